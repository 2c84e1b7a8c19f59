"""Invalid RLJob manifests, shared by the unit tests (pydantic) and the cluster tests (apiserver).

Role: one table of mistakes a user makes, each a small edit of `examples/tiny-cpu.yaml` with the
field path the error must name. `tests/unit/test_api.py` checks that `RLJob.model_validate`
refuses each one, and `tests/integration/test_api_cluster.py` that `kubectl apply` does, so the
Python mirror of the schema and CEL rules cannot drift from what the apiserver enforces.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLES_DIR = REPO_ROOT / "examples"
TINY_EXAMPLE = EXAMPLES_DIR / "tiny-cpu.yaml"

_DELETE = object()


@dataclasses.dataclass(frozen=True)
class InvalidCase:
    """`edits` maps dotted paths under the manifest (list indexes as numbers) to new values."""

    id: str
    edits: dict[str, Any]
    field: str  # the field path the error must name, as the apiserver writes it
    message: str = ""  # a phrase of the rule's message that must appear too (CEL rules)
    python: bool = True  # whether the pydantic models can see the mistake (metadata is not modelled)

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(manifest)
        for dotted, value in self.edits.items():
            *parents, last = dotted.split(".")
            node: Any = out
            for key in parents:
                node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
            if value is _DELETE:
                del node[last]
            elif isinstance(node, list):
                node[int(last)] = value
            else:
                node[last] = value
        return out


DELETE = _DELETE
# A judge model as a test writes one (a tiny model built from an inline config).
_JUDGE_MODEL = {
    "name": "tiny-judge",
    "source": {"tiny": {}},
    "config": {"inline": {"model_type": "qwen2", "vocab_size": 128}},
}

INVALID_CASES: list[InvalidCase] = [
    # wrong types
    InvalidCase("type-groupSize-string", {"spec.grpo.groupSize": "eight"}, "spec.grpo.groupSize"),
    InvalidCase(
        "type-total-quoted-number",
        {"spec.resources.totalAccelerators": "2"},
        "spec.resources.totalAccelerators",
    ),
    InvalidCase("type-dpBalance-string", {"spec.batching.dpBalance": "yes"}, "spec.batching.dpBalance"),
    InvalidCase(
        "type-tolerations-object",
        {"spec.trainerPool.tolerations": {"key": "x"}},
        "spec.trainerPool.tolerations",
    ),
    # out of range, patterns, quantities
    InvalidCase("range-groupSize-1", {"spec.grpo.groupSize": 1}, "spec.grpo.groupSize"),
    InvalidCase(
        "range-gpuMemoryUtilization",
        {"spec.resources.rollout.gpuMemoryUtilization": 1.5},
        "spec.resources.rollout.gpuMemoryUtilization",
    ),
    InvalidCase("range-topP-zero", {"spec.grpo.topP": 0}, "spec.grpo.topP"),
    InvalidCase("range-learningRate-negative", {"spec.grpo.learningRate": -1.0e-5}, "spec.grpo.learningRate"),
    InvalidCase(
        "pattern-claimName",
        {"spec.checkpoint.volume": {"claimName": "Bad_Name"}},
        "spec.checkpoint.volume.claimName",
    ),
    InvalidCase("quantity-memory", {"spec.resources.memory": "lots"}, "spec.resources.memory"),
    # unknown enum values
    InvalidCase("enum-mode", {"spec.resources.mode": "elastic"}, "spec.resources.mode"),
    InvalidCase("enum-packing", {"spec.batching.packing": "zip"}, "spec.batching.packing"),
    InvalidCase(
        "enum-accelerator-kind", {"spec.resources.accelerator.kind": "tpu"}, "spec.resources.accelerator.kind"
    ),
    InvalidCase(
        "enum-builtin-dataset", {"spec.data.source.builtin.name": "mnist"}, "spec.data.source.builtin.name"
    ),
    InvalidCase(
        "enum-reward-name", {"spec.reward.functions.0.name": "bleu"}, "spec.reward.functions[0].name"
    ),
    # missing required fields
    InvalidCase("required-model", {"spec.model": DELETE}, "spec.model"),
    InvalidCase(
        "required-totalAccelerators",
        {"spec.resources.totalAccelerators": DELETE},
        "spec.resources.totalAccelerators",
    ),
    InvalidCase("required-model-name", {"spec.model.name": DELETE}, "spec.model.name"),
    # unknown fields (kubectl's strict field validation names them; pydantic forbids extras)
    InvalidCase("unknown-field-typo", {"spec.grpo.groupsize": 8}, "spec.grpo.groupsize"),
    # every CEL rule
    InvalidCase(
        "cel-lengths-fit-maxModelLen",
        {"spec.lengths.maxModelLen": 16},
        "spec.lengths.maxModelLen",
        "at least maxPromptTokens + maxCompletionTokens",
    ),
    InvalidCase(
        "cel-static-needs-split",
        {"spec.resources.static": DELETE},
        "spec.resources.static",
        "required when mode is static",
    ),
    InvalidCase(
        "cel-per-node-divides-total",
        {
            "spec.resources.acceleratorsPerNode": 3,
            "spec.resources.totalAccelerators": 4,
            "spec.resources.static.trainerAccelerators": 4,
        },
        "spec.resources.acceleratorsPerNode",
        "must divide totalAccelerators",
    ),
    InvalidCase(
        "cel-tp-divides-per-node",
        {"spec.resources.rollout": {"tensorParallel": 2}},
        "spec.resources.rollout.tensorParallel",
        "must divide acceleratorsPerNode",
    ),
    InvalidCase(
        "cel-static-sum-within-total",
        {"spec.resources.static.rolloutAccelerators": 1},
        "spec.resources.static",
        "must not exceed totalAccelerators",
    ),
    InvalidCase(
        "cel-static-rollout-multiple-of-tp",
        {
            "spec.resources.totalAccelerators": 4,
            "spec.resources.acceleratorsPerNode": 2,
            "spec.resources.rollout": {"tensorParallel": 2},
            "spec.resources.static": {"trainerAccelerators": 2, "rolloutAccelerators": 1},
        },
        "spec.resources.static.rolloutAccelerators",
        "multiple of rollout.tensorParallel",
    ),
    InvalidCase(
        "cel-batched-tokens-at-least-seqs",
        {"spec.resources.rollout": {"maxNumSeqs": 64, "maxNumBatchedTokens": 32}},
        "spec.resources.rollout.maxNumBatchedTokens",
        "at least maxNumSeqs",
    ),
    InvalidCase(
        "cel-model-source-exactly-one",
        {"spec.model.source.hub": {"id": "Qwen/Qwen3-4B"}},
        "spec.model.source",
        "exactly one of pvc, hub or tiny",
    ),
    InvalidCase(
        "cel-model-config-exactly-one",
        {"spec.model.config.preset": "Qwen/Qwen3-4B"},
        "spec.model.config",
        "exactly one of preset, inline or configMapRef",
    ),
    InvalidCase(
        "cel-data-source-exactly-one",
        {"spec.data.source": {}},
        "spec.data.source",
        "exactly one of builtin, pvc, hub, configMapRef or reasoningGym",
    ),
    InvalidCase(
        "cel-dynamic-needs-token-budget",
        {"spec.batching.maxTokensPerMicroBatch": DELETE},
        "spec.batching.maxTokensPerMicroBatch",
        "required when microBatching is dynamic",
    ),
    InvalidCase(
        "cel-token-budget-fits-a-sample",
        {"spec.batching.maxTokensPerMicroBatch": 16},
        "spec.batching.maxTokensPerMicroBatch",
        "longest sample must fit",
    ),
    InvalidCase(
        "cel-lora-rank-vllm-can-serve",
        {
            "spec.resources.accelerator": {"kind": "nvidia", "model": "H100-80GB"},
            "spec.model.finetune": {"mode": "lora", "lora": {"rank": 513}},
        },
        "spec.model.finetune.lora.rank",
        "cannot be served by vLLM engines",
    ),
    InvalidCase(
        "cel-cpu-vllm-head-size",
        {"spec.model.config.inline.head_dim": 16, "spec.resources.rollout": {"kind": "vllm"}},
        "spec.model.config.inline.head_dim",
        "head size vLLM's CPU attention cannot run",
    ),
    InvalidCase(
        "cel-reward-module-required",
        {"spec.reward.functions.0": {"name": "module"}},
        "spec.reward.functions[0].module",
        "required when name is module",
    ),
    InvalidCase(
        "cel-reward-module-path-or-import",
        {"spec.reward.functions.0": {"name": "module", "module": {"path": "/r.py", "importPath": "r"}}},
        "spec.reward.functions[0].module",
        "exactly one of path, importPath, configMapRef or pvc",
    ),
    InvalidCase(
        "cel-mini-batches-divide-the-step",
        {"spec.grpo.miniBatchesPerStep": 3, "spec.grpo.promptsPerStep": 4, "spec.grpo.groupSize": 4},
        "spec.grpo.miniBatchesPerStep",
        "must divide promptsPerStep x groupSize",
    ),
    InvalidCase(
        "cel-gspo-needs-sequence-mean",
        {"spec.grpo.policyLoss": "gspo", "spec.grpo.lossNormalization": "tokenMean"},
        "spec.grpo.lossNormalization",
        "gspo optimises a mean over sequences",
    ),
    InvalidCase(
        "cel-rollout-correction-is-bounds",
        {"spec.grpo.rolloutCorrection": {"importanceSampling": {"mode": "mask", "lower": 3.0, "upper": 2.0}}},
        "spec.grpo.rolloutCorrection.importanceSampling.lower",
        "importanceSampling.lower must be at most upper",
    ),
    InvalidCase(
        "cel-rollout-correction-lower-needs-mask",
        {"spec.grpo.rolloutCorrection": {"importanceSampling": {"mode": "truncate", "lower": 0.5}}},
        "spec.grpo.rolloutCorrection.importanceSampling.lower",
        "lower bounds mode mask only",
    ),
    InvalidCase(
        "cel-rollout-correction-rejection-bounds",
        {"spec.grpo.rolloutCorrection": {"rejection": {"level": "geometric", "lower": 1.5, "upper": 1.01}}},
        "spec.grpo.rolloutCorrection.rejection.lower",
        "rejection.lower must be at most upper",
    ),
    InvalidCase(
        "cel-float16-refused",
        {"spec.model.dtype": "float16"},
        "spec.model.dtype",
        "float16 is not supported for training",
    ),
    InvalidCase(
        "pattern-mlflow-file-uri",
        {"spec.tracking.mlflow": {"trackingUri": "file:///tmp/mlruns"}},
        "spec.tracking.mlflow.trackingUri",
    ),
    InvalidCase(
        "range-clip-ratio-c",
        {"spec.grpo.clipRatioC": 1.0},
        "spec.grpo.clipRatioC",
    ),
    InvalidCase(
        "cel-adaptive-scale-up-after-wake",
        {
            "spec.resources.adaptive": {
                "wakeAfterPressuredSyncPoints": 5,
                "scaleUpAfterPressuredSyncPoints": 4,
            }
        },
        "spec.resources.adaptive.scaleUpAfterPressuredSyncPoints",
        "at least wakeAfterPressuredSyncPoints",
    ),
    InvalidCase(
        "cel-accelerator-model-required",
        {"spec.resources.accelerator.kind": "nvidia"},
        "spec.resources.accelerator.model",
        "required unless kind is cpu",
    ),
    InvalidCase(
        "cel-checkpoint-volume-exactly-one",
        {"spec.checkpoint.volume": {"claimName": "ckpt", "emptyDir": {}}},
        "spec.checkpoint.volume",
        "exactly one of claimName or emptyDir",
    ),
    InvalidCase(
        "cel-backoff-max-at-least-initial",
        {"spec.restartPolicy.initialBackoffSeconds": 600, "spec.restartPolicy.maxBackoffSeconds": 60},
        "spec.restartPolicy.maxBackoffSeconds",
        "at least initialBackoffSeconds",
    ),
    InvalidCase(
        "cel-toleration-key-required",
        {"spec.trainerPool.tolerations": [{"operator": "Equal", "value": "x"}]},
        "spec.trainerPool.tolerations[0].key",
        "key is required unless operator is Exists",
    ),
    InvalidCase(
        "cel-toleration-exists-without-value",
        {"spec.rolloutPool.tolerations": [{"key": "k", "operator": "Exists", "value": "x"}]},
        "spec.rolloutPool.tolerations[0].value",
        "value must be empty when operator is Exists",
    ),
    InvalidCase(
        "cel-toleration-seconds-need-no-execute",
        {"spec.trainerPool.tolerations": [{"key": "k", "effect": "NoSchedule", "tolerationSeconds": 30}]},
        "spec.trainerPool.tolerations[0].tolerationSeconds",
        "allowed only with effect NoExecute",
    ),
    InvalidCase(
        "range-reasoning-gym-config-fields",
        {
            "spec.data.source": {
                "reasoningGym": {"task": "chain_sum", "config": {f"f{i}": i for i in range(33)}}
            }
        },
        "spec.data.source.reasoningGym.config",
    ),
    # agents: spec.rollout.agent, spec.environments, spec.reward.judge (docs/agents.md)
    InvalidCase(
        "cel-agent-tool-names-unique",
        {"spec.rollout": {"agent": {"tools": [{"name": "calc", "kind": "calculator"}] * 2}}},
        "spec.rollout.agent.tools",
        "name must be unique",
    ),
    InvalidCase(
        "cel-agent-http-tool-needs-url",
        {"spec.rollout": {"agent": {"tools": [{"name": "search", "kind": "http"}]}}},
        "spec.rollout.agent.tools[0].url",
        "url is required for kind http",
    ),
    InvalidCase(
        "cel-agent-parameters-only-http",
        {"spec.rollout": {"agent": {"tools": [{"name": "calc", "kind": "calculator", "parameters": {}}]}}},
        "spec.rollout.agent.tools[0].parameters",
        "parameters is for kind http",
    ),
    InvalidCase(
        "cel-agent-total-tokens-within-completion",
        {"spec.rollout": {"agent": {"maxTotalTokens": 100000}}},
        "spec.rollout.agent.maxTotalTokens",
        "at most spec.lengths.maxCompletionTokens",
    ),
    InvalidCase(
        "cel-agent-environment-named",
        {"spec.rollout": {"agent": {"environment": "arith"}}, "spec.environments": [{"name": "other"}]},
        "spec.rollout.agent.environment",
        "must name an entry of spec.environments",
    ),
    InvalidCase(
        "cel-agent-mode-environment-without-tools",
        {
            "spec.rollout": {
                "agent": {"environment": "web", "tools": [{"name": "calc", "kind": "calculator"}]}
            },
            "spec.environments": [{"name": "web", "mode": "agent"}],
        },
        "spec.rollout.agent.tools",
        "runs its own agent, which offers its own tools",
    ),
    InvalidCase(
        "cel-agent-demonstrations-end-with-an-answer",
        {
            "spec.rollout": {
                "agent": {
                    "demonstrations": [
                        {"role": "user", "content": "What is 12 + 7?"},
                        {"role": "assistant", "content": "<tool_call>...</tool_call>"},
                        {"role": "tool", "name": "calc", "content": "19"},
                    ]
                }
            }
        },
        "spec.rollout.agent.demonstrations",
        "must start with a user message (a task) and end with an assistant message",
    ),
    InvalidCase(
        "enum-agent-demonstration-role",
        {"spec.rollout": {"agent": {"demonstrations": [{"role": "system", "content": "Be brief."}]}}},
        "spec.rollout.agent.demonstrations[0].role",
    ),
    InvalidCase(
        "cel-agent-mode-environment-without-demonstrations",
        {
            "spec.rollout": {
                "agent": {
                    "environment": "web",
                    "demonstrations": [
                        {"role": "user", "content": "What is 12 + 7?"},
                        {"role": "assistant", "content": "19"},
                    ],
                }
            },
            "spec.environments": [{"name": "web", "mode": "agent"}],
        },
        "spec.rollout.agent.demonstrations",
        "its own agent writes every prompt",
    ),
    InvalidCase(
        "range-environment-port-privileged",
        {"spec.environments": [{"name": "arith", "port": 80}]},
        "spec.environments[0].port",
    ),
    InvalidCase(
        "pattern-environment-name",
        {"spec.environments": [{"name": "Arith_1"}]},
        "spec.environments[0].name",
    ),
    InvalidCase(
        "cel-environment-env-exactly-one",
        {"spec.environments": [{"name": "arith", "env": [{"name": "K"}]}]},
        "spec.environments[0].env[0]",
        "exactly one of value or secretKeyRef",
    ),
    InvalidCase(
        "cel-environment-task-or-task-config",
        {"spec.environments": [{"name": "arith", "task": "easy", "taskConfig": {"steps": 2}}]},
        "spec.environments[0].taskConfig",
        "at most one of task",
    ),
    InvalidCase(
        "cel-environment-own-image-needs-command",
        {"spec.environments": [{"name": "arith", "image": "example.com/env:1"}]},
        "spec.environments[0].command",
        "command is required with an image of your own",
    ),
    InvalidCase(
        "cel-judge-llm-needs-template",
        {"spec.reward.judge": {"model": _JUDGE_MODEL}},
        "spec.reward.judge.promptTemplate",
        "promptTemplate is required for kind llm",
    ),
    InvalidCase(
        "cel-judge-template-has-response",
        {"spec.reward.judge": {"model": _JUDGE_MODEL, "promptTemplate": "Rate {prompt} from 0 to 10."}},
        "spec.reward.judge.promptTemplate",
        "must contain {response}",
    ),
    InvalidCase(
        "cel-judge-reward-model-no-template",
        {
            "spec.reward.judge": {
                "kind": "rewardModel",
                "model": _JUDGE_MODEL,
                "promptTemplate": "Rate {response}.",
            }
        },
        "spec.reward.judge.promptTemplate",
        "promptTemplate is for kind llm",
    ),
    InvalidCase(
        "cel-judge-tensor-parallel-divides-node",
        {
            "spec.reward.judge": {
                "model": _JUDGE_MODEL,
                "promptTemplate": "Rate {response}.",
                "tensorParallel": 3,
            },
            "spec.resources.acceleratorsPerNode": 2,
            "spec.resources.totalAccelerators": 2,
        },
        "spec.reward.judge.tensorParallel",
        "must divide spec.resources.acceleratorsPerNode",
    ),
    InvalidCase(
        "cel-metadata-name-length",
        {"metadata.name": "a-very-long-rljob-name-that-leaves-no-room-for-pod-suffixes"},
        "metadata.name",
        "at most",
        python=False,
    ),
]

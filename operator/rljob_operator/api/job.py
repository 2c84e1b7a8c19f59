"""The job-level parts of the spec (node pools, image, checkpoint, restart policy, export, tracking,
preemption), `RLJobSpec` with its cross-part rules, and the whole `RLJob` object."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from rljob_operator.api.agents import MAX_ENVIRONMENTS, EnvironmentSpec, RolloutLoopSpec
from rljob_operator.api.base import (
    API_VERSION,
    DEFAULT_TRAINER_IMAGE,
    KIND,
    CelRule,
    ObjectName,
    PullPolicy,
    Quantity,
    RestartPolicyName,
    TaintEffect,
    TolerationOperator,
    _count,
    _Model,
    _Spec,
)
from rljob_operator.api.data import DataSpec, RewardSpec
from rljob_operator.api.grpo import BatchingSpec, GRPOSpec, LengthsSpec
from rljob_operator.api.model import ModelSpec, SecretKeyRef
from rljob_operator.api.resources import VLLM_CPU_ATTENTION_HEAD_SIZES, VLLM_MAX_LORA_RANK, ResourcesSpec
from rljob_operator.api.status import RLJobStatus


# --------------------------------------------------------------------------------------------
# spec.trainerPool / rolloutPool, image, checkpoint, restartPolicy
# --------------------------------------------------------------------------------------------
class Toleration(_Spec):
    """A Kubernetes pod toleration (same fields and rules as core/v1 Toleration)."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="has(self.key) || self.operator == 'Exists'",
            message="tolerations[].key is required unless operator is Exists (an empty key with Exists "
            "tolerates every taint)",
            field_path=".key",
            reason="FieldValueRequired",
            check=lambda s: s.key is not None or s.operator == "Exists",
        ),
        CelRule(
            rule="self.operator != 'Exists' || !has(self.value)",
            message="tolerations[].value must be empty when operator is Exists",
            field_path=".value",
            reason="FieldValueForbidden",
            check=lambda s: s.operator != "Exists" or s.value is None,
        ),
        CelRule(
            rule="!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
            message="tolerations[].tolerationSeconds is allowed only with effect NoExecute",
            field_path=".tolerationSeconds",
            check=lambda s: s.toleration_seconds is None or s.effect == "NoExecute",
        ),
    )

    key: str | None = Field(
        None, max_length=317, description="Taint key to tolerate; empty with operator Exists matches all."
    )
    operator: TolerationOperator = Field("Equal", description="Exists or Equal.")
    value: str | None = Field(None, max_length=63, description="Taint value to match when operator is Equal.")
    effect: TaintEffect | None = Field(None, description="Taint effect to match; empty matches all effects.")
    toleration_seconds: int | None = Field(
        None, description="For NoExecute: seconds the pod stays bound after the taint appears."
    )


class NodePoolSpec(_Spec):
    """Where a role's pods schedule."""

    node_selector: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict, description="Node labels the pods require, for example accelerator: h200."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=32,
        description="Taints the pods tolerate (accelerator pools are often tainted).",
    )
    priority_class_name: ObjectName | None = Field(None, description="PriorityClass of the pods.")


class ImageSpec(_Spec):
    """Container images."""

    trainer: str = Field(
        DEFAULT_TRAINER_IMAGE,
        min_length=1,
        max_length=512,
        description="Image of trainer and rollout pods (ships rljob_trainer, torch, Ray and vLLM for GPUs).",
    )
    pull_policy: PullPolicy = Field("IfNotPresent", description="Always, IfNotPresent or Never.")
    pull_secrets: list[ObjectName] = Field(
        default_factory=list,
        max_length=16,
        description="Names of image pull Secrets in the RLJob's namespace.",
    )


class EmptyDirVolume(_Spec):
    """A scratch volume that lives as long as the pod."""

    size_limit: Quantity | None = Field(None, description="Most space the volume may use, for example 50Gi.")


class CheckpointVolume(_Spec):
    """Where checkpoints are stored. Set exactly one of claimName or emptyDir."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="has(self.claimName) != has(self.emptyDir)",
            message="spec.checkpoint.volume: set exactly one of claimName or emptyDir",
            check=lambda s: _count(s.claim_name, s.empty_dir) == 1,
        ),
    )

    claim_name: ObjectName | None = Field(
        None, description="PersistentVolumeClaim for checkpoints (survives pod restarts; needed to resume)."
    )
    empty_dir: EmptyDirVolume | None = Field(None, description="Pod-local scratch space (lost with the pod).")


class CheckpointSpec(_Spec):
    """Checkpointing."""

    volume: CheckpointVolume = Field(
        default_factory=lambda: CheckpointVolume(empty_dir=EmptyDirVolume()),
        description="Volume for checkpoints. Default: an emptyDir.",
    )
    path: str = Field(
        "/checkpoints",
        min_length=1,
        max_length=1024,
        pattern=r"^/",
        description="Absolute mount path in the trainer pods.",
    )
    interval_steps: int = Field(
        50,
        ge=0,
        le=10_000_000,
        description="Save every intervalSteps optimizer steps; 0 saves only at the end.",
    )


class RestartPolicySpec(_Spec):
    """What happens when a pod of the job fails."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="self.maxBackoffSeconds >= self.initialBackoffSeconds",
            message="spec.restartPolicy.maxBackoffSeconds must be at least initialBackoffSeconds",
            field_path=".maxBackoffSeconds",
            check=lambda s: s.max_backoff_seconds >= s.initial_backoff_seconds,
        ),
    )

    policy: RestartPolicyName = Field(
        "OnFailure",
        description="Never fails the job on the first pod failure; OnFailure restarts from the last "
        "checkpoint.",
    )
    backoff_limit: int = Field(3, ge=0, le=1000, description="Restarts before the job fails.")
    initial_backoff_seconds: int = Field(
        10, ge=0, le=86400, description="Delay before the first restart; doubles each time."
    )
    max_backoff_seconds: int = Field(300, ge=0, le=86400, description="Upper bound of the restart delay.")


# --------------------------------------------------------------------------------------------
# spec.export, spec.tracking: what a run leaves behind and where its curves go
# --------------------------------------------------------------------------------------------
_POOL_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class ExportSpec(_Spec):
    """Hugging Face exports under <checkpoint.path>/hf (servable by transformers, peft and vLLM)."""

    every_checkpoint: bool = Field(
        True, description="Also export <checkpoint.path>/hf/step-<N> at every checkpoint."
    )
    final: bool = Field(True, description="Export <checkpoint.path>/hf/final when the run ends.")
    merge_lora: bool = Field(
        True,
        description="With LoRA, write the merged model under merged/ next to the PEFT adapter (the adapter "
        "is always written).",
    )


class WandbTrackingSpec(_Spec):
    """Weights & Biases run settings."""

    project: str = Field(min_length=1, max_length=128, description="W&B project.")
    entity: str | None = Field(None, min_length=1, max_length=128, description="W&B team or user.")
    run_name: str | None = Field(
        None, min_length=1, max_length=128, description="Run name. Default: the RLJob's name."
    )
    mode: Literal["online", "offline"] = Field(
        "online", description="offline keeps the run under the checkpoint volume for `wandb sync`."
    )
    api_key_secret_ref: SecretKeyRef | None = Field(
        None, description="Secret key holding the W&B API key (becomes WANDB_API_KEY in the trainer pods)."
    )


class MlflowTrackingSpec(_Spec):
    """MLflow run settings."""

    tracking_uri: str = Field(
        min_length=1,
        max_length=2048,
        pattern=r"^https?://",
        description="MLflow tracking server: http://... or https://... (an `mlflow server`). The trainer "
        "image's MLflow (mlflow-skinny 3.x) has no SQL store, and MLflow 3 refuses new file: stores.",
    )
    experiment: str = Field("rljob", min_length=1, max_length=256, description="Experiment name.")
    run_name: str | None = Field(
        None, min_length=1, max_length=256, description="Run name. Default: the RLJob's name."
    )
    token_secret_ref: SecretKeyRef | None = Field(
        None, description="Secret key holding a tracking token (becomes MLFLOW_TRACKING_TOKEN)."
    )


class EvaluationSamplingSpec(_Spec):
    """How held-out prompts are sampled: greedy, one completion per prompt, by default."""

    temperature: float = Field(0.0, ge=0.0, le=10.0, description="0 is greedy decoding (the default).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (with temperature > 0).")
    samples_per_prompt: int = Field(1, ge=1, le=64, description="Completions per held-out prompt.")


class EvaluationSpec(_Spec):
    """Held-out evaluation on the rollout engines between training steps (verl's test_freq)."""

    data: DataSpec = Field(
        description="Held-out prompts and answers, the same shape as spec.data. A pvc or configMapRef source "
        "must be spec.data's own claim or ConfigMap (the one the trainer pods mount)."
    )
    every_steps: int = Field(10, ge=1, le=10_000_000, description="Evaluate after every this many steps.")
    max_samples: int = Field(
        256, ge=1, le=1_000_000, description="Held-out prompts evaluated (the first ones of the data)."
    )
    sampling: EvaluationSamplingSpec = Field(
        default_factory=lambda: EvaluationSamplingSpec(), description="Sampling of the held-out prompts."
    )
    before_training: bool = Field(
        True,
        description="Also evaluate the initial weights before the first step (logged as step 0): the "
        "baseline the later evaluations are compared with.",
    )


class TrackingSpec(_Spec):
    """Experiment trackers. TensorBoard event files are always written to <checkpoint.path>/tensorboard."""

    wandb: WandbTrackingSpec | None = Field(None, description="Also log to Weights & Biases.")
    mlflow: MlflowTrackingSpec | None = Field(None, description="Also log to MLflow.")


# --------------------------------------------------------------------------------------------
# Shared clusters: spec.preemption (the Kueue labels on an RLJob's metadata: names.kueue_queue_name)
# --------------------------------------------------------------------------------------------
class PreemptionSpec(_Spec):
    """What happens when Kueue evicts or preempts the job (cooperative preemption)."""

    checkpoint_grace_seconds: int = Field(
        300,
        ge=0,
        le=86400,
        description="Seconds the driver gets to write a checkpoint after Kueue evicts or preempts the job, "
        "before its pods are deleted; the job resumes from that checkpoint when readmitted. 0 deletes the "
        "pods at once (the job resumes from its last periodic checkpoint).",
    )


# --------------------------------------------------------------------------------------------
# The spec
# --------------------------------------------------------------------------------------------
_INLINE = "self.model.config.inline"
_CPU_HEAD_SIZES_CEL = "[" + ", ".join(map(str, VLLM_CPU_ATTENTION_HEAD_SIZES)) + "]"


def _inline_head_dim_runs_on_vllm_cpu(spec: Any) -> bool:
    """The CEL rule's Python twin: an inline config.json (without text_config) whose explicit head_dim
    vLLM's CPU attention refuses cannot run a vLLM engine on a cpu pool. Every other config (presets,
    ConfigMaps, text_config, head_dim derived from hidden_size) is checked by the planner
    (`decide.planning`, condition UnsupportedHeadSize), which reads the geometry as the estimator does."""
    if spec.resources.accelerator.kind != "cpu" or spec.resources.rollout.kind != "vllm":
        return True
    inline = spec.model.config.inline
    if inline is None or inline.get("text_config") is not None:
        return True
    head_dim = inline.get("head_dim")
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
        return True
    return head_dim in VLLM_CPU_ATTENTION_HEAD_SIZES


def _refused_with_an_agent_mode_environment(field: str, why: str, remove: str) -> CelRule:
    """The rule refusing the list spec.rollout.agent.<field> when the environment the agent names has
    mode agent (its own agent runs the episode, so the trainer's agent settings have nothing to act on)."""
    return CelRule(
        rule="!has(self.rollout.agent) || !has(self.rollout.agent.environment) || "
        f"!has(self.rollout.agent.{field}) || size(self.rollout.agent.{field}) == 0 || "
        "!self.environments.exists(e, e.name == self.rollout.agent.environment && has(e.mode) && "
        "e.mode == 'agent')",
        message=f"spec.rollout.agent.{field}: the environment spec.rollout.agent.environment names has mode "
        f"agent: {why}; remove {remove}, or set the environment's mode to steps",
        field_path=f".rollout.agent.{field}",
        check=lambda s: (
            s.rollout.agent is None
            or s.rollout.agent.environment is None
            or not getattr(s.rollout.agent, field)
            or not any(e.name == s.rollout.agent.environment and e.mode == "agent" for e in s.environments)
        ),
    )


class RLJobSpec(_Spec):
    """Desired state of an RLJob: a GRPO training run with its rollout engines."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.batching.maxTokensPerMicroBatch) || self.batching.maxTokensPerMicroBatch >= "
            "self.lengths.maxPromptTokens + self.lengths.maxCompletionTokens",
            message="spec.batching.maxTokensPerMicroBatch must be at least lengths.maxPromptTokens + "
            "lengths.maxCompletionTokens (the longest sample must fit in one micro-batch)",
            field_path=".batching.maxTokensPerMicroBatch",
            check=lambda s: (
                s.batching.max_tokens_per_micro_batch is None
                or s.batching.max_tokens_per_micro_batch
                >= s.lengths.max_prompt_tokens + s.lengths.max_completion_tokens
            ),
        ),
        CelRule(
            rule="self.resources.rollout.kind != 'vllm' || self.model.finetune.mode != 'lora' || "
            "self.resources.rollout.loraSync != 'adapter' || "
            f"self.model.finetune.lora.rank <= {VLLM_MAX_LORA_RANK}",
            message=f"spec.model.finetune.lora.rank above {VLLM_MAX_LORA_RANK} cannot be served by vLLM "
            "engines (vLLM's largest max_lora_rank); lower the rank or set spec.resources.rollout.loraSync "
            "to merged",
            field_path=".model.finetune.lora.rank",
            check=lambda s: (
                s.resources.rollout.kind != "vllm"
                or s.model.finetune.mode != "lora"
                or s.resources.rollout.lora_sync != "adapter"
                or s.model.finetune.lora.rank <= VLLM_MAX_LORA_RANK
            ),
        ),
        CelRule(
            rule="self.resources.accelerator.kind != 'cpu' || self.resources.rollout.kind != 'vllm' || "
            f"!has({_INLINE}) || has({_INLINE}.text_config) || !has({_INLINE}.head_dim) || "
            f"{_INLINE}.head_dim <= 0 || {_INLINE}.head_dim in {_CPU_HEAD_SIZES_CEL}",
            message="spec.model.config.inline.head_dim is a head size vLLM's CPU attention cannot run (it "
            "takes " + ", ".join(map(str, VLLM_CPU_ATTENTION_HEAD_SIZES)) + "), and accelerator.kind cpu "
            "with spec.resources.rollout.kind vllm runs vLLM's CPU build: use a model with one of those "
            "head sizes, or set spec.resources.rollout.kind to transformers",
            field_path=".model.config.inline.head_dim",
            check=_inline_head_dim_runs_on_vllm_cpu,
        ),
        CelRule(
            rule="!has(self.rollout.agent) || !has(self.rollout.agent.environment) || "
            "self.environments.exists(e, e.name == self.rollout.agent.environment)",
            message="spec.rollout.agent.environment must name an entry of spec.environments (add the "
            "environment there, or fix the name)",
            field_path=".rollout.agent.environment",
            check=lambda s: (
                s.rollout.agent is None
                or s.rollout.agent.environment is None
                or any(e.name == s.rollout.agent.environment for e in s.environments)
            ),
        ),
        _refused_with_an_agent_mode_environment(
            "tools",
            "it runs its own agent, which offers its own tools through the job's endpoint",
            "spec.rollout.agent.tools",
        ),
        _refused_with_an_agent_mode_environment(
            "demonstrations",
            "its own agent writes every prompt it sends the job's endpoint, so the trainer has no prompt "
            "to put them in",
            "spec.rollout.agent.demonstrations (show the examples in your agent's own prompt)",
        ),
        CelRule(
            rule="!has(self.rollout.agent) || !has(self.rollout.agent.maxTotalTokens) || "
            "self.rollout.agent.maxTotalTokens <= self.lengths.maxCompletionTokens",
            message="spec.rollout.agent.maxTotalTokens must be at most spec.lengths.maxCompletionTokens: an "
            "episode's turns and tool results share the engines' response budget; raise "
            "maxCompletionTokens or lower maxTotalTokens",
            field_path=".rollout.agent.maxTotalTokens",
            check=lambda s: (
                s.rollout.agent is None
                or s.rollout.agent.max_total_tokens is None
                or s.rollout.agent.max_total_tokens <= s.lengths.max_completion_tokens
            ),
        ),
        CelRule(
            rule="!has(self.reward.judge) || !has(self.reward.judge.tensorParallel) || "
            "self.resources.acceleratorsPerNode % self.reward.judge.tensorParallel == 0",
            message="spec.reward.judge.tensorParallel must divide spec.resources.acceleratorsPerNode (a "
            "judge engine stays on one node)",
            field_path=".reward.judge.tensorParallel",
            check=lambda s: (
                s.reward.judge is None
                or s.reward.judge.tensor_parallel is None
                or s.resources.accelerators_per_node % s.reward.judge.tensor_parallel == 0
            ),
        ),
    )

    model: ModelSpec = Field(description="The policy model: weights, config, dtype and fine-tuning mode.")
    grpo: GRPOSpec = Field(default_factory=GRPOSpec, description="GRPO algorithm settings.")
    lengths: LengthsSpec = Field(
        default_factory=LengthsSpec, description="Prompt, completion and context token limits."
    )
    data: DataSpec = Field(description="Prompts and reference answers.")
    reward: RewardSpec = Field(
        default_factory=RewardSpec, description="Reward functions and weights, and a served judge."
    )
    rollout: RolloutLoopSpec = Field(
        default_factory=RolloutLoopSpec,
        description="How episodes roll out: agent (multi-turn, tool-using episodes). The engines are "
        "spec.resources.rollout.",
    )
    environments: list[EnvironmentSpec] = Field(
        default_factory=list,
        max_length=MAX_ENVIRONMENTS,
        description="Environment servers the operator runs with the job (pods behind a Service each, "
        "inside the job's NetworkPolicy): spec.rollout.agent.environment names the one episodes use. At "
        f"most {MAX_ENVIRONMENTS}, with unique names (a Kueue Workload holds 8 podSets).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    batching: BatchingSpec = Field(default_factory=BatchingSpec, description="Micro-batching and DP balance.")
    resources: ResourcesSpec = Field(description="Accelerators and the trainer/rollout split.")
    trainer_pool: NodePoolSpec = Field(
        default_factory=NodePoolSpec, description="Scheduling of trainer pods."
    )
    rollout_pool: NodePoolSpec = Field(
        default_factory=NodePoolSpec, description="Scheduling of dedicated rollout pods."
    )
    image: ImageSpec = Field(default_factory=ImageSpec, description="Container images.")
    pool: str | None = Field(
        None,
        min_length=1,
        max_length=63,
        pattern=_POOL_NAME,
        description="Node pool of the operator's Helm values (pools.<name>) whose defaults apply: trainer "
        "image, tolerations, nodeSelector, device catalog additions, extra resources. Default: the pool "
        "whose acceleratorKinds include resources.accelerator.kind, else the chart's defaultPool.",
    )
    export: ExportSpec = Field(default_factory=ExportSpec, description="Hugging Face / PEFT exports.")
    evaluation: EvaluationSpec | None = Field(
        None,
        description="Held-out evaluation: metrics eval/mean_reward and eval/reward/<name>, "
        "status.progress.evalReward. Off when unset.",
    )
    tracking: TrackingSpec = Field(
        default_factory=TrackingSpec, description="Experiment trackers (TensorBoard always; W&B, MLflow)."
    )
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec, description="Checkpoint volume and interval."
    )
    restart_policy: RestartPolicySpec = Field(
        default_factory=RestartPolicySpec, description="Restarts after pod failures."
    )
    preemption: PreemptionSpec = Field(
        default_factory=PreemptionSpec,
        description="Cooperative preemption: the checkpoint grace when Kueue evicts or preempts the job.",
    )
    suspend: bool = Field(
        False, description="true deletes the pods and keeps the job (resume from the last checkpoint)."
    )
    ttl_seconds_after_finished: int | None = Field(
        None,
        ge=0,
        le=31_536_000,
        description="Delete the job this many seconds after it succeeds or fails. Default: keep it.",
    )

    @model_validator(mode="after")
    def _unique_environments(self) -> RLJobSpec:
        # The apiserver refuses duplicates itself (x-kubernetes-list-type: map, key name).
        names = [e.name for e in self.environments]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(
                f"spec.environments[].name must be unique: {', '.join(duplicates)} appears more than once"
            )
        return self


# --------------------------------------------------------------------------------------------
# The whole object
# --------------------------------------------------------------------------------------------
class RLJob(_Model):
    """An RLJob object as stored by the apiserver (metadata is kept as a plain dict)."""

    model_config = ConfigDict(extra="ignore")

    api_version: str = Field(API_VERSION, description="rljob.io/v1alpha1.")
    kind: str = Field(KIND, description="RLJob.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Standard object metadata.")
    spec: RLJobSpec = Field(description="Desired state.")
    status: RLJobStatus | None = Field(None, description="Observed state.")


def describe_validation_error(exc: ValidationError, prefix: str = "") -> list[str]:
    """One `path: message` line per error, with paths written like the apiserver's.

    `prefix` is the path of what was validated (`"spec"` when the caller validated a spec alone).
    Example: `spec.reward.functions[0].module: ... required when name is module ...`.
    """
    lines: list[str] = []
    for err in exc.errors():
        path = prefix
        for part in err["loc"]:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        path += (err.get("ctx") or {}).get("field_path", "")
        lines.append(f"{path or '<root>'}: {err['msg']}")
    return lines

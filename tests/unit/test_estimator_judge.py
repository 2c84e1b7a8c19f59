"""The judge's engines sized by the estimator (estimator.judge) from the spec (decide.planning), and
what `rljob plan` prints of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_planning import example_spec

from rljob_operator import api, errors
from rljob_operator import estimator as est
from rljob_operator.cli import commands
from rljob_operator.decide import planning
from rljob_operator.estimator import judge as judge_mod
from rljob_operator.estimator import rollout

TEMPLATE = "Question: {prompt}\nAnswer: {response}\nReference: {answer}\nScore it from 0 to 10."


def gpu_spec(**judge: Any) -> api.RLJobSpec:
    base = example_spec("tiny-cpu.yaml").model_dump(by_alias=True, exclude_none=True)
    base["resources"] = {
        "accelerator": {"kind": "nvidia", "model": "H100-80GB"},
        "totalAccelerators": 8,
        "acceleratorsPerNode": 8,
    }
    base["lengths"] = {"maxPromptTokens": 512, "maxCompletionTokens": 1024}
    base["model"]["config"]["inline"]["max_position_embeddings"] = 4096
    base["batching"] = {**base.get("batching", {}), "maxTokensPerMicroBatch": 4096}
    base["reward"] = {
        "judge": {
            "model": {
                "name": "qwen3-8b",
                "source": {"hub": {"id": "Qwen/Qwen3-8B"}},
                "config": {"preset": "qwen3-8b"},
            },
            "promptTemplate": TEMPLATE,
            **judge,
        }
    }
    return api.RLJobSpec.model_validate(base)


def judge_config(spec: api.RLJobSpec) -> dict[str, Any]:
    source = planning.judge_config_source(spec)
    assert source is not None and source.preset is not None
    return est.load_preset(source.preset)


def test_a_judge_request_is_the_template_the_episode_and_the_judges_answer() -> None:
    spec = gpu_spec(maxTokens=32)
    plan = planning.plan_judge(spec, judge_config(spec))
    assert plan is not None
    template = len(
        TEMPLATE.replace("{prompt}", "").replace("{response}", "").replace("{answer}", "").encode()
    )
    expected = judge_mod.CHAT_TEMPLATE_TOKENS + template + 512 + 1024 + judge_mod.ANSWER_TOKENS + 32
    assert plan.max_model_len == expected
    assert f"judge max_model_len={expected}:" in plan.reasons[1] and "{answer} 256" in plan.reasons[1]
    # Sized with the rollout engine's rules, at that length, on the job's own accelerator.
    model = est.ModelGeometry.from_hf_config(judge_config(spec))
    engine = rollout.size_engine(
        model,
        est.get_device("H100-80GB"),
        plan.tensor_parallel,
        sequence_tokens=expected,
        max_model_len=expected,
        gpu_memory_utilization=0.9,
        sequences_per_step=spec.grpo.prompts_per_step * spec.grpo.group_size,
    )
    assert (plan.max_num_seqs, plan.max_num_batched_tokens, plan.kv_cache_bytes) == (
        engine.max_num_seqs,
        engine.max_num_batched_tokens,
        engine.kv_cache_bytes,
    )
    assert plan.tensor_parallel == 1 and plan.engines == 1 and plan.accelerators == 1
    assert plan.max_num_batched_tokens <= plan.max_model_len  # one prefill, never the whole cache
    assert plan.cpu_kv_cache_bytes > 0  # what a CPU stand-in of the node gives its engine


def test_the_judges_tensor_parallel_and_engines_come_from_the_spec_when_set() -> None:
    spec = gpu_spec(tensorParallel=2, engines=3)
    plan = planning.plan_judge(spec, judge_config(spec))
    assert plan is not None and (plan.tensor_parallel, plan.engines, plan.accelerators) == (2, 3, 6)
    assert "judge tensor_parallel=2: from spec.reward.judge" in plan.reasons
    status = planning.plan_status(planning.plan_job(spec, dict(spec.model.config.inline or {})), plan)
    assert (
        status.judge is not None
        and status.judge.accelerators == 6
        and status.judge.reasons[0].startswith("judge ")
    )


def test_a_judge_request_longer_than_the_judge_model_is_refused_naming_the_field() -> None:
    spec = gpu_spec(promptTemplate="{response}" + "x" * 16000)
    config = {**judge_config(spec), "max_position_embeddings": 4096}
    with pytest.raises(errors.InvalidPlanRequestError, match=r"spec\.reward\.judge: a judge request reaches"):
        planning.plan_judge(spec, config)


def _reward_model_spec(**model: Any) -> api.RLJobSpec:
    """A judge of kind rewardModel: Skywork-Reward's layout (a Llama with a one-label score head)."""
    spec = gpu_spec(kind="rewardModel", promptTemplate=None)
    raw = spec.model_dump(by_alias=True, exclude_none=True)
    raw["reward"]["judge"]["model"] = {
        "name": "skywork-reward-llama-3.1-8b",
        "source": {"hub": {"id": "Skywork/Skywork-Reward-Llama-3.1-8B-v0.2"}},
        "config": {"preset": "qwen3-8b"},
        **model,
    }
    return api.RLJobSpec.model_validate(raw)


def _reward_model_config(**over: Any) -> dict[str, Any]:
    return {
        **judge_config(gpu_spec()),
        "architectures": ["LlamaForSequenceClassification"],
        "id2label": {"0": "LABEL_0"},
        **over,
    }


def test_a_reward_model_asks_for_no_answer_and_no_template() -> None:
    spec = _reward_model_spec()
    request = est.JudgeRequest(
        hf_config=judge_config(spec),
        device=est.get_device("H100-80GB"),
        accelerators_per_node=8,
        engines=1,
        kind="rewardModel",
        max_prompt_tokens=512,
        max_response_tokens=1024,
        responses_per_step=64,
    )
    plan = est.plan_judge(request)
    assert plan.max_model_len == judge_mod.CHAT_TEMPLATE_TOKENS + 512 + 1024 + 1
    assert "score 1" in plan.reasons[1]
    # The job's own plan of it: the same request, sized like a rollout engine's.
    served = planning.plan_judge(spec, _reward_model_config())
    assert served is not None and served.max_model_len == plan.max_model_len
    assert served.tensor_parallel >= 1 and any("judge tensor_parallel" in r for r in served.reasons)


@pytest.mark.parametrize(
    ("config", "why"),
    [
        (
            {"architectures": ["Qwen3ForCausalLM"]},
            r"config\.json names \['Qwen3ForCausalLM'\]: use a reward model",
        ),
        ({"architectures": None}, "names no architectures"),
        ({"id2label": {"0": "bad", "1": "good"}}, "classification head has 2 labels"),
        ({"id2label": None, "num_labels": 3}, "has 3 labels"),
    ],
)
def test_a_reward_model_that_is_not_one_score_head_is_refused_naming_the_field(
    config: dict[str, Any], why: str
) -> None:
    hf = {k: v for k, v in _reward_model_config(**config).items() if v is not None}
    with pytest.raises(errors.InvalidSpecError, match=r"spec\.reward\.judge\.model: .*" + why):
        planning.plan_judge(_reward_model_spec(), hf)


def test_a_tiny_reward_model_is_built_with_one_label_from_a_causal_config() -> None:
    """A tiny judge is built in code: its config's causal architecture does not matter, its labels do."""
    spec = _reward_model_spec(source={"tiny": {}})
    assert planning.plan_judge(spec, judge_config(spec)) is not None
    with pytest.raises(errors.InvalidSpecError, match="has 2 labels"):
        planning.plan_judge(spec, {**judge_config(spec), "num_labels": 2})


def test_a_cpu_judge_with_a_head_size_vllms_cpu_attention_refuses_is_refused() -> None:
    spec = example_spec("tiny-cpu.yaml")
    raw = spec.model_dump(by_alias=True, exclude_none=True)
    bad = {**dict(spec.model.config.inline or {}), "head_dim": 48}
    raw["resources"]["rollout"] = {"kind": "vllm"}
    raw["reward"]["judge"] = {
        "model": {"name": "j", "source": {"tiny": {}}, "config": {"inline": bad}},
        "promptTemplate": "{response}",
    }
    cpu = api.RLJobSpec.model_validate(raw)
    with pytest.raises(errors.UnsupportedHeadSizeError, match=r"spec\.reward\.judge\.model: head_dim 48"):
        planning.plan_judge(cpu, bad)
    assert planning.plan_judge(cpu.model_copy(update={"reward": api.RewardSpec()}), bad) is None


def test_without_its_config_the_judge_is_an_invalid_spec() -> None:
    with pytest.raises(errors.InvalidSpecError, match=r"spec\.reward\.judge\.model\.config"):
        planning.plan_judge(gpu_spec(), None)


def test_rljob_plan_prints_the_judge_in_the_table_and_in_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = gpu_spec()
    doc = {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": "judged"},
        "spec": spec.to_k8s(),
    }
    path = tmp_path / "rljob.yaml"
    path.write_text(json.dumps(doc))
    assert commands.main(["plan", "-f", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\njudge: 1 engine(s) x TP 1 = 1 accelerator(s), maxNumSeqs " in out
    assert "  - judge max_model_len=" in out
    assert commands.main(["plan", "-f", str(path), "-o", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["judge"]["engines"] == 1 and data["judge"]["maxModelLen"] > 1536 and "kvBytesPerToken" in data

"""The spec → estimator adapter (`rljob_operator.decide.planning`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rljob_operator import api, builders, errors
from rljob_operator.decide import planning
from rljob_operator.estimator import EstimatorError

REPO = Path(__file__).resolve().parents[2]


def example_spec(name: str) -> api.RLJobSpec:
    (doc,) = api.load_manifests((REPO / "examples" / name).read_text())
    return api.RLJobSpec.model_validate(doc["spec"])


@pytest.mark.parametrize(
    ("quantity", "expected"),
    [("8Gi", 8 * 2**30), ("512Mi", 512 * 2**20), ("1G", 10**9), (1024, 1024), ("1.5Gi", 3 * 2**29)],
)
def test_quantity_bytes(quantity: int | str, expected: int) -> None:
    assert planning.quantity_bytes(quantity) == expected


def test_quantity_bytes_rejects_cpu_style_units() -> None:
    with pytest.raises(ValueError, match="memory quantity"):
        planning.quantity_bytes("500m")


def test_cpu_job_plans_on_its_pod_memory() -> None:
    spec = example_spec("tiny-cpu.yaml")
    request = planning.plan_request_from_spec(spec, dict(spec.model.config.inline or {}))
    (device,) = request.custom_devices
    assert request.accelerator == device.name == planning.CPU_DEVICE_NAME
    assert device.memory_bytes == planning.quantity_bytes(spec.resources.memory or 0)
    assert request.trainer_accelerators == spec.resources.static.trainer_accelerators  # type: ignore[union-attr]


def test_custom_accelerator_numbers_become_a_catalog_entry() -> None:
    spec = example_spec("qwen3.5-4b-gsm8k-adaptive.yaml")
    custom = spec.resources.accelerator.custom
    assert custom is not None
    request = planning.plan_request_from_spec(spec, {"model_type": "unused"})
    (device,) = request.custom_devices
    assert device.name == spec.resources.accelerator.model
    assert device.memory_bytes == int(custom.memory_gib * 2**30)
    assert device.resource_name == "nvidia.com/gpu"
    assert request.max_model_len == spec.lengths.max_model_len
    assert request.group_size == spec.grpo.group_size


def test_plan_status_carries_the_contract_numbers_and_bounds_the_reasons() -> None:
    spec = example_spec("tiny-cpu.yaml")
    plan = planning.plan_job(spec, dict(spec.model.config.inline or {}))
    many = plan.model_copy(update={"reasons": [f"r{i}" for i in range(500)]})
    status = planning.plan_status(many)
    assert status.kv_bytes_per_token == plan.kv_bytes_per_token
    assert status.max_num_seqs == plan.max_num_seqs and status.trainer_accelerators == 2
    assert len(status.reasons) == planning.MAX_PLAN_REASONS


def test_a_model_that_does_not_fit_raises_the_estimators_error() -> None:
    spec = example_spec("tiny-cpu.yaml")
    huge = {**(spec.model.config.inline or {}), "hidden_size": 16384, "intermediate_size": 65536,
            "num_hidden_layers": 80, "num_attention_heads": 128, "head_dim": 128}  # fmt: skip
    with pytest.raises(EstimatorError) as info:
        planning.plan_job(spec, huge)
    assert info.value.reason == "ModelDoesNotFit"


# ---- the rollout engine on cpu pools: vLLM's CPU build ------------------------------------------
# A tiny model whose head_dim (32) vLLM's CPU attention runs; TINY_16 derives 16 from 64 / 4.
TINY_32 = {
    "model_type": "qwen2",
    "vocab_size": 128,
    "hidden_size": 128,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "torch_dtype": "float32",
}
TINY_16 = {**{k: v for k, v in TINY_32.items() if k != "head_dim"}, "hidden_size": 64}


def cpu_spec(
    model_config: dict[str, object] | None = None,
    *,
    rollout: dict[str, object] | None = None,
    **resources: object,
) -> api.RLJobSpec:
    """A static cpu job of 2 ranks; its config inline when given, else from a ConfigMap."""
    config = {"inline": model_config} if model_config is not None else {"configMapRef": {"name": "tiny"}}
    return api.RLJobSpec.model_validate(
        {
            "model": {"name": "tiny", "source": {"tiny": {}}, "config": config, "finetune": {"mode": "full"}},
            "data": {"source": {"builtin": {"name": "toy-arithmetic"}}},
            "lengths": {"maxPromptTokens": 16, "maxCompletionTokens": 8},
            "grpo": {"groupSize": 8, "promptsPerStep": 16},
            "resources": {
                "accelerator": {"kind": "cpu"},
                "totalAccelerators": 2,
                "acceleratorsPerNode": 1,
                "mode": "static",
                "static": {"trainerAccelerators": 2, "rolloutAccelerators": 0},
                "rollout": rollout or {},
                **resources,
            },
        }
    )


@pytest.mark.parametrize(
    ("config", "where"),
    [
        ({**TINY_32, "head_dim": 16}, "(head_dim of spec.model.config.configMapRef tiny/config.json)"),
        (
            TINY_16,
            "(hidden_size 64 / num_attention_heads 4 of spec.model.config.configMapRef tiny/config.json)",
        ),
        (
            {"model_type": "qwen3_5", "text_config": {**TINY_32, "head_dim": 24}, "torch_dtype": "bfloat16"},
            "(text_config.head_dim of",
        ),
    ],
)
def test_a_head_size_vllms_cpu_attention_refuses_is_refused_naming_the_field_and_both_fixes(
    config: dict[str, object], where: str
) -> None:
    spec = cpu_spec()  # a ConfigMap's config: only the planner can read it
    for planned in (planning.plan_job, planning.plan_request_from_spec, planning.refit_job):
        with pytest.raises(errors.UnsupportedHeadSizeError) as info:
            planned(spec, config) if planned is not planning.refit_job else planned(spec, config, [])
        err = info.value
        assert err.reason == "UnsupportedHeadSize" and not err.retryable and err.field == "spec.model"
        head_dim = config.get("head_dim") or (config.get("text_config") or {}).get("head_dim") or 16  # type: ignore[union-attr]
        assert err.message.startswith(f"head_dim {head_dim} {where}")
        assert "32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512" in err.message
        assert (
            "spec.resources.rollout.kind to transformers" in err.message and "a model with one" in err.message
        )


def test_the_head_size_rule_is_vllms_on_cpu_only() -> None:
    # The transformers engine runs any head size; accelerator pools run vLLM's own kernels; a
    # supported size plans; MLA models use vLLM's CPU MLA backends, not the CPU attention list.
    planning.plan_job(cpu_spec(rollout={"kind": "transformers"}), TINY_16)
    planning.plan_job(cpu_spec(), TINY_32)
    mla = {**TINY_32, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 8, "v_head_dim": 16}
    planning.check_rollout_engine(cpu_spec(), mla)
    gpu = example_spec("qwen3.5-4b-gsm8k-adaptive.yaml")
    planning.check_rollout_engine(gpu, TINY_16)


def test_every_head_size_the_cel_rule_refuses_the_planner_refuses_too() -> None:
    """The CEL rule (kubectl apply) sees only an inline config's explicit head_dim; whatever it refuses,
    the planner (which reads the geometry as the estimator does) refuses too, so the two never disagree
    on a job the apiserver accepts."""
    (rule,) = [r for r in api.RLJobSpec.cel_rules if "head_dim" in r.rule]
    for head_dim in range(1, 600):
        config = {**TINY_32, "head_dim": head_dim}
        spec = api.RLJobSpec.model_construct(**dict(cpu_spec(TINY_32)))
        spec = spec.model_copy(
            update={
                "model": spec.model.model_copy(
                    update={"config": api.ModelConfigSource.model_construct(inline=config)}
                )
            }
        )
        if rule.check(spec):
            continue
        with pytest.raises(errors.UnsupportedHeadSizeError):
            planning.check_rollout_engine(spec, config)


def test_a_cpu_jobs_plan_says_where_its_kv_bytes_come_from_and_caps_them_at_what_is_used() -> None:
    spec = cpu_spec(TINY_32, memory="4Gi")
    plan = planning.plan_job(spec, TINY_32)
    status = planning.plan_status(plan)
    assert plan.reasons[0].startswith(
        "cpu pool: the engine is planned on a nominal CPU device of 4.00 GiB = spec.resources.memory 4Gi"
    )
    assert "rollout.cpuKvCacheBytes" in plan.reasons[0]
    # vLLM's CPU backend: 128-token blocks, one per sequence of 16 + 8 tokens, 2 layers x 2 KV heads x
    # 32 x K and V in the job's bfloat16 per token; 16 x 8 sequences and vLLM's null block.
    block_bytes = 128 * 2 * (2 * 2 * 32 * 2)
    assert plan.block_size_tokens == 128 and plan.max_num_seqs == 128
    assert plan.kv_cache_bytes == plan.cpu_kv_cache_bytes == (128 + 1) * block_bytes
    assert status.kv_cache_bytes == status.cpu_kv_cache_bytes == plan.kv_cache_bytes
    assert any(r.startswith("KV cache on CPU") and "max_num_seqs 128" in r for r in plan.reasons)
    # The room beside vLLM's CPU engine processes (2 GiB measured) is larger; it stays with the pod.
    room = next(r for r in plan.reasons if r.startswith("KV cache room"))
    assert "cpu 4.00 GiB x 0.9" in room and "vLLM CPU engine processes 2.00" in room
    cfg = builders.render_trainer_config(spec, status, TINY_32)
    assert cfg.rollout.kind == "vllm" and cfg.rollout.cpu_kv_cache_bytes == plan.kv_cache_bytes


@pytest.mark.parametrize(("engine", "gib"), [("vllm", 6), ("transformers", 2)])
def test_a_cpu_job_without_memory_plans_on_the_engines_default_and_a_pod_shares_it(
    engine: str, gib: int
) -> None:
    spec = cpu_spec(TINY_32, rollout={"kind": engine})
    (device,) = planning.plan_request_from_spec(spec, TINY_32).custom_devices
    assert device.memory_bytes == gib << 30 == planning.quantity_bytes(api.CPU_POD_MEMORY_DEFAULTS[engine])
    plan = planning.plan_job(spec, TINY_32)
    assert (
        f"spec.resources.memory unset: {gib}Gi, the default of a cpu job with rollout.kind {engine}"
        in (plan.reasons[0])
    )
    # Two workers in a pod of 8Gi: each plans in half of it.
    two = cpu_spec(TINY_32, memory="8Gi", acceleratorsPerNode=2)
    (device,) = planning.plan_request_from_spec(two, TINY_32).custom_devices
    assert device.memory_bytes == 4 << 30
    assert "spec.resources.memory 8Gi / acceleratorsPerNode 2" in planning.plan_job(two, TINY_32).reasons[0]


def test_a_cpu_pod_too_small_for_vllms_engine_says_so_and_how_to_fix_it() -> None:
    spec = cpu_spec(TINY_32, memory="2Gi")
    with pytest.raises(EstimatorError) as info:
        planning.plan_job(spec, TINY_32)
    assert info.value.reason == "ModelDoesNotFit"
    assert "2.00 GiB runtime" in info.value.message and "spec.resources.memory" in info.value.message
    # The transformers engine runs inside the trainer's processes: 2Gi holds it.
    planning.plan_job(cpu_spec(TINY_32, memory="2Gi", rollout={"kind": "transformers"}), TINY_32)


def test_an_accelerator_jobs_cpu_kv_bytes_hold_max_num_seqs_sequences_in_cpu_blocks() -> None:
    """What the local cluster's CPU stand-in of a GPU node gives its vLLM engine: the plan's
    maxNumSeqs sequences of prompt + completion in vLLM's 128-token CPU blocks (and the null block),
    at least kvBytesPerToken x tokens plus the linear-attention state per sequence."""
    for name in ("qwen3-8b", "qwen3.5-4b"):
        from rljob_operator import estimator as est

        config = est.load_preset(name)
        spec = example_spec("qwen3.5-4b-gsm8k-adaptive.yaml")
        plan = planning.plan_job(spec, config)
        tokens = spec.lengths.max_prompt_tokens + spec.lengths.max_completion_tokens
        lower = plan.max_num_seqs * (plan.kv_bytes_per_token * tokens + plan.state_bytes_per_sequence)
        assert lower <= plan.cpu_kv_cache_bytes
        if plan.num_linear_attention_layers == 0:  # full attention only: exactly whole 128-token blocks
            blocks = plan.max_num_seqs * -(-tokens // 128) + 1
            assert plan.cpu_kv_cache_bytes == blocks * 128 * plan.kv_bytes_per_token
        assert planning.plan_status(plan).cpu_kv_cache_bytes == plan.cpu_kv_cache_bytes

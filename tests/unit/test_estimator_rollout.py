"""Rollout engine sizing: vLLM's block layout, capacity arithmetic and the prefill budget.

Ground truths are numbers vLLM printed in public logs (cited per test); property tests check
the invariants the operator relies on. The last test compares our KV specs with vLLM's own
spec classes when the ``vllm`` package is importable (skipped otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from estimator_test_models import nemotron_nano_9b_v2
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rljob_operator.estimator import (
    DeviceSpec,
    EstimatorError,
    ModelGeometry,
    compute_kv_cache_layout,
    size_engine,
)
from rljob_operator.estimator.rollout import estimate_activation_bytes, kv_cache_capacity_tokens

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "model_configs"
GIB = 1 << 30


def geo(name: str) -> ModelGeometry:
    return ModelGeometry.from_hf_config(json.loads((CONFIGS / f"{name}.json").read_text()))


def device(mem_gib: float) -> DeviceSpec:
    return DeviceSpec(
        name="test", memory_bytes=int(mem_gib * GIB), hbm_bandwidth_bytes_per_s=2e12, bf16_flops_per_s=5e14
    )


# --------------------------------------------------------------------------- seed 004
def test_seed_case_qwen35_4b_96gib_12288() -> None:
    # Seed 004: Qwen3.5-4B, 96 GiB accelerators, prompt 1024 + completion 8192, max_model_len 12288:
    # head_dim 256 (not 160) and max_num_batched_tokens = one prefill = 12288 (not ~570k, the whole cache).
    g = geo("Qwen__Qwen3.5-4B")
    s = size_engine(g, device(96), 1, sequence_tokens=1024 + 8192, max_model_len=12288)
    assert g.head_dim == 256
    assert s.max_num_batched_tokens == 12288
    assert s.kv_cache_tokens > 12288 * 10
    # The seed's rule (all 32 layers full, head_dim 256) would give 4x the bytes per token; ours counts 8.
    assert s.kv_bytes_per_token == 8 * 2 * 4 * 256 * 2
    # Blocks: ceil(9216 / 528) = 18 attention blocks + 3 linear groups x 2 state blocks (prefix caching).
    assert s.blocks_per_sequence == 18 + 3 * 2
    assert s.max_num_seqs == min(1024, s.num_blocks // 24)


# --------------------------------------------------------------------------- vLLM log ground truths
def test_ground_truth_qwen35_hybrid_block_size_528() -> None:
    # vllm-project/vllm#37467 log (Qwen3.5 GDN model, TP 1): "Setting attention block size to 528 tokens"
    # and "Padding mamba page size by 0.76%". By hand: attention 2 x 4 x 256 x 2 = 4096 B/token/layer;
    # state 8192 x 3 x 2 + 32 x 128 x 128 x 4 = 2,146,304 B; 16 x ceil(2,146,304 / 65,536) = 16 x 33 = 528.
    layout = compute_kv_cache_layout(geo("Qwen__Qwen3.5-4B"), 1)
    assert layout.block_size_tokens == 528
    padding_pct = 100 * (layout.page_bytes - layout.state_bytes_per_layer) / layout.state_bytes_per_layer
    assert round(padding_pct, 2) == 0.76
    # 8 full + 24 linear layers -> groups of 8: 1 attention group, 3 linear-attention groups.
    assert (layout.group_size_layers, layout.full_attention_groups, layout.linear_attention_groups) == (
        8,
        1,
        3,
    )


def test_ground_truth_nemotron_nano_block_size_672() -> None:
    # vllm-project/vllm#24280: NVIDIA-Nemotron-Nano-9B-v2 gets "672 tokens" attention pages; vLLM then kept
    # the SSM state in the model dtype (bf16). By hand: state 12288 x 3 x 2 + 128 x 80 x 128 x 2 = 2,695,168;
    # attention 2 x 8 x 128 x 2 = 4096 B/token; 16 x ceil(2,695,168 / 65,536) = 16 x 42 = 672.
    g = ModelGeometry.from_hf_config(nemotron_nano_9b_v2(ssm_dtype="bfloat16"))
    assert compute_kv_cache_layout(g, 1).block_size_tokens == 672
    # Today's vLLM defaults NemotronH's SSM cache to float32: 16 x ceil(5,316,608 / 65,536) = 1312.
    g32 = ModelGeometry.from_hf_config(nemotron_nano_9b_v2())
    assert compute_kv_cache_layout(g32, 1).block_size_tokens == 1312


@pytest.mark.parametrize(("kv_gib", "blocks"), [(3.81, 1952), (2.89, 1478)])
def test_ground_truth_llama31_8b_blocks_from_kv_memory(kv_gib: float, blocks: int) -> None:
    # vllm-project/vllm#10517 (Llama-3.1-8B, RTX 3090): "kv_cache_size=3.81GiB ... GPU blocks: 1952" and
    # "kv_cache_size=2.89GiB ... GPU blocks: 1478 ... KV cache (23648)". vLLM logs GiB to 2 decimals, so
    # the exact bytes lie within +-0.005 GiB: our block count must be in the range those bytes give.
    layout = compute_kv_cache_layout(geo("meta-llama__Llama-3.1-8B-Instruct"), 1)
    assert layout.bytes_per_block == 32 * 16 * 4096  # 2 MiB: 32 layers x 16 tokens x 4 KiB
    lo = int((kv_gib - 0.005) * GIB) // layout.bytes_per_block
    hi = int((kv_gib + 0.005) * GIB) // layout.bytes_per_block
    assert lo <= blocks <= hi
    if blocks == 1478:
        assert blocks * layout.block_size_tokens == 23648


@pytest.mark.parametrize(("tokens", "measured_gib"), [(20000, 17.06 - 14.9888), (29000, 17.98 - 14.9888)])
def test_ground_truth_llama31_8b_activation_peak(tokens: int, measured_gib: float) -> None:
    # vllm-project/vllm#10517: peak_torch_memory 17.06 / 17.98 GiB with 14.99 GiB weights, profile runs of
    # 20,000 and 29,000 tokens (chunked prefill off, 256 sequences). Our activation model within 5 %.
    ours = estimate_activation_bytes(geo("meta-llama__Llama-3.1-8B-Instruct"), 1, tokens, 256) / GIB
    assert ours == pytest.approx(measured_gib, rel=0.05)


def test_ground_truth_qwen3_235b_tp4_capacity_from_kv_memory() -> None:
    # vllm-project/vllm#21348 (Qwen3-235B-A22B-FP8, TP 4, H100): "Available KV cache memory: 8.11 GiB",
    # "GPU KV cache size: 178,880 tokens". 94 layers x 2 x max(1, 4 // 4) x 128 x 2 B = 48,128 B/token.
    cfg = {
        "model_type": "qwen3_moe",
        "hidden_size": 4096,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "moe_intermediate_size": 1536,
        "intermediate_size": 12288,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "torch_dtype": "bfloat16",
    }
    g = ModelGeometry.from_hf_config(cfg)
    layout = compute_kv_cache_layout(g, 4)
    num_blocks = int(8.11 * GIB) // layout.bytes_per_block
    tokens, _ = kv_cache_capacity_tokens(layout, num_blocks, 40960, 8192)
    assert g.kv_bytes_per_token(4) == 48128
    # Ours: 180,928 tokens, +1.1 % over the log (that vLLM version reported slightly fewer tokens than
    # the logged GiB imply); within the 2 % target.
    assert tokens == pytest.approx(178_880, rel=0.02)


# --------------------------------------------------------------------------- layout rules
def test_gemma3_style_groups_and_sliding_blocks() -> None:
    cfg = {
        "model_type": "gemma3_text",
        "hidden_size": 5376,
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "intermediate_size": 21504,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16",
    }
    layout = compute_kv_cache_layout(ModelGeometry.from_hf_config(cfg), 1)
    # 10 full, 52 sliding -> group size 10: 1 full group, ceil(52 / 10) = 6 sliding groups (8 padding layers).
    assert (layout.group_size_layers, layout.full_attention_groups, layout.sliding_window_groups) == (
        10,
        1,
        6,
    )
    # A 32k-token sequence with 8192-token prefills: full ceil(32768/16) = 2048 blocks; each sliding group
    # holds ceil(min(1023 + 8192, 32768) / 16) + 1 = 577 blocks.
    assert layout.blocks_per_sequence(32768, 8192) == 2048 + 6 * 577


def test_prefix_caching_off_takes_one_state_block() -> None:
    g = geo("Qwen__Qwen3.5-4B")
    on = compute_kv_cache_layout(g, 1, enable_prefix_caching=True)
    off = compute_kv_cache_layout(g, 1, enable_prefix_caching=False)
    assert on.blocks_per_sequence(9216, 8192) - off.blocks_per_sequence(9216, 8192) == 3


def test_fp8_kv_doubles_sequences_for_dense_model() -> None:
    g = geo("Qwen__Qwen3-8B")
    auto = size_engine(g, device(79.19), 1, sequence_tokens=8192, max_model_len=8192)
    fp8 = size_engine(g, device(79.19), 1, sequence_tokens=8192, max_model_len=8192, kv_cache_dtype="fp8")
    # Same memory, half the page: twice the blocks (less a little: more sequences -> bigger sampler logits).
    assert fp8.num_blocks == pytest.approx(2 * auto.num_blocks, rel=0.005)
    assert fp8.max_num_seqs > 1.9 * auto.max_num_seqs


def test_mnbt_respects_max_model_len_and_override_checks() -> None:
    g = geo("Qwen__Qwen3-8B")
    s = size_engine(g, device(79.19), 1, sequence_tokens=4096, max_model_len=8192)
    assert s.max_num_batched_tokens == 8192
    with pytest.raises(EstimatorError) as exc:
        size_engine(
            g,
            device(79.19),
            1,
            sequence_tokens=4096,
            max_model_len=8192,
            max_num_seqs=64,
            max_num_batched_tokens=32,
        )
    assert exc.value.field == "max_num_batched_tokens"


def test_model_does_not_fit_and_kv_too_small() -> None:
    g = geo("Qwen__Qwen3-30B-A3B")  # ~57 GiB of bf16 weights
    with pytest.raises(EstimatorError) as exc:
        size_engine(g, device(39.39), 1, sequence_tokens=4096, max_model_len=8192)
    assert exc.value.reason == "ModelDoesNotFit"
    with pytest.raises(EstimatorError) as exc:
        size_engine(geo("Qwen__Qwen3-8B"), device(24), 1, sequence_tokens=4096, max_model_len=40960)
    assert exc.value.reason in ("KVCacheTooSmall", "ModelDoesNotFit")


def test_sequence_longer_than_max_model_len_is_rejected() -> None:
    with pytest.raises(EstimatorError) as exc:
        size_engine(geo("Qwen__Qwen3-8B"), device(79.19), 1, sequence_tokens=9000, max_model_len=8192)
    assert exc.value.field == "max_model_len"


# --------------------------------------------------------------------------- properties
NAMES = sorted(p.stem for p in CONFIGS.glob("*.json"))
GEOS = {n: geo(n) for n in NAMES}


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    tp=st.sampled_from([1, 2, 4, 8]),
    mem_gib=st.floats(min_value=16, max_value=200),
    prompt=st.integers(min_value=16, max_value=4096),
    completion=st.integers(min_value=16, max_value=16384),
    extra_len=st.integers(min_value=0, max_value=8192),
    util=st.floats(min_value=0.5, max_value=0.95),
    fp8=st.booleans(),
)
def test_properties_capacity_and_prefill_budget(
    name: str, tp: int, mem_gib: float, prompt: int, completion: int, extra_len: int, util: float, fp8: bool
) -> None:
    g = GEOS[name]
    assume(g.supports_tensor_parallel(tp))
    kwargs: dict[str, Any] = {
        "sequence_tokens": prompt + completion,
        "max_model_len": prompt + completion + extra_len,
        "gpu_memory_utilization": util,
        "kv_cache_dtype": "fp8" if fp8 else "auto",
    }
    try:
        small = size_engine(g, device(mem_gib), tp, **kwargs)
    except EstimatorError as exc:
        assert exc.reason in ("ModelDoesNotFit", "KVCacheTooSmall")
        return
    # capacity never negative; the prefill budget covers one token per decoding sequence
    assert small.kv_cache_bytes > 0 and small.num_blocks > 0 and small.kv_cache_tokens >= 0
    assert small.max_num_seqs >= 1
    assert small.max_num_batched_tokens >= small.max_num_seqs
    assert small.max_num_batched_tokens <= max(kwargs["max_model_len"], small.max_num_seqs)
    assert small.max_num_seqs * small.blocks_per_sequence <= small.num_blocks
    # more memory never means fewer sequences (or less capacity)
    big = size_engine(g, device(mem_gib * 1.25), tp, **kwargs)
    assert big.max_num_seqs >= small.max_num_seqs
    assert big.kv_cache_tokens >= small.kv_cache_tokens


# --------------------------------------------------------------------------- against vLLM's own code
def test_kv_spec_matches_vllm_arithmetic() -> None:
    """Compare page sizes, state shapes, grouping and per-request blocks with vLLM's classes."""
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    try:  # 0.33 moved the grouping into its own module; 0.32 (the CPU pin) has it in kv_cache_utils
        from vllm.v1.core.kv_cache_planning import _get_kv_cache_groups_uniform_page_size
    except ImportError:
        from vllm.v1.core.kv_cache_utils import _get_kv_cache_groups_uniform_page_size
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    models = dict(GEOS)
    models["nemotron"] = ModelGeometry.from_hf_config(nemotron_nano_9b_v2())
    for name, g in models.items():
        for tp in (1, 2, 4, 8):
            if not g.supports_tensor_parallel(tp):
                continue
            for kv_dtype, torch_kv in (("auto", dtypes[g.dtype]), ("fp8", torch.float8_e4m3fn)):
                layout = compute_kv_cache_layout(g, tp, kv_dtype)
                block = layout.block_size_tokens
                attn = FullAttentionSpec(
                    block_size=block,
                    num_kv_heads=g.kv_heads_per_rank(tp),
                    head_size=g.head_dim,
                    dtype=torch_kv,
                )
                assert attn.page_size_bytes == layout.page_bytes, (name, tp, kv_dtype)
                specs: dict[str, Any] = {}
                for i, kind in enumerate(g.layer_kinds):
                    if kind == "full_attention":
                        specs[f"l{i}"] = attn
                    elif kind == "sliding_attention":
                        specs[f"l{i}"] = SlidingWindowSpec(
                            block_size=block,
                            num_kv_heads=g.kv_heads_per_rank(tp),
                            head_size=g.head_dim,
                            dtype=torch_kv,
                            sliding_window=g.sliding_window_tokens,
                        )
                    elif kind == "linear_attention":
                        lin = g.linear
                        assert lin is not None
                        if lin.kind == "gated_delta_net":
                            shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
                                tp,
                                lin.num_key_heads,
                                lin.num_value_heads,
                                lin.key_head_dim,
                                lin.value_head_dim,
                                lin.conv_kernel,
                            )
                        else:
                            shapes = MambaStateShapeCalculator.mamba2_state_shape(
                                tp,
                                lin.num_heads * lin.head_dim,
                                lin.n_groups,
                                lin.num_heads,
                                lin.head_dim,
                                lin.state_size,
                                lin.conv_kernel,
                            )
                        mamba = MambaSpec(
                            block_size=block,
                            shapes=tuple(shapes),
                            dtypes=(dtypes[lin.conv_dtype], dtypes[lin.ssm_dtype]),
                            page_size_padded=layout.page_bytes,
                            mamba_cache_mode="align",
                        )
                        assert mamba.real_page_size_bytes == layout.state_bytes_per_layer, (name, tp)
                        specs[f"l{i}"] = mamba
                groups = (
                    _get_kv_cache_groups_uniform_page_size(specs)
                    if len(set(map(type, specs.values()))) > 1
                    else None
                )
                if groups is None:
                    continue
                cfg = KVCacheConfig(num_blocks=10_000, kv_cache_tensors=[], kv_cache_groups=groups)
                stub = SimpleNamespace(
                    model_config=SimpleNamespace(max_model_len=12288),
                    parallel_config=SimpleNamespace(decode_context_parallel_size=1),
                    cache_config=SimpleNamespace(mamba_cache_mode="align"),
                    max_in_flight_tokens=8192,
                )
                concurrency = get_max_concurrency_for_kv_cache_config(stub, cfg)
                assert 10_000 / concurrency == pytest.approx(layout.blocks_per_sequence(12288, 8192)), name
                assert max(len(gr.layer_names) for gr in groups) == layout.group_size_layers
    # MLA: one latent, not divided by TP
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    assert mla.page_size_bytes == 16 * 576 * 2

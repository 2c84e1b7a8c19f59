"""Exact KV and state bytes for every shipped config, and ground truths from published numbers.

Expected values are worked out by hand from the config numbers in each test (the comment shows
the arithmetic), never by calling the code under test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from estimator_test_models import nemotron_nano_9b_v2

from rljob_operator.estimator import EstimatorError, ModelGeometry, load_preset, preset_names
from rljob_operator.estimator.geometry import serving_dtype

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "model_configs"
KIB = 1024


def load(name: str) -> dict[str, Any]:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def geo(name: str) -> ModelGeometry:
    return ModelGeometry.from_hf_config(load(name))


# --------------------------------------------------------------------------- every shipped config
# kv = layers x 2 (K and V) x max(1, kv_heads // tp) x head_dim x 2 bytes (bf16); fp8 halves it.
KV_CASES = {
    # Qwen3-4B: 36 layers, 8 KV heads, head_dim 128 (config, not 2560/32 = 80)
    "Qwen__Qwen3-4B": {
        1: 36 * 2 * 8 * 128 * 2,
        2: 36 * 2 * 4 * 128 * 2,
        4: 36 * 2 * 2 * 128 * 2,
        8: 36 * 2 * 1 * 128 * 2,
    },
    # Qwen3-8B: same attention geometry as Qwen3-4B (36 x 8 x 128) -> 144 KiB at TP 1
    "Qwen__Qwen3-8B": {1: 147456, 2: 73728, 4: 36864, 8: 18432},
    # Qwen3-30B-A3B: 48 layers, 4 KV heads, 128 -> TP 8 replicates: max(1, 4 // 8) = 1 head per rank
    "Qwen__Qwen3-30B-A3B": {
        1: 48 * 2 * 4 * 128 * 2,
        2: 48 * 2 * 2 * 128 * 2,
        4: 48 * 2 * 1 * 128 * 2,
        8: 48 * 2 * 1 * 128 * 2,
    },
    # Qwen2.5-7B: 28 layers, 4 KV heads, 3584/28 = 128; use_sliding_window false -> all full
    "Qwen__Qwen2.5-7B-Instruct": {
        1: 28 * 2 * 4 * 128 * 2,
        2: 28 * 2 * 2 * 128 * 2,
        4: 28 * 2 * 1 * 128 * 2,
        8: 28 * 2 * 1 * 128 * 2,
    },
    # Llama-3.1-8B: no head_dim field -> 4096/32 = 128; 32 layers x 8 KV heads
    "meta-llama__Llama-3.1-8B-Instruct": {
        1: 32 * 2 * 8 * 128 * 2,
        2: 32 * 2 * 4 * 128 * 2,
        4: 32 * 2 * 2 * 128 * 2,
        8: 32 * 2 * 1 * 128 * 2,
    },
    # SmolLM2-135M-Instruct (the packaged real model): 30 layers, 3 KV heads, head_dim 64;
    # at TP 2+ vLLM keeps max(1, 3 // tp) = 1 head per rank
    "HuggingFaceTB__SmolLM2-135M-Instruct": {
        1: 30 * 2 * 3 * 64 * 2,
        2: 30 * 2 * 1 * 64 * 2,
        4: 30 * 2 * 1 * 64 * 2,
        8: 30 * 2 * 1 * 64 * 2,
    },
    # Qwen3.5-4B: only 8 of 32 layers are full attention; 4 KV heads x head_dim 256
    "Qwen__Qwen3.5-4B": {
        1: 8 * 2 * 4 * 256 * 2,
        2: 8 * 2 * 2 * 256 * 2,
        4: 8 * 2 * 1 * 256 * 2,
        8: 8 * 2 * 1 * 256 * 2,
    },
}

# Qwen3.5-4B gated delta-net state per layer and rank (vLLM gated_delta_net_state_shape):
#   conv: (128*16*2 + 128*32) / tp x (4 - 1) x 2 B (bf16)  = 8192/tp x 3 x 2
#   ssm:  32 / tp x 128 x 128 x 4 B (mamba_ssm_dtype float32)
# 24 linear-attention layers.
QWEN35_STATE = {tp: 24 * (8192 // tp * 3 * 2 + 32 // tp * 128 * 128 * 4) for tp in (1, 2, 4, 8)}


def test_every_shipped_config_is_covered() -> None:
    assert {p.stem for p in CONFIGS.glob("*.json")} == set(KV_CASES)


@pytest.mark.parametrize("name", sorted(KV_CASES))
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_kv_bytes_per_token_exact(name: str, tp: int) -> None:
    g = geo(name)
    assert g.kv_bytes_per_token(tp) == KV_CASES[name][tp]
    # fp8 KV: one byte per element instead of two
    assert g.kv_bytes_per_token(tp, "fp8") == KV_CASES[name][tp] // 2
    assert g.kv_bytes_per_token(tp, "fp8_e5m2") == KV_CASES[name][tp] // 2


@pytest.mark.parametrize("name", sorted(KV_CASES))
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_state_bytes_per_sequence_exact(name: str, tp: int) -> None:
    expected = QWEN35_STATE[tp] if name == "Qwen__Qwen3.5-4B" else 0
    assert geo(name).state_bytes_per_sequence(tp) == expected


def test_qwen35_state_is_the_brief_51_5_mb() -> None:
    # BRIEF: "24 keep a ~51.5 MB fp32 state": 24 x (49,152 + 2,097,152) = 51,511,296 B
    assert QWEN35_STATE[1] == 51_511_296
    assert geo("Qwen__Qwen3.5-4B").state_bytes_per_sequence(1) == 51_511_296


def test_qwen35_reads_text_config_and_inherits_nothing_wrong() -> None:
    g = geo("Qwen__Qwen3.5-4B")
    assert g.head_dim == 256  # config head_dim, not 2560 // 16 = 160 (seed 004 bug 1)
    assert (g.num_full_attention_layers, g.num_linear_attention_layers) == (8, 24)
    assert g.hidden_size == 2560 and g.vocab_size == 248320
    assert g.dtype == "bfloat16" and g.linear is not None and g.linear.ssm_dtype == "float32"
    assert g.tie_word_embeddings is True and g.vision_params > 0


def test_text_config_inherits_parent_dtype() -> None:
    cfg = load("Qwen__Qwen3.5-4B")
    del cfg["text_config"]["dtype"]
    cfg["torch_dtype"] = "float16"
    g = ModelGeometry.from_hf_config(cfg)
    assert g.dtype == "float16"
    assert g.kv_bytes_per_token(1) == 8 * 2 * 4 * 256 * 2


def test_full_attention_interval_without_layer_types() -> None:
    cfg = load("Qwen__Qwen3.5-4B")
    del cfg["text_config"]["layer_types"]  # Qwen3-Next style: interval 4 -> layers 3, 7, ... full
    g = ModelGeometry.from_hf_config(cfg)
    assert g.num_full_attention_layers == 8 and g.layer_kinds[3] == "full_attention"
    assert g.layer_kinds[0] == "linear_attention"


def test_head_dim_fallback_and_non_positive_head_dim() -> None:
    cfg = load("meta-llama__Llama-3.1-8B-Instruct")
    assert ModelGeometry.from_hf_config(cfg).head_dim == 4096 // 32
    cfg["head_dim"] = 0  # not positive -> fall back to hidden / heads
    assert ModelGeometry.from_hf_config(cfg).head_dim == 128


def test_moe_total_vs_active_params() -> None:
    g = geo("Qwen__Qwen3-30B-A3B")
    # Published: 30.5B total, 3.3B activated (Qwen3 model card)
    assert 30.0e9 < g.total_params < 31.0e9
    assert 3.1e9 < g.active_params < 3.5e9


@pytest.mark.parametrize(
    ("name", "published_b"),
    [
        ("Qwen__Qwen3-8B", 8.2),
        ("Qwen__Qwen3-4B", 4.0),
        ("Qwen__Qwen2.5-7B-Instruct", 7.61),
        ("meta-llama__Llama-3.1-8B-Instruct", 8.03),
    ],
)
def test_dense_param_counts_match_model_cards(name: str, published_b: float) -> None:
    assert geo(name).total_params / 1e9 == pytest.approx(published_b, rel=0.02)


def test_tied_embeddings_count_once() -> None:
    tied = load("Qwen__Qwen3-4B")
    untied = dict(tied, tie_word_embeddings=False)
    diff = ModelGeometry.from_hf_config(untied).total_params - ModelGeometry.from_hf_config(tied).total_params
    assert diff == 151936 * 2560


def test_fp8_quantized_weights_are_half() -> None:
    cfg = load("Qwen__Qwen3-8B")
    bf16 = ModelGeometry.from_hf_config(cfg).weight_bytes_per_rank(1)
    fp8 = ModelGeometry.from_hf_config(
        dict(cfg, quantization_config={"quant_method": "fp8"})
    ).weight_bytes_per_rank(1)
    embed = 151936 * 4096 * 2 * 2  # embeddings + lm_head stay bf16
    assert fp8 - embed == pytest.approx((bf16 - embed) / 2, rel=1e-6)


def test_float32_checkpoint_served_in_bfloat16() -> None:
    assert serving_dtype("float32") == "bfloat16"
    g = ModelGeometry.from_hf_config(dict(load("Qwen__Qwen3-8B"), torch_dtype="float32"))
    assert g.kv_bytes_per_token(1) == 147456


# --------------------------------------------------------------------------- errors name the field
@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda c: c.pop("num_hidden_layers"), "num_hidden_layers"),
        (lambda c: c.update(num_key_value_heads=64), "num_key_value_heads"),
        (lambda c: c.update(torch_dtype="float128"), "torch_dtype"),
        (lambda c: c.update(layer_types=["full_attention"] * 3), "layer_types"),
        (
            lambda c: c.update(quantization_config={"quant_method": "magic"}),
            "quantization_config.quant_method",
        ),
    ],
)
def test_invalid_config_errors_name_the_field(mutate: Any, field: str) -> None:
    cfg = load("Qwen__Qwen3-8B")
    mutate(cfg)
    with pytest.raises(EstimatorError) as exc:
        ModelGeometry.from_hf_config(cfg)
    assert exc.value.field == field
    assert exc.value.reason == "InvalidModelConfig"


def test_text_config_errors_carry_the_prefix() -> None:
    cfg = load("Qwen__Qwen3.5-4B")
    cfg["text_config"]["layer_types"][0] = "quantum_attention"
    with pytest.raises(EstimatorError) as exc:
        ModelGeometry.from_hf_config(cfg)
    assert exc.value.field == "text_config.layer_types[0]"


def test_unknown_kv_cache_dtype() -> None:
    with pytest.raises(EstimatorError) as exc:
        geo("Qwen__Qwen3-8B").kv_bytes_per_token(1, "int3")
    assert exc.value.field == "kv_cache_dtype"


def test_presets_match_test_configs_and_unknown_lists_names() -> None:
    assert "qwen3.5-4b" in preset_names() and "llama-3.1-8b-instruct" in preset_names()
    assert load_preset("qwen3.5-4b") == load("Qwen__Qwen3.5-4B")
    with pytest.raises(EstimatorError) as exc:
        load_preset("gpt-5")
    assert exc.value.reason == "UnknownPreset" and "qwen3-8b" in exc.value.message


# --------------------------------------------------------------------------- ground truths
def _dense(
    layers: int, kv_heads: int, head_dim: int, hidden: int, heads: int, **extra: Any
) -> dict[str, Any]:
    cfg = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": 4 * hidden,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "torch_dtype": "bfloat16",
    }
    cfg.update(extra)
    return cfg


def test_ground_truth_qwen3_14b_160_kib() -> None:
    # Issue 4 / LMCache FAQ KV-size table (LMCache/LMCache#1769): Qwen3-14B bf16 = 160 KiB/token.
    # Qwen3-14B config: 40 layers, 8 KV heads, head_dim 128, hidden 5120, 40 heads.
    g = ModelGeometry.from_hf_config(_dense(40, 8, 128, 5120, 40))
    assert g.kv_bytes_per_token(1) == 160 * KIB


def test_ground_truth_llama31_8b_and_70b_hf_blog() -> None:
    # HF blog "Llama 3.1" inference memory table (quoted in huggingface/blog#2345):
    # KV for 1k tokens fp16: 8B 0.125 GB, 70B 0.313 GB -> 128 KiB and 320 KiB per token (1024 tokens).
    assert geo("meta-llama__Llama-3.1-8B-Instruct").kv_bytes_per_token(1) * 1024 == 0.125 * 2**30
    llama70 = ModelGeometry.from_hf_config(_dense(80, 8, 128, 8192, 64))
    assert llama70.kv_bytes_per_token(1) * 1024 / 2**30 == pytest.approx(0.313, abs=0.001)


def test_ground_truth_deepseek_mla_latent_not_split_by_tp() -> None:
    # DeepSeek-V2 paper, Table 1: MLA caches (d_c + d_h^R) x l elements per token, d_c = 512, d_h^R = 64.
    # DeepSeek-V2-Lite: 27 layers -> 27 x 576 x 2 B = 31,104 B; DeepSeek-V3: 61 layers -> 70,272 B
    # ("~70 KB per token", DeepSeek-V3 tech report discussions). vLLM MLAAttentionSpec: not divided by TP.
    lite = {
        "model_type": "deepseek_v2",
        "hidden_size": 2048,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "q_lora_rank": None,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "first_k_dense_replace": 1,
        "vocab_size": 102400,
        "max_position_embeddings": 163840,
        "torch_dtype": "bfloat16",
    }
    g = ModelGeometry.from_hf_config(lite)
    for tp in (1, 2, 4, 8):
        assert g.kv_bytes_per_token(tp) == 27 * 576 * 2
    assert g.kv_bytes_per_token(1, "fp8") == 27 * 576
    # DeepSeek-V2-Lite model card: 15.7B total, 2.4B active parameters (the card does not count the
    # input embedding lookup, 102400 x 2048, which our FLOPs basis keeps: 2.45B + 0.21B).
    assert g.total_params / 1e9 == pytest.approx(15.7, rel=0.03)
    assert (g.active_params - 102400 * 2048) / 1e9 == pytest.approx(2.4, rel=0.03)
    v3 = dict(lite, num_hidden_layers=61, hidden_size=7168, num_attention_heads=128, q_lora_rank=1536)
    assert ModelGeometry.from_hf_config(v3).kv_bytes_per_token(8) == 70_272


def test_ground_truth_llama31_8b_weights_vllm_log() -> None:
    # vllm-project/vllm#10517 log: "Loading model weights took 14.9888 GB" (GiB) for Llama-3.1-8B bf16.
    ours_gib = geo("meta-llama__Llama-3.1-8B-Instruct").weight_bytes_per_rank(1) / 2**30
    assert ours_gib == pytest.approx(14.9888, rel=0.005)


def test_sliding_window_rules() -> None:
    # Mistral-7B-v0.1: sliding_window 4096 on every layer, 32 x 8 KV heads x 128 -> 128 KiB/token.
    mistral = _dense(32, 8, 128, 4096, 32, model_type="mistral", sliding_window=4096)
    g = ModelGeometry.from_hf_config(mistral)
    assert g.num_sliding_window_layers == 32 and g.sliding_window_tokens == 4096
    assert g.kv_bytes_per_token(1) == 128 * KIB and g.kv_bytes_per_token_full_layers(1) == 0
    # Gemma-2-9B: 42 layers alternate sliding (even) / global (odd), window 4096, 8 KV heads x 256.
    gemma2 = _dense(42, 8, 256, 3584, 16, model_type="gemma2", sliding_window=4096)
    g2 = ModelGeometry.from_hf_config(gemma2)
    assert (g2.num_sliding_window_layers, g2.num_full_attention_layers) == (21, 21)
    assert g2.kv_bytes_per_token(1) == 42 * 2 * 8 * 256 * 2
    # Gemma-3-27B: sliding_window_pattern 6 -> every 6th layer global: 62 layers -> 10 global, 52 local.
    gemma3 = _dense(
        62, 16, 128, 5376, 32, model_type="gemma3_text", sliding_window=1024, sliding_window_pattern=6
    )
    g3 = ModelGeometry.from_hf_config(gemma3)
    assert (g3.num_full_attention_layers, g3.num_sliding_window_layers) == (10, 52)
    # use_sliding_window false wins over a set sliding_window (Qwen2.5 config).
    assert geo("Qwen__Qwen2.5-7B-Instruct").num_sliding_window_layers == 0


def test_mamba2_nemotron_state() -> None:
    # NVIDIA-Nemotron-Nano-9B-v2 geometry (HF config): mamba 128 heads x 80, 8 groups, state 128,
    # conv kernel 4; vLLM mamba2_state_shape: conv (10240 + 2*8*128)/tp x 3, ssm 128/tp x 80 x 128.
    cfg = nemotron_nano_9b_v2()
    g = ModelGeometry.from_hf_config(cfg)
    per_layer_fp32 = 12288 * 3 * 2 + 128 * 80 * 128 * 4
    assert g.state_bytes_per_layer(1) == per_layer_fp32  # vLLM default: fp32 SSM cache for NemotronH
    assert g.num_linear_attention_layers == cfg["hybrid_override_pattern"].count("M")
    # TP 2: 8 groups split evenly -> conv 12288/2, ssm 64 heads
    assert g.state_bytes_per_layer(2) == 6144 * 3 * 2 + 64 * 80 * 128 * 4

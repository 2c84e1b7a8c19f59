"""Config fields of models not shipped in tests/data/model_configs, shared by the estimator tests."""

from __future__ import annotations

from typing import Any


def nemotron_nano_9b_v2(ssm_dtype: str | None = None) -> dict[str, Any]:
    """Fields of NVIDIA-Nemotron-Nano-9B-v2's config.json that the estimator reads."""
    # Illustrative 56-layer pattern (26 mamba, 4 attention, 26 MLP); per-layer shapes are the real ones.
    pattern = "M-M-M-M-M-M*-" * 4 + "M-M-"
    cfg: dict[str, Any] = {
        "model_type": "nemotron_h",
        "architectures": ["NemotronHForCausalLM"],
        "hidden_size": 4480,
        "num_hidden_layers": 56,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 15680,
        "mamba_num_heads": 128,
        "mamba_head_dim": 80,
        "n_groups": 8,
        "ssm_state_size": 128,
        "conv_kernel": 4,
        "hybrid_override_pattern": pattern,
        "mlp_hidden_act": "relu2",
        "vocab_size": 131072,
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
    }
    if ssm_dtype:
        cfg["mamba_ssm_cache_dtype"] = ssm_dtype
    return cfg

"""Model geometry read from a Hugging Face ``config.json``: the numbers vLLM sizes its caches by.

Role: turn a raw config dict into a frozen :class:`ModelGeometry` that knows, per accelerator
of one tensor-parallel engine, how many KV-cache bytes each token costs and how many bytes of
fixed linear-attention state each sequence holds, plus parameter counts for weight memory.
Callers: :mod:`rollout` (engine sizing), :mod:`trainer` (FSDP memory), :mod:`throughput`,
:mod:`planner` and the operator/CLI through ``ModelGeometry.from_hf_config``.

The rules follow vLLM (``vllm/v1/kv_cache_interface.py``, ``vllm/config/model.py``,
``vllm/model_executor/layers/mamba/mamba_utils.py``):

* KV heads per rank are ``max(1, num_key_value_heads // tp)``: with more ranks than KV heads
  every rank keeps a replica (``ModelConfig.get_num_kv_heads``).
* MLA (DeepSeek) stores one latent of ``kv_lora_rank + qk_rope_head_dim`` per token and layer,
  not split by tensor parallelism (``MLAAttentionSpec``, ``head_size_v = 0``).
* ``kv_cache_dtype="auto"`` means the model dtype; fp8 variants are 1 byte.
* Gated delta-net layers (Qwen3-Next, Qwen3.5) keep a conv state of
  ``(k_dim*nk*2 + v_dim*nv) / tp x (kernel - 1)`` in the model dtype and an SSM state of
  ``nv / tp x v_dim x k_dim`` in ``mamba_ssm_dtype`` (float32 for Qwen3.5), else the model dtype.
* Mamba2 layers (Nemotron-H) keep ``(conv_dim / tp) x (kernel - 1)`` and
  ``heads / tp x head_dim x state_size``, groups replicated when ``n_groups % tp != 0``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rljob_operator import api, errors

LayerKind = Literal["full_attention", "sliding_attention", "linear_attention", "none"]
LinearKind = Literal["gated_delta_net", "mamba2"]

#: Bytes per element of the dtype names found in HF configs and vLLM flags.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "int8": 1,
}

#: HF ``layer_types`` values and the kind of cache they hold.
_LAYER_TYPE_KINDS: dict[str, LayerKind] = {
    "full_attention": "full_attention",
    "attention": "full_attention",
    "global_attention": "full_attention",
    "sliding_attention": "sliding_attention",
    "sliding_window_attention": "sliding_attention",
    "local_attention": "sliding_attention",
    "linear_attention": "linear_attention",
    "mamba": "linear_attention",
}


def dtype_bytes(name: str, field: str) -> int:
    """Bytes per element of ``name`` (``torch.bfloat16`` and ``bfloat16`` both work)."""
    key = str(name).removeprefix("torch.").lower()
    if key not in DTYPE_BYTES:
        raise errors.InvalidModelConfigError(
            field, f"unknown dtype {name!r}; supported: {', '.join(sorted(DTYPE_BYTES))}"
        )
    return DTYPE_BYTES[key]


def serving_dtype(config_dtype: str) -> str:
    """The dtype vLLM serves with for ``--dtype auto``: float32 checkpoints run in bfloat16."""
    key = str(config_dtype).removeprefix("torch.").lower()
    return "bfloat16" if key in ("float32", "float", "fp32") else key


class MLAGeometry(BaseModel):
    """Multi-head latent attention (DeepSeek-V2/V3): the cached latent per token and layer."""

    model_config = ConfigDict(frozen=True)

    kv_lora_rank: int = Field(gt=0, description="Compressed KV latent width (elements).")
    qk_rope_head_dim: int = Field(gt=0, description="Decoupled RoPE key width (elements).")
    qk_nope_head_dim: int = Field(ge=0, description="Per-head non-RoPE query/key width.")
    v_head_dim: int = Field(gt=0, description="Per-head value width.")
    q_lora_rank: int | None = Field(default=None, description="Query LoRA rank; None = full q_proj.")

    @property
    def latent_elements(self) -> int:
        """Elements cached per token and layer: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class LinearAttentionGeometry(BaseModel):
    """A layer that keeps a fixed per-sequence state (gated delta-net or Mamba2)."""

    model_config = ConfigDict(frozen=True)

    kind: LinearKind
    conv_kernel: int = Field(gt=1, description="Causal conv kernel width; the state keeps kernel - 1.")
    conv_dtype: str = Field(description="Conv state dtype (vLLM mamba_cache_dtype auto = model dtype).")
    ssm_dtype: str = Field(description="SSM/temporal state dtype (mamba_ssm_dtype, else model dtype).")
    # gated delta-net
    num_key_heads: int = 0
    num_value_heads: int = 0
    key_head_dim: int = 0
    value_head_dim: int = 0
    # mamba2
    num_heads: int = 0
    head_dim: int = 0
    n_groups: int = 0
    state_size: int = 0

    def state_shapes(self, tensor_parallel: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state shape, SSM state shape) per layer on one rank, as vLLM's MambaStateShapeCalculator."""
        tp = tensor_parallel
        if self.kind == "gated_delta_net":
            conv_dim = self.key_head_dim * self.num_key_heads * 2 + self.value_head_dim * self.num_value_heads
            _require_divisible(conv_dim, tp, "linear_num_key_heads")
            _require_divisible(self.num_value_heads, tp, "linear_num_value_heads")
            return (conv_dim // tp, self.conv_kernel - 1), (
                self.num_value_heads // tp,
                self.value_head_dim,
                self.key_head_dim,
            )
        groups = self.n_groups if self.n_groups % tp == 0 else self.n_groups + (tp - self.n_groups)
        conv_dim = self.num_heads * self.head_dim + 2 * groups * self.state_size
        _require_divisible(conv_dim, tp, "mamba_num_heads")
        _require_divisible(self.num_heads, tp, "mamba_num_heads")
        return (conv_dim // tp, self.conv_kernel - 1), (self.num_heads // tp, self.head_dim, self.state_size)

    def state_bytes_per_layer(self, tensor_parallel: int = 1) -> int:
        """Bytes of conv + SSM state one sequence holds in one layer on one rank."""
        conv, ssm = self.state_shapes(tensor_parallel)
        return _prod(conv) * dtype_bytes(self.conv_dtype, "dtype") + _prod(ssm) * dtype_bytes(
            self.ssm_dtype, "mamba_ssm_dtype"
        )

    def params_per_layer(self, hidden_size: int) -> int:
        """Weights of one linear-attention mixer (projections + conv), norms ignored."""
        if self.kind == "gated_delta_net":
            key_dim = self.num_key_heads * self.key_head_dim
            value_dim = self.num_value_heads * self.value_head_dim
            conv_dim = 2 * key_dim + value_dim
            in_proj = hidden_size * (2 * key_dim + 2 * value_dim + 2 * self.num_value_heads)
            return in_proj + conv_dim * self.conv_kernel + value_dim * hidden_size
        inner = self.num_heads * self.head_dim
        conv_dim = inner + 2 * self.n_groups * self.state_size
        in_proj = hidden_size * (2 * inner + 2 * self.n_groups * self.state_size + self.num_heads)
        return in_proj + conv_dim * self.conv_kernel + inner * hidden_size


class MoEGeometry(BaseModel):
    """Mixture-of-experts MLP: total experts held in memory vs experts each token runs."""

    model_config = ConfigDict(frozen=True)

    num_experts: int = Field(gt=0)
    experts_per_token: int = Field(gt=0)
    expert_intermediate_size: int = Field(gt=0)
    shared_intermediate_size: int = Field(default=0, ge=0, description="Shared-expert MLP width (0: none).")
    num_moe_layers: int = Field(ge=0)


class QuantGeometry(BaseModel):
    """Weight quantization of the linear layers (embeddings and lm_head stay in the model dtype)."""

    model_config = ConfigDict(frozen=True)

    method: str
    weight_bits: int = Field(gt=0, le=16)
    group_size: int | None = Field(default=None, description="Scale group size; one 2-byte scale per group.")


class ModelGeometry(BaseModel):
    """Shape of a decoder LLM as vLLM and an FSDP trainer see it. Frozen; build with ``from_hf_config``."""

    model_config = ConfigDict(frozen=True)

    model_type: str
    architectures: tuple[str, ...] = ()
    dtype: str = Field(description="Serving dtype (float32 checkpoints are served in bfloat16).")
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0, description="Attention head width; the config's head_dim wins.")
    intermediate_size: int = Field(ge=0, description="Dense MLP width (0 when every layer is MoE).")
    vocab_size: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    tie_word_embeddings: bool = False
    gated_mlp: bool = True
    attn_output_gate: bool = False
    layer_kinds: tuple[LayerKind, ...]
    num_mlp_layers: int = Field(ge=0, description="Layers with an MLP (dense or MoE).")
    sliding_window_tokens: int | None = None
    mla: MLAGeometry | None = None
    linear: LinearAttentionGeometry | None = None
    moe: MoEGeometry | None = None
    quantization: QuantGeometry | None = None
    vision_params: int = Field(default=0, ge=0, description="Vision tower parameters (multimodal).")

    # ------------------------------------------------------------------ layer counts
    @property
    def num_full_attention_layers(self) -> int:
        """Layers that keep per-token KV for the whole sequence."""
        return self.layer_kinds.count("full_attention")

    @property
    def num_sliding_window_layers(self) -> int:
        """Layers that keep per-token KV only for the last ``sliding_window_tokens`` tokens."""
        return self.layer_kinds.count("sliding_attention")

    @property
    def num_linear_attention_layers(self) -> int:
        """Linear-attention / SSM layers that keep a fixed per-sequence state instead of KV."""
        return self.layer_kinds.count("linear_attention")

    @property
    def is_hybrid_linear(self) -> bool:
        return self.num_linear_attention_layers > 0 and self.num_attention_layers > 0

    @property
    def num_attention_layers(self) -> int:
        return self.num_full_attention_layers + self.num_sliding_window_layers

    # ------------------------------------------------------------------ KV and state
    def kv_heads_per_rank(self, tensor_parallel: int = 1) -> int:
        """vLLM ``get_num_kv_heads``: ``max(1, kv_heads // tp)``; MLA caches one latent."""
        _check_tp(tensor_parallel)
        if self.mla is not None:
            return 1
        return max(1, self.num_key_value_heads // tensor_parallel)

    def kv_dtype_bytes(self, kv_cache_dtype: str = "auto") -> int:
        """Bytes per cached element: ``auto`` = model dtype, fp8 = 1."""
        if kv_cache_dtype == "auto":
            return dtype_bytes(self.dtype, "dtype")
        return dtype_bytes(kv_cache_dtype, "kv_cache_dtype")

    def kv_bytes_per_token_per_layer(self, tensor_parallel: int = 1, kv_cache_dtype: str = "auto") -> int:
        """One attention layer's page bytes per token on one rank (vLLM ``page_size_bytes / block_size``)."""
        elem = self.kv_dtype_bytes(kv_cache_dtype)
        if self.mla is not None:
            _check_tp(tensor_parallel)
            return self.mla.latent_elements * elem
        return 2 * self.kv_heads_per_rank(tensor_parallel) * self.head_dim * elem

    def kv_bytes_per_token(self, tensor_parallel: int = 1, kv_cache_dtype: str = "auto") -> int:
        """KV bytes one new token writes on one accelerator of a ``tensor_parallel``-way engine.

        Sums every attention layer (full and sliding window); linear-attention layers hold no
        per-token KV. Sliding-window layers stop growing after the window: see
        :meth:`kv_bytes_per_token_full_layers` for the part that grows with context forever.
        """
        per_layer = self.kv_bytes_per_token_per_layer(tensor_parallel, kv_cache_dtype)
        return per_layer * self.num_attention_layers

    def kv_bytes_per_token_full_layers(self, tensor_parallel: int = 1, kv_cache_dtype: str = "auto") -> int:
        """KV bytes per token of the full-attention layers only (unbounded growth with context)."""
        per_layer = self.kv_bytes_per_token_per_layer(tensor_parallel, kv_cache_dtype)
        return per_layer * self.num_full_attention_layers

    def state_bytes_per_layer(self, tensor_parallel: int = 1) -> int:
        """Linear-attention state bytes per sequence and layer on one rank (0 without such layers)."""
        _check_tp(tensor_parallel)
        if self.linear is None or self.num_linear_attention_layers == 0:
            return 0
        return self.linear.state_bytes_per_layer(tensor_parallel)

    def state_bytes_per_sequence(self, tensor_parallel: int = 1) -> int:
        """Conv + SSM state bytes one sequence holds on one rank, summed over linear-attention layers."""
        return self.state_bytes_per_layer(tensor_parallel) * self.num_linear_attention_layers

    def supports_tensor_parallel(self, tensor_parallel: int) -> bool:
        """vLLM needs attention heads (and linear-attention heads) divisible by TP."""
        if tensor_parallel < 1 or self.num_attention_heads % tensor_parallel:
            return False
        if self.linear is not None and self.num_linear_attention_layers:
            try:
                self.linear.state_shapes(tensor_parallel)
            except errors.EstimatorError:
                return False
        return True

    # ------------------------------------------------------------------ parameters
    def _attention_params_per_layer(self) -> int:
        h = self.hidden_size
        if self.mla is not None:
            m = self.mla
            qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
            if m.q_lora_rank:
                q = h * m.q_lora_rank + m.q_lora_rank * self.num_attention_heads * qk_dim
            else:
                q = h * self.num_attention_heads * qk_dim
            kv_a = h * (m.kv_lora_rank + m.qk_rope_head_dim)
            kv_b = m.kv_lora_rank * self.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim)
            return q + kv_a + kv_b + self.num_attention_heads * m.v_head_dim * h
        q_out = self.num_attention_heads * self.head_dim * (2 if self.attn_output_gate else 1)
        kv_out = 2 * self.num_key_value_heads * self.head_dim
        return h * (q_out + kv_out) + self.num_attention_heads * self.head_dim * h

    def _mlp_params(self, active: bool) -> int:
        factor = 3 if self.gated_mlp else 2
        h = self.hidden_size
        if self.moe is None:
            return self.num_mlp_layers * factor * h * self.intermediate_size
        moe = self.moe
        experts = moe.experts_per_token if active else moe.num_experts
        per_moe_layer = (
            experts * factor * h * moe.expert_intermediate_size
            + factor * h * moe.shared_intermediate_size
            + h * moe.num_experts
        )
        dense_layers = self.num_mlp_layers - moe.num_moe_layers
        return moe.num_moe_layers * per_moe_layer + dense_layers * factor * h * self.intermediate_size

    def embedding_params(self) -> int:
        """Input embedding plus an untied lm_head."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def layer_params(self, active: bool = False) -> int:
        """Transformer-body parameters (mixers + MLPs), ``active`` counting only routed experts per token."""
        mixers = self.num_attention_layers * self._attention_params_per_layer()
        if self.linear is not None:
            mixers += self.num_linear_attention_layers * self.linear.params_per_layer(self.hidden_size)
        return mixers + self._mlp_params(active)

    @property
    def total_params(self) -> int:
        """Every parameter held in memory (all experts, vision tower included)."""
        return self.embedding_params() + self.layer_params(active=False) + self.vision_params

    @property
    def active_params(self) -> int:
        """Parameters one token runs through (routed experts only); the FLOPs basis."""
        return self.embedding_params() + self.layer_params(active=True) + self.vision_params

    def weight_bytes_per_rank(self, tensor_parallel: int = 1) -> int:
        """Weight bytes on one rank of a vLLM engine.

        Linear layers, experts and the vocab-parallel embedding/lm_head are split ``tp`` ways;
        K/V projections are replicated once ``tp`` exceeds the KV heads; the vision tower is
        counted whole on every rank (vLLM shards it too, but it is small: a safe overcount).
        """
        _check_tp(tensor_parallel)
        elem = dtype_bytes(self.dtype, "dtype")
        body = self.layer_params(active=False)
        replicated_kv = 0
        if self.mla is None and self.num_key_value_heads < tensor_parallel:
            per_rank_heads = self.kv_heads_per_rank(tensor_parallel)
            kv_total = (
                2 * self.num_key_value_heads * self.head_dim * self.hidden_size * self.num_attention_layers
            )
            replicated_kv = kv_total * per_rank_heads * tensor_parallel // self.num_key_value_heads - kv_total
        body_bytes = _quantized_bytes(body + replicated_kv, self.quantization, elem)
        embed_bytes = self.embedding_params() * elem
        return _ceil_div(body_bytes + embed_bytes, tensor_parallel) + self.vision_params * elem

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelGeometry:
        """Read a Hugging Face ``config.json`` dict. Raises :class:`EstimatorError` naming the field."""
        return _parse_config(config)


# ====================================================================== parsing helpers
def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for dim in shape:
        out *= dim
    return out


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_tp(tensor_parallel: int) -> None:
    if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise errors.InvalidPlanRequestError(
            "tensor_parallel",
            f"must be a positive integer, got {tensor_parallel!r}",
        )


def _require_divisible(value: int, tp: int, field: str) -> None:
    if value % tp:
        raise errors.InvalidPlanRequestError(
            field,
            f"{value} is not divisible by tensor parallel {tp} (vLLM shards it evenly)",
        )


def _quantized_bytes(params: int, quant: QuantGeometry | None, elem_bytes: int) -> int:
    if quant is None:
        return params * elem_bytes
    data = _ceil_div(params * quant.weight_bits, 8)
    scales = _ceil_div(params, quant.group_size) * 2 if quant.group_size else 0
    return data + scales


def _positive_int(cfg: Mapping[str, Any], key: str, prefix: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise errors.InvalidModelConfigError(f"{prefix}{key}", "is required for KV-cache sizing but missing")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise errors.InvalidModelConfigError(f"{prefix}{key}", f"must be a positive integer, got {value!r}")
    return value


def _text_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    text = config.get("text_config")
    if isinstance(text, Mapping) and (text.get("hidden_size") or text.get("num_hidden_layers")):
        merged = dict(text)
        # Multimodal parents carry dtype and tie flags the text config may omit (Qwen3.5, seed 004 bug 1).
        for key in ("torch_dtype", "dtype", "tie_word_embeddings", "quantization_config"):
            if key not in merged and key in config:
                merged[key] = config[key]
        return merged, "text_config."
    if not isinstance(config, Mapping):
        raise errors.InvalidModelConfigError("config", "must be a JSON object (a config.json dict)")
    return dict(config), ""


def _layer_kinds(cfg: Mapping[str, Any], prefix: str, num_layers: int) -> tuple[LayerKind, ...]:
    layer_types = cfg.get("layer_types")
    pattern = cfg.get("hybrid_override_pattern")
    sliding_window = cfg.get("sliding_window")
    use_sliding = cfg.get("use_sliding_window", True)
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise errors.InvalidModelConfigError(
                f"{prefix}layer_types",
                f"must list one type per layer ({num_layers} = num_hidden_layers), "
                f"got {len(layer_types) if isinstance(layer_types, list) else type(layer_types).__name__}",
            )
        kinds: list[LayerKind] = []
        for i, name in enumerate(layer_types):
            if name not in _LAYER_TYPE_KINDS:
                raise errors.InvalidModelConfigError(
                    f"{prefix}layer_types[{i}]",
                    f"unknown layer type {name!r}; supported: {', '.join(sorted(_LAYER_TYPE_KINDS))}",
                )
            kind = _LAYER_TYPE_KINDS[name]
            if kind == "sliding_attention" and (use_sliding is False or not sliding_window):
                kind = "full_attention"
            kinds.append(kind)
        return tuple(kinds)
    if pattern is not None:
        if not isinstance(pattern, str) or len(pattern) != num_layers:
            raise errors.InvalidModelConfigError(
                f"{prefix}hybrid_override_pattern", f"must be a string of {num_layers} layer codes"
            )
        codes: dict[str, LayerKind] = {
            "M": "linear_attention",
            "*": "full_attention",
            "-": "none",
            "E": "none",
        }
        bad = sorted(set(pattern) - set(codes))
        if bad:
            raise errors.InvalidModelConfigError(
                f"{prefix}hybrid_override_pattern", f"unknown layer codes {bad}; supported: M * - E"
            )
        return tuple(codes[c] for c in pattern)
    interval = cfg.get("full_attention_interval")
    if interval is not None and "linear_num_value_heads" in cfg:
        if not isinstance(interval, int) or interval <= 0:
            raise errors.InvalidModelConfigError(
                f"{prefix}full_attention_interval", f"must be positive, got {interval!r}"
            )
        return tuple(
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
        )
    if sliding_window and use_sliding is not False:
        if not isinstance(sliding_window, int) or sliding_window <= 0:
            raise errors.InvalidModelConfigError(
                f"{prefix}sliding_window", f"must be a positive integer, got {sliding_window!r}"
            )
        model_type = str(cfg.get("model_type", ""))
        swp = cfg.get("sliding_window_pattern")
        if isinstance(swp, int) and swp > 0:  # Gemma-3: every swp-th layer is global
            return tuple(
                "full_attention" if (i + 1) % swp == 0 else "sliding_attention" for i in range(num_layers)
            )
        if model_type.startswith("gemma2"):  # Gemma-2: even layers slide, odd layers are global
            return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers))
        max_window_layers = cfg.get("max_window_layers")
        if model_type.startswith("qwen2") and isinstance(max_window_layers, int):
            # Qwen2: layers at index >= max_window_layers use the window (HF Qwen2Attention).
            return tuple(
                "sliding_attention" if i >= max_window_layers else "full_attention" for i in range(num_layers)
            )
        return tuple("sliding_attention" for _ in range(num_layers))
    return tuple("full_attention" for _ in range(num_layers))


def _linear_geometry(cfg: Mapping[str, Any], prefix: str, model_dtype: str) -> LinearAttentionGeometry | None:
    ssm_dtype_raw = cfg.get("mamba_ssm_dtype") or cfg.get("mamba_ssm_cache_dtype")
    if "linear_num_value_heads" in cfg:
        ssm_dtype = str(ssm_dtype_raw) if ssm_dtype_raw else model_dtype
        dtype_bytes(ssm_dtype, f"{prefix}mamba_ssm_dtype")
        return LinearAttentionGeometry(
            kind="gated_delta_net",
            conv_kernel=_positive_int(cfg, "linear_conv_kernel_dim", prefix, 4),
            conv_dtype=model_dtype,
            ssm_dtype=ssm_dtype,
            num_key_heads=_positive_int(cfg, "linear_num_key_heads", prefix),
            num_value_heads=_positive_int(cfg, "linear_num_value_heads", prefix),
            key_head_dim=_positive_int(cfg, "linear_key_head_dim", prefix),
            value_head_dim=_positive_int(cfg, "linear_value_head_dim", prefix),
        )
    if "mamba_num_heads" in cfg or "hybrid_override_pattern" in cfg:
        # NemotronH: vLLM defaults the SSM cache to float32 unless the config names a dtype.
        ssm_dtype = str(ssm_dtype_raw) if ssm_dtype_raw else "float32"
        dtype_bytes(ssm_dtype, f"{prefix}mamba_ssm_dtype")
        return LinearAttentionGeometry(
            kind="mamba2",
            conv_kernel=_positive_int(cfg, "conv_kernel", prefix, 4),
            conv_dtype=model_dtype,
            ssm_dtype=ssm_dtype,
            num_heads=_positive_int(cfg, "mamba_num_heads", prefix),
            head_dim=_positive_int(cfg, "mamba_head_dim", prefix),
            n_groups=_positive_int(cfg, "n_groups", prefix, 1),
            state_size=_positive_int(cfg, "ssm_state_size", prefix),
        )
    return None


def _moe_geometry(cfg: Mapping[str, Any], prefix: str, num_layers: int) -> MoEGeometry | None:
    num_experts = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    if not num_experts:
        return None
    top_k = cfg.get("num_experts_per_tok") or cfg.get("moe_topk") or cfg.get("top_k")
    if not top_k:
        raise errors.InvalidModelConfigError(
            f"{prefix}num_experts_per_tok", "is required when num_experts is set"
        )
    expert_inter = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")
    if not isinstance(expert_inter, int) or expert_inter <= 0:
        raise errors.InvalidModelConfigError(f"{prefix}moe_intermediate_size", "is required for a MoE config")
    shared = cfg.get("shared_expert_intermediate_size") or 0
    if cfg.get("n_shared_experts"):
        shared = int(cfg["n_shared_experts"]) * expert_inter
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step") or 1
    first_dense = cfg.get("first_k_dense_replace") or 0
    moe_layers = sum(
        1 for i in range(num_layers) if i not in mlp_only and i >= first_dense and (i + 1) % step == 0
    )
    return MoEGeometry(
        num_experts=int(num_experts),
        experts_per_token=int(top_k),
        expert_intermediate_size=expert_inter,
        shared_intermediate_size=int(shared),
        num_moe_layers=moe_layers,
    )


def _quant_geometry(cfg: Mapping[str, Any], prefix: str) -> QuantGeometry | None:
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    field = f"{prefix}quantization_config"
    if not isinstance(quant, Mapping):
        raise errors.InvalidModelConfigError(field, "must be an object")
    method = str(quant.get("quant_method", "")).lower()
    group = quant.get("group_size") if isinstance(quant.get("group_size"), int) else None
    group = group if group and group > 0 else None
    if method in ("fp8", "fbgemm_fp8", "modelopt"):
        return QuantGeometry(method=method, weight_bits=8)
    if method in ("gptq", "awq", "gptq_marlin", "awq_marlin", "auto-round"):
        return QuantGeometry(method=method, weight_bits=int(quant.get("bits", 4)), group_size=group or 128)
    if method == "bitsandbytes":
        return QuantGeometry(method=method, weight_bits=4 if quant.get("load_in_4bit") else 8, group_size=64)
    if method == "mxfp4":
        return QuantGeometry(method=method, weight_bits=4, group_size=32)
    if method == "compressed-tensors":
        for group_cfg in (quant.get("config_groups") or {}).values():
            weights = group_cfg.get("weights") or {}
            if weights.get("num_bits"):
                return QuantGeometry(
                    method=method, weight_bits=int(weights["num_bits"]), group_size=weights.get("group_size")
                )
        raise errors.InvalidModelConfigError(f"{field}.config_groups", "no weights.num_bits found")
    raise errors.InvalidModelConfigError(
        f"{field}.quant_method",
        f"unsupported quantization {method!r}; "
        "supported: fp8, gptq, awq, bitsandbytes, mxfp4, compressed-tensors",
    )


def _vision_params(config: Mapping[str, Any]) -> int:
    vision = config.get("vision_config")
    if not isinstance(vision, Mapping):
        return 0
    h = int(vision.get("hidden_size") or vision.get("embed_dim") or 0)
    depth = int(vision.get("depth") or vision.get("num_hidden_layers") or 0)
    if h <= 0 or depth <= 0:
        return 0
    inter = int(vision.get("intermediate_size") or 4 * h)
    patch = int(vision.get("patch_size") or 14)
    channels = int(vision.get("in_channels") or vision.get("num_channels") or 3)
    temporal = int(vision.get("temporal_patch_size") or 1)
    merge = int(vision.get("spatial_merge_size") or 1)
    out = int(vision.get("out_hidden_size") or h)
    blocks = depth * (4 * h * h + 2 * h * inter)
    patch_embed = channels * temporal * patch * patch * h
    merger = (h * merge * merge) ** 2 + h * merge * merge * out
    return blocks + patch_embed + merger


def _check_bounds(config: Mapping[str, Any]) -> None:
    """Refuse sizes above `api.MODEL_CONFIG_LIMITS` before anything is built per layer or expert: a
    config from a ConfigMap or a preset never met the CRD schema's bounds."""
    over = api.model_config_bound_violations(dict(config))
    if over:
        path, value, limit = over[0]
        raise errors.InvalidModelConfigError(path, api.bound_message(value, limit))


def _parse_config(config: Mapping[str, Any]) -> ModelGeometry:
    if not isinstance(config, Mapping):
        raise errors.InvalidModelConfigError("config", "must be a JSON object (a config.json dict)")
    _check_bounds(config)
    cfg, prefix = _text_config(config)
    raw_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or config.get("dtype")
    raw_dtype = raw_dtype or "bfloat16"
    dtype_bytes(str(raw_dtype), f"{prefix}torch_dtype")
    dtype = serving_dtype(str(raw_dtype))
    hidden = _positive_int(cfg, "hidden_size", prefix)
    num_layers = _positive_int(cfg, "num_hidden_layers", prefix)
    heads = _positive_int(cfg, "num_attention_heads", prefix)
    kv_heads = _positive_int(cfg, "num_key_value_heads", prefix, heads)
    if kv_heads > heads:
        raise errors.InvalidModelConfigError(
            f"{prefix}num_key_value_heads", f"{kv_heads} exceeds num_attention_heads {heads}"
        )
    head_dim_raw = cfg.get("head_dim")
    if isinstance(head_dim_raw, int) and not isinstance(head_dim_raw, bool) and head_dim_raw > 0:
        head_dim = head_dim_raw
    else:
        if hidden % heads:
            raise errors.InvalidModelConfigError(
                f"{prefix}head_dim",
                f"missing and hidden_size {hidden} is not divisible by num_attention_heads {heads}",
            )
        head_dim = hidden // heads
    vocab = _positive_int(cfg, "vocab_size", prefix)
    max_pos = _positive_int(cfg, "max_position_embeddings", prefix, cfg.get("seq_length") or 4096)
    kinds = _layer_kinds(cfg, prefix, num_layers)
    linear = _linear_geometry(cfg, prefix, dtype)
    if kinds.count("linear_attention") and linear is None:
        raise errors.InvalidModelConfigError(
            f"{prefix}layer_types",
            "names linear_attention layers but the config has no linear_num_value_heads or mamba_num_heads",
        )
    mla = None
    if cfg.get("kv_lora_rank"):
        mla = MLAGeometry(
            kv_lora_rank=_positive_int(cfg, "kv_lora_rank", prefix),
            qk_rope_head_dim=_positive_int(cfg, "qk_rope_head_dim", prefix),
            qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
            v_head_dim=_positive_int(cfg, "v_head_dim", prefix, head_dim),
            q_lora_rank=cfg.get("q_lora_rank") or None,
        )
        head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    sliding = cfg.get("sliding_window") if "sliding_attention" in kinds else None
    is_nemotron = "hybrid_override_pattern" in cfg
    num_mlp_layers = (
        sum(1 for c in cfg["hybrid_override_pattern"] if c in "-E") if is_nemotron else num_layers
    )
    moe = _moe_geometry(cfg, prefix, num_layers)
    inter = cfg.get("intermediate_size") or 0
    if moe is None and not isinstance(inter, int | float):
        raise errors.InvalidModelConfigError(
            f"{prefix}intermediate_size", f"must be an integer, got {inter!r}"
        )
    if moe is None and num_mlp_layers and int(inter) <= 0:
        raise errors.InvalidModelConfigError(f"{prefix}intermediate_size", "is required for a dense model")
    if moe is not None and cfg.get("moe_intermediate_size") is None:
        inter = 0  # Mixtral-style: intermediate_size is the expert width, no dense layers
    hidden_act = str(cfg.get("hidden_act") or cfg.get("mlp_hidden_act") or "silu")
    archs = config.get("architectures") or cfg.get("architectures") or ()
    return ModelGeometry(
        model_type=str(config.get("model_type") or cfg.get("model_type") or "unknown"),
        architectures=tuple(str(a) for a in archs),
        dtype=dtype,
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(inter),
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        gated_mlp=not (is_nemotron or hidden_act == "relu2"),
        attn_output_gate=bool(cfg.get("attn_output_gate", False)),
        layer_kinds=kinds,
        num_mlp_layers=num_mlp_layers,
        sliding_window_tokens=int(sliding) if sliding else None,
        mla=mla,
        linear=linear,
        moe=moe,
        quantization=_quant_geometry(cfg, prefix),
        vision_params=_vision_params(config),
    )

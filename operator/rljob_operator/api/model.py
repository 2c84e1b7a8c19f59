"""`spec.model`: where the weights and the config come from, the dtype, and LoRA or full fine-tuning."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import (
    Field,
    model_validator,
)

from rljob_operator.api.base import (
    TINY_TOKENIZER_VOCAB,
    CelRule,
    DataKey,
    Dtype,
    FinetuneMode,
    ObjectName,
    TinyTokenizer,
    _count,
    _Spec,
)


# --------------------------------------------------------------------------------------------
# spec.model
# --------------------------------------------------------------------------------------------
class PVCPathSource(_Spec):
    """Files on a PersistentVolumeClaim, mounted read-only into the pods."""

    claim_name: ObjectName = Field(description="Name of the PersistentVolumeClaim in the RLJob's namespace.")
    path: str = Field(
        min_length=1,
        max_length=1024,
        description="Path inside the volume (for a model: the directory holding config.json and the "
        "safetensors weights; for data: a .jsonl or .parquet file or a directory of them).",
    )


class SecretKeyRef(_Spec):
    """A key of a Secret in the RLJob's namespace."""

    name: ObjectName = Field(description="Name of the Secret.")
    key: DataKey = Field(description="Key inside the Secret whose value is used.")


class HubModelSource(_Spec):
    """A model downloaded from the Hugging Face Hub (or a mirror set by HF_ENDPOINT in the image)."""

    id: str = Field(
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z0-9][-._A-Za-z0-9]*(/[A-Za-z0-9][-._A-Za-z0-9]*)?$",
        description="Repository id, for example Qwen/Qwen3.5-4B.",
    )
    revision: str | None = Field(
        None,
        max_length=256,
        description="Branch, tag or commit to download. Default: the repository's main branch.",
    )
    token_secret_ref: SecretKeyRef | None = Field(
        None, description="Secret key holding a Hub access token, for gated or private repositories."
    )


class TinyModelSource(_Spec):
    """Build a small model with random weights from `spec.model.config` inside the pod.

    For CPU demos and tests: no download, no volume; a character-level tokenizer is built in code,
    so `spec.model.config.inline.vocab_size` must be at least its size (builtin-digits: 19 ids,
    builtin-char: 99 ids).
    """

    tokenizer: TinyTokenizer = Field(
        "builtin-char",
        description="Character-level tokenizer built in code: builtin-char (printable ASCII) or "
        "builtin-digits (digits and + - * = # and space, enough for toy-arithmetic).",
    )


class ModelSource(_Spec):
    """Where the weights come from. Set exactly one of pvc, hub or tiny."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="(has(self.pvc) ? 1 : 0) + (has(self.hub) ? 1 : 0) + (has(self.tiny) ? 1 : 0) == 1",
            message="spec.model.source: set exactly one of pvc, hub or tiny",
            check=lambda s: _count(s.pvc, s.hub, s.tiny) == 1,
        ),
    )

    pvc: PVCPathSource | None = Field(None, description="Weights in a directory on a PersistentVolumeClaim.")
    hub: HubModelSource | None = Field(None, description="Weights downloaded from the Hugging Face Hub.")
    tiny: TinyModelSource | None = Field(
        None,
        description="Random weights built from spec.model.config (write `tiny: {}`); for CPU demos and "
        "tests.",
    )


class ConfigMapKeyRef(_Spec):
    """A key of a ConfigMap in the RLJob's namespace holding a Hugging Face config.json."""

    name: ObjectName = Field(description="Name of the ConfigMap.")
    key: DataKey = Field("config.json", description="Key inside the ConfigMap.")


#: Upper bounds on the config.json numbers the estimator multiplies and iterates over: 8 to 16 times
#: the largest released model (Llama-3.1-405B: 126 layers, hidden 16384; DeepSeek-V3: 256 experts;
#: Gemma-3: 262144 ids; Llama-4-Scout: 10M positions), so no real config meets them, while one
#: RLJob can no longer ask the operator for a tuple of ten billion layers (docs/security.md). The
#: one table: the CRD schema (refused at `kubectl apply`), this model (`rljob validate`) and the
#: estimator (configs read from a ConfigMap or a preset) all read it.
MODEL_CONFIG_LIMITS: dict[str, int] = {
    "num_hidden_layers": 1024,
    "hidden_size": 131072,
    "intermediate_size": 1048576,
    "moe_intermediate_size": 262144,
    "vocab_size": 4194304,
    "num_attention_heads": 2048,
    "num_key_value_heads": 2048,
    "head_dim": 8192,
    "num_experts": 4096,
    "n_routed_experts": 4096,
    "num_local_experts": 4096,
    "num_experts_per_tok": 1024,
    "max_position_embeddings": 16777216,
}
#: Multimodal configs (Qwen3.5, Gemma-3) carry the language model's numbers here.
TEXT_CONFIG_KEY = "text_config"


def _bounded_properties() -> dict[str, Any]:
    return {
        key: {
            "type": "integer",
            "maximum": limit,
            "description": "A size the planner multiplies by (docs/security.md).",
        }
        for key, limit in MODEL_CONFIG_LIMITS.items()
    }


def _inline_schema() -> dict[str, Any]:
    """The bounded numbers of an inline config.json as schema properties (everything else open)."""
    nested = {
        "type": "object",
        "additionalProperties": True,
        "description": "The language model's config of a multimodal model (same bounds).",
        "properties": _bounded_properties(),
    }
    return {"properties": {**_bounded_properties(), TEXT_CONFIG_KEY: nested}}


def model_config_bound_violations(config: Any) -> list[tuple[str, int, int]]:
    """The numbers of `config` (a config.json dict) above `MODEL_CONFIG_LIMITS`, as (key path, value,
    limit); empty when there are none. Pure; the API model and the estimator both call it."""
    if not isinstance(config, dict):
        return []
    out = []
    for prefix, part in (("", config), (f"{TEXT_CONFIG_KEY}.", config.get(TEXT_CONFIG_KEY))):
        if not isinstance(part, dict):
            continue
        for key, limit in MODEL_CONFIG_LIMITS.items():
            value = part.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > limit:
                out.append((f"{prefix}{key}", value, limit))
    return out


def bound_message(value: int, limit: int) -> str:
    """The one wording of a bound a config.json number exceeds (the field is named by the caller)."""
    return (
        f"{value} is above the limit of {limit} (no released model comes near it): use the model's "
        "real config.json"
    )


class ModelConfigSource(_Spec):
    """Where the operator reads the model's config.json (architecture and sizes) for planning.

    Set exactly one of preset, inline or configMapRef.
    """

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="(has(self.preset) ? 1 : 0) + (has(self.inline) ? 1 : 0) + (has(self.configMapRef) ? 1 : 0) "
            "== 1",
            message="spec.model.config: set exactly one of preset, inline or configMapRef",
            check=lambda s: _count(s.preset, s.inline, s.config_map_ref) == 1,
        ),
    )

    preset: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="Name of a config.json shipped with the operator, for example Qwen/Qwen3.5-4B "
        "(`rljob plan --help` lists them).",
    )
    inline: dict[str, Any] | None = Field(
        None,
        description="The config.json content itself, as an object (any Hugging Face config fields; the "
        "sizes the planner multiplies are bounded, see MODEL_CONFIG_LIMITS in docs/security.md).",
        json_schema_extra=_inline_schema(),
    )
    config_map_ref: ConfigMapKeyRef | None = Field(
        None,
        description="A ConfigMap key holding config.json (create it with kubectl create configmap "
        "--from-file).",
    )

    @model_validator(mode="after")
    def _inline_within_bounds(self) -> ModelConfigSource:
        # The CRD schema refuses these at apply; this says the same to `rljob validate`.
        problems = model_config_bound_violations(self.inline)
        if problems:
            raise ValueError(
                "; ".join(f"spec.model.config.inline.{p}: {bound_message(v, m)}" for p, v, m in problems)
            )
        return self


class LoRASpec(_Spec):
    """Low-rank adapter settings (used when finetune.mode is lora)."""

    rank: int = Field(16, ge=1, le=1024, description="Adapter rank r.")
    alpha: int = Field(
        32, ge=1, le=4096, description="Scaling numerator; the update is scaled by alpha / rank."
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapter input, at least 0 and below 1 (1 drops every input).",
    )
    target_modules: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(
        default_factory=lambda: ["all-linear"],
        min_length=1,
        max_length=64,
        description="Module names to adapt (for example q_proj, v_proj); `all-linear` means every linear "
        "layer except the output head.",
    )


class FinetuneSpec(_Spec):
    """Which parameters train."""

    mode: FinetuneMode = Field("lora", description="lora trains low-rank adapters; full trains every weight.")
    lora: LoRASpec = Field(default_factory=LoRASpec, description="Adapter settings, used when mode is lora.")


class ModelSpec(_Spec):
    """The policy model: its weights, its architecture config, precision and what trains."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="self.dtype != 'float16'",
            message="spec.model.dtype float16 is not supported for training: fp16 gradients underflow "
            "without loss scaling, which rljob does not do; use bfloat16 (or float32)",
            field_path=".dtype",
            check=lambda s: s.dtype != "float16",
        ),
    )

    name: str = Field(
        min_length=1,
        max_length=256,
        description="Display and served model name, for example Qwen3.5-4B (shown in logs and metrics).",
    )
    source: ModelSource = Field(description="Where the weights come from: pvc, hub or tiny.")
    config: ModelConfigSource = Field(
        description="Where the operator reads config.json to plan memory: preset, inline or configMapRef."
    )
    dtype: Dtype = Field(
        "bfloat16",
        description="Compute precision of training and rollout: bfloat16 (what GPUs and NPUs train in) or "
        "float32. The trainer keeps fp32 master weights and optimizer state either way (mixed precision).",
    )
    finetune: FinetuneSpec = Field(default_factory=FinetuneSpec, description="LoRA or full fine-tuning.")

    @model_validator(mode="after")
    def _tiny_vocab_holds_its_tokenizer(self) -> ModelSpec:
        # The trainer's tiny model embeds the built-in tokenizer's ids: a smaller vocab_size makes
        # its first forward pass fail in the pod. Not CEL: the inline config has no schema.
        tiny, inline = self.source.tiny, self.config.inline
        if tiny is None or inline is None or not isinstance(inline.get("vocab_size"), int):
            return self
        needed = TINY_TOKENIZER_VOCAB[tiny.tokenizer]
        if inline["vocab_size"] < needed:
            raise ValueError(
                f"spec.model.config.inline.vocab_size is {inline['vocab_size']}, but the {tiny.tokenizer} "
                f"tokenizer has {needed} ids: raise vocab_size to at least {needed}"
            )
        return self

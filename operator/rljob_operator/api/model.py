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
        None, description="The config.json content itself, as an object (any Hugging Face config fields)."
    )
    config_map_ref: ConfigMapKeyRef | None = Field(
        None,
        description="A ConfigMap key holding config.json (create it with kubectl create configmap "
        "--from-file).",
    )


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

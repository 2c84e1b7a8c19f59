"""The RLJob API: pydantic models for `rljob.io/v1alpha1` `RLJob` spec and status.

Role: the single source of truth for the custom resource. Every field lives here with a
description (it becomes `kubectl explain` text), a default, an enum or a range; cross-field rules
are declared once as `CelRule`s next to the model they constrain and are enforced twice, by the
apiserver (as CEL `x-kubernetes-validations`) and by pydantic (so `rljob plan -f` and the
operator refuse exactly what `kubectl apply` refuses).

Callers: `rljob_operator.crd` turns these models into the CustomResourceDefinition in `crds/`;
the kopf handlers validate once at the edge with `RLJobSpec.model_validate(spec)` and write
`RLJobStatus.to_k8s()`; the estimator, builders, policy and the CLI take the typed models.

Conventions: Python names are snake_case, JSON names camelCase (`alias_generator=to_camel`); both
are accepted on input and `model_dump()` emits camelCase. Spec models are frozen, strict (a string
is never coerced into a number, as on the apiserver) and forbid unknown fields. Status models are
lenient (they parse what an older or newer operator wrote) and mutable.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from rljob_operator import quantity
from rljob_trainer import config as trainer_config

GROUP = "rljob.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLJob"
LIST_KIND = "RLJobList"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ["rlj"]
CATEGORIES = ["all", "rljob"]
CRD_NAME = f"{PLURAL}.{GROUP}"

# --------------------------------------------------------------------------------------------
# Enumerations (Literal aliases so they are plain strings in JSON and in Python comparisons).
# --------------------------------------------------------------------------------------------
Dtype = Literal["bfloat16", "float16", "float32"]
FinetuneMode = Literal["lora", "full"]
TinyTokenizer = Literal["builtin-char", "builtin-digits"]
LossNormalization = Literal["sequenceMean", "tokenMean", "sequenceSumNorm"]
BuiltinDataset = Literal["gsm8k-sample", "toy-arithmetic"]
RewardName = Literal["mathAccuracy", "format", "module"]
Packing = Literal["padded", "packed"]
MicroBatching = Literal["fixed", "dynamic"]
AcceleratorKind = Literal["nvidia", "ascend", "amd", "cpu"]
ResourceMode = Literal["static", "estimate", "adaptive"]
KVCacheDtype = Literal["auto", "fp8"]
AdaptiveSignal = Literal["integrated", "snapshot"]
TolerationOperator = Literal["Exists", "Equal"]
TaintEffect = Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]
RestartPolicyName = Literal["Never", "OnFailure"]
Phase = Literal["Pending", "Planning", "Queued", "Running", "Suspended", "Succeeded", "Failed"]
ConditionStatus = Literal["True", "False", "Unknown"]

PHASES: tuple[Phase, ...] = ("Pending", "Planning", "Queued", "Running", "Suspended", "Succeeded", "Failed")
FINISHED_PHASES: tuple[Phase, ...] = ("Succeeded", "Failed")

# Extended resource each accelerator kind requests; `resources.accelerator.resourceName` overrides.
DEFAULT_RESOURCE_NAMES: dict[str, str | None] = {
    "nvidia": "nvidia.com/gpu",
    "ascend": "huawei.com/Ascend910",
    "amd": "amd.com/gpu",
    "cpu": None,
}

# Ids of the trainer's built-in character tokenizers (rljob_trainer.modeling.CHARSETS + 3 specials).
TINY_TOKENIZER_VOCAB: dict[str, int] = {"builtin-char": 99, "builtin-digits": 19}
DEFAULT_TRAINER_IMAGE = "ghcr.io/rljob/rljob-trainer:0.1.0"

# --------------------------------------------------------------------------------------------
# Reusable constrained types.
# --------------------------------------------------------------------------------------------
# DNS-1123 subdomain: the names of PVCs, ConfigMaps, Secrets and PriorityClasses.
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ObjectName = Annotated[str, Field(min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN)]
# ConfigMap / Secret data keys.
DataKey = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")]
# Kubernetes resource.Quantity, as controller-gen renders it.
_QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


def _check_quantity(value: int | str) -> int | str:
    quantity.parse(value)  # the Kubernetes client's parser; the pattern above is the CRD's schema
    return value


Quantity = Annotated[
    int | str,
    AfterValidator(_check_quantity),
    WithJsonSchema(
        {
            "pattern": _QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    ),
]


def format_time(value: datetime) -> str:
    """Render a timestamp the way Kubernetes does (RFC 3339, UTC, whole seconds, `Z`)."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


Timestamp = Annotated[datetime, PlainSerializer(format_time, return_type=str, when_used="json")]


# --------------------------------------------------------------------------------------------
# Cross-field rules: one declaration, two enforcers (CEL on the apiserver, Python here).
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CelRule:
    """A cross-field rule of one object: `rule` is CEL over `self`, `check` the same in Python.

    `message` names the field and the fix; `field_path` (relative, like `.maxModelLen`) makes the
    apiserver report the error at that field instead of at the object.
    """

    rule: str
    message: str
    check: Callable[[Any], bool]
    field_path: str | None = None
    reason: Literal["FieldValueInvalid", "FieldValueRequired", "FieldValueForbidden"] | None = None

    def to_schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rule": self.rule, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        if self.reason:
            out["reason"] = self.reason
        return out


def _add_cel_rules(schema: dict[str, Any], cls: type[Any]) -> None:
    rules: tuple[CelRule, ...] = getattr(cls, "cel_rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [r.to_schema() for r in rules]


def _plain(value: Any) -> Any:
    """Deep copy of Mapping views as dicts (and of tuples as lists), for strict validation."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _count(*values: object) -> int:
    return sum(v is not None for v in values)


class _Model(BaseModel):
    """Shared config: camelCase JSON, both spellings accepted, camelCase out."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        serialize_by_alias=True,
        json_schema_extra=_add_cel_rules,
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = ()

    @model_validator(mode="after")
    def _check_cel_rules(self) -> Any:
        for rule in type(self).cel_rules:
            if not rule.check(self):
                # `field_path` rides in the error context so `describe_validation_error` can name the
                # field below this object, as the apiserver does with the rule's fieldPath.
                raise PydanticCustomError(
                    "cel_rule", "{message}", {"message": rule.message, "field_path": rule.field_path or ""}
                )
        return self

    def to_k8s(self) -> dict[str, Any]:
        """JSON-ready dict with camelCase keys and unset optionals left out (what the API stores)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class _Spec(_Model):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _accept_mappings(cls, data: Any) -> Any:
        # Strict mode takes only dicts; kopf hands over read-only Mapping views (kopf.Spec).
        return _plain(data) if isinstance(data, Mapping) and not isinstance(data, dict) else data


class _Status(_Model):
    model_config = ConfigDict(extra="ignore", frozen=False, strict=False)


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

    name: str = Field(
        min_length=1,
        max_length=256,
        description="Display and served model name, for example Qwen3.5-4B (shown in logs and metrics).",
    )
    source: ModelSource = Field(description="Where the weights come from: pvc, hub or tiny.")
    config: ModelConfigSource = Field(
        description="Where the operator reads config.json to plan memory: preset, inline or configMapRef."
    )
    dtype: Dtype = Field("bfloat16", description="Weight and compute precision of training and rollout.")
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


# --------------------------------------------------------------------------------------------
# spec.grpo, spec.lengths
# --------------------------------------------------------------------------------------------
class GRPOSpec(_Spec):
    """Group Relative Policy Optimization settings."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="(self.promptsPerStep * self.groupSize) % self.miniBatchesPerStep == 0",
            message="spec.grpo.miniBatchesPerStep must divide promptsPerStep x groupSize (the samples of "
            "a step); change miniBatchesPerStep or promptsPerStep",
            field_path=".miniBatchesPerStep",
            check=lambda s: (s.prompts_per_step * s.group_size) % s.mini_batches_per_step == 0,
        ),
    )

    group_size: int = Field(
        8,
        ge=2,
        le=1024,
        description="Completions sampled per prompt; advantages are relative within a group.",
    )
    prompts_per_step: int = Field(
        32,
        ge=1,
        le=65536,
        description="Prompts per optimizer step (a step trains on promptsPerStep x groupSize).",
    )
    max_steps: int = Field(
        100, ge=1, le=10_000_000, description="Optimizer steps to run; the job succeeds after them."
    )
    mini_batches_per_step: int = Field(
        1,
        ge=1,
        le=1024,
        description="Optimizer updates per step: the step's samples are split into this many mini-batches. "
        "Old log-probs are computed once, before the first update, so from the second update on the PPO "
        "ratio moves and clipRatioLow/High act.",
    )
    ppo_epochs: int = Field(
        1,
        ge=1,
        le=64,
        description="Passes over the step's mini-batches (updates per step: miniBatchesPerStep x ppoEpochs).",
    )
    learning_rate: float = Field(1.0e-6, gt=0.0, le=1.0, description="Peak learning rate of AdamW.")
    clip_ratio_low: float = Field(
        0.2, ge=0.0, le=1.0, description="Lower PPO clip: the ratio is clipped at 1 - clipRatioLow."
    )
    clip_ratio_high: float = Field(
        0.2,
        ge=0.0,
        le=10.0,
        description="Upper PPO clip: the ratio is clipped at 1 + clipRatioHigh (0.28 = DAPO).",
    )
    kl_coef: float = Field(
        0.0, ge=0.0, le=100.0, description="Weight of the KL penalty to the reference model; 0 disables it."
    )
    loss_normalization: LossNormalization = Field(
        "sequenceMean",
        description="How token losses are averaged: sequenceMean (mean per sequence, then over sequences: "
        "GRPO), tokenMean (over all tokens of the batch: DAPO) or sequenceSumNorm (token sums divided by "
        "lengths.maxCompletionTokens: Dr. GRPO).",
    )
    temperature: float = Field(
        1.0, gt=0.0, le=10.0, description="Sampling temperature of the rollout engines."
    )
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, description="Nucleus sampling probability mass of the rollout engines."
    )
    grad_clip: float = Field(
        1.0, ge=0.0, le=1.0e6, description="Max global gradient norm; 0 disables clipping."
    )
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed of data order, sampling and initialisation.")
    max_staleness: int | None = Field(
        None,
        ge=0,
        le=64,
        description="Bounded staleness of the rollout pipeline: 0 is synchronous (generate, then train); N "
        "lets dedicated rollout engines generate up to N steps ahead while the trainer trains, and no "
        "sample more than N weight updates old is trained on (1 = one-step-off). Engines colocated with "
        "training always stay synchronous. Default: 1 when the job can have dedicated engines, else 0.",
    )
    tis_cap: float = Field(
        2.0,
        ge=0.0,
        le=1000.0,
        description="Off-policy correction when maxStaleness > 0: truncated importance sampling, each "
        "token's loss weighted by min(pi_trainer / pi_rollout, tisCap) with the engine's log-probs "
        "(verl's TIS); 0 disables it.",
    )


class LengthsSpec(_Spec):
    """Token limits of prompts and completions."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.maxModelLen) || self.maxPromptTokens + self.maxCompletionTokens <= "
            "self.maxModelLen",
            message="spec.lengths.maxModelLen must be at least maxPromptTokens + maxCompletionTokens; "
            "raise maxModelLen or lower the token limits",
            field_path=".maxModelLen",
            check=lambda s: (
                s.max_model_len is None or s.max_prompt_tokens + s.max_completion_tokens <= s.max_model_len
            ),
        ),
    )

    max_prompt_tokens: int = Field(
        1024, ge=1, le=4_194_304, description="Longest prompt in tokens; longer prompts are dropped."
    )
    max_completion_tokens: int = Field(
        1024, ge=1, le=4_194_304, description="Most tokens generated per completion (the rollout cap)."
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        le=8_388_608,
        description="Context length of the rollout engines (vLLM max_model_len). Default: "
        "maxPromptTokens + maxCompletionTokens.",
    )


# --------------------------------------------------------------------------------------------
# spec.data, spec.reward
# --------------------------------------------------------------------------------------------
class BuiltinDataSource(_Spec):
    """A dataset shipped in the trainer image."""

    name: BuiltinDataset = Field(
        description="gsm8k-sample (a slice of GSM8K grade-school math) or toy-arithmetic (generated sums a "
        "tiny model learns on CPU in minutes)."
    )


class HubDataSource(_Spec):
    """A dataset downloaded from the Hugging Face Hub."""

    id: str = Field(
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z0-9][-._A-Za-z0-9]*(/[A-Za-z0-9][-._A-Za-z0-9]*)?$",
        description="Dataset repository id, for example openai/gsm8k.",
    )
    split: str = Field("train", min_length=1, max_length=128, description="Split to read.")
    subset: str | None = Field(
        None, max_length=128, description="Configuration (subset) name, for example main."
    )
    endpoint: str | None = Field(
        None,
        max_length=512,
        pattern=r"^https?://",
        description="Hub endpoint (HF_ENDPOINT), for a mirror or a private hub. Default: huggingface.co.",
    )
    token_secret_ref: SecretKeyRef | None = Field(
        None, description="Secret key holding a hub token for gated or private datasets (never inline)."
    )


class DataConfigMapRef(_Spec):
    """A key of a ConfigMap in the RLJob's namespace holding JSON Lines records."""

    name: ObjectName = Field(description="Name of the ConfigMap.")
    key: DataKey = Field("data.jsonl", description="Key inside the ConfigMap; its value is JSON Lines.")


class DataSource(_Spec):
    """Where prompts come from. Set exactly one of builtin, pvc, hub or configMapRef."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="(has(self.builtin) ? 1 : 0) + (has(self.pvc) ? 1 : 0) + (has(self.hub) ? 1 : 0) "
            "+ (has(self.configMapRef) ? 1 : 0) == 1",
            message="spec.data.source: set exactly one of builtin, pvc, hub or configMapRef",
            check=lambda s: _count(s.builtin, s.pvc, s.hub, s.config_map_ref) == 1,
        ),
    )

    builtin: BuiltinDataSource | None = Field(None, description="A dataset shipped in the trainer image.")
    pvc: PVCPathSource | None = Field(
        None,
        description="On a PersistentVolumeClaim: a .jsonl, .json, .parquet or .arrow file, a directory of "
        "them, or a folder written by datasets' save_to_disk.",
    )
    hub: HubDataSource | None = Field(None, description="A dataset from the Hugging Face Hub.")
    config_map_ref: DataConfigMapRef | None = Field(
        None, description="A small JSON Lines dataset in a ConfigMap."
    )


class DataSpec(_Spec):
    """Training prompts and reference answers."""

    source: DataSource = Field(description="Where records come from: builtin, pvc, hub or configMapRef.")
    prompt_field: str = Field(
        "prompt",
        min_length=1,
        max_length=128,
        description="Record field holding the prompt text (GSM8K: question).",
    )
    answer_field: str = Field(
        "answer",
        min_length=1,
        max_length=128,
        description="Record field holding the reference answer the reward compares to.",
    )
    chat_template: bool = Field(
        False,
        description="Render each prompt as a user message with the tokenizer's chat template (and the "
        "generation prompt), as chat models expect. The tokenizer must have a template.",
    )


class RewardFileConfigMapRef(_Spec):
    """A ConfigMap key holding a reward module's Python source."""

    name: ObjectName = Field(description="Name of the ConfigMap.")
    key: DataKey = Field(
        description="Key inside the ConfigMap whose value is the .py source, e.g. reward.py."
    )


class RewardModuleSpec(_Spec):
    """A user reward function, called once per step with the whole batch:
    `fn(prompts: list[str], completions: list[str], answers: list[str], **kwargs) -> list[float]`
    (one float per completion, like TRL's reward functions).

    Set exactly one of path, importPath, configMapRef or pvc.
    """

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="(has(self.path) ? 1 : 0) + (has(self.importPath) ? 1 : 0) + "
            "(has(self.configMapRef) ? 1 : 0) + (has(self.pvc) ? 1 : 0) == 1",
            message="spec.reward.functions[].module: set exactly one of path, importPath, configMapRef "
            "or pvc",
            check=lambda s: _count(s.path, s.import_path, s.config_map_ref, s.pvc) == 1,
        ),
    )

    path: str | None = Field(
        None, min_length=1, max_length=1024, description="A .py file inside the trainer image."
    )
    config_map_ref: RewardFileConfigMapRef | None = Field(
        None, description="A .py file in a ConfigMap key (mounted read-only into the trainer pods)."
    )
    pvc: PVCPathSource | None = Field(
        None, description="A .py file on a PersistentVolumeClaim (mounted read-only into the trainer pods)."
    )
    import_path: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$",
        description="Importable module, for example my_rewards.math.",
    )
    function: str = Field(
        "reward",
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Function name inside the module.",
    )


class RewardFunctionSpec(_Spec):
    """One reward term; the reward of a completion is the weighted sum of its terms."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="(self.name == 'module') == has(self.module)",
            message="spec.reward.functions[].module is required when name is module and forbidden otherwise",
            field_path=".module",
            check=lambda s: (s.name == "module") == (s.module is not None),
        ),
    )

    name: RewardName = Field(
        description="mathAccuracy (1 when the final number equals the answer), format (1 when the "
        "completion follows the reasoning/answer format) or module (a user function)."
    )
    weight: float = Field(1.0, ge=-1000.0, le=1000.0, description="Multiplier of this term.")
    module: RewardModuleSpec | None = Field(
        None, description="The user function; required when name is module."
    )


class RewardSpec(_Spec):
    """How completions are scored."""

    functions: list[RewardFunctionSpec] = Field(
        default_factory=lambda: [RewardFunctionSpec(name="mathAccuracy", weight=1.0)],
        min_length=1,
        max_length=16,
        description="Reward terms, summed with their weights.",
    )


# --------------------------------------------------------------------------------------------
# spec.batching
# --------------------------------------------------------------------------------------------
class BatchingSpec(_Spec):
    """How the trainer turns a step's samples into micro-batches and spreads them over ranks."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="self.microBatching != 'dynamic' || has(self.maxTokensPerMicroBatch)",
            message="spec.batching.maxTokensPerMicroBatch is required when microBatching is dynamic",
            field_path=".maxTokensPerMicroBatch",
            reason="FieldValueRequired",
            check=lambda s: s.micro_batching != "dynamic" or s.max_tokens_per_micro_batch is not None,
        ),
    )

    packing: Packing = Field(
        "padded",
        description="padded pads each micro-batch to its longest sample; packed concatenates samples.",
    )
    micro_batching: MicroBatching = Field(
        "fixed",
        description="fixed takes microBatchSize samples per micro-batch; dynamic fills each micro-batch up "
        "to "
        "maxTokensPerMicroBatch tokens.",
    )
    micro_batch_size: int = Field(
        4, ge=1, le=65536, description="Samples per micro-batch when microBatching is fixed."
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        le=67_108_864,
        description="Token budget per micro-batch; required when microBatching is dynamic, and at least "
        "maxPromptTokens + maxCompletionTokens.",
    )
    dp_balance: bool = Field(
        True,
        description="Reorder each mini-batch so every data-parallel rank gets a similar workload (rank "
        "sample "
        "counts and the loss are unchanged).",
    )


# --------------------------------------------------------------------------------------------
# spec.resources
# --------------------------------------------------------------------------------------------
class CustomAcceleratorSpec(_Spec):
    """Numbers of an accelerator missing from the catalog (or overrides of a catalog entry)."""

    memory_gib: float = Field(alias="memoryGiB", gt=0.0, le=65536.0, description="Device memory in GiB.")
    hbm_bandwidth_gbps: float = Field(
        alias="hbmBandwidthGBps", gt=0.0, le=1.0e6, description="Memory bandwidth in GB/s."
    )
    bf16_tflops: float = Field(alias="bf16TFLOPS", gt=0.0, le=1.0e6, description="Dense bf16 peak in TFLOPS.")


class AcceleratorSpec(_Spec):
    """The accelerator every trainer and rollout pod uses."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="self.kind == 'cpu' || has(self.model)",
            message="spec.resources.accelerator.model is required unless kind is cpu (a catalog name such as "
            "H100-80GB, or any name together with custom)",
            field_path=".model",
            reason="FieldValueRequired",
            check=lambda s: s.kind == "cpu" or s.model is not None,
        ),
    )

    kind: AcceleratorKind = Field(
        description="nvidia (nvidia.com/gpu), ascend (huawei.com/Ascend910), amd (amd.com/gpu) or cpu (no "
        "accelerator: pods request only spec.resources.cpu and memory)."
    )
    model: str | None = Field(
        None,
        min_length=1,
        max_length=63,
        pattern=r"^[A-Za-z0-9][-_.A-Za-z0-9]*$",
        description="Catalog name: H100-80GB, H200, B200, A100-40GB, A100-80GB, L40S, MI300X, Ascend910B3, "
        "...; with custom, any name.",
    )
    resource_name: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[a-zA-Z0-9]([-_.a-zA-Z0-9]*[a-zA-Z0-9])?$",
        description="Extended resource the pods request. Default by kind: nvidia.com/gpu, "
        "huawei.com/Ascend910, "
        "amd.com/gpu.",
    )
    custom: CustomAcceleratorSpec | None = Field(
        None, description="Memory, bandwidth and peak of an accelerator missing from the catalog."
    )


class StaticSplitSpec(_Spec):
    """An explicit split of the accelerators (mode static)."""

    trainer_accelerators: int = Field(ge=1, le=65536, description="Accelerators for the trainer ranks.")
    rollout_accelerators: int = Field(
        ge=0,
        le=65536,
        description="Accelerators for dedicated rollout engines; 0 means rollout runs on the trainer "
        "accelerators (a colocated engine that sleeps during training).",
    )


WeightSyncMode = Literal["collective", "objectStore"]
LoRASyncMode = Literal["adapter", "merged"]
#: vLLM's largest max_lora_rank: vLLM engines serving the adapter (loraSync adapter) cannot hold a
#: larger rank (the trainer's rule, `rljob_trainer.config.vllm_max_lora_rank`, one list for both).
VLLM_MAX_LORA_RANK = trainer_config.VLLM_MAX_LORA_RANKS[-1]


class RolloutSpec(_Spec):
    """Rollout (vLLM) engine settings; unset numbers are chosen by the estimator."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.maxNumSeqs) || !has(self.maxNumBatchedTokens) || self.maxNumBatchedTokens >= "
            "self.maxNumSeqs",
            message="spec.resources.rollout.maxNumBatchedTokens must be at least maxNumSeqs (one token per "
            "decoding sequence); raise maxNumBatchedTokens or lower maxNumSeqs",
            field_path=".maxNumBatchedTokens",
            check=lambda s: (
                s.max_num_seqs is None
                or s.max_num_batched_tokens is None
                or s.max_num_batched_tokens >= s.max_num_seqs
            ),
        ),
    )

    tensor_parallel: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Accelerators per rollout engine; must divide acceleratorsPerNode. Default: the smallest "
        "size whose memory holds the weights and a useful KV cache.",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="Fraction of device memory a rollout engine may use (vLLM gpu_memory_utilization).",
    )
    kv_cache_dtype: KVCacheDtype = Field(
        "auto", description="KV cache precision: auto (the model dtype) or fp8."
    )
    max_num_seqs: int | None = Field(
        None,
        ge=1,
        le=1_048_576,
        description="Override: most sequences an engine decodes at once (vLLM max_num_seqs).",
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        le=67_108_864,
        description="Override: most tokens in one engine step, i.e. one prefill's length (vLLM "
        "max_num_batched_tokens). Default: min(KV capacity, max model length).",
    )
    enable_sleep_mode: bool = Field(
        True,
        description="vLLM sleep mode for engines colocated with training: they sleep (level 2) while the "
        "trainer trains and reload weights when they wake. false: they never sleep, and stay awake "
        "beside the trainer.",
    )
    drain_grace_seconds: int = Field(
        300,
        ge=0,
        le=86_400,
        description="Two-phase scale-down: after adaptive mode lowers the dedicated engines, a rollout pod "
        "above the target is deleted once the driver reports it released (no engine, no request left on "
        "it), or this many seconds after the decision without that acknowledgement. 0: at once.",
    )
    engine_timeout_seconds: float = Field(
        600.0,
        gt=0.0,
        le=86400.0,
        description="A dedicated rollout engine whose generate or weight-sync call runs longer than this is "
        "taken as hung: the driver drops it, requeues its requests and reports its pod lost.",
    )
    weight_sync: WeightSyncMode = Field(
        "collective",
        description="How new weights reach rollout engines: collective (one torch.distributed group per "
        "engine, bucketed broadcast: gloo on CPU, NCCL on GPU, HCCL on Ascend) or objectStore (the "
        "fallback: one whole-model dict through Ray's object store).",
    )
    lora_sync: LoRASyncMode = Field(
        "adapter",
        description="With model.finetune.mode lora: adapter (the engines serve the LoRA adapter on the base "
        "model, vLLM enable_lora, so a weight sync sends only the adapter; engines colocated with training "
        "then sleep at level 1, keeping the base in host memory) or merged (the engines serve the merged "
        "model, and every sync sends all weights).",
    )


class AdaptiveSpec(_Spec):
    """Adaptive mode: at each weight sync, wake the colocated engine or add rollout engines under pressure."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="self.scaleUpAfterPressuredSyncPoints >= self.wakeAfterPressuredSyncPoints",
            message="spec.resources.adaptive.scaleUpAfterPressuredSyncPoints must be at least "
            "wakeAfterPressuredSyncPoints (wake the colocated engine before adding engines)",
            field_path=".scaleUpAfterPressuredSyncPoints",
            check=lambda s: s.scale_up_after_pressured_sync_points >= s.wake_after_pressured_sync_points,
        ),
    )

    max_rollout_engines: int | None = Field(
        None,
        ge=0,
        le=65536,
        description="Most dedicated rollout engines. Default: as many as idle accelerators allow.",
    )
    signal: AdaptiveSignal = Field(
        "integrated",
        description="integrated measures load over the whole interval between sync points; snapshot reads "
        "it only at the sync point (the seed's rule, which misses generation that already finished).",
    )
    busy_threshold: float = Field(
        1.0,
        ge=0.0,
        le=1.0e6,
        description="Mean in-flight requests per engine at or above which rollout counts as busy.",
    )
    wait_threshold: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="Fraction of the interval the trainer waited for data at or above which it counts as "
        "starved.",
    )
    wake_after_pressured_sync_points: int = Field(
        2,
        ge=1,
        le=1000,
        description="Consecutive pressured sync points (busy and starved) before the colocated engine wakes.",
    )
    scale_up_after_pressured_sync_points: int = Field(
        4,
        ge=1,
        le=1000,
        description="Consecutive pressured sync points before an engine is added on idle accelerators.",
    )
    calm_sync_points_before_scale_down: int = Field(
        3,
        ge=1,
        le=1000,
        description="Consecutive calm sync points before an added engine is removed or the colocated one "
        "sleeps.",
    )
    cooldown_seconds: int = Field(
        60, ge=0, le=86400, description="Minimum seconds between two scaling decisions."
    )


class ResourcesSpec(_Spec):
    """Accelerators, how they split between trainer and rollout, and engine settings."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="self.mode != 'static' || has(self.static)",
            message="spec.resources.static (trainerAccelerators, rolloutAccelerators) is required when mode "
            "is static",
            field_path=".static",
            reason="FieldValueRequired",
            check=lambda s: s.mode != "static" or s.static is not None,
        ),
        CelRule(
            rule="self.totalAccelerators % self.acceleratorsPerNode == 0",
            message="spec.resources.acceleratorsPerNode must divide totalAccelerators (whole nodes per job)",
            field_path=".acceleratorsPerNode",
            check=lambda s: s.total_accelerators % s.accelerators_per_node == 0,
        ),
        CelRule(
            rule="!has(self.rollout.tensorParallel) || self.acceleratorsPerNode % "
            "self.rollout.tensorParallel == 0",
            message="spec.resources.rollout.tensorParallel must divide acceleratorsPerNode (an engine stays "
            "on one node)",
            field_path=".rollout.tensorParallel",
            check=lambda s: (
                s.rollout.tensor_parallel is None or s.accelerators_per_node % s.rollout.tensor_parallel == 0
            ),
        ),
        CelRule(
            rule="!has(self.static) || self.static.trainerAccelerators + self.static.rolloutAccelerators "
            "<= self.totalAccelerators",
            message="spec.resources.static: trainerAccelerators + rolloutAccelerators must not exceed "
            "totalAccelerators",
            field_path=".static",
            check=lambda s: (
                s.static is None
                or s.static.trainer_accelerators + s.static.rollout_accelerators <= s.total_accelerators
            ),
        ),
        CelRule(
            rule="!has(self.static) || !has(self.rollout.tensorParallel) "
            "|| self.static.rolloutAccelerators % self.rollout.tensorParallel == 0",
            message="spec.resources.static.rolloutAccelerators must be a multiple of rollout.tensorParallel",
            field_path=".static.rolloutAccelerators",
            check=lambda s: (
                s.static is None
                or s.rollout.tensor_parallel is None
                or s.static.rollout_accelerators % s.rollout.tensor_parallel == 0
            ),
        ),
    )

    accelerator: AcceleratorSpec = Field(description="Accelerator kind and model of every pod.")
    total_accelerators: int = Field(
        ge=1, le=65536, description="Accelerators the job may use in all (CPU jobs: worker processes)."
    )
    accelerators_per_node: int = Field(
        8, ge=1, le=64, description="Accelerators per pod (one pod per node); must divide totalAccelerators."
    )
    mode: ResourceMode = Field(
        "estimate",
        description="static uses the static split; estimate sizes trainer and rollout once before launch; "
        "adaptive also wakes the colocated engine and adds engines at weight syncs when rollout is the "
        "bottleneck.",
    )
    static: StaticSplitSpec | None = Field(
        None, description="The explicit split; required when mode is static."
    )
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec, description="Rollout engine settings and overrides."
    )
    adaptive: AdaptiveSpec = Field(default_factory=AdaptiveSpec, description="Thresholds of adaptive mode.")
    cpu: Quantity | None = Field(
        None,
        description="CPU request and limit per pod, for example 4 or 500m. Default: none for accelerator "
        "jobs, 1 for cpu jobs.",
    )
    memory: Quantity | None = Field(
        None,
        description="Memory request and limit per pod, for example 8Gi. Default: none for accelerator jobs, "
        "2Gi for cpu jobs.",
    )
    extra_resources: dict[str, Quantity] = Field(
        default_factory=dict,
        description="More resources each pod requests and is limited to, for example hugepages-2Mi: 1Gi or "
        "an RDMA device plugin's resource. Default: the node pool's (spec.pool).",
    )


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
        min_length=1, max_length=2048, description="Tracking server (http(s)://...) or a file: store."
    )
    experiment: str = Field("rljob", min_length=1, max_length=256, description="Experiment name.")
    run_name: str | None = Field(
        None, min_length=1, max_length=256, description="Run name. Default: the RLJob's name."
    )
    token_secret_ref: SecretKeyRef | None = Field(
        None, description="Secret key holding a tracking token (becomes MLFLOW_TRACKING_TOKEN)."
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
            rule="self.resources.accelerator.kind == 'cpu' || self.model.finetune.mode != 'lora' || "
            "self.resources.rollout.loraSync != 'adapter' || "
            f"self.model.finetune.lora.rank <= {VLLM_MAX_LORA_RANK}",
            message=f"spec.model.finetune.lora.rank above {VLLM_MAX_LORA_RANK} cannot be served by vLLM "
            "engines (vLLM's largest max_lora_rank); lower the rank or set spec.resources.rollout.loraSync "
            "to merged",
            field_path=".model.finetune.lora.rank",
            check=lambda s: (
                s.resources.accelerator.kind == "cpu"
                or s.model.finetune.mode != "lora"
                or s.resources.rollout.lora_sync != "adapter"
                or s.model.finetune.lora.rank <= VLLM_MAX_LORA_RANK
            ),
        ),
    )

    model: ModelSpec = Field(description="The policy model: weights, config, dtype and fine-tuning mode.")
    grpo: GRPOSpec = Field(default_factory=GRPOSpec, description="GRPO algorithm settings.")
    lengths: LengthsSpec = Field(
        default_factory=LengthsSpec, description="Prompt, completion and context token limits."
    )
    data: DataSpec = Field(description="Prompts and reference answers.")
    reward: RewardSpec = Field(default_factory=RewardSpec, description="Reward functions and weights.")
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


# --------------------------------------------------------------------------------------------
# Status
# --------------------------------------------------------------------------------------------
class Condition(_Status):
    """A condition in the Kubernetes API conventions (metav1.Condition)."""

    type: str = Field(
        min_length=1,
        max_length=316,
        pattern=r"^([a-z0-9.-]+/)?[A-Za-z][A-Za-z0-9]*$",
        description="Condition type in CamelCase, for example Planned, Ready, Progressing.",
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        min_length=1,
        max_length=1024,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        description="CamelCase reason for the last transition, for example EstimateFailed.",
    )
    message: str = Field(
        "", max_length=32768, description="Human-readable detail naming the field and the fix."
    )
    last_transition_time: Timestamp = Field(description="When status last changed.")
    observed_generation: int | None = Field(
        None, ge=0, description="metadata.generation the condition was computed from."
    )


class PlanStatus(_Status):
    """The trainer/rollout plan the estimator (or the static split) chose."""

    trainer_accelerators: int | None = Field(None, ge=0, description="Accelerators of the trainer ranks.")
    rollout_accelerators: int | None = Field(
        None, ge=0, description="Accelerators of dedicated rollout engines."
    )
    rollout_engines: int | None = Field(None, ge=0, description="Dedicated rollout engines.")
    shared_engines: int | None = Field(
        None, ge=0, description="Rollout engines colocated (sleeping) on trainer accelerators."
    )
    tensor_parallel: int | None = Field(None, ge=1, description="Accelerators per rollout engine.")
    kv_bytes_per_token: int | None = Field(
        None, ge=0, description="KV cache bytes per token on one accelerator of an engine."
    )
    kv_cache_tokens: int | None = Field(None, ge=0, description="Tokens the KV cache of one engine holds.")
    max_num_seqs: int | None = Field(None, ge=0, description="vLLM max_num_seqs per engine.")
    max_num_batched_tokens: int | None = Field(
        None, ge=0, description="vLLM max_num_batched_tokens per engine."
    )
    reasons: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Why the estimator chose these numbers, one line each.",
    )


class DrainingPod(_Status):
    """A rollout pod the operator waits on before deleting it (two-phase scale-down)."""

    index: int = Field(..., ge=0, description="Rollout pod index (pod <job>-rollout-<index>).")
    since: Timestamp = Field(..., description="When the target dropped below it: the drain's start.")


class ReplacementBackoff(_Status):
    """A rollout pod recreated alone after its engine was lost: how often in a row, and when its
    replacement pod may be created."""

    index: int = Field(..., ge=0, description="Rollout pod index (pod <job>-rollout-<index>).")
    attempt: int = Field(..., ge=0, description="The run attempt the losses were counted in.")
    replacements: int = Field(
        ..., ge=1, description="Times in a row its engine was lost and the pod recreated alone."
    )
    not_before: Timestamp = Field(
        ...,
        description="The replacement pod is not created before this time: at once after the first loss, "
        "then spec.restartPolicy's backoff (initialBackoffSeconds doubling up to maxBackoffSeconds).",
    )


class RolloutStatus(_Status):
    """Rollout engines now and what adaptive mode last decided."""

    shared_engines: int | None = Field(None, ge=0, description="Colocated engines on trainer accelerators.")
    shared_engines_awake: int | None = Field(None, ge=0, description="Colocated engines awake (serving) now.")
    dedicated_engines: int | None = Field(None, ge=0, description="Dedicated engines running now.")
    desired_shared_awake: int | None = Field(
        None, ge=0, description="Colocated engines the policy wants awake."
    )
    desired_dedicated_engines: int | None = Field(
        None, ge=0, description="Dedicated engines the policy wants."
    )
    idle_accelerators: int | None = Field(None, ge=0, description="Accelerators of the job running nothing.")
    engines_awake_total: str | None = Field(
        None,
        description="Engines serving / all engines, for example 3/4 (filled from the counts above).",
    )
    last_decision: str | None = Field(
        None, description="Last adaptive decision, for example Wake, ScaleUp, Hold."
    )
    last_decision_reason: str | None = Field(
        None, description="Why, with the measured signal and thresholds."
    )
    last_decision_time: Timestamp | None = Field(None, description="When the last decision was made.")
    draining_pods: list[DrainingPod] | None = Field(
        None,
        description="Rollout pods above the dedicated target, kept until the driver releases them "
        "(two-phase scale-down) or resources.rollout.drainGraceSeconds pass.",
    )
    replaced_pods: int | None = Field(
        None,
        ge=0,
        description="Rollout pods recreated alone after their engine was lost (failed, evicted, deleted or "
        "reported lost by the driver); never a gang restart, never counted in failures.",
    )
    replacement_backoff: list[ReplacementBackoff] | None = Field(
        None,
        max_length=1024,
        description="Rollout pods recreated alone, each with its own backoff (a crash-looping engine waits, "
        "the gang does not); an entry goes once its pod has run for 2 × restartPolicy.maxBackoffSeconds.",
    )

    @model_validator(mode="after")
    def _fill_engines_awake_total(self) -> RolloutStatus:
        if self.shared_engines is not None or self.dedicated_engines is not None:
            awake = (self.shared_engines_awake or 0) + (self.dedicated_engines or 0)
            total = (self.shared_engines or 0) + (self.dedicated_engines or 0)
            self.engines_awake_total = f"{awake}/{total}"
        return self


class QueueStatus(_Status):
    """Where Kueue has the job's Workload (jobs labelled kueue.x-k8s.io/queue-name)."""

    name: str = Field(description="The LocalQueue (label kueue.x-k8s.io/queue-name).")
    workload: str = Field(description="The job's core Workload (trainer + minimum rollout pods).")
    admitted: bool = Field(False, description="Kueue admitted the Workload: the pods may run.")
    cluster_queue: str | None = Field(None, description="The ClusterQueue that admitted it.")
    flavors: list[str] = Field(
        default_factory=list, max_length=64, description="ResourceFlavors the pods were admitted to."
    )
    extra_engines_admitted: int | None = Field(
        None, ge=0, description="Extra dedicated engines (adaptive mode) whose own Workloads are admitted."
    )
    message: str | None = Field(
        None, max_length=1024, description="Kueue's word on the Workload while it waits (quota, eviction)."
    )


class CheckpointRequest(_Status):
    """The operator asks the driver to checkpoint now (cooperative preemption): Kueue evicted or
    preempted the job's Workload. The driver reads it at every sync point, saves a checkpoint and
    acknowledges the id (SyncReport checkpointAck/checkpointAckStep); the pods go once it has, or
    after spec.preemption.checkpointGraceSeconds."""

    id: str = Field(description="Unique per eviction; the driver acknowledges this id.")
    reason: str = Field(description="Why, for example Preempted (Kueue's Evicted reason).")
    request_time: Timestamp = Field(description="When the operator asked; the grace period runs from here.")


class ProgressStatus(_Status):
    """Training progress, reported by the driver at each sync point."""

    step: int | None = Field(None, ge=0, description="Optimizer steps done.")
    max_steps: int | None = Field(None, ge=0, description="Steps the job runs (spec.grpo.maxSteps).")
    mean_reward: float | None = Field(None, description="Mean reward of the last step's completions.")
    loss: float | None = Field(None, description="Policy loss of the last step.")
    tokens_per_second: float | None = Field(
        None, ge=0.0, description="Generated tokens per second over the last step."
    )
    last_sync_time: Timestamp | None = Field(
        None, description="When weights were last synced to the rollout engines."
    )
    export_path: str | None = Field(
        None, description="Newest Hugging Face export in the trainer pod, for example /checkpoints/hf/final."
    )


class RLJobStatus(_Status):
    """Observed state of an RLJob, written only by the operator."""

    phase: Phase | None = Field(
        None,
        description="Pending, Planning, Queued (waiting for Kueue to admit its Workload), Running, "
        "Suspended, Succeeded or Failed.",
    )
    observed_generation: int | None = Field(
        None, ge=0, description="metadata.generation this status reflects."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=32,
        description="Latest observations of the job's state, one per type.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    plan: PlanStatus | None = Field(None, description="The accelerator and engine plan in force.")
    rollout: RolloutStatus | None = Field(None, description="Rollout engines and the last adaptive decision.")
    progress: ProgressStatus | None = Field(None, description="Training progress.")
    queue: QueueStatus | None = Field(
        None, description="Kueue admission (only for jobs labelled kueue.x-k8s.io/queue-name)."
    )
    checkpoint_request: CheckpointRequest | None = Field(
        None, description="A pending request to the driver to checkpoint now (Kueue is preempting the job)."
    )
    restarts: int | None = Field(
        None,
        ge=0,
        description="Times the job's pods were restarted, after a failure or a disruption (the run "
        "attempt stamped on pods).",
    )
    failures: int | None = Field(
        None,
        ge=0,
        description="Pod failures counted against spec.restartPolicy.backoffLimit; evictions, "
        "preemptions and lost nodes are disruptions and are not counted.",
    )
    disruptions: int | None = Field(
        None, ge=0, description="Gang restarts after an eviction, a preemption or a lost node."
    )
    last_failure: str | None = Field(
        None,
        max_length=1024,
        description="The cause of the last counted failure; the same deterministic cause twice in a "
        "row ends the job.",
    )
    start_time: Timestamp | None = Field(None, description="When the job's pods were first created.")
    completion_time: Timestamp | None = Field(None, description="When the job succeeded or failed.")
    last_checkpoint_step: int | None = Field(
        None, ge=0, description="Step of the newest complete checkpoint."
    )


def set_condition(conditions: Sequence[Condition], condition: Condition) -> list[Condition]:
    """Return `conditions` with `condition` in place of the one of the same type.

    Keeps the old `lastTransitionTime` when the status did not change (the API convention), so a
    caller can pass `now` on every reconcile without making the status churn.
    """
    out: list[Condition] = []
    replaced = False
    for old in conditions:
        if old.type != condition.type:
            out.append(old)
            continue
        new = condition
        if old.status == condition.status:
            new = condition.model_copy(update={"last_transition_time": old.last_transition_time})
        out.append(new)
        replaced = True
    if not replaced:
        out.append(condition)
    return out


def find_condition(conditions: Sequence[Condition], type_: str) -> Condition | None:
    """The condition of `type_`, or None."""
    return next((c for c in conditions if c.type == type_), None)


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


# --------------------------------------------------------------------------------------------
# YAML: PyYAML follows YAML 1.1 and reads `1e-6` as a string; kubectl (YAML 1.2) reads a number.
# --------------------------------------------------------------------------------------------
class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader that resolves floats like YAML 1.2 (and kubectl) do."""


_Yaml12Loader.yaml_implicit_resolvers = {
    k: [(tag, regexp) for tag, regexp in v if tag != "tag:yaml.org,2002:float"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def load_manifests(text: str) -> list[dict[str, Any]]:
    """Parse a (multi-document) YAML manifest with kubectl's number rules; skips empty documents."""
    return [doc for doc in yaml.load_all(text, Loader=_Yaml12Loader) if doc]

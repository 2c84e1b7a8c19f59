"""What every part of the RLJob API shares: the group/version/kind, enumerations, constrained
types, the `CelRule` declaration and the base models (`_Spec` frozen and strict, `_Status` lenient).

Also the YAML 1.2 manifest loader (`load_manifests`), so `1e-6` reads as a number as in kubectl.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from rljob_operator import quantity

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
RewardName = Literal["mathAccuracy", "format", "reasoningGym", "module"]
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

# Ids of the trainer's built-in character tokenizers (rljob_trainer.model.modeling.CHARSETS + 3 specials).
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

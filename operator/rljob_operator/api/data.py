"""`spec.data` and `spec.reward`: the prompts (builtin, hub, ConfigMap or volume) and the reward functions."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from rljob_operator.api.base import BuiltinDataset, CelRule, DataKey, ObjectName, RewardName, _count, _Spec
from rljob_operator.api.model import PVCPathSource, SecretKeyRef


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

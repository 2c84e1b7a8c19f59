"""`spec.data` and `spec.reward`: the prompts (builtin, hub, ConfigMap, volume or a reasoning-gym task) and
the reward functions."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from rljob_operator.api.base import (
    BuiltinDataset,
    CelRule,
    DataKey,
    Dtype,
    ObjectName,
    RewardName,
    _count,
    _Spec,
)
from rljob_operator.api.model import ModelConfigSource, ModelSource, PVCPathSource, SecretKeyRef


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


#: A reasoning-gym task config's values are scalars (its *Config dataclass fields), at most this many.
REASONING_GYM_CONFIG_MAX_FIELDS = 32


class ReasoningGymDataSource(_Spec):
    """A reasoning-gym task, generated in the trainer pod (offline: the generators ship in the trainer
    image). Item i of (task, config, seed) is always the same item, so spec.evaluation takes the same
    task with another seed as held-out prompts (items that repeat a training question are left out).
    Score it with the reward reasoningGym (the task's own score_answer)."""

    task: str = Field(
        min_length=1,
        max_length=64,
        pattern=r"^[a-z][a-z0-9_]*$",
        description="The task's name in reasoning-gym, for example chain_sum, basic_arithmetic, countdown "
        "or gsm_symbolic (the trainer names the valid ones if it is not one).",
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="The task's config fields (its *Config dataclass, without seed and size), for example "
        "{min_terms: 2, max_terms: 2, max_digits: 2} for chain_sum; numbers, strings and booleans.",
        # Not CEL: size() has no overload for an object whose fields the schema leaves open (the
        # apiserver refused the CRD); maxProperties is the schema's own bound on the field count.
        json_schema_extra={"maxProperties": REASONING_GYM_CONFIG_MAX_FIELDS},
    )
    size: int = Field(1000, ge=1, le=1_000_000, description="Items generated.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="The dataset's seed (item i comes from seed + i).")
    answer_format: Literal["answerTag", "answerTagOrLastNumber"] = Field(
        "answerTag",
        description="How the reward reads a completion's answer: answerTag, the last <answer>...</answer> "
        "(reasoning-gym's convention; no tag scores 0), or answerTagOrLastNumber, the tag when there is one, "
        "else the completion's last number (tasks answered by a number, for models that state it in prose).",
    )

    @model_validator(mode="after")
    def _scalar_config(self) -> ReasoningGymDataSource:
        bad = [k for k, v in self.config.items() if not isinstance(v, (int, float, str, bool))]
        if bad:
            raise ValueError(
                f"spec.data.source.reasoningGym.config.{bad[0]}: a task's config values are numbers, strings "
                "or booleans"
            )
        if len(self.config) > REASONING_GYM_CONFIG_MAX_FIELDS:
            raise ValueError(
                f"spec.data.source.reasoningGym.config: at most {REASONING_GYM_CONFIG_MAX_FIELDS} fields"
            )
        return self


class DataSource(_Spec):
    """Where prompts come from. Set exactly one of builtin, pvc, hub, configMapRef or reasoningGym."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="(has(self.builtin) ? 1 : 0) + (has(self.pvc) ? 1 : 0) + (has(self.hub) ? 1 : 0) "
            "+ (has(self.configMapRef) ? 1 : 0) + (has(self.reasoningGym) ? 1 : 0) == 1",
            message="spec.data.source: set exactly one of builtin, pvc, hub, configMapRef or reasoningGym",
            check=lambda s: _count(s.builtin, s.pvc, s.hub, s.config_map_ref, s.reasoning_gym) == 1,
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
    reasoning_gym: ReasoningGymDataSource | None = Field(
        None, description="A reasoning-gym task generated in the trainer pod (offline, seeded)."
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
    system_prompt: str | None = Field(
        None,
        min_length=1,
        max_length=16384,
        description="With chatTemplate: a system message before each prompt. Default: the template's own "
        "(if it has one).",
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
        "completion follows the reasoning/answer format), reasoningGym (a reasoning-gym task's own "
        "score_answer, for data.source.reasoningGym) or module (a user function)."
    )
    weight: float = Field(1.0, ge=-1000.0, le=1000.0, description="Multiplier of this term.")
    module: RewardModuleSpec | None = Field(
        None, description="The user function; required when name is module."
    )


JudgeKind = Literal["llm", "rewardModel"]
#: The placeholders a judge's promptTemplate may use; {response} is required.
JUDGE_TEMPLATE_FIELDS = ("prompt", "response", "answer")


class JudgeModelSpec(_Spec):
    """The judge's model: where its weights and config.json come from (as spec.model's)."""

    name: str = Field(
        min_length=1, max_length=256, description="Display name of the judge model, for example Qwen3-8B."
    )
    source: ModelSource = Field(description="Where the weights come from: pvc, hub or tiny.")
    config: ModelConfigSource = Field(
        description="Where the operator reads its config.json to size the judge's engines: preset, inline "
        "or configMapRef."
    )
    dtype: Dtype = Field("bfloat16", description="Serving precision of the judge's engines.")


class JudgeSpec(_Spec):
    """Rewards from a served model on engines of its own, sized by the estimator like rollout engines
    (status.plan.judge): pods `<job>-judge-<k>`, each with the accelerators of one engine, requested
    on top of spec.resources.totalAccelerators and scheduled like rollout pods (spec.rolloutPool)."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="self.kind != 'llm' || has(self.promptTemplate)",
            message="spec.reward.judge.promptTemplate is required for kind llm (it is what the judge is "
            "asked: {prompt}, {response} and {answer} are filled in)",
            field_path=".promptTemplate",
            reason="FieldValueRequired",
            check=lambda s: s.kind != "llm" or s.prompt_template is not None,
        ),
        CelRule(
            rule="!has(self.promptTemplate) || self.promptTemplate.contains('{response}')",
            message="spec.reward.judge.promptTemplate must contain {response}: the judge scores the response",
            field_path=".promptTemplate",
            check=lambda s: s.prompt_template is None or "{response}" in s.prompt_template,
        ),
        CelRule(
            rule="self.kind != 'rewardModel' || !has(self.promptTemplate)",
            message="spec.reward.judge.promptTemplate is for kind llm; a rewardModel scores the prompt and "
            "response as its chat template gives them: remove promptTemplate",
            field_path=".promptTemplate",
            reason="FieldValueForbidden",
            check=lambda s: s.kind != "rewardModel" or s.prompt_template is None,
        ),
    )

    kind: JudgeKind = Field(
        "llm",
        description="llm: a generative judge asked with promptTemplate, the last number of its answer in "
        "[0, maxScore] scaled to [0, 1]; rewardModel: a sequence-classification model's score.",
    )
    model: JudgeModelSpec = Field(description="The judge model: weights and config.json.")
    prompt_template: str | None = Field(
        None,
        min_length=1,
        max_length=16384,
        description="kind llm: what the judge is asked; {prompt}, {response} and {answer} are filled in "
        "({response} is required).",
    )
    max_score: float = Field(
        10.0, gt=0.0, le=1.0e6, description="kind llm: the top of the judge's scale (its score / maxScore)."
    )
    max_tokens: int = Field(64, ge=1, le=16384, description="kind llm: tokens of the judge's answer.")
    weight: float = Field(1.0, ge=-1000.0, le=1000.0, description="Multiplier of the judge's reward term.")
    engines: int = Field(1, ge=1, le=64, description="Judge engines, one pod each.")
    tensor_parallel: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Accelerators per judge engine; must divide acceleratorsPerNode. Default: the smallest "
        "size whose memory holds the judge's weights and a useful KV cache.",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="Fraction of device memory a judge engine may use."
    )
    batch_size: int = Field(32, ge=1, le=4096, description="Responses scored per judge call.")
    timeout_seconds: float = Field(
        120.0,
        gt=0.0,
        le=86400.0,
        description="A batch not scored within this fails, named in the trainer's log and the step's "
        "metrics.",
    )


class RewardSpec(_Spec):
    """How completions are scored."""

    functions: list[RewardFunctionSpec] = Field(
        default_factory=lambda: [RewardFunctionSpec(name="mathAccuracy", weight=1.0)],
        min_length=1,
        max_length=16,
        description="Reward terms, summed with their weights.",
    )
    judge: JudgeSpec | None = Field(
        None, description="A served judge model's score, one more term (its weight) of the reward."
    )

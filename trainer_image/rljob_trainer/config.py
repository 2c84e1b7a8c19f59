"""Trainer configuration contract: the one home of `trainer.json` (docs/contracts.md §1, §2).

Role: the pydantic model the operator renders into the ConfigMap `<job>-config` (key
`trainer.json`) and the trainer reads back at start-up, plus the names of the pod environment
variables the operator sets. Callers: `rljob_operator.builders` (renders it, and sets the env vars
named here), `rljob_trainer.__main__`/`driver` (reads it through `load_config`).

Imports no torch, ray or kubernetes: the operator must be able to import this module alone.

Field names are snake_case in Python; JSON accepts both snake_case and camelCase (every model has
a camelCase alias and `populate_by_name`). Render with `dump_config(cfg)` (camelCase, like the rest
of the Kubernetes objects); `load_config` reads either.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

# ---- pod environment (docs/contracts.md §2) ------------------------------------------------------
ENV_CONFIG_PATH = "RLJOB_CONFIG_PATH"
ENV_ROLE = "RLJOB_ROLE"
ENV_POD_INDEX = "RLJOB_POD_INDEX"
ENV_JOB_NAME = "RLJOB_JOB_NAME"
ENV_NAMESPACE = "RLJOB_NAMESPACE"
ENV_RAY_HEAD = "RLJOB_RAY_HEAD"
ENV_RAY_PORT = "RLJOB_RAY_PORT"
ENV_NUM_TRAINER_PODS = "RLJOB_NUM_TRAINER_PODS"
ENV_TELEMETRY_CONFIGMAP = "RLJOB_TELEMETRY_CONFIGMAP"
# What the pod's container requests, so `ray start` advertises exactly that to Ray (KubeRay does the
# same from the container's limits): the count and the Ray resource name (GPU, NPU or empty).
ENV_NUM_ACCELERATORS = "RLJOB_NUM_ACCELERATORS"
ENV_RAY_ACCELERATOR = "RLJOB_RAY_ACCELERATOR"
# The bearer token of the job's OpenAI-compatible endpoint (trainer pod 0, from the job's Secret
# `<job>-endpoint-<uid[:8]>`): the driver requires it on every call (`rljob_trainer.rollout.endpoint`).
ENV_ENDPOINT_TOKEN = "RLJOB_ENDPOINT_TOKEN"
# The endpoint's port on trainer pod 0 (its container port `endpoint`).
ENDPOINT_PORT = 8000
# The port the endpoint listens on, when set (trainer pod 0: the container port `endpoint`, from the
# operator): it wins over trainer.json's `endpoint.port`, as $RLJOB_ENV_PORT is an environment
# server's, so whatever runs the pod decides the port its process binds (a test kubelet running pods
# as processes on one host gives each its own).
ENV_ENDPOINT_PORT = "RLJOB_ENDPOINT_PORT"

ALL_ENV_VARS: tuple[str, ...] = (
    ENV_CONFIG_PATH,
    ENV_ROLE,
    ENV_POD_INDEX,
    ENV_JOB_NAME,
    ENV_NAMESPACE,
    ENV_RAY_HEAD,
    ENV_RAY_PORT,
    ENV_NUM_TRAINER_PODS,
    ENV_TELEMETRY_CONFIGMAP,
    ENV_NUM_ACCELERATORS,
    ENV_RAY_ACCELERATOR,
)

# Test-only switch, set by the test kubelet (tests/testenv/fakelet.py) on its local-exec GPU/NPU
# nodes and never by the operator: torch runs on CPU (gloo) and the rollout engine is the
# transformers engine (which obeys vLLM's sleep and weight rules), while every Ray placement
# decision (GPU/NPU resources, placement groups) stays what the accelerator job asks for.
ENV_TEST_CPU_STANDIN = "RLJOB_TEST_CPU_STANDIN"

ROLE_TRAINER = "trainer"
ROLE_ROLLOUT = "rollout"
ROLE_JUDGE = "judge"
ROLES: tuple[str, ...] = (ROLE_TRAINER, ROLE_ROLLOUT, ROLE_JUDGE)

DEFAULT_CONFIG_PATH = "/etc/rljob/trainer.json"
CONFIGMAP_KEY = "trainer.json"
DEFAULT_RAY_PORT = 6379

# Ray custom resource that marks rollout pod j; the driver places dedicated engine j on it.
ROLLOUT_RESOURCE_PREFIX = "rljob_rollout_"
# Ray custom resource that marks trainer pod i (one unit per bundle of its placement group).
TRAINER_RESOURCE_PREFIX = "rljob_trainer_"
# The judge's pods (`<job>-judge-<k>`, `judge.engines` of them): Ray workers like rollout pods, each
# advertising `rljob_judge_<k>: 1` (`__main__` starts them as Ray workers, ROLE_JUDGE); the driver
# places judge engine k on it (`runtimes.RayRuntime.create_judge`).
JUDGE_RESOURCE_PREFIX = "rljob_judge_"

# Ray's names for the accelerators of each Kubernetes accelerator kind.
RAY_ACCELERATORS: dict[str, str | None] = {"cpu": None, "nvidia": "GPU", "amd": "GPU", "ascend": "NPU"}


def rollout_resource_name(pod_index: int) -> str:
    """Ray custom resource name advertised by rollout pod `pod_index` (`rljob_rollout_<j>`)."""
    return f"{ROLLOUT_RESOURCE_PREFIX}{pod_index}"


def trainer_resource_name(pod_index: int) -> str:
    """Ray custom resource name advertised by trainer pod `pod_index` (`rljob_trainer_<i>`)."""
    return f"{TRAINER_RESOURCE_PREFIX}{pod_index}"


def judge_resource_name(pod_index: int) -> str:
    """Ray custom resource name advertised by judge pod `pod_index` (`rljob_judge_<k>`)."""
    return f"{JUDGE_RESOURCE_PREFIX}{pod_index}"


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_assignment=True
    )


# ---- model ---------------------------------------------------------------------------------------
class LoraSettings(_Model):
    rank: int = Field(16, ge=1, description="LoRA rank r.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha (scaling = alpha / rank).")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout probability.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names to adapt, or 'all-linear'."
    )


class ModelSettings(_Model):
    name: str = Field(..., description="Human-readable model name (e.g. Qwen/Qwen3-4B).")
    source: Literal["pvc", "hub", "tiny"] = Field(
        ...,
        description="Where weights come from: a path on a mounted volume (pvc), the Hugging Face hub "
        "(hub), or random weights built from `hf_config` (tiny, tests).",
    )
    path: str | None = Field(None, description="Directory with config + weights + tokenizer (source=pvc).")
    hub_id: str | None = Field(None, description="Hub repository id (source=hub).")
    hub_token_env: str | None = Field(
        "HF_TOKEN", description="Name of the env var holding the hub token (source=hub); never the token."
    )
    hub_revision: str | None = Field(
        None,
        description="Branch, tag or commit of the hub repository (source=hub), for the weights and the "
        "tokenizer in the trainer and in vLLM. Default: the repository's main branch.",
    )
    hf_config: dict[str, Any] | None = Field(
        None,
        description="The model's Hugging Face config.json as a dict. Required for source=tiny; for other "
        "sources the copy the operator's estimator used.",
    )
    tokenizer: Literal["auto", "builtin-char", "builtin-digits"] = Field(
        "auto",
        description="'auto' loads the tokenizer next to the weights; 'builtin-char' (printable ASCII) "
        "and 'builtin-digits' (digits and + - * = #) build a character-level tokenizer in code (tiny).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16",
        description="Compute dtype of training and rollout (the trainer keeps fp32 master weights and "
        "optimizer state: rljob_trainer.model.precision). float16 is refused: it needs loss scaling.",
    )
    finetune: Literal["lora", "full"] = Field("lora", description="LoRA adapters or full fine-tuning.")
    lora: LoraSettings = Field(default_factory=LoraSettings)
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward.")

    @model_validator(mode="after")
    def _source_fields(self) -> ModelSettings:
        if self.source == "pvc" and not self.path:
            raise ValueError("model.path is required when model.source is 'pvc'")
        if self.source == "hub" and not self.hub_id:
            raise ValueError("model.hubId is required when model.source is 'hub'")
        if self.source == "tiny" and not self.hf_config:
            raise ValueError("model.hfConfig is required when model.source is 'tiny'")
        if self.dtype == "float16":
            raise ValueError(
                "model.dtype float16 is not supported for training: fp16 gradients underflow without loss "
                "scaling, which rljob does not do; use bfloat16 (or float32)"
            )
        return self


class LengthSettings(_Model):
    max_prompt_tokens: int = Field(
        512, ge=1, description="Prompts longer than this are dropped at load and counted, never cut."
    )
    max_response_tokens: int = Field(1024, ge=1, description="Generation stops after this many tokens.")

    @property
    def max_model_len_tokens(self) -> int:
        return self.max_prompt_tokens + self.max_response_tokens


# ---- GRPO ----------------------------------------------------------------------------------------
class DynamicSamplingSettings(_Model):
    """DAPO's dynamic sampling: groups whose rewards are all equal (zero advantage: no gradient) are
    dropped and the batch is refilled with more prompts, at most `maxGenerationRounds` rounds a step."""

    enabled: bool = Field(False, description="Drop groups whose rewards are all equal and refill the batch.")
    max_generation_rounds: int = Field(
        3,
        ge=1,
        le=64,
        description="Generation rounds per step, the step's own included: the cap on extra generation. "
        "When it is reached, dropped groups fill the rest of the batch (counted, zero advantage).",
    )


class RolloutCorrectionSettings(_Model):
    """`spec.grpo.rolloutCorrection`: importance weights and rejection against the engine's behaviour
    policy (`rljob_trainer.train.rollout_correction`, where each is defined and cited). Applied at every
    staleness, 0 included (the engine and the trainer differ in kernels and dtype even then)."""

    is_level: Literal["token", "sequence", "geometric"] | None = Field(
        "token",
        description="Importance weight per token (token), per sequence (sequence: the product of its "
        "token ratios) or the geometric mean of its token ratios (geometric); None: no weights.",
    )
    is_mode: Literal["truncate", "mask"] = Field(
        "truncate",
        description="truncate: min(ratio, is_upper) (TIS); mask: the ratio inside [is_lower, is_upper], "
        "0 outside (masked IS; IcePop at the token level).",
    )
    is_lower: float | None = Field(None, gt=0, description="mask's lower bound; None: 1 / is_upper.")
    is_upper: float = Field(2.0, gt=0, description="The truncation cap, or mask's upper bound.")
    reject_level: Literal["token", "sequence", "geometric"] | None = Field(
        None, description="Drop tokens or whole sequences whose ratio at this level is out of bounds."
    )
    reject_lower: float | None = Field(None, gt=0, description="None: 1 / reject_upper.")
    reject_upper: float = Field(2.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> RolloutCorrectionSettings:
        for lo, hi, name in (
            (self.is_lower, self.is_upper, "is"),
            (self.reject_lower, self.reject_upper, "reject"),
        ):
            if lo is not None and lo > hi:
                raise ValueError(
                    f"grpo.rollout_correction.{name}_lower must be <= {name}_upper ({lo} > {hi})"
                )
        return self


class GRPOSettings(_Model):
    group_size: int = Field(8, ge=2, description="Samples per prompt (the GRPO group).")
    prompts_per_step: int = Field(32, ge=1, description="Prompts per training step.")
    max_steps: int = Field(100, ge=1, description="Training steps (weight syncs) in the run.")
    mini_batches_per_step: int = Field(
        1, ge=1, description="Optimizer updates per step; >1 makes updates off-policy so clipping acts."
    )
    ppo_epochs: int = Field(
        1,
        ge=1,
        description="Passes over the step's mini-batches; old log-probs stay those of the step start.",
    )
    learning_rate: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    adv_estimator: str = Field(
        "grpo", description="Advantage estimator name (rljob_trainer.train.algos registry)."
    )
    policy_loss: str = Field("clipped", description="Policy loss name (rljob_trainer.train.algos registry).")
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = Field(
        "seq-mean-token-mean",
        description="seq-mean-token-mean: mean over each sequence's tokens, then mean over sequences "
        "of the global batch; token-mean: mean over all tokens of the global batch; "
        "seq-mean-token-sum-norm (Dr. GRPO): each sequence's token sum divided by the completion cap, "
        "then mean over sequences.",
    )
    norm_adv_by_std: bool = Field(True, description="Divide group-centred rewards by the group std.")
    clip_low: float = Field(0.2, ge=0, description="Ratio clip below: 1 - clip_low.")
    clip_high: float = Field(0.28, ge=0, description="Ratio clip above: 1 + clip_high (DAPO clip-higher).")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL-to-reference penalty; 0 disables it.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient L2 norm.")
    seed: int = Field(0, description="Seeds data order, sampling and initialisation.")
    max_staleness: int = Field(
        0,
        ge=0,
        le=64,
        description="Bound on how many weight updates a trained sample may be behind the trainer: 0 is the "
        "synchronous loop; N lets dedicated engines generate up to N steps ahead while the trainer "
        "trains (AReaL's bounded staleness). Shared engines always stay synchronous.",
    )
    tis_cap: float = Field(
        2.0,
        gt=0,
        description="Truncated importance sampling cap of the '*-tis' policy losses: each token's loss is "
        "weighted by min(pi_old / pi_rollout, tisCap) with the engine's rollout log-probs; "
        "off_policy/truncated_fraction counts the tokens above it.",
    )
    clip_ratio_c: float = Field(
        3.0,
        gt=1,
        description="Dual-clip bound (verl's clip_ratio_c): for a negative advantage the token loss is at "
        "most -A * clipRatioC.",
    )
    max_skipped_steps: int = Field(
        5,
        ge=1,
        description="An optimizer step whose gradient norm is not finite is skipped (train/skipped_steps); "
        "this many skipped in a row fail the run, naming the step and the metric.",
    )
    dynamic_sampling: DynamicSamplingSettings = Field(default_factory=DynamicSamplingSettings)
    rollout_correction: RolloutCorrectionSettings | None = Field(
        None,
        description="Rollout correction against the engine's log-probs (replaces tis_cap and the '-tis' "
        "losses' truncation when set); None: a '*-tis' loss truncates token weights at tis_cap, others none.",
    )

    def effective_rollout_correction(self) -> RolloutCorrectionSettings | None:
        """What the trainer applies: `rollout_correction` when set, else a '*-tis' loss's token TIS at
        `tis_cap` (how a job written for tisCap trained before rolloutCorrection), else nothing."""
        if self.rollout_correction is not None:
            return self.rollout_correction
        if self.policy_loss.endswith("-tis"):
            return RolloutCorrectionSettings(is_level="token", is_mode="truncate", is_upper=self.tis_cap)
        return None

    @model_validator(mode="after")
    def _gspo_mean(self) -> GRPOSettings:
        if self.policy_loss.startswith("gspo") and self.loss_agg != "seq-mean-token-mean":
            raise ValueError(
                "grpo.policyLoss gspo averages over sequences: set grpo.lossAgg to seq-mean-token-mean "
                f"(got {self.loss_agg})"
            )
        return self


class BatchingSettings(_Model):
    packed: bool = Field(True, description="Pack samples into rows (True) or pad each sample (False).")
    dynamic: bool = Field(
        True, description="Dynamic micro-batches bounded by max_tokens_per_micro_batch, else fixed size."
    )
    micro_batch_size: int | None = Field(4, ge=1, description="Samples per micro-batch (fixed mode).")
    max_tokens_per_micro_batch: int | None = Field(
        8192, ge=1, description="Token budget of one micro-batch (dynamic mode)."
    )
    dp_balance: bool = Field(True, description="Reorder each step's batch so DP ranks get similar work.")

    @model_validator(mode="after")
    def _mode_fields(self) -> BatchingSettings:
        if self.dynamic and self.max_tokens_per_micro_batch is None:
            raise ValueError("batching.maxTokensPerMicroBatch is required when batching.dynamic is true")
        if not self.dynamic and self.micro_batch_size is None:
            raise ValueError("batching.microBatchSize is required when batching.dynamic is false")
        return self


# ---- rollout -------------------------------------------------------------------------------------
class RolloutSettings(_Model):
    kind: Literal["vllm", "transformers"] = Field("vllm", description="Engine implementation.")
    max_num_seqs: int = Field(256, ge=1, description="vLLM max_num_seqs (estimator's plan).")
    max_num_batched_tokens: int = Field(8192, ge=1, description="vLLM max_num_batched_tokens (one prefill).")
    gpu_memory_utilization: float = Field(0.6, gt=0, le=1, description="Fraction of accelerator memory.")
    tensor_parallel: int = Field(1, ge=1)
    shared_engines: int = Field(
        0, ge=0, description="Engines colocated with training ranks, asleep during training (sleep mode)."
    )
    dedicated_engines: int = Field(1, ge=0, description="Engines on rollout pods at start.")
    max_dedicated_engines: int = Field(8, ge=0, description="Upper bound the driver accepts from status.")
    enable_sleep_mode: bool = Field(
        True, description="vLLM sleep mode for shared engines; false never calls sleep() (they stay awake)."
    )
    sleep_level: Literal[1, 2] = Field(
        2,
        description="vLLM sleep level of shared engines: 1 keeps weights in host memory, 2 discards them "
        "(they are reloaded from the trainer when the engine wakes, before it generates).",
    )
    cpu_kv_cache_bytes: int | None = Field(
        None,
        ge=1,
        description="KV-cache bytes of one engine where vLLM runs on CPU (vLLM's "
        "`kv_cache_memory_bytes`: its CPU backend sizes the cache from bytes it is told, or else from a "
        "fraction of the host's memory). The operator renders the plan's KV bytes on CPU pools, and on "
        "accelerator pools the bytes the plan's maxNumSeqs sequences of maxModelLen need (what the CPU "
        "stand-in of a local-exec GPU/NPU node gets). None: vLLM's own default. Unused on accelerators.",
    )
    enforce_eager: bool | None = Field(
        None,
        description="vLLM's enforce_eager. None: eager where the platform captures no static graphs "
        "(vLLM on CPU: compiling costs ~35 s at every engine start), vLLM's default (compiled) elsewhere.",
    )
    engine_num_cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved by one engine actor.")
    engine_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A dedicated engine call (generate, weight sync) running longer than this is taken as a "
        "hung engine: it is dropped and its requests go back to the queue.",
    )
    weight_sync: Literal["collective", "object-store"] = Field(
        "collective",
        description="collective: trainer rank 0 broadcasts bucketed weights over one torch.distributed group "
        "per engine (gloo on CPU, NCCL on GPU, HCCL on Ascend); object-store: the fallback, one whole-model "
        "dict through Ray's object store. vLLM engines always use object-store here.",
    )
    engine_lora: bool = Field(
        False,
        description="With model.finetune lora: the engines serve the LoRA adapter on top of the base model "
        "themselves, so a weight sync sends only the adapter tensors (the base once more after a level-2 "
        "sleep on transformers engines; vLLM engines serving LoRA need sleepLevel 1). The operator sets "
        "it from the RLJob's spec.resources.rollout.loraSync (adapter, the default, with model.finetune.mode "
        "lora).",
    )
    chunk_prompt_groups: int | None = Field(
        None,
        ge=1,
        description="Prompt groups per generate call on a dedicated engine: a weight sync waits for at most "
        "the call in flight, so smaller chunks wait less but batch less. None: a step's share per engine "
        "(one call per engine and step).",
    )
    partial_rollouts: bool = Field(
        False,
        description="At a weight sync, interrupt the dedicated engines' calls in flight, update the weights, "
        "and resume each unfinished request from the tokens it has under the new weights (each token keeps "
        "the weights version and log-prob it was sampled with). Off: the sync waits for the calls in flight.",
    )

    @model_validator(mode="after")
    def _some_engine(self) -> RolloutSettings:
        if self.shared_engines + self.dedicated_engines < 1:
            raise ValueError("rollout needs at least one engine: sharedEngines + dedicatedEngines >= 1")
        return self


# ---- data and rewards ----------------------------------------------------------------------------
class HeldOutTask(_Model):
    """The held-out reasoning-gym dataset a training dataset leaves out (its task, config, seed, size)."""

    task: str = Field(..., min_length=1)
    config: dict[str, Any] = Field(default_factory=dict)
    size: int = Field(..., ge=1, le=1_000_000)
    seed: int = Field(..., ge=0)


class ReasoningGymSettings(_Model):
    """A reasoning-gym task as a dataset (`rljob_trainer.data.reasoning_gym`): item i of (task, config,
    seed) is always the same item, so a seed names a dataset and another seed a held-out one."""

    task: str = Field(..., min_length=1, description="reasoning-gym task name, e.g. chain_sum.")
    config: dict[str, Any] = Field(
        default_factory=dict, description="The task's config fields (its *Config dataclass), e.g. max_terms."
    )
    size: int = Field(1000, ge=1, le=1_000_000, description="Items in the dataset.")
    seed: int = Field(0, ge=0, description="The dataset's seed (item i is built from seed + i).")
    answer_format: Literal["answerTag", "answerTagOrLastNumber"] = Field(
        "answerTag",
        description="How the reward reads a completion's answer: answerTag (the last <answer>...</answer>, "
        "reasoning-gym's convention) or answerTagOrLastNumber (the tag, else the last number).",
    )
    held_out: HeldOutTask | None = Field(
        None,
        description="A dataset of the same task whose questions this one leaves out (the job's held-out "
        "evaluation: TrainerConfig fills it in), so evaluation measures questions never trained on.",
    )


class DataSettings(_Model):
    builtin: str | None = Field("toy-arithmetic", description="Name of a dataset shipped with the package.")
    path: str | None = Field(
        None,
        description="A .jsonl, .json, .parquet or .arrow file, a directory of them, or a "
        "`Dataset.save_to_disk` folder (overrides builtin).",
    )
    hub_id: str | None = Field(
        None,
        description="Hugging Face dataset id (or a local dataset folder), read with datasets.load_dataset.",
    )
    hub_subset: str | None = Field(None, description="Configuration (subset) of the hub dataset.")
    hub_split: str = Field("train", description="Split of the hub dataset (or of a path's files).")
    hub_token_env: str | None = Field(
        None, description="Name of the env var holding the hub token (HF_ENDPOINT is read from the env)."
    )
    prompt_field: str = Field("prompt")
    answer_field: str = Field("answer")
    chat_template: bool = Field(
        False, description="Wrap each prompt as a user message with the tokenizer's chat template."
    )
    shuffle: bool = Field(True, description="Reshuffle every epoch with a seed derived from grpo.seed.")
    system_prompt: str | None = Field(
        None,
        description="With chatTemplate: a system message before each prompt (None: the template's own "
        "default, if it has one).",
    )
    reasoning_gym: ReasoningGymSettings | None = Field(
        None, description="A reasoning-gym task (overrides builtin; score it with the reasoningGym reward)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> DataSettings:
        if not self.builtin and not self.path and not self.hub_id and not self.reasoning_gym:
            raise ValueError("data needs data.builtin, data.path, data.hubId or data.reasoningGym")
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("data.systemPrompt needs data.chatTemplate: true (it is a chat message)")
        return self


class RewardFunctionSettings(_Model):
    name: Literal["mathAccuracy", "format", "reasoningGym", "module"] = Field(...)
    weight: float = Field(1.0)
    import_path: str | None = Field(None, description="Importable module of a user reward (name=module).")
    path: str | None = Field(None, description="A .py file of a user reward (name=module).")
    function: str | None = Field(
        None,
        description="Function in the module: fn(prompts, completions, answers, **kwargs) -> list[float].",
    )

    @model_validator(mode="after")
    def _module_fields(self) -> RewardFunctionSettings:
        if self.name == "module" and not (bool(self.import_path) != bool(self.path) and self.function):
            raise ValueError(
                "rewards[].function and exactly one of rewards[].importPath or rewards[].path are "
                "required when name is 'module'"
            )
        return self


def _default_rewards() -> list[RewardFunctionSettings]:
    return [RewardFunctionSettings(name="mathAccuracy", weight=1.0)]


# ---- checkpoint, telemetry, distributed ----------------------------------------------------------
class CheckpointSettings(_Model):
    dir: str | None = Field(None, description="Checkpoint directory (a mounted volume); None disables.")
    interval_steps: int = Field(50, ge=1, description="Save every this many steps (and at the end).")
    keep_last: int = Field(2, ge=1, description="Checkpoints kept on disk.")


class TelemetrySettings(_Model):
    enabled: bool = Field(True, description="Write SyncReports to the telemetry ConfigMap.")
    configmap_name: str | None = Field(None, description="Default: $RLJOB_TELEMETRY_CONFIGMAP.")
    namespace: str | None = Field(None, description="Default: $RLJOB_NAMESPACE.")
    job_name: str | None = Field(None, description="Default: $RLJOB_JOB_NAME.")
    prometheus_port: int | None = Field(9400, ge=0, le=65535, description="None or 0 disables the endpoint.")
    read_targets: bool = Field(True, description="Read desired engine counts from the RLJob status.")


class DistributedSettings(_Model):
    num_trainer_ranks: int = Field(1, ge=1, description="torch.distributed world size of the trainer.")
    backend: Literal["auto", "gloo", "nccl", "hccl"] = Field(
        "auto", description="auto: nccl on CUDA, hccl on Ascend NPU, gloo on CPU."
    )
    device: Literal["auto", "cpu", "cuda", "npu"] = Field("auto")
    launcher: Literal["ray", "local"] = Field(
        "ray", description="ray: ranks and engines are Ray actors; local: one process, threads (tests)."
    )
    rank_num_cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved by one training rank actor.")
    accelerator: Literal["GPU", "NPU"] | None = Field(
        None,
        description="Ray resource of one trainer/engine accelerator (GPU for nvidia/amd, NPU for Ascend); "
        "None on CPU. Each rank holds one, shared with a colocated engine.",
    )
    trainer_pod_ranks: list[int] | None = Field(
        None,
        description="Training ranks (= accelerators) of each trainer pod, in pod order; a placement "
        "group per pod pins them there. None: all ranks on one node (local runs).",
    )
    torch_threads_per_rank: int | None = Field(None, ge=1, description="torch.set_num_threads per rank.")

    @property
    def pod_ranks(self) -> list[int]:
        """Ranks of each trainer pod (one pod holding every rank when `trainer_pod_ranks` is unset)."""
        return list(self.trainer_pod_ranks or [self.num_trainer_ranks])


# ---- export and experiment tracking (rljob_trainer.outputs: export, tracking) -----------------------
class ExportSettings(_Model):
    every_checkpoint: bool = Field(
        True, description="Also export <dir>/step-<N> in Hugging Face format at every checkpoint."
    )
    final: bool = Field(True, description="Export <dir>/final at the end of the run.")
    merge_lora: bool = Field(
        True, description="With LoRA, also write the merged model under merged/ next to the adapter."
    )
    dir: str | None = Field(None, description="Where exports go. Default: <checkpoint.dir>/hf.")


class WandbSettings(_Model):
    project: str = Field(..., min_length=1, description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user).")
    run_name: str | None = Field(None, description="Run name. Default: the job name.")
    mode: Literal["online", "offline"] = Field(
        "online", description="offline writes runs under <dir>/wandb to `wandb sync` later."
    )
    api_key_env: str = Field("WANDB_API_KEY", description="Env var holding the API key; never the key.")


class MlflowSettings(_Model):
    tracking_uri: str = Field(
        ...,
        min_length=1,
        pattern=r"^https?://",
        # What the installed MLflow (mlflow-skinny 3.x, the tracking extra) takes: a tracking server.
        # MLflow 3.x refuses new `file:` stores, and sqlite:/postgresql: need the SQL store, which
        # mlflow-skinny does not ship.
        description="MLflow tracking server URI: http://... or https://... (an `mlflow server`).",
    )
    experiment: str = Field("rljob", min_length=1, description="MLflow experiment name.")
    run_name: str | None = Field(None, description="Run name. Default: the job name.")


class TrackingSettings(_Model):
    tensorboard_dir: str | None = Field(
        None, description="TensorBoard event files (always written). Default: <checkpoint.dir>/tensorboard."
    )
    wandb: WandbSettings | None = Field(None, description="Weights & Biases (needs the tracking extra).")
    mlflow: MlflowSettings | None = Field(None, description="MLflow (needs the tracking extra).")


# ---- held-out evaluation (rljob_trainer.data.evaluation) ----------------------------------------------
class EvaluationSettings(_Model):
    """Held-out evaluation on the rollout engines between steps (verl's test_freq)."""

    data: DataSettings = Field(..., description="The held-out prompts (the same shape as data).")
    every_steps: int = Field(10, ge=1, description="Evaluate after every this many training steps.")
    max_samples: int = Field(256, ge=1, description="Prompts evaluated (the first ones of the data).")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature; 0 is greedy (the default).")
    top_p: float = Field(1.0, gt=0, le=1)
    samples_per_prompt: int = Field(1, ge=1, le=64, description="Completions per prompt (default one).")
    before_training: bool = Field(
        True, description="Also evaluate the initial weights, as step 0 (verl's val_before_train)."
    )


# ---- agents: multi-turn, tool-using episodes (rljob_trainer.rollout.agent) ------------------------
TOOL_KINDS = ("calculator", "python", "http")


class ToolSettings(_Model):
    """One tool the policy may call between turns, offered through the model's chat template
    (`tools=`); a call is parsed from what the engine generated and its result is appended as a tool
    message whose tokens the loss masks out."""

    name: str = Field(..., pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$", description="The name the model calls.")
    kind: Literal["calculator", "python", "http"] = Field(
        ...,
        description="calculator: arithmetic on numbers (no names, no calls); python: a sandboxed "
        "interpreter (no network, CPU/memory/time limits, nothing of the trainer reachable); http: a "
        "user tool, POST {'name', 'arguments'} to `url`, answered {'result': text}.",
    )
    description: str | None = Field(
        None, description="What the model is told the tool does (default per kind)."
    )
    url: str | None = Field(
        None, description="kind http: where calls go (in-cluster, inside the job's policy)."
    )
    parameters: dict[str, Any] | None = Field(
        None,
        description="kind http: the JSON schema of the call's arguments, offered to the model through "
        "the chat template (default: an object with no declared properties).",
    )
    timeout_s: float = Field(10.0, gt=0, description="A call running longer fails (its result says so).")
    cpu_seconds: float = Field(5.0, gt=0, description="kind python: CPU time of one call.")
    memory_bytes: int = Field(256 * 1024**2, ge=16 * 1024**2, description="kind python: address space.")
    max_result_chars: int = Field(2000, ge=16, description="A longer result is cut, saying so.")

    @model_validator(mode="after")
    def _http_url(self) -> ToolSettings:
        if self.kind == "http" and not self.url:
            raise ValueError(f"tool {self.name!r} of kind http needs a url")
        return self


class DemonstrationMessage(_Model):
    """One message of the worked examples shown before every task (`AgentSettings.demonstrations`)."""

    role: Literal["user", "assistant", "tool"]
    content: str
    name: str | None = Field(None, description="role tool: the tool that answered.")


class AgentSettings(_Model):
    """Episodes of several turns: generate, call tools or step an environment, generate again, until
    the model answers, `max_turns` or the token budget. Token-in/token-out: what an engine generated
    is never re-tokenised, so log-probs, truncated IS and staleness stay exact per token."""

    max_turns: int = Field(4, ge=1, le=64, description="Model turns per episode.")
    max_total_tokens: int | None = Field(
        None,
        ge=1,
        description="Response tokens of one episode, generated and tool/observation tokens together "
        "(default lengths.maxResponseTokens).",
    )
    tools: list[ToolSettings] = Field(default_factory=list)
    environment: str | None = Field(
        None, description="Name of an `environments` entry whose reset/step drive the episodes."
    )
    demonstrations: list[DemonstrationMessage] = Field(
        default_factory=list,
        description="Worked examples (user, assistant, tool messages) put before every task, after the "
        "system message, in training and evaluation.",
    )
    tool_call_format: Literal["hermes"] = Field(
        "hermes",
        description='How tool calls are written: hermes, <tool_call>{"name": ..., "arguments": {...}}'
        "</tool_call> (Qwen2.5, SmolLM2, Hermes templates).",
    )

    @model_validator(mode="after")
    def _unique_tools(self) -> AgentSettings:
        names = [t.name for t in self.tools]
        if len(names) != len(set(names)):
            raise ValueError(f"agent.tools names must be unique: {names}")
        return self

    @model_validator(mode="after")
    def _demonstrations_end_before_a_task(self) -> AgentSettings:
        roles = [m.role for m in self.demonstrations]
        if roles and (roles[0] != "user" or roles[-1] != "assistant"):
            raise ValueError(
                "agent.demonstrations must start with a user message and end with an assistant message "
                f"(the task follows as the next user message), not {roles[0]} ... {roles[-1]}"
            )
        return self


class EnvironmentSettings(_Model):
    """An environment server of the job (pods and a Service the operator runs; docs/contracts.md has
    its reset/step protocol)."""

    name: str = Field(..., pattern=r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$")
    url: str = Field(
        ...,
        description="Base URL of its headless Service, as the operator renders it: "
        "http://<job>-env-<name>.<ns>.svc:<port> (resolves to its ready replicas).",
    )
    replica_urls: list[str] = Field(
        default_factory=list,
        description="Base URL of each replica, http://<job>-env-<name>-<i>.<job>-env-<name>.<ns>.svc:<port> "
        "(its pod's own DNS name): an episode's reset and steps go to one replica, which holds the episode "
        "(a Service spreads connections over replicas). A replica that is not ready does not resolve: "
        "reset on another. Empty: `url` alone (one replica, or tests).",
    )
    timeout_s: float = Field(30.0, gt=0, description="One reset or step running longer fails the episode.")
    task: str | dict[str, Any] | None = Field(
        None,
        description="What every reset asks of the environment (its `task`: a name or an object the "
        "environment reads); None: no task, the environment's default. Each GRPO group shares a reset seed.",
    )
    mode: Literal["steps", "agent"] = Field(
        "steps",
        description="steps: the trainer's agent loop resets and steps it (docs/contracts.md §4); agent: "
        "the server runs a whole episode itself (POST /episode), its own agent calling the job's "
        "OpenAI-compatible endpoint (`endpoint`), and `timeout_s` bounds the whole episode.",
    )


class EndpointSettings(_Model):
    """The job's OpenAI-compatible endpoint (`rljob_trainer.rollout.endpoint`), served by the driver on
    trainer pod 0 in front of its rollout engines, for environments of mode agent. Its bearer token is
    in the driver's environment (`ENV_ENDPOINT_TOKEN`, from the job's Secret), never in this file."""

    port: int = Field(ENDPOINT_PORT, ge=0, le=65535, description="The port it listens on (0: any free one).")
    host: str = Field("0.0.0.0", description="The address it listens on.")
    url: str = Field(
        ...,
        description="Its base URL as the environment pods reach it (no /v1): "
        "http://<job>-trainer-0.<job>.<ns>.svc:<port>; an episode's agent is given "
        "<url>/episodes/<episode id>/v1.",
    )
    model_name: str | None = Field(
        None, description="The model name it serves (GET /v1/models); default model.name."
    )


class JudgeSettings(_Model):
    """Rewards from a served model on engines of its own (`spec.reward.judge`)."""

    kind: Literal["llm", "rewardModel"] = Field(
        "llm",
        description="llm: a generative judge asked with `prompt_template`, the last number of its answer "
        "in [0, max_score] scaled to [0, 1]; rewardModel: a sequence-classification model's score.",
    )
    model: ModelSettings
    prompt_template: str | None = Field(
        None, description="llm: the judge's prompt; {prompt}, {response} and {answer} are filled in."
    )
    max_score: float = Field(10.0, gt=0)
    max_tokens: int = Field(64, ge=1, description="llm: tokens of the judge's answer.")
    weight: float = Field(1.0, description="Its weight among the job's rewards.")
    engines: int = Field(1, ge=1, description="Judge engines (each on its own pod's accelerators).")
    tensor_parallel: int = Field(
        1, ge=1, description="Accelerators of one judge engine (its pod's), the estimator's choice."
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="Fraction of accelerator memory.")
    max_model_len: int | None = Field(
        None,
        ge=1,
        description="vLLM max_model_len of a judge engine: the longest judge prompt (template + prompt + "
        "response) plus max_tokens, as the estimator planned it. None: the model's own.",
    )
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(4096, ge=1)
    cpu_kv_cache_bytes: int | None = Field(None, ge=1, description="As rollout.cpuKvCacheBytes.")
    batch_size: int = Field(32, ge=1, description="Responses scored per judge call.")
    timeout_s: float = Field(120.0, gt=0, description="A batch not scored within this fails, named.")


class TrainerConfig(_Model):
    """Everything one GRPO job needs; rendered by the operator, read by `python -m rljob_trainer`."""

    model: ModelSettings
    lengths: LengthSettings = Field(default_factory=LengthSettings)
    grpo: GRPOSettings = Field(default_factory=GRPOSettings)
    batching: BatchingSettings = Field(default_factory=BatchingSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    data: DataSettings = Field(default_factory=DataSettings)
    rewards: list[RewardFunctionSettings] = Field(default_factory=_default_rewards, min_length=1)
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    distributed: DistributedSettings = Field(default_factory=DistributedSettings)
    export: ExportSettings = Field(default_factory=ExportSettings)
    tracking: TrackingSettings = Field(default_factory=TrackingSettings)
    log_interval_steps: int = Field(1, ge=1)
    evaluation: EvaluationSettings | None = Field(None, description="Held-out evaluation; None disables it.")
    agent: AgentSettings | None = Field(None, description="Multi-turn, tool-using episodes; None: one turn.")
    environments: list[EnvironmentSettings] = Field(default_factory=list)
    judge: JudgeSettings | None = Field(None, description="Rewards from a served judge model.")
    endpoint: EndpointSettings | None = Field(
        None, description="The job's OpenAI-compatible endpoint (environments of mode agent); None: none."
    )

    @model_validator(mode="after")
    def _batch_divides(self) -> TrainerConfig:
        pods = self.distributed.trainer_pod_ranks
        if pods is not None and sum(pods) != self.distributed.num_trainer_ranks:
            raise ValueError(
                f"distributed.trainerPodRanks {pods} must sum to distributed.numTrainerRanks "
                f"({self.distributed.num_trainer_ranks})"
            )
        if self.rollout.engine_lora and self.model.finetune != "lora":
            raise ValueError(
                "rollout.engineLora needs model.finetune: lora (there is no adapter to send); "
                "set model.finetune to lora or rollout.engineLora to false"
            )
        self._engine_lora_on_vllm()
        self._reasoning_gym_rewards()
        if (
            self.agent is not None
            and self.agent.max_total_tokens is not None
            and self.agent.max_total_tokens > self.lengths.max_response_tokens
        ):
            # The engines' context is maxPromptTokens + maxResponseTokens (vLLM's max_model_len).
            raise ValueError(
                f"agent.maxTotalTokens ({self.agent.max_total_tokens}) must be <= "
                f"lengths.maxResponseTokens ({self.lengths.max_response_tokens}): an episode's turns and "
                "tool results share the engines' response budget; raise lengths.maxResponseTokens"
            )
        if self.agent is not None and self.agent.environment is not None:
            names = [e.name for e in self.environments]
            if self.agent.environment not in names:
                raise ValueError(
                    f"agent.environment {self.agent.environment!r} is not one of environments {names}"
                )
            self._agent_environment()
        samples = self.grpo.group_size * self.grpo.prompts_per_step
        if samples % self.grpo.mini_batches_per_step:
            raise ValueError(
                f"grpo.groupSize*promptsPerStep ({samples}) must be divisible by "
                f"grpo.miniBatchesPerStep ({self.grpo.mini_batches_per_step})"
            )
        return self

    def _agent_environment(self) -> None:
        """An environment of mode agent runs its own agent against the job's endpoint: the endpoint must
        be served, and tools of the trainer's loop would never be offered (the agent brings its own)."""
        assert self.agent is not None
        env = next(e for e in self.environments if e.name == self.agent.environment)
        if env.mode != "agent":
            return
        if self.endpoint is None:
            raise ValueError(
                f"environments[{env.name}] has mode agent: its agent calls the job's OpenAI-compatible "
                "endpoint, so `endpoint` must be set (the operator sets it for such an environment)"
            )
        if self.agent.tools:
            raise ValueError(
                f"agent.tools: environment {env.name} runs its own agent (mode agent), which offers its "
                "own tools through the endpoint; remove agent.tools"
            )

    def _reasoning_gym_rewards(self) -> None:
        """reasoning-gym data is scored by its task (reward reasoningGym), and only it can score it; a
        held-out seed differs from the training seed."""
        names = {r.name for r in self.rewards}
        train = self.data.reasoning_gym
        if train is not None and "mathAccuracy" in names:
            raise ValueError(
                "rewards: mathAccuracy compares final numbers of GSM8K-style answers and cannot read a "
                "reasoning-gym answer; use the reward reasoningGym (the task's own score_answer)"
            )
        if "reasoningGym" in names and train is None:
            raise ValueError(
                "rewards: reasoningGym scores data.reasoningGym prompts only; set data.reasoningGym"
            )
        if self.evaluation is None:
            return
        ev = self.evaluation.data.reasoning_gym
        if (train is None) != (ev is None):
            raise ValueError(
                "evaluation.data and data must both be reasoning-gym tasks or neither: the job's one "
                "reward scores both"
            )
        if (
            ev is not None
            and train is not None
            and (ev.task, ev.config, ev.seed) == (train.task, train.config, train.seed)
        ):
            raise ValueError(
                "evaluation.data.reasoningGym has the training task, config and seed: its prompts would be "
                "the training prompts; give the evaluation another seed"
            )
        if ev is not None and train is not None and train.held_out is None:
            # Training leaves out the evaluated questions (the evaluation keeps the task's distribution;
            # a procedural task with a small space repeats questions across seeds).
            train.held_out = HeldOutTask(
                task=ev.task, config=ev.config, seed=ev.seed, size=min(ev.size, self.evaluation.max_samples)
            )

    def _engine_lora_on_vllm(self) -> None:
        """vLLM engines serving LoRA (engines.vllm_engine): a max_lora_rank vLLM accepts, and no
        level-2 sleep of shared engines (it discards the base, which rljob cannot reload into vLLM's
        LoRA-wrapped layers; level 1 keeps it)."""
        r = self.rollout
        if not (r.engine_lora and r.kind == "vllm"):
            return
        vllm_max_lora_rank(self.model.lora.rank)  # raises naming the field and the fix
        if r.shared_engines and r.enable_sleep_mode and r.sleep_level == 2:
            raise ValueError(
                "rollout.engineLora with vLLM engines needs rollout.sleepLevel 1 for shared engines: "
                "level 2 discards the base weights, and rljob cannot reload them into vLLM's LoRA layers "
                "(set rollout.sleepLevel to 1, or rollout.enableSleepMode or rollout.engineLora to false)"
            )

    @property
    def samples_per_step(self) -> int:
        return self.grpo.group_size * self.grpo.prompts_per_step


# vLLM's LoRAConfig.max_lora_rank is a Literal of these (vllm/config/lora.py, `MaxLoRARanks`); any
# other value is refused when the engine is built, so the trainer's rank is rounded up to one.
VLLM_MAX_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds an adapter of rank `rank` (an adapter of a
    smaller rank fits a larger slot)."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(
        f"model.lora.rank {rank} is above vLLM's largest max_lora_rank {VLLM_MAX_LORA_RANKS[-1]}; "
        "lower model.lora.rank or set rollout.engineLora to false (vLLM then takes the merged model)"
    )


def cpu_standin(config: TrainerConfig) -> TrainerConfig:
    """`config` with torch on CPU (gloo); placement, dtype and the engine unchanged (a vLLM job runs
    vLLM's CPU build, which asks its own platform what it can do): what a local-exec GPU/NPU node of
    the test cluster runs (`ENV_TEST_CPU_STANDIN`; never the operator)."""
    data = config.model_dump()
    data["distributed"].update(device="cpu", backend="gloo")
    # The dtype stays the job's: torch has bf16 CPU kernels, and a stand-in that trained in fp32 would
    # hide what bf16 does to a GPU run (rljob_trainer.model.precision).
    return TrainerConfig.model_validate(data)


def parse_config(data: dict[str, Any]) -> TrainerConfig:
    """Validate a decoded `trainer.json` (snake_case or camelCase keys)."""
    return TrainerConfig.model_validate(data)


def dump_config(config: TrainerConfig) -> str:
    """Render `trainer.json` (camelCase JSON) exactly as the operator puts it in the ConfigMap."""
    return config.model_dump_json(by_alias=True, indent=2)


def load_config(path: str | Path) -> TrainerConfig:
    """Read `trainer.json` (JSON; `.yaml`/`.yml` files are read as YAML)."""
    p = Path(path)
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{p}: the trainer config must be a JSON/YAML object, got {type(data).__name__}")
    return parse_config(data)

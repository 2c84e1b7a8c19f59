"""`spec.grpo`, `spec.lengths`, `spec.batching`: the algorithm, the token budgets and the micro-batching."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from rljob_operator.api.base import CelRule, LossNormalization, MicroBatching, Packing, _Spec


# --------------------------------------------------------------------------------------------
# spec.grpo, spec.lengths
# --------------------------------------------------------------------------------------------
class DynamicSamplingSpec(_Spec):
    """DAPO's dynamic sampling (verl's filter_groups)."""

    enabled: bool = Field(
        False,
        description="Drop the groups whose completions all got the same reward (zero advantage: no "
        "gradient) and refill the batch with more prompts (metric rollout/filtered_groups).",
    )
    max_generation_rounds: int = Field(
        3,
        ge=1,
        le=64,
        description="Generation rounds per step, the step's own included (the cap on extra generation); "
        "when it is reached, dropped groups fill the rest of the batch.",
    )


_BOUNDS_RULE = "!has(self.lower) || self.lower <= self.upper"


class ImportanceSamplingSpec(_Spec):
    """Importance weights π_trainer / π_rollout on each token's loss, detached (no gradient)."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule=_BOUNDS_RULE,
            message="spec.grpo.rolloutCorrection.importanceSampling.lower must be at most upper",
            field_path=".lower",
            check=lambda s: s.lower is None or s.lower <= s.upper,
        ),
        CelRule(
            rule="!has(self.lower) || self.mode == 'mask'",
            message="spec.grpo.rolloutCorrection.importanceSampling.lower bounds mode mask only (truncate "
            "caps at upper): set mode: mask or remove lower",
            field_path=".lower",
            reason="FieldValueForbidden",
            check=lambda s: s.lower is None or s.mode == "mask",
        ),
    )

    level: Literal["token", "sequence", "geometric", "none"] = Field(
        "token",
        description="The ratio each token's weight is computed from: token (its own ratio; verl's token "
        "TIS), sequence (the product of its sequence's token ratios; verl's sequence IS), geometric (their "
        "geometric mean, the length-normalised sequence ratio), or none (no weights: rejection and the "
        "mismatch metrics only).",
    )
    mode: Literal["truncate", "mask"] = Field(
        "truncate",
        description="truncate: weight min(ratio, upper) (truncated IS, TIS); mask: the ratio inside "
        "[lower, upper] and 0 outside (masked IS; at level token this is IcePop, with lower 0.5 and "
        "upper 5 in its paper).",
    )
    lower: float | None = Field(
        None,
        gt=0.0,
        le=1000.0,
        description="Lower bound of mode mask; default 1 / upper.",
    )
    upper: float = Field(
        2.0,
        gt=0.0,
        le=1.0e6,
        description="The truncation cap (mode truncate) or the upper bound (mode mask).",
    )


class RejectionSpec(_Spec):
    """Rejection: tokens or whole sequences whose ratio is out of bounds are dropped from the loss."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule=_BOUNDS_RULE,
            message="spec.grpo.rolloutCorrection.rejection.lower must be at most upper",
            field_path=".lower",
            check=lambda s: s.lower is None or s.lower <= s.upper,
        ),
    )

    level: Literal["token", "sequence", "geometric"] = Field(
        ...,
        description="token: drop each token whose ratio is out of bounds; sequence: drop a whole sequence "
        "whose product of token ratios is (verl's seq_sum_k1); geometric: drop a whole sequence whose "
        "geometric-mean ratio is (verl's seq_mean_k1, Geo-RS; verl suggests bounds 0.999-1.001).",
    )
    lower: float | None = Field(None, gt=0.0, le=1000.0, description="Lower ratio bound; default 1 / upper.")
    upper: float = Field(2.0, gt=0.0, le=1.0e6, description="Upper ratio bound.")


class RolloutCorrectionSpec(_Spec):
    """Correction for the gap between the rollout engine's policy and the trainer's."""

    importance_sampling: ImportanceSamplingSpec = Field(
        default_factory=lambda: ImportanceSamplingSpec(),
        description="Importance weights on each token's loss; default token level, truncated at 2.",
    )
    rejection: RejectionSpec | None = Field(
        None, description="Drop tokens or sequences whose ratio is out of bounds; default none."
    )


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
        CelRule(
            rule="self.policyLoss != 'gspo' || self.lossNormalization == 'sequenceMean'",
            message="spec.grpo.policyLoss gspo optimises a mean over sequences: set "
            "spec.grpo.lossNormalization to sequenceMean",
            field_path=".lossNormalization",
            check=lambda s: s.policy_loss != "gspo" or s.loss_normalization == "sequenceMean",
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
        "(verl's TIS); 0 disables it. rolloutCorrection, when set, replaces it.",
    )
    rollout_correction: RolloutCorrectionSpec | None = Field(
        None,
        description="Rollout correction at every maxStaleness (0 too: engine and trainer kernels differ): "
        "importance weights (token, sequence or geometric; truncated, or masked as IcePop) and rejection, "
        "with the ratio pi_trainer / pi_rollout of the engine's log-probs; metrics rollout_corr/*. When "
        "set it replaces tisCap; {} is token-level truncated IS at 2.",
    )
    policy_loss: Literal["ppo", "gspo"] = Field(
        "ppo",
        description="ppo: the token-level PPO clip (with clipRatioLow/High and the dual-clip clipRatioC); "
        "gspo: one importance ratio per sequence, the geometric mean of its token ratios, clipped per "
        "sequence (GSPO, Zheng et al. 2025; the paper clips at about 3e-4/4e-4).",
    )
    clip_ratio_c: float = Field(
        3.0,
        gt=1.0,
        le=100.0,
        description="Dual-clip (verl's clip_ratio_c): for a negative advantage a token's loss is at most "
        "-advantage x clipRatioC, so one huge ratio cannot dominate the batch.",
    )
    max_skipped_steps: int = Field(
        5,
        ge=1,
        le=10_000,
        description="An optimizer step whose gradient norm is not finite (NaN or inf) is skipped and counted "
        "(metric train/skipped_steps); this many in a row fail the job with a message naming the step and "
        "the metric.",
    )
    dynamic_sampling: DynamicSamplingSpec = Field(
        default_factory=lambda: DynamicSamplingSpec(),
        description="DAPO's dynamic sampling: drop groups whose rewards are all equal and refill the batch.",
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
        1024,
        ge=1,
        le=4_194_304,
        description="Longest prompt in tokens: longer prompts are dropped when the data loads (never cut), "
        "counted in the metric data/dropped_prompts and the condition DataFiltered.",
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

"""Sync-point telemetry: the `SyncReport` contract (docs/contracts.md §3) and its bounded history.

Role: the model the GRPO driver writes to ConfigMap `<job>-telemetry` (key `reports.json`) at every
weight sync, and that the operator's `policy.decide()` reads. Pure: no torch, no clock, no API
calls; the driver (`rljob_trainer.driver`) and the operator's telemetry timer are the callers.
The Kubernetes and Prometheus side effects live in `rljob_trainer.outputs.telemetry_sink`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

REPORTS_KEY = "reports.json"
MAX_REPORTS = 32


# The step metrics a SyncReport carries in `numerics` (rljob_trainer.train.train_metrics names them).
NUMERICS_KEYS: tuple[str, ...] = (
    "entropy",
    "ppo_kl",
    "pg_clipfrac",
    "pg_clipfrac_lower",
    "out_of_nucleus_fraction",
    "rollout/logprob_diff",
    "rollout_corr/kl",
    "rollout_corr/ppl_ratio",
    "rollout_corr/chi2_token",
    "rollout_corr/rollout_is_oob_ratio",
    "rollout_corr/rollout_rs_masked_fraction",
)


class SyncReport(BaseModel):
    """What happened over the interval that ended at one weight-sync point.

    Mean busy-ness of the rollout engines over the interval is
    `inflight_request_seconds / engine_seconds` (requests per awake engine).
    """

    model_config = ConfigDict(populate_by_name=True, frozen=True, extra="ignore")

    step: int = Field(..., ge=0, description="Training step that ended at this sync.")
    time: float = Field(..., description="Unix time of the sync, s.")
    interval_s: float = Field(..., alias="intervalS", ge=0, description="Since the previous sync, s.")
    trainer_wait_s: float = Field(
        ..., alias="trainerWaitS", ge=0, description="Time the trainer waited for rollouts, s."
    )
    generation_s: float = Field(..., alias="generationS", ge=0, description="Wall time generating, s.")
    training_s: float = Field(..., alias="trainingS", ge=0, description="Wall time training, s.")
    inflight_request_seconds: float = Field(
        ...,
        alias="inflightRequestSeconds",
        ge=0,
        description="Σ over engines of ∫ requests in flight (queued, dispatching, generating) dt.",
    )
    engine_seconds: float = Field(
        ..., alias="engineSeconds", ge=0, description="Σ over awake engines of awake time, s."
    )
    snapshot_inflight: int = Field(
        ..., alias="snapshotInflight", ge=0, description="Requests in flight at the sync instant."
    )
    shared_engines_awake: int = Field(..., alias="sharedEnginesAwake", ge=0)
    dedicated_engines: int = Field(..., alias="dedicatedEngines", ge=0)
    # JSON has no NaN: a reward or loss that is not finite (a skipped step) is reported as null.
    mean_reward: float | None = Field(..., alias="meanReward", description="null when not finite.")
    loss: float | None = Field(..., description="Mean over the step's updates; null when not finite.")
    tokens_per_s: float = Field(..., alias="tokensPerS", ge=0, description="Trained tokens per second.")
    response_len_mean: float = Field(..., alias="responseLenMean", ge=0, description="Tokens.")
    export_path: str | None = Field(
        None,
        alias="exportPath",
        description="Newest Hugging Face export (rljob_trainer.outputs.export), if any.",
    )
    checkpoint_ack: str | None = Field(
        None,
        alias="checkpointAck",
        description="Id of the operator's checkpoint request (RLJob status.checkpointRequest) the driver "
        "honoured at this sync: it saved a checkpoint at once (cooperative preemption).",
    )
    checkpoint_ack_step: int | None = Field(
        None, alias="checkpointAckStep", ge=0, description="Step of the checkpoint saved for checkpointAck."
    )
    checkpoint_fallback: str | None = Field(
        None,
        alias="checkpointFallback",
        max_length=4096,
        description="In the first report after a resume that skipped corrupt or partial checkpoints: "
        "which one it resumed from and why it skipped the newer ones (the operator posts it as a "
        "Warning Event, CheckpointFallback).",
    )
    released_rollout_pods: list[int] = Field(
        default_factory=list,
        alias="releasedRolloutPods",
        description="Rollout pod indices the driver holds no engine and no request on after a lowered "
        "dedicated target (the drain acknowledgement: the operator may delete them).",
    )
    lost_rollout_pods: list[int] = Field(
        default_factory=list,
        alias="lostRolloutPods",
        description="Rollout pod indices whose engine the driver dropped since the previous report because "
        "it died or hung past rollout.engineTimeoutS (the operator recreates only those pods).",
    )
    staleness_max: int = Field(
        0, alias="stalenessMax", ge=0, description="Most weight updates a trained sample was behind."
    )
    # What the step's batch cost, for refitting the estimator's rates from the job (`rljob plan
    # --from-job`, status.plan.refit). 0 / None: not measured (a driver from before these fields).
    prompt_tokens: int = Field(
        0, alias="promptTokens", ge=0, description="Prompt tokens of the step's batch."
    )
    generated_tokens: int = Field(
        0, alias="generatedTokens", ge=0, description="Response tokens the engines generated for the batch."
    )
    trained_tokens: int = Field(0, alias="trainedTokens", ge=0, description="Tokens the trainer trained on.")
    generation_engines: int = Field(
        0, alias="generationEngines", ge=0, description="Engines that generated the step's batch."
    )
    prefill_engine_s: float | None = Field(
        None,
        alias="prefillEngineS",
        ge=0,
        description="Engine-seconds of prefill for the batch (if measured).",
    )
    decode_engine_s: float | None = Field(
        None, alias="decodeEngineS", ge=0, description="Engine-seconds of decode for the batch (if measured)."
    )

    eval_mean_reward: float | None = Field(
        None,
        alias="evalMeanReward",
        description=(
            "Mean reward of a held-out evaluation (spec.evaluation) not reported before: the one run "
            "after this step, or in the first report the one of the initial weights; None if neither."
        ),
    )
    eval_step: int | None = Field(
        None,
        alias="evalStep",
        ge=0,
        description="The step whose weights evalMeanReward scored (0: before training); set with it.",
    )
    dropped_prompts: int = Field(
        0,
        alias="droppedPrompts",
        ge=0,
        description="Prompts of the data longer than lengths.maxPromptTokens, dropped at load (never cut).",
    )
    tracker_errors: list[str] = Field(
        default_factory=list,
        alias="trackerErrors",
        description="Experiment trackers (W&B, MLflow) that could not start or failed, with the cause.",
    )
    engine_platform: str | None = Field(
        None,
        alias="enginePlatform",
        max_length=256,
        description="What the rollout engines' platform says it can do, asked of vLLM itself "
        "(e.g. 'vLLM 0.32.0 on cpu, no sleep mode (sleep = stop, wake = restart)'); null without vLLM.",
    )
    shared_wake_s: float | None = Field(
        None,
        alias="sharedWakeS",
        ge=0,
        description="The longest wake of a shared engine since the previous report, the weight load "
        "included (s); null when none woke.",
    )
    shared_wake_restarted: bool = Field(
        False,
        alias="sharedWakeRestarted",
        description="That wake started the engine again: its platform has no sleep mode, so sleeping "
        "had stopped it.",
    )
    numerics: dict[str, float | None] = Field(
        default_factory=dict,
        description="The step's update numerics by metric name (NUMERICS_KEYS: verl's names where they mean "
        "the same); null when not finite. `rljob status` shows the latest.",
    )

    @field_validator("mean_reward", "loss", "eval_mean_reward", mode="before")
    @classmethod
    def _finite_or_null(cls, value: object) -> object:
        if isinstance(value, (int, float)) and not math.isfinite(float(value)):
            return None
        return value

    @field_validator("numerics", mode="before")
    @classmethod
    def _finite_numerics(cls, value: object) -> object:
        if isinstance(value, dict):
            return {k: cls._finite_or_null(v) for k, v in value.items()}
        return value

    @property
    def mean_busy(self) -> float:
        """Mean requests in flight per awake engine over the interval (0 when no engine was awake)."""
        return self.inflight_request_seconds / self.engine_seconds if self.engine_seconds > 0 else 0.0


def append_report(
    history: Sequence[SyncReport], report: SyncReport, *, max_reports: int = MAX_REPORTS
) -> list[SyncReport]:
    """Return a new list: `history` + `report`, keeping the `max_reports` most recent, oldest first."""
    if max_reports < 1:
        raise ValueError(f"max_reports must be >= 1, got {max_reports}")
    return [*history, report][-max_reports:]


def dump_reports(reports: Sequence[SyncReport]) -> str:
    """The `reports.json` value: a JSON list of camelCase objects, oldest first."""
    return json.dumps([r.model_dump(mode="json", by_alias=True) for r in reports])


def parse_reports(text: str | None) -> list[SyncReport]:
    """Parse a `reports.json` value; a missing or empty value is an empty history."""
    if not text:
        return []
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError(f"{REPORTS_KEY} must hold a JSON list, got {type(data).__name__}")
    return [SyncReport.model_validate(item) for item in data]

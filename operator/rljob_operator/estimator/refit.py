"""Plans refitted from what a job measured: the estimator's rates checked against its SyncReports.

Role: the estimator plans before launch from a roofline (:mod:`throughput`); a running job reports
at every weight sync what its steps really cost (`rljob_trainer.outputs.telemetry.SyncReport`: generation
and training seconds, the tokens of the batch, the engines that generated it, and where the engine
measures them the engine-seconds of prefill and decode). :func:`refit` compares the two: it takes
the job's measured lengths as the workload, fits one scale per phase (measured / modelled time:
decode, prefill, training; the median over the reports, so one slow step does not move it) and
re-plans with them (:func:`planner.plan_resources` with the request's ``*_scale`` fields). Without
an engine-side prefill/decode split, prefill and decode share one generation scale.

The result is what ``rljob plan --from-job`` prints and ``status.plan.refit`` holds: the rates as
planned and as measured, the step time the plan predicted against the measured one, and the plan
the estimator makes with the measured rates. :func:`engine_curve` is the refitted model as the
adaptive policy reads it: generation seconds by engine count and training seconds, so one decision
can add or remove as many engines as the measurements call for.

Pure: reports, the request and the plan in, frozen models out. Callers: the operator's reconcile
(``reconcile.steps``), ``rljob plan --from-job`` (``cli.commands``), tests.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from rljob_operator.estimator import planner
from rljob_trainer.outputs import telemetry

#: The newest reports a refit reads (the history holds at most 32): recent enough to follow drift.
REFIT_REPORTS = 16
#: A report whose generation or training took less than this is not timed well enough to fit.
MIN_PHASE_S = 1e-3
#: Engines whose step is within this fraction of the best reachable are enough (more buy < 5 %).
STEADY_TOLERANCE = 0.05


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, alias_generator=to_camel, populate_by_name=True)


class Rate(_Frozen):
    """One rate as the plan modelled it and as the job measured it (tokens per second)."""

    planned: float = Field(ge=0)
    measured: float | None = Field(None, ge=0, description="None: the reports do not measure it.")

    @property
    def measured_over_planned(self) -> float | None:
        return None if self.measured is None or self.planned <= 0 else self.measured / self.planned


class Refit(_Frozen):
    """The plan against the job: rates, step times, scales and the refitted plan."""

    reports: int = Field(ge=1, description="SyncReports the fit read.")
    from_step: int
    to_step: int
    mean_prompt_tokens: int = Field(ge=1, description="Measured (the workload the fit uses).")
    mean_completion_tokens: int = Field(ge=1, description="Measured.")
    engines: int = Field(ge=1, description="Engines that generated the measured steps (median).")
    decode_tokens_per_s_per_engine: Rate
    prefill_tokens_per_s_per_engine: Rate
    training_tokens_per_s: Rate
    decode_scale: float = Field(gt=0, description="Measured / modelled decode time.")
    prefill_scale: float = Field(gt=0, description="Measured / modelled prefill time.")
    training_scale: float = Field(gt=0, description="Measured / modelled training time.")
    split_measured: bool = Field(description="The engines measured prefill and decode apart.")
    measured_step_s: float = Field(ge=0, description="Median interval between sync points.")
    predicted_step_s: float = Field(ge=0, description="The original plan's step time.")
    refit_step_s: float = Field(ge=0, description="The refitted model's step at the measured engines.")
    plan: planner.ResourcePlan = Field(description="The plan the estimator makes with the measured rates.")

    @property
    def step_time_ratio(self) -> float:
        """Predicted / measured step time (1: the plan was right; 3: it was three times optimistic)."""
        return self.predicted_step_s / self.measured_step_s if self.measured_step_s > 0 else 0.0


class EngineCurve(_Frozen):
    """The refitted model as the adaptive policy reads it: a step's generation seconds with 1..N
    engines (index k: k + 1 engines) and its training seconds on the job's trainer."""

    generation_s: tuple[float, ...] = Field(min_length=1)
    training_s: float = Field(ge=0)
    reason: str = ""

    def step_s(self, engines: int) -> float:
        """One-step-off pipeline: the slower of generation on `engines` engines and training."""
        return max(self.generation_s[engines - 1], self.training_s)

    def steady_engines(self, tolerance: float = STEADY_TOLERANCE) -> int:
        """The fewest engines whose step is within `tolerance` of the best any count here reaches:
        generation hidden behind training where engines can do that, else the point past which more
        engines no longer shorten the step (a step also waits for its longest sample)."""
        best = min(self.step_s(e) for e in range(1, len(self.generation_s) + 1))
        return next(
            e for e in range(1, len(self.generation_s) + 1) if self.step_s(e) <= best * (1 + tolerance)
        )


def usable_reports(reports: Sequence[telemetry.SyncReport]) -> list[telemetry.SyncReport]:
    """The reports a fit can read: the newest `REFIT_REPORTS` with both phases timed and the batch's
    tokens counted, the job's first step (start-up) left out while later ones exist."""
    timed = [
        r
        for r in reports
        if r.generation_s > MIN_PHASE_S and r.training_s > MIN_PHASE_S and r.generated_tokens > 0
    ]
    if len(timed) > 1 and timed[0].step <= 1:
        timed = timed[1:]
    return timed[-REFIT_REPORTS:]


def _engines(r: telemetry.SyncReport) -> int:
    return max(1, r.generation_engines or (r.dedicated_engines + r.shared_engines_awake))


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def refit(
    request: planner.PlanRequest, plan: planner.ResourcePlan, reports: Sequence[telemetry.SyncReport]
) -> Refit | None:
    """The plan against the job's reports (None while no report is usable)."""
    used = usable_reports(reports)
    if not used:
        return None
    sequences = request.prompts_per_step * request.group_size
    measured_prompt = [r.prompt_tokens / sequences for r in used if r.prompt_tokens > 0]
    mean_prompt = round(_median(measured_prompt)) if measured_prompt else None
    mean_completion = max(1, round(_median([r.generated_tokens / sequences for r in used])))
    workload = request.model_copy(
        update={
            "mean_prompt_tokens": max(1, mean_prompt) if mean_prompt else request.mean_prompt_tokens,
            "mean_completion_tokens": min(mean_completion, request.max_completion_tokens),
        }
    )
    times = planner.step_times(workload, plan)
    trainer = max(1, plan.trainer_accelerators)
    split = all(r.prefill_engine_s is not None and r.decode_engine_s is not None for r in used)
    decode_scales, prefill_scales, training_scales = [], [], []
    decode_rates, prefill_rates, training_rates = [], [], []
    for r in used:
        engines = _engines(r)
        pred_prefill_s, pred_decode_s = times.generation_parts_s(engines)
        if split:
            busy = (r.prefill_engine_s or 0.0) + (r.decode_engine_s or 0.0)
            share = (r.prefill_engine_s or 0.0) / busy if busy > 0 else 0.0
            prefill_s, decode_s = r.generation_s * share, r.generation_s * (1 - share)
            if prefill_s > 0 and pred_prefill_s > 0:
                prefill_scales.append(prefill_s / pred_prefill_s)
                prefill_rates.append(r.prompt_tokens / (prefill_s * engines))
            if decode_s > 0:
                decode_scales.append(decode_s / pred_decode_s)
                decode_rates.append(r.generated_tokens / (decode_s * engines))
        else:  # one scale for the whole generation
            scale = r.generation_s / (pred_prefill_s + pred_decode_s)
            decode_scales.append(scale)
            prefill_scales.append(scale)
        training_scales.append(r.training_s / times.training_s(trainer))
        if r.trained_tokens > 0:
            training_rates.append(r.trained_tokens / r.training_s)
    decode_scale = _median(decode_scales) if decode_scales else 1.0
    prefill_scale = _median(prefill_scales) if prefill_scales else decode_scale
    training_scale = _median(training_scales)
    engines = round(_median([_engines(r) for r in used]))
    pred_prefill_s, pred_decode_s = times.generation_parts_s(engines)
    wl = times.workload
    planned_decode = wl.sequences * wl.mean_completion_tokens / (pred_decode_s * engines)
    planned_prefill = (
        wl.sequences * wl.mean_prompt_tokens / (pred_prefill_s * engines) if pred_prefill_s else 0.0
    )
    planned_training = wl.train_tokens / times.training_s(trainer)
    scaled = workload.model_copy(
        update={
            "decode_scale": decode_scale,
            "prefill_scale": prefill_scale,
            "training_scale": training_scale,
        }
    )
    refitted = planner.step_times(scaled, plan)
    serial = plan.rollout_engines == 0
    gen_s, train_s = refitted.generation_s(engines), refitted.training_s(trainer)
    return Refit(
        reports=len(used),
        from_step=used[0].step,
        to_step=used[-1].step,
        mean_prompt_tokens=wl.mean_prompt_tokens,
        mean_completion_tokens=wl.mean_completion_tokens,
        engines=engines,
        decode_tokens_per_s_per_engine=Rate(
            planned=planned_decode, measured=_median(decode_rates) if decode_rates else None
        ),
        prefill_tokens_per_s_per_engine=Rate(
            planned=planned_prefill, measured=_median(prefill_rates) if prefill_rates else None
        ),
        training_tokens_per_s=Rate(
            planned=planned_training, measured=_median(training_rates) if training_rates else None
        ),
        decode_scale=decode_scale,
        prefill_scale=prefill_scale,
        training_scale=training_scale,
        split_measured=split,
        measured_step_s=_median([r.interval_s for r in used]),
        predicted_step_s=plan.step_time_s,
        refit_step_s=gen_s + train_s if serial else max(gen_s, train_s),
        plan=planner.plan_resources(scaled),
    )


def engine_curve(
    request: planner.PlanRequest, plan: planner.ResourcePlan, fitted: Refit, *, max_engines: int
) -> EngineCurve:
    """The refitted step model at 1..`max_engines` engines (dedicated + awake shared) on the plan's
    trainer: what the adaptive policy sizes the engines by."""
    scaled = request.model_copy(
        update={
            "mean_prompt_tokens": fitted.mean_prompt_tokens,
            "mean_completion_tokens": fitted.mean_completion_tokens,
            "decode_scale": fitted.decode_scale,
            "prefill_scale": fitted.prefill_scale,
            "training_scale": fitted.training_scale,
        }
    )
    times = planner.step_times(scaled, plan)
    curve = tuple(times.generation_s(e) for e in range(1, max(1, max_engines) + 1))
    train_s = times.training_s(max(1, plan.trainer_accelerators))
    return EngineCurve(
        generation_s=curve,
        training_s=train_s,
        reason=(
            f"refit over steps {fitted.from_step}-{fitted.to_step}: generation {curve[0]:.1f} s with one "
            f"engine (decode x{fitted.decode_scale:.2f} the plan's time), training {train_s:.1f} s "
            f"(x{fitted.training_scale:.2f})"
        ),
    )

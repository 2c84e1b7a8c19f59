"""Adaptive rollout policy: `decide()` turns sync-point telemetry into one wake/scale step.

Role: the pure core of adaptive mode (issue 5, item 4). The operator's telemetry timer
(`rljob_operator.handlers`) parses `<job>-telemetry` into `rljob_trainer.outputs.telemetry.SyncReport`s,
maps `spec.resources.adaptive` to `PolicySettings` (`PolicySettings.from_adaptive_spec`), builds a
`RolloutState` from `status.rollout` and the plan, calls `decide(...)`, logs and posts the
`Decision.reason` as an Event, and writes `desired_shared_awake` / `desired_dedicated_engines` to
`status.rollout`. `bench/adaptive.py` calls `decide()` from its simulator. Nothing here reads the
clock, the environment or the API: `now` is passed in.

What counts as pressure, and why it is read over the interval
--------------------------------------------------------------
The question at every sync point is "would more rollout engines make the trainer faster?". Two
things must be true:

1. The trainer waited for rollouts (`trainerWaitS / intervalS >= waitThreshold`). This is the key
   signal: if the trainer never waits, rollouts are not on the critical path and more engines
   cannot help, however busy they are.
2. The engines, not something else, are the bottleneck: they were busy
   (mean requests in flight per awake engine `>= busyThreshold`, and `> 0`). A trainer can also
   wait on a long tail (a few 8k-token answers decoding alone), on reward scoring, or on a starved
   dispatcher; then the engines sit nearly empty and another engine would sit empty too.

The seed read (2) as a *snapshot* of requests in flight at the sync instant. When generation for
the next batch finished before the sync (one-step-off pipelines: generation overlaps training, the
trainer waits for the batch, then syncs) the snapshot is 0 at every sync point however saturated
the engines were, so the rule never fired. `signal="integrated"` reads (2) over the whole
interval, `inflightRequestSeconds / engineSeconds`: the time-average of requests in flight per
awake engine, counting queued and dispatching requests. In a pipeline where the trainer waited,
generation spanned the wait, so this average is the load the engines carried while the trainer
was blocked on them. (In a fully synchronous pipeline the engines idle during training, which
dilutes the average by `generationS / intervalS`; set `busyThreshold` with that in mind.)
`signal="snapshot"` keeps the seed's reading so its rule stays expressible:
`PolicySettings.seed_rule()`.

Calm, and why scale-down predicts instead of reacting
-----------------------------------------------------
A sync point is *calm* when, with one engine fewer, the trainer would still not wait (below
`waitThreshold`) or the engines would still not be busy (below `busyThreshold`): the mirror image
of pressure, so a step down cannot be undone by the very next reading.
- Wait: with `E` engines awake and throughput-bound generation, one fewer engine stretches
  generation by at most `generationS / (E - 1)`. If the trainer waited at all, generation ended when
  the wait did, so all of the stretch adds to the wait (this covers synchronous pipelines, where
  the trainer always waits for generation). If it did not wait, generation overlapped training and
  finished `intervalS - generationS` early; only the stretch beyond that slack adds to the wait.
- Busy: the same requests on one engine fewer are `E / (E - 1)` times as many per engine.
A rule that scales down as soon as the trainer stops waiting removes the engine that made it stop
waiting, and flaps; the prediction is what prevents that.

Steps, in order (one step per call)
-----------------------------------
- Over the limit (the user lowered `maxRolloutEngines`, which caps *dedicated* engines as the API
  says; shared engines use no extra accelerators): clamp at once, below the plan if need be.
- Cooldown: no action within `cooldownS` of the last one.
- Only reports taken after the last action and showing the engine counts the state targets count
  toward a streak: reports about the old configuration say nothing about the new one, and a
  dedicated engine whose pod has not joined yet must not trigger another one.
- `wakeAfterPressuredSyncPoints` consecutive pressured points wake one sleeping shared engine
  (shared engines first: they cost no new accelerators).
- With every shared engine awake, `scaleUpAfterPressuredSyncPoints` further pressured points (counted
  after the last action, like every streak; with no shared engine, counted from the start) add
  one dedicated engine when `maxRolloutEngines` and the idle accelerators (`tensorParallel` per
  engine) allow.
- `calmSyncPointsBeforeScaleDown` consecutive calm points undo the last kind of step first: remove
  an added dedicated engine (it holds accelerators other jobs can use), then put a shared engine
  back to sleep. The planned dedicated engines are a floor.

How many engines one decision adds or removes
---------------------------------------------
Without a refit, one: the streak rules above see only whether the trainer waited, not by how much.
With the job's refitted model (`estimator.refit.EngineCurve`: generation seconds by engine count
and training seconds, fitted from the job's own SyncReports) a decision goes straight to the
count the measurements call for (`EngineCurve.steady_engines`: the fewest engines whose step is
within 5 % of the best any count reaches: generation hidden behind training, or as short as more
engines make it): an add goes up to it (at least one more, within the limit and the idle
accelerators), a removal down to it (at least one fewer, never below the plan). So a job whose
real generation rate is far from the plan's reaches its steady count in one or two decisions
instead of one per streak.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rljob_operator.estimator import refit as refit_mod
from rljob_trainer.outputs import telemetry

Action = Literal["none", "wake_shared", "add_dedicated", "sleep_shared", "remove_dedicated"]
SignalName = str


class PolicySettings(BaseModel):
    """The adaptive policy's knobs; plain mirror of `spec.resources.adaptive` (no API import)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_rollout_engines: int | None = Field(
        None, ge=0, description="Most dedicated rollout engines; None: as many as idle accelerators allow."
    )
    signal: SignalName = Field("integrated", description="Busy signal: integrated | snapshot.")
    busy_threshold: float = Field(
        1.0, ge=0, description="Mean requests in flight per awake engine that counts as busy."
    )
    wait_threshold: float = Field(
        0.1, ge=0, le=1, description="Fraction of the interval the trainer waited that counts as waiting."
    )
    wake_after_pressured_sync_points: int = Field(2, ge=1)
    scale_up_after_pressured_sync_points: int = Field(4, ge=1)
    calm_sync_points_before_scale_down: int = Field(3, ge=1)
    cooldown_s: float = Field(60.0, ge=0, description="Least time between two actions, s.")

    @model_validator(mode="after")
    def _known_signal(self) -> PolicySettings:
        get_busy_signal(self.signal)
        return self

    @classmethod
    def seed_rule(cls, **overrides: Any) -> PolicySettings:
        """The seed's rule: two consecutive sync points with requests in flight at the sync instant
        while the trainer waits wake the shared engine (`inflight_count > 0` → busy threshold 0)."""
        base: dict[str, Any] = {
            "signal": "snapshot",
            "busy_threshold": 0.0,
            "wake_after_pressured_sync_points": 2,
        }
        return cls(**{**base, **overrides})

    @classmethod
    def from_adaptive_spec(cls, spec: Any) -> PolicySettings:
        """Settings from `spec.resources.adaptive` (a model with snake_case or camelCase attributes,
        or a camelCase dict). Fields the spec does not carry keep their defaults."""
        names = {
            "max_rollout_engines": "maxRolloutEngines",
            "signal": "signal",
            "busy_threshold": "busyThreshold",
            "wait_threshold": "waitThreshold",
            "wake_after_pressured_sync_points": "wakeAfterPressuredSyncPoints",
            "scale_up_after_pressured_sync_points": "scaleUpAfterPressuredSyncPoints",
            "calm_sync_points_before_scale_down": "calmSyncPointsBeforeScaleDown",
            "cooldown_s": "cooldownSeconds",
        }
        aliases = {"cooldown_s": ("cooldown_seconds",)}
        values: dict[str, Any] = {}
        for field, camel in names.items():
            for key in (field, camel, *aliases.get(field, ())):
                value = spec.get(key) if isinstance(spec, Mapping) else getattr(spec, key, None)
                if value is not None:
                    values[field] = getattr(value, "value", value)  # enums → their value
                    break
        return cls(**values)


class RolloutState(BaseModel):
    """The job's rollout engines as the operator targets them now (`status.rollout` + the plan)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    shared_engines_total: int = Field(0, ge=0, description="Colocated engines on trainer accelerators.")
    shared_engines_awake: int = Field(0, ge=0, description="Of those, targeted awake.")
    dedicated_engines: int = Field(0, ge=0, description="Dedicated engines targeted now.")
    planned_dedicated_engines: int = Field(
        0, ge=0, description="Dedicated engines in the launch plan: scale-down never goes below."
    )
    idle_accelerators: int = Field(0, ge=0, description="Accelerators free for new dedicated engines.")
    accelerators_per_engine: int = Field(1, ge=1, description="Tensor-parallel size of one engine.")
    last_action_time_s: float | None = Field(None, description="Unix time of the last action, s.")

    @model_validator(mode="after")
    def _awake_le_total(self) -> RolloutState:
        if self.shared_engines_awake > self.shared_engines_total:
            raise ValueError(
                f"shared_engines_awake={self.shared_engines_awake} exceeds "
                f"shared_engines_total={self.shared_engines_total}"
            )
        return self

    @property
    def engines_awake(self) -> int:
        return self.shared_engines_awake + self.dedicated_engines


class Decision(BaseModel):
    """One step (or none) and the engine targets after it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    action: Action
    desired_shared_awake: int = Field(..., ge=0)
    desired_dedicated_engines: int = Field(..., ge=0)
    reason: str
    pressured_streak: int = Field(0, ge=0, description="Consecutive pressured sync points counted.")
    calm_streak: int = Field(0, ge=0, description="Consecutive calm sync points counted.")


# ---- busy signals (named variants) -------------------------------------------------------------


@dataclass(frozen=True)
class BusyReading:
    """Requests in flight per awake engine, as one signal reads it, and where it came from."""

    per_engine: float
    source: str


BusySignal = Callable[[telemetry.SyncReport], BusyReading]
_BUSY_SIGNALS: dict[str, BusySignal] = {}


def register_busy_signal(name: str) -> Callable[[BusySignal], BusySignal]:
    """Register a busy signal under `name` (decorator)."""

    def deco(fn: BusySignal) -> BusySignal:
        if name in _BUSY_SIGNALS:
            raise ValueError(f"busy signal {name!r} is already registered")
        _BUSY_SIGNALS[name] = fn
        return fn

    return deco


def get_busy_signal(name: str) -> BusySignal:
    """The busy signal registered as `name`; `ValueError` listing the valid names otherwise."""
    try:
        return _BUSY_SIGNALS[name]
    except KeyError:
        raise ValueError(
            f"unknown adaptive signal {name!r}; valid: {', '.join(sorted(_BUSY_SIGNALS))}"
        ) from None


def busy_signal_names() -> list[str]:
    return sorted(_BUSY_SIGNALS)


@register_busy_signal("integrated")
def busy_integrated(report: telemetry.SyncReport) -> BusyReading:
    """Time-average over the interval: `inflightRequestSeconds / engineSeconds`."""
    per_engine = report.inflight_request_seconds / report.engine_seconds if report.engine_seconds > 0 else 0.0
    return BusyReading(per_engine, "in flight per engine, interval mean")


@register_busy_signal("snapshot")
def busy_snapshot(report: telemetry.SyncReport) -> BusyReading:
    """The seed's reading: requests in flight at the sync instant, per awake engine."""
    engines = report.shared_engines_awake + report.dedicated_engines
    per_engine = report.snapshot_inflight / engines if engines > 0 else float(report.snapshot_inflight)
    return BusyReading(per_engine, "in flight per engine at the sync instant")


# ---- classification of one sync point ----------------------------------------------------------


@dataclass(frozen=True)
class SyncPointReading:
    """How one report reads under the settings: pressured, calm, or neither."""

    step: int
    wait_fraction: float
    busy: BusyReading
    pressured: bool
    calm: bool
    predicted_wait_fraction: float  # with one engine fewer; inf when no engine could be removed
    predicted_busy_per_engine: float  # with one engine fewer; inf when no engine could be removed


def read_sync_point(report: telemetry.SyncReport, settings: PolicySettings) -> SyncPointReading:
    """Classify one report. An empty interval (the first sync) is neither pressured nor calm."""
    busy = get_busy_signal(settings.signal)(report)
    if report.interval_s <= 0:
        return SyncPointReading(report.step, 0.0, busy, False, False, float("inf"), float("inf"))
    wait_fraction = min(1.0, report.trainer_wait_s / report.interval_s)
    waited = wait_fraction >= settings.wait_threshold
    is_busy = busy.per_engine > 0 and busy.per_engine >= settings.busy_threshold
    engines = report.shared_engines_awake + report.dedicated_engines
    if engines >= 2:
        stretch_s = report.generation_s / (engines - 1)
        slack_s = 0.0 if report.trainer_wait_s > 0 else max(0.0, report.interval_s - report.generation_s)
        extra_wait_s = max(0.0, stretch_s - slack_s)
        predicted_wait = (report.trainer_wait_s + extra_wait_s) / (report.interval_s + extra_wait_s)
        predicted_busy = busy.per_engine * engines / (engines - 1)
    else:
        predicted_wait = predicted_busy = float("inf")
    # Each prediction is >= today's reading, so a calm point is never a pressured one.
    calm = predicted_wait < settings.wait_threshold or predicted_busy < settings.busy_threshold
    return SyncPointReading(
        report.step, wait_fraction, busy, waited and is_busy, calm, predicted_wait, predicted_busy
    )


def _counts_toward_streak(report: telemetry.SyncReport, state: RolloutState) -> bool:
    after_last_action = state.last_action_time_s is None or report.time > state.last_action_time_s
    settled = (
        report.shared_engines_awake == state.shared_engines_awake
        and report.dedicated_engines == state.dedicated_engines
    )
    return after_last_action and settled


def count_streaks(
    history: Sequence[telemetry.SyncReport], state: RolloutState, settings: PolicySettings
) -> tuple[int, int, list[SyncPointReading]]:
    """(pressured streak, calm streak, readings newest first) over the reports that count.

    Walks back from the newest report; stops at the first one taken before the last action or
    showing engine counts other than the state's targets."""
    readings: list[SyncPointReading] = []
    for report in reversed(history):
        if not _counts_toward_streak(report, state):
            break
        readings.append(read_sync_point(report, settings))
    pressured = next((i for i, r in enumerate(readings) if not r.pressured), len(readings))
    calm = next((i for i, r in enumerate(readings) if not r.calm), len(readings))
    return pressured, calm, readings


# ---- decide --------------------------------------------------------------------------------------


def _describe(readings: Sequence[SyncPointReading], n: int, settings: PolicySettings) -> str:
    """'steps a–b: trainer waited x–y% (≥ w%), engines held p–q in flight per engine (≥ b, signal)'."""
    window = list(reversed(readings[:n]))
    waits = [r.wait_fraction * 100 for r in window]
    busy = [r.busy.per_engine for r in window]
    steps = f"step {window[0].step}" if n == 1 else f"steps {window[0].step}–{window[-1].step}"
    return (
        f"{steps}: trainer waited {min(waits):.0f}–{max(waits):.0f}% of the interval "
        f"(≥ {settings.wait_threshold * 100:.0f}%), engines held {min(busy):.1f}–{max(busy):.1f} "
        f"requests {window[0].busy.source} (≥ {settings.busy_threshold:g}, signal {settings.signal})"
    )


def _describe_calm(readings: Sequence[SyncPointReading], n: int, settings: PolicySettings) -> str:
    window = list(reversed(readings[:n]))
    waits = [r.wait_fraction * 100 for r in window]
    pred_wait = [r.predicted_wait_fraction * 100 for r in window]
    pred_busy = [r.predicted_busy_per_engine for r in window]
    steps = f"step {window[0].step}" if n == 1 else f"steps {window[0].step}–{window[-1].step}"
    return (
        f"{steps}: with one engine fewer the trainer would wait {min(pred_wait):.0f}–{max(pred_wait):.0f}% "
        f"of the interval (threshold {settings.wait_threshold * 100:.0f}%; it waited {max(waits):.0f}% "
        f"at most) or engines would hold {min(pred_busy):.1f}–{max(pred_busy):.1f} requests "
        f"(threshold {settings.busy_threshold:g})"
    )


def _clamp_to_limits(state: RolloutState, settings: PolicySettings) -> Decision | None:
    """Bring an over-limit state down at once (the limit is the user's; no streak, no cooldown)."""
    limit = settings.max_rollout_engines
    if limit is None or state.dedicated_engines <= limit:
        return None
    return Decision(
        action="remove_dedicated",
        desired_shared_awake=state.shared_engines_awake,
        desired_dedicated_engines=limit,
        reason=f"{state.dedicated_engines} dedicated engines exceed maxRolloutEngines={limit}: down to it",
    )


def refit_dedicated_target(state: RolloutState, curve: refit_mod.EngineCurve | None) -> int | None:
    """The dedicated engines the refitted model calls for with every shared engine awake (its
    `steady_engines`: generation behind training, or as short as more engines make it), or None
    without a refit."""
    if curve is None:
        return None
    return max(0, curve.steady_engines() - state.shared_engines_total)


def decide(
    state: RolloutState,
    history: Sequence[telemetry.SyncReport],
    settings: PolicySettings,
    now: float,
    *,
    refit: refit_mod.EngineCurve | None = None,
) -> Decision:
    """One adaptive step from the sync-point history (oldest first) at time `now` (unix s).

    Pure and deterministic. See the module docstring for the rules; `Decision.reason` names the
    numbers, thresholds and sync points behind the step. `refit` (the job's refitted model) sets how
    many engines one add or removal moves."""
    clamped = _clamp_to_limits(state, settings)
    if clamped is not None:
        return clamped
    pressured, calm, readings = count_streaks(history, state, settings)

    def keep(reason: str) -> Decision:
        return Decision(
            action="none",
            desired_shared_awake=state.shared_engines_awake,
            desired_dedicated_engines=state.dedicated_engines,
            reason=reason,
            pressured_streak=pressured,
            calm_streak=calm,
        )

    def step(action: Action, shared: int, dedicated: int, reason: str) -> Decision:
        return Decision(
            action=action,
            desired_shared_awake=shared,
            desired_dedicated_engines=dedicated,
            reason=reason,
            pressured_streak=pressured,
            calm_streak=calm,
        )

    if state.last_action_time_s is not None and now - state.last_action_time_s < settings.cooldown_s:
        left_s = settings.cooldown_s - (now - state.last_action_time_s)
        return keep(f"cooldown: {left_s:.0f} s of cooldownSeconds={settings.cooldown_s:g} left")
    if not readings:
        if history:
            last = history[-1]
            return keep(
                "waiting for the last action to take effect: newest report (step "
                f"{last.step}) shows {last.shared_engines_awake} shared awake + "
                f"{last.dedicated_engines} dedicated, target {state.shared_engines_awake} + "
                f"{state.dedicated_engines}"
            )
        return keep("no sync-point reports yet")

    limit = settings.max_rollout_engines
    at_limit = limit is not None and state.dedicated_engines >= limit
    if pressured >= settings.wake_after_pressured_sync_points and (
        state.shared_engines_awake < state.shared_engines_total
    ):
        why = _describe(readings, pressured, settings)
        wake, sized = 1, ""
        if refit is not None:  # as many as the refitted model calls for (shared ones cost no accelerator)
            wanted = refit.steady_engines()
            sleeping = state.shared_engines_total - state.shared_engines_awake
            wake = max(1, min(sleeping, wanted - state.engines_awake))
            if wake > 1:
                sized = (
                    f"; {refit.reason}: the step is shortest with {wanted} engine(s), so wake {wake} at once"
                )
        first, last = state.shared_engines_awake + 1, state.shared_engines_awake + wake
        which = f"engine {first}" if wake == 1 else f"engines {first}-{last}"
        return step(
            "wake_shared",
            state.shared_engines_awake + wake,
            state.dedicated_engines,
            f"{pressured} pressured sync points ≥ wakeAfterPressuredSyncPoints="
            f"{settings.wake_after_pressured_sync_points} ({why}): wake shared {which} "
            f"of {state.shared_engines_total}{sized}",
        )
    if pressured >= settings.scale_up_after_pressured_sync_points and (
        state.shared_engines_awake == state.shared_engines_total
    ):
        why = _describe(readings, pressured, settings)
        if at_limit:
            return keep(f"pressured ({why}) but {state.dedicated_engines} dedicated = maxRolloutEngines")
        if state.idle_accelerators < state.accelerators_per_engine:
            return keep(
                f"pressured ({why}) but {state.idle_accelerators} idle accelerators < "
                f"{state.accelerators_per_engine} per engine"
            )
        add, sized = 1, ""
        wanted = refit_dedicated_target(state, refit)
        if refit is not None and wanted is not None and wanted <= state.dedicated_engines:
            return keep(
                f"pressured ({why}) but {refit.reason}: more than {state.dedicated_engines} dedicated "
                f"engine(s) would shorten the step by less than {refit_mod.STEADY_TOLERANCE:.0%} "
                "(its longest "
                "samples or training bound it)"
            )
        if refit is not None and wanted is not None and wanted > state.dedicated_engines + 1:
            room = state.idle_accelerators // state.accelerators_per_engine
            if limit is not None:
                room = min(room, limit - state.dedicated_engines)
            add = max(1, min(wanted - state.dedicated_engines, room))
            sized = (
                f"; {refit.reason}: the step is shortest with {wanted} dedicated engine(s), "
                f"so add {add} at once"
            )
        first, last = state.dedicated_engines + 1, state.dedicated_engines + add
        which = f"engine {first}" if add == 1 else f"engines {first}-{last}"
        return step(
            "add_dedicated",
            state.shared_engines_awake,
            state.dedicated_engines + add,
            f"{pressured} pressured sync points ≥ scaleUpAfterPressuredSyncPoints="
            f"{settings.scale_up_after_pressured_sync_points} with all {state.shared_engines_total} "
            f"shared engines awake ({why}): add dedicated {which} on "
            f"{add * state.accelerators_per_engine} of {state.idle_accelerators} idle accelerators{sized}",
        )
    if calm >= settings.calm_sync_points_before_scale_down:
        why = _describe_calm(readings, calm, settings)
        head = (
            f"{calm} calm sync points ≥ calmSyncPointsBeforeScaleDown="
            f"{settings.calm_sync_points_before_scale_down}"
        )
        if state.dedicated_engines > state.planned_dedicated_engines:
            target, sized = state.dedicated_engines - 1, ""
            wanted = refit_dedicated_target(state, refit)
            if refit is not None and wanted is not None and wanted < target:
                target = max(wanted, state.planned_dedicated_engines)
                sized = f"; {refit.reason}: {wanted} dedicated engine(s) are enough"
            gone = state.dedicated_engines - target
            which = (
                f"engine {state.dedicated_engines}"
                if gone == 1
                else f"engines {target + 1}-{state.dedicated_engines}"
            )
            return step(
                "remove_dedicated",
                state.shared_engines_awake,
                target,
                f"{head} ({why}): remove dedicated {which} "
                f"(plan has {state.planned_dedicated_engines}){sized}",
            )
        if state.shared_engines_awake > 0:
            return step(
                "sleep_shared",
                state.shared_engines_awake - 1,
                state.dedicated_engines,
                f"{head} ({why}): put shared engine {state.shared_engines_awake} back to sleep",
            )
        return keep(f"calm ({why}); nothing above the plan to release")
    newest = readings[0]
    return keep(
        f"hold: {pressured} pressured, {calm} calm consecutive sync points; newest (step "
        f"{newest.step}) trainer waited {newest.wait_fraction * 100:.0f}% (threshold "
        f"{settings.wait_threshold * 100:.0f}%), engines held {newest.busy.per_engine:.1f} requests "
        f"{newest.busy.source} (threshold {settings.busy_threshold:g})"
    )

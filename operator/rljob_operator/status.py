"""The RLJob's status, computed from what the handlers observed: phase, conditions, plan, progress.

Role: pure functions the shell calls after it has reconciled: `compute_status(old, situation, ...)`
returns the new `api.RLJobStatus`; the shell writes it through the status subresource only when
`status_patch` says it changed. Conditions follow the API conventions (one per type,
`lastTransitionTime` kept while the status stays the same, `observedGeneration`). `REASONS` is the
one table from exception classes to condition reasons. No clock: `now` is an argument.

Condition types:
- `Planned`: the spec parsed and a plan exists (False: InvalidSpec, ModelConfigUnreadable, ...).
- `Ready`: every desired pod of the current attempt is Running.
- `Suspended`: spec.suspend removed the pods.
- `Restarting`: waiting out the backoff after a pod failure (lastTransitionTime = the failure).
- `Complete` / `Failed`: the run ended.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, Literal

import pydantic

from rljob_operator import api, errors, names
from rljob_operator.builders.common import JobLayout
from rljob_operator.estimator.errors import EstimatorError
from rljob_operator.reconcile import PodObservation
from rljob_trainer.telemetry import SyncReport

PLANNED = "Planned"
READY = "Ready"
SUSPENDED = "Suspended"
RESTARTING = "Restarting"
COMPLETE = "Complete"
FAILED = "Failed"
CONDITION_TYPES = (PLANNED, READY, SUSPENDED, RESTARTING, COMPLETE, FAILED)

# The one table: exception class -> condition reason (most specific class wins, by MRO).
REASONS: dict[type[BaseException], str] = {
    pydantic.ValidationError: "InvalidSpec",
    errors.InvalidSpecError: "InvalidSpec",
    errors.ModelConfigUnreadableError: "ModelConfigUnreadable",
    errors.ModelDoesNotFitError: "ModelDoesNotFit",
    errors.InsufficientCapacityError: "InsufficientAccelerators",
    EstimatorError: "EstimateFailed",  # refined by EstimatorError.reason (ModelDoesNotFit, ...)
    Exception: "ReconcileError",
}
# Errors that waiting may fix leave the job Pending; the rest fail it.
_RETRYABLE_ESTIMATOR_REASONS: frozenset[str] = frozenset()


def reason_for(exc: BaseException) -> str:
    """The condition reason of `exc` from `REASONS` (EstimatorError carries its own, finer reason)."""
    if isinstance(exc, EstimatorError):
        return exc.reason
    for cls in type(exc).__mro__:
        if cls in REASONS:
            return REASONS[cls]
    return "ReconcileError"


def is_retryable(exc: BaseException) -> bool:
    """Whether waiting can fix `exc` (the job stays Pending) or not (the job fails)."""
    if isinstance(exc, errors.RLJobError):
        return exc.retryable
    if isinstance(exc, EstimatorError):
        return exc.reason in _RETRYABLE_ESTIMATOR_REASONS
    return not isinstance(exc, pydantic.ValidationError)


def message_for(exc: BaseException) -> str:
    """A message naming the field and the fix (pydantic errors: every failing field, with its rule)."""
    if isinstance(exc, pydantic.ValidationError):
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(p) for p in err["loc"])
            parts.append(f"spec.{loc}: {err['msg']}" if loc else err["msg"])
        return "; ".join(parts) + " (fix the RLJob spec and apply it again)"
    if isinstance(exc, (errors.RLJobError, EstimatorError)):
        return f"{exc.field}: {exc.message}"
    return f"{type(exc).__name__}: {exc}"


# ---- what the shell found ------------------------------------------------------------------------
Kind = Literal["error", "suspended", "succeeded", "failed", "backoff", "progressing", "finished"]


@dataclasses.dataclass(frozen=True)
class Situation:
    """The outcome of one reconcile, as the shell determined it.

    - error: `error` stopped the reconcile (spec, plan or capacity).
    - suspended: pods removed on spec.suspend.
    - succeeded / failed: the run just ended (`failed_pod` says why it failed).
    - backoff: `failed_pod` failed, restart number `restarts` waits until `restart_at`.
    - progressing: pods exist or are being created (`waiting`: names still terminating).
    - finished: the job had already ended; nothing changes but the generation.
    """

    kind: Kind
    error: BaseException | None = None
    failed_pod: PodObservation | None = None
    restarts: int = 0
    waiting: tuple[str, ...] = ()
    backoff_limit_exceeded: bool = False


def _condition(
    type_: str, status: bool, reason: str, message: str, generation: int, now: datetime
) -> api.Condition:
    return api.Condition(
        type=type_,
        status="True" if status else "False",
        reason=reason,
        message=message[:32768],
        last_transition_time=now,
        observed_generation=generation,
    )


def _set(
    conds: list[api.Condition], cond: api.Condition, *, force_transition: bool = False
) -> list[api.Condition]:
    if force_transition:
        return [c for c in conds if c.type != cond.type] + [cond]
    return api.set_condition(conds, cond)


def _pods_summary(pods: Sequence[PodObservation], layout: JobLayout | None) -> tuple[int, int]:
    """(running, desired) pods of the current attempt."""
    desired = (layout.trainer_pods + layout.rollout_pods) if layout else 0
    running = sum(1 for p in pods if p.phase == "Running" and not p.deleting)
    return running, desired


def _significant(value: float, digits: int = 4) -> float:
    """`value` to `digits` significant digits: what `kubectl get rljobs` shows needs no more."""
    return float(f"{value:.{digits}g}")


def _progress(spec: api.RLJobSpec | None, report: SyncReport | None, old: api.ProgressStatus | None) -> Any:
    if report is None:
        if spec is None:
            return old
        base = old.model_copy() if old else api.ProgressStatus()
        base.max_steps = spec.grpo.max_steps
        return base
    return api.ProgressStatus(
        step=report.step,
        max_steps=spec.grpo.max_steps if spec else (old.max_steps if old else None),
        mean_reward=_significant(report.mean_reward),
        loss=_significant(report.loss),
        tokens_per_second=round(report.tokens_per_s, 1),
        last_sync_time=datetime.fromtimestamp(report.time, tz=timezone.utc),
        export_path=report.export_path or (old.export_path if old else None),
    )


def compute_rollout(
    old: api.RolloutStatus | None,
    plan: api.PlanStatus | None,
    layout: JobLayout | None,
    pods: Sequence[PodObservation],
    report: SyncReport | None,
) -> api.RolloutStatus | None:
    """Rollout engines now (from pods and the latest report), keeping the policy's targets."""
    if plan is None:
        return old
    out = old.model_copy() if old else api.RolloutStatus()
    out.shared_engines = plan.shared_engines or 0
    out.shared_engines_awake = min(report.shared_engines_awake, out.shared_engines) if report else 0
    out.dedicated_engines = sum(
        1 for p in pods if p.role == names.ROLE_ROLLOUT and p.phase == "Running" and not p.deleting
    )
    if out.desired_dedicated_engines is None:
        out.desired_dedicated_engines = plan.rollout_engines or 0
    if out.desired_shared_awake is None:
        out.desired_shared_awake = 0
    out.idle_accelerators = layout.idle_accelerators if layout else None
    return api.RolloutStatus.model_validate(out.model_dump())  # refresh enginesAwakeTotal


def compute_status(
    old: api.RLJobStatus,
    situation: Situation,
    *,
    generation: int,
    now: datetime,
    spec: api.RLJobSpec | None = None,
    plan: api.PlanStatus | None = None,
    layout: JobLayout | None = None,
    pods: Sequence[PodObservation] = (),
    report: SyncReport | None = None,
) -> api.RLJobStatus:
    """The new status for `situation` (a fresh object; `old` is not modified)."""
    new = old.model_copy(deep=True)
    new.observed_generation = generation
    conds = list(new.conditions)
    kind = situation.kind
    if kind == "finished":
        new.conditions = conds
        return new
    if plan is not None:
        new.plan = plan
    new.progress = _progress(spec, report, new.progress)
    new.rollout = compute_rollout(new.rollout, plan, layout, pods, report)
    new.restarts = situation.restarts if situation.restarts else (new.restarts or 0)

    if kind == "error":
        exc = situation.error or RuntimeError("unknown error")
        reason, message = reason_for(exc), message_for(exc)
        if isinstance(exc, errors.InsufficientCapacityError):
            conds = _set(
                conds, _condition(PLANNED, True, "PlanComputed", _plan_message(plan), generation, now)
            )
            conds = _set(conds, _condition(READY, False, reason, message, generation, now))
        else:
            conds = _set(conds, _condition(PLANNED, False, reason, message, generation, now))
            conds = _set(conds, _condition(READY, False, reason, message, generation, now))
        if is_retryable(exc):
            new.phase = "Pending"
        else:
            new.phase = "Failed"
            new.completion_time = new.completion_time or now
            conds = _set(conds, _condition(FAILED, True, reason, message, generation, now))
        new.conditions = conds
        return new

    conds = _set(conds, _condition(PLANNED, True, "PlanComputed", _plan_message(plan), generation, now))
    suspended = kind == "suspended"
    conds = _set(
        conds,
        _condition(
            SUSPENDED,
            suspended,
            "SuspendedBySpec" if suspended else "NotSuspended",
            "spec.suspend is true: pods deleted, the job is kept" if suspended else "",
            generation,
            now,
        ),
    )
    running, desired = _pods_summary(pods, layout)
    if kind == "suspended":
        new.phase = "Suspended"
        conds = _set(conds, _condition(READY, False, "Suspended", "the job is suspended", generation, now))
    elif kind == "succeeded":
        new.phase = "Succeeded"
        new.completion_time = new.completion_time or now
        conds = _set(conds, _condition(READY, False, "Finished", "the run succeeded", generation, now))
        conds = _set(
            conds, _condition(COMPLETE, True, "TrainingSucceeded", "trainer pod 0 exited 0", generation, now)
        )
        conds = _set(conds, _condition(RESTARTING, False, "Finished", "", generation, now))
    elif kind == "failed":
        pod = situation.failed_pod
        reason = "BackoffLimitExceeded" if situation.backoff_limit_exceeded else "PodFailed"
        message = _failure_message(pod, situation, spec)
        new.phase = "Failed"
        new.completion_time = new.completion_time or now
        conds = _set(conds, _condition(READY, False, reason, message, generation, now))
        conds = _set(conds, _condition(FAILED, True, reason, message, generation, now))
        conds = _set(conds, _condition(RESTARTING, False, "Finished", "", generation, now))
    elif kind == "backoff":
        message = _failure_message(situation.failed_pod, situation, spec)
        new.phase = "Pending"
        conds = _set(conds, _condition(READY, False, "BackoffAfterPodFailure", message, generation, now))
        restarting = find(conds, RESTARTING)
        fresh = (
            restarting is None
            or restarting.status != "True"
            or restarting.reason != f"Restart{situation.restarts}"
        )
        conds = _set(
            conds,
            _condition(RESTARTING, True, f"Restart{situation.restarts}", message, generation, now),
            force_transition=fresh,
        )
    else:  # progressing
        new.start_time = new.start_time or now
        all_running = desired > 0 and running >= desired and not situation.waiting
        new.phase = "Running" if all_running else "Pending"
        conds = _set(
            conds,
            _condition(
                READY,
                all_running,
                "AllPodsRunning" if all_running else "PodsPending",
                f"{running}/{desired} pods running",
                generation,
                now,
            ),
        )
        if find(conds, RESTARTING) is not None:
            conds = _set(conds, _condition(RESTARTING, False, "PodsRecreated", "", generation, now))
    new.conditions = conds
    return new


def _plan_message(plan: api.PlanStatus | None) -> str:
    if plan is None:
        return ""
    return (
        f"trainer {plan.trainer_accelerators} accelerators, {plan.rollout_engines} dedicated engines "
        f"(TP {plan.tensor_parallel}), {plan.shared_engines} shared"
    )


def _failure_message(pod: PodObservation | None, situation: Situation, spec: api.RLJobSpec | None) -> str:
    what = "a pod failed"
    if pod is not None:
        code = f" with exit code {pod.exit_code}" if pod.exit_code is not None else ""
        what = f"pod {pod.name} failed{code}" + (f" ({pod.message})" if pod.message else "")
    if situation.kind == "failed":
        if spec is not None and spec.restart_policy.policy == "Never":
            return (
                f"{what}; spec.restartPolicy.policy is Never: set it to OnFailure to restart from checkpoints"
            )
        limit = spec.restart_policy.backoff_limit if spec else "?"
        return (
            f"{what}; {situation.restarts} restarts reached spec.restartPolicy.backoffLimit ({limit}): "
            "fix the cause, then raise backoffLimit or recreate the job"
        )
    return f"{what}; restart {situation.restarts} resumes from the last checkpoint after the backoff"


def find(conditions: Sequence[api.Condition], type_: str) -> api.Condition | None:
    return api.find_condition(conditions, type_)


def restart_due_at(status: api.RLJobStatus) -> datetime | None:
    """When the pending restart's backoff started (the Restarting condition's transition), or None."""
    cond = find(status.conditions, RESTARTING)
    if cond is None or cond.status != "True":
        return None
    return cond.last_transition_time


def status_patch(old: Mapping[str, Any] | None, new: api.RLJobStatus) -> dict[str, Any] | None:
    """The merge patch for `.status`, or None when nothing changed (so nothing is written).

    Compares the canonical JSON of both (timestamps at whole seconds), so a reconcile that finds
    the world unchanged makes no API call. Keys that disappeared are sent as null.
    """
    old_parsed = api.RLJobStatus.model_validate(old or {}).to_k8s()
    new_json = new.to_k8s()
    if old_parsed == new_json:
        return None
    patch: dict[str, Any] = dict(new_json)
    for key in old_parsed:
        if key not in new_json:
            patch[key] = None
    return patch


def transitions(old: Sequence[api.Condition], new: Sequence[api.Condition]) -> list[api.Condition]:
    """Conditions whose status or reason changed: the shell posts one Event for each."""
    before = {c.type: (c.status, c.reason) for c in old}
    return [c for c in new if before.get(c.type) != (c.status, c.reason)]


def event_type(cond: api.Condition) -> Literal["Normal", "Warning"]:
    """Warning for conditions that report trouble, Normal otherwise."""
    bad = (cond.type in (FAILED, RESTARTING) and cond.status == "True") or (
        cond.type in (PLANNED, READY)
        and cond.status == "False"
        and cond.reason not in ("PodsPending", "Suspended", "Finished")
    )
    return "Warning" if bad else "Normal"


def should_post(last_posted_s: float | None, now_s: float, min_interval_s: float) -> bool:
    """Rate limit for Events: at most one per (job, reason) every `min_interval_s` seconds."""
    return last_posted_s is None or now_s - last_posted_s >= min_interval_s

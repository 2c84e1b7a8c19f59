"""The RLJob's status, computed from what one reconcile observed: phase, conditions, plan, progress.

Role: pure functions the shell calls once, at the tail of every reconcile:
`compute_status(old, observed, ...)` returns the new `api.RLJobStatus` from `Observed` (what the
reconcile steps saw and did); the shell writes it through the status subresource only when
`status_patch` says it changed. Conditions follow the API conventions (one per type,
`lastTransitionTime` kept while the status stays the same, `observedGeneration`). Exceptions map
to reasons through the one hierarchy in `rljob_operator.errors` (`reason_for`): an `RLJobError`
carries its own reason and `retryable`; anything else is `InternalError` quoting the exception.
No clock: `now` is an argument.

Condition types:
- `Planned`: the spec parsed and a plan exists (False: InvalidSpec, ModelConfigUnreadable, ...).
- `Ready`: every desired pod of the current attempt is Running (False: the pod-level cause:
  Unschedulable with the scheduler's message, ImagePullBackOff, CreateContainerConfigError, ...).
- `Suspended`: spec.suspend removed the pods.
- `Restarting`: a new attempt replaces the pods (after a failure, with backoff; after a
  disruption, at once); lastTransitionTime = when it began.
- `Complete` / `Failed`: the run ended (a spec error fails the job until a new generation fixes it).
- `Admitted`: only for jobs labelled `kueue.x-k8s.io/queue-name`: Kueue admitted the job's
  Workload (False/Queued: no pod exists until it does; the phase is `Queued`).
- `EnvironmentsReady`: only for jobs with spec.environments: every environment server's pods pass
  their readiness probe (False: the first pod's trouble, CrashLoopBackOff, ImagePullBackOff,
  CreateContainerConfigError, Unschedulable, EnvironmentNotReady, naming the pod and the fix; or
  EnvironmentsStarting); `status.environments` has each one's ready pods and URL.
- `Preempted`: Kueue evicted or preempted the job (`rljob_operator.decide.preemption`): True while the
  driver checkpoints (CheckpointRequested), its pods go (Stopping) and it waits in the queue
  (Requeued); False/Resumed once the readmitted job runs again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, Literal

import pydantic

from rljob_operator import api, errors, names
from rljob_operator.builders.common import JobLayout, JobRef
from rljob_operator.decide.admission import Placement
from rljob_operator.decide.lifecycle import PodObservation, RestartDecision
from rljob_operator.decide.preemption import Decision as PreemptionDecision
from rljob_trainer.outputs.telemetry import SyncReport

PLANNED = "Planned"
READY = "Ready"
SUSPENDED = "Suspended"
RESTARTING = "Restarting"
COMPLETE = "Complete"
FAILED = "Failed"
GANG_SCHEDULING = "GangScheduling"
ENVIRONMENTS_READY = "EnvironmentsReady"  # spec.environments: every server's pods ready (or why not)
TRACKING = "Tracking"  # False when an experiment tracker (W&B, MLflow) could not start or failed
DATA_FILTERED = "DataFiltered"  # True when prompts over spec.lengths.maxPromptTokens were dropped
ADMITTED = "Admitted"
PREEMPTED = "Preempted"
CONDITION_TYPES = (
    PLANNED,
    READY,
    SUSPENDED,
    RESTARTING,
    COMPLETE,
    FAILED,
    ADMITTED,
    PREEMPTED,
    GANG_SCHEDULING,
    ENVIRONMENTS_READY,
)
#: An environment pod that runs without passing its readiness probe is starting for this long, then
#: it is named as not ready (EnvironmentNotReady): a server that never becomes ready says so.
ENVIRONMENT_READINESS_GRACE_S = 60.0
#: The fix of each way an environment pod fails, after the pod and the kubelet's words.
_ENVIRONMENT_FIXES = {
    "CrashLoopBackOff": "the server exits (kubectl logs {pod} --previous says why): fix "
    "spec.environments[{i}].command, args or image",
    "ImagePullBackOff": "fix spec.environments[{i}].image (or spec.image.pullSecrets)",
    "ErrImagePull": "fix spec.environments[{i}].image (or spec.image.pullSecrets)",
    "InvalidImageName": "fix spec.environments[{i}].image",
    "CreateContainerConfigError": "create the Secret or ConfigMap it names, or fix "
    "spec.environments[{i}].env",
    "Unschedulable": "no node takes it: fix spec.environments[{i}].nodeSelector or resources, or add nodes",
    "EnvironmentNotReady": "its readiness probe (GET {path} on port {port}) does not pass: the server must "
    "answer 200 there (kubectl logs {pod}); fix spec.environments[{i}].readinessPath or the server",
    "EnvironmentPodEnded": "the cluster ended it (evicted, or its node lost): it is recreated",
}
RESTART_AFTER_DISRUPTION = "Disrupted"
RESTART_AFTER_FAILURE = "PodFailed"
FIX_SPEC = "fix the spec and apply it again: the job goes on with the new generation"


def reason_for(exc: BaseException) -> str:
    """The condition reason of `exc`: its class's `reason`; pydantic errors are InvalidSpec."""
    if isinstance(exc, errors.RLJobError):
        return exc.reason
    if isinstance(exc, pydantic.ValidationError):
        return errors.InvalidSpecError.reason
    return errors.InternalError.reason


def is_retryable(exc: BaseException) -> bool:
    """Whether waiting can fix `exc` (the job stays Pending) or only a new spec can (it fails)."""
    if isinstance(exc, errors.RLJobError):
        return exc.retryable
    return not isinstance(exc, pydantic.ValidationError)


def message_for(exc: BaseException) -> str:
    """A message naming the field and the fix (pydantic errors: every failing field, with its rule)."""
    if isinstance(exc, pydantic.ValidationError):
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(p) for p in err["loc"])
            parts.append(f"spec.{loc}: {err['msg']}" if loc else err["msg"])
        return "; ".join(parts) + f" ({FIX_SPEC})"
    if isinstance(exc, errors.InternalError):
        return f"{exc.field}: {exc.message} (an operator error; it retries)"
    if isinstance(exc, errors.RLJobError):
        suffix = "" if exc.retryable else f" ({FIX_SPEC})"
        return f"{exc.field}: {exc.message}{suffix}"
    return f"{type(exc).__name__}: {exc}"


# ---- what the reconcile steps observed -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Observed:
    """What one reconcile saw and did, step by step; `compute_status`'s only input besides `old`.

    - error: the exception that stopped the steps (spec, plan, volumes, capacity, or a bug).
    - finished: the job had already ended; only observedGeneration (and the TTL) matter.
    - suspended: spec.suspend removed the pods.
    - decision: the restart decision for the current attempt's pods (`lifecycle.decide_restart`).
    - restart_wait_s: a restart's backoff is still running (seconds left).
    - pods: the pods of the attempt in force; waiting: names still terminating.
    - rollout: adaptive targets decided by this reconcile (persisted with the status).
    - gang: the GangScheduling condition (status, reason, message): a PodGroup, or why none.
    - queue: Kueue admission of a job labelled kueue.x-k8s.io/queue-name (None: not queued by
      Kueue); while `queue.admitted` is False the job is Queued and has no pods. placements: for
      each pod Kueue admitted, the nodeLabels and tolerations of its flavors (the pods step applies them).
    - preemption: this reconcile's step of a cooperative preemption (`preemption.decide`), with
      the sentence for the Preempted condition.
    - unbound_claims: read once the scheduler refused a pod (`lifecycle.unbound_claims`): an
      Unschedulable pod then reads ClaimNotBound, naming the claim instead of the scheduler's
      "unbound immediate PersistentVolumeClaims".
    - refit: the plan refitted from the job's SyncReports (None: no new refit; the last one stays).
    """

    spec: api.RLJobSpec | None = None
    plan: api.PlanStatus | None = None
    layout: JobLayout | None = None
    error: BaseException | None = None
    finished: bool = False
    suspended: bool = False
    decision: RestartDecision | None = None
    restart_wait_s: float | None = None
    pods: Sequence[PodObservation] = ()
    waiting: tuple[str, ...] = ()
    report: SyncReport | None = None
    rollout: api.RolloutStatus | None = None
    gang: tuple[bool, str, str] | None = None
    queue: api.QueueStatus | None = None
    placements: Mapping[str, Placement] | None = None  # pod name -> admitted flavors' placement
    preemption: tuple[PreemptionDecision, str] | None = None  # (decision, condition message)
    unbound_claims: tuple[str, ...] = ()  # claims that exist but are not bound: one sentence each
    refit: api.PlanRefit | None = None  # the plan refitted from the job's reports (status.plan.refit)
    job: JobRef | None = None  # the RLJob (its environments' Service URLs name it)


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


def _pods_summary(
    pods: Sequence[PodObservation], layout: JobLayout | None, spec: api.RLJobSpec | None = None
) -> tuple[int, int]:
    """(running, desired) pods of the current attempt; an environment server counts once it is ready
    (its readiness probe passed: the Service sends it episodes)."""
    desired = (layout.trainer_pods + layout.rollout_pods + layout.judge_pods) if layout else 0
    desired += sum(e.replicas for e in spec.environments) if spec is not None and layout else 0
    running = sum(
        1
        for p in pods
        if p.phase == "Running" and not p.deleting and (p.role != names.ROLE_ENVIRONMENT or p.ready)
    )
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
        mean_reward=_significant(report.mean_reward) if report.mean_reward is not None else None,
        loss=_significant(report.loss) if report.loss is not None else None,
        eval_reward=(
            _significant(report.eval_mean_reward)
            if report.eval_mean_reward is not None
            else (old.eval_reward if old else None)
        ),
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


def _trainer_notes(spec: api.RLJobSpec | None, report: SyncReport | None) -> list[tuple[str, bool, str, str]]:
    """Conditions from what the driver reported: trackers that could not start or failed (`Tracking`,
    a Warning Event on the transition), and prompts dropped for their length (`DataFiltered`)."""
    if report is None or spec is None:
        return []
    out: list[tuple[str, bool, str, str]] = []
    if spec.tracking.wandb is not None or spec.tracking.mlflow is not None:
        if report.tracker_errors:
            msg = "; ".join(report.tracker_errors) + " (the run goes on; fix spec.tracking or the server)"
            out.append((TRACKING, False, "TrackerFailed", msg))
        else:
            out.append((TRACKING, True, "TrackersLogging", "every configured tracker logs each step"))
    if report.dropped_prompts:
        out.append(
            (
                DATA_FILTERED,
                True,
                "PromptsDropped",
                f"{report.dropped_prompts} prompts are longer than spec.lengths.maxPromptTokens "
                f"({spec.lengths.max_prompt_tokens} tokens) and were dropped, never cut; raise "
                "maxPromptTokens to train on them",
            )
        )
    return out


def report_events(report: SyncReport) -> list[tuple[Literal["Normal", "Warning"], str, str]]:
    """The Events one SyncReport asks for (type, reason, message): a resume past corrupt or partial
    checkpoints (CheckpointFallback), a shared engine's wake with its measured cost, and whether its
    platform had to start it again because it has no sleep mode (SharedEngineWoken)."""
    out: list[tuple[Literal["Normal", "Warning"], str, str]] = []
    if report.checkpoint_fallback:
        out.append(("Warning", "CheckpointFallback", f"step {report.step}: {report.checkpoint_fallback}"))
    if report.shared_wake_s is not None:
        how = (
            f"started again: {report.engine_platform or 'its platform has no sleep mode'}"
            if report.shared_wake_restarted
            else "woken from vLLM's sleep mode"
        )
        out.append(
            (
                "Normal",
                "SharedEngineWoken",
                f"step {report.step}: a shared engine woke in {report.shared_wake_s:.1f} s ({how})",
            )
        )
    return out


def _pod_issue(
    pods: Sequence[PodObservation],
    unbound_claims: Sequence[str] = (),
    spec: api.RLJobSpec | None = None,
    now: datetime | None = None,
) -> tuple[str, str] | None:
    """The first pod-level cause that keeps the attempt from running: (reason, message naming the pod).
    An environment server also counts while it runs without being ready (`_environment_issue`); one
    still within its readiness grace is the cause only where nothing else is (EnvironmentsStarting:
    the job waits for its servers, which "PodsPending" would not say)."""
    starting: tuple[str, str] | None = None
    for p in sorted(pods, key=lambda p: (p.role != names.ROLE_TRAINER, p.role, p.index)):
        if p.role == names.ROLE_ENVIRONMENT and spec is not None and p.phase == "Running":
            issue = _environment_issue(p, spec, now)
            if issue is not None and issue[0] != ENVIRONMENTS_STARTING:
                return issue
            if issue is not None and starting is None:
                head = f"environment {p.environment}: " if p.environment else ""
                starting = (issue[0], f"{head}{issue[1]}, its readiness probe not passed yet")
            continue
        if p.deleting or p.phase != "Pending":
            continue
        if p.waiting_reason:
            return p.waiting_reason, f"pod {p.name}: {p.waiting_message}"
        if p.unschedulable and unbound_claims:
            return "ClaimNotBound", f"{'; '.join(unbound_claims)} (pod {p.name} waits for it)"
        if p.unschedulable:
            return "Unschedulable", f"pod {p.name}: {p.unschedulable}"
    return starting


ENVIRONMENTS_STARTING = "EnvironmentsStarting"


def _environment_issue(
    p: PodObservation, spec: api.RLJobSpec, now: datetime | None
) -> tuple[str, str] | None:
    """Why environment pod `p` is not serving (reason, message naming the pod, the kubelet's words and
    the fix), or None when it is ready. A pod still starting reads EnvironmentsStarting."""
    if p.deleting:
        return ENVIRONMENTS_STARTING, f"pod {p.name} is being replaced"
    index = next((i for i, e in enumerate(spec.environments) if e.name == p.environment), 0)
    env = spec.environments[index] if spec.environments else None
    if p.phase in ("Failed", "Succeeded"):
        reason, said = "EnvironmentPodEnded", p.message or p.phase
    elif p.waiting_reason:
        reason, said = p.waiting_reason, p.waiting_message
    elif p.unschedulable:
        reason, said = "Unschedulable", p.unschedulable
    elif p.ready:
        return None
    else:
        age_s = now.timestamp() - p.created if now is not None and p.created is not None else 0.0
        if p.phase != "Running" or (p.restarts == 0 and age_s < ENVIRONMENT_READINESS_GRACE_S):
            return ENVIRONMENTS_STARTING, f"pod {p.name} is starting"
        reason, said = "EnvironmentNotReady", f"running for {age_s:.0f}s without passing its readiness probe"
    fix = _ENVIRONMENT_FIXES.get(reason, "")
    if fix and env is not None:
        fix = fix.format(pod=p.name, i=index, path=env.readiness_path, port=env.port)
    head = f"environment {p.environment}: pod {p.name}: {said}"
    return reason, f"{head} ({fix})" if fix else head


def compute_environments(
    spec: api.RLJobSpec | None,
    pods: Sequence[PodObservation],
    job: JobRef | None,
    now: datetime | None = None,
) -> tuple[list[api.EnvironmentStatus] | None, tuple[bool, str, str] | None]:
    """Each environment's ready pods and URL (`status.environments`), and the EnvironmentsReady
    condition (status, reason, message): True once every server is ready; otherwise the first pod's
    trouble (CrashLoopBackOff, ImagePullBackOff, CreateContainerConfigError, Unschedulable,
    EnvironmentNotReady, EnvironmentPodEnded) naming the pod and the fix, or EnvironmentsStarting."""
    if spec is None or not spec.environments:
        return None, None
    out: list[api.EnvironmentStatus] = []
    trouble: tuple[str, str] | None = None
    starting: tuple[str, str] | None = None
    for env in spec.environments:
        mine = sorted((p for p in pods if p.environment == env.name), key=lambda p: p.index)
        ready = sum(1 for p in mine if p.ready and p.phase == "Running" and not p.deleting)
        first: tuple[str, str] | None = None
        for p in mine:
            issue = _environment_issue(p, spec, now)
            if issue is None:
                continue
            if issue[0] == ENVIRONMENTS_STARTING:
                starting = starting or issue
            elif trouble is None:
                trouble = issue
            first = first or issue
        if len(mine) < env.replicas and first is None:
            first = (
                ENVIRONMENTS_STARTING,
                f"{env.replicas - len(mine)} pod(s) of {env.name} not created yet",
            )
            starting = starting or first
        out.append(
            api.EnvironmentStatus(
                name=env.name,
                replicas=env.replicas,
                ready_replicas=ready,
                ready=f"{ready}/{env.replicas}",
                url=names.environment_url(job.name, job.namespace, env.name, env.port)
                if job is not None
                else None,
                message=first[1][:1024] if first is not None and ready < env.replicas else None,
            )
        )
    summary = ", ".join(f"{e.name} {e.ready}" for e in out)
    if trouble is not None:
        return out, (False, trouble[0], f"{trouble[1]} (ready: {summary})")
    if all(e.ready_replicas >= e.replicas for e in out):
        return out, (True, "EnvironmentsReady", f"ready: {summary}")
    why = starting[1] if starting is not None else "waiting for their pods"
    return out, (False, ENVIRONMENTS_STARTING, f"{why} (ready: {summary})")


def _checkpoint_note(spec: api.RLJobSpec | None) -> str:
    if spec is None:
        return ""
    claim = spec.checkpoint.volume.claim_name
    if claim is None:
        return (
            "checkpoints are not kept (spec.checkpoint.volume is an emptyDir), so the new attempt "
            "starts from step 0: set spec.checkpoint.volume.claimName to resume"
        )
    return f"the new attempt resumes from the last checkpoint in claim {claim!r}"


def compute_status(
    old: api.RLJobStatus,
    observed: Observed,
    *,
    generation: int,
    now: datetime,
) -> api.RLJobStatus:
    """The new status for what the reconcile `observed` (a fresh object; `old` is not modified)."""
    new = old.model_copy(deep=True)
    new.observed_generation = generation
    conds = list(new.conditions)
    if observed.finished:
        return new
    spec, plan, layout = observed.spec, observed.plan, observed.layout
    if plan is not None:  # the refit follows the reports; the plan (cached per generation) has none
        refit = observed.refit or (old.plan.refit if old.plan is not None else None)
        new.plan = plan.model_copy(update={"refit": refit})
    new.progress = _progress(spec, observed.report, new.progress)
    new.rollout = compute_rollout(
        observed.rollout or new.rollout, plan, layout, observed.pods, observed.report
    )
    new.restarts = new.restarts or 0
    decision = observed.decision
    if decision is not None:
        new.restarts, new.failures, new.disruptions = (
            decision.attempt,
            decision.failures,
            decision.disruptions,
        )
        if decision.fingerprint is not None or decision.reason == RESTART_AFTER_FAILURE:
            new.last_failure = (decision.fingerprint or decision.cause)[:1024]

    def put(type_: str, status: bool, reason: str, message: str, *, force: bool = False) -> None:
        nonlocal conds
        conds = _set(
            conds, _condition(type_, status, reason, message, generation, now), force_transition=force
        )

    # A job failed by a spec error goes on once a new generation plans.
    failed = find(conds, FAILED)
    if observed.error is None and failed is not None and failed.status == "True":
        put(FAILED, False, "SpecFixed", f"generation {generation} planned")
        new.completion_time = None

    if observed.error is not None:
        exc = observed.error
        reason, message = reason_for(exc), message_for(exc)
        if plan is not None and is_retryable(exc):  # planned, but the cluster is not ready for it
            put(PLANNED, True, "PlanComputed", _plan_message(plan))
        else:
            put(PLANNED, False, reason, message)
        put(READY, False, reason, message)
        if is_retryable(exc):
            new.phase = "Pending"
        else:
            new.phase = "Failed"
            new.completion_time = new.completion_time or now
            put(FAILED, True, reason, message)
        new.conditions = conds
        return new

    put(PLANNED, True, "PlanComputed", _plan_message(plan))
    for type_, status, reason, message in _trainer_notes(spec, observed.report):
        put(type_, status, reason, message)
    if observed.gang is not None:
        put(GANG_SCHEDULING, *observed.gang)
    suspended = observed.suspended
    put(
        SUSPENDED,
        suspended,
        "SuspendedBySpec" if suspended else "NotSuspended",
        "spec.suspend is true: pods deleted, the job is kept" if suspended else "",
    )
    running, desired = _pods_summary(observed.pods, layout, spec)
    environments, env_condition = compute_environments(spec, observed.pods, observed.job, now)
    new.environments = environments
    if env_condition is not None and not suspended:
        put(ENVIRONMENTS_READY, *env_condition)
    action = decision.action if decision is not None else "run"
    queue = observed.queue
    new.queue = queue
    preempting = _apply_preemption(new, observed.preemption, put)
    if queue is not None:
        put(
            ADMITTED,
            queue.admitted,
            "Admitted" if queue.admitted else "Queued",
            _queue_message(queue),
        )
    if suspended:
        new.phase = "Suspended"
        put(READY, False, "Suspended", "the job is suspended")
    elif action == "succeeded":
        new.phase = "Succeeded"
        new.completion_time = new.completion_time or now
        put(READY, False, "Finished", "the run succeeded")
        put(COMPLETE, True, "TrainingSucceeded", "trainer pod 0 exited 0")
        put(RESTARTING, False, "Finished", "")
    elif action == "fail" and decision is not None:
        message = _failure_message(decision, spec)
        new.phase = "Failed"
        new.completion_time = new.completion_time or now
        put(READY, False, decision.reason, message)
        put(FAILED, True, decision.reason, message)
        put(RESTARTING, False, "Finished", "")
    elif action == "restart" and decision is not None:
        new.phase = "Pending"
        message = _restart_message(decision, spec)
        put(READY, False, decision.reason, message)
        put(RESTARTING, True, decision.reason, message, force=True)
    elif preempting:
        new.phase = "Queued"
        put(READY, False, "Preempted", observed.preemption[1] if observed.preemption else "")
    elif queue is not None and not queue.admitted and not observed.pods:
        new.phase = "Queued"
        put(READY, False, "Queued", _queue_message(queue))
    elif observed.restart_wait_s is not None:
        restarting = find(conds, RESTARTING)
        new.phase = "Pending"
        # No seconds-left in the message: it would change, and be written, on every reconcile.
        put(READY, False, "BackoffAfterPodFailure", restarting.message if restarting else "")
    else:
        new.start_time = new.start_time or now
        all_running = desired > 0 and running >= desired and not observed.waiting
        new.phase = "Running" if all_running else "Pending"
        issue = None if all_running else _pod_issue(observed.pods, observed.unbound_claims, spec, now)
        if issue is not None:
            put(READY, False, issue[0], f"{issue[1]} ({running}/{desired} pods running)")
        else:
            put(
                READY,
                all_running,
                "AllPodsRunning" if all_running else "PodsPending",
                f"{running}/{desired} pods running",
            )
        if find(conds, RESTARTING) is not None and all_running:
            put(RESTARTING, False, "PodsRecreated", "")
        preempted = find(conds, PREEMPTED)
        resumed = all_running and new.checkpoint_request is None
        if preempted is not None and preempted.status == "True" and resumed:
            put(PREEMPTED, False, "Resumed", f"readmitted: attempt {new.restarts} runs")
    new.conditions = conds
    return new


_PREEMPTION_REASONS = {
    "request": "CheckpointRequested",
    "wait": "CheckpointRequested",
    "stop": "Stopping",
    "release": "Requeued",
    "done": "Requeued",
}


def _apply_preemption(
    new: api.RLJobStatus, preemption: tuple[PreemptionDecision, str] | None, put: Any
) -> bool:
    """Carry a preemption step into the status: the checkpoint request, one more disruption (never
    a failure) and a new attempt once the pods are gone. True when the job is leaving or out of
    its admission (phase Queued); False while the driver checkpoints (it still runs)."""
    if preemption is None or preemption[0].action == "none":
        return False
    decision, message = preemption
    put(PREEMPTED, True, _PREEMPTION_REASONS[decision.action], message)
    if decision.counts_disruption:
        new.checkpoint_request = None
        new.restarts = (new.restarts or 0) + 1  # the readmitted pods are a new attempt
        new.disruptions = (new.disruptions or 0) + 1
    else:
        new.checkpoint_request = decision.request
    return decision.action not in ("request", "wait")


def _queue_message(queue: api.QueueStatus) -> str:
    if queue.admitted:
        flavors = f" to flavors {', '.join(queue.flavors)}" if queue.flavors else ""
        return f"Workload {queue.workload} admitted by ClusterQueue {queue.cluster_queue}{flavors}"
    head = f"Workload {queue.workload} waits in LocalQueue {queue.name}; no pod runs until Kueue admits it"
    return f"{head}: {queue.message}" if queue.message else head


def _plan_message(plan: api.PlanStatus | None) -> str:
    if plan is None:
        return ""
    return (
        f"trainer {plan.trainer_accelerators} accelerators, {plan.rollout_engines} dedicated engines "
        f"(TP {plan.tensor_parallel}), {plan.shared_engines} shared"
    )


def _failure_message(decision: RestartDecision, spec: api.RLJobSpec | None) -> str:
    what = decision.cause or "a pod failed"
    if decision.reason == "RestartPolicyNever":
        return f"{what}; spec.restartPolicy.policy is Never: set it to OnFailure to restart"
    if decision.reason == "RepeatedFailure":
        return (
            f"{what}; the same cause ended the previous attempt too, so restarting will not help: "
            "fix it, then recreate the job"
        )
    limit = spec.restart_policy.backoff_limit if spec else "?"
    return (
        f"{what}; {decision.failures - 1} failures already reached "
        f"spec.restartPolicy.backoffLimit ({limit}): "
        "fix the cause, then raise backoffLimit or recreate the job"
    )


def _restart_message(decision: RestartDecision, spec: api.RLJobSpec | None) -> str:
    if decision.disruption:
        head = (
            f"{decision.cause}; restarting every pod at once (attempt {decision.attempt}); "
            "a disruption is not counted against backoffLimit"
        )
    else:
        head = (
            f"{decision.cause}; restart {decision.attempt} after {decision.delay_s:.0f}s of backoff "
            f"(failure {decision.failures})"
        )
    note = _checkpoint_note(spec)
    return f"{head}; {note}" if note else head


def find(conditions: Sequence[api.Condition], type_: str) -> api.Condition | None:
    return api.find_condition(conditions, type_)


def pending_restart(status: api.RLJobStatus) -> tuple[datetime, bool] | None:
    """A restart whose pods are not created yet: (when it began, whether it follows a disruption)."""
    cond = find(status.conditions, RESTARTING)
    if cond is None or cond.status != "True" or cond.last_transition_time is None:
        return None
    return cond.last_transition_time, cond.reason == RESTART_AFTER_DISRUPTION


def status_patch(old: Mapping[str, Any] | None, new: api.RLJobStatus) -> dict[str, Any] | None:
    """The merge patch for `.status`, or None when nothing changed (so nothing is written).

    Compares the canonical JSON of both (timestamps at whole seconds), so a reconcile that finds
    the world unchanged makes no API call. Keys that disappeared, also inside nested objects
    (`rollout.drainingPods` once the drain ends), are sent as null.
    """
    old_parsed = api.RLJobStatus.model_validate(old or {}).to_k8s()
    new_json = new.to_k8s()
    if old_parsed == new_json:
        return None
    return _merge_patch(old_parsed, new_json)


def _merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """`new` as a JSON merge patch over `old`: keys gone at any depth of nested objects are null
    (a merge patch merges objects key by key, so an absent key would keep its old value)."""
    patch: dict[str, Any] = dict(new)
    for key, before in old.items():
        if key not in new:
            patch[key] = None
        elif isinstance(before, Mapping) and isinstance(new[key], Mapping):
            patch[key] = _merge_patch(before, new[key])
    return patch


def transitions(old: Sequence[api.Condition], new: Sequence[api.Condition]) -> list[api.Condition]:
    """Conditions whose status or reason changed: the shell posts one Event for each."""
    before = {c.type: (c.status, c.reason) for c in old}
    return [c for c in new if before.get(c.type) != (c.status, c.reason)]


def event_type(cond: api.Condition) -> Literal["Normal", "Warning"]:
    """Warning for conditions that report trouble, Normal otherwise."""
    bad = (cond.type in (FAILED, RESTARTING) and cond.status == "True") or (
        cond.type in (PLANNED, READY, TRACKING, ENVIRONMENTS_READY)
        and cond.status == "False"
        and cond.reason
        not in ("PodsPending", "Suspended", "Finished", "SpecFixed", "Queued", ENVIRONMENTS_STARTING)
    )
    return "Warning" if bad else "Normal"


def should_post(last_posted_s: float | None, now_s: float, min_interval_s: float) -> bool:
    """Rate limit for Events: at most one per (job, reason) every `min_interval_s` seconds."""
    return last_posted_s is None or now_s - last_posted_s >= min_interval_s

"""Cooperative preemption: what the operator does when Kueue evicts or preempts a job's Workload.

Role: the functional core of the shell's `preemption` reconcile step (`queue_steps.step_preemption`).
Kueue's own integrations (jobframework's reconciler, "handle eviction") stop the job at once, and
once no pod is active they clear the reservation: `Requeued` (True after a preemption or node
failures), `QuotaReserved=False` (reason Pending, Kueue's eviction message), `admission` removed,
`Admitted=False` (NoReservation). We do the same, with one step before: the driver is asked to
checkpoint now (`status.checkpointRequest`, read by the driver at every sync point) and the pods
stay until it acknowledges the request in a SyncReport (`checkpointAck`, `checkpointAckStep`), or
until `spec.preemption.checkpointGraceSeconds` have passed. So a preempted job loses no step
beyond that checkpoint, and goes back to `Queued`; readmitted, it resumes from it.

`decide(...)` maps (the core Workload, the request in status, the acknowledgements, the job's
pods, now) to one action, in this order over successive reconciles:
  request -> wait ... -> stop -> release (or `done`, when the reservation is already gone)
`release_apply(...)` is the Workload status the shell server-side applies for `release`, as
Kueue's field manager `kueue-admission` writes it (`workload.PrepareWorkloadPatch`).
No clock, no API: `now` is an argument.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

from rljob_operator import api, names
from rljob_operator.decide import admission
from rljob_operator.decide.lifecycle import PodObservation

# Kueue's field manager for admission status (pkg/constants: AdmissionName), and the conditions
# it owns and writes together (pkg/workload: admissionManagedConditions).
ADMISSION_FIELD_MANAGER = "kueue-admission"
ADMISSION_MANAGED_CONDITIONS = (
    "QuotaReserved",
    "BlockedOnPreemptionGates",
    "Evicted",
    "Admitted",
    "Preempted",
    "Requeued",
    "DeactivationTarget",
    "Finished",
)
# Kueue sets Requeued=True only after these eviction reasons (the job may be admitted again).
REQUEUE_REASONS = ("Preempted", "NodeFailures")
# How often the shell looks for the acknowledgement while it waits (the telemetry ConfigMap is
# watched through an index, not as a reconcile trigger).
POLL_S = 1.0

Action = Literal["none", "request", "wait", "stop", "release", "done"]


@dataclasses.dataclass(frozen=True)
class Decision:
    """One reconcile's preemption action.

    - none: the Workload is not evicted (or nothing of the job runs and nothing is pending).
    - request: write `request` to status.checkpointRequest; come back at once.
    - wait: the request stands, no acknowledgement yet: come back in `wait_s`.
    - stop: delete every pod of the job (acknowledged at `ack_step`, or the grace ran out).
    - release: no pod is left: clear the Workload's reservation, then clear the request and count
      one disruption (not a failure); the job is Queued.
    - done: the reservation is gone already (Kueue, or a release whose status write was lost):
      clear the request and count the disruption.
    """

    action: Action
    request: api.CheckpointRequest | None = None
    reason: str = ""
    message: str = ""
    wait_s: float = 0.0
    ack_step: int | None = None

    @property
    def counts_disruption(self) -> bool:
        return self.action in ("release", "done")


def request_id(reason: str, attempt: int) -> str:
    """Unique per eviction of a job: the attempt changes with every release."""
    return f"{(reason or 'evicted').lower()}-{attempt}"


def acks_of(reports: Sequence[Any]) -> dict[str, int | None]:
    """Request id -> the step the driver saved for it, from the SyncReport history."""
    return {r.checkpoint_ack: r.checkpoint_ack_step for r in reports if getattr(r, "checkpoint_ack", None)}


def driver_running(pods: Sequence[PodObservation], attempt: int) -> bool:
    """Whether the driver (trainer pod 0 of the attempt) runs, so it can answer a request."""
    return any(
        p.role == names.ROLE_TRAINER
        and p.index == 0
        and p.attempt == attempt
        and p.phase == "Running"
        and not p.deleting
        for p in pods
    )


def _why(workload: admission.WorkloadState) -> tuple[str, str]:
    """Kueue's reason and message for taking the job's admission away."""
    cond = workload.evicted
    if cond is not None:
        return cond.reason or "Evicted", cond.message
    reserved = workload.conditions.get(admission.QUOTA_RESERVED)
    return "AdmissionRemoved", reserved.message if reserved is not None else "the quota reservation is gone"


def decide(
    workload: admission.WorkloadState | None,
    request: api.CheckpointRequest | None,
    acks: Mapping[str, int | None],
    pods: Sequence[PodObservation],
    *,
    attempt: int,
    grace_s: int,
    now: datetime,
) -> Decision:
    """The next step of a cooperative preemption of the job whose core Workload is `workload`.

    Triggers: Kueue evicted the Workload (Evicted=True, which a preemption also sets), or its quota
    reservation is gone while pods of the job still exist. A Workload not yet seen (None: an
    operator that just started) never stops anything."""
    if workload is None or workload.finished:
        return Decision("none")
    active = bool(pods)  # any pod of the job still exists (Kueue's job.IsActive)
    evicted = workload.evicted is not None
    if not evicted and workload.quota_reserved:
        if request is not None:  # readmitted before the release's status write landed
            return Decision("done", reason=request.reason, message="readmitted")
        return Decision("none")
    if not active:
        if request is None:
            return Decision("none")  # queued, nothing ran: the admission step reports it
        reason, message = _why(workload)
        action: Action = "release" if workload.quota_reserved else "done"
        return Decision(
            action, request=request, reason=reason, message=message, ack_step=acks.get(request.id)
        )
    reason, message = _why(workload)
    if request is None:
        new = api.CheckpointRequest(id=request_id(reason, attempt), reason=reason, request_time=now)
        return Decision("request", request=new, reason=reason, message=message)
    if request.id in acks:
        return Decision("stop", request=request, reason=reason, message=message, ack_step=acks[request.id])
    left = request.request_time.timestamp() + grace_s - now.timestamp()
    if left <= 0 or not driver_running(pods, attempt):
        return Decision("stop", request=request, reason=reason, message=message)
    return Decision("wait", request=request, reason=reason, message=message, wait_s=min(left, POLL_S))


def summary(decision: Decision, workload_name: str, grace_s: int) -> str:
    """The sentence a user reads in the RLJob's Preempted condition."""
    head = f"Kueue evicted Workload {workload_name} ({decision.reason}: {decision.message or 'no message'})"
    if decision.action in ("request", "wait"):
        return f"{head}; the driver was asked to checkpoint now (up to {grace_s}s)"
    if decision.ack_step is not None:
        tail = f"the driver checkpointed at step {decision.ack_step}"
    elif decision.request is not None:
        tail = f"no checkpoint acknowledgement (within {grace_s}s, or no driver running to give one)"
    else:
        tail = "its pods are gone"
    if decision.action == "stop":
        return f"{head}; {tail}; deleting the pods"
    if decision.ack_step is not None:
        return f"{head}; {tail}; pods deleted and the quota released: queued, it resumes from that step"
    return f"{head}; pods deleted and the quota released: queued, it resumes from its last checkpoint"


# ---- the Workload status Kueue's integrations write on release -----------------------------------
def _format(now: datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


def _set_condition(conditions: list[dict[str, Any]], cond: dict[str, Any]) -> None:
    """apimeta.SetStatusCondition: replace by type, keep lastTransitionTime when status is unchanged."""
    for i, old in enumerate(conditions):
        if old.get("type") == cond["type"]:
            if old.get("status") == cond["status"]:
                cond = {
                    **cond,
                    "lastTransitionTime": old.get("lastTransitionTime", cond["lastTransitionTime"]),
                }
            conditions[i] = cond
            return
    conditions.append(cond)


def release_apply(workload: Mapping[str, Any], *, now: datetime) -> dict[str, Any]:
    """The server-side apply body (field manager `kueue-admission`, forced) that clears `workload`'s
    quota reservation after an eviction, as jobframework does once the job is no longer active:
    SetRequeuedCondition + UnsetQuotaReservationWithCondition("Pending") + SyncAdmittedCondition,
    sent as PrepareWorkloadPatch sends it (the admission-managed conditions, no `admission`).

    `metadata.uid` and `resourceVersion` make the apply fail on a Workload that changed since it
    was read (the next reconcile reads it again)."""
    meta = workload.get("metadata") or {}
    st = workload.get("status") or {}
    generation = int(meta.get("generation") or 0)
    conditions = [dict(c) for c in st.get("conditions") or []]
    evicted = next((c for c in conditions if c.get("type") == "Evicted" and c.get("status") == "True"), None)
    reason = str((evicted or {}).get("reason") or "")
    message = str((evicted or {}).get("message") or "the job's admission was taken away")[:32768]
    stamp = _format(now)

    def cond(type_: str, status: bool, reason_: str, message_: str) -> dict[str, Any]:
        return {
            "type": type_,
            "status": "True" if status else "False",
            "reason": reason_ or type_,
            "message": message_,
            "lastTransitionTime": stamp,
            "observedGeneration": generation,
        }

    if evicted is not None:
        _set_condition(conditions, cond("Requeued", reason in REQUEUE_REASONS, reason, message))
    _set_condition(conditions, cond("QuotaReserved", False, "Pending", message))
    admitted = next((c for c in conditions if c.get("type") == "Admitted"), None)
    accumulated = st.get("accumulatedPastExecutionTimeSeconds")
    if admitted is not None and admitted.get("status") == "True":
        since = admitted.get("lastTransitionTime")
        if since:
            ran = int(now.timestamp() - datetime.fromisoformat(str(since).replace("Z", "+00:00")).timestamp())
            accumulated = (accumulated or 0) + max(ran, 0)
        _set_condition(
            conditions, cond("Admitted", False, "NoReservation", "The workload has no reservation")
        )
    status: dict[str, Any] = {
        "conditions": [c for c in conditions if c.get("type") in ADMISSION_MANAGED_CONDITIONS],
    }
    if accumulated is not None:
        status["accumulatedPastExecutionTimeSeconds"] = accumulated
    requeue = st.get("requeueState") or {}
    if requeue.get("count") is not None or requeue.get("requeueAt") is not None:
        status["requeueState"] = requeue
    if st.get("resourceRequests"):
        status["resourceRequests"] = st["resourceRequests"]
    evictions = (st.get("schedulingStats") or {}).get("evictions")
    if evictions:
        status["schedulingStats"] = {"evictions": evictions}
    for key in ("clusterName", "nominatedClusterNames", "unhealthyNodes", "preemptionGates"):
        if st.get(key):
            status[key] = st[key]
    return {
        "apiVersion": workload.get("apiVersion", f"{admission.KUEUE_GROUP}/{admission.KUEUE_VERSION}"),
        "kind": "Workload",
        "metadata": {
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "status": status,
    }

"""Unit tests for rljob_operator.decide.preemption: cooperative preemption, decided purely.

The sequence a Kueue eviction walks through (request, wait, stop, release), each edge of it
(acknowledged, grace expired, grace 0, the driver not running, a lost status write), that a
Workload not seen yet never stops a job, and the Workload status written on release being what
Kueue's jobframework writes (Requeued, QuotaReserved=False/Pending, no admission, Admitted=False)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from rljob_operator import api, builders, names
from rljob_operator.decide import admission, preemption
from rljob_operator.decide.lifecycle import PodObservation
from rljob_operator.reconcile import status
from rljob_trainer.outputs import telemetry

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
RESERVED = {"QuotaReserved": ("True", "QuotaReserved"), "Admitted": ("True", "Admitted")}
EVICTED = {
    **RESERVED,
    "Evicted": ("True", "Preempted"),
    "Preempted": ("True", "InClusterQueue"),
}


def workload_body(conditions: dict[str, tuple[str, str]], **status_extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {
            "name": "rljob-demo",
            "namespace": "team-a",
            "uid": "u1",
            "resourceVersion": "42",
            "generation": 2,
            "labels": {names.LABEL_JOB: "demo", names.LABEL_MANAGED_BY: names.MANAGED_BY},
        },
        "spec": {"queueName": "team-queue"},
        "status": {
            "conditions": [
                {
                    "type": t,
                    "status": s,
                    "reason": r,
                    "message": f"{t} says {r}",
                    "lastTransitionTime": "2026-01-01T11:50:00Z",
                }
                for t, (s, r) in conditions.items()
            ],
            **status_extra,
        },
    }


def wl(conditions: dict[str, tuple[str, str]]) -> admission.WorkloadState:
    out = admission.observe_workload(workload_body(conditions))
    assert out is not None
    return out


def pod(
    name: str, role: str, index: int, phase: str = "Running", attempt: int = 0, **kw: Any
) -> PodObservation:
    return PodObservation(name, role, index, phase, attempt, "h", **kw)


PODS = [pod("demo-trainer-0", "trainer", 0), pod("demo-trainer-1", "trainer", 1)]


def decide(
    workload: Any, request: Any = None, acks: Any = None, pods: Any = PODS, **kw: Any
) -> preemption.Decision:
    args: dict[str, Any] = {"attempt": 0, "grace_s": 60, "now": NOW, **kw}
    return preemption.decide(workload, request, acks or {}, pods, **args)


def test_nothing_to_do_while_admitted_or_unseen_or_finished() -> None:
    assert decide(wl(RESERVED)).action == "none"
    assert decide(None).action == "none"  # a Workload not seen yet (operator restart) stops nothing
    assert decide(wl({**EVICTED, "Finished": ("True", "Succeeded")})).action == "none"
    # Queued, nothing ran: the admission step's case.
    assert decide(wl({"QuotaReserved": ("False", "Pending")}), pods=[]).action == "none"


def test_an_eviction_requests_a_checkpoint_then_stops_on_the_ack_then_releases() -> None:
    first = decide(wl(EVICTED))
    assert first.action == "request" and first.request is not None
    assert first.request.id == "preempted-0" and first.request.reason == "Preempted"
    assert first.request.request_time == NOW
    request = first.request

    later = NOW + timedelta(seconds=5)
    waiting = decide(wl(EVICTED), request, now=later)
    assert waiting.action == "wait" and 0 < waiting.wait_s <= preemption.POLL_S

    acked = decide(wl(EVICTED), request, {"preempted-0": 7, "other": 3}, now=later)
    assert (acked.action, acked.ack_step) == ("stop", 7)
    assert "checkpointed at step 7" in preemption.summary(acked, "rljob-demo", 60)

    terminating = [pod(p.name, p.role, p.index, deleting=True) for p in PODS]
    assert decide(wl(EVICTED), request, {"preempted-0": 7}, terminating).action == "stop"
    released = decide(wl(EVICTED), request, {"preempted-0": 7}, pods=[])
    assert released.action == "release" and released.counts_disruption and released.ack_step == 7
    assert "checkpointed at step 7; pods deleted" in preemption.summary(released, "rljob-demo", 60)


def test_without_an_ack_the_pods_go_after_the_grace_or_at_once_when_nobody_can_answer() -> None:
    request = api.CheckpointRequest(id="preempted-0", reason="Preempted", request_time=NOW)
    expired = decide(wl(EVICTED), request, now=NOW + timedelta(seconds=60))
    assert expired.action == "stop" and expired.ack_step is None
    assert "no checkpoint acknowledgement (within 60s" in preemption.summary(expired, "rljob-demo", 60)
    assert decide(wl(EVICTED), request, grace_s=0).action == "stop"
    not_started = [pod("demo-trainer-0", "trainer", 0, phase="Pending")]
    assert decide(wl(EVICTED), request, pods=not_started).action == "stop"
    old_attempt = [pod("demo-trainer-0", "trainer", 0, attempt=1)]
    assert decide(wl(EVICTED), request, pods=old_attempt, attempt=2).action == "stop"


def test_a_lost_admission_without_eviction_is_a_preemption_too() -> None:
    gone = wl({"QuotaReserved": ("False", "Inadmissible"), "Admitted": ("False", "NoReservation")})
    first = decide(gone)
    assert first.action == "request" and first.reason == "AdmissionRemoved"
    assert first.request is not None
    # No reservation to release once the pods are gone: only the status changes.
    assert decide(gone, first.request, pods=[]).action == "done"


def test_a_release_whose_status_write_was_lost_is_counted_once_later() -> None:
    request = api.CheckpointRequest(id="preempted-0", reason="Preempted", request_time=NOW)
    requeued = wl({**EVICTED, "QuotaReserved": ("False", "Pending")})
    assert decide(requeued, request, pods=[]).action == "done"
    assert decide(wl(RESERVED), request, pods=[]).action == "done"  # readmitted meanwhile
    assert decide(requeued, None, pods=[]).action == "none"  # counted: nothing more


def test_request_ids_differ_per_attempt() -> None:
    assert preemption.request_id("Preempted", 0) != preemption.request_id("Preempted", 1)
    assert preemption.request_id("", 3) == "evicted-3"


def test_acks_come_from_the_sync_reports() -> None:
    base = {
        "step": 1, "time": 0.0, "intervalS": 1.0, "trainerWaitS": 0.0, "generationS": 0.0,
        "trainingS": 0.0, "inflightRequestSeconds": 0.0, "engineSeconds": 0.0, "snapshotInflight": 0,
        "sharedEnginesAwake": 0, "dedicatedEngines": 0, "meanReward": 0.0, "loss": 0.0,
        "tokensPerS": 0.0, "responseLenMean": 0.0,
    }  # fmt: skip
    reports = [
        telemetry.SyncReport.model_validate(base),
        telemetry.SyncReport.model_validate(
            {**base, "step": 2, "checkpointAck": "a", "checkpointAckStep": 2}
        ),
    ]
    assert preemption.acks_of(reports) == {"a": 2}


def test_release_apply_is_what_kueue_writes_when_the_job_stopped() -> None:
    body = workload_body(
        {**EVICTED, "PodsReady": ("True", "Started")},
        admission={"clusterQueue": "cq", "podSetAssignments": []},
        requeueState={"count": 1},
        schedulingStats={"evictions": [{"reason": "Preempted", "count": 1}]},
    )
    out = preemption.release_apply(body, now=NOW)
    assert out["metadata"] == {
        "name": "rljob-demo",
        "namespace": "team-a",
        "uid": "u1",
        "resourceVersion": "42",
    }
    st = out["status"]
    assert "admission" not in st  # applied by kueue-admission without it: the field goes
    conds = {c["type"]: c for c in st["conditions"]}
    assert "PodsReady" not in conds  # not an admission-managed condition
    assert (conds["QuotaReserved"]["status"], conds["QuotaReserved"]["reason"]) == ("False", "Pending")
    assert conds["QuotaReserved"]["message"] == "Evicted says Preempted"
    assert (conds["Admitted"]["status"], conds["Admitted"]["reason"]) == ("False", "NoReservation")
    assert (conds["Requeued"]["status"], conds["Requeued"]["reason"]) == ("True", "Preempted")
    assert conds["Evicted"]["status"] == "True"  # Kueue resets it when it admits the job again
    assert all(c["observedGeneration"] == 2 for t, c in conds.items() if t in ("QuotaReserved", "Requeued"))
    assert st["accumulatedPastExecutionTimeSeconds"] == 600  # admitted 11:50, released 12:00
    assert st["requeueState"] == {"count": 1}
    assert st["schedulingStats"] == {"evictions": [{"reason": "Preempted", "count": 1}]}


def test_release_after_an_eviction_for_another_reason_does_not_requeue() -> None:
    body = workload_body({**RESERVED, "Evicted": ("True", "InactiveWorkload")})
    conds = {c["type"]: c for c in preemption.release_apply(body, now=NOW)["status"]["conditions"]}
    assert conds["Requeued"]["status"] == "False"


def test_status_carries_the_request_then_one_disruption_and_a_new_attempt() -> None:
    spec = api.RLJobSpec.model_validate(
        {
            "model": {"name": "tiny", "source": {"tiny": {}}, "config": {"inline": {"model_type": "llama"}}},
            "data": {"source": {"builtin": {"name": "toy-arithmetic"}}},
            "resources": {
                "accelerator": {"kind": "cpu"},
                "totalAccelerators": 2,
                "acceleratorsPerNode": 1,
                "mode": "static",
                "static": {"trainerAccelerators": 2, "rolloutAccelerators": 0},
            },
        }
    )
    plan = api.PlanStatus(trainer_accelerators=2, rollout_engines=0, shared_engines=1, tensor_parallel=1)
    layout = builders.compute_layout(spec, plan)
    old = api.RLJobStatus(phase="Running", restarts=0, failures=0, disruptions=0)
    request = decide(wl(EVICTED))
    queue = api.QueueStatus(name="q", workload="rljob-demo", admitted=False)
    asked = status.compute_status(
        old,
        status.Observed(
            spec=spec, plan=plan, layout=layout, pods=PODS, queue=queue, preemption=(request, "asked")
        ),
        generation=1,
        now=NOW,
    )
    assert asked.checkpoint_request == request.request and asked.phase == "Running"
    assert status.find(asked.conditions, status.PREEMPTED).reason == "CheckpointRequested"  # type: ignore[union-attr]
    assert asked.to_k8s()["checkpointRequest"]["id"] == "preempted-0"

    released = preemption.Decision("release", reason="Preempted")
    out = status.compute_status(
        asked,
        status.Observed(spec=spec, plan=plan, layout=layout, queue=queue, preemption=(released, "requeued")),
        generation=1,
        now=NOW,
    )
    assert out.phase == "Queued" and out.checkpoint_request is None
    assert (out.restarts, out.disruptions, out.failures) == (1, 1, 0)  # a disruption, never a failure
    cond = status.find(out.conditions, status.PREEMPTED)
    assert cond is not None and (cond.status, cond.reason) == ("True", "Requeued")
    assert "checkpointRequest" in (status.status_patch(asked.to_k8s(), out) or {})  # sent as null


def test_the_readmitted_job_running_again_ends_the_preemption() -> None:
    spec = api.RLJobSpec.model_validate(
        {
            "model": {"name": "tiny", "source": {"tiny": {}}, "config": {"inline": {"model_type": "llama"}}},
            "data": {"source": {"builtin": {"name": "toy-arithmetic"}}},
            "resources": {
                "accelerator": {"kind": "cpu"},
                "totalAccelerators": 2,
                "acceleratorsPerNode": 1,
                "mode": "static",
                "static": {"trainerAccelerators": 2, "rolloutAccelerators": 0},
            },
        }
    )
    plan = api.PlanStatus(trainer_accelerators=2, rollout_engines=0, shared_engines=1, tensor_parallel=1)
    layout = builders.compute_layout(spec, plan)
    requeued = api.Condition(
        type=status.PREEMPTED, status="True", reason="Requeued", message="m", last_transition_time=NOW
    )
    old = api.RLJobStatus(phase="Queued", restarts=1, disruptions=1, conditions=[requeued])
    queue = api.QueueStatus(name="q", workload="rljob-demo", admitted=True)
    again = [pod("demo-trainer-0", "trainer", 0, attempt=1), pod("demo-trainer-1", "trainer", 1, attempt=1)]
    out = status.compute_status(
        old,
        status.Observed(spec=spec, plan=plan, layout=layout, pods=again, queue=queue),
        generation=1,
        now=NOW,
    )
    assert out.phase == "Running"
    cond = status.find(out.conditions, status.PREEMPTED)
    assert cond is not None and (cond.status, cond.reason) == ("False", "Resumed")
    assert out.disruptions == 1 and out.restarts == 1  # counted once, when the pods went

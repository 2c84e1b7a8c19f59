"""Unit tests for rljob_operator.decide.admission: Kueue's Workloads read and written, purely.

What the admission step relies on: a Workload's conditions read as Kueue means them (Admitted but
Evicted is not admitted; eviction and preemption stay readable), flavors turned into the pods'
nodeSelector and tolerations as Kueue's podset.Merge does (a contradicting key is an error naming
the pool field), extra engines admitted only as a contiguous prefix and released when evicted,
PodsReady following Kueue's jobframework reasons, and the RLJob's status showing Queued."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from typing import Any

import pytest
from test_builders import make_spec as builders_spec
from test_builders import static_plan
from test_builders_workload import JOB, job_pods, make_spec

from rljob_operator import api, builders, names
from rljob_operator.decide import admission, lifecycle
from rljob_operator.reconcile import status

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def workload_body(
    conditions: dict[str, tuple[str, str]] | None = None,
    *,
    assignments: list[dict[str, Any]] | None = None,
    engine: int | None = None,
    name: str = "rljob-demo",
) -> dict[str, Any]:
    labels = {names.LABEL_JOB: "demo", names.LABEL_MANAGED_BY: names.MANAGED_BY}
    if engine is not None:
        labels[names.LABEL_INDEX] = str(engine)
    body: dict[str, Any] = {
        "metadata": {"name": name, "namespace": "team-a", "uid": "u1", "generation": 1, "labels": labels},
        "spec": {"queueName": "team-queue", "priority": 100},
        "status": {
            "conditions": [
                {"type": t, "status": s, "reason": r, "message": f"{t} says {r}"}
                for t, (s, r) in (conditions or {}).items()
            ]
        },
    }
    if assignments is not None:
        body["status"]["admission"] = {"clusterQueue": "cq", "podSetAssignments": assignments}
    return body


def state(*args: Any, **kwargs: Any) -> admission.WorkloadState:
    out = admission.observe_workload(workload_body(*args, **kwargs))
    assert out is not None
    return out


ADMITTED = {"QuotaReserved": ("True", "QuotaReserved"), "Admitted": ("True", "Admitted")}


def test_observe_reads_admission_and_eviction() -> None:
    pending = state({"QuotaReserved": ("False", "Pending")})
    assert not pending.admitted and not pending.quota_reserved
    assert pending.pending_message == "QuotaReserved says Pending"
    admitted = state(ADMITTED, assignments=[{"name": "trainer", "flavors": {"cpu": "f1"}, "count": 2}])
    assert admitted.admitted and admitted.cluster_queue == "cq" and admitted.priority == 100
    assert admitted.assignments == (admission.PodSetAssignment("trainer", {"cpu": "f1"}, 2),)
    evicted = state({**ADMITTED, "Evicted": ("True", "Preempted"), "Preempted": ("True", "InClusterQueue")})
    assert not evicted.admitted  # Kueue keeps Admitted True until the job stops: evicted is not admitted
    assert evicted.evicted is not None and evicted.evicted.reason == "Preempted"
    assert evicted.preempted is not None and evicted.preempted.reason == "InClusterQueue"
    assert state(engine=3).engine == 3 and state().engine is None
    assert admission.observe_workload({"metadata": {"name": "other", "labels": {}}}) is None


def test_core_workload_hash_tells_a_changed_spec() -> None:
    trainers, rollouts = job_pods(make_spec(24, 16, 8))
    desired = admission.core_workload(JOB, trainers, rollouts, queue_name="q", priority=None)
    seen = admission.observe_workload({**desired, "status": {}})
    assert seen is not None and admission.is_current(seen, desired)
    bigger = admission.core_workload(JOB, *job_pods(make_spec(32, 24, 8)), queue_name="q", priority=None)
    assert not admission.is_current(seen, bigger)


def test_an_admitted_workload_that_no_longer_covers_the_pods_is_told_apart() -> None:
    """Kueue's jobframework stops a job whose Workload no longer matches it and replaces the
    Workload: the podSets' counts or requests changed. Anything else the pods carry does not."""
    trainers, rollouts = job_pods(make_spec(24, 16, 8))
    desired = admission.core_workload(JOB, trainers, rollouts, queue_name="q", priority=None)
    admitted = admission.observe_workload({**desired, "status": {}})
    assert admitted is not None and admitted.pod_sets == (("trainer", 2), ("rollout", 1))
    assert admission.pod_sets_mismatch(admitted, trainers, rollouts) == ""
    # an env change is not a podSet change (though the Workload spec differs)
    env = [
        {**p, "spec": {**p["spec"], "containers": [{**p["spec"]["containers"][0], "env": []}]}}
        for p in trainers
    ]
    same = admission.core_workload(JOB, env, rollouts, queue_name="q", priority=None)
    assert not admission.is_current(admitted, same)
    assert admission.pod_sets_mismatch(admitted, env, rollouts) == ""
    # more trainer pods, or a bigger rollout minimum
    why = admission.pod_sets_mismatch(admitted, *job_pods(make_spec(40, 24, 16)))
    assert "trainer×2, rollout×1" in why and "trainer×3, rollout×2" in why and "rebuilt" in why
    # same counts, other requests: the trainer pods ask for more memory
    container = trainers[0]["spec"]["containers"][0]
    resources = {
        **container["resources"],
        "requests": {**container["resources"]["requests"], "memory": "999Gi"},
    }
    bigger = [
        {**p, "spec": {**p["spec"], "containers": [{**container, "resources": resources}]}} for p in trainers
    ]
    assert "other requests or placement" in admission.pod_sets_mismatch(admitted, bigger, rollouts)
    # a Workload from an operator without the annotation: taken as matching
    old = dataclasses.replace(admitted, pod_sets_hash="")
    assert admission.pod_sets_mismatch(old, *job_pods(make_spec(40, 24, 16))) == ""


def test_engine_workload_is_one_pod_below_the_core_priority() -> None:
    _, rollouts = job_pods(make_spec(24, 16, 8))
    wl = admission.engine_workload(JOB, rollouts[0], 2, queue_name="q", core_priority=100)
    assert wl["metadata"]["name"] == "rljob-demo-rollout-2"
    assert wl["metadata"]["labels"][names.LABEL_INDEX] == "2"
    assert [(p["name"], p["count"]) for p in wl["spec"]["podSets"]] == [("rollout", 1)]
    assert wl["spec"]["priority"] == 99 and "priorityClassRef" not in wl["spec"]
    assert (
        admission.engine_workload(JOB, rollouts[0], 2, queue_name="q", core_priority=None)["spec"]["priority"]
        == -1
    )


FLAVORS = {
    "gpu-a": {"spec": {"nodeLabels": {"pool": "a"}, "tolerations": [{"key": "t", "operator": "Exists"}]}},
    "mem": {"spec": {"nodeLabels": {"zone": "z1"}, "tolerations": [{"key": "t", "operator": "Exists"}]}},
}


def test_placements_union_the_flavors_of_each_pod_set() -> None:
    wl = state(ADMITTED, assignments=[{"name": "trainer", "flavors": {"cpu": "gpu-a", "memory": "mem"}}])
    (placement,) = admission.placements(wl, FLAVORS).values()
    assert placement.node_labels == {"pool": "a", "zone": "z1"}
    assert placement.tolerations == ({"key": "t", "operator": "Exists"},)  # once, not per flavor
    with pytest.raises(admission.FlavorNotFoundError, match="ResourceFlavor 'gpu-a' is not found"):
        admission.placements(wl, {"mem": FLAVORS["mem"]})


def test_place_pod_merges_like_kueue_and_refuses_a_contradiction() -> None:
    trainers, rollouts = job_pods(make_spec(24, 16, 8))  # trainer pool: nodeSelector pool=h100
    placed = admission.place_pod(rollouts[0], admission.Placement({"pool": "a"}, ({"key": "t"},), ("gpu-a",)))
    assert placed["spec"]["nodeSelector"] == {"pool": "a"}
    assert placed["spec"]["tolerations"] == [{"key": "t"}]
    assert "nodeSelector" not in rollouts[0]["spec"]  # the input is not touched
    same = admission.place_pod(trainers[0], admission.Placement({"pool": "h100", "zone": "z"}, (), ("f",)))
    assert same["spec"]["nodeSelector"] == {"pool": "h100", "zone": "z"}
    assert len(same["spec"]["tolerations"]) == 1
    with pytest.raises(admission.FlavorConflictError) as err:
        admission.place_pod(trainers[0], admission.Placement({"pool": "a"}, (), ("gpu-a",)))
    assert err.value.field == "spec.trainerPool.nodeSelector[pool]" and "gpu-a" in err.value.message


def test_pod_set_pods_follow_the_workload_grouping() -> None:
    trainers, rollouts = job_pods(make_spec(24, 12, 8))  # trainer pods request 8 and 4: two podSets
    members = admission.pod_set_pods(trainers, rollouts)
    assert members == {
        "trainer": ["demo-trainer-0"],
        "trainer-1": ["demo-trainer-1"],
        "rollout": ["demo-rollout-0"],
    }
    wl = state(ADMITTED, assignments=[{"name": n, "flavors": {"nvidia.com/gpu": "gpu-a"}} for n in members])
    by_pod = admission.pod_placements(wl, members, FLAVORS)
    assert sorted(by_pod) == ["demo-rollout-0", "demo-trainer-0", "demo-trainer-1"]


def test_extra_engines_admitted_as_a_prefix_and_evicted_ones_fall_outside_it() -> None:
    admitted = state(ADMITTED, engine=1)
    pending = state({"QuotaReserved": ("False", "Pending")}, engine=2)
    evicted = state({**ADMITTED, "Evicted": ("True", "Preempted")}, engine=1, name="rljob-demo-rollout-1")
    # one core engine, target 3: engine 1 admitted, engine 2 waits
    assert admission.admitted_engines(1, 3, {1: admitted, 2: pending}) == 2
    assert admission.admitted_engines(1, 3, {2: state(ADMITTED, engine=2)}) == 1  # no gap: 1 is missing
    assert admission.evicted_engines({1: admitted, 2: pending}, running=[0, 1]) == {}
    # Kueue evicts engine 1: the effective target drops below it, and below engine 2 (indices stay
    # contiguous), so both pods drain; only engine 1 is named as evicted (its drain grace is bounded)
    extra = {1: evicted, 2: state(ADMITTED, engine=2)}
    assert admission.admitted_engines(1, 3, extra) == 1
    (why,) = admission.evicted_engines(extra, running=[0, 1, 2]).items()
    assert why[0] == 1 and "rljob-demo-rollout-1" in why[1] and "Preempted" in why[1]
    assert admission.evicted_engines(extra, running=[0]) == {}  # its pod gone: nothing to drain
    # evicted Workload with its pod gone is deleted (its quota back); beyond the target too
    extra = {1: evicted, 2: state(ADMITTED, engine=2, name="rljob-demo-rollout-2")}
    assert admission.stale_engine_workloads(1, 2, extra, running=[0]) == [
        "rljob-demo-rollout-1",
        "rljob-demo-rollout-2",
    ]
    assert admission.stale_engine_workloads(1, 3, extra, running=[0, 1]) == []


@pytest.mark.parametrize(
    ("conditions", "ready", "expected"),
    [
        ({"QuotaReserved": ("False", "Pending")}, False, ("False", "WaitForStart")),
        (ADMITTED, False, ("False", "WaitForStart")),
        (ADMITTED, True, ("True", "Started")),
        ({**ADMITTED, "PodsReady": ("True", "Started")}, True, None),  # already said: no write
        ({**ADMITTED, "PodsReady": ("True", "Started")}, False, ("False", "WaitForRecovery")),
        ({**ADMITTED, "PodsReady": ("False", "WaitForRecovery")}, True, ("True", "Recovered")),
        ({**ADMITTED, "PodsReady": ("False", "WaitForStart")}, False, None),
    ],
)
def test_pods_ready_follows_kueue_jobframework(
    conditions: dict[str, tuple[str, str]], ready: bool, expected: tuple[str, str] | None
) -> None:
    cond = admission.pods_ready_condition(state(conditions), ready, now=NOW)
    assert (None if cond is None else (cond["status"], cond["reason"])) == expected


def test_condition_apply_owns_only_the_condition_of_this_workload() -> None:
    wl = state(ADMITTED)
    cond = admission.finished_condition(wl, "Succeeded", now=NOW)
    body = admission.condition_apply(wl, cond)
    assert body["metadata"] == {"name": "rljob-demo", "namespace": "team-a", "uid": "u1"}
    assert (
        body["status"] == {"conditions": [cond]} and cond["type"] == "Finished" and cond["status"] == "True"
    )
    assert body["apiVersion"] == "kueue.x-k8s.io/v1beta2" and body["kind"] == "Workload"


def test_status_is_queued_without_pods_and_admitted_after() -> None:
    spec = builders_spec()
    plan = static_plan(spec)
    layout = builders.compute_layout(spec, plan)
    queued = admission.queue_status(
        state({"QuotaReserved": ("False", "Pending")}), "team-queue", "rljob-demo"
    )
    new = status.compute_status(
        api.RLJobStatus(),
        status.Observed(spec=spec, plan=plan, layout=layout, queue=queued),
        generation=1,
        now=NOW,
    )
    assert new.phase == "Queued" and new.queue is not None and new.queue.name == "team-queue"
    adm = status.find(new.conditions, status.ADMITTED)
    assert adm is not None and adm.status == "False" and adm.reason == "Queued"
    assert "QuotaReserved says Pending" in adm.message and "no pod runs" in adm.message
    ready = status.find(new.conditions, status.READY)
    assert ready is not None and ready.reason == "Queued" and status.event_type(ready) == "Normal"

    wl = state(ADMITTED, assignments=[{"name": "trainer", "flavors": {"nvidia.com/gpu": "gpu-a"}}])
    running = [
        lifecycle.PodObservation(
            name=f"demo-trainer-{i}", role="trainer", index=i, phase="Running", attempt=0, template_hash="h"
        )
        for i in range(layout.trainer_pods)
    ]
    later = status.compute_status(
        new,
        status.Observed(
            spec=spec,
            plan=plan,
            layout=layout,
            pods=running,
            queue=admission.queue_status(wl, "team-queue", "rljob-demo"),
        ),
        generation=1,
        now=NOW,
    )
    assert later.phase != "Queued"
    adm = status.find(later.conditions, status.ADMITTED)
    assert adm is not None and adm.status == "True" and "gpu-a" in adm.message
    assert later.queue is not None and later.queue.admitted and later.queue.flavors == ["gpu-a"]
    # a job without the label has no queue status and no Admitted condition
    plain = status.compute_status(
        api.RLJobStatus(), status.Observed(spec=spec, plan=plan, layout=layout), generation=1, now=NOW
    )
    assert plain.queue is None and status.find(plain.conditions, status.ADMITTED) is None


def test_admitted_pod_sets_pair_each_workload_with_its_pods() -> None:
    core = state(ADMITTED)
    engine = state(ADMITTED, engine=1, name="rljob-demo-rollout-1")
    pairs = admission.admitted_pod_sets(
        "demo", core, {"trainer": ["demo-trainer-0"]}, {1: engine}, range(1, 2)
    )
    assert pairs == [(core, {"trainer": ["demo-trainer-0"]}), (engine, {"rollout": ["demo-rollout-1"]})]
    assert admission.admitted_pod_sets("demo", core, {}, {1: engine}, range(1, 1)) == [(core, {})]

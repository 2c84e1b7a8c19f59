"""Unit tests for rljob_operator.decide.lifecycle: observations, outcomes, the pod diff, backoff, capacity."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_builders import JOB, make_spec, static_plan

from rljob_operator import api, builders, errors, names
from rljob_operator.decide import lifecycle


def obs(
    name: str, phase: str = "Running", attempt: int = 0, h: str = "", deleting: bool = False
) -> lifecycle.PodObservation:
    role, index = names.parse_pod_name("demo", name) or ("trainer", 0)
    return lifecycle.PodObservation(name, role, index, phase, attempt, h, deleting=deleting)


def desired(attempt: int = 0, dedicated: int | None = None) -> list[dict[str, Any]]:
    spec = make_spec()
    layout = builders.compute_layout(spec, static_plan(spec), dedicated)
    return builders.build_pods(JOB, spec, layout, attempt=attempt)


def observed_from(pods: list[dict[str, Any]], phase: str = "Running") -> list[lifecycle.PodObservation]:
    out = []
    for p in pods:
        o = lifecycle.observe_pod({**p, "status": {"phase": phase}})
        assert o is not None
        out.append(o)
    return out


def test_pods_of_an_earlier_job_of_the_same_name_are_told_apart_by_their_owner_uid() -> None:
    """Only pods whose controller ownerReference is this RLJob's uid are its own; an earlier RLJob's
    (same name, deleted, not yet collected) and orphans (--cascade=orphan) are leftovers."""

    def owned(pod: dict[str, Any], uid: str | None) -> lifecycle.PodObservation:
        refs = [] if uid is None else [{"kind": "RLJob", "name": "demo", "uid": uid, "controller": True}]
        other = [{"kind": "Other", "name": "x", "uid": "not-a-controller"}]
        o = lifecycle.observe_pod({**pod, "metadata": {**pod["metadata"], "ownerReferences": other + refs}})
        assert o is not None
        return o

    a, b, c = desired()[:3]
    pods = [owned(a, "new"), owned(b, "old"), owned(c, None)]
    assert [p.owner_uid for p in pods] == ["new", "old", None]
    assert [p.name for p in lifecycle.left_by_earlier_job(pods, "new")] == [
        b["metadata"]["name"],
        c["metadata"]["name"],
    ]
    assert lifecycle.left_by_earlier_job(pods[:1], "new") == []


def test_observe_pod_reads_labels_annotations_and_exit_code() -> None:
    pod = desired()[0]
    pod = {
        **pod,
        "metadata": {**pod["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {**pod["spec"], "nodeName": "n1"},
        "status": {
            "phase": "Failed",
            "containerStatuses": [{"state": {"terminated": {"exitCode": 3, "reason": "Error"}}}],
        },
    }
    o = lifecycle.observe_pod(pod)
    assert o is not None
    assert (o.name, o.role, o.index, o.phase, o.attempt) == ("demo-trainer-0", "trainer", 0, "Failed", 0)
    assert o.exit_code == 3 and o.message == "Error" and o.deleting and o.node_name == "n1"
    assert lifecycle.observe_pod({"metadata": {"labels": {"app": "x"}}}) is None


def test_observe_node() -> None:
    node = {
        "metadata": {"name": "n", "labels": {"a": "b"}},
        "spec": {"taints": [{"key": "k", "value": "v", "effect": "NoSchedule"}]},
        "status": {
            "allocatable": {"nvidia.com/gpu": "8"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    n = lifecycle.observe_node(node)
    assert (
        n.schedulable and n.taints == (("k", "v", "NoSchedule"),) and n.allocatable["nvidia.com/gpu"] == "8"
    )
    assert not lifecycle.observe_node({**node, "spec": {"unschedulable": True}}).schedulable


RP = api.RestartPolicySpec(backoff_limit=3, initial_backoff_seconds=10, max_backoff_seconds=35)


def decide(pods: list[lifecycle.PodObservation], **kw: object) -> lifecycle.RestartDecision:
    args: dict[str, object] = {
        "attempt": 0, "failures": 0, "disruptions": 0, "last_failure": None, "policy": RP,
        "node_names": frozenset({"n1"}), **kw,
    }  # fmt: skip
    return lifecycle.decide_restart(pods, **args)  # type: ignore[arg-type]


def test_decide_restart_success_failure_and_older_attempts() -> None:
    assert decide([obs("demo-trainer-0", "Succeeded")]).action == "succeeded"
    assert decide([obs("demo-trainer-1", "Succeeded")]).action == "run"
    failed = decide([obs("demo-rollout-1", "Failed"), obs("demo-trainer-1", "Failed")])
    assert failed.action == "restart" and failed.pod is not None and failed.pod.name == "demo-trainer-1"
    assert (failed.attempt, failed.failures, failed.disruptions, failed.delay_s) == (1, 1, 0, 10.0)
    assert decide([obs("demo-trainer-0", "Failed", attempt=0)], attempt=1).action == "run"
    limit = decide([obs("demo-trainer-0", "Failed")], failures=3)
    assert limit.action == "fail" and limit.reason == "BackoffLimitExceeded"


def test_the_same_termination_message_twice_ends_the_job() -> None:
    bad = dataclasses.replace(
        obs("demo-trainer-0", "Failed"), termination_message="dataset not found", message="dataset not found"
    )
    first = decide([bad])
    assert first.action == "restart" and first.fingerprint == "dataset not found"
    again = decide(
        [dataclasses.replace(bad, attempt=1)], attempt=1, failures=1, last_failure="dataset not found"
    )
    assert again.action == "fail" and again.reason == "RepeatedFailure" and "dataset not found" in again.cause
    # Without a termination message a failure is not known to be deterministic.
    plain = decide([obs("demo-trainer-0", "Failed", attempt=1)], attempt=1, failures=1, last_failure="Error")
    assert plain.action == "restart"


def test_disruptions_restart_the_gang_without_counting() -> None:
    evicted = dataclasses.replace(obs("demo-trainer-1", "Running"), disruption="EvictionByEvictionAPI")
    d = decide([obs("demo-trainer-0", "Running"), evicted], failures=2)
    assert d.action == "restart" and d.disruption and (d.attempt, d.failures, d.disruptions) == (1, 2, 1)
    assert d.delay_s == 0.0
    # a pod on a deleted node is lost even before the pod GC deletes it
    gone = dataclasses.replace(obs("demo-trainer-1", "Running"), node_name="n2")
    assert decide([obs("demo-trainer-0", "Running"), gone]).disruption
    # a pod the shell saw vanish (evicted and deleted at once, or a trainer lost from its Ray
    # cluster): never recreated alone
    lost = decide(
        [obs("demo-trainer-0", "Running")],
        vanished={"demo-trainer-1": "pod demo-trainer-1 was disrupted (EvictionByEvictionAPI)"},
    )
    assert lost.action == "restart" and lost.disruption and "EvictionByEvictionAPI" in lost.cause
    # ... but a gang being created (nothing vanished) is not a loss
    assert decide([obs("demo-trainer-0", "Running")]).action == "run"
    # a disruption outranks the failures it causes (the Ray workers die with their head)
    both = decide(
        [
            dataclasses.replace(obs("demo-trainer-0", "Failed"), disruption="Evicted"),
            obs("demo-trainer-1", "Failed"),
        ]
    )
    assert both.disruption and both.failures == 0


def test_observe_pod_reads_pod_level_causes() -> None:
    base = {
        "metadata": {
            "name": "demo-trainer-0",
            "labels": {names.LABEL_JOB: "demo", names.LABEL_ROLE: "trainer"},
        }
    }
    pending = {
        **base,
        "status": {
            "phase": "Pending",
            "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"}
            ],
            "containerStatuses": [
                {
                    "name": "trainer",
                    "state": {
                        "waiting": {
                            "reason": "CreateContainerConfigError",
                            "message": 'secret "hf" not found',
                        }
                    },
                }
            ],
        },
    }
    o = lifecycle.observe_pod(pending)
    assert o is not None and o.unschedulable == "0/3 nodes"
    assert o.waiting_reason == "CreateContainerConfigError" and 'secret "hf"' in o.waiting_message
    evicted = {
        **base,
        "status": {
            "phase": "Running",
            "conditions": [
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "EvictionByEvictionAPI",
                    "message": "Eviction API: evicting",
                }
            ],
        },
    }
    e = lifecycle.observe_pod(evicted)
    assert e is not None and e.disruption.startswith("EvictionByEvictionAPI")
    done = {
        **base,
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {
                    "name": "trainer",
                    "state": {
                        "terminated": {"exitCode": 1, "reason": "Error", "message": "dataset not found\n"}
                    },
                }
            ],
        },
    }
    d = lifecycle.observe_pod(done)
    assert d is not None and d.termination_message == "dataset not found" and d.message == "dataset not found"


def test_check_claims_names_the_claim_and_the_fix() -> None:
    uses = [lifecycle.ClaimUse("spec.checkpoint.volume.claimName", "ckpt", 2, False)]
    with pytest.raises(errors.ClaimNotFoundError, match=r"'ckpt' .*not found"):
        lifecycle.check_claims(uses, {"ckpt": None}, "ns")
    rwo = {"spec": {"accessModes": ["ReadWriteOnce"]}}
    with pytest.raises(errors.ClaimAccessModeError, match="ReadWriteMany"):
        lifecycle.check_claims(uses, {"ckpt": rwo}, "ns")
    lifecycle.check_claims(uses, {"ckpt": {"spec": {"accessModes": ["ReadWriteMany"]}}}, "ns")
    one = [dataclasses.replace(uses[0], pods=1)]
    lifecycle.check_claims(one, {"ckpt": rwo}, "ns")  # one pod: any mode mounts
    model = [lifecycle.ClaimUse("spec.model.source.pvc.claimName", "m", 3, True)]
    lifecycle.check_claims(model, {"m": {"spec": {"accessModes": ["ReadOnlyMany"]}}}, "ns")


def test_unbound_claims_name_the_claim_its_storage_class_and_the_fix() -> None:
    uses = [
        lifecycle.ClaimUse("spec.model.source.pvc.claimName", "models", 5, True),
        lifecycle.ClaimUse("spec.checkpoint.volume.claimName", "ckpt", 1, False),
    ]
    pending = {"spec": {"storageClassName": "shared-rwx"}, "status": {"phase": "Pending"}}
    bound = {"spec": {}, "status": {"phase": "Bound"}}
    (sentence,) = lifecycle.unbound_claims(uses, {"models": pending, "ckpt": bound})
    assert "PersistentVolumeClaim 'models' (spec.model.source.pvc.claimName) is Pending" in sentence
    assert "storage class 'shared-rwx'" in sentence and "kubectl describe pvc models" in sentence
    assert lifecycle.unbound_claims(uses, {"models": bound, "ckpt": None}) == ()  # missing: check_claims
    no_class = lifecycle.unbound_claims(uses[1:], {"ckpt": {"spec": {}, "status": {"phase": "Pending"}}})
    assert "no storage class" in no_class[0]


def test_diff_creates_missing_in_index_order() -> None:
    want = desired()
    d = lifecycle.diff_pods(want, [], 0)
    assert [p["metadata"]["name"] for p in d.create] == [
        "demo-trainer-0",
        "demo-trainer-1",
        "demo-rollout-0",
        "demo-rollout-1",
    ]
    assert d.delete == () and d.waiting == ()
    assert lifecycle.diff_pods(want, observed_from(want), 0) == lifecycle.PodDiff()


def test_diff_stale_attempt_waits_for_termination() -> None:
    old = observed_from(desired(attempt=0))
    d = lifecycle.diff_pods(desired(attempt=1), old, 1)
    assert set(d.delete) == {p.name for p in old} and d.create == ()
    assert set(d.waiting) == {p.name for p in old}
    terminating = [lifecycle.PodObservation(**{**p.__dict__, "deleting": True}) for p in old]
    d2 = lifecycle.diff_pods(desired(attempt=1), terminating, 1)
    assert d2.delete == () and len(d2.waiting) == 4


def test_diff_scale_down_and_up_of_rollout_pods() -> None:
    current = observed_from(desired())
    down = lifecycle.diff_pods(desired(dedicated=1), current, 0)
    assert down.delete == ("demo-rollout-1",) and down.create == ()
    up = lifecycle.diff_pods(desired(dedicated=3), current, 0)
    assert [p["metadata"]["name"] for p in up.create] == ["demo-rollout-2"] and up.delete == ()


def test_diff_template_change_replaces_the_trainer_gang() -> None:
    want = desired()
    current = observed_from(want)
    outdated = lifecycle.PodObservation(**{**current[1].__dict__, "template_hash": "old"})
    stale = [outdated, current[0], *current[2:]]
    d = lifecycle.diff_pods(want, stale, 0)
    assert set(d.delete) == {"demo-trainer-0", "demo-trainer-1"}


def test_pods_to_stop() -> None:
    pods = [obs("demo-trainer-0", "Succeeded"), obs("demo-rollout-0"), obs("demo-rollout-1", deleting=True)]
    assert lifecycle.pods_to_stop(pods, keep_finished=True) == ("demo-rollout-0",)
    assert lifecycle.pods_to_stop(pods, keep_finished=False) == ("demo-rollout-0", "demo-trainer-0")


def node(
    name: str, gpus: int, labels: dict[str, str] | None = None, taints: tuple[Any, ...] = ()
) -> lifecycle.NodeObservation:
    return lifecycle.NodeObservation(name, labels or {}, taints, {"nvidia.com/gpu": str(gpus)}, True)


def test_capacity_fits_and_fails_with_a_message_naming_the_fix() -> None:
    spec = make_spec()
    layout = builders.compute_layout(spec, static_plan(spec))
    lifecycle.check_capacity(spec, layout, [node("a", 8), node("b", 8), node("c", 8)])
    with pytest.raises(errors.InsufficientCapacityError) as info:
        lifecycle.check_capacity(spec, layout, [node("a", 8), node("b", 8)])
    assert info.value.field == "spec.rolloutPool" and "add nodes" in info.value.message
    with pytest.raises(errors.InsufficientCapacityError, match="trainerPool"):
        lifecycle.check_capacity(spec, layout, [node("a", 4)] * 6)


def test_capacity_respects_selectors_and_taints() -> None:
    spec = make_spec(
        trainerPool={"nodeSelector": {"pool": "t"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]},
    )
    layout = builders.compute_layout(spec, static_plan(spec), 0)
    tainted = (("gpu", "yes", "NoSchedule"),)
    lifecycle.check_capacity(
        spec, layout, [node("a", 8, {"pool": "t"}, tainted), node("b", 8, {"pool": "t"})]
    )
    with pytest.raises(errors.InsufficientCapacityError):
        lifecycle.check_capacity(spec, layout, [node("a", 8, {"pool": "t"}), node("b", 8, {"pool": "x"})])
    untolerated = (("other", None, "NoExecute"),)
    with pytest.raises(errors.InsufficientCapacityError):
        lifecycle.check_capacity(
            spec, layout, [node("a", 8, {"pool": "t"}), node("b", 8, {"pool": "t"}, untolerated)]
        )
    soft = (("other", None, "PreferNoSchedule"),)
    lifecycle.check_capacity(spec, layout, [node("a", 8, {"pool": "t"}), node("b", 8, {"pool": "t"}, soft)])


def test_capacity_cpu_jobs_need_any_matching_node() -> None:
    spec = make_spec(**{"resources.accelerator": {"kind": "cpu"}})
    layout = builders.compute_layout(spec, static_plan(spec))
    lifecycle.check_capacity(spec, layout, [lifecycle.NodeObservation("c", {}, (), {}, True)])
    with pytest.raises(errors.InsufficientCapacityError, match="schedulable"):
        lifecycle.check_capacity(spec, layout, [])


@settings(max_examples=60, deadline=None)
@given(
    present=st.lists(
        st.sampled_from(
            ["demo-trainer-0", "demo-trainer-1", "demo-rollout-0", "demo-rollout-1", "demo-rollout-5"]
        ),
        unique=True,
    ),
    attempt=st.integers(0, 2),
    dedicated=st.integers(0, 3),
)
def test_diff_never_creates_a_name_that_exists(present: list[str], attempt: int, dedicated: int) -> None:
    pods = [obs(n, attempt=attempt % 2) for n in present]
    want = desired(attempt=attempt, dedicated=dedicated)
    d = lifecycle.diff_pods(want, pods, attempt)
    created = {p["metadata"]["name"] for p in d.create}
    assert not created & set(present)
    assert created | set(d.waiting) | {p.name for p in pods if p.name not in d.delete} >= {
        p["metadata"]["name"] for p in want
    }


def test_rollout_pods_never_decide_the_attempt() -> None:
    """A dedicated engine's pod that fails or is taken away is replaced alone (elastic): the
    gang keeps running and restarts/failures/disruptions stay as they are."""
    trainers = [obs("demo-trainer-0"), obs("demo-trainer-1")]
    failed = decide([*trainers, obs("demo-rollout-0", "Failed")], failures=1)
    assert (failed.action, failed.attempt, failed.failures, failed.disruptions) == ("run", 0, 1, 0)
    evicted = dataclasses.replace(obs("demo-rollout-1"), disruption="EvictionByEvictionAPI")
    assert decide([*trainers, evicted]).action == "run"
    gone = dataclasses.replace(obs("demo-rollout-1"), node_name="n2")  # its node was deleted
    assert decide([*trainers, gone]).action == "run"
    # a trainer pod failure still restarts the gang, counted
    both = decide([obs("demo-trainer-0"), obs("demo-trainer-1", "Failed"), obs("demo-rollout-0", "Failed")])
    assert both.action == "restart" and both.failures == 1 and both.pod is not None
    assert both.pod.name == "demo-trainer-1"


def test_diff_keeps_draining_pods_and_replaces_lost_ones() -> None:
    current = observed_from(desired())
    kept = lifecycle.diff_pods(desired(dedicated=1), current, 0, keep=["demo-rollout-1"])
    assert kept == lifecycle.PodDiff()
    lost = lifecycle.diff_pods(desired(), current, 0, replace=["demo-rollout-0"])
    assert lost.delete == ("demo-rollout-0",) and lost.create == () and lost.waiting == ("demo-rollout-0",)
    # the trainers are untouched by a rollout pod's replacement
    assert not any("trainer" in n for n in lost.delete)


def test_observe_pod_reads_the_creation_time() -> None:
    pod = desired()[0]
    pod = {**pod, "metadata": {**pod["metadata"], "creationTimestamp": "2026-01-01T00:00:10Z"}}
    o = lifecycle.observe_pod(pod)
    assert o is not None and o.created == 1767225610.0


def test_a_restart_backoff_counts_from_the_end_of_the_recorded_second() -> None:
    """The failure is recorded at whole second S (it happened within [S, S+1)): a 10 s backoff
    ends at S+11 at the latest, never before S+1+10, so it is never shorter than the spec says."""
    since = datetime(2026, 12, 1, 10, 0, 0, tzinfo=timezone.utc)

    def at(s: float) -> datetime:
        return since + timedelta(seconds=s)

    assert lifecycle.restart_wait_s(since, False, 1, RP, at(0)) == 11.0
    assert lifecycle.restart_wait_s(since, False, 1, RP, at(10)) == 1.0
    assert lifecycle.restart_wait_s(since, False, 1, RP, at(11)) == 0.0
    assert lifecycle.restart_wait_s(since, True, 1, RP, at(0)) == 0.0  # a disruption: at once

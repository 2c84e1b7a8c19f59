"""Unit tests for rljob_operator.decide.elastic: two-phase scale-down and lone replacement of rollout pods."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, timezone
from typing import Any

from rljob_operator import api, names
from rljob_operator.decide import elastic, lifecycle
from rljob_trainer.outputs.telemetry import SyncReport

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


def pod(index: int, phase: str = "Running", **kw: Any) -> lifecycle.PodObservation:
    name = names.pod_name("demo", names.ROLE_ROLLOUT, index)
    return lifecycle.PodObservation(name, names.ROLE_ROLLOUT, index, phase, 0, "h", **kw)


def trainer(index: int) -> lifecycle.PodObservation:
    return lifecycle.PodObservation(f"demo-trainer-{index}", names.ROLE_TRAINER, index, "Running", 0, "h")


def report(
    at: datetime, step: int = 1, released: tuple[int, ...] = (), lost: tuple[int, ...] = ()
) -> SyncReport:
    zero = {"intervalS": 1, "trainerWaitS": 0, "generationS": 0, "trainingS": 0, "inflightRequestSeconds": 0,
            "engineSeconds": 0, "snapshotInflight": 0, "sharedEnginesAwake": 0, "dedicatedEngines": 1,
            "meanReward": 0, "loss": 0, "tokensPerS": 0, "responseLenMean": 0}  # fmt: skip
    return SyncReport.model_validate(
        {"step": step, "time": at.timestamp(), **zero,
         "releasedRolloutPods": list(released), "lostRolloutPods": list(lost)}
    )  # fmt: skip


def plan(pods: list[lifecycle.PodObservation], **kw: Any) -> elastic.RolloutPodsPlan:
    args: dict[str, Any] = {
        "attempt": 0, "target": 1, "draining": [], "reports": [], "grace_s": 300, "now": T0, **kw,
    }  # fmt: skip
    return elastic.plan_rollout_pods([trainer(0), *pods], **args)


def test_lowering_the_target_drains_instead_of_deleting() -> None:
    first = plan([pod(0), pod(1)])
    assert first.keep == ("demo-rollout-1",) and first.released == first.expired == ()
    assert first.draining == (api.DrainingPod(index=1, since=T0),)
    assert first.retry_s == 300


def test_a_release_newer_than_the_drain_deletes_the_pod() -> None:
    draining = [api.DrainingPod(index=1, since=T0)]
    later = T0 + timedelta(seconds=20)
    old_ack = report(T0 - timedelta(seconds=5), released=(1,))  # an earlier drain of the same index
    waiting = plan([pod(0), pod(1)], draining=draining, reports=[old_ack], now=later)
    assert waiting.keep == ("demo-rollout-1",) and waiting.released == ()
    assert waiting.draining[0].since == T0 and waiting.retry_s == 280  # the drain keeps its start
    acked = plan(
        [pod(0), pod(1)], draining=draining, reports=[old_ack, report(T0 + timedelta(seconds=8), 2, (1,))],
        now=later,
    )  # fmt: skip
    assert acked.keep == () and acked.released == (1,) and acked.draining == () and acked.retry_s is None


def test_without_an_ack_the_pod_goes_after_the_grace_period() -> None:
    draining = [api.DrainingPod(index=1, since=T0)]
    assert plan([pod(0), pod(1)], draining=draining, now=T0 + timedelta(seconds=299)).keep
    late = plan([pod(0), pod(1)], draining=draining, now=T0 + timedelta(seconds=300))
    assert late.keep == () and late.expired == (1,) and late.draining == ()
    assert plan([pod(0), pod(1)], grace_s=0).expired == (1,)  # 0: at once


def test_a_draining_pod_that_is_not_running_goes_at_once() -> None:
    out = plan([pod(0), pod(1, "Pending"), pod(2, "Failed")])
    assert out.keep == () and out.expired == (1, 2) and out.replace == ()


def test_raising_the_target_again_ends_the_drain() -> None:
    draining = [api.DrainingPod(index=1, since=T0)]
    out = plan([pod(0), pod(1)], draining=draining, target=2)
    assert out == elastic.RolloutPodsPlan()


def test_deleting_pods_are_neither_drained_nor_replaced() -> None:
    out = plan([pod(0, "Failed", deleting=True), pod(1, deleting=True)])
    assert out == elastic.RolloutPodsPlan()


def test_lost_engines_are_replaced_alone() -> None:
    created = (T0 - timedelta(minutes=5)).timestamp()
    failed = pod(0, "Failed", exit_code=1, message="ray worker died")
    out = plan([failed], target=2)
    assert [r.name for r in out.replace] == ["demo-rollout-0"] and "exit code 1" in out.replace[0].why
    evicted = pod(0, disruption="EvictionByEvictionAPI")
    assert "disrupted" in plan([evicted]).replace[0].why
    orphan = pod(0, node_name="gpu-local-9")
    assert plan([orphan], node_names=frozenset({"gpu-local-0"})).replace[0].why.endswith("gpu-local-9")
    # reported lost by the driver after the pod was created: replace; a report older than the
    # pod is about its predecessor (already replaced)
    hung = pod(0, created=created)
    lost = report(T0 - timedelta(minutes=1), step=7, lost=(0,))
    assert "step 7" in plan([hung], reports=[lost]).replace[0].why
    new = dataclasses.replace(hung, created=T0.timestamp())
    assert plan([new], reports=[lost]).replace == ()
    # the report's interval (1 s here) began after the pod was created: the pod that was deleted
    # (and whose engine the driver then reported lost) was its predecessor, so no second replacement
    during = dataclasses.replace(hung, created=lost.time - 0.5)
    assert plan([during], reports=[lost]).replace == ()
    assert plan([pod(0)]).replace == ()  # a healthy pod stays
    # the trainers are never in the plan
    assert all("trainer" not in r.name for r in plan([failed], target=1).replace)


def test_a_kueue_evicted_engine_drains_within_the_shorter_grace() -> None:
    """Kueue evicted engine 1's Workload (the admission step lowered the target to 1): the pod is
    drained, not deleted, and its grace is bounded by preempted_grace, while another drain keeps
    drainGraceSeconds."""
    evicted = {1: "Kueue evicted Workload rljob-demo-rollout-1 (Preempted: ...)"}
    first = plan([pod(0), pod(1), pod(2)], preempted=evicted, preempted_grace=30)
    assert first.keep == ("demo-rollout-1", "demo-rollout-2") and first.expired == first.released == ()
    assert [d.index for d in first.draining] == [1, 2] and first.retry_s == 30
    draining = list(first.draining)
    later = plan([pod(0), pod(1), pod(2)], draining=draining, preempted=evicted, preempted_grace=30,
                 now=T0 + timedelta(seconds=30))  # fmt: skip
    assert later.expired == (1,) and later.keep == ("demo-rollout-2",) and later.retry_s == 270
    # the driver's release still wins before the grace ends
    ack = report(T0 + timedelta(seconds=3), released=(1,))
    acked = plan([pod(0), pod(1)], draining=draining[:1], preempted=evicted, preempted_grace=30,
                 reports=[ack], now=T0 + timedelta(seconds=5))  # fmt: skip
    assert acked.released == (1,) and acked.keep == ()
    # the bound never lengthens drainGraceSeconds
    assert plan([pod(0), pod(1)], grace_s=10, preempted=evicted, preempted_grace=30).retry_s == 10


def test_preempted_grace_is_the_shorter_of_drain_and_checkpoint_grace() -> None:
    spec = api.RLJobSpec.model_validate(
        {"model": {"name": "m", "source": {"tiny": {}}, "config": {"preset": "qwen2.5-0.5b"}},
         "data": {"source": {"builtin": {"name": "toy-arithmetic"}}},
         "resources": {"accelerator": {"kind": "cpu"}, "totalAccelerators": 2, "acceleratorsPerNode": 1,
                       "rollout": {"drainGraceSeconds": 120}},
         "preemption": {"checkpointGraceSeconds": 45}}
    )  # fmt: skip
    assert elastic.preempted_grace_s(spec) == 45
    longer = spec.model_copy(update={"preemption": api.PreemptionSpec(checkpoint_grace_seconds=600)})
    assert elastic.preempted_grace_s(longer) == 120


POLICY = api.RestartPolicySpec(initial_backoff_seconds=10, max_backoff_seconds=40)


def backoffs(out: elastic.RolloutPodsPlan) -> list[tuple[int, int, float]]:
    return [(b.index, b.replacements, (b.not_before - T0).total_seconds()) for b in out.backoff]


def test_a_crash_looping_rollout_pod_waits_a_growing_backoff() -> None:
    """First loss: replaced at once; each loss in a row after it doubles the wait (10, 20, 40, 40 s,
    counted from the end of the second the loss was seen in: `now` is whole seconds, so the wait is
    never shorter than the spec); the pod's name stays free (held) until its backoff ends; other
    indices are not affected."""
    failed = pod(0, "Failed", exit_code=1)
    first = plan([failed, pod(1)], target=2, restart_policy=POLICY)
    assert [r.name for r in first.replace] == ["demo-rollout-0"] and first.replace[0].replacements == 1
    assert backoffs(first) == [(0, 1, 0)] and first.hold == () and first.retry_s is None
    record = list(first.backoff)
    waits = []
    for _ in range(4):
        again = plan([failed, pod(1)], target=2, backoff=record, restart_policy=POLICY)
        (b,) = again.backoff
        waits.append((b.not_before - T0).total_seconds())
        assert again.hold == (0,) and again.retry_s == waits[-1]
        assert again.replace[0].not_before == b.not_before and again.replace[0].replacements == b.replacements
        record = list(again.backoff)
    assert waits == [11, 21, 41, 41]
    # while the backoff runs, the missing pod is held; once it ends, the pod diff creates it
    gone = plan([pod(1)], target=2, backoff=record, restart_policy=POLICY, now=T0 + timedelta(seconds=40))
    assert gone.hold == (0,) and gone.retry_s == 1 and gone.backoff == tuple(record)
    due = plan([pod(1)], target=2, backoff=record, restart_policy=POLICY, now=T0 + timedelta(seconds=41))
    assert due.hold == () and due.retry_s is None and due.backoff == tuple(record)


def test_the_backoff_resets_once_the_replacement_ran_long_enough() -> None:
    record = [api.ReplacementBackoff(index=0, attempt=0, replacements=3, not_before=T0)]
    created = T0.timestamp() + 5  # created 5 s after the backoff ended
    healthy = pod(0, created=created)
    reset_s = elastic.BACKOFF_RESET_FACTOR * POLICY.max_backoff_seconds
    soon = plan([healthy], backoff=record, restart_policy=POLICY, now=T0 + timedelta(seconds=reset_s + 4))
    assert soon.backoff == tuple(record)  # not yet: counted from the pod's creation
    later = plan([healthy], backoff=record, restart_policy=POLICY, now=T0 + timedelta(seconds=reset_s + 5))
    assert later.backoff == () and later.replace == ()
    # a pending pod is not healthy, however long it waits
    pending = pod(0, "Pending", created=created)
    assert plan([pending], backoff=record, restart_policy=POLICY, now=T0 + timedelta(hours=1)).backoff
    # after a reset the next loss is a first loss again: replaced at once
    fresh = plan([pod(0, "Failed", created=created)], backoff=list(later.backoff), restart_policy=POLICY)
    assert fresh.hold == () and fresh.replace[0].replacements == 1


def test_backoff_records_of_another_attempt_or_above_the_target_are_dropped() -> None:
    old = api.ReplacementBackoff(index=0, attempt=0, replacements=4, not_before=T0 + timedelta(minutes=5))
    above = api.ReplacementBackoff(index=1, attempt=1, replacements=2, not_before=T0 + timedelta(minutes=5))
    out = plan([], attempt=1, target=1, backoff=[old, above], restart_policy=POLICY)
    assert out.backoff == () and out.hold == ()

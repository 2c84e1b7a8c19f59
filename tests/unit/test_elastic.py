"""Unit tests for rljob_operator.elastic: two-phase scale-down and lone replacement of rollout pods."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, timezone
from typing import Any

from rljob_operator import api, elastic, names, reconcile
from rljob_trainer.telemetry import SyncReport

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


def pod(index: int, phase: str = "Running", **kw: Any) -> reconcile.PodObservation:
    name = names.pod_name("demo", names.ROLE_ROLLOUT, index)
    return reconcile.PodObservation(name, names.ROLE_ROLLOUT, index, phase, 0, "h", **kw)


def trainer(index: int) -> reconcile.PodObservation:
    return reconcile.PodObservation(f"demo-trainer-{index}", names.ROLE_TRAINER, index, "Running", 0, "h")


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


def plan(pods: list[reconcile.PodObservation], **kw: Any) -> elastic.RolloutPodsPlan:
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

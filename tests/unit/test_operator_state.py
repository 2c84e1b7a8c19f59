"""What the operator's watches remember between reconciles (rljob_operator.reconcile.state.State)."""

from __future__ import annotations

import dataclasses
from typing import Any

from rljob_operator.decide import lifecycle
from rljob_operator.reconcile.state import State


def _pod(**changes: Any) -> lifecycle.PodObservation:
    base = lifecycle.PodObservation(
        name="j-trainer-0", role="trainer", index=0, phase="Pending", attempt=0, template_hash="h"
    )
    return dataclasses.replace(base, **changes)


def test_only_a_pod_event_that_changes_what_a_reconcile_reads_counts() -> None:
    state = State(kube=None)  # type: ignore[arg-type]  # no API call here
    assert state.pod_changed("ns/j", "j-trainer-0", _pod()) == "changed"  # a new pod
    assert state.pod_changed("ns/j", "j-trainer-0", _pod()) == "none"  # e.g. only the pod IP changed
    assert state.pod_changed("ns/j", "j-trainer-0", _pod(node_name="n1")) == "none"  # bound, nothing else
    assert state.pod_changed("ns/j", "j-trainer-0", _pod(node_name="n1", phase="Running")) == "changed"
    assert state.pod_changed("ns/j", "j-trainer-0", None) == "changed"  # deleted
    assert state.pod_changed("ns/j", "j-trainer-0", None) == "none"


def test_a_refusal_in_new_words_is_told_apart_from_a_new_refusal_and_from_any_other_change() -> None:
    state = State(kube=None)  # type: ignore[arg-type]
    first = "0/82 nodes are available: 54 node(s) had untolerated taint(s), 28 Insufficient nvidia.com/gpu."
    again = "0/82 nodes are available: 20 node(s) had untolerated taint(s), 62 Insufficient nvidia.com/gpu."
    assert state.pod_changed("ns/j", "j-trainer-0", _pod()) == "changed"
    assert state.pod_changed("ns/j", "j-trainer-0", _pod(unschedulable=first)) == "changed"  # refused
    assert state.pod_changed("ns/j", "j-trainer-0", _pod(unschedulable=again)) == "reworded"
    assert state.pod_changed("ns/j", "j-trainer-0", _pod(unschedulable=again)) == "none"
    # reworded, and something else changed with it: a change
    assert state.pod_changed("ns/j", "j-trainer-0", _pod(unschedulable=first, deleting=True)) == "changed"
    # no longer refused (bound): a change
    assert state.pod_changed("ns/j", "j-trainer-0", _pod(node_name="n1", deleting=True)) == "changed"


def test_forgetting_a_job_forgets_its_pod_views_and_creates() -> None:
    state = State(kube=None)  # type: ignore[arg-type]
    state.pod_changed("ns/j", "j-trainer-0", _pod())
    state.created["ns/j"] = {"j-trainer-0": (0, 1.0)}
    state.unwritten["ns/j"] = 1.0
    state.forget("ns/j")
    assert "ns/j" not in state.pod_views and "ns/j" not in state.created and "ns/j" not in state.unwritten


def test_the_watch_showing_a_pod_just_created_is_no_news_and_forgets_the_create() -> None:
    state = State(kube=None)  # type: ignore[arg-type]
    state.created["ns/j"] = {"j-trainer-0": (1, 1.0), "j-rollout-0": (1, 1.0)}
    assert state.seen_created("ns/j", "j-trainer-0", _pod(attempt=1))
    assert "j-trainer-0" not in state.created["ns/j"]
    assert not state.seen_created("ns/j", "j-trainer-0", _pod(attempt=1))  # not ours any more
    # already bound, or already in trouble: news for the reconcile
    assert not state.seen_created("ns/j", "j-rollout-0", _pod(attempt=1, unschedulable="0/3 nodes"))
    assert not state.seen_created("ns/j", "j-other-0", _pod(attempt=1))  # never created here


def test_a_telemetry_write_is_news_only_when_the_reports_change() -> None:
    state = State(kube=None)  # type: ignore[arg-type]
    assert not state.reports_changed("ns/j", "[]")  # the ConfigMap as the operator creates it
    assert not state.reports_changed("ns/j", "")
    assert state.reports_changed("ns/j", '[{"step": 1}]')
    assert not state.reports_changed("ns/j", '[{"step": 1}]')
    assert state.reports_changed("ns/j", '[{"step": 1}, {"step": 2}]')


def _ctx(state: State, uid: str) -> Any:
    from datetime import UTC, datetime

    from rljob_operator import api, builders
    from rljob_operator.reconcile.context import Ctx

    body = {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": "j", "namespace": "ns", "uid": uid},
    }
    return Ctx(
        state=state,
        key="ns/j",
        job=builders.JobRef("j", "ns", uid),
        body=body,
        raw_spec={},
        generation=1,
        old=api.RLJobStatus(),
        old_raw={},
        pods=[],
        telemetry_index={},
        nodes_index={},
        logger=None,  # type: ignore[arg-type]
        now=datetime.now(UTC),
    )


def test_an_rljob_recreated_under_the_same_name_posts_its_own_events_at_once() -> None:
    """The Event rate limit (one per job and reason per interval) is per RLJob, not per name: the
    earlier job's `PodsDeleted` must not silence the one the new job posts for the pods it deletes."""
    from rljob_operator.reconcile.context import post

    state = State(kube=None)  # type: ignore[arg-type]
    first, again = _ctx(state, "uid-1"), _ctx(state, "uid-1")
    post(first, "Normal", "PodsDeleted", "deleted j-rollout-0 (job finished)")
    post(again, "Normal", "PodsDeleted", "deleted j-rollout-0 (again)")
    assert [e["reason"] for e in first.events] == ["PodsDeleted"] and not again.events  # rate-limited
    second = _ctx(state, "uid-2")
    post(second, "Normal", "PodsDeleted", "deleted j-trainer-0 (left by an earlier RLJob of this name)")
    assert [e["involvedObject"]["uid"] for e in second.events] == ["uid-2"]
    state.forget("ns/j")
    assert not state.events


def _rljob(uid: str, resource_version: str) -> dict[str, Any]:
    return {"metadata": {"name": "j", "namespace": "ns", "uid": uid, "resourceVersion": resource_version}}


def test_an_rljob_recreated_under_the_same_name_is_not_forgotten_by_the_earlier_ones_deletion() -> None:
    """kopf handles each object's events apart (streams keyed by uid): the new RLJob's ADDED can come
    before the earlier one's DELETED. That DELETED must not forget the new job (its due reconcile,
    its body), and nothing the earlier job kept (its reconcile cache: the children it applied) is
    the new job's."""
    state = State(kube=None)  # type: ignore[arg-type]
    state.observe_job(_rljob("uid-1", "10"))
    state.cache_for("ns/j", "uid-1").applied = "hash-of-the-same-spec"
    state.created["ns/j"] = {"j-trainer-0": (0, 1.0)}
    state.observe_job(_rljob("uid-2", "20"))  # recreated, seen before the deletion
    assert state.latest["ns/j"]["metadata"]["uid"] == "uid-2"
    assert "ns/j" not in state.created  # the earlier job's, forgotten
    assert state.cache_for("ns/j", "uid-2").applied is None  # children checked again
    state.forget("ns/j", uid="uid-1")  # the earlier job's DELETED, late
    assert "ns/j" in state.jobs and "ns/j" in state.due and "ns/j" in state.latest
    state.observe_job(_rljob("uid-1", "15"))  # a late event of the earlier job: dropped
    assert state.latest["ns/j"]["metadata"]["uid"] == "uid-2"
    state.forget("ns/j", uid="uid-2")
    assert "ns/j" not in state.jobs and "ns/j" not in state.latest


def test_a_cache_left_by_an_earlier_rljob_of_the_name_is_not_reused() -> None:
    state = State(kube=None)  # type: ignore[arg-type]
    state.cache_for("ns/j", "uid-1").applied = "h"
    assert state.cache_for("ns/j", "uid-1").applied == "h"
    assert state.cache_for("ns/j", "uid-2").applied is None


def test_a_pod_refused_again_in_new_words_reconciles_its_job_within_the_refresh_not_at_once() -> None:
    import asyncio
    import time

    from rljob_operator import handlers, names

    state = State(kube=None)  # type: ignore[arg-type]
    state.jobs["ns/j"] = ("ns", "j")
    labels = {names.LABEL_JOB: "j", names.LABEL_ROLE: "trainer", names.LABEL_MANAGED_BY: names.MANAGED_BY}

    def refused(message: str) -> dict[str, Any]:
        condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
        return {
            "metadata": {"name": "j-trainer-0", "namespace": "ns", "labels": labels},
            "status": {"phase": "Pending", "conditions": [condition]},
        }

    def due_in_s(body: dict[str, Any]) -> float:
        state.due.pop("ns/j", None)
        asyncio.run(
            handlers.rljob_pod_event(
                event={"type": "MODIFIED", "object": body},
                body=body,
                name="j-trainer-0",
                namespace="ns",
                labels=labels,
                memo={"rljob": state},
            )
        )
        return state.due["ns/j"] - time.monotonic()

    first = due_in_s(refused("0/82 nodes are available: 54 untolerated taint(s)."))
    assert first <= handlers.EVENT_COALESCE_S
    reworded = due_in_s(refused("0/82 nodes are available: 20 untolerated taint(s)."))
    assert handlers.EVENT_COALESCE_S < reworded <= handlers.REFUSAL_REFRESH_S
    bound = {**refused(""), "status": {"phase": "Pending"}, "spec": {"nodeName": "n1"}}
    assert due_in_s(bound) <= handlers.EVENT_COALESCE_S  # no longer refused: at once

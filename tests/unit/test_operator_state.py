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
    assert state.pod_changed("ns/j", "j-trainer-0", _pod())  # a new pod
    assert not state.pod_changed("ns/j", "j-trainer-0", _pod())  # e.g. only the pod IP changed
    assert not state.pod_changed("ns/j", "j-trainer-0", _pod(node_name="n1"))  # bound, nothing else
    assert state.pod_changed("ns/j", "j-trainer-0", _pod(node_name="n1", phase="Running"))
    assert state.pod_changed("ns/j", "j-trainer-0", None)  # deleted
    assert not state.pod_changed("ns/j", "j-trainer-0", None)


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

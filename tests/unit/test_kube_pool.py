"""The operator's API pool (rljob_operator.kube.adapter.PriorityPool): pod creates before status writes
before Events, in order among equals; and which calls get which priority."""

from __future__ import annotations

import threading

import pytest

from rljob_operator.kube import adapter


def test_waiting_calls_run_most_urgent_first_and_in_order_among_equals() -> None:
    pool = adapter.PriorityPool(1)
    gate, ran = threading.Event(), []
    try:
        blocker = pool.submit(adapter.PRIORITY_WORK, gate.wait)  # the one thread is busy
        futures = [
            pool.submit(prio, lambda what=what: ran.append(what))
            for prio, what in [
                (adapter.PRIORITY_EVENT, "event"),
                (adapter.PRIORITY_STATUS, "status-1"),
                (adapter.PRIORITY_WORK, "pod-1"),
                (adapter.PRIORITY_STATUS, "status-2"),
                (adapter.PRIORITY_WORK, "pod-2"),
            ]
        ]
        gate.set()
        for future in [blocker, *futures]:
            future.result(timeout=5)
    finally:
        pool.shutdown()
    assert ran == ["pod-1", "pod-2", "status-1", "status-2", "event"]


def test_a_failing_call_hands_its_exception_to_the_caller_and_the_pool_goes_on() -> None:
    pool = adapter.PriorityPool(1)
    try:
        with pytest.raises(ZeroDivisionError):
            pool.submit(adapter.PRIORITY_WORK, lambda: 1 / 0).result(timeout=5)
        assert pool.submit(adapter.PRIORITY_WORK, lambda: 42).result(timeout=5) == 42
    finally:
        pool.shutdown()


def test_events_go_last_and_rljob_status_writes_after_the_work() -> None:
    assert adapter.priority_of("create", "Event") == adapter.PRIORITY_EVENT
    assert adapter.priority_of("patch", "RLJob") == adapter.PRIORITY_STATUS
    for verb, kind in [("create", "Pod"), ("delete", "Pod"), ("create", "ServiceAccount"), ("get", "RLJob")]:
        assert adapter.priority_of(verb, kind) == adapter.PRIORITY_WORK


def test_a_call_after_shutdown_raises_instead_of_waiting_forever() -> None:
    """An operator stopping with a reconcile or Event post still running must not hang on a call
    no thread will ever run (what made kopf's runner time out: "The operator didn't stop")."""
    pool = adapter.PriorityPool(1)
    queued = pool.submit(adapter.PRIORITY_WORK, lambda: "queued before")
    pool.shutdown()
    assert queued.result(timeout=5) == "queued before"
    with pytest.raises(RuntimeError, match="after the pool shut down"):
        pool.submit(adapter.PRIORITY_EVENT, lambda: None)

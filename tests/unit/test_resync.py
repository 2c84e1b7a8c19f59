"""The resync loop's scheduling core (rljob_operator.kube.resync): due times, wake-ups, jitter, freshness."""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time

import pytest

from rljob_operator.kube import resync


def test_an_event_during_a_reconcile_runs_it_again_right_after() -> None:
    due = resync.DueTimes()
    due.running("ns/a")
    due["ns/a"] = 5.0  # the contract: another step asks for a reconcile while one runs
    due.schedule("ns/a", 300.0, resync.RESYNC)
    assert due["ns/a"] == 5.0 and due.causes["ns/a"] == resync.EVENT


def test_without_an_event_the_reconcile_schedules_its_own_next_time() -> None:
    due = resync.DueTimes()
    due.running("ns/a")
    due.schedule("ns/a", 12.5, resync.RETRY)
    assert due["ns/a"] == 12.5 and due.causes["ns/a"] == resync.RETRY


def test_soon_never_postpones_an_earlier_time_but_brings_a_later_one_forward() -> None:
    due = resync.DueTimes()
    due.soon("ns/a", 10.0)
    due.soon("ns/a", 20.0)
    assert due["ns/a"] == 10.0
    due.soon("ns/a", 3.0)
    assert due["ns/a"] == 3.0
    due.running("ns/a")
    due.soon("ns/a", 40.0)  # running: any event makes it run again
    assert due["ns/a"] == 40.0


def test_pop_forgets_the_cause_too() -> None:
    due = resync.DueTimes()
    due["ns/a"] = 1.0
    assert due.pop("ns/a") == 1.0 and "ns/a" not in due.causes
    assert due.pop("ns/a", None) is None


def test_setting_a_due_time_wakes_the_waiting_loop_at_once() -> None:
    async def scenario() -> float:
        due = resync.DueTimes()
        waiter = asyncio.create_task(due.wait(30.0))
        await asyncio.sleep(0.01)  # the loop is waiting now
        started = time.monotonic()
        due["ns/a"] = time.monotonic()
        await waiter
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 1.0


def test_a_due_time_set_from_a_thread_wakes_the_loop_too() -> None:
    async def scenario() -> float:
        due = resync.DueTimes()
        waiter = asyncio.create_task(due.wait(30.0))
        await asyncio.sleep(0.01)
        started = time.monotonic()
        thread = threading.Thread(target=lambda: due.__setitem__("ns/a", 0.0))  # a sync kopf handler
        thread.start()
        await waiter
        thread.join()
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 1.0


def test_wait_returns_after_its_timeout_when_nothing_is_due() -> None:
    async def scenario() -> float:
        due = resync.DueTimes()
        started = time.monotonic()
        await due.wait(0.05)
        return time.monotonic() - started

    assert 0.04 <= asyncio.run(scenario()) < 1.0


@pytest.mark.parametrize(("draw", "expected"), [(0.0, 300.0), (0.5, 270.0), (1.0, 240.0)])
def test_the_safety_net_is_spread_over_the_last_fifth_of_the_interval(draw: float, expected: float) -> None:
    assert resync.next_resync_s(300.0, lambda: draw) == pytest.approx(expected)


def test_a_retry_sooner_than_the_interval_wins_and_a_later_one_waits_for_the_safety_net() -> None:
    assert resync.next_delay_s(1.0, 300.0, lambda: 0.0) == (1.0, resync.RETRY)
    assert resync.next_delay_s(None, 300.0, lambda: 0.0) == (300.0, resync.RESYNC)
    assert resync.next_delay_s(86400.0, 300.0, lambda: 1.0) == (240.0, resync.RESYNC)


@pytest.mark.parametrize(
    ("candidate", "known", "newer"),
    [
        ("11", None, True),  # nothing known yet
        ("11", "11", False),  # the echo of our own write
        ("10", "11", False),  # a watch event lagging behind our write's response
        ("12", "11", True),
        ("100", "99", True),  # integers, not strings: "100" < "99" as text
        ("b", "a", True),  # opaque versions: any difference is news
        (None, "11", False),
    ],
)
def test_is_newer_compares_etcd_revisions_as_integers(
    candidate: str | None, known: str | None, newer: bool
) -> None:
    assert resync.is_newer(candidate, known) is newer


# ---- which due job goes first -------------------------------------------------------------------
def test_pick_starts_jobs_with_pods_to_create_before_earlier_re_reconciles() -> None:
    due = {"ns/old-1": 1.0, "ns/old-2": 2.0, "ns/new": 3.0, "ns/later": 50.0}
    start, next_at = resync.pick(due, 10.0, running=(), slots=2, urgent=lambda k: k == "ns/new")
    assert start == ["ns/new", "ns/old-1"]
    assert next_at == 50.0  # old-2 waits for a free slot, which wakes the loop itself


def test_pick_never_starts_a_running_job_nor_more_than_the_free_slots() -> None:
    due = {"ns/a": resync.RUNNING, "ns/b": 0.0, "ns/c": 0.0}
    start, next_at = resync.pick(due, 1.0, running={"ns/a", "ns/b"}, slots=5, urgent=lambda _: False)
    assert start == ["ns/c"] and next_at == math.inf
    assert resync.pick(due, 1.0, running=(), slots=0, urgent=lambda _: True)[0] == []


def test_a_job_wants_pods_until_one_of_its_current_attempt_exists() -> None:
    assert resync.wants_pods(0, [])
    assert resync.wants_pods(1, [0, 0])  # restarted: only the old attempt's pods
    assert not resync.wants_pods(1, [0, 1])


def test_a_free_slot_wakes_the_waiting_loop() -> None:
    async def scenario() -> float:
        due = resync.DueTimes()
        waiter = asyncio.create_task(due.wait(30.0))
        await asyncio.sleep(0.01)
        started = time.monotonic()
        due.wake()
        await waiter
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 1.0


# ---- what may wait for the next reconcile ----------------------------------------------------------
def test_a_starting_jobs_pending_writes_wait_for_the_window() -> None:
    defer = functools.partial(resync.defer_status, starting=True, new_phase="Pending", window_s=1.0)
    assert defer(old_phase="Pending", deferred_since=None, now=5.0)  # "1/2 pods running"
    assert defer(old_phase="Pending", deferred_since=5.0, now=5.9)
    assert not defer(old_phase="Pending", deferred_since=5.0, now=6.0)  # the window is over: write


@pytest.mark.parametrize(
    ("old_phase", "new_phase", "starting"),
    [
        (None, "Pending", True),  # a new job's first status: its plan, with its pods
        ("Pending", "Running", True),  # Running is news
        (None, "Failed", True),
        ("Running", "Pending", True),  # a Running job that lost a pod
        ("Pending", "Pending", False),  # not starting: a restart, an error, an unschedulable pod
        (None, "Queued", True),
    ],
)
def test_every_other_status_change_is_written_at_once(
    old_phase: str | None, new_phase: str, starting: bool
) -> None:
    assert not resync.defer_status(
        old_phase=old_phase, new_phase=new_phase, starting=starting, deferred_since=None, now=0.0
    )


def test_pods_created_and_not_yet_watched_are_not_created_again_until_seen_or_timed_out() -> None:
    created = {"j-trainer-0": (1, 100.0), "j-rollout-0": (1, 100.0), "j-rollout-1": (0, 100.0)}
    unseen = functools.partial(resync.unseen_creates, created, attempt=1, memory_s=30.0)
    assert unseen(seen=set(), now=101.0) == {"j-trainer-0", "j-rollout-0"}  # not the old attempt's
    assert unseen(seen={"j-trainer-0"}, now=101.0) == {"j-rollout-0"}
    assert unseen(seen=set(), now=130.0) == set()  # a lost create: the next reconcile makes it

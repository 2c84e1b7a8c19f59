"""The resync loop's scheduling core (rljob_operator.resync): due times, wake-ups, jitter, freshness."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rljob_operator import resync


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

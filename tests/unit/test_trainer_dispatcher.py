"""Unit tests for rljob_trainer.rollout.dispatcher: exact load integrals with an injected clock."""

from __future__ import annotations

import pytest

from rljob_trainer.rollout import dispatcher


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_counts_queued_dispatching_and_generating_over_time():
    clock = FakeClock()
    d = dispatcher.Dispatcher(clock)
    d.set_engine("e0", awake=True, capacity=2)
    d.set_engine("e1", awake=False, capacity=2)
    ids = d.submit(3)  # t=100: 3 queued
    clock.t = 101.0
    sent = d.admit()  # t=101: 2 dispatching on e0 (capacity), 1 queued
    assert sent == {"e0": ids[:2]}
    assert (d.count(dispatcher.Phase.DISPATCHING), d.count(dispatcher.Phase.QUEUED)) == (2, 1)
    clock.t = 103.0
    d.mark_generating(ids[:2])  # dispatching requests counted for 2 s
    clock.t = 104.0
    d.finish(ids[:2])
    clock.t = 106.0
    load = d.close_interval()
    # inflight: 3 for [100,104) = 12 request-s, then 1 (the queued one) for [104,106) = 2.
    assert load.inflight_request_seconds == 14.0
    assert load.engine_seconds == 6.0  # only e0 awake, 6 s
    assert load.interval_s == 6.0
    assert load.snapshot_inflight == 1


def test_snapshot_misses_finished_work_but_integral_sees_it():
    clock = FakeClock()
    d = dispatcher.Dispatcher(clock)
    d.set_engine("e0", awake=True, capacity=8)
    ids = d.submit(4)
    d.admit()
    clock.t += 5.0
    d.finish(ids)
    clock.t += 5.0
    load = d.close_interval()
    assert load.snapshot_inflight == 0  # the seed's rule reads "idle"
    assert load.inflight_request_seconds == 20.0 and load.engine_seconds == 10.0
    nxt = d.close_interval()  # a new interval starts from zero
    assert (nxt.interval_s, nxt.inflight_request_seconds, nxt.engine_seconds) == (0.0, 0.0, 0.0)


def test_admission_balances_and_respects_sleep_and_removal():
    clock = FakeClock()
    d = dispatcher.Dispatcher(clock)
    d.set_engine("a", awake=True, capacity=3)
    d.set_engine("b", awake=True, capacity=3)
    d.set_engine("c", awake=False, capacity=3)
    ids = d.submit(5)
    sent = d.admit(max_per_engine=2)
    assert sorted(len(v) for v in sent.values()) == [2, 2] and "c" not in sent
    assert d.count(dispatcher.Phase.QUEUED) == 1
    d.remove_engine("a")  # its requests return to the queue
    assert d.count(dispatcher.Phase.QUEUED) == 3
    assert d.admit() == {"b": sorted(set(ids) - set(sent["b"]))[:1]}
    with pytest.raises(ValueError, match="not dispatching"):
        d.mark_generating([ids[4]])  # still queued
    clock.t -= 1
    with pytest.raises(ValueError, match="backwards"):
        d.submit(1)


def test_admit_limits_engines_and_requests_and_requeue_returns_them_to_the_queue():
    clock = FakeClock()
    d = dispatcher.Dispatcher(clock)
    d.set_engine("shared-0", awake=True, capacity=8)
    d.set_engine("dedicated-0", awake=True, capacity=8)
    current, ahead = d.submit(3), d.submit(3)
    # The shared engine takes only the step the trainer waits for, never the steps ahead.
    sent = d.admit(engines=["shared-0"], requests=set(current))
    assert sent == {"shared-0": current}
    sent = d.admit(engines=["dedicated-0"])
    assert sent == {"dedicated-0": ahead}
    assert d.admit() == {}  # nothing queued
    d.requeue(ahead[1:])  # e.g. their outputs were too stale to train on
    assert [d.is_queued(r) for r in ahead] == [False, True, True]
    assert d.engine_inflight("dedicated-0") == 1
    clock.t = 102.0
    load = d.close_interval()
    assert load.inflight_request_seconds == 12.0  # requeued requests stay in flight
    with pytest.raises(ValueError, match="not in flight"):
        d.requeue([999])


def test_a_removed_engine_hands_its_requests_back_to_the_others():
    d = dispatcher.Dispatcher(FakeClock())
    d.set_engine("dedicated-0", awake=True, capacity=4)
    d.set_engine("dedicated-1", awake=True, capacity=4)
    ids = d.submit(4)
    sent = d.admit(max_per_engine=2)
    assert sorted(len(v) for v in sent.values()) == [2, 2]
    lost = sent["dedicated-1"]
    d.remove_engine("dedicated-1")  # it died: its requests go back to the queue
    assert all(d.is_queued(r) for r in lost)
    assert d.admit() == {"dedicated-0": lost}
    assert d.inflight == len(ids)

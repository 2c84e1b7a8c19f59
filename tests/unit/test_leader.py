"""The pure rules of Lease leader election (`rljob_operator.kube.leader`): who may take the Lease, what a
holder writes, where the Lease lives. The elector against the real apiserver is in
tests/integration/test_leader_election.py."""

from __future__ import annotations

import datetime
import threading
import time

import pytest

from rljob_operator.cli import commands
from rljob_operator.kube import leader

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
T1 = T0 + datetime.timedelta(seconds=2)


def held_by(holder: str, duration_s: int = 15, transitions: int = 4) -> leader.LeaseRecord:
    return leader.LeaseRecord(holder, duration_s, T0, T0, transitions)


def test_a_missing_or_released_lease_is_free_to_take() -> None:
    assert leader.may_acquire(None, "b", unchanged_for_s=0)
    assert leader.may_acquire(held_by(""), "b", unchanged_for_s=0)


def test_another_holders_lease_is_taken_only_after_it_stayed_unchanged_for_its_duration() -> None:
    record = held_by("a", duration_s=15)
    assert not leader.may_acquire(record, "b", unchanged_for_s=0)
    assert not leader.may_acquire(record, "b", unchanged_for_s=14.9)
    assert leader.may_acquire(record, "b", unchanged_for_s=15)
    # The record's own duration counts, not the candidate's idea of it.
    assert not leader.may_acquire(held_by("a", duration_s=60), "b", unchanged_for_s=30)


def test_the_holder_may_always_renew() -> None:
    assert leader.may_acquire(held_by("a"), "a", unchanged_for_s=0)


def test_renewing_keeps_acquire_time_and_transitions() -> None:
    renewed = leader.acquired_record(held_by("a"), "a", T1, 15)
    assert renewed == leader.LeaseRecord("a", 15, T0, T1, 4)


def test_taking_over_counts_a_transition_and_restarts_acquire_time() -> None:
    assert leader.acquired_record(held_by("a"), "b", T1, 15) == leader.LeaseRecord("b", 15, T1, T1, 5)
    assert leader.acquired_record(None, "b", T1, 15) == leader.LeaseRecord("b", 15, T1, T1, 0)


def test_release_empties_the_holder_and_shortens_the_lease() -> None:
    released = leader.released_record(held_by("a"), T1)
    assert released.holder == "" and released.lease_duration_s == 1 and released.renew_time == T1
    assert leader.may_acquire(released, "b", unchanged_for_s=0)


def test_lease_namespace_flag_then_pod_namespace_then_default() -> None:
    assert leader.lease_namespace("ops", "rljob-system") == "ops"
    assert leader.lease_namespace(None, "rljob-system") == "rljob-system"
    assert leader.lease_namespace(None, None) == "default"


def test_identities_of_two_processes_on_one_host_differ() -> None:
    assert leader.new_identity("node-1", "aa") != leader.new_identity("node-1", "bb")
    assert leader.new_identity("pod-7f9", "aa").startswith("pod-7f9_")


@pytest.mark.parametrize(
    ("retry", "deadline", "duration"),
    [(2, 10, 10), (10, 10, 15), (0, 5, 15), (3, 2, 15)],
)
def test_timing_must_let_a_lost_holder_stop_before_anyone_else_may_lead(
    retry: float, deadline: float, duration: int
) -> None:
    with pytest.raises(ValueError, match="retry_period_s < renew_deadline_s < lease_duration_s"):
        leader.ElectionTiming(lease_duration_s=duration, renew_deadline_s=deadline, retry_period_s=retry)


class _UnreachableApi:
    """A CoordinationV1Api whose every call fails, as when the apiserver cannot be reached."""

    def __init__(self) -> None:
        self.calls = 0

    def read_namespaced_lease(self, *args: object, **kwargs: object) -> None:
        self.calls += 1
        raise ConnectionRefusedError("apiserver unreachable")


def test_a_holder_that_cannot_renew_gives_up_within_the_renew_deadline() -> None:
    """The shell's loop: no renewal for renew_deadline_s means lost, well before the lease expires
    for the others (the integration test covers the Lease taken by another candidate)."""
    timing = leader.ElectionTiming(lease_duration_s=2, renew_deadline_s=0.5, retry_period_s=0.05)
    api = _UnreachableApi()
    elector = leader.LeaderElector(api, "ns", "me", timing=timing)  # type: ignore[arg-type]
    lost: list[str] = []
    started = elector.renewed_at = time.monotonic()  # as a successful acquire() leaves it
    elector.renew_until(threading.Event(), lost.append)
    elapsed = time.monotonic() - started
    assert lost == ["Lease ns/rljob-operator not renewed for 0.5 s"]
    # Given up at the deadline, not a retry period or a request timeout later.
    assert 0.5 <= elapsed < 0.5 + 2 * timing.retry_period_s
    assert api.calls >= 5  # it kept retrying every retry period until the deadline


def test_rljob_operator_elects_by_default_and_can_opt_out() -> None:
    parser = commands.build_parser()
    default = parser.parse_args(["operator"])
    assert default.leader_election is True and default.leader_election_namespace is None
    dev = parser.parse_args(["operator", "--no-leader-election", "--leader-election-namespace", "ops"])
    assert dev.leader_election is False and dev.leader_election_namespace == "ops"


class _HangingApi:
    """A CoordinationV1Api whose reads hang for as long as the caller lets them (the request timeout)."""

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def read_namespaced_lease(self, *args: object, _request_timeout: float, **kwargs: object) -> None:
        self.timeouts.append(_request_timeout)
        time.sleep(_request_timeout)
        raise TimeoutError("read timed out")


def test_a_hanging_apiserver_cannot_keep_a_holder_past_its_renew_deadline() -> None:
    # The first renewal starts 0.2 s in, with 0.1 s left before the deadline.
    timing = leader.ElectionTiming(lease_duration_s=2, renew_deadline_s=0.3, retry_period_s=0.2)
    api = _HangingApi()
    elector = leader.LeaderElector(api, "ns", "me", timing=timing)  # type: ignore[arg-type]
    lost: list[str] = []
    started = elector.renewed_at = time.monotonic()
    elector.renew_until(threading.Event(), lost.append)
    elapsed = time.monotonic() - started
    assert lost and "not renewed" in lost[0]
    assert elapsed < 0.3 + 0.15, elapsed
    # Each request was cut to what was left before the deadline (and never beyond a retry period).
    assert api.timeouts and all(t <= 0.2 for t in api.timeouts)
    assert api.timeouts[-1] < 0.15

"""Unit tests for a job's backoff after API errors (`kube.resync.api_error_delay_s`), what an API
error tells it (`kube.adapter.retry_after_s`, `is_api_error`), and the pod observations the
storage limits lead to (`decide.lifecycle`: an eviction for the pod's own emptyDir is a failure)."""

from __future__ import annotations

import urllib3
from hypothesis import given
from hypothesis import strategies as st
from kubernetes.client.rest import ApiException

from rljob_operator.decide import lifecycle
from rljob_operator.kube import adapter, resync


def test_the_backoff_doubles_from_5_s_to_5_min() -> None:
    top = [resync.api_error_delay_s(n, rand=lambda: 1.0) for n in range(1, 10)]
    assert top == [5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 300.0, 300.0]
    low = [resync.api_error_delay_s(n, rand=lambda: 0.0) for n in range(1, 10)]
    assert low == [5.0, 5.0, 10.0, 20.0, 40.0, 80.0, 150.0, 150.0, 150.0]  # never under 5 s


@given(st.integers(min_value=0, max_value=1000), st.floats(min_value=0.0, max_value=0.999999))
def test_the_backoff_stays_within_its_bounds(failures: int, draw: float) -> None:
    delay = resync.api_error_delay_s(failures, rand=lambda: draw)
    assert resync.API_BACKOFF_BASE_S <= delay <= resync.API_BACKOFF_CAP_S


def test_jobs_failing_together_come_back_spread_out() -> None:
    import random

    rng = random.Random(7)
    delays = {round(resync.api_error_delay_s(6, rand=rng.random), 3) for _ in range(50)}
    assert len(delays) > 40 and min(delays) >= 80.0 and max(delays) <= 160.0


def test_retry_after_is_honoured_when_it_asks_for_longer() -> None:
    assert resync.api_error_delay_s(1, 30.0, rand=lambda: 0.0) == 30.0
    assert resync.api_error_delay_s(5, 1.0, rand=lambda: 1.0) == 80.0  # the backoff is longer
    assert resync.api_error_delay_s(1, 9999.0) == resync.API_BACKOFF_CAP_S


def _error(status: int, headers: dict[str, str] | None = None) -> ApiException:
    exc = ApiException(status=status, reason="x")
    exc.headers = headers
    return exc


def test_what_an_api_error_tells_the_backoff() -> None:
    assert adapter.retry_after_s(_error(429, {"Retry-After": "7"})) == 7.0
    assert adapter.retry_after_s(_error(503, {"Retry-After": "2"})) == 2.0
    assert adapter.retry_after_s(_error(429, {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})) is None
    assert adapter.retry_after_s(_error(429)) is None
    assert adapter.retry_after_s(_error(500, {"Retry-After": "7"})) is None  # only 429 / 503 ask it
    assert adapter.retry_after_s(ValueError("x")) is None
    assert adapter.is_api_error(_error(500)) and adapter.is_api_error(urllib3.exceptions.ProtocolError())
    assert not adapter.is_api_error(KeyError("x"))
    assert adapter.is_conflict(_error(409)) and not adapter.is_conflict(_error(404))


def _evicted(message: str) -> lifecycle.PodObservation:
    pod = {
        "metadata": {
            "name": "demo-trainer-0",
            "labels": {"rljob.io/job": "demo", "rljob.io/role": "trainer"},
        },
        "status": {"phase": "Failed", "reason": "Evicted", "message": message},
    }
    obs = lifecycle.observe_pod(pod)
    assert obs is not None
    return obs


def test_an_eviction_for_the_pods_own_storage_is_its_failure_not_a_disruption() -> None:
    own = _evicted('Usage of EmptyDir volume "tmp" exceeds the limit "9Gi". ')
    assert own.disruption == "" and 'EmptyDir volume "tmp"' in own.message
    limit = _evicted('Container trainer exceeded its local ephemeral storage limit "1Gi". ')
    assert limit.disruption == ""
    pressure = _evicted("The node was low on resource: memory. ")
    assert pressure.disruption.startswith("Evicted: The node was low")  # the cluster's doing

"""Unit tests for rljob_operator.kube.metrics: the phase gauge and the one-server-per-port guard."""

from __future__ import annotations

import socket
import urllib.request

from rljob_operator.kube import metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_phase_gauge_counts_every_phase() -> None:
    metrics.set_phase_counts({"a/x": "Running", "a/y": "Running", "b/z": "Failed"})
    assert metrics.JOBS_BY_PHASE.labels("Running")._value.get() == 2
    assert metrics.JOBS_BY_PHASE.labels("Failed")._value.get() == 1
    metrics.set_phase_counts({})
    assert metrics.JOBS_BY_PHASE.labels("Running")._value.get() == 0


def test_server_starts_once_and_serves_our_metrics() -> None:
    assert metrics.start_metrics_server(0) is False
    port = _free_port()
    assert metrics.start_metrics_server(port, addr="127.0.0.1") is True
    assert metrics.start_metrics_server(port, addr="127.0.0.1") is False
    metrics.PODS_CREATED.labels("trainer").inc()
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "rljob_operator_pods_created_total" in body and "rljob_operator_reconcile_duration_seconds" in body

"""Prometheus metrics of the operator, served on one HTTP port.

Role: module-level collectors the handlers update (the shell is the only writer) and
`start_metrics_server(port)`, called once from the kopf startup handler. Names are prefixed
`rljob_operator_`; units are in the names (`_seconds`, `_total`).
"""

from __future__ import annotations

import threading

import prometheus_client

REGISTRY = prometheus_client.CollectorRegistry(auto_describe=True)

RECONCILE_SECONDS = prometheus_client.Histogram(
    "rljob_operator_reconcile_duration_seconds",
    "Time one reconcile of one RLJob took, by cause (event, retry, resync).",
    ["cause"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)
JOBS_BY_PHASE = prometheus_client.Gauge(
    "rljob_operator_jobs", "RLJobs this operator serves, by status.phase.", ["phase"], registry=REGISTRY
)
PODS_CREATED = prometheus_client.Counter(
    "rljob_operator_pods_created_total",
    "Pods created, by role (trainer, rollout).",
    ["role"],
    registry=REGISTRY,
)
PODS_DELETED = prometheus_client.Counter(
    "rljob_operator_pods_deleted_total",
    "Pods deleted, by why (stale, scaledown, suspend, finished).",
    ["why"],
    registry=REGISTRY,
)
DECISIONS = prometheus_client.Counter(
    "rljob_operator_decisions_total",
    "Adaptive decisions that changed a target, by action (wake_shared, add_dedicated, ...).",
    ["action"],
    registry=REGISTRY,
)
RESTARTS = prometheus_client.Counter(
    "rljob_operator_restarts_total", "Job restarts after pod failures.", registry=REGISTRY
)
API_REQUESTS = prometheus_client.Counter(
    "rljob_operator_api_requests_total",
    "Kubernetes API requests the handlers made, by verb and kind (kopf's own watches excluded).",
    ["verb", "kind"],
    registry=REGISTRY,
)
_API_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
API_QUEUE_SECONDS = prometheus_client.Histogram(
    "rljob_operator_api_queue_seconds",
    "Time an API call waited in the operator's API pool for a free thread.",
    buckets=_API_BUCKETS,
    registry=REGISTRY,
)
API_REQUEST_SECONDS = prometheus_client.Histogram(
    "rljob_operator_api_request_seconds",
    "Time an API call took once a thread ran it (the round trip to the apiserver).",
    buckets=_API_BUCKETS,
    registry=REGISTRY,
)
API_ERRORS = prometheus_client.Counter(
    "rljob_operator_api_errors_total",
    "Kubernetes API requests that failed, by verb, kind and HTTP status (409 on create is not an error).",
    ["verb", "kind", "code"],
    registry=REGISTRY,
)

_started: set[int] = set()
_lock = threading.Lock()


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> bool:
    """Serve /metrics on `port` once per process (a second call with the same port is a no-op).

    Returns True when this call started the server. Port 0 disables the endpoint.
    """
    if port <= 0:
        return False
    with _lock:
        if port in _started:
            return False
        prometheus_client.start_http_server(port, addr=addr, registry=REGISTRY)
        _started.add(port)
        return True


def set_phase_counts(phases: dict[str, str]) -> None:
    """Set the jobs-by-phase gauge from `{job_key: phase}` (every known phase, zeros included)."""
    counts: dict[str, int] = {}
    for phase in phases.values():
        counts[phase] = counts.get(phase, 0) + 1
    for phase in ("Pending", "Planning", "Queued", "Running", "Suspended", "Succeeded", "Failed", *counts):
        JOBS_BY_PHASE.labels(phase).set(counts.get(phase, 0))

"""Where sync-point telemetry goes: logs, a Prometheus endpoint, and the job's telemetry ConfigMap.

Role: the imperative shell around `rljob_trainer.outputs.telemetry` (pure). At every weight sync the driver
calls `publish(history, metrics)`: metrics go to the log and to Prometheus gauges always; the report
history goes to ConfigMap `<job>-telemetry` (key `reports.json`) when telemetry is enabled and a
Kubernetes config (in-cluster or kubeconfig) is available. `read_targets()` reads the desired engine
counts and the checkpoint request (cooperative preemption) the operator wrote to the RLJob status.
Uses only what the job's Role allows: patch of the telemetry ConfigMap and get of the RLJob
(docs/contracts.md §3). Callers: `rljob_trainer.driver`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rljob_trainer.outputs import telemetry

log = logging.getLogger("rljob_trainer.outputs.telemetry")

API_GROUP = "rljob.io"
API_VERSION = "v1alpha1"
PLURAL = "rljobs"


@dataclass(frozen=True)
class CheckpointRequest:
    """The operator's `status.checkpointRequest`: checkpoint now (Kueue is preempting the job)."""

    id: str
    reason: str = ""


@dataclass(frozen=True)
class EngineTargets:
    """What the driver follows from the RLJob status: the desired engine counts of `status.rollout`
    (None: the operator has not written one) and a pending checkpoint request (None: none)."""

    desired_shared_awake: int | None
    desired_dedicated_engines: int | None
    checkpoint_request: CheckpointRequest | None = None


def parse_checkpoint_request(status: Mapping[str, Any]) -> CheckpointRequest | None:
    """Pure: `status.checkpointRequest` ({id, reason, requestTime}); None when absent or without an id."""
    raw = status.get("checkpointRequest")
    if not isinstance(raw, Mapping) or not raw.get("id"):
        return None
    return CheckpointRequest(id=str(raw["id"]), reason=str(raw.get("reason") or ""))


def parse_targets(rljob: Mapping[str, Any]) -> EngineTargets:
    """Pure: read `status.rollout.desiredSharedAwake` / `desiredDedicatedEngines` and
    `status.checkpointRequest` from an RLJob object.

    A rollout pod in `status.rollout.drainingPods` is one the operator waits for the driver to
    release, whatever the desired count says (Kueue evicted its Workload, while the policy still
    wants the engine and queues it again): the dedicated target stops below the first of them, so
    the driver drains it and reports it released, as for a lowered target."""
    status = rljob.get("status") or {}
    rollout = status.get("rollout") or {}

    def _int(key: str) -> int | None:
        v = rollout.get(key)
        return int(v) if v is not None else None

    dedicated = _int("desiredDedicatedEngines")
    draining = [
        int(d["index"]) for d in rollout.get("drainingPods") or [] if isinstance(d, Mapping) and "index" in d
    ]
    if draining and dedicated is not None:
        dedicated = min(dedicated, min(draining))
    return EngineTargets(_int("desiredSharedAwake"), dedicated, parse_checkpoint_request(status))


def checkpoint_to_honour(request: CheckpointRequest | None, acked: str | None) -> str | None:
    """Pure: the request id to checkpoint for now, or None (no request, or this one is acknowledged)."""
    if request is None or request.id == acked:
        return None
    return request.id


def prometheus_name(metric: str) -> str:
    """`dp_balance/max_over_bound` -> `rljob_dp_balance_max_over_bound`."""
    return "rljob_" + re.sub(r"[^a-zA-Z0-9_]", "_", metric)


class TelemetrySink:
    def __init__(
        self,
        *,
        enabled: bool,
        job_name: str | None,
        namespace: str | None,
        configmap_name: str | None,
        prometheus_port: int | None,
    ) -> None:
        self.job_name = job_name
        self.namespace = namespace
        self.configmap_name = configmap_name
        self._core: Any = None
        self._custom: Any = None
        self._gauges: dict[str, Any] = {}
        self._registry: Any = None
        if enabled and job_name and namespace and configmap_name:
            self._connect()
        if prometheus_port:
            self._start_prometheus(prometheus_port)

    @property
    def kubernetes_connected(self) -> bool:
        return self._core is not None

    def _connect(self) -> None:
        try:
            from kubernetes import client
            from kubernetes import config as kube_config

            try:
                kube_config.load_incluster_config()
            except kube_config.ConfigException:
                kube_config.load_kube_config()
            self._core = client.CoreV1Api()
            self._custom = client.CustomObjectsApi()
        except Exception as e:  # no cluster: logs and Prometheus still work
            log.warning("telemetry: no Kubernetes API (%s); reports go to the log only", e)

    def _start_prometheus(self, port: int) -> None:
        try:
            from prometheus_client import CollectorRegistry, start_http_server

            self._registry = CollectorRegistry()
            start_http_server(port, registry=self._registry)
        except Exception as e:  # port taken (tests run several drivers): keep training
            log.warning("telemetry: Prometheus endpoint on :%s not started (%s)", port, e)
            self._registry = None

    def _set_gauges(self, metrics: Mapping[str, float]) -> None:
        if self._registry is None:
            return
        from prometheus_client import Gauge

        for key, value in metrics.items():
            if not isinstance(value, (int, float)):
                continue
            name = prometheus_name(key)
            gauge = self._gauges.get(name)
            if gauge is None:
                gauge = Gauge(name, f"rljob trainer metric {key}", registry=self._registry)
                self._gauges[name] = gauge
            gauge.set(float(value))

    def publish(self, history: Sequence[telemetry.SyncReport], metrics: Mapping[str, Any]) -> None:
        """Log the step's metrics, set gauges, and write the report history to the ConfigMap."""
        log.info("step %s %s", metrics.get("step"), json.dumps(dict(metrics), default=str, sort_keys=True))
        self._set_gauges(metrics)
        self.write_history(history)

    def write_history(self, history: Sequence[telemetry.SyncReport]) -> None:
        """Write the report history to the telemetry ConfigMap (no-op without a cluster)."""
        if self._core is None or not history:
            return
        body = {"data": {telemetry.REPORTS_KEY: telemetry.dump_reports(history)}}
        try:
            self._core.patch_namespaced_config_map(self.configmap_name, self.namespace, body)
        except Exception as e:  # telemetry must never stop training
            log.warning("telemetry: patch configmap %s/%s failed: %s", self.namespace, self.configmap_name, e)

    def read_targets(self) -> EngineTargets | None:
        """Desired engine counts from the RLJob status; None when unavailable."""
        if self._custom is None:
            return None
        try:
            obj = self._custom.get_namespaced_custom_object(
                API_GROUP, API_VERSION, self.namespace, PLURAL, self.job_name
            )
        except Exception as e:
            log.warning("telemetry: get rljob %s/%s failed: %s", self.namespace, self.job_name, e)
            return None
        return parse_targets(obj)

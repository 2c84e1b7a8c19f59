"""The job's NetworkPolicy: its pods take connections only from each other (and Prometheus).

Role: pure builder and its settings. Every pod of a job (trainer, rollout and judge, labelled
`names.job_pod_selector`; not its environment servers, which `environments` fences apart) is
selected; ingress is allowed from those pods of the same job on any port
(Ray's GCS, raylets, object managers and workers use many, some random) and, when the chart names
a monitoring namespace, from that namespace to the driver's `metrics` port. Egress is open (hub
downloads, trackers, the apiserver for telemetry) unless the chart gives a list of egress rules:
then only those, the job's own pods and cluster DNS. The chart passes its settings as JSON in
RLJOB_JOB_NETWORK_POLICY (`parse_settings`). Enforcement is the CNI's (Calico, Cilium, ...): a
cluster without a NetworkPolicy implementation stores the object and enforces nothing
(docs/security.md). KubeRay's anchor: a NetworkPolicy admitting only the RayCluster's own pods.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from rljob_operator import names
from rljob_operator.builders.common import JobRef, deep_copy

#: The container port name of the driver's Prometheus endpoint (`pods.METRICS_PORT_NAME`).
METRICS_PORT_NAME = "metrics"
#: The label every namespace carries with its own name (Kubernetes >= 1.21, set by the apiserver).
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
#: Cluster DNS (CoreDNS and kube-dns both carry it), needed once egress is restricted.
DNS_SELECTOR = {"k8s-app": "kube-dns"}
SETTINGS_ENV = "RLJOB_JOB_NETWORK_POLICY"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the chart decides for every job's NetworkPolicy (`jobNetworkPolicy` in values.yaml).

    `metrics_namespace`: the namespace whose pods may scrape the `metrics` port (None: none);
    `egress`: None leaves egress open, else these NetworkPolicyEgressRules (plus the job's own pods
    and DNS) are all a job's pods may reach."""

    enabled: bool = True
    metrics_namespace: str | None = None
    egress: tuple[dict[str, Any], ...] | None = None


def parse_settings(text: str | None) -> Settings:
    """The chart's JSON (`{"enabled": true, "metricsNamespace": "monitoring", "egress": null}`);
    empty or absent: the defaults. Raises ValueError naming the value and the fix."""
    if not text:
        return Settings()
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ValueError(
            f"{SETTINGS_ENV} is not JSON ({exc}): set jobNetworkPolicy in the chart's values"
        ) from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{SETTINGS_ENV} must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - {"enabled", "metricsNamespace", "egress"})
    if unknown:
        raise ValueError(f"{SETTINGS_ENV}: unknown keys {unknown}; valid: enabled, metricsNamespace, egress")
    namespace = raw.get("metricsNamespace") or None
    if namespace is not None and not isinstance(namespace, str):
        raise ValueError(f"{SETTINGS_ENV}.metricsNamespace must be a namespace name, got {namespace!r}")
    egress = raw.get("egress")
    if egress is not None and (
        not isinstance(egress, list) or not all(isinstance(rule, dict) for rule in egress)
    ):
        raise ValueError(f"{SETTINGS_ENV}.egress must be null (open) or a list of NetworkPolicyEgressRules")
    return Settings(
        enabled=bool(raw.get("enabled", True)),
        metrics_namespace=namespace,
        egress=tuple(egress) if egress is not None else None,
    )


def build_network_policy(
    job: JobRef, settings: Settings, *, extra_ingress: Sequence[dict[str, Any]] = ()
) -> dict[str, Any]:
    """The NetworkPolicy `<job>` fencing the job's pods (see the module docstring); `extra_ingress`:
    more rules it admits (the job's endpoint: `endpoint.job_ingress_rule`)."""

    def pods() -> dict[str, Any]:  # a fresh dict each time: no shared objects (YAML aliases) in output
        return {"matchLabels": names.job_pod_selector(job.name)}

    def ranks() -> dict[str, Any]:
        # Every pod of the job but its environment servers: those run untrusted code, so they are
        # fenced apart (`environments.build_environment_network_policy`): no connection from them.
        return {
            "matchLabels": names.job_pod_selector(job.name),
            "matchExpressions": [
                {"key": names.LABEL_ROLE, "operator": "NotIn", "values": [names.ROLE_ENVIRONMENT]}
            ],
        }

    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": ranks()}]}]
    if settings.metrics_namespace:
        ingress.append(
            {
                "from": [
                    {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: settings.metrics_namespace}}}
                ],
                "ports": [{"protocol": "TCP", "port": METRICS_PORT_NAME}],
            }
        )
    ingress += deep_copy(list(extra_ingress))
    spec: dict[str, Any] = {"podSelector": ranks(), "policyTypes": ["Ingress"], "ingress": ingress}
    if settings.egress is not None:
        dns = {
            "to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": dict(DNS_SELECTOR)}}],
            "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
        }
        spec["policyTypes"] = ["Ingress", "Egress"]
        # To every pod of the job, its environment servers included (their own policy admits only
        # the trainer and rollout pods, on their http port).
        spec["egress"] = [{"to": [{"podSelector": pods()}]}, dns, *deep_copy(list(settings.egress))]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": names.network_policy_name(job.name),
            "namespace": job.namespace,
            "labels": names.object_labels(job.name, names.ROLE_FENCE),
        },
        "spec": spec,
    }

"""RBAC objects: the per-job least-privilege Role and the operator's own ClusterRole.

Role: pure builders for ServiceAccount/Role/RoleBinding dicts. The per-job objects follow
docs/contracts.md §3 exactly (a job's pods may touch only their own telemetry ConfigMap, read their
own config ConfigMap and read their own RLJob); `handlers` applies them. The operator ClusterRole is
reused by the Helm chart and the integration tests. No clock, env or API access.
"""

from __future__ import annotations

from typing import Any

from rljob_operator import names

API_GROUP = "rljob.io"
KUEUE_GROUP = "kueue.x-k8s.io"
PLURAL = "rljobs"


def build_service_account(job: str, namespace: str) -> dict[str, Any]:
    """The job's ServiceAccount `<job>`; its pods run as it (token mounted for the telemetry writes)."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {
            "name": names.service_account_name(job),
            "namespace": namespace,
            "labels": names.object_labels(job, "rbac"),
        },
    }


def build_role(job: str, namespace: str) -> dict[str, Any]:
    """The job's Role: exactly the rules of docs/contracts.md §3, each limited by resourceNames."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {
            "name": names.role_name(job),
            "namespace": namespace,
            "labels": names.object_labels(job, "rbac"),
        },
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [names.telemetry_config_map_name(job)],
                "verbs": ["get", "patch", "update"],
            },
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [names.config_map_name(job)],
                "verbs": ["get"],
            },
            {
                "apiGroups": [API_GROUP],
                "resources": [PLURAL],
                "resourceNames": [job],
                "verbs": ["get"],
            },
        ],
    }


def build_role_binding(job: str, namespace: str) -> dict[str, Any]:
    """Binds the job's Role to the job's ServiceAccount, in the job's namespace only."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {
            "name": names.role_binding_name(job),
            "namespace": namespace,
            "labels": names.object_labels(job, "rbac"),
        },
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": names.role_name(job)},
        "subjects": [
            {"kind": "ServiceAccount", "name": names.service_account_name(job), "namespace": namespace}
        ],
    }


def operator_rules() -> list[dict[str, Any]]:
    """What the operator itself needs, and nothing more.

    - rljobs: watch, patch (kopf's annotations/finalizer), delete (TTL after finished);
      rljobs/status for the status subresource; rljobs/finalizers so owner references with
      blockOwnerDeletion pass the OwnerReferencesPermissionEnforcement admission plugin.
    - pods, services, configmaps, serviceaccounts, roles, rolebindings: the job's children.
      Creating a Role requires holding its rules, which the configmaps/rljobs grants cover.
    - secrets: create only, the job's Ray token (never read: no get, list or watch on Secrets).
    - networkpolicies: the job's fence, created once (get when its name is taken).
    - nodes: read-only, to check that the node pool can hold the plan.
    - persistentvolumeclaims: get, to report a missing claim or one the pods cannot share.
    - podgroups (scheduling.k8s.io, where served): a job's gang, created once, replaced when its
      minCount changes.
    - events: kopf posts Events on transitions.
    - kopf peering and CRD/namespace discovery.
    - Kueue (kueue.x-k8s.io): the job's Workloads (created, watched, deleted when an extra engine
      is released or a pending one is rebuilt), their status (PodsReady and Finished, server-side
      applied), and reads of the ResourceFlavors and WorkloadPriorityClasses they name; the pods'
      PriorityClass value when the Workload's priority comes from it.
    """
    rw = ["get", "list", "watch", "create", "update", "patch", "delete"]
    read = ["get", "list", "watch"]
    return [
        _rule(API_GROUP, [PLURAL], [*read, "patch", "update", "delete"]),
        _rule(API_GROUP, [f"{PLURAL}/status"], ["get", "patch", "update"]),
        _rule(API_GROUP, [f"{PLURAL}/finalizers"], ["update"]),
        _rule("", ["pods", "services", "configmaps", "serviceaccounts"], rw),
        _rule("rbac.authorization.k8s.io", ["roles", "rolebindings"], rw),
        _rule("", ["secrets"], ["create"]),
        _rule("networking.k8s.io", ["networkpolicies"], ["get", "create"]),
        _rule("", ["nodes"], read),
        _rule("", ["persistentvolumeclaims"], ["get"]),
        _rule("scheduling.k8s.io", ["podgroups"], ["get", "create", "delete"]),
        _rule("", ["events"], ["create", "patch"]),
        _rule("events.k8s.io", ["events"], ["create", "patch"]),
        _rule("", ["namespaces"], read),
        _rule("apiextensions.k8s.io", ["customresourcedefinitions"], read),
        _rule("kopf.dev", ["clusterkopfpeerings", "kopfpeerings"], [*read, "patch"]),
        _rule(KUEUE_GROUP, ["workloads"], [*read, "create", "delete"]),
        _rule(KUEUE_GROUP, ["workloads/status"], ["patch"]),
        _rule(KUEUE_GROUP, ["resourceflavors", "workloadpriorityclasses"], read),
        _rule("scheduling.k8s.io", ["priorityclasses"], ["get"]),
    ]


def _rule(group: str, resources: list[str], verbs: list[str]) -> dict[str, Any]:
    return {"apiGroups": [group], "resources": resources, "verbs": verbs}


def build_operator_cluster_role(name: str = "rljob-operator") -> dict[str, Any]:
    """The operator's ClusterRole (the Helm chart renders the same rules)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {names.LABEL_MANAGED_BY: names.MANAGED_BY}},
        "rules": operator_rules(),
    }


def build_operator_cluster_role_binding(
    name: str, service_account: str, namespace: str, role: str = "rljob-operator"
) -> dict[str, Any]:
    """Binds the operator ClusterRole to the operator's ServiceAccount."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name, "labels": {names.LABEL_MANAGED_BY: names.MANAGED_BY}},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}],
    }

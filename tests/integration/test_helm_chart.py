"""The Helm chart (`helm/rljob`) against real `helm` and the real local control plane.

What a cluster admin relies on: `helm lint` passes; `helm template` renders the operator Deployment,
its ServiceAccount, RBAC and metrics Service for all-namespaces and one-namespace installs; the
chart's CRD is the generated one; `helm install` creates everything and the CRD becomes
Established; the ServiceAccount may do exactly what the handlers need (checked with
SubjectAccessReviews and RBAC escalation prevention), plus its leader-election Lease and no other;
two replicas with a PodDisruptionBudget and a one-at-a-time rolling update; `rljob operator`, started with the
Deployment's own arguments and environment and authenticated only by that ServiceAccount's token,
reconciles `examples/tiny-cpu.yaml` into pods without a single Forbidden; `helm uninstall` removes
what it installed. No container runs on the local cluster, so the operator runs here as a process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob_operator.api import crd
from rljob_operator.builders import rbac
from testenv.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "rljob"
EXAMPLE = REPO / "examples" / "tiny-cpu.yaml"
RBAC_GROUP = "rbac.authorization.k8s.io"

Rules = dict[tuple[str, str], set[str]]

# What the operator (handlers, steps, queue_steps) and kopf (standalone) call, per (apiGroup, resource).
# The chart's rules must equal these: a wider grant fails here, a missing one fails the reconcile.
NAMESPACED_RULES: Rules = {
    ("rljob.io", "rljobs"): {"get", "list", "watch", "patch", "delete"},
    ("rljob.io", "rljobs/status"): {"patch"},
    ("rljob.io", "rljobs/finalizers"): {"update"},
    ("", "pods"): {"list", "watch", "create", "delete"},
    ("", "configmaps"): {"get", "list", "watch", "create", "patch", "update"},
    ("", "services"): {"get", "create"},
    ("", "serviceaccounts"): {"get", "create"},
    (RBAC_GROUP, "roles"): {"get", "create"},
    (RBAC_GROUP, "rolebindings"): {"get", "create"},
    ("", "secrets"): {"create"},
    ("networking.k8s.io", "networkpolicies"): {"get", "create"},
    ("", "events"): {"create"},
    ("", "persistentvolumeclaims"): {"get"},
    ("scheduling.k8s.io", "podgroups"): {"get", "create", "delete"},
    ("kueue.x-k8s.io", "workloads"): {"get", "list", "watch", "create", "delete"},
    ("kueue.x-k8s.io", "workloads/status"): {"patch"},
}
CLUSTER_RULES: Rules = {
    ("", "nodes"): {"list", "watch"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    ("kueue.x-k8s.io", "resourceflavors"): {"get"},
    ("kueue.x-k8s.io", "workloadpriorityclasses"): {"get"},
    ("scheduling.k8s.io", "priorityclasses"): {"get"},
}
# Leader election (operator/rljob_operator/kube/leader.py), in the release namespace only.
LEASE_RULES: Rules = {("coordination.k8s.io", "leases"): {"create", "get", "update"}}
# Only with a namespace list: kopf follows those namespaces (all-namespaces mode never reads them).
ONE_NAMESPACE_CLUSTER_RULES: Rules = {**CLUSTER_RULES, ("", "namespaces"): {"list", "watch"}}

# (verb, group, resource, subresource, namespaced) the ServiceAccount must NOT be allowed.
DENIED = [
    ("get", "", "secrets", "", True),
    ("list", "", "secrets", "", True),
    ("watch", "", "secrets", "", True),
    ("update", "", "secrets", "", True),
    ("patch", "", "secrets", "", True),
    ("delete", "", "secrets", "", True),
    ("update", "networking.k8s.io", "networkpolicies", "", True),
    ("delete", "networking.k8s.io", "networkpolicies", "", True),
    ("create", "", "pods", "exec", True),
    ("get", "", "pods", "log", True),
    ("patch", "", "pods", "", True),
    ("update", "", "pods", "", True),
    ("delete", "", "configmaps", "", True),
    ("delete", "", "services", "", True),
    ("delete", "", "serviceaccounts", "", True),
    ("delete", RBAC_GROUP, "roles", "", True),
    ("delete", RBAC_GROUP, "rolebindings", "", True),
    ("patch", RBAC_GROUP, "roles", "", True),
    ("bind", RBAC_GROUP, "roles", "", True),
    ("escalate", RBAC_GROUP, "roles", "", True),
    ("create", RBAC_GROUP, "clusterroles", "", False),
    ("create", RBAC_GROUP, "clusterrolebindings", "", False),
    ("delete", "", "namespaces", "", False),
    ("patch", "", "nodes", "", False),
    ("create", "apiextensions.k8s.io", "customresourcedefinitions", "", False),
    ("create", "apps", "deployments", "", True),
]


# ---- helpers -------------------------------------------------------------------------------------
def rule_map(rules: Iterable[dict[str, Any]]) -> Rules:
    """PolicyRules as {(group, resource): verbs}; resourceNames are ignored (they only narrow)."""
    out: Rules = {}
    for rule in rules:
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                out.setdefault((group, resource), set()).update(rule.get("verbs", []))
    return out


def covers(granted: Rules, needed: Rules) -> list[str]:
    """What `needed` asks beyond `granted` (wildcards honoured), as readable lines."""
    missing = []
    for (group, resource), verbs in needed.items():
        have = (
            granted.get((group, resource), set())
            | granted.get((group, "*"), set())
            | granted.get(("*", resource), set())
        )
        lacking = verbs - have if "*" not in have else set()
        if lacking:
            missing.append(f"{group or 'core'}/{resource}: {sorted(lacking)}")
    return missing


def render(cluster: Any, *args: str, namespace: str = "rljob-system") -> list[dict[str, Any]]:
    out = cluster.helm("template", "rel-rljob", str(CHART), "--namespace", namespace, *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    containers = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def env_of(ctr: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in ctr.get("env", [])}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def can(
    api: Any,
    sa: str,
    sa_ns: str,
    verb: str,
    group: str,
    resource: str,
    sub: str,
    ns: str | None,
    name: str | None = None,
) -> bool:
    """A SubjectAccessReview for the ServiceAccount (the authorizer `kubectl auth can-i --as` asks)."""
    from kubernetes import client

    review = client.V1SubjectAccessReview(
        spec=client.V1SubjectAccessReviewSpec(
            user=f"system:serviceaccount:{sa_ns}:{sa}",
            groups=["system:serviceaccounts", f"system:serviceaccounts:{sa_ns}", "system:authenticated"],
            resource_attributes=client.V1ResourceAttributes(
                verb=verb, group=group, resource=resource, subresource=sub or None, namespace=ns, name=name
            ),
        )
    )
    return bool(client.AuthorizationV1Api(api).create_subject_access_review(review).status.allowed)


# ---- static checks -------------------------------------------------------------------------------
def test_chart_crd_is_the_generated_crd() -> None:
    """One source of truth: the chart's crds/ copy is byte-identical to `rljob crd`'s output."""
    generated = crd.render_crd_yaml()
    chart_copy = CHART / "crds" / crd.CRD_FILENAME
    assert chart_copy.read_text(encoding="utf-8") == generated, (
        f"{chart_copy.relative_to(REPO)} differs from the generated CRD: run `rljob crd` "
        f"and copy crds/{crd.CRD_FILENAME} there"
    )
    assert (REPO / "crds" / crd.CRD_FILENAME).read_text(encoding="utf-8") == generated


def test_chart_rules_cover_job_roles_and_stay_within_the_builder() -> None:
    """Escalation prevention: the operator must hold every rule of the per-job Role it creates; and
    the chart never grants more than `builders.rbac.operator_rules()` (the operator's own list)."""
    job_role = rule_map(rbac.build_role("job", "ns")["rules"])
    assert covers(NAMESPACED_RULES, job_role) == []
    assert covers(rule_map(rbac.operator_rules()), NAMESPACED_RULES | ONE_NAMESPACE_CLUSTER_RULES) == []
    # A negative control: without configmaps `update` the job's Role could not be created.
    narrowed = {**NAMESPACED_RULES, ("", "configmaps"): NAMESPACED_RULES[("", "configmaps")] - {"update"}}
    assert covers(narrowed, job_role) == ["core/configmaps: ['update']"]


@pytest.mark.cluster
def test_helm_lint(cluster: Any) -> None:
    for extra in (
        [],
        ["--set", "watchNamespaces={team-a}"],
        ["--set", "metrics.serviceMonitor.enabled=true"],
    ):
        result = cluster.helm("lint", "--strict", str(CHART), *extra)
        assert "0 chart(s) failed" in result.stdout, result.stdout


@pytest.mark.cluster
def test_template_all_namespaces(cluster: Any) -> None:
    docs = render(cluster)
    assert sorted(d["kind"] for d in docs) == [
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "PodDisruptionBudget",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ]
    assert all(d["metadata"]["name"].startswith("rel-rljob") for d in docs)
    check_leader_election_objects(docs, "rljob-system")
    role = one(docs, "ClusterRole")
    assert rule_map(role["rules"]) == NAMESPACED_RULES | CLUSTER_RULES
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    sa = one(docs, "ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "rljob-system"}
    ]

    deployment = one(docs, "Deployment")
    spec = deployment["spec"]
    # Two replicas, replaced one at a time; the Lease makes only one of them reconcile.
    assert spec["replicas"] == 2
    rolling = {"maxSurge": 0, "maxUnavailable": 1}
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": rolling}
    spread = spec["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = spread["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": spec["selector"]["matchLabels"]}}
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    ctr = container(docs)
    assert ctr["image"] == "ghcr.io/rljob/rljob-operator:0.1.0"
    assert [*ctr["command"], *ctr["args"]] == [
        "rljob",
        "operator",
        "--all-namespaces",
        "--liveness=http://0.0.0.0:8080/healthz",
        "--leader-election-namespace=rljob-system",
    ]
    assert ctr["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert {p["name"]: p["containerPort"] for p in ctr["ports"]} == {"healthz": 8080, "metrics": 9090}
    assert env_of(ctr)["RLJOB_METRICS_PORT"] == "9090"
    assert env_of(ctr)["RLJOB_API_THREADS"] == "48" and env_of(ctr)["RLJOB_MAX_RECONCILES"] == "48"
    assert ctr["securityContext"]["allowPrivilegeEscalation"] is False
    assert ctr["securityContext"]["capabilities"]["drop"] == ["ALL"]

    service = one(docs, "Service")
    assert service["spec"]["selector"] == spec["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"


def check_leader_election_objects(docs: list[dict[str, Any]], release_ns: str) -> None:
    """The Lease Role: in the release namespace, limited to the Lease `rljob-operator` except for
    `create` (RBAC resourceNames never restrict create), bound to the operator's ServiceAccount."""
    (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"].endswith("-leader-election")]
    (binding,) = [
        d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["name"].endswith("-leader-election")
    ]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == release_ns
    assert rule_map(role["rules"]) == LEASE_RULES
    for rule in role["rules"]:
        assert rule["verbs"] == ["create"] or rule["resourceNames"] == ["rljob-operator"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    sa = one(docs, "ServiceAccount")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": release_ns}]


@pytest.mark.cluster
def test_template_replicas(cluster: Any) -> None:
    """replicaCount 1 drops the PodDisruptionBudget (it would block every node drain); the Lease
    stays, since election is on for every replica count."""
    docs = render(cluster, "--set", "replicaCount=1")
    assert one(docs, "Deployment")["spec"]["replicas"] == 1
    assert not [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    check_leader_election_objects(docs, "rljob-system")
    assert one(render(cluster, "--set", "replicaCount=3"), "Deployment")["spec"]["replicas"] == 3


@pytest.mark.cluster
def test_template_one_namespace(cluster: Any) -> None:
    docs = render(cluster, "--set", "watchNamespaces={team-a}")
    assert sorted(d["kind"] for d in docs) == [
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "PodDisruptionBudget",
        "Role",
        "Role",
        "RoleBinding",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ]
    assert rule_map(one(docs, "ClusterRole")["rules"]) == ONE_NAMESPACE_CLUSTER_RULES
    check_leader_election_objects(docs, "rljob-system")
    docs = [d for d in docs if not d["metadata"]["name"].endswith("-leader-election")]
    role, binding = one(docs, "Role"), one(docs, "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "team-a"
    assert rule_map(role["rules"]) == NAMESPACED_RULES
    assert binding["roleRef"] == {"apiGroup": RBAC_GROUP, "kind": "Role", "name": role["metadata"]["name"]}
    assert binding["subjects"][0]["namespace"] == "rljob-system"
    assert container(docs)["args"][:2] == ["operator", "--namespace=team-a"]


@pytest.mark.cluster
def test_template_values_for_an_ascend_pool(cluster: Any, tmp_path: Path) -> None:
    values = {
        "image": {"repository": "registry.local/rljob-operator", "tag": "dev", "pullPolicy": "Always"},
        "tolerations": [{"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoSchedule"}],
        "nodeSelector": {"node-role.kubernetes.io/system": "true"},
        "priorityClassName": "system-cluster-critical",
        "operator": {"logLevel": "DEBUG"},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    }
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    docs = render(cluster, "-f", str(path))
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["tolerations"] == values["tolerations"]
    assert pod["nodeSelector"] == values["nodeSelector"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    ctr = container(docs)
    assert ctr["image"] == "registry.local/rljob-operator:dev" and ctr["imagePullPolicy"] == "Always"
    env = env_of(ctr)
    assert env["RLJOB_LOG_LEVEL"] == "DEBUG"
    monitor = one(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"

    no_metrics = render(cluster, "--set", "metrics.enabled=false")
    assert not [d for d in no_metrics if d["kind"] in ("Service", "ServiceMonitor")]
    assert env_of(container(no_metrics))["RLJOB_METRICS_PORT"] == "0"


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["--set", "watchNamespaces={a,b}"], "watches one namespace or all"),
        (["--set", "metrics.port=8080"], "metrics.port and livenessProbe.port must differ"),
        (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
        (["--set", "replicaCount=0"], "replicaCount"),
        (["--set", "operator.apiThreads=0"], "apiThreads"),
        (["--set", "operator.maxConcurrentReconciles=0"], "maxConcurrentReconciles"),
    ],
)
def test_template_rejects_bad_values(cluster: Any, values: list[str], message: str) -> None:
    result = cluster.helm("template", "rel", str(CHART), *values, check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


# ---- install on the real cluster -----------------------------------------------------------------
@contextmanager
def operator_process(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # kopf stops gracefully on SIGINT/SIGTERM
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def helm_ok(cluster: Any, *args: str) -> str:
    """Run helm; fail with its stderr (CalledProcessError alone does not show it)."""
    result = cluster.helm(*args, check=False)
    assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stderr}"
    return str(result.stdout)


def exists(cluster: Any, *args: str) -> bool:
    return cluster.kubectl("get", *args, "-o", "name", check=False).returncode == 0


@pytest.mark.cluster
@pytest.mark.parametrize("scope", ["all-namespaces", "one-namespace"])
def test_install_reconcile_uninstall(cluster: Any, namespace: str, scope: str, tmp_path: Path) -> None:
    release = f"rljob-{uuid.uuid4().hex[:6]}"  # also the full name: ClusterRoles never collide
    system_ns = cluster.create_namespace(f"{release}-system")
    nodes = cluster.add_nodes(1, name_prefix=f"{release}-cpu", resource=None, labels={"rljob.io/pool": "cpu"})
    extra = ["--set", f"watchNamespaces={{{namespace}}}"] if scope == "one-namespace" else []
    installed = False
    try:
        helm_ok(cluster, "install", release, str(CHART), "--namespace", system_ns, *extra)
        installed = True
        cluster.kubectl("wait", "--for=condition=Established", "crd/rljobs.rljob.io", "--timeout=60s")
        for obj in ("deployment", "serviceaccount", "service/" + f"{release}-metrics"):
            name = obj if "/" in obj else f"{obj}/{release}"
            assert exists(cluster, name, "-n", system_ns), name
        for obj in ("clusterrole", "clusterrolebinding"):
            assert exists(cluster, f"{obj}/{release}"), obj
        for obj in ("role", "rolebinding"):
            assert exists(cluster, f"{obj}/{release}-leader-election", "-n", system_ns), obj
        assert exists(cluster, f"poddisruptionbudget/{release}", "-n", system_ns)
        if scope == "one-namespace":
            assert exists(cluster, f"role/{release}", "-n", namespace)
            assert exists(cluster, f"rolebinding/{release}", "-n", namespace)

        check_access(cluster, release, system_ns, namespace, scope)
        run_operator_as_service_account(cluster, release, system_ns, namespace, tmp_path)

        helm_ok(cluster, "uninstall", release, "--namespace", system_ns, "--wait")
        installed = False
        leftovers = [
            obj
            for obj in (f"deployment/{release}", f"serviceaccount/{release}", f"service/{release}-metrics")
            if exists(cluster, obj, "-n", system_ns)
        ]
        leftovers += [
            obj for obj in (f"clusterrole/{release}", f"clusterrolebinding/{release}") if exists(cluster, obj)
        ]
        leftovers += [
            obj
            for obj in (f"role/{release}", f"rolebinding/{release}")
            if exists(cluster, obj, "-n", namespace)
        ]
        leftovers += [
            obj
            for obj in (f"role/{release}-leader-election", f"rolebinding/{release}-leader-election")
            if exists(cluster, obj, "-n", system_ns)
        ]
        assert leftovers == []
        # Helm keeps CRDs (and so every RLJob) on uninstall; helm/README.md says how to remove them.
        assert exists(cluster, "crd/rljobs.rljob.io")
    finally:
        if installed:
            cluster.helm("uninstall", release, "--namespace", system_ns, check=False)
        cluster.delete_nodes(nodes)
        cluster.kubectl("delete", "namespace", system_ns, "--wait=false", check=False)


def check_access(cluster: Any, release: str, system_ns: str, job_ns: str, scope: str) -> None:
    """Every rule the chart grants is effective for the ServiceAccount, and nothing on the DENIED list."""
    api = cluster.api_client()
    try:
        for (group, resource), verbs in sorted(NAMESPACED_RULES.items()):
            base, _, sub = resource.partition("/")
            for verb in sorted(verbs):
                assert can(api, release, system_ns, verb, group, base, sub, job_ns), (verb, group, resource)
        cluster_rules = ONE_NAMESPACE_CLUSTER_RULES if scope == "one-namespace" else CLUSTER_RULES
        for (group, resource), verbs in sorted(cluster_rules.items()):
            for verb in sorted(verbs):
                assert can(api, release, system_ns, verb, group, resource, "", None), (verb, group, resource)
        if scope == "all-namespaces":
            assert not can(api, release, system_ns, "list", "", "namespaces", "", None)
        for verb, group, resource, sub, namespaced in DENIED:
            ns = job_ns if namespaced else None
            what = f"{verb} {group or 'core'}/{resource}{'/' + sub if sub else ''}"
            assert not can(api, release, system_ns, verb, group, resource, sub, ns), what
        lease = ("coordination.k8s.io", "leases", "")
        assert can(api, release, system_ns, "create", *lease, system_ns)
        for verb in ("get", "update"):
            assert can(api, release, system_ns, verb, *lease, system_ns, "rljob-operator"), verb
            assert not can(api, release, system_ns, verb, *lease, system_ns, "kube-scheduler"), verb
        assert not can(api, release, system_ns, "delete", *lease, system_ns, "rljob-operator")
        assert not can(api, release, system_ns, "update", *lease, job_ns, "rljob-operator")
        # One namespace means one: the same rights elsewhere are denied.
        elsewhere = not can(api, release, system_ns, "create", "", "pods", "", "default")
        assert elsewhere is (scope == "one-namespace")
    finally:
        api.close()

    # Escalation prevention holds: the ServiceAccount cannot write a Role granting what it lacks.
    token = cluster.kubectl("create", "token", release, "-n", system_ns, "--duration=1h").stdout.strip()
    kubeconfig = cluster.token_kubeconfig(token, f"{release}-sa")
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "wants-secrets", "namespace": job_ns},
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}],
    }
    result = cluster.kubectl(
        "--kubeconfig", str(kubeconfig), "create", "-f", "-", input=json.dumps(role), check=False
    )
    assert result.returncode != 0 and "permissions not currently held" in result.stderr, result.stderr


def run_operator_as_service_account(
    cluster: Any, release: str, system_ns: str, job_ns: str, tmp_path: Path
) -> None:
    """The installed Deployment's command, args and env, with the ServiceAccount's token only."""
    deployment = json.loads(
        cluster.kubectl("get", f"deployment/{release}", "-n", system_ns, "-o", "json").stdout
    )
    ctr = deployment["spec"]["template"]["spec"]["containers"][0]
    live_port, metrics_port = free_port(), free_port()
    args = [
        f"--liveness=http://127.0.0.1:{live_port}/healthz" if a.startswith("--liveness=") else a
        for a in ctr["args"]
    ]
    assert ctr["command"] == ["rljob"]
    argv = [str(Path(sys.executable).parent / "rljob"), *args]
    token = cluster.kubectl("create", "token", release, "-n", system_ns, "--duration=1h").stdout.strip()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "RLJOB_"))}
    env.update(env_of(ctr))
    env.update(
        KUBECONFIG=str(cluster.token_kubeconfig(token, f"{release}-operator")),
        RLJOB_METRICS_PORT=str(metrics_port),
        RLJOB_RECONCILE_INTERVAL_S="1",  # test pace; the chart's 10 s would only slow the test
    )
    job_ns_flag = ["-n", job_ns]
    log = tmp_path / "operator.log"
    with operator_process(argv, env, log) as proc:
        try:
            cluster.kubectl("apply", *job_ns_flag, "-f", str(EXAMPLE))

            def both_pods() -> list[str]:
                """The job's pods once both are there: the operator creates them one call each, and a
                CI run read the list between the two."""
                if proc.poll() is not None:
                    return ["operator exited"]
                got = cluster.kubectl(
                    "get", "pods", *job_ns_flag, "-l", "rljob.io/job=tiny-cpu", "-o", "name", check=False
                ).stdout.split()
                return got if len(got) >= 2 else []

            pods = wait_for("the operator to create tiny-cpu's pods", both_pods, 60, interval_s=0.5)
            assert sorted(pods) == ["pod/tiny-cpu-trainer-0", "pod/tiny-cpu-trainer-1"]
            for obj in (
                "serviceaccount/tiny-cpu",
                "role/tiny-cpu",
                "rolebinding/tiny-cpu",
                "service/tiny-cpu",
                "configmap/tiny-cpu-config",
                "configmap/tiny-cpu-telemetry",
                "networkpolicy/tiny-cpu",
            ):
                assert exists(cluster, obj, *job_ns_flag), obj
            # The Ray token Secret exists (created under the chart's create-only grant), named by
            # the job's uid; the chart's metrics namespace may scrape the driver's port.
            uid = cluster.kubectl(
                "get", "rljob/tiny-cpu", *job_ns_flag, "-o", "jsonpath={.metadata.uid}"
            ).stdout
            assert exists(cluster, f"secret/tiny-cpu-ray-auth-{uid[:8]}", *job_ns_flag)
            fence = json.loads(
                cluster.kubectl("get", "networkpolicy/tiny-cpu", *job_ns_flag, "-o", "json").stdout
            )
            sources = [peer for rule in fence["spec"]["ingress"] for peer in rule["from"]]
            monitoring = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
            assert {"namespaceSelector": monitoring} in sources
            wait_for(
                "a status phase",
                lambda: (
                    cluster.kubectl(
                        "get", "rljob/tiny-cpu", *job_ns_flag, "-o", "jsonpath={.status.phase}"
                    ).stdout
                ),
                30,
                interval_s=0.5,
            )
            with urllib.request.urlopen(f"http://127.0.0.1:{live_port}/healthz", timeout=5) as rsp:
                assert rsp.status == 200
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as rsp:
                assert b"rljob_" in rsp.read()
            cluster.kubectl("delete", "rljob/tiny-cpu", *job_ns_flag, "--wait=true", "--timeout=30s")
        finally:
            assert proc.poll() is None, f"the operator exited:\n{log.read_text()[-4000:]}"
    text = log.read_text()
    # A Forbidden anywhere (kopf retries, falls back, or drops an Event) means a missing rule. The
    # one exception is not about RBAC: in all-namespaces mode the operator may meet RLJobs of
    # earlier tests whose namespaces are being deleted, where every create is refused.
    markers = ("Forbidden", "forbidden", " 403", "Not enough permissions", "Failed to post")
    records = re.split(r"\n(?=\[\d{4}-\d\d-\d\d )", text)  # one log record may span lines
    suspicious = [
        record
        for record in records
        if any(m in record for m in markers) and "because it is being terminated" not in record
    ]
    assert suspicious == [], "\n".join(suspicious)


@pytest.mark.cluster
def test_uninstall_then_delete_everything_does_not_hang(cluster: Any, tmp_path: Path) -> None:
    """helm install, create jobs, helm uninstall as helm/README.md says, then delete the RLJobs and
    the CRD: both finish in under 60 s, because no RLJob carries a finalizer an operator must remove."""
    release = f"rljob-{uuid.uuid4().hex[:6]}"
    system_ns = cluster.create_namespace(f"{release}-system")
    job_ns = cluster.create_namespace(f"{release}-jobs")
    nodes = cluster.add_nodes(1, name_prefix=f"{release}-cpu", resource=None, labels={"rljob.io/pool": "cpu"})
    try:
        helm_ok(cluster, "install", release, str(CHART), "--namespace", system_ns)
        cluster.kubectl("wait", "--for=condition=Established", "crd/rljobs.rljob.io", "--timeout=60s")
        deployment = json.loads(
            cluster.kubectl("get", f"deployment/{release}", "-n", system_ns, "-o", "json").stdout
        )
        ctr = deployment["spec"]["template"]["spec"]["containers"][0]
        token = cluster.kubectl("create", "token", release, "-n", system_ns, "--duration=1h").stdout.strip()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "RLJOB_"))}
        env.update(env_of(ctr))
        env.update(
            KUBECONFIG=str(cluster.token_kubeconfig(token, f"{release}-operator")),
            RLJOB_METRICS_PORT=str(free_port()),
            RLJOB_RECONCILE_INTERVAL_S="1",
        )
        args = [a for a in ctr["args"] if not a.startswith("--liveness=")]
        argv = [str(Path(sys.executable).parent / "rljob"), *args]
        with operator_process(argv, env, tmp_path / "operator.log"):
            for name in ("one", "two"):
                doc = yaml.safe_load(EXAMPLE.read_text())
                doc["metadata"]["name"] = name
                cluster.kubectl("apply", "-n", job_ns, "-f", "-", input=yaml.safe_dump(doc))
            for name in ("one", "two"):

                def phase(n: str = name) -> str:
                    return str(
                        cluster.kubectl(
                            "get", f"rljob/{n}", "-n", job_ns, "-o", "jsonpath={.status.phase}"
                        ).stdout
                    )

                wait_for(f"{name} reconciled", phase, 60)
            time.sleep(3)  # several resyncs: nothing adds a finalizer later either
            finalizers = cluster.kubectl(
                "get", "rljobs", "-n", job_ns, "-o", "jsonpath={.items[*].metadata.finalizers}"
            ).stdout.strip()
            assert finalizers == "", finalizers
        # The operator is gone, as after the Deployment's deletion.
        helm_ok(cluster, "uninstall", release, "--namespace", system_ns, "--wait")
        started = time.monotonic()
        cluster.kubectl("delete", "rljobs", "--all", "-n", job_ns, "--timeout=60s")
        cluster.kubectl("delete", "crd", "rljobs.rljob.io", "--timeout=60s")
        assert time.monotonic() - started < 60
        assert not exists(cluster, "crd/rljobs.rljob.io")
    finally:
        cluster.helm("uninstall", release, "--namespace", system_ns, check=False)
        cluster.delete_nodes(nodes)
        for ns in (system_ns, job_ns):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        # Later tests in this session expect the CRD: put it back.
        cluster.kubectl(
            "apply", "--server-side", "-f", str(REPO / "crds" / "rljobs.rljob.io.yaml"), check=False
        )
        cluster.kubectl(
            "wait", "--for=condition=Established", "crd/rljobs.rljob.io", "--timeout=60s", check=False
        )

"""The real Kueue manager on the local control plane, for tests and `python -m testenv up --kueue`.

Called by the `kueue` pytest fixture (`tests/conftest.py`) and by `python -m testenv serve --kueue`.
`start_kueue(cluster)` installs, from the same Kueue module version the binary was built from
(`tests/testenv/kueue/go.mod`, see `testenv.binaries.ensure_kueue`):

- the CRDs of `config/components/crd` (with the conversion webhooks its kustomization enables),
- the ServiceAccount `kueue-system/kueue-controller-manager`, which Kueue then runs as (never as
  admin), and every role `config/components/rbac`'s kustomization binds to it (the manager's
  ClusterRole, its Secrets and leader-election Roles, metrics authentication),
  plus `kueue-rljob-reader` (get, list, watch RLJobs: the external framework's objects),
- the webhook configurations of `config/components/webhook/manifests.yaml` for Kueue's own API
  (ClusterQueue, LocalQueue, Workload, ResourceFlavor, Cohort, ...),

and starts `kueue --config=...` as a child of the cluster (its log joins `cluster.logs()`).

Webhooks are served the way envtest serves them: every client config is a URL to the manager's
webhook server on 127.0.0.1 with a `caBundle` of a CA generated here (`pki.create_loopback_serving_pki`),
since the apiserver cannot reach a Service without kube-proxy. Kueue's internal cert management is
off (it would issue certificates for `kueue-webhook-service.kueue-system.svc`, a name nothing
resolves here). With it off, `cmd/kueue/main.go` reads a metrics serving pair from the hard-coded
path `/etc/kueue/metrics/certs`, where a Deployment mounts a Secret. Here the manager runs in a
private mount namespace (`unshare --mount`) in which our generated pair is bind-mounted onto that
path; the host only ever gets the empty mount point.

Configuration (`config.kueue.x-k8s.io/v1beta2`): no built-in job integration (`frameworks: []`,
so none of Kueue's Job/Pod/Deployment webhooks intercept the cluster's other objects),
`externalFrameworks: ["RLJob.v1alpha1.rljob.io"]` (the operator creates RLJobs' Workloads),
leader election off (one manager), every port free on loopback. The on-demand visibility API
(feature gate VisibilityOnDemand) is off: it is an aggregated API server that needs its own
certificate at the hard-coded path `/visibility` and an APIService; admission does not use it.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from testenv import binaries, pki
from testenv.cluster import LocalCluster, free_port

NAMESPACE = "kueue-system"
SERVICE_ACCOUNT = "kueue-controller-manager"
# kustomize's namePrefix in Kueue's config/default.
NAME_PREFIX = "kueue-"
EXTERNAL_FRAMEWORKS = ["RLJob.v1alpha1.rljob.io"]
KUEUE_GROUP = "kueue.x-k8s.io"
# Hard-coded in sigs.k8s.io/kueue cmd/kueue/main.go when internal cert management is off.
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")
FEATURE_GATES = "VisibilityOnDemand=false"


@dataclass
class Kueue:
    """A running Kueue manager on a LocalCluster."""

    cluster: LocalCluster
    workdir: Path
    webhook_port: int
    health_port: int

    def log(self) -> str:
        """The manager's log so far."""
        component = next(c for c in self.cluster.components if c.name == "kueue")
        return component.log_path.read_text(errors="replace")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz", timeout=2) as rsp:
                return rsp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomization_patches(directory: Path) -> list[Path]:
    """The patch files a kustomization.yaml enables (commented-out ones are not in the YAML)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return [directory / p["path"] for p in kustomization.get("patches", []) if "path" in p]


def crd_manifests(config: Path, webhook_base: str, ca_bundle: str) -> list[dict[str, Any]]:
    """Kueue's CRDs, with each conversion webhook its kustomization enables pointed at `webhook_base`."""
    crd_dir = config / "crd"
    kustomization = yaml.safe_load((crd_dir / "kustomization.yaml").read_text())
    crds = {d["metadata"]["name"]: d for r in kustomization["resources"] for d in _docs(crd_dir / r)}
    for patch_path in _kustomization_patches(crd_dir):
        patch = _docs(patch_path)[0]
        conversion = patch["spec"]["conversion"]
        webhook = conversion["webhook"]
        path = webhook["clientConfig"]["service"]["path"]
        webhook["clientConfig"] = {"url": f"{webhook_base}{path}", "caBundle": ca_bundle}
        crds[patch["metadata"]["name"]]["spec"]["conversion"] = conversion
    return list(crds.values())


def rbac_manifests(config: Path) -> list[dict[str, Any]]:
    """The manager's ServiceAccount and every Role/ClusterRole its kustomization binds to it (the
    manager's own rules, its Secrets role, metrics auth, ...), renamed as config/default does;
    the aggregated editor/viewer roles meant for users are left out."""
    rbac_dir = config / "rbac"
    kustomization = yaml.safe_load((rbac_dir / "kustomization.yaml").read_text())
    docs = [d for r in kustomization["resources"] for d in _docs(rbac_dir / r)]
    bindings = [
        d
        for d in docs
        if d["kind"] in ("RoleBinding", "ClusterRoleBinding")
        and any(s.get("name") == "controller-manager" for s in d.get("subjects", []))
    ]
    bound_roles = {(b["roleRef"]["kind"], b["roleRef"]["name"]) for b in bindings}
    wanted = [d for d in docs if d["kind"] == "ServiceAccount"] + bindings
    wanted += [d for d in docs if (d["kind"], d["metadata"]["name"]) in bound_roles]
    out: list[dict[str, Any]] = []
    for doc in wanted:
        doc["metadata"]["name"] = NAME_PREFIX + doc["metadata"]["name"]
        if doc["kind"] in ("ServiceAccount", "Role", "RoleBinding"):
            doc["metadata"]["namespace"] = NAMESPACE
        if "roleRef" in doc:
            doc["roleRef"]["name"] = NAME_PREFIX + doc["roleRef"]["name"]
        for subject in doc.get("subjects", []):
            subject["name"] = NAME_PREFIX + subject["name"]
            subject["namespace"] = NAMESPACE
        out.append(doc)
    # RLJobs are an external framework: Kueue never reconciles them, but it reads a Workload's
    # controller owner when it walks an ownership chain (jobframework.FindAncestorJobManagedByKueue),
    # and controller-runtime's client reads through a cache, which lists and watches the type.
    rljob_reader = f"{NAME_PREFIX}rljob-reader"
    out += [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": rljob_reader},
            "rules": [
                {"apiGroups": ["rljob.io"], "resources": ["rljobs"], "verbs": ["get", "list", "watch"]}
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": rljob_reader},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": rljob_reader},
            "subjects": [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}],
        },
    ]
    return out


def _touches_kueue_api(webhook: dict[str, Any]) -> bool:
    return any(KUEUE_GROUP in rule.get("apiGroups", []) for rule in webhook.get("rules", []))


def webhook_manifests(config: Path, webhook_base: str, ca_bundle: str) -> list[dict[str, Any]]:
    """Kueue's mutating and validating webhooks for its own API, as URL client configs."""
    out = []
    for doc in _docs(config / "webhook" / "manifests.yaml"):
        doc["metadata"]["name"] = NAME_PREFIX + doc["metadata"]["name"]
        hooks = [w for w in doc["webhooks"] if _touches_kueue_api(w)]
        for hook in hooks:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"{webhook_base}{path}", "caBundle": ca_bundle}
        doc["webhooks"] = hooks
        out.append(doc)
    return out


def manager_configuration(
    *, webhook_port: int, health_port: int, metrics_port: int, cert_dir: Path
) -> dict[str, Any]:
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "clientConnection": {"qps": 50, "burst": 100},
        "integrations": {"frameworks": [], "externalFrameworks": EXTERNAL_FRAMEWORKS},
    }


def _apply(cluster: LocalCluster, docs: Iterable[dict[str, Any]]) -> None:
    cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump_all(list(docs))
    )


class KueueUnavailable(RuntimeError):
    """This machine cannot run the Kueue manager as testenv runs it (the message says why and the fix)."""


def check_mount_namespace() -> None:
    """Raise KueueUnavailable unless `unshare --mount` works here and the mount point exists."""
    if shutil.which("unshare") is None:
        raise KueueUnavailable("Kueue needs `unshare` (util-linux) to mount its metrics certificate")
    try:
        METRICS_CERT_DIR.mkdir(parents=True, exist_ok=True)
    except PermissionError as exc:
        raise KueueUnavailable(
            f"Kueue reads its metrics certificate from {METRICS_CERT_DIR} (hard-coded in cmd/kueue); "
            f"create the empty mount point once: sudo mkdir -p {METRICS_CERT_DIR}"
        ) from exc
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        raise KueueUnavailable(
            "Kueue runs in a private mount namespace (`unshare --mount`), which needs root here: "
            f"{probe.stderr.strip()}"
        )


def _launcher(certs: pki.ServingPki, argv: list[str]) -> list[str]:
    """`argv` in a private mount namespace where the metrics pair sits at METRICS_CERT_DIR."""
    check_mount_namespace()
    script = 'mount --bind "$0" "$1" && shift && exec "$@"'  # $0: source, $1: target
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        script,
        str(certs.cert.parent),
        str(METRICS_CERT_DIR),
        *argv,
    ]


def start_kueue(cluster: LocalCluster, timeout_s: float = 120) -> Kueue:
    """Install Kueue's CRDs, RBAC and webhooks on `cluster` and run its manager as a cluster child."""
    build = binaries.ensure_kueue()  # a first build takes minutes: not part of the readiness wait
    deadline = time.monotonic() + timeout_s
    config = build / "config" / "components"
    workdir = cluster.workdir / "kueue"
    certs = pki.create_loopback_serving_pki(workdir / "certs", "kueue-webhook")
    ca_bundle = _b64(certs.ca_cert.read_bytes())
    webhook_port, health_port, metrics_port = free_port(), free_port(), free_port()
    webhook_base = f"https://127.0.0.1:{webhook_port}"

    if cluster.get_json("namespace", NAMESPACE) is None:
        cluster.kubectl("create", "namespace", NAMESPACE)
    _apply(cluster, crd_manifests(config, webhook_base, ca_bundle))
    _apply(cluster, rbac_manifests(config))
    cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s",
        *(f"crd/{d['metadata']['name']}" for d in crd_manifests(config, webhook_base, ca_bundle)),
    )  # fmt: skip
    token = cluster.kubectl(
        "create", "token", SERVICE_ACCOUNT, "-n", NAMESPACE, "--duration=48h"
    ).stdout.strip()
    kubeconfig = cluster.token_kubeconfig(token, "kueue-controller-manager")
    config_path = workdir / "controller_manager_config.yaml"
    config_path.write_text(
        yaml.safe_dump(
            manager_configuration(
                webhook_port=webhook_port,
                health_port=health_port,
                metrics_port=metrics_port,
                cert_dir=certs.cert.parent,
            )
        )
    )
    argv = [
        str(build / "kueue"),
        f"--config={config_path}",
        f"--kubeconfig={kubeconfig}",
        f"--feature-gates={FEATURE_GATES}",
        f"--visibility-server-port={free_port()}",
    ]
    cluster.start_component("kueue", _launcher(certs, argv))
    kueue = Kueue(cluster, workdir, webhook_port, health_port)
    while not kueue.ready():
        cluster.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"Kueue not ready after {timeout_s}s\n{cluster.logs()}")
        time.sleep(0.3)
    # The webhooks go in only now: with failurePolicy Fail they would refuse every Kueue object
    # while the manager is still starting.
    _apply(cluster, webhook_manifests(config, webhook_base, ca_bundle))
    return kueue


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def queue_manifests(
    *,
    namespace: str,
    flavor: str = "default-flavor",
    cluster_queue: str = "cluster-queue",
    local_queue: str = "user-queue",
    quota: dict[str, str] | None = None,
    node_labels: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """A ResourceFlavor, a ClusterQueue with `quota` of it, and a LocalQueue in `namespace`."""
    quota = quota or {"cpu": "8", "memory": "32Gi"}
    flavor_spec: dict[str, Any] = {"nodeLabels": node_labels} if node_labels else {}
    return [
        {
            "apiVersion": f"{KUEUE_GROUP}/v1beta2",
            "kind": "ResourceFlavor",
            "metadata": {"name": flavor},
            "spec": flavor_spec,
        },
        {
            "apiVersion": f"{KUEUE_GROUP}/v1beta2",
            "kind": "ClusterQueue",
            "metadata": {"name": cluster_queue},
            "spec": {
                "namespaceSelector": {},
                "resourceGroups": [
                    {
                        "coveredResources": sorted(quota),
                        "flavors": [
                            {
                                "name": flavor,
                                "resources": [
                                    {"name": name, "nominalQuota": value}
                                    for name, value in sorted(quota.items())
                                ],
                            }
                        ],
                    }
                ],
            },
        },
        {
            "apiVersion": f"{KUEUE_GROUP}/v1beta2",
            "kind": "LocalQueue",
            "metadata": {"name": local_queue, "namespace": namespace},
            "spec": {"clusterQueue": cluster_queue},
        },
    ]

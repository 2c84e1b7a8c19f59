"""A real Kubernetes control plane on loopback, for tests and for the local demo.

Called by the pytest fixtures in `tests/conftest.py`, by `python -m testenv` (the cluster a person
uses by hand) and by the benchmarks. It runs, as child processes of the caller:

- etcd (built from go.etcd.io/etcd/server/v3),
- kube-apiserver with RBAC, client-certificate auth for an admin and ServiceAccount token signing,
- kube-controller-manager (garbage collector, ReplicaSet, ServiceAccount, node lifecycle, ...),
- kube-scheduler,

on free loopback ports with a private temporary folder, so parallel test runs never collide.
Fake accelerator nodes are plain Node objects that `testenv.fakelet` keeps Ready; it also plays
the kubelet's part for pods bound to them (Running, Failed on request, final deletion), and on
local-exec nodes (`add_nodes(exec_local=True)`) runs their pods as processes on this machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from testenv import binaries, fakelet, local_exec, pki
from testenv.waiting import wait_for

SERVICE_CIDR = "10.96.0.0/16"


# Local-exec accelerator nodes: pods bound there run as processes on this machine, and `ray start`
# in them advertises exactly the pod's GPUs/NPUs to Ray while torch runs on CPU (the test kubelet
# sets rljob_trainer.config.ENV_TEST_CPU_STANDIN). So every Ray placement decision of a GPU or NPU
# job runs for real here. `python -m testenv up` and the `local_accelerator_nodes` fixture add them.
LOCAL_ACCELERATOR_POOLS: list[dict[str, Any]] = [
    {
        "count": 2,
        "name_prefix": "gpu-local",
        "resource": "nvidia.com/gpu",
        "per_node": 4,
        "labels": {"rljob.io/pool": "gpu-local"},
        "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
        "cpu": "64",
        "memory": "512Gi",
        "exec_local": True,
    },
    {
        "count": 1,
        "name_prefix": "npu-local",
        "resource": "huawei.com/Ascend910",
        "per_node": 4,
        "labels": {"rljob.io/pool": "npu-local"},
        "taints": [{"key": "huawei.com/Ascend910", "value": "present", "effect": "NoSchedule"}],
        "cpu": "64",
        "memory": "512Gi",
        "exec_local": True,
    },
]


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Component:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(text[-lines:])


# Pod Security admission (built into kube-apiserver): a namespace labelled `enforce: restricted`
# refuses any pod that could run as root, escalate privileges, keep capabilities or skip seccomp.
POD_SECURITY_ENFORCE = "pod-security.kubernetes.io/enforce"
POD_SECURITY_RESTRICTED = "restricted"


def restricted(pod_spec: dict[str, Any]) -> dict[str, Any]:
    """`pod_spec` with what the `restricted` level asks of every pod and container, for the tests'
    own raw pods (the operator's pods carry their own, builders.pods)."""
    out = {**pod_spec, "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                           "seccompProfile": {"type": "RuntimeDefault"}}}  # fmt: skip
    out["containers"] = [
        {**c, "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}
        for c in pod_spec["containers"]
    ]
    return out


@dataclass
class LocalCluster:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler, and a fake kubelet."""

    workdir: Path
    bins: dict[str, Path] = field(default_factory=dict)
    node_monitor_grace_period_s: int = 60
    # The controllers' client rate limit (kube-controller-manager --kube-api-qps, burst twice it;
    # None: its default, 20/s). The node lifecycle controller lifts each new node's not-ready taint
    # through it: at 20/s a thousand nodes registered together stay unschedulable for ~4 minutes.
    controller_api_qps: int | None = None
    # Feature gates for apiserver, controller-manager and scheduler (e.g. "GenericWorkload=true"),
    # and API groups to serve beyond the defaults (e.g. "scheduling.k8s.io/v1beta1=true").
    feature_gates: tuple[str, ...] = ()
    runtime_config: tuple[str, ...] = ()
    components: list[Component] = field(default_factory=list)
    kubelet: fakelet.FakeKubelet | None = None
    owns_workdir: bool = False

    @classmethod
    def create(cls, workdir: Path | None = None, **kwargs: Any) -> LocalCluster:
        owns = workdir is None
        path = Path(tempfile.mkdtemp(prefix="rljob-cluster-")) if workdir is None else workdir
        path.mkdir(parents=True, exist_ok=True)
        return cls(workdir=path, bins=binaries.ensure_all(), owns_workdir=owns, **kwargs)

    # ---- paths and clients -------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against this cluster; raise with its stderr when `check` fails."""
        return self._run([str(self.bins["kubectl"]), *args], input=input, check=check, timeout=timeout)

    def apply_crds(self, path: str | Path, crd: str = "rljobs.rljob.io", timeout_s: float = 90) -> None:
        """Server-side apply the CRD manifest(s) at `path` and wait until `crd` is Established.

        `kubectl wait` right after the apply can fail at once ("not found") on a loaded machine, so
        the wait is retried until `timeout_s`.
        """
        self.kubectl("apply", "--server-side", "-f", str(path))
        wait_for(
            f"the CRD {crd} Established",
            lambda: (
                self.kubectl(
                    "wait", "--for=condition=Established", f"crd/{crd}", "--timeout=30s", check=False
                ).returncode
                == 0
            ),
            timeout_s,
            interval_s=1.0,
        )

    def get_json(self, *what: str, namespace: str | None = None, check: bool = False) -> Any:
        """`kubectl get WHAT -o json` parsed; None when it fails (e.g. not found) unless `check`."""
        scope = ("-n", namespace) if namespace else ()
        result = self.kubectl("get", *scope, *what, "-o", "json", check=check)
        return json.loads(result.stdout) if result.returncode == 0 else None

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        env = {
            "HELM_CACHE_HOME": str(self.workdir / "helm" / "cache"),
            "HELM_CONFIG_HOME": str(self.workdir / "helm" / "config"),
            "HELM_DATA_HOME": str(self.workdir / "helm" / "data"),
        }
        return self._run([str(self.bins["helm"]), *args], check=check, timeout=timeout, env=env)

    def _run(
        self,
        argv: Sequence[str],
        *,
        input: str | None = None,
        check: bool,
        timeout: float,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        full_env = dict(os.environ, KUBECONFIG=str(self.kubeconfig), **(env or {}))
        result = subprocess.run(
            list(argv), input=input, capture_output=True, text=True, timeout=timeout, env=full_env
        )
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(
                result.returncode, list(argv), output=result.stdout, stderr=result.stderr
            )
        return result

    def api_client(self) -> Any:
        """A kubernetes.client.ApiClient authenticated as the admin."""
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=configuration)
        return client.ApiClient(configuration)

    def logs(self, lines: int = 60) -> str:
        parts = [
            f"===== {c.name} (last {lines} lines of {c.log_path}) =====\n{c.tail(lines)}"
            for c in self.components
        ]
        return "\n".join(parts)

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout_s: float = 120) -> LocalCluster:
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        certs = pki.create_pki(self.workdir / "pki")
        self.etcd_port, etcd_peer_port = free_port(), free_port()
        self.apiserver_port = free_port()
        self._spawn(
            "etcd",
            [
                str(self.bins["etcd"]),
                "--name=default",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{etcd_peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer_port}",
                f"--initial-cluster=default=http://127.0.0.1:{etcd_peer_port}",
                # Tests throw the data away; fsync only slows the shared disk down.
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        _wait_http(f"http://127.0.0.1:{self.etcd_port}/health", deadline, "etcd")
        self._spawn(
            "kube-apiserver",
            [
                str(self.bins["kube-apiserver"]),
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.apiserver_port}",
                f"--cert-dir={self.workdir / 'pki'}",
                f"--tls-cert-file={certs.serving_cert}",
                f"--tls-private-key-file={certs.serving_key}",
                f"--client-ca-file={certs.ca_cert}",
                f"--service-account-key-file={certs.sa_pub}",
                f"--service-account-signing-key-file={certs.sa_key}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=RBAC",
                # Fake nodes' Hostname addresses do not resolve; their kubelet (logs) is on 127.0.0.1.
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                "--allow-privileged=false",
                "--endpoint-reconciler-type=none",
                *self._gate_flags(),
                *([f"--runtime-config={','.join(self.runtime_config)}"] if self.runtime_config else []),
                "--v=1",
            ],
        )
        ssl_context = ssl.create_default_context(cafile=str(certs.ca_cert))
        ssl_context.load_cert_chain(str(certs.admin_cert), str(certs.admin_key))
        _wait_http(f"{self.server}/readyz", deadline, "kube-apiserver", ssl_context)
        self._write_kubeconfig(certs)
        controller_port, scheduler_port = free_port(), free_port()
        self._spawn(
            "kube-controller-manager",
            [
                str(self.bins["kube-controller-manager"]),
                f"--kubeconfig={self.kubeconfig}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={controller_port}",
                f"--cert-dir={self.workdir / 'controller-manager'}",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={certs.sa_key}",
                f"--root-ca-file={certs.ca_cert}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                f"--node-monitor-grace-period={self.node_monitor_grace_period_s}s",
                "--concurrent-gc-syncs=10",
                *self._controller_rate_flags(),
                *self._gate_flags(),
                "--v=1",
            ],
        )
        self._spawn(
            "kube-scheduler",
            [
                str(self.bins["kube-scheduler"]),
                f"--kubeconfig={self.kubeconfig}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={scheduler_port}",
                f"--cert-dir={self.workdir / 'scheduler'}",
                "--leader-elect=false",
                *self._gate_flags(),
                "--v=1",
            ],
        )
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        _wait_http(
            f"https://127.0.0.1:{controller_port}/healthz", deadline, "kube-controller-manager", insecure
        )
        _wait_http(f"https://127.0.0.1:{scheduler_port}/healthz", deadline, "kube-scheduler", insecure)
        self._wait_default_service_account("default", deadline)
        self.kubelet = fakelet.FakeKubelet(self.api_client(), log_dir=self.workdir / "pod-logs")
        self.kubelet.start()

    def _controller_rate_flags(self) -> list[str]:
        if self.controller_api_qps is None:
            return []
        qps = self.controller_api_qps
        return [f"--kube-api-qps={qps}", f"--kube-api-burst={2 * qps}"]

    def _gate_flags(self) -> list[str]:
        return [f"--feature-gates={','.join(self.feature_gates)}"] if self.feature_gates else []

    def _spawn(self, name: str, argv: list[str]) -> Component:
        log_path = self.workdir / f"{name}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - owned by the child for its lifetime
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        component = Component(name, process, log_path)
        self.components.append(component)
        return component

    def start_component(self, name: str, argv: list[str]) -> Component:
        """Run one more component (e.g. Kueue, `testenv.kueue`) as this cluster's child: its log
        joins `logs()`, `check_alive()` watches it and `stop()` ends it before the control plane."""
        return self._spawn(name, argv)

    def check_alive(self) -> None:
        """Raise, with its log tail, if any component has exited."""
        self._check_alive()

    def _write_kubeconfig(self, certs: pki.Pki) -> None:
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "rljob-local",
                    "cluster": {"server": self.server, "certificate-authority": str(certs.ca_cert)},
                }
            ],
            "users": [
                {
                    "name": "admin",
                    "user": {"client-certificate": str(certs.admin_cert), "client-key": str(certs.admin_key)},
                }
            ],
            "contexts": [{"name": "rljob-local", "context": {"cluster": "rljob-local", "user": "admin"}}],
            "current-context": "rljob-local",
        }
        self.kubeconfig.write_text(yaml.safe_dump(kubeconfig))

    def token_kubeconfig(self, token: str, name: str) -> Path:
        """A kubeconfig that authenticates with `token` only (e.g. a ServiceAccount's), never as admin."""
        path = self.workdir / f"{name}.kubeconfig"
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "rljob-local",
                    "cluster": {
                        "server": self.server,
                        "certificate-authority": str(self.workdir / "pki" / "ca.crt"),
                    },
                }
            ],
            "users": [{"name": name, "user": {"token": token}}],
            "contexts": [{"name": name, "context": {"cluster": "rljob-local", "user": name}}],
            "current-context": name,
        }
        path.write_text(yaml.safe_dump(kubeconfig))
        return path

    def _wait_default_service_account(self, namespace: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            self._check_alive()
            if self.kubectl("get", "serviceaccount", "default", "-n", namespace, check=False).returncode == 0:
                return
            time.sleep(0.2)
        raise TimeoutError(
            f"no default ServiceAccount in {namespace}: is the controller-manager up?\n{self.logs()}"
        )

    def _check_alive(self) -> None:
        for component in self.components:
            if component.process.poll() is not None:
                raise RuntimeError(
                    f"{component.name} exited with {component.process.returncode}\n{component.tail(80)}"
                )

    def stop(self) -> None:
        if self.kubelet is not None:
            self.kubelet.stop()
            self.kubelet = None
        for component in reversed(self.components):
            _terminate(component.process)
        self.components.clear()
        if self.owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- namespaces and fake accelerator nodes -----------------------------------------------

    def create_namespace(
        self, name: str, timeout_s: float = 30, *, pod_security: str | None = POD_SECURITY_RESTRICTED
    ) -> str:
        """A namespace whose pods the apiserver's Pod Security admission holds to `pod_security`
        (`restricted` by default, as a shared cluster's tenant namespaces are; None: no label)."""
        self.kubectl("create", "namespace", name)
        if pod_security:
            self.kubectl("label", "namespace", name, f"{POD_SECURITY_ENFORCE}={pod_security}")
        self._wait_default_service_account(name, time.monotonic() + timeout_s)
        return name

    def add_nodes(
        self,
        count: int,
        *,
        name_prefix: str = "gpu",
        resource: str | None = "nvidia.com/gpu",
        per_node: int = 8,
        labels: dict[str, str] | None = None,
        taints: list[dict[str, str]] | None = None,
        cpu: str = "96",
        memory: str = "1Ti",
        pods: int = 110,
        exec_local: bool = False,
    ) -> list[str]:
        """Create `count` Ready nodes with an accelerator capacity, like a GPU or NPU pool.

        `exec_local`: pods bound there really run, as processes on this machine (label
        `rljob.io/local-exec: "true"`; see `testenv.fakelet`), for end-to-end runs."""
        if self.kubelet is None:
            raise RuntimeError("the cluster is not started")
        names = [f"{name_prefix}-{i}" for i in range(count)]
        node_labels = dict(labels or {})
        if exec_local:
            node_labels[local_exec.LOCAL_EXEC_LABEL] = "true"
        for name in names:
            self.kubelet.register_node(
                fakelet.node_manifest(
                    name,
                    resource=resource,
                    per_node=per_node,
                    labels=node_labels,
                    taints=taints or [],
                    cpu=cpu,
                    memory=memory,
                    pods=pods,
                )
            )
        return names

    def add_local_accelerator_nodes(self) -> list[str]:
        """Register gpu-local-0/1 and npu-local-0 (`LOCAL_ACCELERATOR_POOLS`); idempotent."""
        names: list[str] = []
        for pool in LOCAL_ACCELERATOR_POOLS:
            names += self.add_nodes(**pool)
        return names

    def delete_nodes(self, names: Sequence[str]) -> None:
        if self.kubelet is not None:
            for name in names:
                self.kubelet.unregister_node(name)

    def fail_pod(self, namespace: str, name: str, exit_code: int = 1) -> None:
        """Make a pod on a fake node fail, as if its container had exited with `exit_code`."""
        if self.kubelet is None:
            raise RuntimeError("the cluster is not started")
        self.kubelet.fail_pod(namespace, name, exit_code)

    def pod_log(self, namespace: str, name: str) -> str:
        """stdout+stderr of a pod that ran on a local-exec node ("" if it never ran there)."""
        if self.kubelet is None:
            raise RuntimeError("the cluster is not started")
        return self.kubelet.pod_log(namespace, name)

    def succeed_pod(self, namespace: str, name: str) -> None:
        if self.kubelet is None:
            raise RuntimeError("the cluster is not started")
        self.kubelet.fail_pod(namespace, name, 0)


def _wait_http(url: str, deadline: float, what: str, context: ssl.SSLContext | None = None) -> None:
    last_error = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, ssl.SSLError) as error:
            last_error = str(error)
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready at {url}: {last_error}")


def _terminate(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


@contextlib.contextmanager
def running_cluster(workdir: Path | None = None) -> Iterator[LocalCluster]:
    cluster = LocalCluster.create(workdir)
    with cluster:
        yield cluster

"""A fake kubelet for fake accelerator nodes: our small stand-in for KWOK.

Called by `testenv.cluster.LocalCluster`. For each node it registers it:
- keeps the node Ready the way a kubelet does, by renewing its Lease in `kube-node-lease`, so the
  real node-lifecycle controller in kube-controller-manager never taints it unreachable;
- plays the kubelet's part for pods the real scheduler binds to it: marks them Running (with
  Ready conditions, container statuses and a pod IP; never Ready with a readiness probe, which
  nothing running here could pass), finishes graceful deletions (a kubelet
  confirms a pod's deletion with grace period 0; without that a deleted pod would stay
  Terminating forever), and on request ends a pod as Failed or Succeeded with an exit code;
- refuses to start what a kubelet cannot start, with the kubelet's waiting reasons and messages:
  a missing Secret/ConfigMap (or key) behind an env var is `CreateContainerConfigError`
  (`secret "x" not found`, `couldn't find key k in Secret ns/x`); an image marked unpullable
  (`mark_image_unpullable`, or any image on a `*.invalid` host) is `ErrImagePull`, then
  `ImagePullBackOff`; the pod starts once the cause is gone, as a kubelet's retries do.

Nodes labelled `rljob.io/local-exec: "true"` run their pods as processes on this machine: see
`testenv.local_exec` (and `testenv.local_services` for their ports, Services, DNS names and
readiness probes; restartPolicy Always restarts a container there after the kubelet's back-off,
CrashLoopBackOff meanwhile).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from testenv import kubelet_logs, local_exec, local_services
from testenv.local_exec import LOCAL_EXEC_LABEL, LocalPod, _has_started, _now, _rfc3339, accelerator_resources

LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_S = 40
LEASE_RENEW_S = 10.0
POD_CIDR = ipaddress.ip_network("10.244.0.0/16")
UNPULLABLE_HOST_SUFFIX = ".invalid"  # RFC 6761: never resolves, so a real pull fails the same way
IMAGE_PULL_BACKOFF_AFTER_S = 4.0  # the first pull fails, then the kubelet backs off
BLOCKED_RECHECK_S = 2.0

log = logging.getLogger(__name__)


def _probes_readiness(pod: Any) -> bool:
    """Whether a container of `pod` has a readiness probe (only a running server can pass it)."""
    return any(c.readiness_probe is not None for c in pod.spec.containers)


def node_manifest(
    name: str,
    *,
    resource: str | None,
    per_node: int,
    labels: dict[str, str],
    taints: list[dict[str, str]],
    cpu: str,
    memory: str,
    pods: int,
) -> dict[str, Any]:
    """A Node as a kubelet would register it, with `per_node` units of `resource` (e.g. nvidia.com/gpu)."""
    capacity = {"cpu": cpu, "memory": memory, "pods": str(pods), "ephemeral-storage": "1Ti"}
    if resource:
        capacity[resource] = str(per_node)
    heartbeat = _rfc3339(_now())
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "rljob.io/fake-node": "true",
                **labels,
            },
        },
        "spec": {"taints": taints},
        "status": {
            "capacity": capacity,
            "allocatable": dict(capacity),
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "fake kubelet is posting ready status",
                    "lastHeartbeatTime": heartbeat,
                    "lastTransitionTime": heartbeat,
                },
                *[
                    {
                        "type": kind,
                        "status": "False",
                        "reason": f"KubeletHasNo{kind}",
                        "message": "",
                        "lastHeartbeatTime": heartbeat,
                        "lastTransitionTime": heartbeat,
                    }
                    for kind in ("MemoryPressure", "DiskPressure", "PIDPressure")
                ],
            ],
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": name},
            ],
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": "v1.37.2-fake",
                "containerRuntimeVersion": "fake://1",
                "kernelVersion": "",
                "osImage": "fake",
                "machineID": name,
                "systemUUID": name,
                "bootID": name,
                "kubeProxyVersion": "",
            },
        },
    }


class FakeKubelet(local_exec.LocalExecPods):
    """Keeps registered nodes Ready and drives the lifecycle of pods bound to them."""

    def __init__(self, api_client: Any, *, python: str | None = None, log_dir: Path | None = None) -> None:
        self._api_client = api_client
        self._core = client.CoreV1Api(api_client)
        self._coordination = client.CoordinationV1Api(api_client)
        self._nodes: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._next_ip = 10
        # local-exec nodes and their pods
        self._python = python or sys.executable
        self._exec_nodes: set[str] = set()
        self._accelerator_exec_nodes: set[str] = set()
        self._local: dict[str, LocalPod] = {}  # by pod uid
        self._by_name: dict[tuple[str, str], LocalPod] = {}  # (namespace, name) -> latest pod
        self._job_ports: dict[tuple[str, str], int] = {}
        # (namespace, Service, port) -> the proxy forwarding it to ready local pods (local_services)
        self._service_proxies: dict[tuple[str, str, int], local_services.ServiceProxy | None] = {}
        # (namespace, pod name, container port) -> the port of this machine it listens on (local_services)
        self._pod_ports: dict[tuple[str, str, int], int] = {}
        self._root: Path | None = None
        self._seq = 0
        self._log_dir = log_dir  # `<namespace>_<pod>.log` there (appended to across pod restarts)
        self._unpullable: set[str] = set()  # images whose pull fails (plus any on a *.invalid host)
        self._blocked: set[str] = set()  # uids of pods waiting to start (their recheck loop runs)
        # The kubelet's /containerLogs endpoint (`kubectl logs`), one for every node of this kubelet.
        self._logs = kubelet_logs.KubeletLogServer(self._log_of)

    # ---- nodes ---------------------------------------------------------------------------------

    def register_node(self, manifest: dict[str, Any]) -> None:
        name = manifest["metadata"]["name"]
        manifest["status"].setdefault("daemonEndpoints", {"kubeletEndpoint": {"Port": self._logs.port}})
        # Node status is writable on create, as a kubelet registering itself does.
        try:
            self._core.create_node(manifest)
        except ApiException as error:
            if error.status != 409:
                raise
            self._core.patch_node_status(name, {"status": manifest["status"]})
        local_exec = manifest["metadata"].get("labels", {}).get(LOCAL_EXEC_LABEL) == "true"
        with self._lock:
            self._nodes.add(name)
            if local_exec:
                self._exec_nodes.add(name)
                if accelerator_resources(manifest):
                    self._accelerator_exec_nodes.add(name)
        self._renew_lease(name)

    def unregister_node(self, name: str) -> None:
        with self._lock:
            self._nodes.discard(name)
            self._exec_nodes.discard(name)
            self._accelerator_exec_nodes.discard(name)
        with contextlib.suppress(ApiException):
            self._core.delete_node(name)
        with contextlib.suppress(ApiException):
            self._coordination.delete_namespaced_lease(name, LEASE_NAMESPACE)

    def _renew_lease(self, name: str) -> None:
        now = _now().strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": name, "namespace": LEASE_NAMESPACE},
            "spec": {"holderIdentity": name, "leaseDurationSeconds": LEASE_DURATION_S, "renewTime": now},
        }
        try:
            self._coordination.patch_namespaced_lease(name, LEASE_NAMESPACE, {"spec": body["spec"]})
        except ApiException as error:
            if error.status != 404:
                raise
            with contextlib.suppress(ApiException):
                self._coordination.create_namespaced_lease(LEASE_NAMESPACE, body)

    def _lease_loop(self) -> None:
        while not self._stop.wait(LEASE_RENEW_S):
            with self._lock:
                names = sorted(self._nodes)
            for name in names:
                try:
                    self._renew_lease(name)
                except Exception:  # keep heartbeating the others; the next round retries
                    log.exception("renewing the lease of node %s", name)

    # ---- pods ----------------------------------------------------------------------------------

    def _owns(self, pod: Any) -> bool:
        with self._lock:
            return bool(pod.spec.node_name) and pod.spec.node_name in self._nodes

    def _pod_ip(self) -> str:
        with self._lock:
            self._next_ip += 1
            return str(POD_CIDR[self._next_ip % (POD_CIDR.num_addresses - 2) + 1])

    def _handle(self, pod: Any) -> None:
        if not self._owns(pod):
            return
        if pod.metadata.deletion_timestamp is None and self._hold_if_blocked(pod):
            return
        with self._lock:
            local_exec = pod.spec.node_name in self._exec_nodes
        if local_exec:
            self._handle_local(pod)
            return
        name, namespace = pod.metadata.name, pod.metadata.namespace
        if pod.metadata.deletion_timestamp is not None:
            # A kubelet confirms the deletion once containers stopped: grace period 0 removes it.
            with contextlib.suppress(ApiException):
                self._core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
            return
        phase = pod.status.phase if pod.status else None
        if phase in (None, "Pending") and not _has_started(pod):
            # Nothing runs here, so a readiness probe never passes: Running, never Ready.
            self._set_running(pod, ready=not _probes_readiness(pod))

    # ---- what stops a container from starting, as a kubelet reports it ---------------------------

    def mark_image_unpullable(self, image: str) -> None:
        """Pulls of `image` fail from now on (ErrImagePull, then ImagePullBackOff), as from a registry
        that does not have it; images on a `*.invalid` host always fail."""
        with self._lock:
            self._unpullable.add(image)

    def _image_error(self, image: str) -> str | None:
        host = image.split("/", 1)[0] if "/" in image else ""
        with self._lock:
            marked = image in self._unpullable
        if marked or host.split(":", 1)[0].endswith(UNPULLABLE_HOST_SUFFIX):
            return (
                f'failed to pull and unpack image "{image}": failed to resolve reference "{image}": '
                f"failed to do request: dial tcp: lookup {host or 'docker.io'}: no such host"
            )
        return None

    def _config_error(self, pod: Any, container: Any) -> str | None:
        """The kubelet's CreateContainerConfigError message for a missing env source, or None."""
        namespace = pod.metadata.namespace
        for var in container.env or []:
            source = var.value_from
            if source is None:
                continue
            for ref, kind, read in (
                (source.config_map_key_ref, "ConfigMap", self._core.read_namespaced_config_map),
                (source.secret_key_ref, "Secret", self._core.read_namespaced_secret),
            ):
                if ref is None or ref.optional:
                    continue
                try:
                    data = read(ref.name, namespace).data or {}
                except ApiException as error:
                    if error.status == 404:
                        return f'{kind.lower()} "{ref.name}" not found'
                    raise
                if ref.key not in data:
                    return f"couldn't find key {ref.key} in {kind} {namespace}/{ref.name}"
        for env_from in container.env_from or []:
            for ref, kind, read in (
                (env_from.config_map_ref, "ConfigMap", self._core.read_namespaced_config_map),
                (env_from.secret_ref, "Secret", self._core.read_namespaced_secret),
            ):
                if ref is None or ref.optional:
                    continue
                try:
                    read(ref.name, namespace)
                except ApiException as error:
                    if error.status == 404:
                        return f'{kind.lower()} "{ref.name}" not found'
                    raise
        return None

    def _start_blocker(self, pod: Any, *, backoff: bool) -> tuple[str, str, str] | None:
        """(container, waiting reason, message) of the first container that cannot start, or None."""
        for container in pod.spec.containers:
            pull = self._image_error(container.image or "")
            if pull is not None:
                if backoff:
                    return (
                        container.name,
                        "ImagePullBackOff",
                        f'Back-off pulling image "{container.image}": {pull}',
                    )
                return container.name, "ErrImagePull", pull
            config = self._config_error(pod, container)
            if config is not None:
                return container.name, "CreateContainerConfigError", config
        return None

    def _hold_if_blocked(self, pod: Any) -> bool:
        """Keep a pod that cannot start Pending with the kubelet's waiting reason; True when held.

        A kubelet retries: the recheck loop starts the pod once its image pulls and its Secrets and
        ConfigMaps exist, and moves ErrImagePull to ImagePullBackOff as a kubelet's back-off does.
        """
        if _has_started(pod) and not self._is_blocked(pod.metadata.uid):
            return False
        blocker = self._start_blocker(pod, backoff=False)
        if blocker is None:
            return False
        with self._lock:
            if pod.metadata.uid in self._blocked:
                return True
            self._blocked.add(pod.metadata.uid)
        self._set_waiting(pod, *blocker)
        self._spawn_thread(self._recheck_blocked, pod, name=f"fakelet-blocked-{pod.metadata.name}")
        return True

    def _is_blocked(self, uid: str) -> bool:
        with self._lock:
            return uid in self._blocked

    def _recheck_blocked(self, pod: Any) -> None:
        started = time.monotonic()
        namespace, name, uid = pod.metadata.namespace, pod.metadata.name, pod.metadata.uid
        try:
            while not self._stop.wait(BLOCKED_RECHECK_S):
                try:
                    fresh = self._core.read_namespaced_pod(name, namespace)
                except ApiException:
                    return
                if fresh.metadata.uid != uid or fresh.metadata.deletion_timestamp is not None:
                    return
                backoff = time.monotonic() - started >= IMAGE_PULL_BACKOFF_AFTER_S
                blocker = self._start_blocker(fresh, backoff=backoff)
                if blocker is None:
                    with self._lock:
                        self._blocked.discard(uid)
                    self._clear_waiting(fresh)
                    return
                self._set_waiting(fresh, *blocker)
        finally:
            with self._lock:
                self._blocked.discard(uid)

    def _clear_waiting(self, pod: Any) -> None:
        """The blocker is gone: start the pod as if it had just been bound here."""
        with self._lock:
            local_exec = pod.spec.node_name in self._exec_nodes
        if local_exec:
            self._handle_local(pod, resume=True)
        else:
            self._set_running(pod, ready=not _probes_readiness(pod))

    def _set_waiting(self, pod: Any, container_name: str, reason: str, message: str) -> None:
        now = _rfc3339(_now())
        statuses = [
            {
                "name": c.name,
                "image": c.image or "",
                "imageID": "",
                "ready": False,
                "started": False,
                "restartCount": 0,
                "state": {
                    "waiting": {"reason": reason, "message": message}
                    if c.name == container_name
                    else {"reason": "PodInitializing"}
                },
            }
            for c in pod.spec.containers
        ]
        not_ready = {"status": "False", "reason": "ContainersNotReady", "lastTransitionTime": now}
        body = {
            "status": {
                "phase": "Pending",
                "conditions": [
                    {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                    {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                    {"type": "ContainersReady", **not_ready},
                    {"type": "Ready", **not_ready},
                ],
                "containerStatuses": statuses,
                "hostIP": "127.0.0.1",
                "startTime": now,
            }
        }
        with contextlib.suppress(ApiException):
            self._core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, body)

    def _set_running(
        self,
        pod: Any,
        *,
        ip: str | None = None,
        container_id: str = "fake",
        ready: bool = True,
        restart_count: int = 0,
        last_state: dict[str, Any] | None = None,
        started_at: str | None = None,
    ) -> None:
        """Running; `ready` False while a readiness probe has not passed (ContainersNotReady), and
        `restart_count`/`last_state` for a container the kubelet restarted (restartPolicy Always)."""
        now = _rfc3339(_now())
        conditions = [
            {"type": kind, "status": "True", "lastTransitionTime": now}
            for kind in ("PodReadyToStartContainers", "Initialized", "PodScheduled")
        ]
        conditions += [
            {"type": kind, "status": "True", "lastTransitionTime": now}
            if ready
            else {"type": kind, "status": "False", "reason": "ContainersNotReady", "lastTransitionTime": now}
            for kind in ("ContainersReady", "Ready")
        ]
        statuses = [
            {
                "name": c.name,
                "image": c.image or "",
                "imageID": f"fake://{c.image}",
                "ready": ready,
                "started": True,
                "restartCount": restart_count,
                "containerID": f"{container_id}://{pod.metadata.uid}/{c.name}",
                "state": {"running": {"startedAt": started_at or now}},
                **({"lastState": last_state} if last_state else {}),
            }
            for c in pod.spec.containers
        ]
        ip = ip or self._pod_ip()
        body = {
            "status": {
                "phase": "Running",
                "conditions": conditions,
                "containerStatuses": statuses,
                "hostIP": "127.0.0.1",
                "hostIPs": [{"ip": "127.0.0.1"}],
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "startTime": now,
            }
        }
        with contextlib.suppress(ApiException):
            self._core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, body)

    def _set_back_off(
        self, pod: Any, *, restart_count: int, last_state: dict[str, Any], back_off_s: float
    ) -> None:
        """A container restartPolicy Always brings back, waiting out its restart back-off: phase Running,
        CrashLoopBackOff with the kubelet's message, the last run in lastState."""
        now = _rfc3339(_now())
        name, namespace, uid = pod.metadata.name, pod.metadata.namespace, pod.metadata.uid
        statuses = [
            {
                "name": c.name,
                "image": c.image or "",
                "imageID": f"fake://{c.image}",
                "ready": False,
                "started": False,
                "restartCount": restart_count,
                "state": {
                    "waiting": {
                        "reason": "CrashLoopBackOff",
                        "message": f"back-off {back_off_s:.0f}s restarting failed container={c.name} "
                        f"pod={name}_{namespace}({uid})",
                    }
                },
                "lastState": last_state,
            }
            for c in pod.spec.containers
        ]
        not_ready = {"status": "False", "reason": "ContainersNotReady", "lastTransitionTime": now}
        body = {
            "status": {
                "phase": "Running",
                "conditions": [{"type": "ContainersReady", **not_ready}, {"type": "Ready", **not_ready}],
                "containerStatuses": statuses,
            }
        }
        with contextlib.suppress(ApiException):
            self._core.patch_namespaced_pod_status(name, namespace, body)

    def fail_pod(self, namespace: str, name: str, exit_code: int, message: str | None = None) -> None:
        """End a pod's containers with `exit_code`: phase Failed, or Succeeded for 0; `message` is
        what the container wrote to its termination-message file."""
        pod = self._core.read_namespaced_pod(name, namespace)
        self._set_terminated(pod, exit_code, message=message)

    def _set_terminated(
        self,
        pod: Any,
        exit_code: int,
        *,
        started_at: str | None = None,
        container_id: str = "fake",
        message: str | None = None,
        evicted: str | None = None,
    ) -> None:
        """End the pod with `exit_code`; `evicted`: the kubelet's eviction message (the pod's
        status then has reason Evicted and that message, as `evictPod` writes them)."""
        name, namespace = pod.metadata.name, pod.metadata.namespace
        now = _rfc3339(_now())
        reason = "Completed" if exit_code == 0 else "Error"
        terminated: dict[str, Any] = {
            "exitCode": exit_code,
            "reason": reason,
            "startedAt": started_at or now,
            "finishedAt": now,
        }
        if message:
            terminated["message"] = message[-4096:]
        statuses = [
            {
                "name": c.name,
                "image": c.image or "",
                "imageID": f"fake://{c.image}",
                "ready": False,
                "started": False,
                "restartCount": 0,
                "containerID": f"{container_id}://{pod.metadata.uid}/{c.name}",
                "state": {"terminated": dict(terminated)},
            }
            for c in pod.spec.containers
        ]
        conditions = [
            {
                "type": kind,
                "status": "False",
                "reason": "PodCompleted" if exit_code == 0 else "PodFailed",
                "lastTransitionTime": now,
            }
            for kind in ("ContainersReady", "Ready")
        ]
        body: dict[str, Any] = {
            "status": {
                "phase": "Succeeded" if exit_code == 0 else "Failed",
                "containerStatuses": statuses,
                "conditions": conditions,
            }
        }
        if evicted:
            body["status"].update(reason="Evicted", message=evicted)
        self._core.patch_namespaced_pod_status(name, namespace, body)

    def _pod_loop(self) -> None:
        resource_version: str | None = None
        while not self._stop.is_set():
            try:
                if resource_version is None:
                    listing = self._core.list_pod_for_all_namespaces(field_selector="spec.nodeName!=")
                    for pod in listing.items:
                        self._handle(pod)
                    resource_version = listing.metadata.resource_version
                stream = watch.Watch()
                for event in stream.stream(
                    self._core.list_pod_for_all_namespaces,
                    field_selector="spec.nodeName!=",
                    resource_version=resource_version,
                    timeout_seconds=5,
                    allow_watch_bookmarks=True,
                ):
                    if self._stop.is_set():
                        stream.stop()
                        break
                    pod = event["object"]
                    if event["type"] == "ERROR" or isinstance(pod, dict):
                        # An ERROR event (e.g. 410 Gone as a status object): list again.
                        resource_version = None
                        stream.stop()
                        break
                    resource_version = pod.metadata.resource_version
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._handle(pod)
            except ApiException as error:
                if error.status == 410:  # the watch window expired: list again
                    resource_version = None
                elif not self._stop.is_set():
                    log.warning("fake kubelet watch error: %s", error)
                    self._stop.wait(0.5)
            except Exception:
                if not self._stop.is_set():
                    log.exception("fake kubelet pod loop")
                    resource_version = None
                    self._stop.wait(0.5)

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._logs.start()
        for target, name in ((self._lease_loop, "fakelet-leases"), (self._pod_loop, "fakelet-pods")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        self._logs.stop()
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads.clear()
        self._stop_local_pods()
        self._close_service_proxies()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

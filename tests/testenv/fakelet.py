"""A fake kubelet for fake accelerator nodes: our small stand-in for KWOK.

Called by `testenv.cluster.LocalCluster`. For each node it registers it:
- keeps the node Ready the way a kubelet does, by renewing its Lease in `kube-node-lease`, so the
  real node-lifecycle controller in kube-controller-manager never taints it unreachable;
- plays the kubelet's part for pods the real scheduler binds to it: marks them Running (with
  Ready conditions, container statuses and a pod IP), finishes graceful deletions (a kubelet
  confirms a pod's deletion with grace period 0; without that a deleted pod would stay
  Terminating forever), and on request ends a pod as Failed or Succeeded with an exit code.
Nothing here runs containers.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import threading
from typing import Any

from kubernetes import client, watch
from kubernetes.client.rest import ApiException

LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_S = 40
LEASE_RENEW_S = 10.0
POD_CIDR = ipaddress.ip_network("10.244.0.0/16")

log = logging.getLogger(__name__)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _rfc3339(moment: datetime.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


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


class FakeKubelet:
    """Keeps registered nodes Ready and drives the lifecycle of pods bound to them."""

    def __init__(self, api_client: Any) -> None:
        self._core = client.CoreV1Api(api_client)
        self._coordination = client.CoordinationV1Api(api_client)
        self._nodes: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._next_ip = 10

    # ---- nodes ---------------------------------------------------------------------------------

    def register_node(self, manifest: dict[str, Any]) -> None:
        name = manifest["metadata"]["name"]
        # Node status is writable on create, as a kubelet registering itself does.
        try:
            self._core.create_node(manifest)
        except ApiException as error:
            if error.status != 409:
                raise
            self._core.patch_node_status(name, {"status": manifest["status"]})
        with self._lock:
            self._nodes.add(name)
        self._renew_lease(name)

    def unregister_node(self, name: str) -> None:
        with self._lock:
            self._nodes.discard(name)
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
        name, namespace = pod.metadata.name, pod.metadata.namespace
        if pod.metadata.deletion_timestamp is not None:
            # A kubelet confirms the deletion once containers stopped: grace period 0 removes it.
            with contextlib.suppress(ApiException):
                self._core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
            return
        phase = pod.status.phase if pod.status else None
        if phase in (None, "Pending") and not (pod.status and pod.status.container_statuses):
            self._set_running(pod)

    def _set_running(self, pod: Any) -> None:
        now = _rfc3339(_now())
        conditions = [
            {"type": kind, "status": "True", "lastTransitionTime": now}
            for kind in (
                "PodReadyToStartContainers",
                "Initialized",
                "ContainersReady",
                "Ready",
                "PodScheduled",
            )
        ]
        statuses = [
            {
                "name": c.name,
                "image": c.image or "",
                "imageID": f"fake://{c.image}",
                "ready": True,
                "started": True,
                "restartCount": 0,
                "containerID": f"fake://{pod.metadata.uid}/{c.name}",
                "state": {"running": {"startedAt": now}},
            }
            for c in pod.spec.containers
        ]
        ip = self._pod_ip()
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

    def fail_pod(self, namespace: str, name: str, exit_code: int) -> None:
        """End a pod's containers with `exit_code`: phase Failed, or Succeeded for 0."""
        pod = self._core.read_namespaced_pod(name, namespace)
        now = _rfc3339(_now())
        reason = "Completed" if exit_code == 0 else "Error"
        statuses = [
            {
                "name": c.name,
                "image": c.image or "",
                "imageID": f"fake://{c.image}",
                "ready": False,
                "started": False,
                "restartCount": 0,
                "containerID": f"fake://{pod.metadata.uid}/{c.name}",
                "state": {
                    "terminated": {
                        "exitCode": exit_code,
                        "reason": reason,
                        "startedAt": now,
                        "finishedAt": now,
                    }
                },
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
        body = {
            "status": {
                "phase": "Succeeded" if exit_code == 0 else "Failed",
                "containerStatuses": statuses,
                "conditions": conditions,
            }
        }
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
        for target, name in ((self._lease_loop, "fakelet-leases"), (self._pod_loop, "fakelet-pods")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads.clear()

"""The Kubernetes API edge: a thin async wrapper over the synchronous `kubernetes` client.

Role: the only place that issues requests; `rljob_operator.handlers` holds one `Kube` per running
operator (kopf memo). Calls run in a thread pool, never block the event loop, and are counted in
`metrics.API_REQUESTS` / `metrics.API_ERRORS`. Idempotence lives here: `create` treats 409
AlreadyExists and `delete_*` treat 404 NotFound as success; readers return None for 404. Deletes
of a pod or an RLJob carry `preconditions.uid` (the object the decision was about, never a
namesake created since: 409 means "not that one any more"), and status writes carry the
resourceVersion they were computed from (409 Conflict: re-read, `reconcile.steps`). What an API
error tells the caller's backoff (`retry_after_s`, `is_api_error`) is read here too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import kubernetes
import urllib3
from kubernetes.client.rest import ApiException

from rljob_operator import api, names
from rljob_operator.builders import podgroup, workload
from rljob_operator.kube import kubeclient, metrics

#: Threads of the API pool (`RLJOB_API_THREADS`, chart `operator.apiThreads`). At 500 RLJobs
#: created at once (bench/operator_scale.py) 16 threads made each call wait 0.40 s for a thread, four
#: times its own 0.12 s, and create -> all pods took p99 3.45 s; 48 cut the wait to 0.02 s (p99 1.74 s).
API_THREADS = int(os.environ.get("RLJOB_API_THREADS", "48"))
#: The API pool serves waiting calls in this order: what makes a job run (pod and child creates,
#: deletes, reads) before status writes, and Events last (`PriorityPool`).
PRIORITY_WORK, PRIORITY_STATUS, PRIORITY_EVENT = 0, 1, 2
KUEUE_GROUP, KUEUE_VERSION = workload.GROUP, workload.VERSION
POD_GROUP_API = podgroup.API_VERSION  # native gang scheduling (Kubernetes 1.37, GenericWorkload)


def is_conflict(exc: BaseException) -> bool:
    """409 Conflict: a failed precondition (uid, resourceVersion), or a name already taken."""
    return isinstance(exc, ApiException) and exc.status == 409


def is_api_error(exc: BaseException) -> bool:
    """An error the apiserver (or the way to it) returned: what a job's backoff is for."""
    return isinstance(exc, ApiException | urllib3.exceptions.HTTPError)


def retry_after_s(exc: BaseException) -> float | None:
    """The seconds a 429 Too Many Requests (or a 503) asks the client to wait (its Retry-After
    header, in seconds as the apiserver's priority-and-fairness sends it), else None."""
    if not isinstance(exc, ApiException) or exc.status not in (429, 503):
        return None
    value = (exc.headers or {}).get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else None
    except (TypeError, ValueError):
        return None  # an HTTP date: the backoff's own delay applies


def priority_of(verb: str, kind: str) -> int:
    """Events last, RLJob status writes before them, everything else (creates, deletes, reads) first."""
    if kind == "Event":
        return PRIORITY_EVENT
    if kind == "RLJob" and verb == "patch":
        return PRIORITY_STATUS
    return PRIORITY_WORK


class PriorityPool:
    """`threads` worker threads that run submitted calls most urgent first, in order among equals.

    A thread pool for the synchronous kubernetes client: when 500 jobs start together, a job's
    pod creates do not wait behind the other jobs' status writes and Events."""

    _STOP = (math.inf, math.inf, None, None)

    def __init__(self, threads: int, name: str = "rljob-api") -> None:
        self._queue: queue.PriorityQueue[tuple[float, float, Any, Any]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, priority: int, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Queue `fn`; after `shutdown` this raises, as ThreadPoolExecutor does, since no thread
        would ever run it (a caller awaiting it would hang, and the operator with it)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new API calls after the pool shut down")
            self._queue.put((priority, next(self._order), (fn, time.monotonic()), future))
        return future

    def _work(self) -> None:
        while True:
            _, _, item, future = self._queue.get()
            if item is None:
                return
            fn, queued = item
            if not future.set_running_or_notify_cancel():
                continue
            started = time.monotonic()
            metrics.API_QUEUE_SECONDS.observe(started - queued)
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the awaiting coroutine
                future.set_exception(exc)
            finally:
                metrics.API_REQUEST_SECONDS.observe(time.monotonic() - started)

    def shutdown(self) -> None:
        """Stop the threads once the calls queued so far have run; later `submit`s raise."""
        with self._lock:
            self._closed = True
            for _ in self._threads:
                self._queue.put(self._STOP)


class Kube:
    """Thin async wrapper over the synchronous `kubernetes` client (calls run in a thread pool).

    Counts every request in `metrics.API_REQUESTS` and every failure in `metrics.API_ERRORS`;
    `create` treats 409 AlreadyExists and `delete` treats 404 NotFound as success.
    """

    def __init__(self, client: kubernetes.client.ApiClient, executor: PriorityPool) -> None:
        self.client = client
        self.executor = executor
        self.core = kubernetes.client.CoreV1Api(client)
        self.rbac = kubernetes.client.RbacAuthorizationV1Api(client)
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.networking = kubernetes.client.NetworkingV1Api(client)
        self._creators: dict[str, Callable[..., Any]] = {
            "Pod": self.core.create_namespaced_pod,
            "Service": self.core.create_namespaced_service,
            "ConfigMap": self.core.create_namespaced_config_map,
            "ServiceAccount": self.core.create_namespaced_service_account,
            "Role": self.rbac.create_namespaced_role,
            "RoleBinding": self.rbac.create_namespaced_role_binding,
            "Secret": self.core.create_namespaced_secret,
            "NetworkPolicy": self.networking.create_namespaced_network_policy,
            "Event": self.core.create_namespaced_event,
            "Workload": self._create_workload,
            "PodGroup": self._create_pod_group,
        }
        self.scheduling = kubernetes.client.SchedulingV1Api(client)
        # The children `foreign_owner` may find left by an earlier RLJob of the same name.
        self._readers: dict[str, Callable[..., Any]] = {
            "Service": self.core.read_namespaced_service,
            "ConfigMap": self.core.read_namespaced_config_map,
            "ServiceAccount": self.core.read_namespaced_service_account,
            "Role": self.rbac.read_namespaced_role,
            "RoleBinding": self.rbac.read_namespaced_role_binding,
            "NetworkPolicy": self.networking.read_namespaced_network_policy,
        }

    @classmethod
    def from_environment(cls) -> Kube:
        """KUBECONFIG (or ~/.kube/config) when present, else the in-cluster ServiceAccount."""
        cfg = kubeclient.load_configuration()  # $KUBECONFIG read now, not at import time
        cfg.connection_pool_maxsize = API_THREADS * 2
        return cls(kubernetes.client.ApiClient(cfg), PriorityPool(API_THREADS))

    def close(self) -> None:
        self.executor.shutdown()
        self.client.close()

    async def call(self, verb: str, kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn(*args, **kwargs)` without deserializing the response; returns the decoded JSON.

        Served in `priority_of(verb, kind)` order when the pool is busy."""
        metrics.API_REQUESTS.labels(verb, kind).inc()

        def invoke() -> Any:
            resp = fn(*args, _preload_content=False, **kwargs)
            data = resp.data
            return json.loads(data) if data else None

        try:
            return await asyncio.wrap_future(self.executor.submit(priority_of(verb, kind), invoke))
        except ApiException as exc:
            if not ((verb == "create" and exc.status == 409) or (verb == "delete" and exc.status == 404)):
                metrics.API_ERRORS.labels(verb, kind, str(exc.status)).inc()
            raise

    async def create(self, obj: dict[str, Any]) -> bool:
        """Create `obj`; True when created, False when it already existed."""
        kind = obj["kind"]
        try:
            await self.call("create", kind, self._creators[kind], obj["metadata"]["namespace"], obj)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def foreign_owner(self, obj: dict[str, Any]) -> str | None:
        """After a create that found `obj`'s name taken: the existing object's controller uid when it
        is not `obj`'s owner (an earlier RLJob of the same name left it; "" for none: an orphan, or
        gone meanwhile), else None. Only read: the chart grants no delete on these kinds, and the
        garbage collector deletes what an earlier RLJob owned."""
        meta = obj["metadata"]
        kind, namespace, name = obj["kind"], meta["namespace"], meta["name"]
        if kind == "Secret":
            # Never read (no `get` on Secrets is granted): its name holds the RLJob's uid
            # (`names.ray_auth_secret_name`, `names.endpoint_secret_name`), so a name taken is this job's own.
            return None
        want = names.controller_uid(meta)
        try:
            current = await self.call("get", kind, self._readers[kind], name, namespace)
        except ApiException as exc:
            if exc.status == 404:  # gone meanwhile: the next create makes ours
                return ""
            raise
        have = names.controller_uid((current or {}).get("metadata") or {})
        if want is None or have == want:
            return None
        return have or ""

    async def delete_pod(self, namespace: str, name: str, uid: str | None = None) -> bool:
        """Delete pod `name`, only if it is still the one with `uid` (when given); True when deleted."""
        body = (
            kubernetes.client.V1DeleteOptions(preconditions=kubernetes.client.V1Preconditions(uid=uid))
            if uid
            else None
        )
        try:
            await self.call("delete", "Pod", self.core.delete_namespaced_pod, name, namespace, body=body)
        except ApiException as exc:
            if exc.status == 404 or (uid and is_conflict(exc)):
                return False  # gone, or a new pod of that name: not the one to delete
            raise
        return True

    async def read_config_map(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.call("get", "ConfigMap", self.core.read_namespaced_config_map, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def apply_config_map(self, obj: dict[str, Any]) -> None:
        """Create the ConfigMap, or replace its data when it differs (spec change)."""
        if await self.create(obj):
            return
        meta = obj["metadata"]
        current = await self.read_config_map(meta["namespace"], meta["name"])
        if current is not None and current.get("data") == obj["data"]:
            return
        await self.call(
            "patch",
            "ConfigMap",
            self.core.patch_namespaced_config_map,
            meta["name"],
            meta["namespace"],
            {"data": obj["data"]},
        )

    async def patch_status(
        self, namespace: str, name: str, patch: dict[str, Any], resource_version: str | None = None
    ) -> dict[str, Any] | None:
        """Merge-patch the RLJob's status; returns the RLJob as stored after the patch. With
        `resource_version`, only if the RLJob is still at it (else ApiException 409 Conflict)."""
        body: dict[str, Any] = {"status": patch}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        return await self.call(
            "patch",
            "RLJob",
            self.custom.patch_namespaced_custom_object_status,
            api.GROUP,
            api.VERSION,
            namespace,
            api.PLURAL,
            name,
            body,
        )

    async def delete_rljob(self, namespace: str, name: str, uid: str | None = None) -> None:
        """Delete the RLJob (its children follow, in the background), only if it is still the one
        with `uid`: a job recreated under the same name since is not the one whose TTL ran out."""
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            await self.call(
                "delete",
                "RLJob",
                self.custom.delete_namespaced_custom_object,
                api.GROUP,
                api.VERSION,
                namespace,
                api.PLURAL,
                name,
                body=body,
            )
        except ApiException as exc:
            if exc.status != 404 and not (uid and is_conflict(exc)):
                raise

    async def _read(self, kind: str, fn: Callable[..., Any], *args: Any) -> dict[str, Any] | None:
        try:
            return await self.call("get", kind, fn, *args)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def read_rljob(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The RLJob as stored now: handlers re-read it inside the job's lock (kopf's body may be stale)."""
        return await self._read(
            "RLJob",
            self.custom.get_namespaced_custom_object,
            api.GROUP,
            api.VERSION,
            namespace,
            api.PLURAL,
            name,
        )

    # ---- Kueue (kueue.x-k8s.io/v1beta2): Workloads, ResourceFlavors, WorkloadPriorityClasses ----
    def _create_workload(self, namespace: str, body: dict[str, Any], **kwargs: Any) -> Any:
        return self.custom.create_namespaced_custom_object(
            KUEUE_GROUP, KUEUE_VERSION, namespace, "workloads", body, **kwargs
        )

    async def delete_workload(self, namespace: str, name: str) -> bool:
        try:
            await self.call(
                "delete",
                "Workload",
                self.custom.delete_namespaced_custom_object,
                KUEUE_GROUP,
                KUEUE_VERSION,
                namespace,
                "workloads",
                name,
                body={"propagationPolicy": "Background"},
            )
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def read_workload(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._read(
            "Workload",
            self.custom.get_namespaced_custom_object,
            KUEUE_GROUP,
            KUEUE_VERSION,
            namespace,
            "workloads",
            name,
        )

    async def read_kueue_object(self, plural: str, name: str) -> dict[str, Any] | None:
        """A cluster-scoped Kueue object (resourceflavors, workloadpriorityclasses), None if absent."""
        return await self._read(
            plural, self.custom.get_cluster_custom_object, KUEUE_GROUP, KUEUE_VERSION, plural, name
        )

    async def read_priority_class(self, name: str) -> dict[str, Any] | None:
        return await self._read("PriorityClass", self.scheduling.read_priority_class, name)

    async def apply_workload_status(self, body: dict[str, Any], field_manager: str) -> None:
        """Server-side apply to a Workload's status subresource as `field_manager` (force: the
        fields it names are ours), the way Kueue writes each of its conditions."""
        meta = body["metadata"]
        await self.call(
            "apply",
            "Workload",
            self.custom.patch_namespaced_custom_object_status,
            KUEUE_GROUP,
            KUEUE_VERSION,
            meta["namespace"],
            "workloads",
            meta["name"],
            body,
            field_manager=field_manager,
            force=True,
            _content_type="application/apply-patch+yaml",
        )

    async def serves(self, group_version: str, plural: str) -> bool:
        """Whether the apiserver serves `plural` in `group_version` (discovery; 404: not served)."""

        try:
            group, version = group_version.split("/")
            found = await self.call("get", "APIResourceList", self.custom.get_api_resources, group, version)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.get("name") == plural for r in (found or {}).get("resources") or [])

    def _create_pod_group(self, namespace: str, body: dict[str, Any], **kwargs: Any) -> Any:
        group, version = POD_GROUP_API.split("/")
        return self.custom.create_namespaced_custom_object(
            group, version, namespace, "podgroups", body, **kwargs
        )

    async def read_pod_group(self, namespace: str, name: str) -> dict[str, Any] | None:
        group, version = POD_GROUP_API.split("/")
        return await self._read(
            "PodGroup", self.custom.get_namespaced_custom_object, group, version, namespace, "podgroups", name
        )

    async def delete_pod_group(self, namespace: str, name: str) -> None:
        group, version = POD_GROUP_API.split("/")
        try:
            await self.call(
                "delete",
                "PodGroup",
                self.custom.delete_namespaced_custom_object,
                group,
                version,
                namespace,
                "podgroups",
                name,
            )
        except ApiException as exc:
            if exc.status != 404:
                raise

    async def read_pvc(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._read(
            "PersistentVolumeClaim", self.core.read_namespaced_persistent_volume_claim, name, namespace
        )

"""kopf handlers: the operator's watches, indexes and resync loop (all API calls go through `adapter.Kube`).

Role: the resync loop (`_resync_loop`) runs one level-based reconcile (`steps.reconcile_job`)
whenever a job is due, serialized per job by an `asyncio.Lock` keyed by `names.job_key()`.
Reconciles are event-driven (`rljob_operator.kube.resync`): a watch event on a job's RLJob, pods,
telemetry ConfigMap or Kueue Workloads, or on a node its pods use, marks the job due at once
(`state.due[key]`); a reconcile that waits for time (a backoff, a terminating pod, a TTL, a missing
object) asks for its own retry; every job is also reconciled every RLJOB_RECONCILE_INTERVAL_S as a
safety net, with jitter. A pod or telemetry event counts only when it changes what a reconcile
reads (`State.pod_changed`, `State.reports_changed`; a pod still refused with a new message counts
within REFUSAL_REFRESH_S); a due job waits for a free slot, jobs with pods to create first
(`resync.pick`). An idle reconcile makes no API call: the RLJob comes from the watch (or
our own write's response, whichever is newer), the status is written only if it changed, and
Events only on transitions. What a reconcile does, step by step, is in `steps` (and the Kueue,
preemption and gang steps in `queue_steps`).

Observations come from kopf indexes (pods, telemetry ConfigMaps, nodes and RLJobs are watched, not
listed); the handlers here also remember what a reconcile may miss between two runs (a pod seen
disrupted, then deleted). No kopf timer or daemon: those would put a finalizer on every RLJob, and
RLJobs would then outlive an uninstalled operator.

Entry point: `run_operator(namespace)` (used by `rljob operator`), or
`kopf run --standalone -m rljob_operator.handlers [--namespace NS | -A]`.
Environment (read once, in the shell): `RLJOB_RECONCILE_INTERVAL_S` (the safety-net resync
of every job, default 300; events and retries do not wait for it),
`RLJOB_METRICS_PORT` (default 8080, 0 disables), `RLJOB_EVENT_INTERVAL_S` (Event rate limit, 30,
read in `context`), `RLJOB_API_THREADS` (the API pool's threads, 48, read in `kube.adapter`) and
`RLJOB_MAX_RECONCILES` (reconciles at once, default the API threads)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import gc
import logging
import os
import time
from typing import Any

import kopf

from rljob_operator import api, names
from rljob_operator.decide import admission, lifecycle
from rljob_operator.kube import adapter, metrics, resync
from rljob_operator.reconcile.guards import api_backoff_s
from rljob_operator.reconcile.state import State
from rljob_operator.reconcile.steps import RETRY_WAITING_S, reconcile_job
from rljob_trainer.outputs import telemetry

RECONCILE_INTERVAL_S = float(os.environ.get("RLJOB_RECONCILE_INTERVAL_S", "300"))
METRICS_PORT = int(os.environ.get("RLJOB_METRICS_PORT", "8080"))
# Pods and telemetry come in bursts (a gang's pods bound and started together): one reconcile,
# and one status write instead of one per pod. RLJob changes are not delayed.
EVENT_COALESCE_S = 0.25
# A pod the scheduler still refuses, with a new message (its node counts move with every retry,
# "0/1002 nodes are available: 40 Insufficient nvidia.com/gpu, ...", or a new cause), refreshes the
# job's Ready message within this, not at once: at 500 jobs waiting for nodes each retry was a
# status write (12 of the 15 per job), its watch echo, and one more reconcile. A first refusal, or
# any other change, is at once.
REFUSAL_REFRESH_S = 30.0
RESYNC_SCAN_PAUSE_S = 0.005
RESYNC_MAX_SLEEP_S = 1.0  # the loop also looks for due jobs at least this often
RESYNC_SWEEP_S = 5.0  # how often it forgets jobs gone from the index
# Reconciles at once (`RLJOB_MAX_RECONCILES`, chart `operator.maxConcurrentReconciles`): a reconcile
# mostly waits for the API, so it takes as many as the API pool has threads (16 queued a burst of 500
# new jobs 0.88 s on average for a slot, 48 0.03 s).
RESYNC_CONCURRENCY = int(os.environ.get("RLJOB_MAX_RECONCILES", str(adapter.API_THREADS)))

RLJOBS = (api.GROUP, api.VERSION, api.PLURAL)


def _state(memo: kopf.Memo) -> State:
    state = memo.get("rljob")
    if not isinstance(state, State):
        raise kopf.TemporaryError("the operator is still starting (no API client yet)", delay=1)
    return state


# ---- startup, indexes ----------------------------------------------------------------------------
@kopf.on.startup()
async def rljob_startup(
    settings: kopf.OperatorSettings,
    memo: kopf.Memo,
    logger: kopf.Logger,
    rljob_pods: kopf.Index,
    rljob_telemetry: kopf.Index,
    rljob_nodes: kopf.Index,
    rljob_jobs: kopf.Index,
    **_: Any,
) -> None:
    """All kopf settings in one place, the API client, the metrics endpoint and the resync loop."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.KOPF_PREFIX)
    # kopf's create/update handlers are gone (the watch events reconcile), so nothing needs the
    # last-handled configuration: storing it would cost one RLJob PATCH per job for nothing.
    settings.persistence.diffbase_storage = _NoDiffBase()
    # No handler needs a finalizer (there are no kopf timers or daemons, and the delete handler
    # is optional), so none is added: deleting an RLJob, or the CRD after `helm uninstall`, never
    # waits for an operator that is gone. kopf removes the finalizer older versions added.
    settings.persistence.finalizer = names.FINALIZER
    # Our own Events are explicit (builders.build_event); kopf's log lines become Events from WARNING up.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = names.MANAGED_BY
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.execution.max_workers = adapter.API_THREADS
    # Server-side label selectors (kopf sends them as the LIST's and the WATCH's labelSelector,
    # _cogs/clients/fetching.py and watching.py): the apiserver sends only our jobs' pods and
    # telemetry ConfigMaps, so a cluster full of other pods costs the operator nothing. The
    # handlers' `labels=` filters below are kopf's client-side ones, kept as the same rule.
    for resource, selector in WATCH_SELECTORS.items():
        settings.watching.label_selectors[resource] = selector
    # First what may fail (a busy port): kopf retries the startup, which must not leave a second
    # API client or resync loop behind.
    # kopf logs every event handler's success at INFO: one line per watch event is noise, not news.
    quiet = logging.getLogger("kopf.objects")
    if not any(isinstance(f, _QuietEventHandlers) for f in quiet.filters):
        quiet.addFilter(_QuietEventHandlers())
    if metrics.start_metrics_server(METRICS_PORT):
        logger.info(f"metrics on :{METRICS_PORT}/metrics")
    state = State(kube=adapter.Kube.from_environment())
    memo["rljob"] = state
    # The indexes are live objects, filled by kopf's watches from now on.
    indexes = _Indexes(pods=rljob_pods, telemetry=rljob_telemetry, nodes=rljob_nodes, jobs=rljob_jobs)
    state.resync = asyncio.create_task(_resync_loop(state, indexes), name="rljob-resync")
    state.resync.add_done_callback(_resync_ended)


class _NoDiffBase(kopf.DiffBaseStorage):
    """A diff-base kopf never writes: no handler of ours compares an RLJob with its last version.

    Nor builds: kopf builds the essence of every watched object's every event (two deep copies of
    the whole body, status and managedFields included) to diff it for change handlers, and ours
    are watch-event handlers and an optional delete, which read no diff. At 500 new jobs the
    copies were 15 % of the operator's CPU."""

    def fetch(self, *, body: kopf.Body) -> None:
        return None

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


class _QuietEventHandlers(logging.Filter):
    """Drops kopf's "Handler 'rljob_..._event' succeeded." lines (the watch triggers below)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Handler 'rljob_") and message.endswith("_event' succeeded."))


def _resync_ended(task: asyncio.Task[None]) -> None:
    """The resync loop never ends but by cancellation: anything else is a bug, and loud."""
    if not task.cancelled() and task.exception() is not None:
        logging.getLogger("rljob_operator.kube.resync").error(
            "the resync loop crashed: no job is reconciled any more", exc_info=task.exception()
        )


@kopf.on.login()
def rljob_login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """Credentials from $KUBECONFIG read now (kopf's client-library login reads it at import time),
    else the in-cluster ServiceAccount."""
    if os.environ.get("KUBECONFIG") or os.path.exists(os.path.expanduser("~/.kube/config")):
        return kopf.login_with_kubeconfig(**kwargs)
    return kopf.login_with_service_account(**kwargs)


@kopf.on.cleanup()
async def rljob_cleanup(memo: kopf.Memo, **_: Any) -> None:
    state = memo.get("rljob")
    if isinstance(state, State):
        if state.resync is not None:
            state.resync.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await state.resync
        # Events still being posted are dropped (they are rate-limited news, not state).
        for task in list(state.posting):
            task.cancel()
        await asyncio.gather(*state.posting, return_exceptions=True)
        state.kube.close()


POD_LABELS = {names.LABEL_JOB: kopf.PRESENT, names.LABEL_MANAGED_BY: names.MANAGED_BY}
TELEMETRY_LABELS = {names.LABEL_ROLE: names.ROLE_TELEMETRY, names.LABEL_MANAGED_BY: names.MANAGED_BY}
#: The same rules as Kubernetes label selectors, per (version, plural) kopf watches.
WATCH_SELECTORS = {
    ("v1", "pods"): f"{names.LABEL_JOB},{names.LABEL_MANAGED_BY}={names.MANAGED_BY}",
    (
        "v1",
        "configmaps",
    ): f"{names.LABEL_ROLE}={names.ROLE_TELEMETRY},{names.LABEL_MANAGED_BY}={names.MANAGED_BY}",
}


# Indexes are what a reconcile observes; the `on.event` handlers below are what makes a job due.
# Both are coroutines: they run on the event loop, never in kopf's thread pool, so the state they
# touch is never shared with a thread. kopf calls the event handlers only once every index is
# filled, so no reconcile sees a half-listed cluster.
@kopf.index("pods", labels=POD_LABELS)
async def rljob_pods(body: kopf.Body, namespace: str, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> Any:
    """Pods of every job, by (namespace, job): the reconcile's view of its pods (no LIST calls).

    Every pod seen is remembered, with its DisruptionTarget if it has one: an eviction deletes the
    pod right after, maybe before any reconcile saw it, and the reconcile must still know it was
    a disruption, not a pod never created or one to recreate alone."""
    obs = lifecycle.observe_pod(body)
    if obs is None:
        return None
    state = memo.get("rljob")
    if isinstance(state, State):
        key = names.job_key(namespace, labels[names.LABEL_JOB])
        # Seen here, not only by a reconcile: a pod may be created and evicted between two.
        state.known.setdefault(key, {})[obs.name] = (obs.attempt, obs.owner_uid)
        if obs.disruption:
            state.disrupted.setdefault(key, {})[obs.name] = (obs.attempt, obs.disruption, obs.owner_uid)
    return {(namespace, labels[names.LABEL_JOB]): obs}


@kopf.index("configmaps", labels=TELEMETRY_LABELS)
async def rljob_telemetry(body: kopf.Body, namespace: str, labels: kopf.Labels, **_: Any) -> Any:
    """The raw `reports.json` of every job's telemetry ConfigMap, by (namespace, job), with the uid
    of the RLJob that owns it (`context.sync_reports` reads only its own job's)."""
    job = labels.get(names.LABEL_JOB)
    if job is None:
        return None
    owner = names.controller_uid(body.get("metadata") or {})
    return {(namespace, job): (owner, (body.get("data") or {}).get(telemetry.REPORTS_KEY, ""))}


@kopf.index("nodes")
async def rljob_nodes(body: kopf.Body, **_: Any) -> Any:
    """Every node's labels, taints and allocatable resources, for the capacity check."""
    return {"nodes": lifecycle.observe_node(body)}


@kopf.on.event(
    admission.KUEUE_GROUP,
    admission.KUEUE_VERSION,
    "workloads",
    labels={names.LABEL_MANAGED_BY: names.MANAGED_BY},
)
async def rljob_workloads(
    event: kopf.RawEvent, body: kopf.Body, namespace: str, memo: kopf.Memo, **_: Any
) -> None:
    """Kueue's Workloads of our jobs: kept in `State.workloads`, and a change (an admission, an
    eviction) reconciles the job at once. Without Kueue's CRDs kopf serves nothing here."""
    state = memo.get("rljob")
    obs = admission.observe_workload(body)
    if not isinstance(state, State) or obs is None:
        return
    key = names.job_key(namespace, obs.job)
    table = state.workloads.setdefault(key, {})
    if event.get("type") == "DELETED":
        table.pop(obs.name, None)
    else:
        table[obs.name] = obs
    state.due[key] = time.monotonic()


@kopf.index(*RLJOBS)
async def rljob_jobs(namespace: str, name: str, **_: Any) -> Any:
    """Every RLJob, by (namespace, name): which jobs exist (the resync loop forgets the others)."""
    return {(namespace, name): True}


@kopf.on.event(*RLJOBS)
async def rljob_job_event(event: kopf.RawEvent, namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """A new or changed RLJob (spec, labels, someone else's status write) is due at once; the echo
    of our own status write is not (its body is already the newest we know)."""
    state = memo.get("rljob")
    if not isinstance(state, State):
        return
    if event["type"] == "DELETED":
        uid = (event["object"].get("metadata") or {}).get("uid")
        state.forget(names.job_key(namespace, name), uid=uid)
    else:
        state.observe_job(copy.deepcopy(dict(event["object"])))


@kopf.on.event("pods", labels=POD_LABELS)
async def rljob_pod_event(
    event: kopf.RawEvent,
    body: kopf.Body,
    name: str,
    namespace: str,
    labels: kopf.Labels,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """A job's pod was created, scheduled, started, ended or deleted: reconcile the job. An event
    that changes nothing a reconcile reads of the pod (`lifecycle.observe_pod`) does not."""
    state = memo.get("rljob")
    if not isinstance(state, State):
        return
    key = names.job_key(namespace, labels[names.LABEL_JOB])
    gone = event["type"] == "DELETED"
    view = None if gone else lifecycle.observe_pod(body)
    # The watch shows a pod this operator created: forget the create (`steps._step_pods`), and
    # its ADDED, a pod just as it was created, is no news to the reconcile that created it.
    ours = state.seen_created(key, name, view)
    change = state.pod_changed(key, name, view)
    if (change == "changed" and not ours) or gone:
        state.touch(namespace, labels[names.LABEL_JOB], EVENT_COALESCE_S)
    elif change == "reworded":
        state.touch(namespace, labels[names.LABEL_JOB], REFUSAL_REFRESH_S)


@kopf.on.event("configmaps", labels=TELEMETRY_LABELS)
async def rljob_telemetry_event(
    body: kopf.Body, namespace: str, labels: kopf.Labels, memo: kopf.Memo, **_: Any
) -> None:
    """The driver wrote a SyncReport: the adaptive policy and the progress read it. (Not the
    ConfigMap's creation, nor a write that left the reports as they were.)"""
    state = memo.get("rljob")
    job = labels.get(names.LABEL_JOB)
    if isinstance(state, State) and job is not None:
        reports = (body.get("data") or {}).get(telemetry.REPORTS_KEY, "")
        if state.reports_changed(names.job_key(namespace, job), reports):
            state.touch(namespace, job, EVENT_COALESCE_S)


@kopf.on.event("nodes")
async def rljob_node_event(
    event: kopf.RawEvent, body: kopf.Body, name: str, memo: kopf.Memo, rljob_pods: kopf.Index, **_: Any
) -> None:
    """A node appeared, went, or changed what the capacity check reads (heartbeats do not count):
    reconcile the jobs with pods on it (a lost node) and the jobs waiting for capacity."""
    state = memo.get("rljob")
    if not isinstance(state, State):
        return
    obs = None if event["type"] == "DELETED" else lifecycle.observe_node(body)
    before = state.nodes.pop(name, None) if obs is None else state.nodes.get(name)
    if obs is not None:
        state.nodes[name] = obs
    if event["type"] is None or obs == before:  # the initial listing: every job is due anyway
        return
    for namespace, job in [k for k, pods in rljob_pods.items() if any(p.node_name == name for p in pods)]:
        state.touch(namespace, job)
    for key in list(state.waiting):
        state.due.soon(key, time.monotonic())


# ---- the handlers --------------------------------------------------------------------------------
@kopf.on.delete(*RLJOBS, optional=True)
async def rljob_delete(name: str, namespace: str, uid: str | None, memo: kopf.Memo, **_: Any) -> None:
    """Children go through their owner references and the garbage collector; forget our caches.

    (With no finalizer kopf rarely sees a deletion in progress; the DELETED event and the resync
    loop's sweep forget the job too. This handler stays so that kopf keeps managing RLJobs'
    finalizers: it removes the one older operator versions added.)"""
    state = memo.get("rljob")
    if isinstance(state, State):
        state.forget(names.job_key(namespace, name), uid=uid)


# ---- the resync loop (instead of a kopf timer, which would put a finalizer on every RLJob) -------
@dataclasses.dataclass(frozen=True)
class _Indexes:
    pods: kopf.Index
    telemetry: kopf.Index
    nodes: kopf.Index
    jobs: kopf.Index


async def _resync_loop(state: State, indexes: _Indexes) -> None:
    """Reconcile every job that is due (`state.due`): after an event, a retry, or the safety net.

    A job is due at once when something of it changed (the `on.event` handlers, or another step
    setting `state.due[key]`), after the delay its last reconcile asked for (`ctx.retry`: a
    backoff ending, a pod still terminating, a TTL), and otherwise every RLJOB_RECONCILE_INTERVAL_S
    less a random share (`resync.next_resync_s`), so idle jobs never wake together. At most
    `RESYNC_CONCURRENCY` reconciles run at once, and a job is taken only when a slot is free:
    events that come while it waits are still seen by that one reconcile (none queues behind a
    semaphore as "running" and then runs again for them). Jobs with pods still to create go
    first (`resync.pick`). The loop sleeps until the next due time, an event, or a free slot.
    """
    log = logging.getLogger("rljob_operator.kube.resync")
    running: dict[str, asyncio.Task[None]] = {}
    due = state.due

    def urgent(key: str) -> bool:
        body = state.latest.get(key)
        attempt = int(((body or {}).get("status") or {}).get("restarts") or 0)
        return resync.wants_pods(attempt, (p.attempt for p in indexes.pods.get(state.jobs[key], [])))

    async def one(key: str, cause: str) -> None:
        namespace, name = state.jobs[key]
        try:
            retry_s = await reconcile_job(
                cause=cause,
                name=name,
                namespace=namespace,
                state=state,
                logger=log,
                pods_index=indexes.pods,
                telemetry_index=indexes.telemetry,
                nodes_index=indexes.nodes,
            )
        except Exception as exc:  # the status write itself failed (API down): back off
            log.warning(f"reconcile of {key} failed: {type(exc).__name__}: {exc}")
            retry_s = api_backoff_s(state, key, exc) if adapter.is_api_error(exc) else RETRY_WAITING_S
        finally:
            running.pop(key, None)
            due.wake()  # a slot is free
        if key in state.jobs:
            delay_s, why = resync.next_delay_s(retry_s, RECONCILE_INTERVAL_S)
            due.schedule(key, time.monotonic() + delay_s, why)

    last_sweep = time.monotonic()
    while True:
        now = time.monotonic()
        for key in [k for k in due if k not in state.jobs and k not in running]:
            due.pop(key, None)  # forgotten meanwhile, or never an RLJob we watch
        start, next_at = resync.pick(
            due, now, running=running, slots=RESYNC_CONCURRENCY - len(running), urgent=urgent
        )
        for key in start:
            cause = due.causes.get(key, resync.EVENT)
            due.running(key)
            running[key] = asyncio.create_task(one(key, cause), name=f"rljob-reconcile-{key}")
        if now - last_sweep >= RESYNC_SWEEP_S:
            last_sweep = now
            present = {names.job_key(namespace, name) for namespace, name in indexes.jobs}
            for key in (set(state.jobs) | set(due)) - present - set(running):
                state.forget(key)
        # A short pause first: events come in bursts, and one scan serves them all.
        await asyncio.sleep(RESYNC_SCAN_PAUSE_S)
        await due.wait(min(next_at, now + RESYNC_MAX_SLEEP_S) - time.monotonic())


# ---- entry point ---------------------------------------------------------------------------------
LOG_LEVELS = ("DEBUG", "INFO", "WARNING")


# Young collections every 20,000 allocations, not 700: the watch events and API responses in
# flight then die by their reference count before a collection promotes them, and full collections,
# which stop the event loop and every API thread, come as the heap grows, not with the traffic.
GC_THRESHOLDS = (20_000, 10, 10)


def tune_gc() -> None:
    """What import made (kopf, the API client, pydantic's models: ~90,000 objects) lives as long as
    the process: frozen, no full collection walks it again. At 500 new jobs, full collections took
    0.2-1 s every 3-4 s (10 % of the time), each one a stall of every job being created."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def run_operator(
    namespace: str | None = None,
    *,
    standalone: bool = True,
    liveness_endpoint: str | None = None,
    log_level: str = "INFO",
) -> None:
    """Run the operator until interrupted: one namespace, or all namespaces when `namespace` is None.

    `rljob operator` calls this. Standalone (the default) skips kopf's peering (one replica;
    the Helm chart runs one).
    """
    level = log_level.upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"log level {log_level!r}; valid: {', '.join(LOG_LEVELS)}")
    kopf.configure(debug=level == "DEBUG", verbose=False, quiet=level == "WARNING")
    tune_gc()
    asyncio.run(
        kopf.operator(
            clusterwide=namespace is None,
            namespaces=[namespace] if namespace else (),
            standalone=standalone,
            liveness_endpoint=liveness_endpoint,
        )
    )

"""kopf handlers: the operator's imperative shell (all API calls go through `kube.Kube`).

Role: one level-based reconcile (`_reconcile`), run by the resync loop (`_resync_loop`) whenever
a job is due, serialized per job by an `asyncio.Lock` keyed by `names.job_key()`. Reconciles are
event-driven (`rljob_operator.resync`): a watch event on a job's RLJob, pods or telemetry
ConfigMap, or on a node its pods use, marks the job due at once (`state.due[key]`); a reconcile
that waits for time (a backoff, a terminating pod, a TTL, a missing object) asks for its own retry;
every job is also reconciled every RLJOB_RECONCILE_INTERVAL_S as a safety net, with jitter. An
idle reconcile makes no API call: the RLJob comes from the watch (or our own write's response,
whichever is newer), the status is written only if it changed, and Events only on transitions.
The shape is KubeRay's: inside the lock the newest RLJob is taken, then a fixed list of steps
(`STEPS`: finished?, plan, suspend, outcome, backoff, children, volumes, capacity, adapt, pods)
runs; each step returns what it observed (`status.Observed`) and may stop the list; one pure
`status.compute_status` runs at the tail and the status is written once, only if it changed;
Events follow condition transitions. Any exception in a step becomes a condition: `errors.RLJobError`
with its own reason, anything else as `InternalError` quoting the exception, retried by the loop.

Observations come from kopf indexes (pods, telemetry ConfigMaps, nodes and RLJobs are watched, not
listed). Pod failures follow `reconcile.decide_restart` (pure): a failure counts against
`spec.restartPolicy.backoffLimit` and restarts the gang after an exponential backoff; a
disruption (eviction, preemption, lost node) restarts it at once and is not counted. The new
attempt is written to the status first (it is what marks the old pods stale); the next
reconcile deletes them and creates the new ones. Adaptive mode calls `policy.decide()` on the
telemetry history and reconciles its targets into `<job>-rollout-<j>` pods and
`status.rollout.desired*`; rollout pods follow `elastic.plan_rollout_pods` (pure): above a lowered
target they drain until the driver releases them (or `drainGraceSeconds`), and one whose engine
was lost is recreated alone, never restarting the gang. No kopf timer or daemon: those would put
a finalizer on every RLJob, and RLJobs would then outlive an uninstalled operator.

Entry point: `run_operator(namespace)` (used by `rljob operator`), or
`kopf run --standalone -m rljob_operator.handlers [--namespace NS | -A]`.
Environment (read once, here in the shell): `RLJOB_RECONCILE_INTERVAL_S` (the safety-net resync
of every job, default 300; events and retries do not wait for it),
`RLJOB_METRICS_PORT` (default 8080, 0 disables), `RLJOB_EVENT_INTERVAL_S` (Event rate limit, 30).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timezone
from typing import Any, Literal

import kopf
import pydantic

from rljob_operator import (
    admission,
    api,
    builders,
    elastic,
    errors,
    kube,
    metrics,
    names,
    planning,
    policy,
    pools,
    preemption,
    reconcile,
    resync,
    status,
)
from rljob_operator.builders import podgroup
from rljob_operator.estimator import presets
from rljob_trainer import telemetry

RECONCILE_INTERVAL_S = float(os.environ.get("RLJOB_RECONCILE_INTERVAL_S", "300"))
METRICS_PORT = int(os.environ.get("RLJOB_METRICS_PORT", "8080"))
EVENT_MIN_INTERVAL_S = float(os.environ.get("RLJOB_EVENT_INTERVAL_S", "30"))
# A terminating pod still holds its name; check again soon rather than at the next resync.
WAIT_FOR_TERMINATION_S = 1.0
RETRY_INTERNAL_ERROR_S = 5.0
# A job waiting for something no watch of ours sees (a ConfigMap, a claim): look again this often.
RETRY_WAITING_S = 10.0
# Pods and telemetry come in bursts (a gang's pods bound and started together): one reconcile,
# and one status write instead of one per pod. RLJob changes are not delayed.
EVENT_COALESCE_S = 0.25
RESYNC_SCAN_PAUSE_S = 0.005
RESYNC_MAX_SLEEP_S = 1.0  # the loop also looks for due jobs at least this often
RESYNC_SWEEP_S = 5.0  # how often it forgets jobs gone from the index
RESYNC_CONCURRENCY = 16
POD_GROUP_API_REFRESH_S = 600.0  # how long the operator trusts its discovery of the PodGroup API

RLJOBS = (api.GROUP, api.VERSION, api.PLURAL)


# ---- per-operator state (kopf memo: one per running operator, so one per event loop) -------------
@dataclasses.dataclass
class Cache:
    """What a reconcile may reuse: the plan per generation, the children applied per config."""

    generation: int | None = None
    model_config: dict[str, Any] | None = None
    plan: api.PlanStatus | None = None
    applied: str | None = None  # hash of the non-pod children last applied
    error: BaseException | None = None  # a spec error of this generation (waits for the next)


@dataclasses.dataclass
class State:
    kube: kube.Kube
    locks: dict[str, asyncio.Lock] = dataclasses.field(default_factory=dict)
    caches: dict[str, Cache] = dataclasses.field(default_factory=dict)
    events: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)
    phases: dict[str, str] = dataclasses.field(default_factory=dict)
    # job key -> monotonic s of its next reconcile; `due[key] = time.monotonic()`: reconcile ASAP
    due: resync.DueTimes = dataclasses.field(default_factory=resync.DueTimes)
    # job key -> (namespace, name), and the newest RLJob body seen (watch or our write's response)
    jobs: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    latest: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # jobs whose last reconcile waits on something (a retryable error): a node change retries them
    waiting: set[str] = dataclasses.field(default_factory=set)
    nodes: dict[str, reconcile.NodeObservation] = dataclasses.field(default_factory=dict)
    # native gang scheduling: (checked at, served) of the PodGroup API; job key -> minCount created
    pod_group_api: tuple[float, bool] | None = None
    gangs: dict[str, int] = dataclasses.field(default_factory=dict)
    # job key -> pod name -> (attempt, why): pods seen disrupted (see rljob_pods)
    disrupted: dict[str, dict[str, tuple[int, str]]] = dataclasses.field(default_factory=dict)
    # job key -> pod name -> attempt: pods seen; and the names the operator deleted itself, so that
    # a pod of the attempt that is gone can be told from one not created yet or deleted by us.
    known: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    deleted: dict[str, set[tuple[str, int]]] = dataclasses.field(default_factory=dict)
    # job key -> Workload name -> what it says (rljob_workloads, the Kueue watch)
    workloads: dict[str, dict[str, admission.WorkloadState]] = dataclasses.field(default_factory=dict)
    resync: asyncio.Task[None] | None = None

    def observe_job(self, body: dict[str, Any]) -> None:
        """A watched RLJob: keep it when it is newer than what we know, and reconcile it soon."""
        meta = body.get("metadata") or {}
        key = names.job_key(meta.get("namespace", ""), meta.get("name", ""))
        self.jobs[key] = (meta.get("namespace", ""), meta.get("name", ""))
        if self.remember(key, body):  # not the echo of our own write
            self.due.soon(key, time.monotonic())

    def remember(self, key: str, body: dict[str, Any] | None) -> bool:
        """Keep `body` as the job's newest known version if it is newer; True when it was."""
        if not body:
            return False
        known = (self.latest.get(key, {}).get("metadata") or {}).get("resourceVersion")
        if key in self.latest and not resync.is_newer(body["metadata"].get("resourceVersion"), known):
            return False
        self.latest[key] = body
        return True

    def touch(self, namespace: str, job: str, delay_s: float = 0.0) -> None:
        """Something of job `namespace/job` changed: reconcile it within `delay_s`."""
        key = names.job_key(namespace, job)
        if key in self.jobs:
            self.due.soon(key, time.monotonic() + delay_s)

    def forget(self, key: str) -> None:
        """A deleted job: drop everything kept for it."""
        self.caches.pop(key, None)
        self.locks.pop(key, None)
        self.phases.pop(key, None)
        self.due.pop(key, None)
        self.jobs.pop(key, None)
        self.latest.pop(key, None)
        self.waiting.discard(key)
        self.gangs.pop(key, None)
        self.disrupted.pop(key, None)
        self.known.pop(key, None)
        self.deleted.pop(key, None)
        self.workloads.pop(key, None)
        metrics.set_phase_counts(self.phases)


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
    settings.execution.max_workers = kube.API_THREADS
    # First what may fail (a busy port): kopf retries the startup, which must not leave a second
    # API client or resync loop behind.
    # kopf logs every event handler's success at INFO: one line per watch event is noise, not news.
    quiet = logging.getLogger("kopf.objects")
    if not any(isinstance(f, _QuietEventHandlers) for f in quiet.filters):
        quiet.addFilter(_QuietEventHandlers())
    if metrics.start_metrics_server(METRICS_PORT):
        logger.info(f"metrics on :{METRICS_PORT}/metrics")
    state = State(kube=kube.Kube.from_environment())
    memo["rljob"] = state
    # The indexes are live objects, filled by kopf's watches from now on.
    indexes = _Indexes(pods=rljob_pods, telemetry=rljob_telemetry, nodes=rljob_nodes, jobs=rljob_jobs)
    state.resync = asyncio.create_task(_resync_loop(state, indexes), name="rljob-resync")
    state.resync.add_done_callback(_resync_ended)


class _NoDiffBase(kopf.DiffBaseStorage):
    """A diff-base kopf never writes: no handler of ours compares an RLJob with its last version."""

    def fetch(self, *, body: kopf.Body) -> None:
        return None

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
        logging.getLogger("rljob_operator.resync").error(
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
        state.kube.close()


POD_LABELS = {names.LABEL_JOB: kopf.PRESENT, names.LABEL_MANAGED_BY: names.MANAGED_BY}
TELEMETRY_LABELS = {names.LABEL_ROLE: names.ROLE_TELEMETRY}


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
    obs = reconcile.observe_pod(body)
    if obs is None:
        return None
    state = memo.get("rljob")
    if isinstance(state, State):
        key = names.job_key(namespace, labels[names.LABEL_JOB])
        # Seen here, not only by a reconcile: a pod may be created and evicted between two.
        state.known.setdefault(key, {})[obs.name] = obs.attempt
        if obs.disruption:
            state.disrupted.setdefault(key, {})[obs.name] = (obs.attempt, obs.disruption)
    return {(namespace, labels[names.LABEL_JOB]): obs}


@kopf.index("configmaps", labels=TELEMETRY_LABELS)
async def rljob_telemetry(body: kopf.Body, namespace: str, labels: kopf.Labels, **_: Any) -> Any:
    """The raw `reports.json` of every job's telemetry ConfigMap, by (namespace, job)."""
    job = labels.get(names.LABEL_JOB)
    if job is None:
        return None
    return {(namespace, job): (body.get("data") or {}).get(telemetry.REPORTS_KEY, "")}


@kopf.index("nodes")
async def rljob_nodes(body: kopf.Body, **_: Any) -> Any:
    """Every node's labels, taints and allocatable resources, for the capacity check."""
    return {"nodes": reconcile.observe_node(body)}


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
        state.forget(names.job_key(namespace, name))
    else:
        state.observe_job(copy.deepcopy(dict(event["object"])))


@kopf.on.event("pods", labels=POD_LABELS)
async def rljob_pod_event(namespace: str, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    """A job's pod was created, scheduled, started, ended or deleted: reconcile the job."""
    state = memo.get("rljob")
    if isinstance(state, State):
        state.touch(namespace, labels[names.LABEL_JOB], EVENT_COALESCE_S)


@kopf.on.event("configmaps", labels=TELEMETRY_LABELS)
async def rljob_telemetry_event(namespace: str, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    """The driver wrote a SyncReport: the adaptive policy and the progress read it."""
    state = memo.get("rljob")
    job = labels.get(names.LABEL_JOB)
    if isinstance(state, State) and job is not None:
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
    obs = None if event["type"] == "DELETED" else reconcile.observe_node(body)
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
async def rljob_delete(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """Children go through their owner references and the garbage collector; forget our caches.

    (With no finalizer kopf rarely sees a deletion in progress; the DELETED event and the resync
    loop's sweep forget the job too. This handler stays so that kopf keeps managing RLJobs'
    finalizers: it removes the one older operator versions added.)"""
    state = memo.get("rljob")
    if isinstance(state, State):
        state.forget(names.job_key(namespace, name))


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
    `RESYNC_CONCURRENCY` reconciles run at once; the loop sleeps until the next due time or event.
    """
    log = logging.getLogger("rljob_operator.resync")
    limit = asyncio.Semaphore(RESYNC_CONCURRENCY)
    running: dict[str, asyncio.Task[None]] = {}
    due = state.due

    async def one(key: str, cause: str) -> None:
        namespace, name = state.jobs[key]
        try:
            async with limit:
                retry_s = await _reconcile(
                    cause=cause,
                    name=name,
                    namespace=namespace,
                    state=state,
                    logger=log,
                    pods_index=indexes.pods,
                    telemetry_index=indexes.telemetry,
                    nodes_index=indexes.nodes,
                )
        except Exception as exc:  # the status write itself failed (API down): try again later
            log.warning(f"reconcile of {key} failed: {type(exc).__name__}: {exc}")
            retry_s = RETRY_WAITING_S
        finally:
            running.pop(key, None)
        if key in state.jobs:
            delay_s, why = resync.next_delay_s(retry_s, RECONCILE_INTERVAL_S)
            due.schedule(key, time.monotonic() + delay_s, why)

    last_sweep = time.monotonic()
    while True:
        now = time.monotonic()
        wake_at = now + RESYNC_MAX_SLEEP_S
        for key, when in list(due.items()):
            if key in running:
                continue
            if when <= now and key in state.jobs:
                cause = due.causes.get(key, resync.EVENT)
                due.running(key)
                running[key] = asyncio.create_task(one(key, cause), name=f"rljob-reconcile-{key}")
            else:
                wake_at = min(wake_at, when)
        if now - last_sweep >= RESYNC_SWEEP_S:
            last_sweep = now
            present = {names.job_key(namespace, name) for namespace, name in indexes.jobs}
            for key in (set(state.jobs) | set(due)) - present - set(running):
                state.forget(key)
        # A short pause first: events come in bursts, and one scan serves them all.
        await asyncio.sleep(RESYNC_SCAN_PAUSE_S)
        await due.wait(wake_at - time.monotonic())


# ---- reconcile -----------------------------------------------------------------------------------
async def _reconcile(
    *,
    cause: str,
    name: str,
    namespace: str,
    state: State,
    logger: Any,
    pods_index: kopf.Index,
    telemetry_index: kopf.Index,
    nodes_index: kopf.Index,
) -> float | None:
    """Reconcile one job under its lock; returns when to run again (seconds), or None for the interval."""
    key = names.job_key(namespace, name)
    lock = state.locks.setdefault(key, asyncio.Lock())
    started = time.monotonic()
    try:
        async with lock:
            # The newest RLJob we know, taken inside the lock: the watch's copy or the response to
            # this job's last status write, whichever is newer (`State.remember`), so a lagging
            # watch event never undoes a status just written (restarts, adaptive targets). Only a
            # job never seen is read.
            body = state.latest.get(key)
            if body is None:
                body = await state.kube.read_rljob(namespace, name)
                state.remember(key, body)
            if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
                return None
            raw_status = dict(body.get("status") or {})
            ctx = _Ctx(
                state=state,
                key=key,
                job=builders.JobRef(name, namespace),
                body=body,
                raw_spec=dict(body.get("spec") or {}),
                generation=int(body["metadata"].get("generation") or 0),
                old=api.RLJobStatus.model_validate(raw_status),
                old_raw=raw_status,
                pods=list(pods_index.get((namespace, name), [])),
                telemetry_index=telemetry_index,
                nodes_index=nodes_index,
                logger=logger,
                now=datetime.now(timezone.utc).replace(microsecond=0),
            )
            observed = await _run_steps(ctx)
            if observed.error is not None and status.is_retryable(observed.error):
                state.waiting.add(key)
            else:
                state.waiting.discard(key)
            try:
                await _write_status(ctx, observed)
            finally:
                await _post_events(ctx)
            if ctx.retry_s is not None:
                logger.debug(f"reconcile {key} again in {ctx.retry_s:.1f}s: {ctx.retry_why}")
            return ctx.retry_s
    finally:
        metrics.RECONCILE_SECONDS.labels(cause).observe(time.monotonic() - started)


@dataclasses.dataclass
class _Ctx:
    """One reconcile's inputs (the RLJob as re-read inside the lock), shared by its steps."""

    state: State
    key: str
    job: builders.JobRef
    body: dict[str, Any]
    raw_spec: dict[str, Any]
    generation: int
    old: api.RLJobStatus
    old_raw: dict[str, Any]
    pods: list[reconcile.PodObservation]
    telemetry_index: kopf.Index
    nodes_index: kopf.Index
    logger: Any
    now: datetime
    model_config: dict[str, Any] | None = None
    config_hash: str = ""
    retry_s: float | None = None
    retry_why: str = ""
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def retry(self, delay_s: float, why: str) -> None:
        """Ask kopf to run this reconcile again after `delay_s` (the soonest request wins)."""
        if self.retry_s is None or delay_s < self.retry_s:
            self.retry_s, self.retry_why = max(delay_s, 0.0), why

    @property
    def attempt(self) -> int:
        return self.old.restarts or 0


# A step reads what earlier steps observed and returns it extended, plus whether to stop here.
Step = Callable[[_Ctx, status.Observed], Awaitable[tuple[status.Observed, bool]]]


async def _run_steps(ctx: _Ctx) -> status.Observed:
    """Run `STEPS` in order; any exception stops them and becomes the observed error.

    Known errors (`errors.RLJobError`, a pydantic ValidationError of the spec) carry their own
    reason; anything else is wrapped as `InternalError` naming the step and quoting the exception,
    and kopf retries it. Nothing escapes without the status saying why.
    """
    seen = status.Observed()
    for step in STEPS:
        try:
            seen, stop = await step(ctx, seen)
        except (errors.RLJobError, pydantic.ValidationError) as exc:
            # Retryable ones (a ConfigMap, a claim or nodes that may appear) are looked at again
            # soon (nodes also retry them when they change); the others wait for a new generation.
            if status.is_retryable(exc):
                ctx.retry(RETRY_WAITING_S, f"{_step_label(step)}: {status.reason_for(exc)}")
            return dataclasses.replace(seen, error=exc)
        except Exception as exc:
            ctx.logger.exception(f"reconcile step {step.__name__} failed")
            ctx.retry(RETRY_INTERNAL_ERROR_S, f"{step.__name__}: {exc}")
            return dataclasses.replace(seen, error=errors.InternalError.wrap(_step_label(step), exc))
        if stop:
            break
    return seen


def _step_label(step: Step) -> str:
    return f"reconcile step {step.__name__.removeprefix('_step_')}"


# ---- steps ---------------------------------------------------------------------------------------
def _spec_failure_fixed(ctx: _Ctx) -> bool:
    """A job failed by its spec (it never planned) goes on once a new generation arrives."""
    planned = status.find(ctx.old.conditions, status.PLANNED)
    return (
        ctx.old.phase == "Failed"
        and planned is not None
        and planned.status == "False"
        and (ctx.old.observed_generation or 0) < ctx.generation
    )


async def _step_finished(ctx: _Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """A finished job: stop leftover pods, honour ttlSecondsAfterFinished, keep the status."""
    if ctx.old.phase not in api.FINISHED_PHASES or _spec_failure_fixed(ctx):
        return seen, False
    await _delete_pods(ctx, reconcile.pods_to_stop(ctx.pods, keep_finished=True), why="finished")
    await _finish_workloads(ctx)
    ttl = ctx.raw_spec.get("ttlSecondsAfterFinished")
    done = ctx.old.completion_time
    if isinstance(ttl, int) and done is not None:
        left_s = done.timestamp() + ttl - ctx.now.timestamp()
        if left_s <= 0:
            _post(ctx, "Normal", "TTLExpired", f"deleting the job {ttl}s after it finished")
            await ctx.state.kube.delete_rljob(ctx.job.namespace, ctx.job.name)
        else:
            ctx.retry(left_s, f"ttlSecondsAfterFinished ends in {left_s:.0f}s")
    return dataclasses.replace(seen, finished=True), True


async def _step_plan(ctx: _Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """Parse the spec, read the model config, plan, lay out the pods (cached per generation)."""
    cache = ctx.state.caches.setdefault(ctx.key, Cache())
    if cache.generation == ctx.generation and cache.error is not None:
        raise cache.error  # a spec error waits for a new generation: no API call until then
    try:
        spec = api.RLJobSpec.model_validate(ctx.raw_spec)
        spec = pools.with_pool_defaults(spec, await _pool_catalog(ctx.state.kube))
        bad_name = names.validate_job_name(ctx.job.name)
        if bad_name:
            raise errors.InvalidSpecError("metadata.name", bad_name)
        plan, model_config = await _plan(ctx, spec)
    except (errors.RLJobError, pydantic.ValidationError) as exc:
        if not isinstance(exc, errors.RLJobError) or not exc.retryable:
            cache.generation, cache.error, cache.plan = ctx.generation, exc, None
        raise
    ctx.model_config = model_config
    adaptive = spec.resources.mode == "adaptive"
    desired_dedicated = ctx.old.rollout.desired_dedicated_engines if adaptive and ctx.old.rollout else None
    layout = builders.compute_layout(spec, plan, desired_dedicated)
    current = [p for p in ctx.pods if p.attempt == ctx.attempt]
    return dataclasses.replace(seen, spec=spec, plan=plan, layout=layout, pods=current), False


def _spec_of(seen: status.Observed) -> api.RLJobSpec:
    if seen.spec is None or seen.plan is None or seen.layout is None:
        raise RuntimeError("a step ran before the plan step")
    return seen.spec


async def _step_suspend(ctx: _Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """spec.suspend: delete every pod (and the Kueue Workloads, whose quota goes back; resuming
    queues the job again), keep everything else."""
    if not _spec_of(seen).suspend:
        return seen, False
    await _delete_pods(ctx, reconcile.pods_to_stop(ctx.pods, keep_finished=False), why="suspend")
    await _release_workloads(ctx)
    return dataclasses.replace(seen, suspended=True), True


async def _step_outcome(ctx: _Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """Succeeded, failed, disrupted? The pure `reconcile.decide_restart` says; this step obeys."""
    spec = _spec_of(seen)
    nodes = {n.name for n in ctx.nodes_index.get("nodes", [])}
    decision = reconcile.decide_restart(
        ctx.pods,
        attempt=ctx.attempt,
        failures=ctx.old.failures or 0,
        disruptions=ctx.old.disruptions or 0,
        last_failure=ctx.old.last_failure,
        policy=spec.restart_policy,
        node_names=frozenset(nodes),
        vanished=_vanished_pods(ctx),
    )
    if decision.action == "run":
        return seen, False
    seen = dataclasses.replace(seen, decision=decision)
    if decision.action in ("succeeded", "fail"):
        if decision.action == "succeeded":
            reports = _reports(ctx)
            seen = dataclasses.replace(seen, report=reports[-1] if reports else None)
        await _delete_pods(ctx, reconcile.pods_to_stop(ctx.pods, keep_finished=True), why="finished")
        return seen, True
    # restart: the status (written at the tail) carries the new attempt, which is what marks the
    # old pods stale even across a crash; the next reconcile deletes them and waits out the backoff.
    metrics.RESTARTS.inc()
    ctx.retry(WAIT_FOR_TERMINATION_S, f"restart {decision.attempt}: {decision.cause}")
    return seen, True


def _vanished_pods(ctx: _Ctx) -> dict[str, str]:
    """Pods of the current attempt seen before and gone now, not deleted by the operator: why.

    A disrupted pod (any role) is named with its DisruptionTarget; a trainer pod that simply
    vanished broke its Ray cluster. A rollout pod that vanished is recreated alone by the pod diff.
    """
    known = ctx.state.known.setdefault(ctx.key, {})
    disrupted = ctx.state.disrupted.setdefault(ctx.key, {})
    ours = ctx.state.deleted.setdefault(ctx.key, set())
    ours.difference_update({(n, a) for n, a in ours if a != ctx.attempt})
    for table in (known, disrupted):
        for name in [n for n, v in table.items() if (v if isinstance(v, int) else v[0]) != ctx.attempt]:
            del table[name]
    present = {p.name for p in ctx.pods if p.attempt == ctx.attempt}
    known.update(dict.fromkeys(present, ctx.attempt))
    out = {}
    for name in sorted(set(known) - present - {n for n, _ in ours}):
        role = names.parse_pod_name(ctx.job.name, name)
        if role is not None and role[0] == names.ROLE_ROLLOUT:
            continue  # a rollout pod is recreated alone by the pod diff, whatever took it
        if name in disrupted:
            out[name] = f"pod {name} was disrupted ({disrupted[name][1]})"
        elif role is not None and role[0] == names.ROLE_TRAINER:
            out[name] = (
                f"trainer pod {name} disappeared (deleted outside the operator, or lost with its node)"
            )
    return out


async def _step_backoff(ctx: _Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """A pending restart: delete the old attempt's pods, and wait out the backoff after a failure."""
    pending = status.pending_restart(ctx.old)
    if pending is None:
        return seen, False
    since, disruption = pending
    stale = [p.name for p in ctx.pods if p.attempt != ctx.attempt and not p.deleting]
    await _delete_pods(ctx, stale, why="restart")
    wait = reconcile.restart_wait_s(
        since, disruption, ctx.old.failures or 0, _spec_of(seen).restart_policy, ctx.now
    )
    if wait > 0:
        ctx.retry(wait, f"restart {ctx.attempt} waits for its backoff")
        return dataclasses.replace(seen, restart_wait_s=wait), True
    return seen, False


async def _step_children(ctx: _Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """Everything but pods (once per generation/config; AlreadyExists is success)."""
    spec = _spec_of(seen)
    assert seen.plan is not None and seen.layout is not None
    objects = builders.build_job_objects(ctx.job, spec, seen.plan, seen.layout, ctx.model_config)
    ctx.config_hash = objects.config_hash
    await _apply_children(ctx, objects)
    return seen, False


def _first_pods_of_attempt(ctx: _Ctx) -> bool:
    return not any(p.attempt == ctx.attempt for p in ctx.pods)


async def _step_volumes(ctx: _Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """Before an attempt's first pod: every claim exists and every pod that mounts it can."""
    if not _first_pods_of_attempt(ctx):
        return seen, False
    assert seen.layout is not None
    uses = reconcile.claims_of(_spec_of(seen), seen.layout)
    claims = {u.claim: await ctx.state.kube.read_pvc(ctx.job.namespace, u.claim) for u in uses}
    reconcile.check_claims(uses, claims, ctx.job.namespace)
    return seen, False


async def _step_capacity(ctx: _Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """Before an attempt's first pod: can the pools ever hold the layout? (Not for a job Kueue
    admits: its flavors add the nodeLabels and tolerations that say where the pods may go.)"""
    if _first_pods_of_attempt(ctx) and not _kueue_managed(ctx):
        assert seen.layout is not None
        reconcile.check_capacity(_spec_of(seen), seen.layout, list(ctx.nodes_index.get("nodes", [])))
    return seen, False


async def _step_adapt(ctx: _Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """Adaptive mode: turn the telemetry history into engine targets (`policy.decide()`)."""
    spec = _spec_of(seen)
    reports = _reports(ctx)
    seen = dataclasses.replace(seen, report=reports[-1] if reports else None)
    if spec.resources.mode != "adaptive" or not reports:
        return seen, False
    assert seen.plan is not None and seen.layout is not None
    rollout = await _adapt(ctx, spec, seen.plan, seen.layout, reports)
    if rollout is None:
        return seen, False
    layout = builders.compute_layout(spec, seen.plan, rollout.desired_dedicated_engines)
    return dataclasses.replace(seen, rollout=rollout, layout=layout), False


async def _step_pods(ctx: _Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """Delete the stale pods, create the missing ones (all at once; the Event lists them in order)."""
    spec = _spec_of(seen)
    assert seen.layout is not None
    desired = builders.build_pods(
        ctx.job, spec, seen.layout, attempt=ctx.attempt, config_hash=ctx.config_hash
    )
    if seen.placements:  # Kueue admitted them: onto the admitted flavors' nodes
        desired = [
            admission.place_pod(d, seen.placements[d["metadata"]["name"]])
            if d["metadata"]["name"] in seen.placements
            else d
            for d in desired
        ]
    if seen.gang is not None and seen.gang[0]:  # members join the job's PodGroup (`_step_gang`)
        assert seen.plan is not None
        desired = podgroup.with_gang(desired, podgroup.job_gang(ctx.job, spec, seen.plan, seen.layout))
    seen, elastic_plan = _plan_rollout_pods(ctx, seen)
    diff = reconcile.diff_pods(
        desired,
        ctx.pods,
        ctx.attempt,
        keep=elastic_plan.keep,
        replace=[r.name for r in elastic_plan.replace],
    )
    lost = {r.name for r in elastic_plan.replace}
    await _delete_pods(ctx, [n for n in diff.delete if n not in lost], why="stale")
    await _delete_pods(ctx, [n for n in diff.delete if n in lost], why="engine-lost")
    for pod in diff.create:
        kopf.adopt(pod, owner=ctx.body)
    # Independent objects (each create idempotent): one round trip for all, not one per pod.
    made = await asyncio.gather(*(ctx.state.kube.create(pod) for pod in diff.create))
    created = []
    for pod, new in zip(diff.create, made, strict=True):
        if new:
            metrics.PODS_CREATED.labels(pod["metadata"]["labels"][names.LABEL_ROLE]).inc()
            created.append(pod["metadata"]["name"])
    if created:
        ctx.logger.info(f"reconciled {ctx.key}: created pods {', '.join(created)}")
        _post(ctx, "Normal", "PodsCreated", f"created {', '.join(created)}")
    if diff.waiting:
        ctx.retry(WAIT_FOR_TERMINATION_S, f"waiting for {', '.join(diff.waiting)} to terminate")
    return dataclasses.replace(seen, waiting=diff.waiting + tuple(created)), False


# ---- native gang scheduling (the pure part: builders.podgroup) -----------------------------------
async def _step_gang(ctx: _Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """Where the apiserver serves PodGroups, the job's core (trainer pods plus the minimum rollout
    pods) is one PodGroup, so the scheduler binds all of it or none; elsewhere pods schedule one by
    one, and the GangScheduling condition says why."""
    if not await _pod_groups_served(ctx.state.kube, ctx.state):
        why = (
            f"the apiserver does not serve {podgroup.API_VERSION} PodGroups (Kubernetes 1.37 with "
            "the GenericWorkload feature gate and that API enabled): pods are scheduled one by one"
        )
        return dataclasses.replace(seen, gang=(False, "PodGroupAPIUnavailable", why)), False
    spec = _spec_of(seen)
    assert seen.plan is not None and seen.layout is not None
    gang = podgroup.job_gang(ctx.job, spec, seen.plan, seen.layout)
    kube_ = ctx.state.kube
    if ctx.state.gangs.get(ctx.key) != gang.min_count:
        group = podgroup.build_pod_group(
            ctx.job, min_count=gang.min_count, priority_class_name=spec.trainer_pool.priority_class_name
        )
        kopf.adopt(group, owner=ctx.body)
        if not await kube_.create(group):  # it exists: from before a restart, or an older spec
            stored = podgroup.min_count_of(await kube_.read_pod_group(ctx.job.namespace, gang.group))
            if stored not in (None, gang.min_count):
                # A PodGroup's gang is fixed once made: replace it (bound pods stay where they are).
                await kube_.delete_pod_group(ctx.job.namespace, gang.group)
                ctx.retry(
                    WAIT_FOR_TERMINATION_S, f"PodGroup {gang.group} is replaced (minCount {gang.min_count})"
                )
                why = f"PodGroup {gang.group} is replaced: minCount {stored}, the job's is {gang.min_count}"
                return dataclasses.replace(seen, gang=(False, "PodGroupReplaced", why)), True
        ctx.state.gangs[ctx.key] = gang.min_count
    message = (
        f"PodGroup {gang.group}: {', '.join(sorted(gang.members))} are scheduled all together or "
        f"not at all (minCount {gang.min_count})"
    )
    return dataclasses.replace(seen, gang=(True, "PodGroupCreated", message)), False


async def _pod_groups_served(kube_: kube.Kube, state: State) -> bool:
    """Discovery of the PodGroup API, cached for POD_GROUP_API_REFRESH_S (it changes with an upgrade)."""
    now = time.monotonic()
    if state.pod_group_api is None or now - state.pod_group_api[0] >= POD_GROUP_API_REFRESH_S:
        served = await kube_.serves(podgroup.API_VERSION, "podgroups")
        state.pod_group_api = (now, served)
    return state.pod_group_api[1]


# ---- Kueue admission (the pure part: rljob_operator.admission) -----------------------------------
async def _step_admission(ctx: _Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """A job labelled kueue.x-k8s.io/queue-name: its Workloads exist before any pod, and no pod
    exists until Kueue admits them; admitted pods go onto their flavors' nodes, and Kueue hears
    PodsReady. Extra dedicated engines (adaptive mode) each wait for their own Workload."""
    spec = _spec_of(seen)
    labels = (ctx.body.get("metadata") or {}).get("labels") or {}
    try:
        queue_name = names.kueue_queue_name(labels)
        priority_class = names.kueue_priority_class(labels)
    except ValueError as exc:
        raise admission.KueueLabelError("metadata.labels", str(exc)) from exc
    if queue_name is None:
        return seen, False
    assert seen.plan is not None and seen.layout is not None
    core_layout = builders.compute_layout(spec, seen.plan)  # the plan's engines: the job's minimum
    core_pods = builders.build_pods(ctx.job, spec, core_layout)
    trainers, rollouts = core_pods[: core_layout.trainer_pods], core_pods[core_layout.trainer_pods :]
    known = ctx.state.workloads.setdefault(ctx.key, {})
    wl_name = names.workload_name(ctx.job.name)
    core = known.get(wl_name)
    if core is None or not core.quota_reserved:
        priority = await _workload_priority(ctx, spec, priority_class, core)
        desired = admission.core_workload(
            ctx.job, trainers, rollouts, queue_name=queue_name, priority=priority
        )
        if core is not None and not core.deleting and not admission.is_current(core, desired):
            await ctx.state.kube.delete_workload(ctx.job.namespace, wl_name)  # pending: rebuild it
            ctx.retry(WAIT_FOR_TERMINATION_S, f"Workload {wl_name} is rebuilt for the new spec")
            core = None
        elif core is None:
            kopf.adopt(desired, owner=ctx.body)
            if await ctx.state.kube.create(desired):
                _post(
                    ctx, "Normal", "WorkloadCreated", f"created Workload {wl_name} in LocalQueue {queue_name}"
                )
            else:  # it exists, and the watch has not told us yet (an operator restart)
                core = admission.observe_workload(
                    await ctx.state.kube.read_workload(ctx.job.namespace, wl_name) or {}
                )
                if core is not None:
                    known[wl_name] = core
    queue = admission.queue_status(core, queue_name, wl_name)
    if core is None or not core.admitted:
        return dataclasses.replace(seen, queue=queue), True  # no pod until Kueue admits the Workload
    # Extra engines beyond the minimum: one lower-priority Workload each, a pod once admitted.
    current = [p for p in ctx.pods if p.attempt == ctx.attempt and not p.deleting]
    core_n, target = core_layout.rollout_pods, seen.layout.rollout_pods
    extra = {s.engine: s for s in known.values() if s.engine is not None}
    running = [p.index for p in current if p.role == names.ROLE_ROLLOUT]
    for index in sorted(set(range(core_n, target)) - set(extra)):
        pod = builders.build_rollout_pod(ctx.job, spec, seen.layout, index)
        wl = admission.engine_workload(
            ctx.job, pod, index, queue_name=queue_name, core_priority=core.priority
        )
        kopf.adopt(wl, owner=ctx.body)
        await ctx.state.kube.create(wl)
    release = admission.engines_to_release(core_n, target, extra, running)
    await _delete_pods(ctx, [names.rollout_pod_name(ctx.job.name, i) for i in release], why="kueue")
    for name in admission.stale_engine_workloads(core_n, target, extra, running):
        await ctx.state.kube.delete_workload(ctx.job.namespace, name)
    allowed = admission.admitted_engines(core_n, target, extra)
    admitted = admission.admitted_pod_sets(
        ctx.job.name, core, admission.pod_set_pods(trainers, rollouts), extra, range(core_n, allowed)
    )
    for wl, members in admitted:
        await _report_pods_ready(ctx, wl, {n for pods in members.values() for n in pods}, current)
    # The admitted flavors' placement, read only when a pod is to be created.
    placements: dict[str, admission.Placement] = {}
    present = {p.name for p in current}
    if any(n not in present for _, members in admitted for pods in members.values() for n in pods):
        flavor_names = admission.flavor_names(wl for wl, _ in admitted)
        flavors = {f: await ctx.state.kube.read_kueue_object("resourceflavors", f) for f in flavor_names}
        for wl, members in admitted:
            placements.update(admission.pod_placements(wl, members, flavors))
    queue = admission.queue_status(core, queue_name, wl_name, extra_engines_admitted=allowed - core_n)
    layout = builders.compute_layout(spec, seen.plan, allowed) if allowed != target else seen.layout
    return dataclasses.replace(seen, queue=queue, placements=placements, layout=layout), False


async def _step_preemption(ctx: _Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """Kueue evicted or preempted the job's Workload: cooperative preemption (`preemption.decide`).

    Ask the driver to checkpoint (status.checkpointRequest), wait for its acknowledgement in the
    SyncReports up to spec.preemption.checkpointGraceSeconds, delete the pods, and once none is
    left clear the reservation as Kueue's integrations do; the job is then Queued and resumes from
    that checkpoint when readmitted. The steps after this one run only when there is nothing to do."""
    labels = (ctx.body.get("metadata") or {}).get("labels") or {}
    try:
        queue_name = names.kueue_queue_name(labels)
    except ValueError:
        return seen, False  # the admission step names the bad label
    if queue_name is None:
        return seen, False
    wl_name = names.workload_name(ctx.job.name)
    core = ctx.state.workloads.get(ctx.key, {}).get(wl_name)
    grace = _spec_of(seen).preemption.checkpoint_grace_seconds
    decision = preemption.decide(
        core,
        ctx.old.checkpoint_request,
        preemption.acks_of(_reports(ctx)),
        ctx.pods,
        attempt=ctx.attempt,
        grace_s=grace,
        now=ctx.now,
    )
    if decision.action == "none":
        return seen, False
    assert core is not None
    message = preemption.summary(decision, wl_name, grace)
    if decision.action == "request":
        _post(ctx, "Normal", "CheckpointRequested", message)
        ctx.retry(0, "a checkpoint was requested")
    elif decision.action == "wait":
        ctx.retry(decision.wait_s, "waiting for the driver's checkpoint acknowledgement")
    elif decision.action == "stop":
        await _delete_pods(ctx, reconcile.pods_to_stop(ctx.pods, keep_finished=False), why="preempted")
        ctx.retry(WAIT_FOR_TERMINATION_S, "waiting for the preempted pods to terminate")
    elif decision.action == "release":
        body = await ctx.state.kube.read_workload(ctx.job.namespace, wl_name)
        if body is not None:
            await ctx.state.kube.apply_workload_status(
                preemption.release_apply(body, now=ctx.now), preemption.ADMISSION_FIELD_MANAGER
            )
        # Extra engines' Workloads hold quota for pods that are gone: the admission step queues
        # them again once the core is readmitted.
        for extra in list(ctx.state.workloads.get(ctx.key, {}).values()):
            if extra.engine is not None and not extra.deleting:
                await ctx.state.kube.delete_workload(ctx.job.namespace, extra.name)
        _post(ctx, "Normal", "Requeued", message)
    # While the driver checkpoints the job still runs under its admission, as far as users see.
    running = decision.action in ("request", "wait")
    queue = ctx.old.queue if running else admission.queue_status(core, queue_name, wl_name)
    return dataclasses.replace(seen, queue=queue, preemption=(decision, message)), True


def _kueue_managed(ctx: _Ctx) -> bool:
    return names.KUEUE_QUEUE_LABEL in ((ctx.body.get("metadata") or {}).get("labels") or {})


async def _workload_priority(
    ctx: _Ctx, spec: api.RLJobSpec, class_name: str | None, current: admission.WorkloadState | None
) -> admission.WorkloadPriority | None:
    """The Workload's priority: the label's WorkloadPriorityClass, else the trainer pool's
    PriorityClass; read from the class only when the Workload does not already name it."""
    kind, name = (
        ("WorkloadPriorityClass", class_name)
        if class_name
        else ("PriorityClass", spec.trainer_pool.priority_class_name)
    )
    if name is None:
        return None
    if current is not None and current.priority_class == (kind, name) and current.priority is not None:
        return admission.WorkloadPriority(kind=kind, name=name, value=current.priority)
    if kind == "WorkloadPriorityClass":
        obj = await ctx.state.kube.read_kueue_object("workloadpriorityclasses", name)
        field = f"metadata.labels[{names.KUEUE_PRIORITY_CLASS_LABEL}]"
    else:
        obj = await ctx.state.kube.read_priority_class(name)
        field = "spec.trainerPool.priorityClassName"
    if obj is None:
        raise admission.PriorityClassNotFoundError(
            field, f"{kind} {name!r} is not found: create it, or fix the name"
        )
    return admission.WorkloadPriority(kind=kind, name=name, value=int(obj.get("value") or 0))


async def _report_pods_ready(
    ctx: _Ctx, wl: admission.WorkloadState, pod_names: set[str], current: list[reconcile.PodObservation]
) -> None:
    """Tell Kueue whether the Workload's pods are up (its PodsReady condition, server-side applied)."""
    ready = pod_names <= {p.name for p in current if p.phase == "Running"}
    cond = admission.pods_ready_condition(wl, ready, now=ctx.now)
    if cond is not None:
        await ctx.state.kube.apply_workload_status(
            admission.condition_apply(wl, cond), admission.PODS_READY_FIELD_MANAGER
        )


async def _release_workloads(ctx: _Ctx) -> None:
    """A suspended job holds no quota: delete its Workloads (they are rebuilt when it resumes)."""
    for wl in list(ctx.state.workloads.get(ctx.key, {}).values()):
        if not wl.deleting:
            await ctx.state.kube.delete_workload(ctx.job.namespace, wl.name)


async def _finish_workloads(ctx: _Ctx) -> None:
    """A finished job gives its quota back: its Workloads get Finished=True, as Kueue's own jobs do."""
    outcome = "Succeeded" if ctx.old.phase == "Succeeded" else "Failed"
    for wl in ctx.state.workloads.get(ctx.key, {}).values():
        if wl.finished or wl.deleting:
            continue
        cond = admission.finished_condition(wl, outcome, now=ctx.now)
        await ctx.state.kube.apply_workload_status(
            admission.condition_apply(wl, cond), admission.FINISHED_FIELD_MANAGER
        )


def _plan_rollout_pods(ctx: _Ctx, seen: status.Observed) -> tuple[status.Observed, elastic.RolloutPodsPlan]:
    """Drains and lone replacements of rollout pods (`elastic.plan_rollout_pods`, pure), their
    Events, and the open drains and replacement count for `status.rollout`."""
    spec = _spec_of(seen)
    assert seen.layout is not None
    rollout = seen.rollout or ctx.old.rollout or api.RolloutStatus()
    plan = elastic.plan_rollout_pods(
        ctx.pods,
        attempt=ctx.attempt,
        target=seen.layout.rollout_pods,
        draining=rollout.draining_pods or [],
        reports=_reports(ctx),
        grace_s=spec.resources.rollout.drain_grace_seconds,
        now=ctx.now,
        node_names=frozenset(n.name for n in ctx.nodes_index.get("nodes", [])),
    )
    pod = functools.partial(names.pod_name, ctx.job.name, names.ROLE_ROLLOUT)
    started = sorted({d.index for d in plan.draining} - {d.index for d in rollout.draining_pods or []})
    if started:
        what = ", ".join(map(pod, started))
        _post(ctx, "Normal", "RolloutPodDraining", f"{what}: draining, deleted once the driver releases it")
    if plan.released:
        what = ", ".join(map(pod, plan.released))
        _post(ctx, "Normal", "RolloutPodReleased", f"the driver released {what}: deleting it")
    if plan.expired:
        what = ", ".join(map(pod, plan.expired))
        _post(
            ctx,
            "Normal",
            "RolloutPodDrained",
            f"{what}: not running, or no release within drainGraceSeconds: deleting it",
        )
    if plan.replace:
        why = "; ".join(r.why for r in plan.replace)
        _post(ctx, "Warning", "RolloutPodReplaced", f"{why}: recreating it alone (the trainers keep running)")
    if plan.retry_s is not None:
        ctx.retry(plan.retry_s, "a rollout pod's drain grace ends")
    update: dict[str, Any] = {"draining_pods": list(plan.draining) or None}
    if plan.replace:
        update["replaced_pods"] = (rollout.replaced_pods or 0) + len(plan.replace)
    if (rollout.draining_pods or None) != update["draining_pods"] or plan.replace:
        seen = dataclasses.replace(seen, rollout=rollout.model_copy(update=update))
    return seen, plan


#: The reconcile, in order. Each step returns what it observed; `compute_status` reads it all once.
STEPS: tuple[Step, ...] = (
    _step_finished,
    _step_plan,
    _step_suspend,
    _step_preemption,
    _step_outcome,
    _step_backoff,
    _step_children,
    _step_volumes,
    _step_capacity,
    _step_adapt,
    _step_admission,
    _step_gang,
    _step_pods,
)


# ---- step helpers --------------------------------------------------------------------------------
async def _model_config(ctx: _Ctx, spec: api.RLJobSpec) -> dict[str, Any]:
    src = spec.model.config
    if src.inline is not None:
        return dict(src.inline)
    if src.preset is not None:
        return presets.load_preset(src.preset)
    ref = src.config_map_ref
    if ref is None:
        raise errors.InvalidSpecError("spec.model.config", "set one of preset, inline or configMapRef")
    field = "spec.model.config.configMapRef"
    cm = await ctx.state.kube.read_config_map(ctx.job.namespace, ref.name)
    if cm is None:
        raise errors.ModelConfigUnreadableError(
            field,
            f"ConfigMap {ref.name!r} not found in namespace {ctx.job.namespace!r}: create it "
            f"(kubectl create configmap {ref.name} --from-file={ref.key}=config.json) or fix the name",
        )
    text = (cm.get("data") or {}).get(ref.key)
    if text is None:
        raise errors.ModelConfigUnreadableError(
            field,
            f"ConfigMap {ref.name!r} has no key {ref.key!r} (keys: {sorted(cm.get('data') or {})}): fix .key",
        )
    try:
        parsed = json.loads(text)
    except ValueError as exc:
        raise errors.ModelConfigUnreadableError(
            field,
            f"ConfigMap {ref.name!r} key {ref.key!r} is not JSON ({exc}): store config.json there",
        ) from exc
    if not isinstance(parsed, dict):
        raise errors.ModelConfigUnreadableError(
            field, f"key {ref.key!r} must hold a JSON object (config.json)"
        )
    return parsed


def _compute_plan(spec: api.RLJobSpec, model_config: dict[str, Any]) -> api.PlanStatus:
    """The estimator's plan (`planning.plan_job`: spec -> PlanRequest -> ResourcePlan) as a PlanStatus.

    Estimator errors carry their own reason; anything else is a bug and surfaces as InternalError.
    """
    return planning.plan_status(planning.plan_job(spec, model_config))


async def _plan(ctx: _Ctx, spec: api.RLJobSpec) -> tuple[api.PlanStatus, dict[str, Any]]:
    cache = ctx.state.caches.setdefault(ctx.key, Cache())
    if cache.generation == ctx.generation and cache.plan is not None and cache.model_config is not None:
        return cache.plan, cache.model_config
    model_config = await _model_config(ctx, spec)
    plan = _compute_plan(spec, model_config)
    cache.generation, cache.plan, cache.model_config, cache.applied = ctx.generation, plan, model_config, None
    cache.error = None
    return plan, model_config


async def _apply_children(ctx: _Ctx, objects: builders.JobObjects) -> None:
    cache = ctx.state.caches.setdefault(ctx.key, Cache())
    if cache.applied == objects.config_hash:
        return
    children = [dict(obj) for obj in objects.children]  # the telemetry ConfigMap: the driver owns its data
    config_map = dict(objects.config_map)
    for obj in [*children, config_map]:
        kopf.adopt(obj, owner=ctx.body)
    # Independent objects: create them concurrently (each is idempotent on its own).
    kube = ctx.state.kube
    await asyncio.gather(*(kube.create(obj) for obj in children), kube.apply_config_map(config_map))
    cache.applied = objects.config_hash


async def _delete_pods(ctx: _Ctx, pod_names: Sequence[str], *, why: str) -> None:
    deleted = []
    ours = ctx.state.deleted.setdefault(ctx.key, set())
    attempt_of = {p.name: p.attempt for p in ctx.pods}
    for pod_name in pod_names:
        ours.add((pod_name, attempt_of.get(pod_name, -1)))
        if await ctx.state.kube.delete_pod(ctx.job.namespace, pod_name):
            metrics.PODS_DELETED.labels(why).inc()
            deleted.append(pod_name)
    if deleted:
        _post(ctx, "Normal", "PodsDeleted", f"deleted {', '.join(deleted)} ({why})")


def _reports(ctx: _Ctx) -> list[telemetry.SyncReport]:
    raw = next(iter(ctx.telemetry_index.get((ctx.job.namespace, ctx.job.name), [])), "")
    try:
        return telemetry.parse_reports(raw)
    except ValueError as exc:  # json and pydantic errors: a bad write must not stop the job
        ctx.logger.warning(f"ignoring unreadable {telemetry.REPORTS_KEY}: {exc}")
        return []


async def _adapt(
    ctx: _Ctx,
    spec: api.RLJobSpec,
    plan: api.PlanStatus,
    layout: builders.JobLayout,
    reports: list[telemetry.SyncReport],
) -> api.RolloutStatus | None:
    """Call `policy.decide()`; the new targets (None: no change) are persisted with the status."""
    rollout = ctx.old.rollout or api.RolloutStatus()
    last = rollout.last_decision_time.timestamp() if rollout.last_decision_time else None
    shared_total = plan.shared_engines or 0
    state = policy.RolloutState(
        shared_engines_total=shared_total,
        shared_engines_awake=min(rollout.desired_shared_awake or 0, shared_total),
        dedicated_engines=layout.rollout_pods,
        planned_dedicated_engines=plan.rollout_engines or 0,
        idle_accelerators=layout.idle_accelerators,
        accelerators_per_engine=plan.tensor_parallel or 1,
        last_action_time_s=last,
    )
    settings = policy.PolicySettings.from_adaptive_spec(spec.resources.adaptive)
    decision = policy.decide(state, reports, settings, ctx.now.timestamp())
    if decision.action == "none":
        return None
    metrics.DECISIONS.labels(decision.action).inc()
    ctx.logger.info(f"adaptive decision {decision.action}: {decision.reason}")
    _post(ctx, "Normal", f"Adaptive{_camel(decision.action)}", decision.reason)
    return rollout.model_copy(
        update={
            "desired_shared_awake": decision.desired_shared_awake,
            "desired_dedicated_engines": decision.desired_dedicated_engines,
            "last_decision": _camel(decision.action),
            "last_decision_reason": decision.reason[:1024],
            "last_decision_time": ctx.now,
        }
    )


def _camel(action: str) -> str:
    return "".join(part.capitalize() for part in action.split("_"))


async def _write_status(ctx: _Ctx, observed: status.Observed) -> None:
    """The reconcile's one status write: compute, write only if changed, post Events on transitions."""
    new = status.compute_status(ctx.old, observed, generation=ctx.generation, now=ctx.now)
    patch = status.status_patch(ctx.old_raw, new)
    if patch is not None:
        ctx.state.remember(ctx.key, await ctx.state.kube.patch_status(ctx.job.namespace, ctx.job.name, patch))
        known = {c.type for c in ctx.old.conditions}
        for cond in status.transitions(ctx.old.conditions, new.conditions):
            kind = status.event_type(cond)
            if cond.type in known or kind == "Warning":  # a condition's first Normal value is no news
                _post(ctx, kind, cond.reason, cond.message or f"{cond.type}={cond.status}")
    if new.phase:
        ctx.state.phases[ctx.key] = new.phase
        metrics.set_phase_counts(ctx.state.phases)


def _post(ctx: _Ctx, type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
    """Queue an Event on the RLJob (posted after the status write), at most one per (job, reason)
    every EVENT_MIN_INTERVAL_S."""
    now_s = time.monotonic()
    mark = (ctx.key, reason)
    if not status.should_post(ctx.state.events.get(mark), now_s, EVENT_MIN_INTERVAL_S):
        return
    ctx.state.events[mark] = now_s
    ctx.events.append(builders.build_event(ctx.body, type_, reason, message, ctx.now))


async def _post_events(ctx: _Ctx) -> None:
    """Post the reconcile's Events; a lost Event never fails the reconcile (it is logged)."""
    for event in ctx.events:
        try:
            await ctx.state.kube.create(event)
        except Exception as exc:
            ctx.logger.warning(f"could not post Event {event['reason']} on {ctx.key}: {exc}")
    ctx.events.clear()


# ---- node-pool defaults (the chart's pools ConfigMap, rljob_operator.pools) ----------------------
POOLS_CONFIGMAP = os.environ.get("RLJOB_POOLS_CONFIGMAP", "")  # "<namespace>/<name>"; empty: no pools
POOLS_REFRESH_S = 10.0
_pools_read: list[tuple[float, pools.PoolCatalog]] = []


async def _pool_catalog(kube_: kube.Kube) -> pools.PoolCatalog:
    """The chart-rendered pool defaults, re-read at most every POOLS_REFRESH_S (helm upgrade applies)."""
    if not POOLS_CONFIGMAP:
        return pools.PoolCatalog()
    if _pools_read and time.monotonic() - _pools_read[0][0] < POOLS_REFRESH_S:
        return _pools_read[0][1]
    namespace, _, name = POOLS_CONFIGMAP.partition("/")
    cm = await kube_.read_config_map(namespace, name)
    catalog = pools.parse_pool_catalog(((cm or {}).get("data") or {}).get(pools.POOLS_KEY))
    _pools_read[:] = [(time.monotonic(), catalog)]
    return catalog


# ---- entry point ---------------------------------------------------------------------------------
LOG_LEVELS = ("DEBUG", "INFO", "WARNING")


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
    asyncio.run(
        kopf.operator(
            clusterwide=namespace is None,
            namespaces=[namespace] if namespace else (),
            standalone=standalone,
            liveness_endpoint=liveness_endpoint,
        )
    )

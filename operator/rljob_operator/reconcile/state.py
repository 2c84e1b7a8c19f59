"""The operator's in-memory state: one `State` per running operator (kopf's memo), and a `Cache`
per job of what a reconcile may reuse (the plan per generation, the children applied).

Everything here is filled by the watches (`handlers`) and read by the reconcile steps (`steps`);
`State.due` is how anything asks for a job's reconcile (`state.due[key] = time.monotonic()`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from rljob_operator import api, names
from rljob_operator.decide import admission, lifecycle, planning
from rljob_operator.kube import adapter, metrics, resync, trace

EMPTY_REPORTS = "[]"  # a telemetry ConfigMap as the operator creates it (no SyncReport yet)


@dataclasses.dataclass
class Cache:
    """What a reconcile may reuse: the plan per generation, the children applied per config. It
    belongs to one RLJob (`uid`): a job recreated under the same name starts from none."""

    uid: str | None = None
    generation: int | None = None
    model_config: dict[str, Any] | None = None
    judge_config: dict[str, Any] | None = None  # spec.reward.judge's config.json (None: no judge)
    plan: api.PlanStatus | None = None
    applied: str | None = None  # hash of the non-pod children last applied
    error: BaseException | None = None  # a spec error of this generation (waits for the next)
    # the plan refitted from the reports, keyed by (generation, newest report's step and time)
    refit: tuple[tuple[int, int, float], planning.JobRefit | None] | None = None


@dataclasses.dataclass
class State:
    kube: adapter.Kube
    locks: dict[str, asyncio.Lock] = dataclasses.field(default_factory=dict)
    caches: dict[str, Cache] = dataclasses.field(default_factory=dict)
    # (job key, RLJob uid, reason) -> monotonic s of the last Event posted: keyed by uid too, so an
    # RLJob recreated under the same name is not silenced by the earlier one's Events
    events: dict[tuple[str, str, str], float] = dataclasses.field(default_factory=dict)
    phases: dict[str, str] = dataclasses.field(default_factory=dict)
    # job key -> monotonic s of its next reconcile; `due[key] = time.monotonic()`: reconcile ASAP
    due: resync.DueTimes = dataclasses.field(default_factory=resync.DueTimes)
    # job key -> (namespace, name), and the newest RLJob body seen (watch or our write's response)
    jobs: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    latest: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # jobs whose last reconcile waits on something (a retryable error): a node change retries them
    waiting: set[str] = dataclasses.field(default_factory=set)
    nodes: dict[str, lifecycle.NodeObservation] = dataclasses.field(default_factory=dict)
    # native gang scheduling: (checked at, served) of the PodGroup API; job key -> minCount created
    pod_group_api: tuple[float, bool] | None = None
    gangs: dict[str, int] = dataclasses.field(default_factory=dict)
    # job key -> pod name -> (attempt, why, owner uid): pods seen disrupted (see rljob_pods)
    disrupted: dict[str, dict[str, tuple[int, str, str | None]]] = dataclasses.field(default_factory=dict)
    # job key -> pod name -> (attempt, owner uid): pods seen; and the names the operator deleted
    # itself, so that a pod of the attempt that is gone can be told from one not created yet or
    # deleted by us. The owner uid tells an earlier RLJob's pods (same name) from this one's.
    known: dict[str, dict[str, tuple[int, str | None]]] = dataclasses.field(default_factory=dict)
    deleted: dict[str, set[tuple[str, int]]] = dataclasses.field(default_factory=dict)
    # job key -> Workload name -> what it says (rljob_workloads, the Kueue watch)
    workloads: dict[str, dict[str, admission.WorkloadState]] = dataclasses.field(default_factory=dict)
    # job key -> pod name -> what the last pod event showed: an event that changes none of it
    # (a condition's timestamp, the pod IP) reconciles nothing
    pod_views: dict[str, dict[str, lifecycle.PodObservation]] = dataclasses.field(default_factory=dict)
    # job key -> the telemetry ConfigMap's reports as last seen (an unchanged write is no news)
    reports: dict[str, str] = dataclasses.field(default_factory=dict)
    # job key -> pod name -> (attempt, monotonic s): pods created and not yet seen in the watch
    created: dict[str, dict[str, tuple[int, float]]] = dataclasses.field(default_factory=dict)
    # job key -> monotonic s of the first status write put off (`resync.defer_status`)
    unwritten: dict[str, float] = dataclasses.field(default_factory=dict)
    # job key -> what SyncReports asked to post (checkpoint fallbacks, shared-engine wakes) and was posted
    report_events_posted: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    # job key -> API errors in a row (`resync.api_error_delay_s`: the job's backoff)
    api_failures: dict[str, int] = dataclasses.field(default_factory=dict)
    # Events being posted after their reconcile (kept referenced until done)
    posting: set[asyncio.Task[None]] = dataclasses.field(default_factory=set)
    resync: asyncio.Task[None] | None = None

    def observe_job(self, body: dict[str, Any]) -> None:
        """A watched RLJob: keep it when it is newer than what we know, and reconcile it soon.

        kopf handles each object's events apart (its streams are keyed by uid), so the events of an
        RLJob deleted and one recreated under its name can come in either order: a newer RLJob of
        another uid replaces all that was kept for the earlier one, and an older one's late event is
        dropped."""
        meta = body.get("metadata") or {}
        key = names.job_key(meta.get("namespace", ""), meta.get("name", ""))
        kept = self.latest.get(key)
        if kept is not None and (kept.get("metadata") or {}).get("uid") != meta.get("uid"):
            if not resync.is_newer(meta.get("resourceVersion"), kept["metadata"].get("resourceVersion")):
                return  # the earlier RLJob's, after the new one
            self.forget(key)
        if key not in self.jobs:
            trace.mark(key, "seen")
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

    def pod_changed(self, key: str, name: str, view: lifecycle.PodObservation | None) -> lifecycle.PodChange:
        """A pod event of job `key`: what it changed of what a reconcile acts on
        (`lifecycle.pod_change`; `view` None: the pod is gone)."""
        views = self.pod_views.setdefault(key, {})
        before = views.pop(name, None) if view is None else views.get(name)
        if view is not None:
            views[name] = view
        return lifecycle.pod_change(before, view)

    def seen_created(self, key: str, name: str, view: lifecycle.PodObservation | None) -> bool:
        """The watch shows pod `name` of job `key`: forget that this operator created it, and say
        whether it is just as created (this attempt, unbound, nothing wrong): no news then."""
        made = self.created.get(key, {}).pop(name, None)
        return (
            made is not None
            and view is not None
            and view.attempt == made[0]
            and view.phase == "Pending"
            and view.node_name is None
            and not (view.deleting or view.unschedulable or view.waiting_reason or view.disruption)
            and view.exit_code is None
        )

    def reports_changed(self, key: str, reports: str) -> bool:
        """A telemetry ConfigMap event of job `key`: whether its reports differ from the last seen
        (its creation, with no reports yet, is not news)."""
        reports = reports.strip() or EMPTY_REPORTS
        before = self.reports.get(key, EMPTY_REPORTS)
        self.reports[key] = reports
        return reports != before

    def cache_for(self, key: str, uid: str | None) -> Cache:
        """The reconcile cache of RLJob `uid` under `key`; one an earlier RLJob of the name left is
        dropped (its children applied are not this job's: they must be checked again)."""
        cache = self.caches.get(key)
        if cache is None or cache.uid != uid:
            cache = self.caches[key] = Cache(uid=uid)
        return cache

    def forget(self, key: str, uid: str | None = None) -> None:
        """A deleted job: drop everything kept for it. With `uid` (a DELETED event's), only while the
        job kept under `key` is that RLJob: a newer one of the same name may already be observed."""
        kept = (self.latest.get(key, {}).get("metadata") or {}).get("uid")
        if uid is not None and kept is not None and kept != uid:
            return
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
        self.pod_views.pop(key, None)
        self.created.pop(key, None)
        self.reports.pop(key, None)
        self.unwritten.pop(key, None)
        self.report_events_posted.pop(key, None)
        self.api_failures.pop(key, None)
        self.events = {mark: at for mark, at in self.events.items() if mark[0] != key}
        metrics.set_phase_counts(self.phases)

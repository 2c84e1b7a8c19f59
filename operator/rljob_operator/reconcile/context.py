"""One reconcile's context (`Ctx`) and what every step shares: the retry delays, the pods it
deletes, the Events it posts, the SyncReports it reads.

A step is `async (ctx, seen) -> (seen, stop)`: it reads what earlier steps observed
(`status.Observed`) and returns it extended, plus whether the list stops here (`steps.STEPS`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, Literal

import kopf

from rljob_operator import api, builders
from rljob_operator.decide import lifecycle
from rljob_operator.kube import metrics
from rljob_operator.reconcile import status
from rljob_operator.reconcile.state import State
from rljob_trainer.outputs import telemetry

EVENT_MIN_INTERVAL_S = float(os.environ.get("RLJOB_EVENT_INTERVAL_S", "30"))
# A terminating pod still holds its name; check again soon rather than at the next resync.
WAIT_FOR_TERMINATION_S = 1.0
RETRY_INTERNAL_ERROR_S = 5.0
# A job waiting for something no watch of ours sees (a ConfigMap, a claim): look again this often.
RETRY_WAITING_S = 10.0


@dataclasses.dataclass
class Ctx:
    """One reconcile's inputs (the RLJob as re-read inside the lock), shared by its steps."""

    state: State
    key: str
    job: builders.JobRef
    body: dict[str, Any]
    raw_spec: dict[str, Any]
    generation: int
    old: api.RLJobStatus
    old_raw: dict[str, Any]
    pods: list[lifecycle.PodObservation]
    telemetry_index: kopf.Index
    nodes_index: kopf.Index
    logger: Any
    now: datetime
    model_config: dict[str, Any] | None = None
    judge_config: dict[str, Any] | None = None
    config_hash: str = ""
    retry_s: float | None = None
    retry_why: str = ""
    api_error: bool = False  # an API error stopped this reconcile (the job's backoff grows)
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def retry(self, delay_s: float, why: str) -> None:
        """Ask kopf to run this reconcile again after `delay_s` (the soonest request wins)."""
        if self.retry_s is None or delay_s < self.retry_s:
            self.retry_s, self.retry_why = max(delay_s, 0.0), why

    def back_off(self, delay_s: float, why: str) -> None:
        """An API error stopped the steps: run again after exactly `delay_s` (the job's backoff
        wins over any sooner retry an earlier step asked for)."""
        self.retry_s, self.retry_why, self.api_error = max(delay_s, 0.0), why, True

    @property
    def attempt(self) -> int:
        return self.old.restarts or 0

    @property
    def uid(self) -> str | None:
        """The RLJob's uid: its children carry it in their controller ownerReference."""
        return (self.body.get("metadata") or {}).get("uid")


# A step reads what earlier steps observed and returns it extended, plus whether to stop here.
Step = Callable[[Ctx, status.Observed], Awaitable[tuple[status.Observed, bool]]]


def spec_of(seen: status.Observed) -> api.RLJobSpec:
    if seen.spec is None or seen.plan is None or seen.layout is None:
        raise RuntimeError("a step ran before the plan step")
    return seen.spec


async def delete_pods(ctx: Ctx, pod_names: Sequence[str], *, why: str) -> None:
    deleted = []
    ours = ctx.state.deleted.setdefault(ctx.key, set())
    attempt_of = {p.name: p.attempt for p in ctx.pods}
    uid_of = {p.name: p.uid for p in ctx.pods}  # the pod decided on, never one recreated since
    for pod_name in pod_names:
        ours.add((pod_name, attempt_of.get(pod_name, -1)))
        if await ctx.state.kube.delete_pod(ctx.job.namespace, pod_name, uid_of.get(pod_name)):
            metrics.PODS_DELETED.labels(why).inc()
            deleted.append(pod_name)
    if deleted:
        post(ctx, "Normal", "PodsDeleted", f"deleted {', '.join(deleted)} ({why})")


def sync_reports(ctx: Ctx) -> list[telemetry.SyncReport]:
    owner, raw = next(iter(ctx.telemetry_index.get((ctx.job.namespace, ctx.job.name), [])), (None, ""))
    if owner != ctx.uid:
        return []  # an earlier RLJob's of the same name, not yet garbage-collected: another run's
    try:
        return telemetry.parse_reports(raw)
    except ValueError as exc:  # json and pydantic errors: a bad write must not stop the job
        ctx.logger.warning(f"ignoring unreadable {telemetry.REPORTS_KEY}: {exc}")
        return []


def post(ctx: Ctx, type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
    """Queue an Event on the RLJob (posted after the status write), at most one per (job, reason)
    every EVENT_MIN_INTERVAL_S (a job: this RLJob, not an earlier one of the same name)."""
    now_s = time.monotonic()
    mark = (ctx.key, ctx.uid or "", reason)
    if not status.should_post(ctx.state.events.get(mark), now_s, EVENT_MIN_INTERVAL_S):
        return
    ctx.state.events[mark] = now_s
    ctx.events.append(builders.build_event(ctx.body, type_, reason, message, ctx.now))


async def post_events(ctx: Ctx) -> None:
    """Post the reconcile's Events; a lost Event never fails the reconcile (it is logged)."""
    for event in ctx.events:
        try:
            await ctx.state.kube.create(event)
        except Exception as exc:
            ctx.logger.warning(f"could not post Event {event['reason']} on {ctx.key}: {exc}")
    ctx.events.clear()

"""Rollout pods that come and go without the gang: two-phase scale-down and lone replacement.

Role: the pure half of the elastic rollout (issue 14, items 5 and 6). The handlers' pods step
asks `plan_rollout_pods` which dedicated rollout pods to keep while they drain, which to delete
now and which to replace, and writes the drains it returns to `status.rollout.drainingPods`
(so a restarted operator resumes them where they were). No clock, env or API: `now` comes in.

Two-phase scale-down. Lowering `status.rollout.desiredDedicatedEngines` below the running count
makes every rollout pod with index >= the target *draining*. The driver reads the target at its
next sync point, stops sending to that engine, finishes or requeues its requests and lists the
index in `SyncReport.releasedRolloutPods`. Only a report newer than the drain's start counts
(an old report about an earlier drain of the same index says nothing about this one). Without
an acknowledgement the pod goes `drainGraceSeconds` after the drain began: a driver that never
acks (older image, hung) must not hold accelerators forever, and the driver treats a pod that
vanishes under it as a lost engine, so the job goes on either way. A draining pod that is not
Running (never started, already ended) holds no engine and goes at once. Raising the target
again ends the drain and keeps the pod.

Lone replacement. A dedicated engine's pod that fails, ends, is evicted, loses its node, or is
listed in a `SyncReport.lostRolloutPods` whose interval began after the pod was created (the
driver dropped its engine: died or hung past `engineTimeoutSeconds`; a pod created within or after
that interval is already the replacement, since engines join only at sync points) is deleted and
recreated under the same name. The
trainer gang keeps running; restart count, failures and backoff are untouched
(`reconcile.decide_restart` reads only trainer pods). A pod deleted outside the operator needs
nothing here: the pod diff recreates a missing name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone

from rljob_operator import api, names
from rljob_operator.reconcile import PodObservation
from rljob_trainer.telemetry import SyncReport


@dataclasses.dataclass(frozen=True)
class Replacement:
    """A rollout pod to delete and recreate alone, and why (the sentence of its Event)."""

    name: str
    index: int
    why: str


@dataclasses.dataclass(frozen=True)
class RolloutPodsPlan:
    """What to do with the dedicated rollout pods this reconcile.

    - keep: names of draining pods to leave in place (not desired, not deleted yet).
    - draining: the drains still open, to persist in `status.rollout.drainingPods` (index order).
    - released / expired: indices deleted now because the driver acknowledged them, or because
      the grace period passed (or the pod holds no engine: not Running).
    - replace: pods whose engine was lost, to delete and recreate alone.
    - retry_s: seconds until the earliest open drain's grace ends (None: no open drain).
    """

    keep: tuple[str, ...] = ()
    draining: tuple[api.DrainingPod, ...] = ()
    released: tuple[int, ...] = ()
    expired: tuple[int, ...] = ()
    replace: tuple[Replacement, ...] = ()
    retry_s: float | None = None


def released_since(reports: Iterable[SyncReport], index: int, since_s: float) -> bool:
    """Whether a report taken after `since_s` (unix s) lists rollout pod `index` as released."""
    return any(r.time > since_s and index in r.released_rollout_pods for r in reports)


def _lost_why(pod: PodObservation, reports: Sequence[SyncReport], node_names: frozenset[str] | None) -> str:
    """Why the engine on this rollout pod is gone, or "" when it is not."""
    if pod.disruption:
        return f"pod {pod.name} was disrupted ({pod.disruption})"
    if node_names is not None and pod.node_name and pod.node_name not in node_names:
        return f"pod {pod.name} lost its node {pod.node_name}"
    if pod.phase in ("Failed", "Succeeded"):
        code = f" with exit code {pod.exit_code}" if pod.exit_code is not None else ""
        return f"pod {pod.name} ended ({pod.phase}{code})" + (f": {pod.message}" if pod.message else "")
    # The driver adds engines only at sync points, so an engine lost during a report's interval ran
    # on a pod that existed at the interval's start; a pod created since is its replacement.
    created = pod.created if pod.created is not None else float("inf")
    for r in reversed(reports):
        if pod.index in r.lost_rollout_pods and r.time - r.interval_s > created:
            return f"the driver dropped the engine on pod {pod.name} at step {r.step} (died or hung)"
    return ""


def plan_rollout_pods(
    pods: Iterable[PodObservation],
    *,
    attempt: int,
    target: int,
    draining: Sequence[api.DrainingPod],
    reports: Sequence[SyncReport],
    grace_s: float,
    now: datetime,
    node_names: frozenset[str] | None = None,
) -> RolloutPodsPlan:
    """Drains and replacements for the rollout pods of `attempt`, with `target` dedicated engines.

    `draining` is `status.rollout.drainingPods` as last written; `reports` the SyncReport history
    (oldest first); `grace_s` is `drainGraceSeconds`.
    """
    now_s = now.timestamp()
    since_of = {d.index: d.since for d in draining}
    mine = sorted(
        (p for p in pods if p.role == names.ROLE_ROLLOUT and p.attempt == attempt and not p.deleting),
        key=lambda p: p.index,
    )
    keep: list[str] = []
    still: list[api.DrainingPod] = []
    released: list[int] = []
    expired: list[int] = []
    replace: list[Replacement] = []
    retry: float | None = None
    for pod in mine:
        if pod.index < target:
            why = _lost_why(pod, reports, node_names)
            if why:
                replace.append(Replacement(pod.name, pod.index, why))
            continue
        since = since_of.get(pod.index, now)
        if since.tzinfo is None:
            since = since.replace(tzinfo=timezone.utc)
        if pod.phase != "Running" or released_since(reports, pod.index, since.timestamp()):
            (released if pod.phase == "Running" else expired).append(pod.index)
            continue
        left = since.timestamp() + grace_s - now_s
        if left <= 0:
            expired.append(pod.index)
            continue
        keep.append(pod.name)
        still.append(api.DrainingPod(index=pod.index, since=since))
        retry = left if retry is None else min(retry, left)
    return RolloutPodsPlan(
        keep=tuple(keep),
        draining=tuple(still),
        released=tuple(released),
        expired=tuple(expired),
        replace=tuple(replace),
        retry_s=retry,
    )

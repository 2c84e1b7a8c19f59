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
(`lifecycle.decide_restart` reads only trainer pods). A pod deleted outside the operator needs
nothing here: the pod diff recreates a missing name.

Replacement backoff. A rollout pod that keeps losing its engine (a crash loop: bad image, an
engine that dies at start) must not be recreated in a tight loop. Each index counts its losses in
a row (`status.rollout.replacementBackoff`, so an operator restart keeps them); the first
replacement is created at once, the n-th waits `lifecycle.backoff_s(n - 1, spec.restartPolicy)` (from
the end of the second the loss was seen in, `lifecycle.backoff_ends`)
(initialBackoffSeconds doubling up to maxBackoffSeconds, the gang's own settings, its own count).
The count resets once the pod has run for `BACKOFF_RESET_FACTOR` × maxBackoffSeconds (the
kubelet's CrashLoopBackOff resets after 10 minutes with its 5-minute cap).

Kueue preemption of an extra engine. An extra engine's Workload that Kueue evicts falls outside
the admitted engines (`admission.admitted_engines`), which lowers the target: its pod drains like
any other. Kueue evicts for a reason (a waiting higher-priority Workload, whose wait is bounded
by the evicted Workload's release), so such a drain's grace is `preempted_grace_s`: at most
`spec.preemption.checkpointGraceSeconds`, the patience the job grants Kueue for its own core.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone

from rljob_operator import api, names
from rljob_operator.decide import lifecycle
from rljob_operator.decide.lifecycle import PodObservation
from rljob_trainer.outputs.telemetry import SyncReport

BACKOFF_RESET_FACTOR = 2  # a replacement that ran this many maxBackoffSeconds is healthy again


def preempted_grace_s(spec: api.RLJobSpec) -> float:
    """The drain grace of an extra engine whose Workload Kueue evicted: the shorter of
    `resources.rollout.drainGraceSeconds` and `preemption.checkpointGraceSeconds` (the preempting
    Workload waits for this one's quota, and the job grants Kueue no more for its own core)."""
    return float(min(spec.resources.rollout.drain_grace_seconds, spec.preemption.checkpoint_grace_seconds))


@dataclasses.dataclass(frozen=True)
class Replacement:
    """A rollout pod to delete and recreate alone, and why (the sentence of its Event).

    `replacements`: its losses in a row, this one included; `not_before`: when the new pod may be
    created (the loss time for the first replacement, later once the backoff applies)."""

    name: str
    index: int
    why: str
    replacements: int = 1
    not_before: datetime | None = None


@dataclasses.dataclass(frozen=True)
class RolloutPodsPlan:
    """What to do with the dedicated rollout pods this reconcile.

    - keep: names of draining pods to leave in place (not desired, not deleted yet).
    - draining: the drains still open, to persist in `status.rollout.drainingPods` (index order).
    - released / expired: indices deleted now because the driver acknowledged them, or because
      the grace period passed (or the pod holds no engine: not Running).
    - replace: pods whose engine was lost, to delete and recreate alone.
    - hold: indices of desired rollout pods not to create yet (their replacement backoff runs).
    - backoff: the replacement backoffs to persist in `status.rollout.replacementBackoff`.
    - retry_s: seconds until the earliest open drain's grace or hold ends (None: neither).
    """

    keep: tuple[str, ...] = ()
    draining: tuple[api.DrainingPod, ...] = ()
    released: tuple[int, ...] = ()
    expired: tuple[int, ...] = ()
    replace: tuple[Replacement, ...] = ()
    hold: tuple[int, ...] = ()
    backoff: tuple[api.ReplacementBackoff, ...] = ()
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


def _aware(stamp: datetime) -> datetime:
    return stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=timezone.utc)


def _healthy(pod: PodObservation, record: api.ReplacementBackoff, reset_s: float, now_s: float) -> bool:
    """Whether the replacement ran long enough for its loss count to start over."""
    since = _aware(record.not_before).timestamp()
    if pod.created is not None:
        since = max(since, pod.created)
    return pod.phase == "Running" and now_s - since >= reset_s


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
    preempted: Mapping[int, str] | None = None,
    preempted_grace: float | None = None,
    backoff: Sequence[api.ReplacementBackoff] = (),
    restart_policy: api.RestartPolicySpec | None = None,
) -> RolloutPodsPlan:
    """Drains and replacements for the rollout pods of `attempt`, with `target` dedicated engines.

    `draining` is `status.rollout.drainingPods` as last written; `reports` the SyncReport history
    (oldest first); `grace_s` is `drainGraceSeconds`. `preempted` names the indices whose extra
    engine Workload Kueue evicted (index -> why); their drain's grace is at most `preempted_grace`
    (`preempted_grace_s`). `backoff` is `status.rollout.replacementBackoff` as last written, and
    `restart_policy` gives the backoff's settings (None: the defaults).
    """
    policy = restart_policy or api.RestartPolicySpec()
    reset_s = BACKOFF_RESET_FACTOR * policy.max_backoff_seconds
    now_s = now.timestamp()
    since_of = {d.index: d.since for d in draining}
    records = {b.index: b for b in backoff if b.attempt == attempt and b.index < target}
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

    def wake(left: float) -> None:
        nonlocal retry
        retry = left if retry is None else min(retry, left)

    for pod in mine:
        if pod.index < target:
            record = records.get(pod.index)
            why = _lost_why(pod, reports, node_names)
            if why:
                count = (record.replacements if record is not None else 0) + 1
                not_before = lifecycle.backoff_ends(now, lifecycle.backoff_s(count - 1, policy))
                records[pod.index] = api.ReplacementBackoff(
                    index=pod.index, attempt=attempt, replacements=count, not_before=not_before
                )
                replace.append(Replacement(pod.name, pod.index, why, count, not_before))
            elif record is not None and _healthy(pod, record, reset_s, now_s):
                del records[pod.index]
            continue
        since = _aware(since_of.get(pod.index, now))
        if pod.phase != "Running" or released_since(reports, pod.index, since.timestamp()):
            (released if pod.phase == "Running" else expired).append(pod.index)
            continue
        limit = grace_s
        if preempted and pod.index in preempted and preempted_grace is not None:
            limit = min(grace_s, preempted_grace)
        left = since.timestamp() + limit - now_s
        if left <= 0:
            expired.append(pod.index)
            continue
        keep.append(pod.name)
        still.append(api.DrainingPod(index=pod.index, since=since))
        wake(left)
    # A replaced pod, or one whose name is free while its backoff runs, waits to be created.
    up = {p.index for p in mine} - {r.index for r in replace}
    hold = []
    for index, record in sorted(records.items()):
        left = _aware(record.not_before).timestamp() - now_s
        if index not in up and left > 0:
            hold.append(index)
            wake(left)
    return RolloutPodsPlan(
        keep=tuple(keep),
        draining=tuple(still),
        released=tuple(released),
        expired=tuple(expired),
        replace=tuple(replace),
        hold=tuple(hold),
        backoff=tuple(records[i] for i in sorted(records)),
        retry_s=retry,
    )

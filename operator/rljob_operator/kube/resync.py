"""When each job is reconciled next: due times, wake-ups, which due job goes first, the
safety-net spread, object freshness, and what may wait for the next reconcile.

Role: the scheduling core of the operator's resync loop (`handlers._resync_loop`). Reconciles are
event-driven: a watch event on a job's RLJob, pods, telemetry ConfigMap or nodes marks the job
due at once (`DueTimes.soon`), a reconcile that waits for time (a backoff, a terminating pod, a
TTL) asks for its own retry, and the periodic resync is only a slow safety net, spread with
jitter so that hundreds of idle jobs never wake together. When more jobs are due than may run at
once, a job with pods still to create goes before one re-reconciled for a pod event (`pick`).

While a job's pods start, its status would change with every pod event ("0/2", "1/2" running):
`defer_status` lets such a write wait up to `STATUS_COALESCE_S` for the next change, so a job
is written Pending, then Running, not once per pod event in between. And
pods this operator just created may not be in the watch yet: `unseen_creates` names them, so that
a reconcile in between does not create them again (a 409 is a request too).

No API calls here; the only impurity is the asyncio wake-up, which is what lets
`state.due[key] = time.monotonic()` (the contract other steps use to trigger a reconcile) take
effect at once instead of at the next poll.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Collection, Iterable, Mapping

#: Why a job is due: a watch event or another component (`event`), the job's own retry (`retry`),
#: or the safety-net period (`resync`). The reconcile-latency metric is labelled with it.
Cause = str
EVENT, RETRY, RESYNC = "event", "retry", "resync"
#: The share of the safety-net period drawn at random, so jobs created together drift apart.
JITTER = 0.2
#: A job being reconciled right now is due "never" until its reconcile ends (`DueTimes.running`).
RUNNING = math.inf


class DueTimes(dict[str, float]):
    """Job key -> monotonic time its next reconcile is due; setting a time wakes the loop.

    Setting `due[key]` from outside (`due[key] = time.monotonic()`) is an event: the loop
    reconciles the job as soon as possible, also when it is running right now (then once more
    right after). `schedule` is the loop's own bookkeeping after a reconcile; it never pushes back
    an earlier time somebody asked for while the reconcile ran.
    """

    def __init__(self) -> None:
        super().__init__()
        self.causes: dict[str, Cause] = {}
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def __setitem__(self, key: str, when: float) -> None:
        super().__setitem__(key, when)
        self.causes[key] = EVENT
        self._notify()

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self.causes.pop(key, None)

    def pop(self, key: str, *default: float) -> float:  # type: ignore[override]
        self.causes.pop(key, None)
        return super().pop(key, *default)

    def soon(self, key: str, when: float) -> None:
        """Due at `when` at the latest (an earlier due time stays)."""
        if when < self.get(key, math.inf):  # RUNNING is infinite: a running job runs again
            self[key] = when

    def running(self, key: str) -> None:
        """The loop started reconciling `key`: not due again until `schedule` (or an event)."""
        super().__setitem__(key, RUNNING)

    def schedule(self, key: str, when: float, cause: Cause) -> None:
        """After a reconcile: next due at `when`, unless an event asked for earlier meanwhile."""
        current = self.get(key, RUNNING)
        if current != RUNNING and current <= when:
            return  # an event during the reconcile: it runs again first
        super().__setitem__(key, when)
        self.causes[key] = cause
        self._notify()

    def wake(self) -> None:
        """Wake the waiting loop without a new due time (a reconcile ended: a slot is free)."""
        self._notify()

    def _notify(self) -> None:
        loop = self._loop
        if loop is None:
            return  # the loop has not started waiting yet; it scans everything when it does
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            self._wake.set()
        else:  # a thread (a sync handler): asyncio objects are not thread-safe
            loop.call_soon_threadsafe(self._wake.set)

    async def wait(self, timeout_s: float) -> None:
        """Sleep until a due time is set or `timeout_s` passes; then the caller scans again."""
        self._loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(self._wake.wait(), max(timeout_s, 0.0))
        except asyncio.TimeoutError:
            pass
        finally:
            self._wake.clear()


def next_resync_s(interval_s: float, rand: Callable[[], float] = random.random) -> float:
    """The safety-net delay: `interval_s` minus up to `JITTER` of it, drawn at random."""
    return interval_s * (1.0 - JITTER * rand())


def next_delay_s(
    retry_s: float | None, interval_s: float, rand: Callable[[], float] = random.random
) -> tuple[float, Cause]:
    """When to reconcile again after a reconcile that asked for `retry_s` (None: nothing to wait for)."""
    if retry_s is None or retry_s >= interval_s:
        return next_resync_s(interval_s, rand), RESYNC
    return retry_s, RETRY


#: A job whose reconciles keep meeting API errors waits this long after the first, doubling per
#: error in a row up to the cap (client-go's per-item exponential backoff has the same shape).
API_BACKOFF_BASE_S = 5.0
API_BACKOFF_CAP_S = 300.0


def api_error_delay_s(
    failures: int, retry_after_s: float | None = None, rand: Callable[[], float] = random.random
) -> float:
    """When to reconcile a job again after its `failures`-th API error in a row.

    Exponential from API_BACKOFF_BASE_S to API_BACKOFF_CAP_S with "equal jitter" (half the step
    fixed, half drawn), so jobs failing together (an apiserver restart) come back spread out, and
    never sooner than the base; a 429's Retry-After is honoured when it asks for longer."""
    step = min(API_BACKOFF_CAP_S, API_BACKOFF_BASE_S * 2.0 ** max(0, failures - 1))
    delay = max(API_BACKOFF_BASE_S, step / 2 + rand() * step / 2)
    if retry_after_s is not None:
        delay = max(delay, min(retry_after_s, API_BACKOFF_CAP_S))
    return delay


def is_newer(candidate: str | None, known: str | None) -> bool:
    """Whether an object at resourceVersion `candidate` is newer than the copy at `known`.

    The watch and our own writes' responses both bring versions of an RLJob; the operator keeps
    the newest, so a watch event that lags behind our own status write never rolls it back. etcd's
    resourceVersions are revisions, increasing integers, and compared as such; versions that are
    not integers are opaque, and then whatever differs counts as newer (the watch is the truth).
    """
    if known is None:
        return True
    if candidate is None or candidate == known:
        return False
    if candidate.isdigit() and known.isdigit():
        return int(candidate) > int(known)
    return True


def pick(
    due: Mapping[str, float],
    now: float,
    *,
    running: Collection[str],
    slots: int,
    urgent: Callable[[str], bool],
) -> tuple[list[str], float]:
    """Which due jobs to start now, at most `slots`, and when the next of the others is due.

    Urgent jobs (`urgent(key)`: pods still to create) go first, then the earliest due. Jobs
    running now are skipped (they are due again only through `DueTimes.schedule`). A job due but
    left for lack of a slot does not set the next time: the loop is woken when a slot frees.
    """
    ready = [key for key, when in due.items() if when <= now and key not in running]
    later = [when for key, when in due.items() if when > now and key not in running]
    ready.sort(key=lambda key: (not urgent(key), due[key]))
    return ready[: max(slots, 0)], min(later, default=math.inf)


def wants_pods(attempt: int, pod_attempts: Iterable[int]) -> bool:
    """Whether a job has no pod of its current attempt yet: a new job, or one just restarted."""
    return all(a != attempt for a in pod_attempts)


#: How long a starting job's changed status may wait for the next reconcile before it is written.
STATUS_COALESCE_S = 1.0


def defer_status(
    *,
    old_phase: str | None,
    new_phase: str | None,
    starting: bool,
    deferred_since: float | None,
    now: float,
    window_s: float = STATUS_COALESCE_S,
) -> bool:
    """Whether a changed status may wait for the next reconcile instead of being written now.

    Only while a job's pods start (`starting`: every pod created or on its way, nothing wrong, no
    restart or decision to persist) and the job stays Pending, for at most `window_s` since the
    first write it put off. A job's first status (its plan, written by the reconcile that creates
    its pods) and any other change (Running, a failure, a restart's new attempt, Queued,
    Suspended) are written at once.
    """
    if not starting or new_phase != "Pending" or old_phase != "Pending":
        return False
    return deferred_since is None or now - deferred_since < window_s


#: How long a pod this operator created counts as existing while the watch has not shown it.
CREATED_MEMORY_S = 30.0


def unseen_creates(
    created: Mapping[str, tuple[int, float]],
    *,
    attempt: int,
    seen: Collection[str],
    now: float,
    memory_s: float = CREATED_MEMORY_S,
) -> set[str]:
    """Pods created by this operator for `attempt` (name -> (attempt, when)) and not yet `seen` in
    the watch, for at most `memory_s`: a reconcile must not create them again."""
    return {
        name
        for name, (made_for, when) in created.items()
        if made_for == attempt and name not in seen and now - when < memory_s
    }

"""Rollout dispatcher: the driver-side admission state and the load integral between sync points.

Role: owns which requests are queued, being dispatched and generating, and on which engine; admits
queued requests to awake engines up to their `max_num_seqs`; and integrates what it owns over
time, so each sync point can report `inflightRequestSeconds` (∫ requests in flight dt, queued +
dispatching + generating), `engineSeconds` (∫ awake engines dt) and `snapshotInflight` (the count at
the sync instant, what the seed's snapshot rule read). The state stays in this one object in the
driver process (the seed's bug was a load counter in another process that nobody wrote).

A request may be pinned to an engine (`submit(..., engine=)`): a multi-turn episode's later turns
go to the engine that served its first, whose prefix cache holds the episode so far. A pinned
request waits for its engine while that engine is awake and busy; once the engine is gone (removed:
lost or drained) or no longer awake, the pin is dropped and the request goes to any engine (the
episode continues there from its tokens, token-in/token-out: nothing is lost but the cache).

The clock is injected (monotonic seconds), so tests drive it exactly. Callers:
`rljob_trainer.driver` (generation loop and sync points), tests.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from enum import Enum


class Phase(str, Enum):
    QUEUED = "queued"
    DISPATCHING = "dispatching"
    GENERATING = "generating"


@dataclass(frozen=True)
class IntervalLoad:
    """Load over one interval between sync points (the dispatcher's part of a `SyncReport`)."""

    interval_s: float
    inflight_request_seconds: float
    engine_seconds: float
    snapshot_inflight: int


class Dispatcher:
    """Admission state of one driver. Every state change first integrates up to `clock()`."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._now = clock()
        self._interval_start = self._now
        self._next_id = 0
        self._phase: dict[int, Phase] = {}
        self._engine_of: dict[int, str] = {}
        self._pin: dict[int, str] = {}
        self._awake: dict[str, bool] = {}
        self._capacity: dict[str, int] = {}
        self._inflight_request_seconds = 0.0
        self._engine_seconds = 0.0

    # ---- integration -----------------------------------------------------------------------------
    def _advance(self) -> None:
        now = self._clock()
        dt = now - self._now
        if dt < 0:
            raise ValueError(f"clock went backwards by {-dt} s")
        self._inflight_request_seconds += self.inflight * dt
        self._engine_seconds += self.awake_engines * dt
        self._now = now

    @property
    def inflight(self) -> int:
        """Requests queued, being dispatched or generating."""
        return len(self._phase)

    @property
    def awake_engines(self) -> int:
        return sum(self._awake.values())

    def count(self, phase: Phase) -> int:
        return sum(1 for p in self._phase.values() if p is phase)

    def engine_inflight(self, engine: str) -> int:
        """Requests dispatched to (dispatching or generating on) `engine`."""
        return sum(1 for e in self._engine_of.values() if e == engine)

    # ---- engines ---------------------------------------------------------------------------------
    def set_engine(self, engine: str, *, awake: bool, capacity: int) -> None:
        """Register or update an engine: awake or asleep, and its admission limit (max_num_seqs)."""
        if capacity < 1:
            raise ValueError(f"engine {engine}: capacity must be >= 1, got {capacity}")
        self._advance()
        self._awake[engine] = awake
        self._capacity[engine] = capacity

    def remove_engine(self, engine: str) -> None:
        """Drop an engine; requests it held go back to the queue."""
        self._advance()
        for rid, e in list(self._engine_of.items()):
            if e == engine:
                del self._engine_of[rid]
                self._phase[rid] = Phase.QUEUED
        for rid in [r for r, e in self._pin.items() if e == engine]:
            del self._pin[rid]  # its episode continues on any engine
        self._awake.pop(engine, None)
        self._capacity.pop(engine, None)

    # ---- requests --------------------------------------------------------------------------------
    def submit(self, count: int, *, engine: str | None = None) -> list[int]:
        """Queue `count` new requests, pinned to `engine` when given (and registered); returns their ids."""
        self._advance()
        ids = list(range(self._next_id, self._next_id + count))
        self._next_id += count
        for rid in ids:
            self._phase[rid] = Phase.QUEUED
            if engine is not None and engine in self._awake:
                self._pin[rid] = engine
        return ids

    def pinned_to(self, rid: int) -> str | None:
        """The engine request `rid` waits for, if it is pinned."""
        return self._pin.get(rid)

    def admit(
        self,
        max_per_engine: int | None = None,
        *,
        engines: Collection[str] | None = None,
        requests: Collection[int] | None = None,
    ) -> dict[str, list[int]]:
        """Move queued requests (oldest first) to awake engines with free capacity, least loaded first.

        `max_per_engine` caps what one call hands each engine (one generate call); `engines` limits
        the call to those engines and `requests` to those request ids (e.g. engines colocated with
        training take only the step the trainer waits for). Returns {engine: request ids now
        DISPATCHING}; engines that got nothing are absent. A pinned request goes only to its engine
        while that engine is awake (it waits while the engine is busy), anywhere once it is not.
        """
        self._advance()
        queued = sorted(
            rid
            for rid, p in self._phase.items()
            if p is Phase.QUEUED and (requests is None or rid in requests)
        )
        awake = [
            e for e, is_awake in sorted(self._awake.items()) if is_awake and (engines is None or e in engines)
        ]
        free = {e: self._capacity[e] - self.engine_inflight(e) for e in awake}
        out: dict[str, list[int]] = {}
        for rid in queued:
            pin = self._pin.get(rid)
            if pin is not None and not self._awake.get(pin, False):
                del self._pin[rid]  # its engine sleeps or drains: the episode continues elsewhere
                pin = None
            candidates = [e for e, f in free.items() if f > 0 and (pin is None or e == pin)]
            if max_per_engine is not None:
                candidates = [e for e in candidates if len(out.get(e, [])) < max_per_engine]
            if not candidates:
                if pin is not None:
                    continue  # it waits for its own engine; the others may still go
                break
            engine = max(candidates, key=lambda e: (free[e], -len(out.get(e, []))))
            out.setdefault(engine, []).append(rid)
            free[engine] -= 1
            self._phase[rid] = Phase.DISPATCHING
            self._engine_of[rid] = engine
        return out

    def mark_generating(self, ids: Sequence[int]) -> None:
        """The engine acknowledged these requests and is generating them."""
        self._advance()
        for rid in ids:
            if self._phase.get(rid) is not Phase.DISPATCHING:
                raise ValueError(f"request {rid} is {self._phase.get(rid)}, not dispatching")
            self._phase[rid] = Phase.GENERATING

    def requeue(self, ids: Sequence[int]) -> None:
        """These dispatched requests go back to the queue (their engine was dropped or their output
        was too stale to train on)."""
        self._advance()
        for rid in ids:
            if rid not in self._phase:
                raise ValueError(f"request {rid} is not in flight")
            self._phase[rid] = Phase.QUEUED
            self._engine_of.pop(rid, None)

    def is_queued(self, rid: int) -> bool:
        return self._phase.get(rid) is Phase.QUEUED

    def finish(self, ids: Sequence[int]) -> None:
        """These requests are done (output received by the driver)."""
        self._advance()
        for rid in ids:
            if rid not in self._phase:
                raise ValueError(f"request {rid} is not in flight")
            del self._phase[rid]
            self._engine_of.pop(rid, None)
            self._pin.pop(rid, None)

    # ---- sync points -----------------------------------------------------------------------------
    def close_interval(self) -> IntervalLoad:
        """Integrate up to now, return the interval's load and start the next interval."""
        self._advance()
        load = IntervalLoad(
            interval_s=self._now - self._interval_start,
            inflight_request_seconds=self._inflight_request_seconds,
            engine_seconds=self._engine_seconds,
            snapshot_inflight=self.inflight,
        )
        self._interval_start = self._now
        self._inflight_request_seconds = 0.0
        self._engine_seconds = 0.0
        return load

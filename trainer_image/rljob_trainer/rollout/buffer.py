"""A staleness-bounded buffer of finished rollouts, for the asynchronous GRPO pipeline.

Role: dedicated engines generate step k+1's rollouts while the trainer trains step k, so a
rollout can reach the trainer after the weights it was sampled with have been replaced. Every
item here carries that weights version; `take` hands the trainer only items within `max_staleness`
versions of the trainer's and drops (or returns for regeneration) the rest, counting both.
`submit_budget` is the admission rule that keeps generation from running so far ahead that its
output would be stale on arrival (AReaL's bounded staleness): with B items per step, at most
(trainer_version + max_staleness + 1) · B items may have been started in total.

max_staleness 0 is the synchronous loop (only items from the current weights), 1 one-step-off.
An item is whatever the driver groups by (for GRPO, one prompt's group of completions, so a group's
advantages never mix weights versions it was not generated with).

Pure logic: no clock, no randomness, no I/O; the driver owns the only instance. Callers: the GRPO
driver (a later round wires it in), tests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

T = TypeVar("T")

OnStale = Literal["drop", "regenerate"]


@dataclass(frozen=True)
class Versioned(Generic[T]):
    """One finished rollout item and the weights version its engine generated it with."""

    item: T
    weights_version: int


@dataclass(frozen=True)
class Taken(Generic[T]):
    """What one `take` returned: the batch (None while fewer than asked are fresh), and the stale items
    removed on the way (to regenerate when the buffer's policy is "regenerate", else dropped)."""

    batch: list[Versioned[T]] | None
    stale: list[Versioned[T]] = field(default_factory=list)


def staleness(trainer_version: int, weights_version: int) -> int:
    """How many weight updates an item is behind the trainer (0 = on-policy)."""
    return trainer_version - weights_version


def submit_budget(*, trainer_version: int, max_staleness: int, items_per_step: int, started: int) -> int:
    """How many more items may start generating now without any being stale when trained on.

    `started` counts every item ever submitted (finished, buffered, in flight, dropped or consumed)
    minus those returned for regeneration. Step s (trained at trainer version s) takes items
    s·B..(s+1)·B-1 in order; an item started now uses weights version `trainer_version`, so it is
    within the bound if its step is at most trainer_version + max_staleness.
    """
    if max_staleness < 0 or items_per_step < 1:
        raise ValueError("max_staleness must be >= 0 and items_per_step >= 1")
    return max(0, (trainer_version + max_staleness + 1) * items_per_step - started)


class StalenessBuffer(Generic[T]):
    """FIFO of finished items, each tagged with its weights version, bounded in staleness."""

    def __init__(self, max_staleness: int, *, on_stale: OnStale = "drop") -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (0 = synchronous), got {max_staleness}")
        if on_stale not in ("drop", "regenerate"):
            raise ValueError(f"on_stale must be 'drop' or 'regenerate', got {on_stale!r}")
        self.max_staleness = max_staleness
        self.on_stale: OnStale = on_stale
        self._items: deque[Versioned[T]] = deque()
        self.produced = 0
        self.consumed = 0
        self.dropped_stale = 0
        self.regenerated = 0
        self._consumed_staleness: list[int] = []

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T, weights_version: int) -> None:
        """Add one finished item generated with `weights_version`."""
        self._items.append(Versioned(item, weights_version))
        self.produced += 1

    def extend(self, items: Iterable[T], weights_version: int) -> None:
        for item in items:
            self.put(item, weights_version)

    def evict_stale(self, trainer_version: int) -> list[Versioned[T]]:
        """Remove every item more than `max_staleness` versions behind; returns them (counted)."""
        fresh: deque[Versioned[T]] = deque()
        stale: list[Versioned[T]] = []
        for entry in self._items:
            if staleness(trainer_version, entry.weights_version) > self.max_staleness:
                stale.append(entry)
            else:
                fresh.append(entry)
        self._items = fresh
        if self.on_stale == "regenerate":
            self.regenerated += len(stale)
        else:
            self.dropped_stale += len(stale)
        return stale

    def take(self, count: int, trainer_version: int) -> Taken[T]:
        """The `count` oldest fresh items for the step trained at `trainer_version`, or no batch while
        fewer are fresh (the trainer waits). Stale items are evicted first, whatever the outcome."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        stale = self.evict_stale(trainer_version)
        if len(self._items) < count:
            return Taken(None, stale)
        batch = [self._items.popleft() for _ in range(count)]
        self.consumed += count
        self._consumed_staleness.extend(staleness(trainer_version, e.weights_version) for e in batch)
        return Taken(batch, stale)

    def metrics(self) -> dict[str, float]:
        """Counters since creation, named `rollout_buffer/*` (staleness over consumed items)."""
        consumed = self._consumed_staleness
        return {
            "rollout_buffer/produced": float(self.produced),
            "rollout_buffer/consumed": float(self.consumed),
            "rollout_buffer/buffered": float(len(self._items)),
            "rollout_buffer/dropped_stale": float(self.dropped_stale),
            "rollout_buffer/regenerated": float(self.regenerated),
            "rollout_buffer/staleness_mean": sum(consumed) / len(consumed) if consumed else 0.0,
            "rollout_buffer/staleness_max": float(max(consumed, default=0)),
        }

"""Unit tests for rljob_trainer.rollout.buffer: the staleness bound, drop vs regenerate, counters,
and the admission budget that keeps an in-order pipeline from producing stale items at all."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rljob_trainer.rollout import buffer
from rljob_trainer.rollout.buffer import StalenessBuffer


def test_synchronous_bound_trains_only_on_the_current_weights() -> None:
    buf: StalenessBuffer[str] = StalenessBuffer(0)
    buf.extend(["old-1", "old-2"], weights_version=3)
    buf.extend(["new-1", "new-2"], weights_version=4)
    taken = buf.take(2, trainer_version=4)
    assert taken.batch is not None
    assert [e.item for e in taken.batch] == ["new-1", "new-2"]
    assert [e.item for e in taken.stale] == ["old-1", "old-2"]
    m = buf.metrics()
    assert (
        m["rollout_buffer/dropped_stale"],
        m["rollout_buffer/consumed"],
        m["rollout_buffer/staleness_max"],
    ) == (
        2.0,
        2.0,
        0.0,
    )


def test_one_step_off_accepts_the_previous_weights_and_evicts_older() -> None:
    buf: StalenessBuffer[int] = StalenessBuffer(1)
    buf.put(1, weights_version=5)  # two behind at version 7: stale
    buf.put(2, weights_version=6)  # one behind: fine
    buf.put(3, weights_version=7)
    taken = buf.take(2, trainer_version=7)
    assert taken.batch is not None
    assert [(e.item, e.weights_version) for e in taken.batch] == [(2, 6), (3, 7)]
    assert [e.item for e in taken.stale] == [1]
    m = buf.metrics()
    assert m["rollout_buffer/staleness_mean"] == 0.5
    assert m["rollout_buffer/staleness_max"] == 1.0


def test_regenerate_returns_stale_items_and_counts_them_apart_from_drops() -> None:
    buf: StalenessBuffer[str] = StalenessBuffer(1, on_stale="regenerate")
    buf.put("prompt-a", weights_version=0)
    taken = buf.take(1, trainer_version=2)
    assert taken.batch is None
    assert [e.item for e in taken.stale] == ["prompt-a"]
    m = buf.metrics()
    assert m["rollout_buffer/regenerated"] == 1.0
    assert m["rollout_buffer/dropped_stale"] == 0.0


def test_too_few_fresh_items_means_wait_and_consumes_nothing() -> None:
    buf: StalenessBuffer[int] = StalenessBuffer(2)
    buf.extend([1, 2], weights_version=0)
    assert buf.take(3, trainer_version=0).batch is None
    assert len(buf) == 2
    assert buf.metrics()["rollout_buffer/consumed"] == 0.0
    buf.put(3, weights_version=1)
    taken = buf.take(3, trainer_version=1)
    assert taken.batch is not None and [e.item for e in taken.batch] == [1, 2, 3]  # FIFO


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_staleness": -1}, "max_staleness must be >= 0"),
        ({"max_staleness": 1, "on_stale": "keep"}, "on_stale must be 'drop' or 'regenerate'"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StalenessBuffer(**kwargs)  # type: ignore[arg-type]


def test_submit_budget_allows_max_staleness_steps_ahead() -> None:
    # 4 items per step: at version 0 with one-step-off, steps 0 and 1 may be generated.
    assert buffer.submit_budget(trainer_version=0, max_staleness=1, items_per_step=4, started=0) == 8
    assert buffer.submit_budget(trainer_version=0, max_staleness=0, items_per_step=4, started=4) == 0
    assert buffer.submit_budget(trainer_version=3, max_staleness=0, items_per_step=4, started=12) == 4
    assert buffer.submit_budget(trainer_version=0, max_staleness=0, items_per_step=4, started=9) == 0


def run_pipeline(
    *, max_staleness: int, items_per_step: int, steps: int, finishes: list[int], eager: int | None = None
) -> StalenessBuffer[int]:
    """Engines finish in submission order, `finishes[t]` items at tick t (cycled); the trainer takes a
    step whenever a full batch is fresh. `eager`: submit that many ahead, ignoring the budget."""
    buf: StalenessBuffer[int] = StalenessBuffer(max_staleness)
    in_flight: deque[tuple[int, int]] = deque()
    version = started = tick = 0
    while version < steps and tick < 10_000:
        if eager is None:
            budget = buffer.submit_budget(
                trainer_version=version,
                max_staleness=max_staleness,
                items_per_step=items_per_step,
                started=started,
            )
        else:
            budget = max(0, eager - len(in_flight))
        for _ in range(budget):
            in_flight.append((started, version))
            started += 1
        for _ in range(min(finishes[tick % len(finishes)], len(in_flight))):
            item, weights = in_flight.popleft()
            buf.put(item, weights)
        if buf.take(items_per_step, version).batch is not None:
            version += 1
        tick += 1
    assert version == steps, "the pipeline stalled"
    return buf


@settings(max_examples=80, deadline=None)
@given(
    st.integers(0, 3),
    st.integers(1, 6),
    st.lists(st.integers(0, 5), min_size=1, max_size=8).filter(lambda f: any(f)),
)
def test_in_order_pipeline_within_budget_never_drops_and_stays_in_bound(
    max_staleness: int, items_per_step: int, finishes: list[int]
) -> None:
    buf = run_pipeline(max_staleness=max_staleness, items_per_step=items_per_step, steps=6, finishes=finishes)
    m = buf.metrics()
    assert m["rollout_buffer/dropped_stale"] == 0.0
    assert m["rollout_buffer/staleness_max"] <= max_staleness


def test_generating_too_far_ahead_without_the_budget_drops_stale_items() -> None:
    buf = run_pipeline(max_staleness=0, items_per_step=2, steps=4, finishes=[3], eager=8)
    assert buf.metrics()["rollout_buffer/dropped_stale"] > 0

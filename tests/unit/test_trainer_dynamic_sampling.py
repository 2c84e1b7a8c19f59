"""DAPO's dynamic sampling (rljob_trainer.train.dynamic_sampling): groups split, refill, cap and top-up."""

from __future__ import annotations

from rljob_trainer.train import dynamic_sampling as ds


def _batch(rewards_per_group: list[list[float]], first_example: int = 0) -> ds.ScoredBatch:
    totals = [r for grp in rewards_per_group for r in grp]
    gids = [g for g, grp in enumerate(rewards_per_group) for _ in grp]
    return ds.ScoredBatch(
        [f"o{first_example + g}" for g in gids],
        [first_example + g for g in gids],
        gids,
        totals,
        {"acc": list(totals)},
    )


def test_groups_with_equal_rewards_are_told_apart() -> None:
    kept, dropped = ds.split_groups(_batch([[0, 0], [0, 1], [1, 1], [0.5, 0.2]]))
    assert kept == [[2, 3], [6, 7]] and dropped == [[0, 1], [4, 5]]


def test_fill_batch_refills_until_enough_informative_groups() -> None:
    rounds = iter([_batch([[0, 1], [1, 1]], 10), _batch([[0, 1], [0, 1]], 20)])
    out, m = ds.fill_batch(
        _batch([[0, 0], [0, 1]]), want_groups=3, max_rounds=5, generate=lambda: next(rounds)
    )
    assert out.example_ids == [1, 1, 10, 10, 20, 20] and out.group_ids == [0, 0, 1, 1, 2, 2]
    assert m == {
        "rollout/filtered_groups": 2.0,
        "rollout/generation_rounds": 3.0,
        "rollout/topped_up_groups": 0.0,
    }


def test_the_cap_tops_the_batch_up_with_dropped_groups() -> None:
    calls = []

    def generate() -> ds.ScoredBatch:
        calls.append(1)
        return _batch([[1, 1], [0, 0]], 10 * len(calls))

    out, m = ds.fill_batch(_batch([[0, 0], [0, 1]]), want_groups=2, max_rounds=2, generate=generate)
    assert len(calls) == 1 and len(out.groups()) == 2  # the batch keeps its size
    assert out.example_ids[:2] == [1, 1] and m["rollout/topped_up_groups"] == 1.0
    assert m["rollout/filtered_groups"] == 3.0

"""Unit tests for rljob_trainer.dp_balance: candidates, refinement, lower bound, plan and apply."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rljob_trainer import dp_balance
from rljob_trainer.dp_balance import CostModel, MicroBatchSpec, plan_dp_balance
from rljob_trainer.train import microbatch

COST = CostModel(per_token=100.0, per_token_squared=1.0, per_micro_batch=500.0)
SPECS = [
    MicroBatchSpec(packed=True, dynamic=False, micro_batch_size=2),
    MicroBatchSpec(packed=False, dynamic=False, micro_batch_size=2),
    MicroBatchSpec(packed=True, dynamic=True, max_tokens_per_micro_batch=600),
    MicroBatchSpec(packed=False, dynamic=True, max_tokens_per_micro_batch=600),
]
spec_strategy = st.sampled_from(SPECS)


def slowest(lengths: list[int], perm: tuple[int, ...] | list[int], dp: int, spec: MicroBatchSpec) -> float:
    return max(dp_balance.simulate_rank_costs(lengths, perm, dp, spec, COST))


@st.composite
def divisible_batches(draw: st.DrawFn) -> tuple[list[int], int]:
    dp = draw(st.sampled_from([2, 3, 4]))
    m = draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(1, 300), min_size=dp * m, max_size=dp * m))
    return lengths, dp


@settings(max_examples=120, deadline=None)
@given(divisible_batches(), spec_strategy)
def test_plan_is_never_worse_than_original_or_kk(batch: tuple[list[int], int], spec: MicroBatchSpec) -> None:
    lengths, dp = batch
    plan = plan_dp_balance(lengths, dp, micro_batch=spec, cost=COST)
    n = len(lengths)
    assert sorted(plan.permutation) == list(range(n))
    assert plan.rank_costs == tuple(dp_balance.simulate_rank_costs(lengths, plan.permutation, dp, spec, COST))
    kk = dp_balance.karmarkar_karp_equal_size([COST.sample_cost(x) for x in lengths], dp)
    kk_perm = [i for g in kk for i in g]
    after = max(plan.rank_costs)
    assert after <= max(plan.original_rank_costs)
    assert after <= slowest(lengths, kk_perm, dp, spec) * (1 + 1e-9)
    assert after >= dp_balance.lower_bound(lengths, dp, micro_batch=spec, cost=COST) * (1 - 1e-9)
    if plan.strategy == "original":
        assert plan.permutation == tuple(range(n))
    else:
        assert after < max(plan.original_rank_costs)
    # Per-rank sample counts are unchanged by construction: m per rank.
    assert all(len(plan.rank_indices(r)) == n // dp for r in range(dp))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=30), st.sampled_from([2, 3, 4]), spec_strategy)
def test_not_divisible_keeps_identity(lengths: list[int], dp: int, spec: MicroBatchSpec) -> None:
    if len(lengths) % dp == 0:
        lengths = [*lengths, 7]
    plan = plan_dp_balance(lengths, dp, micro_batch=spec, cost=COST)
    assert plan.permutation == tuple(range(len(lengths)))
    assert plan.strategy == "original"
    assert plan.metrics["dp_balance/divisible"] == 0.0
    assert plan.metrics["dp_balance/applied"] == 0.0


@settings(max_examples=80, deadline=None)
@given(divisible_batches(), spec_strategy, st.randoms(use_true_random=False))
def test_refinement_never_makes_slowest_slower(
    batch: tuple[list[int], int], spec: MicroBatchSpec, rng: random.Random
) -> None:
    lengths, dp = batch
    m = len(lengths) // dp
    perm = list(range(len(lengths)))
    rng.shuffle(perm)
    groups = [perm[r * m : (r + 1) * m] for r in range(dp)]
    k = microbatch.max_micro_batch_count([[lengths[i] for i in g] for g in groups], spec)

    def evaluate(group: list[int]) -> float:
        return dp_balance.rank_cost([lengths[i] for i in group], spec, COST, k)

    before = max(evaluate(g) for g in groups)
    weights = [COST.sample_cost(x) for x in lengths]
    for refined in (
        dp_balance.refine_by_swaps(groups, evaluate, weights),
        dp_balance.refine_by_swaps_reference(groups, evaluate, max_swaps=50),
    ):
        assert sorted(len(g) for g in refined) == [m] * dp
        assert sorted(i for g in refined for i in g) == sorted(perm)
        assert max(evaluate(g) for g in refined) <= before


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 400), min_size=2, max_size=24).filter(lambda x: len(x) % 2 == 0))
def test_fast_refinement_matches_reference_on_packed_two_ranks(lengths: list[int]) -> None:
    # Packed fixed batching has additive costs, where the bisect-guided candidates include the exact best
    # swap: the fast refinement must stop only at a swap-local optimum, like the exhaustive reference.
    spec = SPECS[0]
    m = len(lengths) // 2
    groups = [list(range(m)), list(range(m, 2 * m))]
    k = microbatch.max_micro_batch_count([[lengths[i] for i in g] for g in groups], spec)

    def evaluate(group: list[int]) -> float:
        return dp_balance.rank_cost([lengths[i] for i in group], spec, COST, k)

    weights = [COST.sample_cost(x) for x in lengths]
    fast = max(evaluate(g) for g in dp_balance.refine_by_swaps(groups, evaluate, weights))
    slow = max(evaluate(g) for g in dp_balance.refine_by_swaps_reference(groups, evaluate))
    start = max(evaluate(g) for g in groups)
    assert fast <= start and slow <= start
    # Both stop at a swap-local optimum: no single swap makes the slowest rank strictly lighter.
    for a, b in (
        dp_balance.refine_by_swaps(groups, evaluate, weights),
        dp_balance.refine_by_swaps_reference(groups, evaluate),
    ):
        top = max(evaluate(a), evaluate(b))
        for x, y in itertools.product(range(m), range(m)):
            na = [*a[:x], b[y], *a[x + 1 :]]
            nb = [*b[:y], a[x], *b[y + 1 :]]
            assert max(evaluate(na), evaluate(nb)) >= top * (1 - 1e-9)


def _optimal_slowest(lengths: list[int], dp: int, spec: MicroBatchSpec) -> float:
    # Reference optimum over all equal-size assignments (small n only).
    n, m = len(lengths), len(lengths) // dp
    best = float("inf")
    for perm in itertools.permutations(range(n)):
        if any(list(perm[r * m : (r + 1) * m]) != sorted(perm[r * m : (r + 1) * m]) for r in range(dp)):
            continue
        best = min(best, slowest(lengths, perm, dp, spec))
    return best


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=6, max_size=6), spec_strategy)
def test_lower_bound_is_below_the_exhaustive_optimum(lengths: list[int], spec: MicroBatchSpec) -> None:
    for dp in (2, 3):
        optimum = _optimal_slowest(lengths, dp, spec)
        bound = dp_balance.lower_bound(lengths, dp, micro_batch=spec, cost=COST)
        assert 0 < bound <= optimum * (1 + 1e-9)
        plan = plan_dp_balance(lengths, dp, micro_batch=spec, cost=COST)
        assert max(plan.rank_costs) >= optimum * (1 - 1e-9)


def test_refinement_beats_kk_on_a_known_batch() -> None:
    # KK and snake both leave a gap on this skewed batch; the swap refinement closes it.
    rng = random.Random(3)
    lengths = [rng.choice([1200, 1200, rng.randint(150, 500)]) for _ in range(64)]
    spec = SPECS[0]
    plan = plan_dp_balance(lengths, 4, micro_batch=spec, cost=COST)
    no_refine = plan_dp_balance(lengths, 4, micro_batch=spec, cost=COST, refine=False)
    assert max(plan.rank_costs) <= max(no_refine.rank_costs)
    bound = dp_balance.lower_bound(lengths, 4, micro_batch=spec, cost=COST)
    assert max(plan.rank_costs) / bound < 1.005


def test_cost_model_from_hidden_size_matches_derivation() -> None:
    cost = CostModel.from_hidden_size(1024)
    assert cost.per_token == 12 * 1024
    assert cost.per_token_squared == 1.0
    gated = CostModel.from_hf_config({"text_config": {"hidden_size": 2560, "intermediate_size": 9728}})
    assert gated.per_token == 4 * 2560 + 3 * 9728


def test_micro_batch_cost_padded_vs_packed() -> None:
    assert COST.micro_batch_cost([10, 20], packed=True) == 500 + 100 * 30 + 100 + 400
    assert COST.micro_batch_cost([10, 20], packed=False) == 500 + 2 * (100 * 20 + 400)


def test_snake_order_deals_longest_first() -> None:
    groups = dp_balance.snake_order([10, 9, 8, 7, 6, 5], 2)
    assert groups == [[0, 3, 4], [1, 2, 5]]


def test_metrics_and_clock() -> None:
    ticks = iter([1.0, 1.25])
    lengths = [1000, 10, 1000, 10, 1000, 10, 1000, 10]
    plan = plan_dp_balance(
        [1000, 1000, 1000, 1000, 10, 10, 10, 10],
        2,
        micro_batch=SPECS[0],
        cost=COST,
        clock=lambda: next(ticks),
    )
    assert plan.applied
    assert plan.metrics["dp_balance/plan_ms"] == pytest.approx(250.0)
    assert plan.metrics["dp_balance/applied"] == 1.0
    assert plan.metrics["dp_balance/strategy_name"] == plan.strategy
    assert plan.metrics["dp_balance/strategy"] == dp_balance.STRATEGY_CODES[plan.strategy]
    assert plan.metrics["dp_balance/imbalance_after"] == pytest.approx(1.0)
    assert plan.metrics["dp_balance/slowest_cost_before"] > plan.metrics["dp_balance/slowest_cost_after"]
    assert all(key.startswith("dp_balance/") for key in plan.metrics)
    balanced = plan_dp_balance(lengths, 2, micro_batch=SPECS[0], cost=COST)
    assert max(balanced.rank_costs) <= max(balanced.original_rank_costs)


def test_apply_reorders_lists_numpy_torch_and_fields_consistently() -> None:
    torch = pytest.importorskip("torch")
    lengths = [900, 900, 900, 900, 5, 5, 5, 5]
    plan = plan_dp_balance(lengths, 2, micro_batch=SPECS[0], cost=COST)
    assert plan.applied
    perm = list(plan.permutation)
    ids = [[i] * lengths[i] for i in range(8)]
    mm = [[[i % 2] * lengths[i]] for i in range(8)]  # nested [1, L], as rollouts store it
    fields = {
        "input_ids": ids,
        "mm_token_type_ids": mm,
        "advantages": np.arange(8.0),
        "old_log_probs": torch.arange(8.0).unsqueeze(1).repeat(1, 3),
        "rewards": tuple(range(8)),
    }
    out = plan.apply_fields(fields)
    assert out["input_ids"] == [ids[i] for i in perm]
    assert out["mm_token_type_ids"] == [mm[i] for i in perm]
    assert all(len(a) == len(b[0]) for a, b in zip(out["input_ids"], out["mm_token_type_ids"], strict=True))
    assert out["advantages"].tolist() == [float(i) for i in perm]
    assert out["old_log_probs"][:, 0].tolist() == [float(i) for i in perm]
    assert out["rewards"] == tuple(perm)
    assert plan.restore(out["advantages"]).tolist() == list(np.arange(8.0))
    with pytest.raises(ValueError, match="field 'scalar'"):
        plan.apply_fields({"scalar": [1, 2, 3]})


def _equal_partitions(items: list[int], parts: int) -> list[list[list[int]]]:
    # Every partition of `items` into `parts` unordered groups of equal size (small inputs only).
    if parts == 1:
        return [[items]]
    size = len(items) // parts
    first, rest = items[0], items[1:]
    out: list[list[list[int]]] = []
    for others in itertools.combinations(rest, size - 1):
        group = [first, *others]
        remaining = [i for i in rest if i not in others]
        out.extend([group, *tail] for tail in _equal_partitions(remaining, parts - 1))
    return out


def _optimum_by_partitions(lengths: list[int], dp: int, spec: MicroBatchSpec) -> float:
    return min(
        slowest(lengths, [i for g in groups for i in g], dp, spec)
        for groups in _equal_partitions(list(range(len(lengths))), dp)
    )


PADDED_EXHAUSTIVE = [
    (2, MicroBatchSpec(packed=False, dynamic=False, micro_batch_size=2)),  # m=4: 2 + 2 (block bound)
    (4, MicroBatchSpec(packed=False, dynamic=False, micro_batch_size=1)),  # m=2: 1 + 1 (block bound)
    (2, MicroBatchSpec(packed=False, dynamic=False, micro_batch_size=3)),  # m=4: 2 + 2
    (2, MicroBatchSpec(packed=False, dynamic=True, max_tokens_per_micro_batch=600)),
    (4, MicroBatchSpec(packed=False, dynamic=True, max_tokens_per_micro_batch=400)),
]


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(1, 300), min_size=8, max_size=8),
    st.sampled_from(PADDED_EXHAUSTIVE),
)
def test_padded_bound_is_below_the_exhaustive_optimum_and_often_tight(
    lengths: list[int], case: tuple[int, MicroBatchSpec]
) -> None:
    dp, spec = case
    optimum = _optimum_by_partitions(lengths, dp, spec)
    bound = dp_balance.lower_bound(lengths, dp, micro_batch=spec, cost=COST)
    assert 0 < bound <= optimum * (1 + 1e-9)
    plan = plan_dp_balance(lengths, dp, micro_batch=spec, cost=COST)
    assert optimum * (1 - 1e-9) <= max(plan.rank_costs)
    if (
        not spec.dynamic
        and (len(lengths) // dp) % math.ceil(len(lengths) // dp / (spec.micro_batch_size or 1)) == 0
    ):
        # Equal-size padded micro-batches with k <= 2 per rank: the block bound is the exact optimum,
        # and the block planner reaches it.
        assert bound == pytest.approx(optimum, rel=1e-9)
        assert max(plan.rank_costs) == pytest.approx(optimum, rel=1e-9)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=10, max_size=10))
def test_padded_fixed_unequal_sizes_bound_below_optimum(lengths: list[int]) -> None:
    # m = 5 with micro_batch_size 2: sizes 1, 2, 2 per rank (no block bound; the order bound applies).
    spec = MicroBatchSpec(packed=False, dynamic=False, micro_batch_size=2)
    optimum = _optimum_by_partitions(lengths, 2, spec)
    bound = dp_balance.lower_bound(lengths, 2, micro_batch=spec, cost=COST)
    assert 0 < bound <= optimum * (1 + 1e-9)
    assert max(plan_dp_balance(lengths, 2, micro_batch=spec, cost=COST).rank_costs) >= optimum * (1 - 1e-9)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 400), min_size=4, max_size=48),
    st.sampled_from([1, 2, 3, 4, 5]),
    st.booleans(),
    st.randoms(use_true_random=False),
)
def test_fast_fixed_evaluator_matches_the_planner(
    lengths: list[int], mbs: int, packed: bool, rng: random.Random
) -> None:
    spec = MicroBatchSpec(packed=packed, dynamic=False, micro_batch_size=mbs)
    m = max(1, len(lengths) // 2)
    group = rng.sample(range(len(lengths)), m)
    k = math.ceil(m / mbs)
    fast = dp_balance._fixed_rank_evaluator(lengths, spec, COST, m, k)(group)
    exact = dp_balance.rank_cost([lengths[i] for i in group], spec, COST, k)
    assert fast == pytest.approx(exact, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(divisible_batches(), st.sampled_from([1, 2, 3, 4]))
def test_block_order_keeps_counts_and_prices_ranks_as_their_blocks(
    batch: tuple[list[int], int], mbs: int
) -> None:
    lengths, dp = batch
    groups = dp_balance.padded_fixed_block_order(lengths, dp, mbs, COST)
    assert groups is not None
    m = len(lengths) // dp
    assert [len(g) for g in groups] == [m] * dp
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    spec = MicroBatchSpec(packed=False, dynamic=False, micro_batch_size=mbs)
    k = math.ceil(m / mbs)
    # Every rank's cost is at least its share of the cheapest total (the blocks), and the plan never
    # loses to its block candidate.
    perm = [i for g in groups for i in g]
    plan = plan_dp_balance(lengths, dp, micro_batch=spec, cost=COST)
    assert max(plan.rank_costs) <= slowest(lengths, perm, dp, spec) * (1 + 1e-9)
    blocks = dp_balance._padded_fixed_blocks(lengths, dp, k, COST)
    if blocks is not None:
        total = sum(c for _, c in blocks)
        assert sum(dp_balance.simulate_rank_costs(lengths, perm, dp, spec, COST)) == pytest.approx(total)


def test_padded_fixed_plan_reaches_the_block_bound_on_a_grpo_like_batch() -> None:
    # Long truncated groups next to short ones: per-sample KK pays padding inside every rank; dealing
    # whole sorted micro-batches does not. The old bound (additive + total / P) was 4-10% below.
    rng = random.Random(11)
    lengths = [rng.choice([1200, 1200, rng.randint(150, 900)]) for _ in range(128)]
    spec = MicroBatchSpec(packed=False, dynamic=False, micro_batch_size=4)
    plan = plan_dp_balance(lengths, 4, micro_batch=spec, cost=COST)
    bound = dp_balance.lower_bound(lengths, 4, micro_batch=spec, cost=COST)
    kk = dp_balance.karmarkar_karp_equal_size([COST.sample_cost(x) for x in lengths], 4)
    kk_cost = slowest(lengths, [i for g in kk for i in g], 4, spec)
    assert max(plan.rank_costs) / bound < 1.01
    assert kk_cost / bound > 1.03
    assert max(plan.rank_costs) < kk_cost
    assert plan.strategy.startswith("blocks")


def _grpo_like(rng: random.Random, n: int, completion_cap: int) -> list[int]:
    # Right-skewed body plus a spike at the completion cap, prompts shared by groups of 4.
    lengths: list[int] = []
    while len(lengths) < n:
        prompt = rng.randint(90, 160)
        for _ in range(4):
            if rng.random() < 0.2:
                lengths.append(prompt + completion_cap)
            else:
                lengths.append(prompt + min(completion_cap, int(rng.lognormvariate(math.log(200), 0.6))))
    return lengths[:n]


def _padded_dynamic_exhaustive_cases() -> list[tuple[list[int], int, MicroBatchSpec]]:
    rng = random.Random(2024)
    cases = []
    for _ in range(14):
        dp, m = rng.choice([(2, 2), (2, 3), (2, 4), (3, 2), (3, 3), (3, 4)])
        lengths = _grpo_like(rng, dp * m, 512)
        cap = int(rng.choice([1.0, 1.5, 2.0, 2.5, 3.0]) * 672)
        cases.append(
            (lengths, dp, MicroBatchSpec(packed=False, dynamic=True, max_tokens_per_micro_batch=cap))
        )
    return cases


def test_padded_dynamic_bound_is_valid_and_tight_against_exhaustive_optima() -> None:
    # Findings behind `lower_bound`'s first-fit-decreasing terms: on small GRPO-like batches the planner
    # is at (or within 0.1% on average of) the optimum, so the gap the benchmark showed was the bound's:
    # the relaxed bound (also the only one for karmarkar_karp batching) lets a rank group its samples
    # freely, e.g. a long sample alone, while first-fit decreasing always fills its micro-batch.
    cost = CostModel.from_hidden_size(2560, intermediate_size=9728)
    ratios, relaxed_ratios = [], []
    for lengths, dp, spec in _padded_dynamic_exhaustive_cases():
        optimum = min(
            max(dp_balance.simulate_rank_costs(lengths, [i for g in groups for i in g], dp, spec, cost))
            for groups in _equal_partitions(list(range(len(lengths))), dp)
        )
        bound = dp_balance.lower_bound(lengths, dp, micro_batch=spec, cost=cost)
        assert 0 < bound <= optimum * (1 + 1e-9)
        kk_spec = spec.model_copy(update={"dynamic_algorithm": "karmarkar_karp"})
        kk_optimum = min(
            max(dp_balance.simulate_rank_costs(lengths, [i for g in groups for i in g], dp, kk_spec, cost))
            for groups in _equal_partitions(list(range(len(lengths))), dp)
        )
        relaxed = dp_balance.lower_bound(lengths, dp, micro_batch=kk_spec, cost=cost)
        assert 0 < relaxed <= kk_optimum * (1 + 1e-9)
        plan = plan_dp_balance(lengths, dp, micro_batch=spec, cost=cost)
        assert max(plan.rank_costs) >= optimum * (1 - 1e-9)
        ratios.append(optimum / bound)
        relaxed_ratios.append(optimum / relaxed)
    # Measured: bound 0.7% below the optimum on average (5% at worst); relaxed 4.4% (18% at worst).
    assert sum(ratios) / len(ratios) < 1.015
    assert sum(relaxed_ratios) / len(relaxed_ratios) > 1.03


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 300), min_size=8, max_size=8),
    st.sampled_from([150, 300, 450, 600, 900]),
    st.sampled_from(["first_fit_decreasing", "karmarkar_karp"]),
)
def test_padded_dynamic_bound_below_optimum_with_spikes(lengths: list[int], cap: int, algorithm: str) -> None:
    # Spikes at the longest length exercise the "rank holding q copies of the longest" terms.
    lengths = [max(lengths) if x % 3 == 0 else x for x in lengths]
    cap = max(cap, max(lengths))
    spec = MicroBatchSpec(
        packed=False, dynamic=True, max_tokens_per_micro_batch=cap, dynamic_algorithm=algorithm
    )  # type: ignore[arg-type]
    for dp in (2, 4):
        optimum = _optimum_by_partitions(lengths, dp, spec)
        bound = dp_balance.lower_bound(lengths, dp, micro_batch=spec, cost=COST)
        assert 0 < bound <= optimum * (1 + 1e-9)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 700), min_size=1, max_size=40),
    st.integers(300, 2000),
    st.integers(1, 8),
    st.randoms(use_true_random=False),
)
def test_fast_padded_dynamic_evaluator_matches_the_planner(
    lengths: list[int], cap: int, k: int, rng: random.Random
) -> None:
    spec = MicroBatchSpec(packed=False, dynamic=True, max_tokens_per_micro_batch=cap)
    group = rng.sample(range(len(lengths)), rng.randint(1, len(lengths)))
    fast = dp_balance._padded_greedy_rank_evaluator(lengths, spec, COST, k)(group)
    exact = dp_balance.rank_cost([lengths[i] for i in group], spec, COST, k)
    assert fast == exact or fast == pytest.approx(exact, rel=1e-12)


def test_padded_dynamic_one_spike_per_rank_bound_is_tight() -> None:
    # DP=8, 8 samples per rank, GSM8K-like with a few responses at the cap: the rank holding a spike
    # needs a second micro-batch and first-fit decreasing pads 3 samples to the spike's length. The
    # relaxed bound assumed the spike could sit alone and was ~35% below the plan.
    rng = random.Random(5)
    lengths = [rng.randint(220, 320) for _ in range(62)] + [650, 672]
    spec = MicroBatchSpec(packed=False, dynamic=True, max_tokens_per_micro_batch=2688)
    cost = CostModel.from_hidden_size(2560, intermediate_size=9728)
    plan = plan_dp_balance(lengths, 8, micro_batch=spec, cost=cost)
    bound = dp_balance.lower_bound(lengths, 8, micro_batch=spec, cost=cost)
    assert max(plan.rank_costs) / bound < 1.03


def test_padded_dynamic_bound_allows_a_larger_shared_count() -> None:
    # Here the best plan runs more micro-batches than the fewest every rank needs (k_lo): the spike rank's
    # greedy micro-batch gets split, cheaper than the unsplit greedy plan the k_lo terms assume. Found by
    # exhaustive search against a bound that wrongly applied those terms to every k.
    lengths = [300, 300, 203, 236, 86, 300, 181, 214]
    spec = MicroBatchSpec(packed=False, dynamic=True, max_tokens_per_micro_batch=450)
    optimum = _optimum_by_partitions(lengths, 2, spec)
    assert optimum == pytest.approx(337292.0)
    assert dp_balance.lower_bound(lengths, 2, micro_batch=spec, cost=COST) <= optimum * (1 + 1e-9)

"""Unit tests for rljob_trainer.train.microbatch: the planner the trainer executes, dp_balance simulates."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rljob_trainer.train import microbatch
from rljob_trainer.train.microbatch import MicroBatchSpec

PACKED_FIXED = MicroBatchSpec(packed=True, dynamic=False, micro_batch_size=3)
PADDED_FIXED = MicroBatchSpec(packed=False, dynamic=False, micro_batch_size=3)


def dynamic(packed: bool, cap: int, algorithm: str = "first_fit_decreasing") -> MicroBatchSpec:
    return MicroBatchSpec(
        packed=packed, dynamic=True, max_tokens_per_micro_batch=cap, dynamic_algorithm=algorithm
    )


def is_partition(plan: list[list[int]], n: int) -> bool:
    flat = [i for mb in plan for i in mb]
    return sorted(flat) == list(range(n)) and all(mb for mb in plan)


def test_spec_rejects_mixed_modes() -> None:
    with pytest.raises(ValidationError, match="max_tokens_per_micro_batch"):
        MicroBatchSpec(packed=True, dynamic=True, micro_batch_size=None, max_tokens_per_micro_batch=None)
    with pytest.raises(ValidationError, match="micro_batch_size"):
        MicroBatchSpec(packed=True, dynamic=False, micro_batch_size=None, max_tokens_per_micro_batch=None)
    with pytest.raises(ValidationError, match="leave micro_batch_size"):
        MicroBatchSpec(packed=True, dynamic=True, micro_batch_size=2, max_tokens_per_micro_batch=10)


def test_fixed_groups_longest_first_with_balanced_sizes() -> None:
    lengths = [5, 50, 10, 40, 20, 30, 1]
    plan = microbatch.plan_micro_batches(lengths, PADDED_FIXED)
    # 7 samples, size 3 -> 3 micro-batches of sizes 2, 2, 3; the smallest takes the longest samples.
    assert plan == [[1, 3], [4, 5], [0, 2, 6]]


def test_padded_tokens_count_padding() -> None:
    assert microbatch.micro_batch_tokens([3, 10], packed=True) == 13
    assert microbatch.micro_batch_tokens([3, 10], packed=False) == 20


def test_cap_error_names_sample_and_cap() -> None:
    with pytest.raises(ValueError, match=r"sample 2 has 300 tokens.*max_tokens_per_micro_batch=256"):
        microbatch.plan_micro_batches([10, 20, 300], dynamic(True, 256))


def test_forced_count_below_own_count_is_an_error() -> None:
    with pytest.raises(ValueError, match="need at least 2 micro-batches"):
        microbatch.plan_micro_batches([100, 100], dynamic(True, 150), num_micro_batches=1)


def test_forced_count_above_samples_is_an_error() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        microbatch.plan_micro_batches([10, 10], PACKED_FIXED, num_micro_batches=3)


def test_max_micro_batch_count_is_max_over_ranks() -> None:
    spec = dynamic(True, 100)
    ranks = [[90, 90, 90], [10, 10, 10]]
    assert microbatch.max_micro_batch_count(ranks, spec) == 3
    plans = [microbatch.plan_micro_batches(r, spec, 3) for r in ranks]
    assert [len(p) for p in plans] == [3, 3]


def test_karmarkar_karp_equal_size_example() -> None:
    parts = microbatch.karmarkar_karp([8, 7, 6, 5, 4, 3], 2, equal_size=True)
    assert sorted(len(p) for p in parts) == [3, 3]
    sums = sorted(sum([8, 7, 6, 5, 4, 3][i] for i in p) for p in parts)
    assert sums == [16, 17]


def _fits(lengths: list[int], cap: int, i: int, loads: list[int]) -> bool:
    if i == len(lengths):
        return True
    return any(
        loads[b] + lengths[i] <= cap
        and _fits(lengths, cap, i + 1, [*loads[:b], loads[b] + lengths[i], *loads[b + 1 :]])
        for b in range(len(loads))
    )


def _brute_force_bins(lengths: list[int], cap: int) -> int:
    # Reference: fewest bins by trying every assignment (small n only).
    return next(bins for bins in range(1, len(lengths) + 1) if _fits(lengths, cap, 0, [0] * bins))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=7))
def test_ffd_is_near_optimal_against_brute_force(lengths: list[int]) -> None:
    cap = 64
    ffd = microbatch.first_fit_decreasing(lengths, cap, packed=True)
    optimal = _brute_force_bins(lengths, cap)
    assert optimal <= len(ffd) <= math.floor(11 / 9 * optimal + 6 / 9)


lengths_strategy = st.lists(st.integers(1, 200), min_size=1, max_size=40)
spec_strategy = st.sampled_from(
    [
        PACKED_FIXED,
        PADDED_FIXED,
        dynamic(True, 400),
        dynamic(False, 400),
        dynamic(True, 400, "karmarkar_karp"),
        dynamic(False, 400, "karmarkar_karp"),
    ]
)


@settings(max_examples=150, deadline=None)
@given(lengths_strategy, spec_strategy, st.integers(0, 5))
def test_plans_partition_respect_cap_and_forced_count(
    lengths: list[int], spec: MicroBatchSpec, extra: int
) -> None:
    plan = microbatch.plan_micro_batches(lengths, spec)
    assert is_partition(plan, len(lengths))
    assert len(plan) == microbatch.count_micro_batches(lengths, spec)
    forced = min(len(lengths), len(plan) + extra)
    forced_plan = microbatch.plan_micro_batches(lengths, spec, forced)
    assert is_partition(forced_plan, len(lengths))
    assert len(forced_plan) == forced
    for mb in plan + forced_plan:
        tokens = microbatch.micro_batch_tokens([lengths[i] for i in mb], packed=spec.packed)
        if spec.dynamic:
            assert spec.max_tokens_per_micro_batch is not None
            assert tokens <= spec.max_tokens_per_micro_batch
        else:
            assert spec.micro_batch_size is not None
            assert len(mb) <= spec.micro_batch_size

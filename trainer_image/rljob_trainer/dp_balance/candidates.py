"""Candidate orders for the DP-balance planner: per-rank index lists, cheap to build.

Role: each function proposes one assignment of samples to ranks (equal counts per rank):
`snake_order` (OpenRLHF), `karmarkar_karp_equal_size` (verl) and, for fixed padded micro-batching,
`padded_fixed_block_order`. `plan.plan_dp_balance` prices them all and keeps the cheapest.

Callers: `rljob_trainer.dp_balance.plan`, tests, `bench/dp_balance.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rljob_trainer.dp_balance import refinement

# Names, not the module: every function here takes a `cost` argument that would shadow it.
from rljob_trainer.dp_balance.cost import CostModel
from rljob_trainer.train import microbatch


def snake_order(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """OpenRLHF-style snake: longest first, dealt 0,1,…,P−1,P−1,…,0,0,1,… Returns per-rank index lists."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = [[] for _ in range(dp_size)]
    for position, index in enumerate(order):
        row, col = divmod(position, dp_size)
        groups[col if row % 2 == 0 else dp_size - 1 - col].append(index)
    return [sorted(g) for g in groups]


def karmarkar_karp_equal_size(weights: Sequence[float], dp_size: int) -> list[list[int]]:
    """verl-style equal-size Karmarkar–Karp on per-sample weights; len(weights) % dp_size must be 0."""
    return microbatch.karmarkar_karp(weights, dp_size, equal_size=True)


def padded_fixed_block_order(
    lengths: Sequence[int], dp_size: int, micro_batch_size: int, cost: CostModel
) -> list[list[int]] | None:
    """Per-rank index lists built from whole padded micro-batches (fixed micro-batching, padded).

    Why: a padded micro-batch costs its size times its longest sample, so the cheapest way to hold all
    samples is micro-batches of consecutive lengths in sorted order (the blocks `lower_bound` uses);
    per-sample balancers (KK, snake) mix lengths inside a rank and pay padding for it. Here the sorted
    lengths are cut into the very micro-batches the ranks will run — each rank's sizes, smaller ones
    on longer samples, as `microbatch.plan_micro_batches` forms them — and whole blocks are dealt to
    ranks: equal-size Karmarkar–Karp on block costs per size class, then `refine_by_swaps` over blocks
    (an additive problem: a rank's cost is exactly the sum of its blocks, since each rank re-forms
    them when it sorts its own samples longest first). When every block has the same size this
    reaches the block bound of `lower_bound` whenever the block partition is optimal.
    Returns None when n is not divisible by dp_size.
    """
    n = len(lengths)
    if n == 0 or n % dp_size:
        return None
    m = n // dp_size
    k = math.ceil(m / micro_batch_size)
    sizes = microbatch.balanced_group_sizes(m, k)  # one rank's sizes, smallest (longest samples) first
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    blocks: list[list[int]] = []
    block_cost: list[float] = []
    block_small: list[bool] = []
    start = 0
    for size in sorted(sizes * dp_size):
        members = order[start : start + size]
        blocks.append(members)
        block_cost.append(cost.per_micro_batch + size * cost.sample_cost(lengths[members[0]]))
        block_small.append(size == sizes[0])
        start += size
    small_per_rank = sizes.count(sizes[0])
    small = [b for b in range(len(blocks)) if block_small[b]]
    large = [b for b in range(len(blocks)) if not block_small[b]]
    parts = _kk_blocks(small, block_cost, dp_size)
    if large:
        # Heaviest small-block part with the lightest large-block part.
        parts.sort(key=lambda part: -sum(block_cost[b] for b in part))
        large_parts = sorted(
            _kk_blocks(large, block_cost, dp_size), key=lambda part: sum(block_cost[b] for b in part)
        )
        parts = [a + b for a, b in zip(parts, large_parts, strict=True)]

    def evaluate(part: list[int]) -> float:
        # A swap must keep each rank's mix of block sizes (its sample count and micro-batch sizes).
        if sum(block_small[b] for b in part) != small_per_rank:
            return math.inf
        return sum(block_cost[b] for b in part)

    parts = refinement.refine_by_swaps(parts, evaluate, block_cost, max_evaluations=4 * len(blocks) + 64)
    return [sorted(i for b in part for i in blocks[b]) for part in parts]


def _kk_blocks(indices: Sequence[int], block_cost: Sequence[float], dp_size: int) -> list[list[int]]:
    parts = microbatch.karmarkar_karp([block_cost[b] for b in indices], dp_size, equal_size=True)
    return [[indices[j] for j in part] for part in parts]

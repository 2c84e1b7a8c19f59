"""Fast rank evaluators: the same value as `cost.rank_cost` without building micro-batch lists.

Role: swap refinement calls a rank's cost thousands of times per plan; for the layouts where the
trainer's micro-batch plan has a closed form (fixed micro-batching; padded first-fit-decreasing
dynamic batching) these closures compute it from the rank's sorted lengths. Tests pin each one to
`cost.rank_cost`.

Callers: `rljob_trainer.dp_balance.plan`, tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

# Names, not the module: every function here takes a `cost` argument that would shadow it.
from rljob_trainer.dp_balance.cost import CostModel, fixed_heads
from rljob_trainer.train.microbatch import MicroBatchSpec


def fixed_rank_evaluator(
    lengths: Sequence[int], spec: MicroBatchSpec, cost: CostModel, m: int, k: int
) -> Callable[[list[int]], float]:
    """Fast cost of a rank of exactly m samples under fixed micro-batching with k micro-batches.

    Same value as `rank_cost` (up to float summation order): a fixed plan's micro-batches are the
    rank's samples longest first cut into `balanced_group_sizes(m, k)`, so a padded rank costs
    k·per_micro_batch + Σ size·w(first sample of each micro-batch), and a packed one
    k·per_micro_batch + Σ w. Avoids building micro-batch lists on every swap the refinement tries.
    """
    overhead = k * cost.per_micro_batch
    weights = [cost.sample_cost(length) for length in lengths]
    if spec.packed:
        return lambda group: overhead + sum(weights[i] for i in group)
    heads = fixed_heads(m, k)

    def evaluate(group: list[int]) -> float:
        if len(group) != m:
            return math.inf
        desc = sorted((lengths[i] for i in group), reverse=True)
        return overhead + sum(size * cost.sample_cost(desc[position]) for position, size in heads)

    return evaluate


def padded_greedy_rank_evaluator(
    lengths: Sequence[int], spec: MicroBatchSpec, cost: CostModel, k: int
) -> Callable[[list[int]], float]:
    """Fast cost of a rank under padded first-fit-decreasing dynamic batching with k micro-batches.

    Same value as `rank_cost` (up to float summation order) without building index lists: padded
    first-fit decreasing is the greedy contiguous grouping of the rank's lengths sorted longest first
    (a micro-batch headed by L holds floor(cap / L) samples, so earlier bins are full before a new one
    opens), and `microbatch.split_to_count` then splits the micro-batch with the most padded tokens at
    the cut that minimises the larger half, which only depends on the sorted lengths. Refinement calls
    this thousands of times per plan.
    """
    cap = spec.max_tokens_per_micro_batch or 1
    c0 = cost.per_micro_batch
    weight = cost.sample_cost

    def evaluate(group: list[int]) -> float:
        desc = sorted((lengths[i] for i in group), reverse=True)
        size = len(desc)
        if k > size:
            return math.inf
        bounds: list[tuple[int, int]] = []  # (start, end) of each micro-batch in `desc`
        position = 0
        while position < size:
            if desc[position] > cap:
                return math.inf
            end = min(size, position + max(1, cap // desc[position]))
            bounds.append((position, end))
            position = end
        if len(bounds) > k:
            return math.inf
        while len(bounds) < k:
            g = max(
                (j for j in range(len(bounds)) if bounds[j][1] - bounds[j][0] > 1),
                key=lambda j: ((bounds[j][1] - bounds[j][0]) * desc[bounds[j][0]], -j),
            )
            start, end = bounds[g]
            best_cut, best_tokens = start + 1, math.inf
            for cut in range(start + 1, end):
                larger = max((cut - start) * desc[start], (end - cut) * desc[cut])
                if larger < best_tokens:
                    best_cut, best_tokens = cut, larger
            bounds[g : g + 1] = [(start, best_cut), (best_cut, end)]
        return k * c0 + sum((end - start) * weight(desc[start]) for start, end in bounds)

    return evaluate

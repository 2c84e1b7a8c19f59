"""The DP-balance plan: pick the cheapest candidate order for one mini-batch and apply it.

Role: `plan_dp_balance` builds the candidates (original, equal-size Karmarkar–Karp, snake, padded
blocks), refines the best two by swaps, prices every one with the trainer's own micro-batch planner
and returns a `DPBalancePlan` that reorders only when the slowest rank gets strictly lighter.
`DPBalancePlan.apply_fields` moves every sample-aligned field the same way.

Callers: the trainer driver, tests, `bench/dp_balance.py` (through the package's re-exports).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rljob_trainer.dp_balance import bounds, candidates, evaluators, refinement

# Names, not the module: `plan_dp_balance` takes a `cost` argument that would shadow it.
from rljob_trainer.dp_balance.cost import REL_EPS, CostModel, rank_cost, simulate_rank_costs, strictly_less
from rljob_trainer.train import microbatch
from rljob_trainer.train.microbatch import MicroBatchSpec

STRATEGY_CODES: dict[str, int] = {
    "original": 0,
    "karmarkar_karp": 1,
    "snake": 2,
    "original+swaps": 3,
    "karmarkar_karp+swaps": 4,
    "snake+swaps": 5,
    "blocks": 6,
    "blocks+swaps": 7,
}

# Relative slack for "strictly lighter": float sums of the same costs in another order differ by ulps.


@dataclass(frozen=True)
class DPBalancePlan:
    """A reorder of one mini-batch: rank r owns `permutation[r*m:(r+1)*m]`, m = len / dp_size."""

    permutation: tuple[int, ...]
    dp_size: int
    strategy: str
    rank_costs: tuple[float, ...]
    original_rank_costs: tuple[float, ...]
    metrics: dict[str, float | str] = field(default_factory=dict)

    @property
    def applied(self) -> bool:
        """Whether the batch is reordered at all."""
        return self.permutation != tuple(range(len(self.permutation)))

    def rank_indices(self, rank: int) -> list[int]:
        """Original sample indices rank `rank` processes, in order."""
        m = len(self.permutation) // self.dp_size
        return list(self.permutation[rank * m : (rank + 1) * m])

    def apply(self, x: Any) -> Any:
        """Reorder the first dimension of a list/tuple, numpy array or torch tensor (same type back)."""
        return self._take(x, self.permutation)

    def restore(self, x: Any) -> Any:
        """Inverse of `apply`: put per-sample outputs (e.g. log-probs) back in the original order."""
        inverse = [0] * len(self.permutation)
        for position, index in enumerate(self.permutation):
            inverse[index] = position
        return self._take(x, inverse)

    def apply_fields(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """Reorder every sample-aligned field the same way.

        Each value's first dimension must be the batch: token ids [N, L] or a list of N ragged
        sequences, masks, old/ref log-probs, advantages [N], rewards [N], per-token side arrays such as
        `mm_token_type_ids` (a list of N arrays, each kept whole so it stays aligned with its
        `input_ids`). Raises ValueError naming a field whose length is not the batch size.
        """
        n = len(self.permutation)
        out: dict[str, Any] = {}
        for name, value in fields.items():
            size = _first_dim(value)
            if size != n:
                raise ValueError(
                    f"field {name!r} has first dimension {size}, expected the batch size {n}; "
                    "pass only sample-aligned fields"
                )
            out[name] = self._take(value, self.permutation)
        return out

    @staticmethod
    def _take(x: Any, order: Sequence[int]) -> Any:
        size = _first_dim(x)
        if size != len(order):
            raise ValueError(f"first dimension {size} does not match the plan's batch size {len(order)}")
        if isinstance(x, list):
            return [x[i] for i in order]
        if isinstance(x, tuple):
            return tuple(x[i] for i in order)
        if hasattr(x, "index_select"):  # torch.Tensor: keep device, avoid importing torch here
            import torch

            return x.index_select(0, torch.as_tensor(list(order), dtype=torch.long, device=x.device))
        if hasattr(x, "take") and hasattr(x, "shape"):  # numpy.ndarray
            import numpy as np

            return np.take(x, np.asarray(order, dtype=np.int64), axis=0)
        raise TypeError(
            f"cannot reorder {type(x).__name__}; expected a list, tuple, numpy array or torch tensor"
        )


def _first_dim(x: Any) -> int:
    shape = getattr(x, "shape", None)
    if shape is not None:
        if len(shape) == 0:
            raise ValueError("cannot reorder a 0-d array")
        return int(shape[0])
    return len(x)


def _groups_to_permutation(groups: Sequence[Sequence[int]]) -> tuple[int, ...]:
    return tuple(i for g in groups for i in sorted(g))


def plan_dp_balance(
    lengths: Sequence[int],
    dp_size: int,
    *,
    micro_batch: MicroBatchSpec,
    cost: CostModel | None = None,
    refine: bool = True,
    clock: Callable[[], float] = time.perf_counter,
) -> DPBalancePlan:
    """Plan a reorder of one mini-batch for `dp_size` data-parallel ranks.

    Args:
        lengths: tokens per sample (prompt + response), len n, in the driver's order.
        dp_size: number of data-parallel ranks P; rank r will take permutation[r*m:(r+1)*m], m = n / P.
        micro_batch: the micro-batching the trainer runs (used to simulate each rank).
        cost: micro-batch cost model; default `CostModel.from_hidden_size(1024)`.
        refine: also try `refine_by_swaps` on the best candidates.
        clock: monotonic seconds, read twice for the `dp_balance/plan_ms` metric only.

    Returns:
        The cheapest plan; the identity (strategy "original") unless the slowest rank gets strictly
        lighter, or when n % P != 0 (`dp_balance/divisible` = 0).
    """
    started = clock()
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    cost = cost or CostModel.from_hidden_size(1024)
    lengths = [int(length) for length in lengths]
    n = len(lengths)
    identity = tuple(range(n))
    divisible = n > 0 and n % dp_size == 0
    if not divisible:
        # Unequal per-rank counts: reordering would change each sample's weight in the gradient.
        # Costs as a contiguous split that gives the first n % P ranks one extra sample.
        sizes = sorted(microbatch.balanced_group_sizes(n, dp_size), reverse=True)
        starts = [sum(sizes[:r]) for r in range(dp_size)]
        ranks = [[lengths[i] for i in identity[s : s + size]] for s, size in zip(starts, sizes, strict=True)]
        k = microbatch.max_micro_batch_count(ranks, micro_batch)
        costs = tuple(rank_cost(g, micro_batch, cost, k) for g in ranks)
        return _finish(
            identity, dp_size, "original", costs, costs, divisible=False, started=started, clock=clock
        )

    m = n // dp_size
    weights = [cost.sample_cost(length) for length in lengths]

    def score(perm: Sequence[int]) -> tuple[float, ...]:
        return tuple(simulate_rank_costs(lengths, perm, dp_size, micro_batch, cost))

    orders: dict[str, tuple[int, ...]] = {
        "original": identity,
        "karmarkar_karp": _groups_to_permutation(candidates.karmarkar_karp_equal_size(weights, dp_size)),
        "snake": _groups_to_permutation(candidates.snake_order(lengths, dp_size)),
    }
    if not micro_batch.packed and not micro_batch.dynamic and micro_batch.micro_batch_size is not None:
        blocks = candidates.padded_fixed_block_order(lengths, dp_size, micro_batch.micro_batch_size, cost)
        if blocks is not None:
            orders["blocks"] = _groups_to_permutation(blocks)
    scored = {name: score(perm) for name, perm in orders.items()}
    original_costs = scored["original"]
    # Stop early when a candidate is provably optimal (the bound is cheap for fixed batching only).
    bound = 0.0
    if not micro_batch.dynamic:
        bound = bounds.lower_bound(lengths, dp_size, micro_batch=micro_batch, cost=cost)
    at_bound = min(max(c) for c in scored.values()) <= bound * (1 + REL_EPS)

    if refine and dp_size > 1 and not at_bound:
        # Refine the two best distinct starting points; the shared micro-batch count of the start is
        # kept fixed during the search (swaps that would need more micro-batches evaluate to inf) and
        # the result is re-simulated from scratch below.
        ranked = sorted(scored, key=lambda name: (max(scored[name]), sum(scored[name]), STRATEGY_CODES[name]))
        for name in ranked[:2]:
            perm = orders[name]
            groups = [list(perm[r * m : (r + 1) * m]) for r in range(dp_size)]
            k = microbatch.max_micro_batch_count([[lengths[i] for i in g] for g in groups], micro_batch)

            def evaluate(group: list[int], k: int = k) -> float:
                return rank_cost([lengths[i] for i in group], micro_batch, cost, k)

            search: dict[str, int] = {}
            if not micro_batch.dynamic:
                evaluate = evaluators.fixed_rank_evaluator(lengths, micro_batch, cost, m, k)
            elif not micro_batch.packed and micro_batch.dynamic_algorithm == "first_fit_decreasing":
                evaluate = evaluators.padded_greedy_rank_evaluator(lengths, micro_batch, cost, k)
                # Padding makes the additive surrogate a poor guide here, so look at more candidate swaps;
                # the fast evaluator keeps this cheaper than the default search with `rank_cost`.
                search = {"candidates_per_pair": 32, "max_evaluations": 8000}
            refined = _groups_to_permutation(refinement.refine_by_swaps(groups, evaluate, weights, **search))
            orders[f"{name}+swaps"] = refined
            scored[f"{name}+swaps"] = score(refined)

    best = min(scored, key=lambda name: (max(scored[name]), sum(scored[name]), STRATEGY_CODES[name]))
    if not strictly_less(max(scored[best]), max(original_costs)):
        best = "original"
    return _finish(
        orders[best],
        dp_size,
        best,
        scored[best],
        original_costs,
        divisible=True,
        started=started,
        clock=clock,
    )


def _finish(
    permutation: tuple[int, ...],
    dp_size: int,
    strategy: str,
    rank_costs: Sequence[float],
    original_rank_costs: Sequence[float],
    *,
    divisible: bool,
    started: float,
    clock: Callable[[], float],
) -> DPBalancePlan:
    def stats(costs: Sequence[float]) -> tuple[float, float]:
        if not costs:
            return 0.0, 0.0
        return max(costs), sum(costs) / len(costs)

    slow_before, mean_before = stats(original_rank_costs)
    slow_after, mean_after = stats(rank_costs)
    metrics: dict[str, float | str] = {
        "dp_balance/applied": float(permutation != tuple(range(len(permutation)))),
        "dp_balance/divisible": float(divisible),
        "dp_balance/slowest_cost_before": slow_before,
        "dp_balance/slowest_cost_after": slow_after,
        "dp_balance/mean_cost_before": mean_before,
        "dp_balance/mean_cost_after": mean_after,
        "dp_balance/imbalance_before": slow_before / mean_before if mean_before else 1.0,
        "dp_balance/imbalance_after": slow_after / mean_after if mean_after else 1.0,
        "dp_balance/estimated_speedup": slow_before / slow_after if slow_after else 1.0,
        "dp_balance/strategy": float(STRATEGY_CODES[strategy]),
        "dp_balance/strategy_name": strategy,
    }
    metrics["dp_balance/plan_ms"] = (clock() - started) * 1000.0
    return DPBalancePlan(
        permutation=permutation,
        dp_size=dp_size,
        strategy=strategy,
        rank_costs=tuple(rank_costs),
        original_rank_costs=tuple(original_rank_costs),
        metrics=metrics,
    )

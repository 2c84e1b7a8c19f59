"""DP-balance planner: reorder a mini-batch so the slowest data-parallel rank finishes earliest.

Role: every GRPO step waits for the slowest rank, and rollout lengths vary a lot, so a contiguous
split is uneven. Before forward/backward the driver calls `plan_dp_balance(lengths, dp_size, ...)` and
applies the returned permutation to every sample-aligned field (`DPBalancePlan.apply_fields`); rank r
then takes the contiguous slice `permutation[r*m:(r+1)*m]` as before.

Callers: the trainer driver (planning + `apply_fields`), `bench/dp_balance.py`, tests.

How a rank's cost is simulated: the rank's samples go through `microbatch.plan_micro_batches` — the
planner the trainer executes — with the micro-batch count every rank must share, and each
micro-batch is priced by `CostModel`. Candidate orders: the original, equal-size Karmarkar–Karp,
snake by length, and `refine_by_swaps` applied on top of the best of them. The cheapest wins; the
batch is reordered only when its slowest rank gets strictly lighter than in the original order.

Why the gradient is unchanged: per-rank sample counts never change, and GRPO's per-sequence-mean loss
normalised by the global number of sequences is a sum over sequences, so the all-reduced gradient is
a permutation-invariant sum. When len(lengths) % dp_size != 0 the ranks would get different counts
(different weights under a per-rank mean), so the planner keeps the original order.

Pure: lists in, lists out. The only clock read is the planning time reported in the metrics, through
an injectable `clock`.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rljob_trainer import microbatch
from rljob_trainer.microbatch import MicroBatchSpec

__all__ = [
    "STRATEGY_CODES",
    "CostModel",
    "DPBalancePlan",
    "MicroBatchSpec",
    "karmarkar_karp_equal_size",
    "lower_bound",
    "plan_dp_balance",
    "rank_cost",
    "refine_by_swaps",
    "refine_by_swaps_reference",
    "simulate_rank_costs",
    "snake_order",
]

# Numeric codes so the chosen strategy can be plotted as a metric next to its name.
STRATEGY_CODES: dict[str, int] = {
    "original": 0,
    "karmarkar_karp": 1,
    "snake": 2,
    "original+swaps": 3,
    "karmarkar_karp+swaps": 4,
    "snake+swaps": 5,
}

# Relative slack for "strictly lighter": float sums of the same costs in another order differ by ulps.
_REL_EPS = 1e-9


class CostModel(BaseModel):
    """Relative cost of one micro-batch (forward + backward), in arbitrary units.

    A micro-batch costs `per_micro_batch + Σ (per_token·L + per_token_squared·L²)` over its samples when
    packed (attention is per sample), and `per_micro_batch + B·(per_token·L_max + per_token_squared·L_max²)`
    when padded to a [B, L_max] tensor.
    """

    model_config = ConfigDict(frozen=True)

    per_token: float = Field(ge=0, description="Linear cost per token (weight matmuls).")
    per_token_squared: float = Field(ge=0, description="Cost per squared sequence length (attention).")
    per_micro_batch: float = Field(ge=0, description="Fixed cost per micro-batch (launches, syncs).")

    @classmethod
    def from_hidden_size(
        cls,
        hidden_size: int,
        *,
        intermediate_size: int | None = None,
        overhead_tokens: float = 256.0,
    ) -> CostModel:
        """Default cost from the model's width, in units of 2·h FLOPs per layer.

        Per layer and sequence of L tokens, forward FLOPs ≈ 2·P·L for the weight matmuls (P parameters:
        4h² for q, k, v, o plus 3·h·I for a gated MLP, or 8h² for the classic 4h MLP, so 12h² in total)
        and ≈ 2·h·L² for causal attention (QKᵀ and AV are 2·h·L² each, halved by the causal mask).
        Backward is about twice forward for both, so it cancels. Dividing by 2h gives
        per_token = P/h (12·h by default) and per_token_squared = 1. verl's `24576·L + L²` is the same
        shape with per_token = 24·h for h = 1024 (it weighs the linear part twice as much as this
        derivation). `overhead_tokens` prices a micro-batch's fixed cost (kernel launches, FSDP gathers
        that do not overlap) as that many tokens.
        """
        if hidden_size < 1:
            raise ValueError(f"hidden_size must be >= 1, got {hidden_size}")
        if intermediate_size is None:
            params_per_layer = 12 * hidden_size * hidden_size
        else:
            params_per_layer = 4 * hidden_size * hidden_size + 3 * hidden_size * intermediate_size
        per_token = params_per_layer / hidden_size
        return cls(per_token=per_token, per_token_squared=1.0, per_micro_batch=overhead_tokens * per_token)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], *, overhead_tokens: float = 256.0) -> CostModel:
        """`from_hidden_size` reading a Hugging Face config dict (the `text_config` of a multimodal one)."""
        text = config.get("text_config") or config
        return cls.from_hidden_size(
            int(text["hidden_size"]),
            intermediate_size=text.get("intermediate_size"),
            overhead_tokens=overhead_tokens,
        )

    def sample_cost(self, length: int) -> float:
        """Token cost of one sample of `length` tokens (no micro-batch overhead)."""
        return self.per_token * length + self.per_token_squared * length * length

    def micro_batch_cost(self, lengths: Sequence[int], *, packed: bool) -> float:
        """Cost of one micro-batch holding samples of these lengths."""
        if not lengths:
            return 0.0
        if packed:
            return self.per_micro_batch + sum(self.sample_cost(length) for length in lengths)
        return self.per_micro_batch + len(lengths) * self.sample_cost(max(lengths))


def rank_cost(
    lengths: Sequence[int], spec: MicroBatchSpec, cost: CostModel, num_micro_batches: int | None = None
) -> float:
    """Simulated cost of one rank: its micro-batch plan (the trainer's planner) priced by `cost`.

    Returns inf when the samples cannot be planned into `num_micro_batches` micro-batches.
    """
    try:
        plan = microbatch.plan_micro_batches(lengths, spec, num_micro_batches)
    except ValueError:
        if num_micro_batches is None:
            raise
        return math.inf
    return sum(cost.micro_batch_cost([lengths[i] for i in mb], packed=spec.packed) for mb in plan)


def _shared_micro_batch_count(groups: Sequence[Sequence[int]], spec: MicroBatchSpec) -> int:
    return microbatch.max_micro_batch_count(groups, spec)


def simulate_rank_costs(
    lengths: Sequence[int], permutation: Sequence[int], dp_size: int, spec: MicroBatchSpec, cost: CostModel
) -> list[float]:
    """Cost of each rank when rank r owns `permutation[r*m:(r+1)*m]` (m = len // dp_size).

    All ranks run the same number of micro-batches (the max they need), as gradient sync requires.
    """
    m = len(lengths) // dp_size
    groups = [[lengths[i] for i in permutation[r * m : (r + 1) * m]] for r in range(dp_size)]
    k = _shared_micro_batch_count(groups, spec)
    return [rank_cost(g, spec, cost, k) for g in groups]


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


def _strictly_less(new: float, old: float) -> bool:
    return new < old - _REL_EPS * max(1.0, abs(old))


def refine_by_swaps(
    groups: Sequence[Sequence[int]],
    evaluate: Callable[[list[int]], float],
    weights: Sequence[float],
    *,
    max_swaps: int = 1000,
    candidates_per_pair: int = 8,
    max_evaluations: int = 1500,
) -> list[list[int]]:
    """Swap one sample of the slowest rank with one of a lighter rank while the slowest gets lighter.

    Args:
        groups: per-rank index lists (equal sizes are kept: a swap moves one sample each way).
        evaluate: exact cost of a rank given its index list (e.g. a simulated micro-batch plan).
        weights: additive per-sample surrogate cost (exact for packed layouts), used only to rank
            candidate swaps so few exact evaluations are needed.
        max_swaps: stop after this many accepted swaps (bounds planning time).
        candidates_per_pair: candidate swaps evaluated exactly per (slowest, other) rank pair and step.
        max_evaluations: stop after this many calls to `evaluate` (bounds planning time when each call
            re-plans a padded rank; packed layouts converge long before).

    A swap between the slowest rank s (cost S) and rank r is accepted only if both new costs are
    strictly below S, so the maximum never rises and the descending cost vector decreases
    lexicographically at every step (hence termination). Returns new per-rank lists, sorted.
    """
    out = [list(g) for g in groups]
    costs = [evaluate(g) for g in out]
    evaluations = len(out)
    for _ in range(max_swaps):
        if evaluations >= max_evaluations:
            break
        s = max(range(len(out)), key=lambda r: (costs[r], -r))
        top = costs[s]
        accepted = False
        for r in sorted(range(len(out)), key=lambda q: costs[q]):
            if r == s or not _strictly_less(costs[r], top):
                continue
            target = (top - costs[r]) / 2.0  # ideal weight moved from s to r
            other = sorted(out[r], key=lambda i: weights[i])
            other_w = [weights[i] for i in other]
            ranked: list[tuple[float, int, int]] = []
            for a, x in enumerate(out[s]):
                want = weights[x] - target  # best partner weight
                pos = bisect.bisect_left(other_w, want)
                for b in (pos - 1, pos):
                    if 0 <= b < len(other) and other_w[b] < weights[x]:
                        ranked.append((abs(weights[x] - other_w[b] - target), a, b))
            ranked.sort()
            best: tuple[float, int, int, float, float] | None = None
            for _, a, b in ranked[:candidates_per_pair]:
                y = other[b]
                new_s = evaluate([*out[s][:a], y, *out[s][a + 1 :]])
                new_r = evaluate([i for i in out[r] if i != y] + [out[s][a]])
                evaluations += 2
                worst = max(new_s, new_r)
                if _strictly_less(worst, top) and (best is None or worst < best[0]):
                    best = (worst, a, y, new_s, new_r)
            if best is not None:
                _, a, y, new_s, new_r = best
                x = out[s][a]
                out[s][a] = y
                out[r] = [i for i in out[r] if i != y] + [x]
                costs[s], costs[r] = new_s, new_r
                accepted = True
                break
        if not accepted:
            break
    return [sorted(g) for g in out]


def refine_by_swaps_reference(
    groups: Sequence[Sequence[int]], evaluate: Callable[[list[int]], float], *, max_swaps: int = 1000
) -> list[list[int]]:
    """Slow reference for `refine_by_swaps`: tries every (slowest, other) pair of samples exactly and
    takes the best improving swap. Same acceptance rule, so it reaches a swap-local optimum."""
    out = [list(g) for g in groups]
    costs = [evaluate(g) for g in out]
    for _ in range(max_swaps):
        s = max(range(len(out)), key=lambda r: (costs[r], -r))
        top = costs[s]
        best: tuple[float, int, int, int, float, float] | None = None
        for r in range(len(out)):
            if r == s:
                continue
            for a, x in enumerate(out[s]):
                for b, y in enumerate(out[r]):
                    new_s = evaluate([*out[s][:a], y, *out[s][a + 1 :]])
                    new_r = evaluate([*out[r][:b], x, *out[r][b + 1 :]])
                    worst = max(new_s, new_r)
                    if _strictly_less(worst, top) and (best is None or worst < best[0]):
                        best = (worst, r, a, b, new_s, new_r)
        if best is None:
            break
        _, r, a, b, new_s, new_r = best
        out[s][a], out[r][b] = out[r][b], out[s][a]
        costs[s], costs[r] = new_s, new_r
    return [sorted(g) for g in out]


def lower_bound(
    lengths: Sequence[int], dp_size: int, *, micro_batch: MicroBatchSpec, cost: CostModel
) -> float:
    """A lower bound on the slowest rank's cost over every equal-size assignment of samples to ranks.

    Let w_i = cost.sample_cost(L_i), m = n / P, and k_min the fewest micro-batches every rank must run
    (fixed: ceil(m / micro_batch_size); dynamic: ceil(Σ tokens / (P · cap)), since some rank holds at
    least the average tokens and a micro-batch holds at most `cap`). Every rank pays k·per_micro_batch
    with k >= k_min, and a micro-batch costs at least the Σ w_i of its samples (padding only adds), so
    a rank costs at least k_min·per_micro_batch + Σ_{i in rank} w_i. The slowest rank is then at least:
    - the average: Σ w / P;
    - for every t: among the t heaviest samples some rank holds q = ceil(t / P); its cost is at least
      the q lightest of those t plus the m − q lightest samples overall (t = 1 is "w_max + the m − 1
      smallest"). Any m − q other samples weigh at least the m − q lightest, so this is valid.
    For padded layouts the padded total is also bounded: any grouping of all samples into micro-batches
    of at most s samples (fixed: s = ceil(m / k)) costs at least the optimal contiguous grouping of the
    sorted lengths (exchange argument: filling groups in sorted order, heaviest max first, never raises
    a group's max), with exactly P·k_min groups for fixed batching; the slowest rank is >= total / P.
    Returns 0.0 when n is not divisible by P (no equal-size assignment exists).
    """
    n = len(lengths)
    if n == 0 or n % dp_size:
        return 0.0
    m = n // dp_size
    spec = micro_batch
    if spec.dynamic:
        cap = spec.max_tokens_per_micro_batch or 1
        k_min = max(1, math.ceil(sum(lengths) / (dp_size * cap)))
    else:
        k_min = math.ceil(m / (spec.micro_batch_size or 1))
    overhead = k_min * cost.per_micro_batch
    w = sorted((cost.sample_cost(length) for length in lengths), reverse=True)
    ascending = w[::-1]
    prefix_small = [0.0]
    for value in ascending:
        prefix_small.append(prefix_small[-1] + value)
    best = sum(w) / dp_size
    for t in range(1, n + 1):
        q = math.ceil(t / dp_size)
        if q > m:
            break
        best = max(best, sum(w[t - q : t]) + prefix_small[m - q])
    bound = overhead + best
    if not spec.packed and not spec.dynamic:
        bound = max(bound, _padded_fixed_total_bound(lengths, dp_size * k_min, cost) / dp_size + overhead)
    if not spec.packed and spec.dynamic and spec.max_tokens_per_micro_batch is not None:
        total = _padded_dynamic_total_bound(lengths, spec.max_tokens_per_micro_batch, cost)
        bound = max(bound, total / dp_size)
    return bound


def _padded_dynamic_total_bound(lengths: Sequence[int], max_tokens: int, cost: CostModel) -> float:
    # Min over contiguous groupings of the sorted lengths, each group within the padded cap
    # (|g| · max <= cap), of Σ (per_micro_batch + |g| · w(max of g)). Any real plan groups all samples
    # under the cap (in however many groups), so its total is at least this.
    desc = sorted(lengths, reverse=True)
    n = len(desc)
    best = [math.inf] * (n + 1)
    best[0] = 0.0
    for i in range(n):
        if best[i] == math.inf:
            continue
        head = cost.sample_cost(desc[i])
        for size in range(1, min(n - i, max_tokens // max(1, desc[i])) + 1):
            value = best[i] + cost.per_micro_batch + size * head
            if value < best[i + size]:
                best[i + size] = value
    return best[n]


def _padded_fixed_total_bound(lengths: Sequence[int], num_groups: int, cost: CostModel) -> float:
    # Min over contiguous groupings of the sorted lengths into exactly `num_groups` groups of the
    # balanced sizes fixed batching uses (sizes differ by one), of Σ |g| · w(max of g). The real layout
    # is one such grouping (each rank: the same k balanced sizes), so this is a valid lower bound.
    n = len(lengths)
    desc = sorted(lengths, reverse=True)
    base = n // num_groups
    big_total = n - base * num_groups  # groups of size base+1 across all ranks
    small_total = num_groups - big_total
    # dp[j][b]: min cost using j small and b big groups (position = j*base + b*(base+1)).
    inf = math.inf
    dp = [[inf] * (big_total + 1) for _ in range(small_total + 1)]
    dp[0][0] = 0.0
    for j in range(small_total + 1):
        for b in range(big_total + 1):
            here = dp[j][b]
            if here == inf:
                continue
            pos = j * base + b * (base + 1)
            if pos >= n:
                continue
            head = cost.sample_cost(desc[pos])
            if j < small_total and base > 0:
                dp[j + 1][b] = min(dp[j + 1][b], here + base * head)
            if b < big_total:
                dp[j][b + 1] = min(dp[j][b + 1], here + (base + 1) * head)
    return dp[small_total][big_total] if dp[small_total][big_total] != inf else 0.0


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

    candidates: dict[str, tuple[int, ...]] = {
        "original": identity,
        "karmarkar_karp": _groups_to_permutation(karmarkar_karp_equal_size(weights, dp_size)),
        "snake": _groups_to_permutation(snake_order(lengths, dp_size)),
    }
    scored = {name: score(perm) for name, perm in candidates.items()}
    original_costs = scored["original"]

    if refine and dp_size > 1:
        # Refine the two best distinct starting points; the shared micro-batch count of the start is
        # kept fixed during the search (swaps that would need more micro-batches evaluate to inf) and
        # the result is re-simulated from scratch below.
        ranked = sorted(scored, key=lambda name: (max(scored[name]), sum(scored[name]), STRATEGY_CODES[name]))
        for name in ranked[:2]:
            perm = candidates[name]
            groups = [list(perm[r * m : (r + 1) * m]) for r in range(dp_size)]
            k = _shared_micro_batch_count([[lengths[i] for i in g] for g in groups], micro_batch)

            def evaluate(group: list[int], k: int = k) -> float:
                return rank_cost([lengths[i] for i in group], micro_batch, cost, k)

            refined = _groups_to_permutation(refine_by_swaps(groups, evaluate, weights))
            candidates[f"{name}+swaps"] = refined
            scored[f"{name}+swaps"] = score(refined)

    best = min(scored, key=lambda name: (max(scored[name]), sum(scored[name]), STRATEGY_CODES[name]))
    if not _strictly_less(max(scored[best]), max(original_costs)):
        best = "original"
    return _finish(
        candidates[best],
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

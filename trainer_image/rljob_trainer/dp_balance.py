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
    "blocks": 6,
    "blocks+swaps": 7,
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

    parts = refine_by_swaps(parts, evaluate, block_cost, max_evaluations=4 * len(blocks) + 64)
    return [sorted(i for b in part for i in blocks[b]) for part in parts]


def _kk_blocks(indices: Sequence[int], block_cost: Sequence[float], dp_size: int) -> list[list[int]]:
    parts = microbatch.karmarkar_karp([block_cost[b] for b in indices], dp_size, equal_size=True)
    return [[indices[j] for j in part] for part in parts]


def _fixed_rank_evaluator(
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
    heads = _fixed_heads(m, k)

    def evaluate(group: list[int]) -> float:
        if len(group) != m:
            return math.inf
        desc = sorted((lengths[i] for i in group), reverse=True)
        return overhead + sum(size * cost.sample_cost(desc[position]) for position, size in heads)

    return evaluate


def _padded_greedy_rank_evaluator(
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
    (fixed: k = ceil(m / micro_batch_size), exactly; dynamic: ceil(Σ tokens / (P · cap)), since some
    rank holds at least the average tokens and a micro-batch holds at most `cap`). Every rank pays
    k·per_micro_batch with k >= k_min, and a micro-batch costs at least the Σ w_i of its samples
    (padding only adds), so a rank costs at least k_min·per_micro_batch + Σ_{i in rank} w_i. The slowest
    rank is then at least `_equal_count_bound` of the w_i (average; "among the t heaviest some rank
    holds ceil(t / P), plus the lightest others").

    Padded layouts add tighter terms (the padding any assignment must pay):
    - fixed, every rank's k micro-batches the same size s = m / k (`_padded_fixed_block_bound`): cut
      the lengths sorted longest first into P·k blocks of s; block i costs b_i = per_micro_batch +
      s·w(its first, longest length). In any assignment, sort all P·k micro-batches by their longest
      sample: the i-th one's longest is >= the block-i head (samples longer than it all sit in the
      i − 1 micro-batches before it, at most (i − 1)·s of them), so its cost is >= b_i. Giving each
      rank the blocks whose ranks (in that sorted order) its own micro-batches hold is an assignment
      of blocks, k per rank, whose slowest rank is no slower. So the optimum is >= the best
      k-per-rank partition of the b_i, bounded by `_equal_count_bound` (exact for k <= 2).
    - fixed, any sizes (`_padded_fixed_order_bound`): a rank's cost is k·per_micro_batch + Σ_j s_j ·
      w(its h_j-th longest), h_j the first position of its j-th micro-batch (the planner fills
      micro-batches longest first), which never decreases when any sample gets longer. Some rank
      holds q = ceil(t / P) of the t longest, so its p-th longest is >= l[t − q + p] for p < q, and
      any m samples' p-th longest is >= l[n − m + p]; price those sorted vectors for every q.
    - fixed, total: the cheapest grouping of all samples into P·k micro-batches of the ranks' sizes
      is contiguous in sorted order (exchange argument); the slowest rank is >= total / P.
    - dynamic (`_padded_dynamic_bound`): any plan groups each rank's samples under the cap, so the
      ranks together run at least G_min micro-batches (the greedy contiguous count of all sorted
      lengths) and each runs the same k >= ceil(G_min / P). The cheapest capped grouping, with a
      per_micro_batch charge per group, is contiguous in sorted order; with at least P·k groups in
      total (Lagrangian relaxation of the count) it bounds the total, hence the slowest rank by
      total / P; with at least k groups on the sorted vector a rank holding q of the
      (q − 1)·P + 1 longest dominates, it bounds one rank. k is also at least the fewest capped
      groups of any vector some rank dominates (that count never falls as lengths grow); call the
      largest of these k_lo.
    - dynamic, first-fit decreasing: padded FFD is the greedy contiguous grouping (fewest groups), so
      no rank needs more than the fewest groups of the m longest lengths (k_hi). Some rank holds q
      copies of the longest length ℓ (q <= ceil(copies / P)); when its dominated vector already needs
      k_lo groups and k = k_lo, its own plan is the unsplit greedy one: every micro-batch headed by ℓ
      holds exactly floor(cap / ℓ) samples (or all that remain), all padded to ℓ, and its other
      samples form exactly k_lo minus those micro-batches (`_padded_grouping_exact`). For k > k_lo only
      the relaxed terms above hold, and they only grow with k, so the bound is
      max(relaxed(k_lo), min(greedy(k_lo), relaxed(k_lo + 1))) (just greedy(k_lo) when k_hi = k_lo).
      A larger k can really be cheaper (splits cut padding); a test keeps the exhaustive counterexample.
    What exhaustive search (every equal-size assignment, P <= 3, m <= 4, GRPO-like lengths with a spike
    at the cap, padded dynamic) showed: the planner was within 0.1% of the optimum on average (a few
    batches 1–11% above, where swaps of one sample cannot reach the optimum), while the relaxed bound
    was 18% below the optimum on average (up to 2.1x: it let the long sample sit alone, which
    first-fit decreasing never does) — the bound, not the balancer, was loose on small batches. With
    the first-fit-decreasing terms the optimum is 1–1.7% above the bound on average. On the benchmark's
    larger batches (m >= 16) the balancer is the loose part: a wider swap search alone moves the mean
    from ~1.08 to ~1.05 of the bound.
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
    bound = overhead + _equal_count_bound([cost.sample_cost(length) for length in lengths], dp_size, m)
    if not spec.packed and not spec.dynamic:
        bound = max(
            bound,
            _padded_fixed_total_bound(lengths, dp_size * k_min, cost) / dp_size + overhead,
            _padded_fixed_order_bound(lengths, dp_size, k_min, cost),
            _padded_fixed_block_bound(lengths, dp_size, k_min, cost),
        )
    if not spec.packed and spec.dynamic and spec.max_tokens_per_micro_batch is not None:
        bound = max(
            bound,
            _padded_dynamic_bound(
                lengths,
                dp_size,
                spec.max_tokens_per_micro_batch,
                cost,
                greedy=spec.dynamic_algorithm == "first_fit_decreasing",
            ),
        )
    return bound


def _equal_count_bound(values: Sequence[float], parts: int, per_part: int) -> float:
    """Lower bound on min over partitions of `values` into `parts` groups of exactly `per_part` of the
    largest group sum (values >= 0, len(values) == parts · per_part).

    - the average, Σ / parts;
    - for every t: some group holds q = ceil(t / parts) of the t largest, so it weighs at least the q
      smallest of those t plus the per_part − q smallest values overall (any per_part − q other values
      weigh at least that much);
    - per_part == 2: pairing the i-th largest with the i-th smallest is optimal (exchange argument),
      so its largest pair is the exact optimum.
    """
    v = sorted(values, reverse=True)
    if not v:
        return 0.0
    prefix = [0.0]  # prefix[i] = Σ v[:i]
    for value in v:
        prefix.append(prefix[-1] + value)
    ascending_prefix = [0.0]  # Σ of the i smallest
    for value in reversed(v):
        ascending_prefix.append(ascending_prefix[-1] + value)
    best = prefix[-1] / parts
    # For a fixed q the smallest t = (q − 1)·parts + 1 gives the largest q-smallest-of-top-t sum.
    for q in range(1, per_part + 1):
        t = (q - 1) * parts + 1
        best = max(best, prefix[t] - prefix[t - q] + ascending_prefix[per_part - q])
    if per_part == 1:
        best = max(best, v[0])
    elif per_part == 2:
        best = max(best, max(v[i] + v[len(v) - 1 - i] for i in range(parts)))
    return best


def _fixed_heads(m: int, k: int) -> list[tuple[int, int]]:
    """(first position, size) of each micro-batch of a rank with m samples in k fixed micro-batches,
    positions counted in the rank's longest-first order, as `microbatch.plan_micro_batches` forms them."""
    heads: list[tuple[int, int]] = []
    position = 0
    for size in microbatch.balanced_group_sizes(m, k):
        heads.append((position, size))
        position += size
    return heads


def _padded_fixed_order_bound(lengths: Sequence[int], dp_size: int, k: int, cost: CostModel) -> float:
    # See `lower_bound`: price, for each q, the sorted vector every rank holding q of the
    # (q − 1)·P + 1 longest samples dominates, with the trainer's head positions.
    n = len(lengths)
    m = n // dp_size
    desc = sorted(lengths, reverse=True)
    heads = _fixed_heads(m, k)
    best = 0.0
    for q in range(1, m + 1):
        t = (q - 1) * dp_size + 1
        total = k * cost.per_micro_batch
        for position, size in heads:
            index = n - m + position
            if position < q:
                index = min(index, t - q + position)
            total += size * cost.sample_cost(desc[index])
        best = max(best, total)
    return best


def _padded_fixed_block_bound(lengths: Sequence[int], dp_size: int, k: int, cost: CostModel) -> float:
    # See `lower_bound`: only when every micro-batch of every rank has the same size s = m / k.
    blocks = _padded_fixed_blocks(lengths, dp_size, k, cost)
    if blocks is None:
        return 0.0
    return _equal_count_bound([c for _, c in blocks], dp_size, k)


def _padded_fixed_blocks(
    lengths: Sequence[int], dp_size: int, k: int, cost: CostModel
) -> list[tuple[list[int], float]] | None:
    """The P·k blocks of s = m / k consecutive samples in longest-first order, with their padded cost;
    None when m is not a multiple of k (the ranks' micro-batches differ in size)."""
    n = len(lengths)
    m = n // dp_size
    if k < 1 or m % k:
        return None
    size = m // k
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    return [
        (order[start : start + size], cost.per_micro_batch + size * cost.sample_cost(lengths[order[start]]))
        for start in range(0, n, size)
    ]


def _padded_min_groups(desc: Sequence[int], max_tokens: int) -> int:
    # Fewest padded micro-batches under the cap for lengths sorted longest first: greedy, each
    # micro-batch as large as its head allows. Any capped grouping can be made contiguous in sorted
    # order without raising a head (exchange argument), and greedy stays ahead among contiguous ones.
    count = position = 0
    while position < len(desc):
        position += max(1, max_tokens // max(1, desc[position]))
        count += 1
    return count


def _padded_grouping_cost(desc: Sequence[int], max_tokens: int, cost: CostModel, charge: float) -> float:
    # Min over contiguous groupings of `desc` (sorted longest first), each group within the padded cap
    # (|g| · max <= cap), of Σ (charge + |g| · w(max of g)). Any capped grouping of samples whose sorted
    # lengths dominate `desc` costs at least this (same group sizes in head order, heads no longer).
    n = len(desc)
    best = [math.inf] * (n + 1)
    best[0] = 0.0
    for i in range(n):
        if best[i] == math.inf:
            continue
        head = cost.sample_cost(desc[i])
        for size in range(1, min(n - i, max_tokens // max(1, desc[i])) + 1):
            value = best[i] + charge + size * head
            if value < best[i + size]:
                best[i + size] = value
    return best[n]


def _padded_grouping_bound(desc: Sequence[int], max_tokens: int, cost: CostModel, min_groups: int) -> float:
    # Lower bound on Σ (per_micro_batch + |g| · w(max of g)) over capped groupings into at least
    # `min_groups` groups, by Lagrangian relaxation: for λ >= 0 and G >= min_groups groups,
    # Σ (c0 + …) = Σ (c0 − λ + …) + λ·G >= _padded_grouping_cost(charge = c0 − λ) + λ·min_groups.
    c0 = cost.per_micro_batch
    return max(
        _padded_grouping_cost(desc, max_tokens, cost, c0 - lam) + lam * min_groups
        for lam in (0.0, 0.5 * c0, c0)
    )


def _padded_grouping_exact(desc: Sequence[int], max_tokens: int, cost: CostModel, groups: int) -> float:
    # Min over contiguous capped groupings of `desc` (sorted longest first) into exactly `groups` groups
    # of Σ (per_micro_batch + |g| · w(max of g)); inf when none exists. Lower-bounds any capped grouping
    # into exactly `groups` groups of samples whose sorted lengths dominate `desc` (same argument as
    # `_padded_grouping_cost`).
    n = len(desc)
    if groups < 0 or groups > n or (n > 0 and groups == 0):
        return 0.0 if n == 0 and groups == 0 else math.inf
    c0 = cost.per_micro_batch
    best = [0.0] + [math.inf] * n  # best[i]: first i samples in g groups (g grows per round)
    for _ in range(groups):
        nxt = [math.inf] * (n + 1)
        for i in range(n):
            if best[i] == math.inf:
                continue
            head = cost.sample_cost(desc[i])
            for size in range(1, min(n - i, max_tokens // max(1, desc[i])) + 1):
                value = best[i] + c0 + size * head
                if value < nxt[i + size]:
                    nxt[i + size] = value
        best = nxt
    return best[n]


def _padded_dynamic_relaxed(
    desc: Sequence[int], weights: Sequence[float], dp_size: int, max_tokens: int, cost: CostModel, k: int
) -> float:
    # Bound on the slowest rank when every rank runs at least k capped micro-batches, whatever the
    # grouping inside a rank; nondecreasing in k. See `lower_bound`.
    n = len(desc)
    m = n // dp_size
    best = k * cost.per_micro_batch + _equal_count_bound(weights, dp_size, m)
    best = max(best, _padded_grouping_bound(desc, max_tokens, cost, dp_size * k) / dp_size)
    for vector in _dominated_rank_vectors(desc, dp_size):
        best = max(best, _padded_grouping_bound(vector, max_tokens, cost, k))
    return best


def _dominated_rank_vectors(desc: Sequence[int], dp_size: int) -> list[list[int]]:
    # Some rank holds q of the t = (q − 1)·P + 1 longest (see `_padded_fixed_order_bound`), so its
    # sorted lengths dominate these vectors; a few q keep this cheap, every q is valid.
    n = len(desc)
    m = n // dp_size
    qs = sorted({q for q in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, m // 4, m // 2, m) if 1 <= q <= m})
    return [
        [desc[min(n - m + p, (q - 1) * dp_size + 1 - q + p) if p < q else n - m + p] for p in range(m)]
        for q in qs
    ]


def _padded_dynamic_bound(
    lengths: Sequence[int], dp_size: int, max_tokens: int, cost: CostModel, *, greedy: bool
) -> float:
    # See `lower_bound`. `greedy`: the planner is first-fit decreasing, whose padded plan is the greedy
    # contiguous grouping (the fewest micro-batches) before any split.
    n = len(lengths)
    m = n // dp_size
    desc = sorted(lengths, reverse=True)
    weights = [cost.sample_cost(length) for length in lengths]
    c0 = cost.per_micro_batch
    longest = desc[0]
    spikes = desc.count(longest)
    # A rank holding q copies of the longest length: its sorted lengths dominate `spiked(q)`.
    spiked = {
        q: [longest] * q + list(desc[n - (m - q) :] if m > q else [])
        for q in range(1, min(m, math.ceil(spikes / dp_size)) + 1)
    }
    # Shared count k: at least every rank's natural count, which is at least the fewest capped groups
    # of any vector some rank dominates (the fewest-groups count never decreases as lengths grow).
    k_lo = max(
        1,
        math.ceil(sum(lengths) / (dp_size * max_tokens)),
        math.ceil(_padded_min_groups(desc, max_tokens) / dp_size),
        *(_padded_min_groups(v, max_tokens) for v in _dominated_rank_vectors(desc, dp_size)),
        *(_padded_min_groups(v, max_tokens) for v in spiked.values()),
    )
    relaxed = _padded_dynamic_relaxed(desc, weights, dp_size, max_tokens, cost, k_lo)
    if not greedy:
        return relaxed
    # First-fit decreasing: the shared count is at most the fewest groups of the m longest lengths
    # (the most any rank can need), and at k = k_lo a rank whose own count is forced to k_lo runs its
    # greedy plan unsplit: each micro-batch headed by the longest length holds exactly
    # c = floor(cap / longest) samples (or what is left), all padded to the longest.
    k_hi = _padded_min_groups(desc[:m], max_tokens)
    exact = relaxed
    capacity = max(1, max_tokens // longest)
    for q, vector in spiked.items():
        if _padded_min_groups(vector, max_tokens) != k_lo:
            continue
        heads = math.ceil(q / capacity)
        covered = min(m, heads * capacity)
        rest = desc[n - (m - covered) :] if m > covered else []
        tail = _padded_grouping_exact(rest, max_tokens, cost, k_lo - heads)
        if tail < math.inf:
            exact = max(exact, heads * c0 + covered * cost.sample_cost(longest) + tail)
    if k_hi <= k_lo:
        return exact
    # k > k_lo: only the relaxed terms hold, and they only grow with k.
    above = _padded_dynamic_relaxed(desc, weights, dp_size, max_tokens, cost, k_lo + 1)
    return max(relaxed, min(exact, above))


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
    if not micro_batch.packed and not micro_batch.dynamic and micro_batch.micro_batch_size is not None:
        blocks = padded_fixed_block_order(lengths, dp_size, micro_batch.micro_batch_size, cost)
        if blocks is not None:
            candidates["blocks"] = _groups_to_permutation(blocks)
    scored = {name: score(perm) for name, perm in candidates.items()}
    original_costs = scored["original"]
    # Stop early when a candidate is provably optimal (the bound is cheap for fixed batching only).
    bound = 0.0 if micro_batch.dynamic else lower_bound(lengths, dp_size, micro_batch=micro_batch, cost=cost)
    at_bound = min(max(c) for c in scored.values()) <= bound * (1 + _REL_EPS)

    if refine and dp_size > 1 and not at_bound:
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

            search: dict[str, int] = {}
            if not micro_batch.dynamic:
                evaluate = _fixed_rank_evaluator(lengths, micro_batch, cost, m, k)
            elif not micro_batch.packed and micro_batch.dynamic_algorithm == "first_fit_decreasing":
                evaluate = _padded_greedy_rank_evaluator(lengths, micro_batch, cost, k)
                # Padding makes the additive surrogate a poor guide here, so look at more candidate swaps;
                # the fast evaluator keeps this cheaper than the default search with `rank_cost`.
                search = {"candidates_per_pair": 32, "max_evaluations": 8000}
            refined = _groups_to_permutation(refine_by_swaps(groups, evaluate, weights, **search))
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

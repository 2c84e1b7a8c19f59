"""Lower bounds on the slowest rank's cost over every equal-size assignment of samples to ranks.

Role: `lower_bound` is the yardstick of the planner's quality (slowest rank over the bound, in the
tests and `bench/dp_balance.py`) and lets `plan.plan_dp_balance` stop early when a candidate is
provably optimal. The derivation of each term is in `lower_bound`'s docstring.

Callers: `rljob_trainer.dp_balance.plan`, tests, `bench/dp_balance.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Names, not the module: every function here takes a `cost` argument that would shadow it.
from rljob_trainer.dp_balance.cost import CostModel, fixed_heads
from rljob_trainer.train.microbatch import MicroBatchSpec


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


def _padded_fixed_order_bound(lengths: Sequence[int], dp_size: int, k: int, cost: CostModel) -> float:
    # See `lower_bound`: price, for each q, the sorted vector every rank holding q of the
    # (q − 1)·P + 1 longest samples dominates, with the trainer's head positions.
    n = len(lengths)
    m = n // dp_size
    desc = sorted(lengths, reverse=True)
    heads = fixed_heads(m, k)
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
    blocks = padded_fixed_blocks(lengths, dp_size, k, cost)
    if blocks is None:
        return 0.0
    return _equal_count_bound([c for _, c in blocks], dp_size, k)


def padded_fixed_blocks(
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

"""Swap refinement: move one sample each way between the slowest rank and a lighter one.

Role: `refine_by_swaps` improves a candidate order (equal per-rank counts kept) under any exact
rank evaluator, guided by an additive per-sample surrogate; `refine_by_swaps_reference` is its slow,
exhaustive twin that tests compare against.

Callers: `rljob_trainer.dp_balance.plan`, `rljob_trainer.dp_balance.candidates`, tests.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from rljob_trainer.dp_balance.cost import strictly_less


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
            if r == s or not strictly_less(costs[r], top):
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
                if strictly_less(worst, top) and (best is None or worst < best[0]):
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
                    if strictly_less(worst, top) and (best is None or worst < best[0]):
                        best = (worst, r, a, b, new_s, new_r)
        if best is None:
            break
        _, r, a, b, new_s, new_r = best
        out[s][a], out[r][b] = out[r][b], out[s][a]
        costs[s], costs[r] = new_s, new_r
    return [sorted(g) for g in out]

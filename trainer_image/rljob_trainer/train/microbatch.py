"""Micro-batch planner: how one data-parallel rank splits its samples into micro-batches.

Role: the single source of truth for micro-batching. The trainer executes these plans (it runs one
forward/backward per returned index list), and `dp_balance` simulates each rank's cost by calling the
very same functions, so the balance it optimises is the balance the trainer gets.

Callers: `rljob_trainer.dp_balance` (simulation), the trainer's forward/backward loop (execution).

Layouts and "tokens" of a micro-batch (what a token cap limits):
- packed (padding-free): samples are concatenated into one row; tokens = sum of the lengths.
- padded: samples form a [B, L_max] tensor; tokens = B × L_max (padding costs memory too).

Modes:
- fixed: `micro_batch_size` samples per micro-batch. Samples are grouped longest first into
  balanced sizes (sizes differ by at most one; the smaller groups take the longest samples), which
  minimises padding; grouping inside a rank never changes a sum-reduced gradient.
- dynamic: as many samples as fit under `max_tokens_per_micro_batch`, by first-fit decreasing
  (fewest micro-batches in practice) or Karmarkar–Karp (balanced micro-batches, verl's choice).

Gradient synchronisation (FSDP/DDP) needs the same number of micro-batches on every rank: compute
each rank's `count_micro_batches`, take the max across ranks (`max_micro_batch_count` here, or an
all-reduce MAX in the trainer), then call `plan_micro_batches(..., num_micro_batches=k)`.

Pure python: lists of ints in, lists of index lists out; no torch, no clock, no randomness.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DynamicAlgorithm = Literal["first_fit_decreasing", "karmarkar_karp"]


class MicroBatchSpec(BaseModel):
    """How a rank's samples are laid out and grouped into micro-batches."""

    model_config = ConfigDict(frozen=True)

    packed: bool = Field(description="Padding-free: samples of a micro-batch are concatenated in one row.")
    dynamic: bool = Field(description="Group by a token cap instead of a fixed number of samples.")
    micro_batch_size: int | None = Field(
        default=None, ge=1, description="Samples per micro-batch (fixed mode only)."
    )
    max_tokens_per_micro_batch: int | None = Field(
        default=None,
        ge=1,
        description="Token cap per micro-batch (dynamic mode only): sum of lengths when packed, "
        "samples × longest length when padded.",
    )
    dynamic_algorithm: DynamicAlgorithm = Field(
        default="first_fit_decreasing",
        description="Dynamic mode grouping: first_fit_decreasing (fewest micro-batches) or "
        "karmarkar_karp (balanced micro-batches).",
    )

    @model_validator(mode="after")
    def _check_mode_fields(self) -> MicroBatchSpec:
        if self.dynamic:
            if self.max_tokens_per_micro_batch is None:
                raise ValueError("dynamic micro-batching needs max_tokens_per_micro_batch (a token cap)")
            if self.micro_batch_size is not None:
                raise ValueError(
                    "dynamic micro-batching groups by max_tokens_per_micro_batch; leave micro_batch_size "
                    f"unset (got {self.micro_batch_size})"
                )
        else:
            if self.micro_batch_size is None:
                raise ValueError("fixed micro-batching needs micro_batch_size (samples per micro-batch)")
            if self.max_tokens_per_micro_batch is not None:
                raise ValueError(
                    "fixed micro-batching groups by micro_batch_size; set dynamic=True to use "
                    f"max_tokens_per_micro_batch (got {self.max_tokens_per_micro_batch})"
                )
        return self


def micro_batch_tokens(lengths: Sequence[int], *, packed: bool) -> int:
    """Tokens one micro-batch occupies: Σ L when packed, B × max L when padded."""
    if not lengths:
        return 0
    return sum(lengths) if packed else len(lengths) * max(lengths)


def _check_fits_cap(lengths: Sequence[int], cap: int) -> None:
    for index, length in enumerate(lengths):
        if length > cap:
            raise ValueError(
                f"sample {index} has {length} tokens, longer than max_tokens_per_micro_batch={cap}; "
                "raise the cap to at least the longest sequence (prompt + max completion) or truncate"
            )


def _order_longest_first(lengths: Sequence[int]) -> list[int]:
    # Stable: equal lengths keep index order, so plans are deterministic.
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def balanced_group_sizes(num_items: int, num_groups: int) -> list[int]:
    """Sizes of `num_groups` groups holding `num_items` items, differing by at most one, smallest first."""
    base, extra = divmod(num_items, num_groups)
    return [base] * (num_groups - extra) + [base + 1] * extra


def first_fit_decreasing(lengths: Sequence[int], max_tokens: int, *, packed: bool) -> list[list[int]]:
    """Bin packing by first-fit decreasing under a token cap.

    Longest sample first, each into the first micro-batch it fits (see `micro_batch_tokens`). Uses at
    most 11/9·OPT + 6/9 bins. Returns index lists in the order the bins were opened (longest first).
    """
    _check_fits_cap(lengths, max_tokens)
    bins: list[list[int]] = []
    bin_tokens: list[int] = []  # packed: Σ L; padded: the bin's max L (its first, longest item)
    for index in _order_longest_first(lengths):
        length = lengths[index]
        for b, members in enumerate(bins):
            if packed:
                fits = bin_tokens[b] + length <= max_tokens
            else:
                fits = (len(members) + 1) * bin_tokens[b] <= max_tokens
            if fits:
                members.append(index)
                if packed:
                    bin_tokens[b] += length
                break
        else:
            bins.append([index])
            bin_tokens.append(length)
    return bins


def karmarkar_karp(weights: Sequence[float], num_parts: int, *, equal_size: bool) -> list[list[int]]:
    """Largest-differencing (Karmarkar–Karp) partition of item indices into `num_parts` parts.

    With `equal_size`, len(weights) must be divisible by `num_parts` and every part gets exactly
    len(weights) / num_parts items (items are seeded in sorted rows of `num_parts`, as in verl's
    `seqlen_balancing.karmarkar_karp`). Each step merges the two partial partitions with the largest
    spread, pairing the heaviest part of one with the lightest of the other.
    Returns `num_parts` index lists, each sorted ascending.
    """
    n = len(weights)
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if equal_size and n % num_parts:
        raise ValueError(f"equal-size partition needs len(weights) % num_parts == 0, got {n} % {num_parts}")
    order = sorted(range(n), key=lambda i: (weights[i], i))
    # A partial partition: (sums, members) with parts kept sorted by sum, heaviest first.
    heap: list[tuple[float, int, list[float], list[list[int]]]] = []
    seeds = [order[s : s + num_parts] for s in range(0, n, num_parts)] if equal_size else [[i] for i in order]
    for tie, seed in enumerate(seeds):
        sums = [float(weights[i]) for i in seed] + [0.0] * (num_parts - len(seed))
        members = [[i] for i in seed] + [[] for _ in range(num_parts - len(seed))]
        ranked = sorted(range(num_parts), key=lambda p: -sums[p])
        sums = [sums[p] for p in ranked]
        members = [members[p] for p in ranked]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), tie, sums, members))
    if not heap:
        return [[] for _ in range(num_parts)]
    tie = len(seeds)
    while len(heap) > 1:
        _, _, sums_a, members_a = heapq.heappop(heap)
        _, _, sums_b, members_b = heapq.heappop(heap)
        # Heaviest of a with lightest of b cancels the largest differences.
        sums = [sums_a[p] + sums_b[num_parts - 1 - p] for p in range(num_parts)]
        members = [members_a[p] + members_b[num_parts - 1 - p] for p in range(num_parts)]
        ranked = sorted(range(num_parts), key=lambda p: -sums[p])
        sums = [sums[p] for p in ranked]
        members = [members[p] for p in ranked]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), tie, sums, members))
        tie += 1
    return [sorted(part) for part in heap[0][3]]


def split_to_count(
    groups: Sequence[Sequence[int]], lengths: Sequence[int], num_groups: int, *, packed: bool
) -> list[list[int]]:
    """Split the largest micro-batches in two until there are `num_groups` of them.

    Used when a rank must run more micro-batches than it needs (gradient sync). Splitting a group
    never exceeds a cap the group met. The split is contiguous in length order at the point that
    minimises the larger half's tokens (cuts padding when padded).
    """
    out = [sorted(g, key=lambda i: (-lengths[i], i)) for g in groups]
    while len(out) < num_groups:
        splittable = [g for g in range(len(out)) if len(out[g]) > 1]
        if not splittable:
            raise ValueError(
                f"cannot form {num_groups} non-empty micro-batches from {sum(map(len, out))} samples"
            )
        g = max(
            splittable, key=lambda j: (micro_batch_tokens([lengths[i] for i in out[j]], packed=packed), -j)
        )
        members = out[g]  # sorted longest first
        sizes = [lengths[i] for i in members]
        total = sum(sizes)
        best_cut, best_tokens, head_sum = 1, math.inf, 0
        for cut in range(1, len(members)):
            head_sum += sizes[cut - 1]
            if packed:
                larger = max(head_sum, total - head_sum)
            else:  # padded: each half's longest is its first member
                larger = max(cut * sizes[0], (len(sizes) - cut) * sizes[cut])
            if larger < best_tokens:
                best_cut, best_tokens = cut, larger
        out[g : g + 1] = [members[:best_cut], members[best_cut:]]
    return out


def _karmarkar_karp_under_cap(
    lengths: Sequence[int], max_tokens: int, packed: bool, start: int
) -> list[list[int]]:
    # verl's dynamic batching: the fewest balanced parts (from `start` up) that all fit the cap.
    # Terminates: with len(lengths) parts every part is one sample, which fits after _check_fits_cap.
    for parts in range(max(1, start), len(lengths) + 1):
        plan = karmarkar_karp(lengths, parts, equal_size=False)
        if all(micro_batch_tokens([lengths[i] for i in p], packed=packed) <= max_tokens for p in plan):
            return plan
    raise AssertionError("unreachable: one sample per micro-batch always fits the cap")


def _natural_plan(lengths: Sequence[int], spec: MicroBatchSpec) -> list[list[int]]:
    n = len(lengths)
    if not spec.dynamic:
        if spec.micro_batch_size is None:  # narrowed by MicroBatchSpec's validator
            raise ValueError("fixed micro-batching needs micro_batch_size")
        return _fixed_plan(lengths, math.ceil(n / spec.micro_batch_size))
    cap = spec.max_tokens_per_micro_batch
    if cap is None:
        raise ValueError("dynamic micro-batching needs max_tokens_per_micro_batch")
    _check_fits_cap(lengths, cap)
    if spec.dynamic_algorithm == "first_fit_decreasing":
        return first_fit_decreasing(lengths, cap, packed=spec.packed)
    return _karmarkar_karp_under_cap(lengths, cap, spec.packed, math.ceil(sum(lengths) / cap))


def _fixed_plan(lengths: Sequence[int], num_groups: int) -> list[list[int]]:
    order = _order_longest_first(lengths)
    groups: list[list[int]] = []
    start = 0
    for size in balanced_group_sizes(len(lengths), num_groups):
        groups.append(order[start : start + size])
        start += size
    return groups


def count_micro_batches(lengths: Sequence[int], spec: MicroBatchSpec) -> int:
    """Micro-batches this rank needs on its own (before matching the other ranks)."""
    if not lengths:
        return 0
    return len(_natural_plan(lengths, spec))


def max_micro_batch_count(per_rank_lengths: Sequence[Sequence[int]], spec: MicroBatchSpec) -> int:
    """The count every rank must use: the max of `count_micro_batches` over ranks.

    In a real job each rank only knows its own lengths; the trainer all-reduces `count_micro_batches`
    with MAX instead. This is the same number, for the driver and the simulation.
    """
    return max((count_micro_batches(lengths, spec) for lengths in per_rank_lengths), default=0)


def plan_micro_batches(
    lengths: Sequence[int], spec: MicroBatchSpec, num_micro_batches: int | None = None
) -> list[list[int]]:
    """Group a rank's samples into micro-batches.

    Args:
        lengths: tokens per sample (prompt + response), len n.
        spec: layout and grouping.
        num_micro_batches: force exactly this many micro-batches (>= the rank's own count, <= n), as
            gradient sync requires; None uses the rank's own count.

    Returns:
        Index lists into `lengths`, one per micro-batch; every index appears exactly once; indices in
        a micro-batch are ascending (the order the trainer concatenates or pads them).

    Raises:
        ValueError: a sample is longer than the token cap (names the sample and the cap), or
            `num_micro_batches` is below the rank's own count or above n.
    """
    n = len(lengths)
    natural = _natural_plan(lengths, spec) if n else []
    if num_micro_batches is None or num_micro_batches == len(natural):
        return [sorted(g) for g in natural]
    if num_micro_batches < len(natural):
        raise ValueError(
            f"these {n} samples need at least {len(natural)} micro-batches under {_describe(spec)}, "
            f"got num_micro_batches={num_micro_batches}"
        )
    if num_micro_batches > n:
        raise ValueError(
            f"cannot form num_micro_batches={num_micro_batches} non-empty micro-batches from {n} samples"
        )
    if not spec.dynamic:
        return [sorted(g) for g in _fixed_plan(lengths, num_micro_batches)]
    cap = spec.max_tokens_per_micro_batch
    if spec.dynamic_algorithm == "karmarkar_karp" and cap is not None:
        # KK with exactly k parts balances best; fall back to splitting when it overflows the cap.
        plan = karmarkar_karp(lengths, num_micro_batches, equal_size=False)
        if all(micro_batch_tokens([lengths[i] for i in p], packed=spec.packed) <= cap for p in plan):
            return [sorted(g) for g in plan]
    return [sorted(g) for g in split_to_count(natural, lengths, num_micro_batches, packed=spec.packed)]


def _describe(spec: MicroBatchSpec) -> str:
    layout = "packed" if spec.packed else "padded"
    if spec.dynamic:
        return f"{layout} dynamic batching (max_tokens_per_micro_batch={spec.max_tokens_per_micro_batch})"
    return f"{layout} fixed batching (micro_batch_size={spec.micro_batch_size})"

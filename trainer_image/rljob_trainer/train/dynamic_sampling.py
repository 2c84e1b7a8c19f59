"""DAPO's dynamic sampling: drop the groups whose rewards are all equal and refill the batch.

Role: a group whose completions all got the same reward has zero advantage for every sample, so it
adds nothing to the policy gradient but still dilutes the batch mean (DAPO, Yu et al. 2025; verl's
`filter_groups`). `ScoredBatch` is one generation round scored; `split_groups` (pure) tells the
groups with a reward spread from the others; `fill_batch` keeps generating rounds of
`promptsPerStep` more prompts (`grpo.dynamicSampling.maxGenerationRounds` rounds a step at most, the
step's own included: the cap on extra generation) until the step has `promptsPerStep` informative
groups; when the cap is reached the dropped groups fill the rest (their advantage is zero), so the
batch keeps its size. Metrics: `rollout/filtered_groups` (equal-reward groups seen this step),
`rollout/generation_rounds`, `rollout/topped_up_groups`. Caller: `rljob_trainer.driver`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ScoredBatch:
    """Scored completions, one entry per sample; `group_ids` number the groups 0..G-1 in order."""

    outputs: list[Any]
    example_ids: list[int]
    group_ids: list[int]
    totals: list[float]
    parts: dict[str, list[float]] = field(default_factory=dict)

    def groups(self) -> list[list[int]]:
        """Sample indices of each group, in group order."""
        out: dict[int, list[int]] = {}
        for i, gid in enumerate(self.group_ids):
            out.setdefault(gid, []).append(i)
        return [out[k] for k in sorted(out)]

    def take(self, groups: Sequence[Sequence[int]]) -> ScoredBatch:
        """A batch of these groups (renumbered 0..), sample order kept within each group."""
        idx = [i for grp in groups for i in grp]
        gids = [n for n, grp in enumerate(groups) for _ in grp]
        return ScoredBatch(
            [self.outputs[i] for i in idx],
            [self.example_ids[i] for i in idx],
            gids,
            [self.totals[i] for i in idx],
            {k: [v[i] for i in idx] for k, v in self.parts.items()},
        )


def concat(batches: Sequence[ScoredBatch]) -> ScoredBatch:
    """One batch of every group of `batches`, in order."""
    out = ScoredBatch([], [], [], [], {k: [] for k in batches[0].parts} if batches else {})
    offset = 0
    for b in batches:
        out.outputs += b.outputs
        out.example_ids += b.example_ids
        out.group_ids += [g + offset for g in b.group_ids]
        out.totals += b.totals
        for k, v in b.parts.items():
            out.parts.setdefault(k, []).extend(v)
        offset += len(b.groups())
    return out


def split_groups(batch: ScoredBatch) -> tuple[list[list[int]], list[list[int]]]:
    """(groups whose rewards differ, groups whose rewards are all equal), as sample-index lists."""
    kept, dropped = [], []
    for grp in batch.groups():
        values = [batch.totals[i] for i in grp]
        (dropped if max(values) == min(values) else kept).append(grp)
    return kept, dropped


def fill_batch(
    first: ScoredBatch, *, want_groups: int, max_rounds: int, generate: Callable[[], ScoredBatch]
) -> tuple[ScoredBatch, dict[str, float]]:
    """`want_groups` groups, informative ones first, generating up to `max_rounds - 1` more rounds."""
    rounds = [first]
    kept, dropped = split_groups(first)
    kept_of = [(0, g) for g in kept]
    dropped_of = [(0, g) for g in dropped]
    while len(kept_of) < want_groups and len(rounds) < max_rounds:
        extra = generate()
        rounds.append(extra)
        k, d = split_groups(extra)
        kept_of += [(len(rounds) - 1, g) for g in k]
        dropped_of += [(len(rounds) - 1, g) for g in d]
    chosen = kept_of[:want_groups]
    topped = dropped_of[: want_groups - len(chosen)]
    parts = [rounds[r].take([g]) for r, g in chosen + topped]
    return concat(parts), {
        "rollout/filtered_groups": float(len(dropped_of)),
        "rollout/generation_rounds": float(len(rounds)),
        "rollout/topped_up_groups": float(len(topped)),
    }

"""Micro-batch and rank costs: the price list every other part of the DP-balance planner uses.

Role: `CostModel` prices one micro-batch; `rank_cost` prices a rank by running its samples through
`microbatch.plan_micro_batches` (the planner the trainer executes) and summing the micro-batch
prices; `simulate_rank_costs` does it for every rank of a permutation, with the shared micro-batch
count gradient sync requires.

Callers: the other `rljob_trainer.dp_balance` modules, the trainer driver (`CostModel.from_hf_config`),
tests and `bench/dp_balance.py` (through the package's re-exports).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rljob_trainer.train import microbatch
from rljob_trainer.train.microbatch import MicroBatchSpec

# Relative slack for "strictly lighter": float sums of the same costs in another order differ by ulps.
REL_EPS = 1e-9


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


def simulate_rank_costs(
    lengths: Sequence[int], permutation: Sequence[int], dp_size: int, spec: MicroBatchSpec, cost: CostModel
) -> list[float]:
    """Cost of each rank when rank r owns `permutation[r*m:(r+1)*m]` (m = len // dp_size).

    All ranks run the same number of micro-batches (the max they need), as gradient sync requires.
    """
    m = len(lengths) // dp_size
    groups = [[lengths[i] for i in permutation[r * m : (r + 1) * m]] for r in range(dp_size)]
    k = microbatch.max_micro_batch_count(groups, spec)
    return [rank_cost(g, spec, cost, k) for g in groups]


def fixed_heads(m: int, k: int) -> list[tuple[int, int]]:
    """(first position, size) of each micro-batch of a rank with m samples in k fixed micro-batches,
    positions counted in the rank's longest-first order, as `microbatch.plan_micro_batches` forms them."""
    heads: list[tuple[int, int]] = []
    position = 0
    for size in microbatch.balanced_group_sizes(m, k):
        heads.append((position, size))
        position += size
    return heads


def strictly_less(new: float, old: float) -> bool:
    """Whether cost `new` is lighter than `old` by more than float noise."""
    return new < old - REL_EPS * max(1.0, abs(old))

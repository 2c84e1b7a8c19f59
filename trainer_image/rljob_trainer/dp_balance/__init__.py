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

Layers, each importing only those below it (an import-linter contract keeps it so):
  plan        `plan_dp_balance`, `DPBalancePlan`: candidates -> refinement -> best, applied
  candidates  snake, equal-size Karmarkar–Karp, padded fixed blocks
  refinement  `refine_by_swaps` and its exhaustive reference
  evaluators  closed-form rank costs for the refinement's inner loop
  bounds      `lower_bound`: the yardstick of quality and the early stop
  cost        `CostModel`, `rank_cost`, `simulate_rank_costs`
"""

from rljob_trainer.dp_balance.bounds import lower_bound, padded_fixed_blocks
from rljob_trainer.dp_balance.candidates import (
    karmarkar_karp_equal_size,
    padded_fixed_block_order,
    snake_order,
)
from rljob_trainer.dp_balance.cost import CostModel, rank_cost, simulate_rank_costs
from rljob_trainer.dp_balance.evaluators import fixed_rank_evaluator, padded_greedy_rank_evaluator
from rljob_trainer.dp_balance.plan import STRATEGY_CODES, DPBalancePlan, plan_dp_balance
from rljob_trainer.dp_balance.refinement import refine_by_swaps, refine_by_swaps_reference
from rljob_trainer.train.microbatch import MicroBatchSpec

# The names these helpers had while the planner was one module; tests pin the fast evaluators and
# the block layout to the exact simulation through them.
_fixed_rank_evaluator = fixed_rank_evaluator
_padded_greedy_rank_evaluator = padded_greedy_rank_evaluator
_padded_fixed_blocks = padded_fixed_blocks

__all__ = [
    "STRATEGY_CODES",
    "CostModel",
    "DPBalancePlan",
    "MicroBatchSpec",
    "fixed_rank_evaluator",
    "karmarkar_karp_equal_size",
    "lower_bound",
    "padded_fixed_block_order",
    "padded_fixed_blocks",
    "padded_greedy_rank_evaluator",
    "plan_dp_balance",
    "rank_cost",
    "refine_by_swaps",
    "refine_by_swaps_reference",
    "simulate_rank_costs",
    "snake_order",
]

"""One step's training metrics from the ranks' sums, and the guard that fails a diverged run.

Role: `step_training_metrics` turns the per-rank sums `trainer.TrainingRank.train_step` returns into
the step's metrics (loss, pg_loss, kl and entropy (aggregated as the loss is) as means over the step's
optimizer updates; token means of pg_clipfrac, pg_clipfrac_lower (the dual-clip fraction, verl's
name), pg_clipfrac_ratio_low/high (which ratio bound clipped) and ppo_kl; the engines' log-prob gap,
IS weights and `rollout_corr/*` (`rljob_trainer.train.rollout_correction`);
`train/skipped_steps`); `SkipGuard` counts optimizer steps skipped in a row for a non-finite gradient
norm and raises `TrainingDivergedError` at `grpo.maxSkippedSteps`, naming the step and
the metric (the trainer writes it to the termination log, the operator quotes it). Pure; caller:
`rljob_trainer.driver`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rljob_trainer.train import rollout_correction


class TrainingDivergedError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite gradient norm."""


def _ratio(stats: Sequence[Mapping[str, Any]], num: str, den: str) -> float:
    return sum(float(s[num]) for s in stats) / max(sum(float(s[den]) for s in stats), 1.0)


def step_training_metrics(stats: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The step's metrics from every rank's `train_step` result (shares summed over ranks)."""
    return {
        "loss": sum(s["loss"] for s in stats),
        "pg_loss": sum(s["pg_loss"] for s in stats),
        "pg_loss_updates": [sum(u) for u in zip(*(s["pg_loss_updates"] for s in stats), strict=True)],
        "kl": sum(s["kl"] for s in stats),
        "entropy": sum(s["entropy"] for s in stats),
        # verl's names where they mean the same: pg_clipfrac (the clipped term is the larger),
        # pg_clipfrac_lower (the dual-clip bound binds, A < 0), ppo_kl (mean log π_old − log π)
        "pg_clipfrac": _ratio(stats, "pg_clipfrac_tokens", "loss_tokens"),
        "pg_clipfrac_lower": _ratio(stats, "pg_clipfrac_lower_tokens", "loss_tokens"),
        # which ratio bound clipped: A < 0 below 1 - clipRatioLow, A > 0 above 1 + clipRatioHigh
        "pg_clipfrac_ratio_low": _ratio(stats, "pg_clipfrac_ratio_low_tokens", "loss_tokens"),
        "pg_clipfrac_ratio_high": _ratio(stats, "pg_clipfrac_ratio_high_tokens", "loss_tokens"),
        "ppo_kl": _ratio(stats, "ppo_kl_sum", "loss_tokens"),
        # tokens with a -inf log-prob (outside the trainer's top-p nucleus), dropped from the loss
        "out_of_nucleus_fraction": _ratio(stats, "out_of_nucleus_tokens", "loss_tokens"),
        # rollout/logprob_diff (mean |trainer - engine| log-prob, before any update of the step),
        # rollout/out_of_nucleus_fraction and rollout_corr/* (KL, PPL, chi^2, masked, rejected)
        **rollout_correction.correction_metrics(
            {k: sum(float(s.get(f"corr/{k}", 0.0)) for s in stats) for k in rollout_correction.SUM_KEYS}
        ),
        "off_policy/is_weight_mean": _ratio(stats, "is_weight_sum", "is_weight_tokens"),
        "off_policy/is_weight_max": max(s["is_weight_max"] for s in stats),
        "off_policy/truncated_fraction": _ratio(stats, "is_truncated_tokens", "is_weight_tokens"),
        "grad_norm": stats[0]["grad_norm"],
        # every rank skips the same updates (they see the same reduced norm): rank 0's count
        "train/skipped_steps": int(stats[0]["skipped_updates"]),
        "train/updates": int(stats[0]["updates"]),
    }


class SkipGuard:
    """Optimizer steps skipped in a row; `record` raises once `max_in_a_row` is reached."""

    def __init__(self, max_in_a_row: int) -> None:
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.total = 0

    def record(self, step: int, metrics: Mapping[str, Any]) -> None:
        skipped = int(metrics["train/skipped_steps"])
        updates = int(metrics["train/updates"])
        self.total += skipped
        # A step whose last update went through ends the run of skips.
        self.in_a_row = self.in_a_row + skipped if skipped == updates else skipped
        if self.in_a_row >= self.max_in_a_row:
            culprits = [k for k in ("loss", "pg_loss", "kl", "grad_norm") if not _finite(metrics.get(k))]
            raise TrainingDivergedError(
                f"training diverged at step {step}: {self.in_a_row} optimizer steps in a row had a "
                f"non-finite gradient norm (grad_norm={metrics['grad_norm']}; non-finite: "
                f"{', '.join(culprits) or 'grad_norm'}; grpo.maxSkippedSteps {self.max_in_a_row}); "
                "lower grpo.learningRate, check the reward for huge values, or raise maxSkippedSteps"
            )


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return True

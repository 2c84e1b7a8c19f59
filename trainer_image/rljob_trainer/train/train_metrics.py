"""One step's training metrics from the ranks' sums, and the guard that fails a diverged run.

Role: `step_training_metrics` turns the per-rank sums `trainer.TrainingRank.train_step` returns into
the step's metrics (loss, pg_loss and kl as means over the step's optimizer updates; token means of
clipfrac, clipfrac_low/high, ppo_kl and entropy; the engines' log-prob gap and IS weights;
`train/skipped_steps`); `SkipGuard` counts optimizer steps skipped in a row for a non-finite
gradient norm and raises `TrainingDivergedError` at `grpo.maxSkippedSteps`, naming the step and
the metric (the trainer writes it to the termination log, the operator quotes it). Pure; caller:
`rljob_trainer.driver`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


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
        "clipfrac": _ratio(stats, "clipfrac_tokens", "loss_tokens"),
        "clipfrac_low": _ratio(stats, "clipfrac_low_tokens", "loss_tokens"),
        "clipfrac_high": _ratio(stats, "clipfrac_high_tokens", "loss_tokens"),
        "ppo_kl": _ratio(stats, "ppo_kl_sum", "loss_tokens"),
        "entropy": _ratio(stats, "entropy_sum", "loss_tokens"),
        # mean |trainer - engine| log-prob over response tokens, before any update of the step
        "rollout/logprob_diff": _ratio(stats, "logprob_diff_sum", "logprob_diff_tokens"),
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

"""Step metrics from the ranks' sums and the skipped-step guard (rljob_trainer.train.train_metrics)."""

from __future__ import annotations

import math

import pytest

from rljob_trainer.train import train_metrics as tm
from rljob_trainer.train import trainer


def _rank(**over: float) -> dict:
    base = dict.fromkeys(trainer.STAT_SUMS, 0.0)
    base.update(loss=0.5, pg_loss=0.4, kl=0.1, loss_tokens=10.0, pg_clipfrac_tokens=2.0, entropy=0.25)
    base.update(grad_norm=1.0, pg_loss_updates=[0.4], updates=1)
    base.update(over)
    return base


def test_shares_add_up_over_ranks_and_token_means_are_weighted() -> None:
    m = tm.step_training_metrics([_rank(), _rank(loss_tokens=30.0, pg_clipfrac_tokens=2.0, entropy=0.5)])
    assert m["loss"] == pytest.approx(1.0) and m["pg_loss_updates"] == [pytest.approx(0.8)]
    # token means weigh by tokens; entropy is a share of the global aggregate, like the loss: summed
    assert m["pg_clipfrac"] == pytest.approx(4 / 40) and m["entropy"] == pytest.approx(0.75)
    assert m["train/skipped_steps"] == 0


def _metrics(skipped: int, updates: int = 1) -> dict:
    return {"train/skipped_steps": skipped, "train/updates": updates, "grad_norm": math.nan, "loss": math.nan}


def test_the_guard_fails_after_max_skipped_steps_in_a_row_only() -> None:
    guard = tm.SkipGuard(3)
    guard.record(1, _metrics(1))
    guard.record(2, _metrics(1))
    guard.record(3, _metrics(0))  # a good step ends the run of skips
    guard.record(4, _metrics(1))
    guard.record(5, _metrics(1))
    with pytest.raises(
        tm.TrainingDivergedError, match=r"at step 6: 3 optimizer steps in a row.*loss, grad_norm"
    ):
        guard.record(6, _metrics(1))
    assert guard.total == 5

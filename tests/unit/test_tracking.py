"""Tracker selection and the per-step scalars (`rljob_trainer.outputs.tracking`); no backend needed."""

from __future__ import annotations

import math
from typing import Any

import pytest

from rljob_trainer import config
from rljob_trainer.outputs import telemetry, tracking


def _report() -> telemetry.SyncReport:
    return telemetry.SyncReport(
        step=3, time=1.0, interval_s=1.0, trainer_wait_s=0.25, generation_s=0.5, training_s=0.4,
        inflight_request_seconds=2.0, engine_seconds=1.0, snapshot_inflight=0, shared_engines_awake=1,
        dedicated_engines=2, mean_reward=0.5, loss=0.1, tokens_per_s=100.0, response_len_mean=4.0,
    )  # fmt: skip


def _cfg(**over: Any) -> config.TrainerConfig:
    return config.parse_config(
        {"model": {"name": "m", "source": "tiny", "hfConfig": {"model_type": "qwen2"}},
         "rollout": {"sharedEngines": 1}, **over}
    )  # fmt: skip


def test_scalars_keep_numbers_log_non_finite_as_nan_and_add_engines() -> None:
    metrics = {
        "step": 3, "mean_reward": 0.5, "reward/mathAccuracy": 0.5, "loss": 0.1, "dp_balance/applied": 1,
        "prompt_indices": [1, 2], "nan_metric": math.nan, "inf_metric": math.inf, "flag": True,
        "strategy": "kk",
    }  # fmt: skip
    got = tracking.step_scalars(metrics, _report(), shared_engines_total=1)
    # A diverging run must show in every tracker: non-finite values are logged as NaN, never dropped.
    assert math.isnan(got.pop("nan_metric")) and math.isnan(got.pop("inf_metric"))
    assert got == {
        "mean_reward": 0.5, "reward/mathAccuracy": 0.5, "loss": 0.1, "dp_balance/applied": 1.0,
        "engines/shared_awake": 1.0, "engines/dedicated": 2.0, "engines_awake": 3.0, "engines_total": 3.0,
        "trainer_wait_s": 0.25,
    }  # fmt: skip


def test_tensorboard_dir_defaults_under_the_checkpoint_dir(tmp_path: Any) -> None:
    t = tracking.Trackers.from_config(_cfg(checkpoint={"dir": str(tmp_path)}), run_name="job")
    assert t.names == ["tensorboard"]
    assert t.trackers[0].log_dir == tmp_path / tracking.TENSORBOARD_DIR
    t.close()
    assert tracking.Trackers.from_config(_cfg(), run_name="job").names == []  # nowhere to write


def test_a_missing_or_failing_tracker_never_stops_the_run(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_wandb(*_: Any, **__: Any) -> Any:
        raise ImportError("No module named 'wandb'")

    monkeypatch.setattr(tracking, "WandbTracker", no_wandb)
    cfg = _cfg(checkpoint={"dir": str(tmp_path)}, tracking={"wandb": {"project": "p"}})
    t = tracking.Trackers.from_config(cfg, run_name="job")
    assert t.names == ["tensorboard"] and "wandb disabled" in caplog.text

    class Broken:
        name = "broken"

        def log(self, step: int, scalars: Any) -> None:
            raise OSError("disk full")

        def close(self) -> None:
            pass

    t.trackers.append(Broken())
    t.log_step({"step": 1, "loss": 0.5}, None)
    assert t.names == ["tensorboard"] and "broken failed at step 1" in caplog.text
    t.close()

"""Experiment trackers: the same per-step scalars to TensorBoard (always), W&B and MLflow (optional).

Role: the driver calls `Trackers.log_step(metrics, report)` once per step and `close()` at the end.
`step_scalars` (pure) picks what every tracker gets: reward and its parts, loss, KL, entropy,
pg_clipfrac and pg_clipfrac_lower, `rollout_corr/*`, grad norm, response lengths, tokens/s, the step
time split, `dp_balance/*` and engines awake/total.
TensorBoard event files go to `tracking.tensorboardDir` (default `<checkpoint.dir>/tensorboard`)
through torch's `SummaryWriter`. W&B and MLflow come from the `tracking` extra; a tracker whose
package is missing or whose backend fails is logged and skipped, so a tracker never stops a run; the
cause is kept in `Trackers.errors`, which the driver reports in its SyncReport (`trackerErrors`) and the
operator shows as the job's `Tracking` condition and a Warning Event. MLflow takes only `http(s)://`
tracking URIs (a tracking server): the tracking extra installs `mlflow-skinny`, which has no SQL
store, and MLflow 3.x refuses new `file:` stores. Callers: `rljob_trainer.driver`, tests.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from rljob_trainer import config as config_mod
from rljob_trainer.outputs import telemetry

log = logging.getLogger("rljob_trainer.outputs.tracking")

TENSORBOARD_DIR = "tensorboard"
# Driver metrics that are bookkeeping rather than curves.
_SKIP = frozenset({"step", "prompt_indices"})


def step_scalars(
    metrics: Mapping[str, Any], report: telemetry.SyncReport | None, *, shared_engines_total: int
) -> dict[str, float]:
    """The numeric metrics of one step (bools and lists dropped; a value that is not finite is logged
    as NaN, never dropped, so a diverging run shows in every tracker) plus, from the step's SyncReport,
    `engines/shared_awake`, `engines/dedicated` and (when the driver did not set them)
    `engines_awake` = shared awake + dedicated and `engines_total` = shared + dedicated."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key in _SKIP or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[key] = float(value) if math.isfinite(float(value)) else math.nan
    if report is not None:
        out["engines/shared_awake"] = float(report.shared_engines_awake)
        out["engines/dedicated"] = float(report.dedicated_engines)
        out.setdefault("engines_awake", float(report.shared_engines_awake + report.dedicated_engines))
        out.setdefault("engines_total", float(shared_engines_total + report.dedicated_engines))
        out["trainer_wait_s"] = float(report.trainer_wait_s)
    return out


class Tracker(Protocol):
    name: str

    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()  # a killed pod keeps every step written so far

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(
        self, settings: config_mod.WandbSettings, *, run_name: str | None, directory: str | None
    ) -> None:
        import wandb

        key = os.environ.get(settings.api_key_env)
        if settings.mode == "online" and key:
            wandb.login(key=key, relogin=True)
        self._run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=settings.run_name or run_name,
            mode=settings.mode,
            dir=directory,
            reinit="create_new",
        )

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        self._run.finish()


MLFLOW_REQUEST_BOUNDS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


class MlflowTracker:
    name = "mlflow"

    def __init__(self, settings: config_mod.MlflowSettings, *, run_name: str | None) -> None:
        # MLflow's client retries a failed request 7 times with exponential backoff (about four
        # minutes) and waits 120 s for an answer: an unreachable server would stall the trainer at
        # start and then at every step's log. Bounded here unless the pod's env says otherwise.
        for var, value in MLFLOW_REQUEST_BOUNDS.items():
            os.environ.setdefault(var, value)
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=settings.tracking_uri)
        exp = self._client.get_experiment_by_name(settings.experiment)
        exp_id = exp.experiment_id if exp is not None else self._client.create_experiment(settings.experiment)
        run = self._client.create_run(exp_id, run_name=settings.run_name or run_name)
        self.run_id = run.info.run_id

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        batch = [Metric(key, value, now_ms, step) for key, value in scalars.items()]
        self._client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


class Trackers:
    """Every configured tracker behind one `log_step`; a failing tracker is dropped, never raised."""

    def __init__(
        self, trackers: list[Tracker], *, shared_engines_total: int, errors: list[str] | None = None
    ) -> None:
        self.trackers = trackers
        self.shared_engines_total = shared_engines_total
        self.errors: list[str] = list(errors or [])  # "<tracker>: <cause>", for the job's status

    @classmethod
    def from_config(cls, cfg: config_mod.TrainerConfig, *, run_name: str | None) -> Trackers:
        t = cfg.tracking
        tb_dir = t.tensorboard_dir or (
            str(Path(cfg.checkpoint.dir) / TENSORBOARD_DIR) if cfg.checkpoint.dir else None
        )
        out: list[Tracker] = []
        attempts: list[tuple[str, Any]] = []
        if tb_dir:
            attempts.append(("tensorboard", lambda: TensorBoardTracker(tb_dir)))
        if t.wandb is not None:
            w = t.wandb
            attempts.append(
                ("wandb", lambda: WandbTracker(w, run_name=run_name, directory=cfg.checkpoint.dir))
            )
        if t.mlflow is not None:
            m = t.mlflow
            attempts.append(("mlflow", lambda: MlflowTracker(m, run_name=run_name)))
        errors: list[str] = []
        for name, make in attempts:
            try:
                out.append(make())
            except Exception as exc:  # ImportError (extra not installed) or an unreachable backend
                log.warning("tracking: %s disabled (%s: %s)", name, type(exc).__name__, exc)
                errors.append(_error(name, "could not start", exc))
        return cls(out, shared_engines_total=cfg.rollout.shared_engines, errors=errors)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trackers]

    def log_step(self, metrics: Mapping[str, Any], report: telemetry.SyncReport | None) -> None:
        scalars = step_scalars(metrics, report, shared_engines_total=self.shared_engines_total)
        step = int(metrics["step"])
        for tracker in list(self.trackers):
            try:
                tracker.log(step, scalars)
            except Exception as exc:
                log.warning("tracking: %s failed at step %s and is dropped (%s)", tracker.name, step, exc)
                self.trackers.remove(tracker)
                self.errors.append(_error(tracker.name, f"failed at step {step}", exc))

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:
                log.warning("tracking: closing %s failed (%s)", tracker.name, exc)
        self.trackers = []


def _error(name: str, what: str, exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return f"{name} {what}: {text[:300]}"

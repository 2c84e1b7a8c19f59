"""status.progress.exportPath follows the driver's SyncReport and survives reports without one."""

from __future__ import annotations

from datetime import datetime, timezone

from test_builders import make_spec, static_plan

from rljob_operator import api
from rljob_operator.reconcile import status
from rljob_trainer.outputs.telemetry import SyncReport

NOW = datetime(2026, 12, 1, tzinfo=timezone.utc)
SPEC = make_spec()


def _report(step: int, export_path: str | None) -> SyncReport:
    return SyncReport(
        step=step, time=1000.0 + step, interval_s=1.0, trainer_wait_s=0.1, generation_s=0.1,
        training_s=0.1, inflight_request_seconds=1.0, engine_seconds=1.0, snapshot_inflight=0,
        shared_engines_awake=0, dedicated_engines=1, mean_reward=0.5, loss=0.1, tokens_per_s=10.0,
        response_len_mean=1.0, export_path=export_path,
    )  # fmt: skip


def _status(old: api.RLJobStatus, report: SyncReport) -> api.RLJobStatus:
    observed = status.Observed(spec=SPEC, plan=static_plan(SPEC), report=report)
    return status.compute_status(old, observed, generation=1, now=NOW)


def test_export_path_is_reported_and_kept() -> None:
    first = _status(api.RLJobStatus(), _report(50, "/checkpoints/hf/step-50"))
    assert first.progress is not None and first.progress.export_path == "/checkpoints/hf/step-50"
    assert first.to_k8s()["progress"]["exportPath"] == "/checkpoints/hf/step-50"
    later = _status(first, _report(51, None))
    assert later.progress is not None and later.progress.step == 51
    assert later.progress.export_path == "/checkpoints/hf/step-50"
    final = _status(later, _report(52, "/checkpoints/hf/final"))
    assert final.progress is not None and final.progress.export_path == "/checkpoints/hf/final"

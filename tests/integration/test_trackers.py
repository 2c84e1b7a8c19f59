"""W&B (offline) and MLflow (file store) receive the same per-step scalars as TensorBoard.

Real packages from the `tracking` extra, no network: W&B writes its offline run file (read back
here record by record: the file is a LevelDB-style log of W&B protobuf records), MLflow writes a
file store read back through its own client.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from trainer_configs import toy_config

from rljob_trainer import driver

pytestmark = [pytest.mark.torch, pytest.mark.slow]

KEYS = ("mean_reward", "loss", "grad_norm", "tokens_per_s", "engines_awake", "dp_balance/applied")


def _wandb_records(path: Path) -> Iterator[bytes]:
    """Records of a `.wandb` file: a 7-byte header, then 32 KiB blocks of (crc, len, type) chunks."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, block, partial = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            partial = chunk
        elif kind == 3:
            partial += chunk
        elif kind == 4:
            yield partial + chunk


def _wandb_history(run_dir: Path, timeout_s: float = 60.0) -> list[dict[str, float]]:
    """The history rows of the offline run, once its file is whole.

    `wandb.finish()` returns when the wandb-core service has the exit record, and the service may
    still be flushing the file then (seen on a loaded machine as a truncated last record), so read
    until the file parses and holds the exit record.
    """
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    files = list(run_dir.rglob("offline-run-*/*.wandb"))
    assert len(files) == 1, files
    deadline = time.monotonic() + timeout_s
    while True:
        rows, kinds = [], []
        try:
            for raw in _wandb_records(files[0]):
                rec = pb.Record()
                rec.ParseFromString(raw)
                kinds.append(rec.WhichOneof("record_type"))
                if kinds[-1] == "history":
                    rows.append(
                        {(i.key or "/".join(i.nested_key)): float(i.value_json) for i in rec.history.item}
                    )
        except DecodeError:
            kinds = []
        if "exit" in kinds:
            return rows
        assert time.monotonic() < deadline, f"{files[0]} never held a whole run (records: {kinds})"
        time.sleep(0.5)


def test_wandb_offline_and_mlflow_file_store_get_every_step(tmp_path: Path, monkeypatch: Any) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store opt-in
    uri = f"file:{tmp_path / 'mlruns'}"
    cfg = toy_config(
        grpo={"maxSteps": 3, "promptsPerStep": 4, "groupSize": 4},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
        checkpoint={"dir": str(tmp_path / "ckpt"), "intervalSteps": 10},
        export={"final": False, "everyCheckpoint": False},
        tracking={
            "wandb": {"project": "rljob-test", "mode": "offline"},
            "mlflow": {"trackingUri": uri, "experiment": "rljob-test"},
        },
    )
    d = driver.GRPODriver(cfg, driver.LocalRuntime(cfg))
    assert d.tracker.names == ["tensorboard", "wandb", "mlflow"]
    try:
        metrics = d.run()
    finally:
        d.shutdown()

    rows = _wandb_history(tmp_path / "ckpt")
    assert [int(r["_step"]) for r in rows] == [1, 2, 3]
    for key in KEYS:
        assert all(key in r for r in rows), key
    for key in ("mean_reward", "loss", "grad_norm"):
        assert [r[key] for r in rows] == pytest.approx([m[key] for m in metrics]), key

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("rljob-test")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    for key in KEYS:
        history = client.get_metric_history(run.info.run_id, key)
        assert [h.step for h in history] == [1, 2, 3], key
    loss = [h.value for h in client.get_metric_history(run.info.run_id, "loss")]
    assert loss == pytest.approx([m["loss"] for m in metrics])

"""W&B (offline) and MLflow (a real `mlflow server`) receive the same per-step scalars as TensorBoard,
a non-finite one as NaN; a tracker that cannot start shows in the SyncReport the operator reads.

Real packages: W&B writes its offline run file (read back here record by record: the file is a
LevelDB-style log of W&B protobuf records); MLflow is the `mlflow server` of the full `mlflow`
package in `.venv-mlflow/` (`make setup`, trainer_image/locks/mlflow-server.txt: kept out of .venv,
where its scikit-learn would be imported by transformers in every trainer process), started here on
loopback with its SQL store (as the tests start the control plane), and the trainer talks to it
over HTTP with the tracking extra's `mlflow-skinny`, the only kind of tracking URI the trainer
accepts (`file:` stores are refused by MLflow 3, and skinny has no SQL store). Read back through
MLflow's own client.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import struct
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from trainer_configs import toy_config

from rljob_trainer import driver

REPO = Path(__file__).resolve().parents[2]
MLFLOW_SERVER = REPO / ".venv-mlflow" / "bin" / "mlflow"

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


# A reward whose group mean overflows float64 at its second call (step 2): that step's loss is NaN.
NAN_AT_STEP_2 = """
CALLS = [0]

def reward(prompts, completions, answers, **kwargs):
    CALLS[0] += 1
    value = 1e308 if CALLS[0] == 2 else 0.0
    return [value if i % 2 else 0.5 * value + (i % 3) for i in range(len(completions))]
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `mlflow server` on a free loopback port (SQL store in a temp dir); its URI."""
    assert MLFLOW_SERVER.exists(), f"{MLFLOW_SERVER} is missing: make setup installs it"
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    log = open(root / "server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            str(MLFLOW_SERVER),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "artifacts"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its uvicorn and job-runner children go with it
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # a loaded two-core machine took 2.5 min to import the server
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (root / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not come up in 300 s"
            time.sleep(1.0)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:  # uvicorn waits out its graceful shutdown (about 30 s) for nothing here
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        log.close()


def test_wandb_offline_and_a_real_mlflow_server_get_every_step_nan_included(
    tmp_path: Path, monkeypatch: Any, mlflow_server: str
) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_SILENT", "true")
    reward = tmp_path / "reward.py"
    reward.write_text(NAN_AT_STEP_2)
    cfg = toy_config(
        grpo={"maxSteps": 3, "promptsPerStep": 4, "groupSize": 4},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
        rewards=[{"name": "module", "path": str(reward), "function": "reward"}],
        checkpoint={"dir": str(tmp_path / "ckpt"), "intervalSteps": 10},
        export={"final": False, "everyCheckpoint": False},
        tracking={
            "wandb": {"project": "rljob-test", "mode": "offline"},
            "mlflow": {"trackingUri": mlflow_server, "experiment": "rljob-test"},
        },
    )
    d = driver.GRPODriver(cfg, driver.LocalRuntime(cfg))
    assert d.tracker.names == ["tensorboard", "wandb", "mlflow"] and d.tracker.errors == []
    try:
        metrics = d.run()
    finally:
        d.shutdown()
    assert math.isnan(metrics[1]["loss"]) and metrics[1]["train/skipped_steps"] == 1
    assert d.state.history[-1].tracker_errors == []

    def same(got: list[float], want: list[float]) -> bool:  # a value that is not finite arrives as NaN
        return all(
            (math.isnan(g) and not math.isfinite(w)) or g == pytest.approx(w)
            for g, w in zip(got, want, strict=True)
        )

    rows = _wandb_history(tmp_path / "ckpt")
    assert [int(r["_step"]) for r in rows] == [1, 2, 3]
    for key in (*KEYS, "train/skipped_steps"):
        assert all(key in r for r in rows), key
    for key in ("mean_reward", "loss", "grad_norm"):
        assert same([r[key] for r in rows], [m[key] for m in metrics]), key

    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("rljob-test")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    for key in (*KEYS, "train/skipped_steps"):
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted(h.step for h in history) == [1, 2, 3], key
    loss = [h.value for h in sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda h: h.step)]
    assert same(loss, [m["loss"] for m in metrics]), loss

    acc = EventAccumulator(str(tmp_path / "ckpt" / "tensorboard"))
    acc.Reload()
    assert same([e.value for e in acc.Scalars("loss")], [m["loss"] for m in metrics])


def test_a_tracker_that_cannot_start_is_reported_to_the_operator(tmp_path: Path, monkeypatch: Any) -> None:
    # MLflow's client alone retries a refused connection 7 times with exponential backoff (about
    # four minutes) before it raises; the trainer bounds it (tracking.MLFLOW_REQUEST_BOUNDS).
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    started = time.monotonic()
    cfg = toy_config(
        grpo={"maxSteps": 1, "promptsPerStep": 2, "groupSize": 2},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
        # nothing listens there: MLflow's client fails when the tracker starts
        tracking={"mlflow": {"trackingUri": f"http://127.0.0.1:{_free_port()}", "experiment": "x"}},
    )
    d = driver.GRPODriver(cfg, driver.LocalRuntime(cfg))
    try:
        d.run()
    finally:
        d.shutdown()
    (error,) = d.state.history[-1].tracker_errors
    assert error.startswith("mlflow could not start:"), error
    assert time.monotonic() - started < 120, "an unreachable MLflow server stalled the trainer"

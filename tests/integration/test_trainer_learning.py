"""End to end on CPU: `python -m rljob_trainer` (Ray, two gloo training ranks, a shared and a dedicated
transformers engine) makes a tiny model learn the toy task, then a restarted job resumes from the
checkpoint across both ranks; and a SIGKILLed job resumes with the same data order and numbers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trainer_configs import toy_config

from rljob_trainer import config
from rljob_trainer.outputs import checkpoint

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def _run(cfg_path: Path, metrics: Path, *extra: str, timeout_s: float = 420) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLJOB_")}
    env["RAY_DEDUP_LOGS"] = "0"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rljob_trainer",
            "--config",
            str(cfg_path),
            "--metrics-jsonl",
            str(metrics),
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _read(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_grpo_two_ranks_learns_and_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    cfg = toy_config(checkpoint={"dir": str(ckpt), "intervalSteps": 80})
    cfg_path = tmp_path / "trainer.json"
    cfg_path.write_text(config.dump_config(cfg))
    metrics = tmp_path / "metrics.jsonl"
    started = time.monotonic()
    _run(cfg_path, metrics)
    wall_s = time.monotonic() - started
    rows = _read(metrics)
    assert [r["step"] for r in rows] == list(range(1, 161))
    start, end = _mean([r["mean_reward"] for r in rows[:20]]), _mean([r["mean_reward"] for r in rows[-20:]])
    print(f"toy GRPO, 2 ranks: mean reward {start:.3f} (steps 1-20) -> {end:.3f} (141-160), {wall_s:.0f} s")
    assert start < 0.15
    assert end > start + 0.25, f"reward did not rise: {start:.3f} -> {end:.3f}"
    # The DP-balance planner ran on every step and telemetry saw the engines work.
    assert all("dp_balance/strategy_name" in r for r in rows)
    assert all(r["inflight_request_seconds"] > 0 and r["engine_seconds"] > 0 for r in rows)
    assert [s for s, _ in checkpoint.list_checkpoints(ckpt)] == [80, 160]

    # Restart the job with more steps: both ranks load the step-160 state and carry on at its level.
    more = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"max_steps": 164})})
    cfg_path.write_text(config.dump_config(more))
    resumed = tmp_path / "resumed.jsonl"
    _run(cfg_path, resumed)
    again = _read(resumed)
    assert [r["step"] for r in again] == [161, 162, 163, 164]
    assert _mean([r["mean_reward"] for r in again]) > start + 0.2


def _local_cfg(tmp_path: Path, max_steps: int) -> Path:
    cfg = toy_config(
        grpo={"maxSteps": max_steps},
        checkpoint={"dir": str(tmp_path / "ckpt"), "intervalSteps": 3, "keepLast": 3},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
    )
    p = tmp_path / f"trainer-{max_steps}.json"
    p.write_text(config.dump_config(cfg))
    return p


def test_resume_after_sigkill_continues_with_identical_data_order(tmp_path):
    reference_dir, killed_dir = tmp_path / "ref", tmp_path / "killed"
    reference_dir.mkdir()
    killed_dir.mkdir()
    ref_metrics = reference_dir / "m.jsonl"
    _run(_local_cfg(reference_dir, 12), ref_metrics, timeout_s=300)
    reference = {r["step"]: r for r in _read(ref_metrics)}

    # A long job, SIGKILLed as soon as its first checkpoint is on disk.
    killed_metrics = killed_dir / "m.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLJOB_")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rljob_trainer",
            "--config",
            str(_local_cfg(killed_dir, 10_000)),
            "--metrics-jsonl",
            str(killed_metrics),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 240
    try:
        while checkpoint.latest_checkpoint(killed_dir / "ckpt") is None:
            assert proc.poll() is None, "trainer exited before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    latest = checkpoint.latest_checkpoint(killed_dir / "ckpt")
    assert latest is not None
    resumed_from = int(latest.name.split("-")[1])
    assert resumed_from < 12

    restarted = killed_dir / "restarted.jsonl"
    _run(_local_cfg(killed_dir, 12), restarted, timeout_s=300)
    rows = _read(restarted)
    assert [r["step"] for r in rows] == list(range(resumed_from + 1, 13))
    for r in rows:  # same prompts, same samples, same update: the kill cost only the lost steps
        ref = reference[r["step"]]
        assert r["prompt_indices"] == ref["prompt_indices"]
        assert r["mean_reward"] == ref["mean_reward"]
        assert r["loss"] == pytest.approx(ref["loss"], abs=1e-7)
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)

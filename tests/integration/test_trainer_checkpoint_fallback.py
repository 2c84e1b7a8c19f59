"""A job whose newest checkpoint is cut short resumes from the one before, and says so.

The real driver and training rank (one CPU rank, the transformers engine, the toy task) save
checkpoints at steps 3 and 6; step 6's tensors file is then truncated, as a node lost mid-copy or
a full disk leaves it. The restarted job resumes from step 3 (not 6, not 0), logs why, and its
first SyncReport carries `checkpointFallback`, which the operator posts as a Warning Event
(tests/unit/test_reconcile_security.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from trainer_configs import toy_config

from rljob_trainer import driver
from rljob_trainer.outputs import checkpoint

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def _run(tmp_path: Path, max_steps: int) -> tuple[driver.GRPODriver, list[dict]]:
    cfg = toy_config(
        grpo={"maxSteps": max_steps, "promptsPerStep": 4, "groupSize": 4},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
        checkpoint={"dir": str(tmp_path / "ckpt"), "intervalSteps": 3, "keepLast": 3},
        export={"final": False, "everyCheckpoint": False},
    )
    d = driver.GRPODriver(cfg, driver.LocalRuntime(cfg))
    try:
        return d, d.run()
    finally:
        d.shutdown()


def test_a_truncated_newest_checkpoint_resumes_from_the_one_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _run(tmp_path, 6)
    root = tmp_path / "ckpt"
    assert [s for s, _ in checkpoint.list_checkpoints(root)] == [3, 6]
    tensors = checkpoint.checkpoint_path(root, 6) / checkpoint.TENSORS
    tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 3])

    with caplog.at_level(logging.INFO, logger="rljob_trainer"):
        d, rows = _run(tmp_path, 8)
    assert [r["step"] for r in rows] == [4, 5, 6, 7, 8]  # from step 3: 6 was not trusted
    assert "resumed from" in caplog.text and "step-00000003 at step 3" in caplog.text
    warning = next(r.getMessage() for r in caplog.records if "checkpoint fallback" in r.getMessage())
    assert "step-00000006/tensors.safetensors" in warning and "does not match its sha256" in warning
    first = next(r for r in d.state.history if r.step == 4)
    assert first.checkpoint_fallback is not None
    assert first.checkpoint_fallback.startswith("resumed from step-00000003")
    assert all(r.checkpoint_fallback is None for r in d.state.history if r.step > 4)  # said once
    # The re-run saved step 6 afresh: the next resume has nothing to skip.
    assert checkpoint.load_latest(root).fallback_note() is None

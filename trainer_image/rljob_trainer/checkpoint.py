"""Checkpoints: atomic save of a training step's full state and resume from the latest one.

Role: the driver gathers the state (trainable weights or adapters, optimizer, every rank's RNG from
rank 0; step, data position and driver state from itself) and saves it here as
`<dir>/step-<NNNNNNNN>/state.pt` + `meta.json`. A checkpoint is written into a temporary directory
and renamed into place, so `latest_checkpoint` never sees a half-written one, even after SIGKILL.
Callers: `rljob_trainer.driver`, tests.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

_PREFIX = "step-"


def checkpoint_path(root: str | Path, step: int) -> Path:
    return Path(root) / f"{_PREFIX}{step:08d}"


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first (temporary directories are ignored)."""
    r = Path(root)
    if not r.is_dir():
        return []
    out = []
    for p in r.iterdir():
        if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX) :].isdigit():
            out.append((int(p.name[len(_PREFIX) :]), p))
    return sorted(out)


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def save_checkpoint(
    root: str | Path, step: int, state: dict[str, Any], meta: dict[str, Any], *, keep_last: int
) -> Path:
    """Write `state` (torch-serialisable) and `meta` (JSON) for `step` atomically; prune old ones."""
    r = Path(root)
    r.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(r, step)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{_PREFIX}{step:08d}-", dir=r))
    try:
        torch.save(state, tmp / "state.pt")
        (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=2, sort_keys=True))
        for f in tmp.iterdir():  # data on disk before the rename makes it visible
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():  # a re-run of the same step after a restart
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for _, old in list_checkpoints(r)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state, meta) of one checkpoint directory."""
    p = Path(path)
    state = torch.load(p / "state.pt", map_location="cpu", weights_only=False)
    meta = json.loads((p / "meta.json").read_text())
    return state, meta

"""Unit tests for rljob_trainer.outputs.checkpoint: safetensors + JSON on disk, a sha256 per file verified on
load, nothing unpickled, and resume falling back past a corrupt or partial newest checkpoint."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from rljob_trainer.outputs import checkpoint  # noqa: E402

pytestmark = pytest.mark.torch


def train_state() -> dict[str, Any]:
    """What `trainer.get_train_state` returns: weights, a real AdamW state after one step (int keys,
    tuple betas, 0-d step tensors), every rank's RNG as a ByteTensor."""
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    optimizer.step()
    return {
        "ranks": {
            "model": dict(model.state_dict()),
            "optimizer": optimizer.state_dict(),
            "rng": [torch.random.get_rng_state(), torch.random.get_rng_state()],
        }
    }


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, path


def save(root: Path, step: int, state: dict[str, Any] | None = None) -> Path:
    return checkpoint.save_checkpoint(
        root, step, state or train_state(), {"sampler": {"epoch": 0}, "history": []}, keep_last=5
    )


def test_the_state_round_trips_through_safetensors_and_json_with_no_pickle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = train_state()
    path = save(tmp_path, 3, state)
    assert sorted(p.name for p in path.iterdir()) == sorted([*checkpoint.FILES, checkpoint.CHECKSUMS])
    sums = json.loads((path / checkpoint.CHECKSUMS).read_text())
    assert sums == {f: checkpoint.sha256_of(path / f) for f in checkpoint.FILES}

    def no_unpickling(*_: Any, **__: Any) -> None:
        raise AssertionError("a checkpoint load unpickled something")

    monkeypatch.setattr(torch, "load", no_unpickling)
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    monkeypatch.setattr(pickle, "load", no_unpickling)
    loaded, meta = checkpoint.load_checkpoint(path)
    assert meta["step"] == 3 and meta["sampler"] == {"epoch": 0}
    assert_same(loaded, state)  # int keys, tuples (betas) and dtypes included
    fresh = torch.optim.AdamW(torch.nn.Linear(4, 3).to(torch.bfloat16).parameters(), lr=1e-3)
    fresh.load_state_dict(loaded["ranks"]["optimizer"])  # what torch's own loader accepts


def test_views_and_shared_storage_are_written_apart() -> None:
    base = torch.arange(12.0)
    shared = {"a": base[:6], "b": base[6:], "t": base.view(3, 4).t(), "same": base}
    path = checkpoint.save_checkpoint(
        Path(__import__("tempfile").mkdtemp()), 1, {"x": shared, "also": base}, {}, keep_last=1
    )
    state, _ = checkpoint.load_checkpoint(path)
    for key, tensor in shared.items():
        assert torch.equal(state["x"][key], tensor), key


def test_a_state_that_is_not_tensors_and_json_is_refused_on_save(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"state\.ranks\.when: datetime"):
        checkpoint.save_checkpoint(
            tmp_path, 1, {"ranks": {"when": __import__("datetime").datetime.now()}}, {}, keep_last=1
        )
    assert checkpoint.list_checkpoints(tmp_path) == []  # nothing half-written left behind


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        ("truncate", r"step-00000006/tensors\.safetensors \(\d+ bytes\) does not match its sha256"),
        ("flip", r"step-00000006/state\.json \(\d+ bytes\) does not match its sha256"),
        ("drop-meta", r"step-00000006/meta\.json is missing: the checkpoint is partial"),
        ("drop-sums", r"step-00000006/checksums\.json is missing: the checkpoint is partial"),
    ],
)
def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path: Path, damage: str, fragment: str) -> None:
    path = save(tmp_path, 6)
    if damage == "truncate":
        data = (path / checkpoint.TENSORS).read_bytes()
        (path / checkpoint.TENSORS).write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        text = (path / checkpoint.STATE).read_text()
        (path / checkpoint.STATE).write_text(text.replace("0.9", "0.8", 1))
    elif damage == "drop-meta":
        (path / checkpoint.META).unlink()
    else:
        (path / checkpoint.CHECKSUMS).unlink()
    with pytest.raises(checkpoint.CheckpointError, match=fragment):
        checkpoint.load_checkpoint(path)


def test_an_old_pickled_checkpoint_is_never_unpickled(tmp_path: Path) -> None:
    old = checkpoint.checkpoint_path(tmp_path, 9)
    old.mkdir()
    (old / checkpoint.LEGACY_PICKLE).write_bytes(pickle.dumps({"w": 1}))
    (old / checkpoint.META).write_text(json.dumps({"step": 9}))
    with pytest.raises(checkpoint.CheckpointError, match="is a pickle"):
        checkpoint.load_checkpoint(old)


def test_resume_falls_back_past_corrupt_newest_checkpoints(tmp_path: Path) -> None:
    for step in (3, 6, 9):
        save(tmp_path, step)
    newest = checkpoint.checkpoint_path(tmp_path, 9)
    data = (newest / checkpoint.TENSORS).read_bytes()
    (newest / checkpoint.TENSORS).write_bytes(data[:100])
    (checkpoint.checkpoint_path(tmp_path, 6) / checkpoint.CHECKSUMS).unlink()  # a partial copy
    found = checkpoint.load_latest(tmp_path)
    assert found.path == checkpoint.checkpoint_path(tmp_path, 3) and found.meta is not None
    assert found.meta["step"] == 3 and [p.name for p, _ in found.skipped] == [
        "step-00000009",
        "step-00000006",
    ]
    note = found.fallback_note()
    assert note is not None and note.startswith("resumed from step-00000003")
    assert "step-00000009/tensors.safetensors" in note and "step-00000006/checksums.json is missing" in note

    clean = tmp_path / "clean"
    save(clean, 3)
    assert checkpoint.load_latest(clean).fallback_note() is None
    assert checkpoint.load_latest(tmp_path / "none") == checkpoint.Resumed(None, None, None)
    (checkpoint.checkpoint_path(clean, 3) / checkpoint.META).unlink()
    gone = checkpoint.load_latest(clean)
    assert gone.path is None and "starting from step 0" in (gone.fallback_note() or "")

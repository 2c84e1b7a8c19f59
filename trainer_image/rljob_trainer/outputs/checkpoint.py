"""Checkpoints: atomic save of a training step's full state, verified load, and resume from the
newest checkpoint that reads back whole.

Role: the driver gathers the state (trainable weights or adapters, optimizer, every rank's RNG from
rank 0; step, data position and driver state from itself) and saves it here as
`<dir>/step-<NNNNNNNN>/`:
  - `tensors.safetensors`: every tensor of the state, named by its path in the state's tree;
  - `state.json`: the rest of the tree (dicts, lists, tuples, numbers, strings), tensors as
    `{"__tensor__": name}`;
  - `meta.json`: step, sampler position, history, config;
  - `checksums.json`: the sha256 of each of those files, written last.
Nothing loaded runs code: safetensors and JSON only (a pickle, `state.pt` of older rljob
versions, is refused, never unpickled). `load_checkpoint` verifies every checksum first and
raises `CheckpointError` naming the file; `load_latest` walks from the newest checkpoint back
and returns the first whole one with the reasons it skipped the others (a truncated file, a
missing one), which the driver logs and reports (`SyncReport.checkpointFallback`, a Warning
Event on the RLJob). A checkpoint is written into a temporary directory and renamed into place,
so `list_checkpoints` never sees a half-written one, even after SIGKILL.
Callers: `rljob_trainer.driver`, `rljob_trainer.outputs.export`, tests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

_PREFIX = "step-"
TENSORS = "tensors.safetensors"
STATE = "state.json"
META = "meta.json"
CHECKSUMS = "checksums.json"
FILES = (TENSORS, STATE, META)
LEGACY_PICKLE = "state.pt"
_TENSOR, _TUPLE, _DICT = "__tensor__", "__tuple__", "__dict__"
_HASH_CHUNK_BYTES = 8 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted: a file missing, cut short, changed or not ours."""


def checkpoint_path(root: str | Path, step: int) -> Path:
    return Path(root) / f"{_PREFIX}{step:08d}"


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Checkpoints under `root`, oldest first (temporary directories are ignored; whether each
    one reads back whole is `load_checkpoint`'s to say)."""
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


# ---- the state's tree: tensors apart, the rest as JSON --------------------------------------------
def _split(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """`value` as JSON, its tensors moved to `tensors` under their path (pure but for `tensors`)."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value
        return {_TENSOR: path}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list):
        return [_split(v, f"{path}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {_TUPLE: [_split(v, f"{path}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _split(v, f"{path}.{k}", tensors) for k, v in value.items()}
        # Keys JSON cannot hold (optimizer states are keyed by int): pairs, keys encoded too.
        pairs = [
            [_split(k, f"{path}.key{i}", tensors), _split(v, f"{path}.{k}", tensors)]
            for i, (k, v) in enumerate(value.items())
        ]
        return {_DICT: pairs}
    raise TypeError(f"checkpoint state {path}: {type(value).__name__} is neither a tensor nor JSON")


def _join(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_join(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {_TENSOR}:
        if value[_TENSOR] not in tensors:
            raise CheckpointError(f"{STATE} names tensor {value[_TENSOR]!r}, which {TENSORS} lacks")
        return tensors[value[_TENSOR]]
    if set(value) == {_TUPLE}:
        return tuple(_join(v, tensors) for v in value[_TUPLE])
    if set(value) == {_DICT}:
        return {_hashable(_join(k, tensors)): _join(v, tensors) for k, v in value[_DICT]}
    return {k: _join(v, tensors) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    if isinstance(key, list | dict):
        raise CheckpointError(f"{STATE}: a dict key of type {type(key).__name__}")
    return key


def _storable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors sharing no storage (what safetensors writes)."""
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu")
        storage = t.untyped_storage()
        shared = storage.data_ptr() in storages or storage.nbytes() != t.nbytes
        if shared or not t.is_contiguous():
            t = t.contiguous().clone()
        storages.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


# ---- save ------------------------------------------------------------------------------------------
def save_checkpoint(
    root: str | Path, step: int, state: dict[str, Any], meta: dict[str, Any], *, keep_last: int
) -> Path:
    """Write `state` (tensors and JSON values) and `meta` (JSON) for `step` atomically; prune old ones."""
    from safetensors.torch import save_file

    r = Path(root)
    r.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(r, step)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{_PREFIX}{step:08d}-", dir=r))
    try:
        tensors: dict[str, torch.Tensor] = {}
        tree = _split(state, "state", tensors)
        save_file(_storable(tensors), str(tmp / TENSORS))
        (tmp / STATE).write_text(json.dumps(tree))
        (tmp / META).write_text(json.dumps({"step": step, **meta}, indent=2, sort_keys=True))
        (tmp / CHECKSUMS).write_text(json.dumps({f: sha256_of(tmp / f) for f in FILES}, indent=2))
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


# ---- load ------------------------------------------------------------------------------------------
def verify_checkpoint(path: str | Path) -> None:
    """Raise `CheckpointError` unless every file of the checkpoint is there with its sha256."""
    p = Path(path)
    if (p / LEGACY_PICKLE).exists() and not (p / CHECKSUMS).exists():
        raise CheckpointError(
            f"{p.name}/{LEGACY_PICKLE} is a pickle (written by rljob before safe checkpoints): never "
            "loaded, as loading a pickle runs whatever code it holds"
        )
    try:
        sums = json.loads((p / CHECKSUMS).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{p.name}/{CHECKSUMS} is missing: the checkpoint is partial") from None
    except ValueError as exc:
        raise CheckpointError(f"{p.name}/{CHECKSUMS} is not JSON ({exc})") from None
    if not isinstance(sums, dict) or set(sums) != set(FILES):
        raise CheckpointError(f"{p.name}/{CHECKSUMS} must list exactly {', '.join(FILES)}")
    for name in FILES:
        if not (p / name).is_file():
            raise CheckpointError(f"{p.name}/{name} is missing: the checkpoint is partial")
        actual = sha256_of(p / name)
        if actual != sums[name]:
            size = (p / name).stat().st_size
            raise CheckpointError(
                f"{p.name}/{name} ({size} bytes) does not match its sha256 (cut short or changed)"
            )


def load_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state, meta) of one checkpoint directory, after its checksums; `CheckpointError` otherwise."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    verify_checkpoint(p)
    try:
        tensors = load_file(str(p / TENSORS), device="cpu")
    except SafetensorError as exc:
        raise CheckpointError(f"{p.name}/{TENSORS}: {exc}") from exc
    state = _join(json.loads((p / STATE).read_text()), tensors)
    meta = json.loads((p / META).read_text())
    if not isinstance(state, dict) or not isinstance(meta, dict) or "step" not in meta:
        raise CheckpointError(f"{p.name}: {STATE} and {META} must hold objects, {META} with a step")
    return state, meta


@dataclasses.dataclass(frozen=True)
class Resumed:
    """What `load_latest` found: the newest whole checkpoint (None: none) and the newer ones it
    skipped, each with why."""

    path: Path | None
    state: dict[str, Any] | None
    meta: dict[str, Any] | None
    skipped: tuple[tuple[Path, str], ...] = ()

    def fallback_note(self) -> str | None:
        """One line for the log, the SyncReport and the RLJob's Warning Event; None when nothing
        was skipped."""
        if not self.skipped:
            return None
        why = "; ".join(reason for _, reason in self.skipped)[:1024]
        if self.path is None:
            return f"no checkpoint reads back whole ({why}): starting from step 0"
        return f"resumed from {self.path.name}, the newest checkpoint that reads back whole ({why})"


def load_latest(root: str | Path) -> Resumed:
    """The newest checkpoint under `root` that verifies, walking back past corrupt or partial ones."""
    skipped: list[tuple[Path, str]] = []
    for _, path in reversed(list_checkpoints(root)):
        try:
            state, meta = load_checkpoint(path)
        except CheckpointError as exc:
            skipped.append((path, str(exc)))
            continue
        return Resumed(path, state, meta, tuple(skipped))
    return Resumed(None, None, None, tuple(skipped))

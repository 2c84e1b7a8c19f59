"""Model export: what a run leaves behind that serving stacks load (transformers, peft, vLLM).

Role: write the trained policy in Hugging Face format, atomically, to `<export dir>/<name>`:
  - full fine-tuning: `save_pretrained` (config.json, generation_config.json, model.safetensors)
    plus the tokenizer;
  - LoRA: the PEFT adapter (adapter_config.json, adapter_model.safetensors) plus the tokenizer, and
    with `export.mergeLora` the merged model under `merged/` (what `vllm serve DIR/merged` and
    `AutoModelForCausalLM.from_pretrained` read; the adapter is what `vllm serve BASE --enable-lora
    --lora-modules name=DIR` and `PeftModel.from_pretrained(base, DIR)` read).
Each export also carries `rljob-export.json` (step, fine-tuning mode, base model, files).
Callers: `trainer.TrainingRank.export_hf` (every rank: FSDP2 gathers; rank 0 writes),
`driver.GRPODriver` (at checkpoints and at the end), and `python -m rljob_trainer export`
(from a checkpoint directory, offline, one CPU process).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rljob_trainer import config as config_mod
from rljob_trainer.model import modeling, precision
from rljob_trainer.outputs import checkpoint

log = logging.getLogger("rljob_trainer.outputs.export")

MANIFEST = "rljob-export.json"
MERGED_DIR = "merged"
FINAL = "final"


def export_root(cfg: config_mod.TrainerConfig) -> Path | None:
    """`export.dir`, else `<checkpoint.dir>/hf`; None when neither is set (nothing is exported)."""
    if cfg.export.dir:
        return Path(cfg.export.dir)
    if cfg.checkpoint.dir:
        return Path(cfg.checkpoint.dir) / "hf"
    return None


def step_name(step: int) -> str:
    """`step-<N>`: the export of checkpoint step N."""
    return f"step-{step}"


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _generation_config(model: torch.nn.Module, tokenizer: Any) -> Any:
    """The model's generation config with the tokenizer's special tokens, so servers stop at EOS."""
    gen = copy.deepcopy(model.generation_config)
    for attr in ("eos_token_id", "pad_token_id", "bos_token_id"):
        tid = getattr(tokenizer, attr, None)
        if tid is not None and getattr(gen, attr, None) is None:
            setattr(gen, attr, tid)
    return gen


def _save_full(
    model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], tokenizer: Any, out: Path
) -> None:
    """A plain causal LM (`model` supplies config and class; `state_dict` the weights)."""
    model.save_pretrained(out, state_dict=dict(state_dict), safe_serialization=True)
    _generation_config(model, tokenizer).save_pretrained(out)
    for attr in ("eos_token_id", "pad_token_id", "bos_token_id"):
        tid = getattr(tokenizer, attr, None)
        if tid is not None and getattr(model.config, attr, None) is None:
            cfg = json.loads((out / "config.json").read_text())
            cfg[attr] = tid
            (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(out)


def write_export(
    model: torch.nn.Module,
    tokenizer: Any,
    out: str | Path,
    *,
    step: int,
    settings: config_mod.ModelSettings,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    merged_weights: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Write one export of `model` (a PeftModel under LoRA, else the causal LM) to `out`, atomically.

    `state_dict`: the model's full state dict (default `model.state_dict()`; FSDP2 callers pass the
    gathered one). `merged_weights`: base-model names -> merged tensors (LoRA only; None skips
    `merged/`). Returns the manifest written to `out/rljob-export.json`.
    """
    final = Path(out)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    sd = dict(state_dict) if state_dict is not None else model.state_dict()
    lora = modeling.is_lora(model)
    try:
        if lora:
            # save_embedding_layers=False: the adapter never trains embeddings (peft would else copy
            # the tied embedding matrix into the adapter whenever it cannot rule that out).
            model.save_pretrained(tmp, state_dict=sd, safe_serialization=True, save_embedding_layers=False)
            tokenizer.save_pretrained(tmp)
            if merged_weights is not None:
                base = model.get_base_model()
                _save_full(base, merged_weights, tokenizer, tmp / MERGED_DIR)
        else:
            _save_full(model, sd, tokenizer, tmp)
        manifest = {
            "step": step,
            "finetune": "lora" if lora else "full",
            "baseModel": settings.name,
            "format": "peft" if lora else "transformers",
            "merged": MERGED_DIR if lora and merged_weights is not None else (None if lora else "."),
            "files": _files(tmp),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        if final.exists():  # `final` again after a restart, or a re-run step
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported step %s to %s (%s)", step, final, manifest["format"])
    return manifest


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The `rljob-export.json` of one export directory."""
    return json.loads((Path(path) / MANIFEST).read_text())


# ---- from a checkpoint (offline) -----------------------------------------------------------------
def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint step directory: `path` itself, or the latest checkpoint under it."""
    p = Path(path)
    if (p / checkpoint.META).is_file():
        return p
    latest = checkpoint.latest_checkpoint(p)
    if latest is None:
        raise FileNotFoundError(f"{p}: no checkpoint (neither meta.json nor step-*/ inside)")
    return latest


def rebuild_policy(cfg: config_mod.TrainerConfig, trainable: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """The policy as the trainer held it: the base (same source and seed), the fine-tuning wrapper,
    then the checkpoint's trainable weights. Raises when a checkpoint key does not fit the model."""
    base = modeling.build_base_model(cfg.model, init_seed=cfg.grpo.seed)
    model = modeling.apply_finetune_mode(base, cfg.model)
    result = model.load_state_dict(dict(trainable), strict=False)
    if result.unexpected_keys:
        raise ValueError(
            f"checkpoint weights do not fit model {cfg.model.name!r}: unexpected {result.unexpected_keys[:5]}"
        )
    missing_trainable = [n for n, p in model.named_parameters() if p.requires_grad and n not in trainable]
    if missing_trainable:
        raise ValueError(f"checkpoint lacks trainable weights {missing_trainable[:5]}")
    return model.eval()


def export_checkpoint(
    checkpoint_dir: str | Path, out: str | Path, *, merge_lora: bool = True
) -> dict[str, Any]:
    """Export a saved checkpoint (`checkpoint`'s safetensors + JSON, verified against its checksums:
    a corrupt one raises `checkpoint.CheckpointError`, never loads) to `out`; returns the manifest."""
    path = resolve_checkpoint(checkpoint_dir)
    state, meta = checkpoint.load_checkpoint(path)
    cfg = config_mod.parse_config(meta["config"])
    model = rebuild_policy(cfg, state["ranks"]["model"])
    tokenizer = modeling.load_tokenizer(cfg.model)
    merged = dict(modeling.iter_engine_weights(model)) if merge_lora and modeling.is_lora(model) else None
    return write_export(
        model, tokenizer, out, step=int(meta["step"]), settings=cfg.model, merged_weights=merged
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m rljob_trainer export --checkpoint DIR --out DIR [--no-merge]`."""
    p = argparse.ArgumentParser(
        prog="python -m rljob_trainer export",
        description="Export a checkpoint in Hugging Face format (PEFT adapter + merged model for LoRA).",
    )
    p.add_argument("--checkpoint", required=True, help="a checkpoint step-*/ directory, or the root above")
    p.add_argument("--out", required=True, help="output directory (replaced if it exists)")
    p.add_argument("--no-merge", action="store_true", help="LoRA: write only the adapter, not merged/")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        manifest = export_checkpoint(args.checkpoint, args.out, merge_lora=not args.no_merge)
    except (FileNotFoundError, ValueError) as exc:
        p.exit(2, f"export: {exc}\n")
    print(json.dumps({"out": str(args.out), **manifest}, indent=2))
    return 0


# ---- from a live training rank -------------------------------------------------------------------
def export_from_rank(
    model: torch.nn.Module,
    cfg: config_mod.TrainerConfig,
    out: str | Path,
    *,
    step: int,
    rank: int,
    offload: bool,
) -> dict[str, Any] | None:
    """Every rank calls (FSDP2 gathers full tensors collectively); rank 0 writes and gets the manifest."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
    # The trainer's masters are fp32; an export holds the job's dtype, as the engines do.
    dtype = precision.compute_dtype(cfg.model.dtype)
    sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    merged = None
    if cfg.export.merge_lora and modeling.is_lora(model):
        merged = dict(modeling.iter_engine_weights(model, dtype))
    if rank != 0:
        return None
    tokenizer = modeling.load_tokenizer(cfg.model)
    return write_export(
        model, tokenizer, out, step=step, settings=cfg.model, state_dict=sd, merged_weights=merged
    )


def prune_step_exports(root: str | Path, *, keep_last: int) -> list[Path]:
    """Delete all but the `keep_last` newest `step-<N>` exports under `root` (`final` is kept)."""
    r = Path(root)
    found = sorted(
        (int(p.name[5:]), p)
        for p in (r.iterdir() if r.is_dir() else [])
        if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()
    )
    gone = [p for _, p in found[:-keep_last]] if keep_last > 0 else [p for _, p in found]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone

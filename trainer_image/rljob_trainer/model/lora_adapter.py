"""The trainer's LoRA adapter as a PEFT adapter directory, for vLLM engines that serve LoRA.

Role: with `rollout.engineLora` a vLLM engine serves base + adapter (`enable_lora=True`), and a
weight sync sends only the adapter tensors (`weight_sync.lora_adapter_tensors`: PEFT's saved-adapter
names, `base_model.model.<module>.lora_A.weight`). vLLM's public API takes an adapter as a directory
(`LoRARequest(lora_name, lora_int_id, lora_path)`), so each sync writes one:
- `write_peft_adapter`: `adapter_config.json` (the trainer's `peft.LoraConfig`, from
  `modeling.peft_lora_config`, with "all-linear" resolved to the modules the tensors adapt, as PEFT's
  own save does) and `adapter_model.safetensors` (the tensors under their PEFT names). It is what
  `PeftModel.from_pretrained` and vLLM's LoRA loader read; tests load it with real peft.
- `AdapterStore`: one engine's adapter versions under /dev/shm (tmpfs: nothing touches a disk; a
  temp dir where there is none), each with a new `lora_int_id`; the previous version's directory is
  deleted once the engine has swapped adapters.
Callers: `engines.vllm_engine`, tests.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rljob_trainer import config as config_mod

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT's saved-adapter names start here (vLLM strips it too)


def adapted_modules(names: Iterable[str]) -> list[str]:
    """The module names (last component: q_proj, down_proj, ...) that PEFT adapter tensors adapt."""
    out = set()
    for name in names:
        module, sep, _ = name.partition(".lora_")
        if not sep or not name.startswith(PEFT_PREFIX):
            raise ValueError(
                f"{name!r} is not a LoRA adapter tensor in PEFT's saved naming "
                f"({PEFT_PREFIX}<module>.lora_A.weight); only the adapter goes to a LoRA vLLM engine"
            )
        out.add(module.rsplit(".", 1)[-1])
    return sorted(out)


def adapter_config(settings: config_mod.ModelSettings, names: Iterable[str]) -> Any:
    """The `peft.LoraConfig` of `adapter_config.json`: the trainer's LoRA settings, with "all-linear"
    resolved to the modules the adapter tensors adapt."""
    cfg = _peft_config(settings)
    modules = adapted_modules(names)
    targets = settings.lora.target_modules
    if targets == "all-linear":
        # PEFT resolves "all-linear" when it wraps the model and saves the resolved names; an engine
        # has no wrapped model, so the names come from the tensors.
        cfg.target_modules = set(modules)
    else:
        extra = sorted(set(modules) - set(targets))
        if extra:
            raise ValueError(f"adapter tensors for {extra}, which model.lora.targetModules {targets} lacks")
    return cfg


def write_peft_adapter(
    directory: str | Path, tensors: Mapping[str, Any], settings: config_mod.ModelSettings
) -> Path:
    """Write the adapter directory vLLM and `peft.PeftModel.from_pretrained` load: the trainer's
    LoraConfig and the tensors (PEFT saved-adapter names). Written next to `directory` and renamed
    into place, so a reader never sees half an adapter."""
    from safetensors.torch import save_file

    if not tensors:
        raise ValueError("no adapter tensors to write")
    out = Path(directory)
    peft_cfg = adapter_config(settings, tensors)
    rank = settings.lora.rank
    for name, t in tensors.items():
        dims = tuple(t.shape)
        wrong_a = ".lora_A." in name and dims[0] != rank
        if wrong_a or (".lora_B." in name and dims[-1] != rank):
            raise ValueError(f"adapter tensor {name!r} has shape {dims}, not rank model.lora.rank {rank}")
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        peft_cfg.save_pretrained(str(staging))  # adapter_config.json, as PEFT itself writes it
        weights = {n: torch.as_tensor(t).detach().to("cpu").contiguous() for n, t in tensors.items()}
        save_file(weights, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _peft_config(settings: config_mod.ModelSettings) -> Any:
    from rljob_trainer.model import modeling

    return modeling.peft_lora_config(settings)


# ---- one engine's adapter versions ----------------------------------------------------------------
@dataclass(frozen=True)
class AdapterVersion:
    """One adapter an engine serves: vLLM's `LoRARequest(name, lora_int_id, path)` as plain data."""

    name: str
    lora_int_id: int
    path: Path
    weights_version: int


def scratch_root() -> Path:
    """/dev/shm when it is there (tmpfs), else the temp dir: where an engine writes what it hands its
    own vLLM processes (adapter directories here, full-weight files in `vllm_engine`)."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class AdapterStore:
    """An engine's adapter directories: `write` makes the next version (a new lora_int_id, which vLLM
    needs to treat it as a new adapter), `retire` deletes one the engine no longer serves. The whole
    root goes when the store is garbage-collected or the process exits."""

    def __init__(self, engine_name: str, *, root: str | Path | None = None) -> None:
        safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in engine_name)
        self.root = Path(tempfile.mkdtemp(prefix=f"rljob-lora-{safe}-", dir=root or scratch_root()))
        self._engine = safe
        self._next_id = 1  # vLLM requires lora_int_id >= 1
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.root), True)

    def write(
        self, tensors: Mapping[str, Any], settings: config_mod.ModelSettings, weights_version: int
    ) -> AdapterVersion:
        lora_id = self._next_id
        self._next_id += 1
        path = write_peft_adapter(self.root / f"v{weights_version}-id{lora_id}", tensors, settings)
        return AdapterVersion(
            f"{self._engine}-v{weights_version}-id{lora_id}", lora_id, path, weights_version
        )

    def retire(self, adapter: AdapterVersion) -> None:
        shutil.rmtree(adapter.path, ignore_errors=True)

    def close(self) -> None:
        self._cleanup()

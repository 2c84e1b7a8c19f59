"""The estimator's trainer memory model against what CUDA really allocates.

For shipped configs (Qwen3-4B, Qwen3.5-4B) with random bf16 weights, one LoRA update with gradient
checkpointing at three token budgets: `estimator.trainer.trainer_memory` (minus its runtime
allowance, which `max_memory_allocated` does not see) against `torch.cuda.max_memory_allocated`.
Prints both so a run on a lent device records the figures.
"""

from __future__ import annotations

import pytest
import torch

from rljob_operator.estimator import geometry, presets
from rljob_operator.estimator import trainer as trainer_mem

TOKEN_BUDGETS = (1024, 4096, 16384)
TOLERANCE = 0.35  # the model is for sizing: within 35% of the real peak, never a fraction of it


def _text_config(config: dict) -> dict:
    text = dict(config.get("text_config") or config)
    text.setdefault("torch_dtype", config.get("torch_dtype", "bfloat16"))
    return text


@pytest.mark.parametrize("preset", ["Qwen/Qwen3-4B", "Qwen/Qwen3.5-4B"])
@pytest.mark.parametrize("tokens", TOKEN_BUDGETS)
def test_lora_update_peak_memory_matches_the_estimate(preset: str, tokens: int) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = presets.load_preset(preset)
    model_geometry = geometry.ModelGeometry.from_hf_config(config)
    text = _text_config(config)
    try:
        hf = AutoConfig.for_model(
            text.pop("model_type"), **{k: v for k, v in text.items() if k != "architectures"}
        )
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
    except (ValueError, KeyError) as e:
        pytest.skip(f"this transformers cannot build {preset}: {e}")
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=32, lora_alpha=64, target_modules="all-linear"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, hf.vocab_size, (1, tokens), device="cuda")
    out = model(input_ids=ids, use_cache=False)
    logp = torch.log_softmax(out.logits.float(), -1).gather(-1, ids[..., None]).mean()
    (-logp).backward()
    opt.step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    est = trainer_mem.trainer_memory(model_geometry, 1, micro_batch_tokens=tokens, lora=True, lora_rank=32)
    predicted = est.total_bytes - est.runtime_bytes
    print(
        f"{preset} tokens={tokens}: estimated {predicted / 2**30:.2f} GiB "
        f"(+ runtime {est.runtime_bytes / 2**30:.1f}), measured peak {measured / 2**30:.2f} GiB"
    )
    assert abs(predicted - measured) <= TOLERANCE * measured, (predicted, measured)


def test_mixed_precision_full_fine_tuning_peak_matches_the_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real `TrainingRank` (FSDP2 at world size 1, fp32 masters, bf16 compute, gradient
    checkpointing) on a 4-layer cut of Qwen3-4B's config: one update's peak against the estimator's
    full fine-tuning model (16 bytes/parameter of fp32 state + bf16 compute copies + activations)."""
    import os

    from rljob_trainer import config
    from rljob_trainer.train import trainer

    monkeypatch.setenv("LOCAL_RANK", "0")
    text = _text_config(presets.load_preset("Qwen/Qwen3-4B"))
    text.update(num_hidden_layers=4, torch_dtype="bfloat16")
    tokens = 4096
    cfg = config.parse_config(
        {
            "model": {"name": "qwen3-4b-cut", "source": "tiny", "hfConfig": text, "dtype": "bfloat16",
                      "tokenizer": "builtin-digits", "finetune": "full", "gradientCheckpointing": True},
            "lengths": {"maxPromptTokens": 8, "maxResponseTokens": tokens},
            "grpo": {"groupSize": 2, "promptsPerStep": 1, "learningRate": 1e-5},
            "batching": {"packed": True, "dynamic": True, "maxTokensPerMicroBatch": 2 * tokens + 16},
            "rollout": {"kind": "transformers", "sharedEngines": 1, "dedicatedEngines": 0},
            "telemetry": {"enabled": False, "prometheusPort": None},
            "distributed": {"numTrainerRanks": 1, "device": "cuda", "launcher": "local"},
        }
    )  # fmt: skip
    rank = trainer.TrainingRank(cfg, 0, 1)
    try:
        rank.setup("127.0.0.1", int(os.environ.get("RLJOB_GPU_TEST_PORT", "29519")))
        gen = torch.Generator().manual_seed(0)
        samples = tuple(
            trainer.TrainSample(
                tuple(torch.randint(3, 16, (8,), generator=gen).tolist()),
                tuple(torch.randint(3, 16, (tokens // 2 - 8,), generator=gen).tolist()),
                1.0 if i else -1.0,
            )
            for i in range(2)
        )
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        rank.train_step([trainer.RankMiniBatch(samples, 2, sum(len(s.response_ids) for s in samples))])
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated()
    finally:
        rank.shutdown()
    est = trainer_mem.trainer_memory(
        geometry.ModelGeometry.from_hf_config(text), 1, micro_batch_tokens=tokens
    )
    predicted = est.total_bytes - est.runtime_bytes
    print(
        f"qwen3-4b 4-layer full FT mixed precision tokens={tokens}: estimated {predicted / 2**30:.2f} GiB "
        f"(state {est.sharded_state_bytes / 2**30:.2f}, "
        f"compute copies {est.gathered_weight_bytes / 2**30:.2f}), "
        f"measured peak {measured / 2**30:.2f} GiB"
    )
    assert abs(predicted - measured) <= TOLERANCE * measured, (predicted, measured)

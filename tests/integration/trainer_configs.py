"""Tiny GRPO configs shared by the trainer integration tests (built in code, nothing downloaded)."""

from __future__ import annotations

from typing import Any

from rljob_trainer import config
from rljob_trainer.model import modeling


def toy_config(**over: Any) -> config.TrainerConfig:
    """The toy task: answer a single-digit sum `a+b=` with one token; a random 2-layer model starts at
    ~1/19 accuracy (19-token vocabulary) and GRPO lifts it within a few hundred fast steps."""
    base: dict[str, Any] = {
        "model": {
            "name": "tiny-qwen2",
            "source": "tiny",
            "hfConfig": modeling.tiny_hf_config(32),
            "dtype": "float32",
            "tokenizer": "builtin-digits",
            "finetune": "full",
        },
        "lengths": {"maxPromptTokens": 8, "maxResponseTokens": 1},
        "grpo": {"groupSize": 8, "promptsPerStep": 16, "maxSteps": 160, "learningRate": 3e-3, "seed": 1},
        "batching": {"packed": True, "dynamic": True, "maxTokensPerMicroBatch": 256, "dpBalance": True},
        "rollout": {"kind": "transformers", "sharedEngines": 1, "dedicatedEngines": 1, "engineNumCpus": 0.5},
        "data": {"builtin": "toy-arithmetic"},
        "rewards": [{"name": "mathAccuracy"}],
        "telemetry": {"enabled": False, "prometheusPort": None},
        "distributed": {
            "numTrainerRanks": 2,
            "launcher": "ray",
            "torchThreadsPerRank": 1,
            "rankNumCpus": 0.5,
        },
    }
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return config.parse_config(base)


def vllm_config(dtype: str = "float32", **over: Any) -> config.TrainerConfig:
    """The toy task on vLLM's CPU build (one dedicated engine): the tiny model's heads of 32 are a size
    vLLM's CPU attention takes; the KV cache is told in bytes, as the operator renders it for CPU."""
    rollout = {
        "kind": "vllm",
        "sharedEngines": 0,
        "dedicatedEngines": 1,
        "maxNumSeqs": 16,
        "maxNumBatchedTokens": 256,
        "cpuKvCacheBytes": 32 << 20,
        **over.pop("rollout", {}),
    }
    model = {**toy_config().model.model_dump(by_alias=True), "dtype": dtype, **over.pop("model", {})}
    return toy_config(model=model, rollout=rollout, **over)

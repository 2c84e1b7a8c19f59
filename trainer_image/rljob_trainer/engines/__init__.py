"""Rollout engines behind one interface (`base.RolloutEngine`): transformers (CPU, tests) and vLLM.

`base` is the interface and its value types;
`vllm_engine` and `transformers_engine` implement it; `reward_model` scores sequences for a judge of
kind rewardModel (vLLM's pooling runner or transformers). Engines take weights through `weights/` and
load the model through `model/`. Callers: `rljob_trainer.driver` builds engines with `build_engine`
(inside Ray actors or in-process), the judge's reward models with `build_reward_model`.
"""

from __future__ import annotations

from typing import Any

from rljob_trainer import config as config_mod
from rljob_trainer.engines import base, reward_model


def build_engine(
    cfg: config_mod.TrainerConfig, *, name: str, colocated: bool, **kwargs: Any
) -> base.RolloutEngine:
    """The engine `cfg.rollout.kind` names (vLLM is imported only when asked for)."""
    if cfg.rollout.kind == "transformers":
        from rljob_trainer.engines import transformers_engine

        return transformers_engine.TransformersEngine(cfg, name=name, colocated=colocated, **kwargs)
    from rljob_trainer.engines import vllm_engine

    return vllm_engine.VLLMEngine(cfg, name=name, colocated=colocated, **kwargs)


def build_reward_model(cfg: config_mod.TrainerConfig, *, name: str) -> reward_model.RewardModelEngine:
    """The reward model on the engine `cfg.rollout.kind` names (the judge's config)."""
    if cfg.rollout.kind == "transformers":
        return reward_model.TransformersRewardModel(cfg, name=name)
    return reward_model.VLLMRewardModel(cfg, name=name)

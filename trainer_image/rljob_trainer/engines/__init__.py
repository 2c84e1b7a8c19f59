"""Rollout engines behind one interface (`base.RolloutEngine`): transformers (CPU, tests) and vLLM.

`base` is the interface and its value types;
`vllm_engine` and `transformers_engine` implement it. Engines take weights through `weights/` and
load the model through `model/`. Callers: `rljob_trainer.driver` builds engines with `build_engine`
(inside Ray actors or in-process).
"""

from __future__ import annotations

from typing import Any

from rljob_trainer import config as config_mod
from rljob_trainer.engines import base


def build_engine(
    cfg: config_mod.TrainerConfig, *, name: str, colocated: bool, **kwargs: Any
) -> base.RolloutEngine:
    """The engine `cfg.rollout.kind` names (vLLM is imported only when asked for)."""
    if cfg.rollout.kind == "transformers":
        from rljob_trainer.engines import transformers_engine

        return transformers_engine.TransformersEngine(cfg, name=name, colocated=colocated, **kwargs)
    from rljob_trainer.engines import vllm_engine

    return vllm_engine.VLLMEngine(cfg, name=name, colocated=colocated, **kwargs)

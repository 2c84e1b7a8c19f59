"""LoRA across sleep (issue 21, item 6): vLLM issue 53888 reports an engine that silently stops serving
its LoRA adapter after a level-1 sleep and wake. After waking a shared engine's weights the driver asks
it which adapter it serves (`adapter_version`: vLLM's `list_loras`) and sends the current adapter again
when it lost it, before the engine generates. Tested on the transformers engine's contract, with an
engine that loses its adapter on wake as that vLLM report describes (its B matrices back to zero: the
base model alone), on the real driver in local mode."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from trainer_configs import toy_config

from rljob_trainer import config, driver, runtimes
from rljob_trainer.engines import transformers_engine

pytestmark = [pytest.mark.torch]


class _LosesAdapterOnWake(transformers_engine.TransformersEngine):
    """A transformers engine that, like the vLLM of issue 53888, keeps its base across a level-1 sleep
    but comes back serving no adapter (and says so, as vLLM's list_loras would)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.losses = 0
        self._lost = False

    def wake(self, tags: Any = None) -> None:
        state = self.sleep_state
        waking_weights = "weights" not in state.awake and (tags is None or "weights" in tags)
        level = state.level
        super().wake(tags)
        if waking_weights and level == 1 and self._version > 0:
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    if "lora_B" in name:
                        p.zero_()
            self._lost = True
            self.losses += 1

    def update_weights(self, named_tensors: Any, version: int | None = None) -> int:
        n = super().update_weights(named_tensors, version)
        if n:
            self._lost = False
        return n

    def adapter_version(self) -> int | None:
        return None if self._lost else super().adapter_version()


class _Runtime(runtimes.LocalRuntime):
    def create_engine(self, name: str, *, colocated: bool, pod_index: int | None) -> Any:
        host = super().create_engine(name, colocated=colocated, pod_index=pod_index)
        host.obj = _LosesAdapterOnWake(self.cfg, name=name, colocated=colocated)
        return host


def _cfg() -> config.TrainerConfig:
    return toy_config(
        grpo={"groupSize": 8, "promptsPerStep": 4, "maxSteps": 4, "learningRate": 3e-3, "seed": 1},
        model={"finetune": "lora", "lora": {"rank": 4, "alpha": 8.0, "targetModules": "all-linear"}},
        lengths={"maxPromptTokens": 8, "maxResponseTokens": 2},
        rollout={"sharedEngines": 1, "dedicatedEngines": 0, "engineLora": True, "sleepLevel": 1},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
    )


def test_an_adapter_lost_across_a_level_1_sleep_is_added_again_before_generation() -> None:
    from peft import get_peft_model_state_dict

    cfg = _cfg()
    d = driver.GRPODriver(cfg, _Runtime(cfg))
    d.setup()
    rows = [d.step() for _ in range(3)]
    engine = d.engines["shared-0"].handle.obj
    d.prepare_generation()  # woken with the weights of step 3 (it slept before they were trained)
    # A sleep and wake with nothing trained in between: the engine already holds the current version,
    # so only the adapter check can tell that it lost its adapter.
    d.sleep_shared_engines()
    losses = engine.losses
    d.prepare_generation()
    assert engine.losses == losses + 1, "the engine did not lose its adapter: the test exercised nothing"
    assert engine.adapter_version() == d.weights_version == 3
    trainer_adapter = d.rt.get(d.rt.submit(d.ranks[0], "engine_weights", "adapter"))
    served = get_peft_model_state_dict(engine.model)
    assert set(served) == set(trainer_adapter)
    for name, tensor in trainer_adapter.items():
        assert torch.equal(served[name].to(tensor.dtype), tensor), name
    assert any("lora_B" in n and served[n].abs().sum() > 0 for n in served)
    # Every step sampled with the trainer's policy, adapter included (before each update).
    assert all(r["rollout/logprob_diff"] < 1e-4 for r in rows)

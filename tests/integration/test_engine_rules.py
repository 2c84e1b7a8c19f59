"""vLLM's sleep and weight rules in the CPU engine, and the driver's one engine order that obeys them.

The rules mirror vLLM 0.33.0 (`engines.base.MIRRORS_VLLM`, the CUDA image's pin), as read from its
source: tests/conformance/test_vllm_sleep_rules_mirror.py runs that release's own executor sleep/wake
logic and reads its worker's, and checks the pin is the release mirrored (`make test-vllm`). There, a weight
load into sleeping weights is not refused but corrupts them: the engines here refuse it first.

A weight load must not happen while the weights sleep, vLLM discards weights at sleep level 2, wakes in
parts (`wake_up(tags=["weights"])`, load, `wake_up(tags=["kv_cache"])`) and refuses `sleep()` without
sleep mode. The CPU engine follows the same rules (`engines.base.SleepState`), so a driver that
breaks them fails here as it would on a GPU. Its log-probs are the ones it sampled with (after
temperature and top-p: vLLM's `processed_logprobs`).
"""

from __future__ import annotations

import math

import pytest
import torch
from trainer_configs import toy_config

from rljob_trainer import driver, runtimes
from rljob_trainer.engines import base, build_engine
from rljob_trainer.model import modeling

pytestmark = [pytest.mark.torch]


def _cfg(**over):
    base_over = {
        "lengths": {"maxResponseTokens": 3},
        "distributed": {"numTrainerRanks": 1, "launcher": "local"},
        "grpo": {"learningRate": 5e-2, "maxSteps": 3, "promptsPerStep": 4},
    }
    for k, v in over.items():
        base_over[k] = {**base_over.get(k, {}), **v}
    return toy_config(**base_over)


def _prompts(cfg):
    t = modeling.load_tokenizer(cfg.model)
    return [t.encode(p, add_special_tokens=False) for p in ["3+4=", "1+2=", "9+0=", "5+5="]]


def _weights(engine):
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


def test_these_rules_mirror_the_pinned_vllm():
    assert base.MIRRORS_VLLM == "0.33.0"


def test_update_while_asleep_is_refused_and_level_1_keeps_weights():
    cfg = _cfg()
    engine = build_engine(cfg, name="e", colocated=True)
    engine.load()
    sampling = base.SamplingSettings(max_tokens=3, seeds=(1, 2, 3, 4))
    first = engine.generate(_prompts(cfg), sampling)
    weights = _weights(engine)
    engine.sleep(level=1)
    with pytest.raises(base.EngineAsleepError, match="wake"):
        engine.update_weights(weights)
    with pytest.raises(base.EngineAsleepError):
        engine.generate(_prompts(cfg), sampling)
    engine.wake()
    assert engine.generate(_prompts(cfg), sampling) == first


def test_level_2_discards_weights_until_loaded_after_waking_weights_only():
    cfg = _cfg()
    engine = build_engine(cfg, name="e", colocated=True)
    engine.load()
    sampling = base.SamplingSettings(max_tokens=3, seeds=(1, 2, 3, 4))
    first = engine.generate(_prompts(cfg), sampling)
    weights = _weights(engine)
    engine.sleep(level=2)
    assert all(p.numel() == 0 for p in engine.model.parameters())  # nothing kept, not even on host
    engine.wake(tags=["weights"])
    with pytest.raises(base.EngineAsleepError, match="kv_cache"):  # KV cache still asleep
        engine.generate(_prompts(cfg), sampling)
    engine.wake(tags=["kv_cache"])
    with pytest.raises(base.WeightsDiscardedError, match="level 2"):  # awake, but on garbage
        engine.generate(_prompts(cfg), sampling)
    # vLLM's RL order: weights awake, load, then the KV cache.
    engine.sleep(level=2)
    engine.wake(tags=["weights"])
    engine.update_weights(weights, version=7)
    engine.wake(tags=["kv_cache"])
    out = engine.generate(_prompts(cfg), sampling)
    assert [o.token_ids for o in out] == [o.token_ids for o in first]
    assert engine.weights_version == 7 and out[0].meta["version"] == 7


def test_sleep_needs_sleep_mode():
    cfg = _cfg(rollout={"enableSleepMode": False})
    shared = build_engine(cfg, name="s", colocated=True)
    shared.load()
    with pytest.raises(base.SleepModeDisabledError, match="enableSleepMode"):
        shared.sleep()
    dedicated = build_engine(_cfg(), name="d", colocated=False)
    dedicated.load()
    with pytest.raises(base.SleepModeDisabledError):
        dedicated.sleep()


def test_log_probs_are_those_sampled_with_after_temperature_and_top_p():
    cfg = _cfg()
    engine = build_engine(cfg, name="e", colocated=False)
    engine.load()
    prompt = _prompts(cfg)[0]
    temperature, top_p = 0.7, 0.6
    (out,) = engine.generate([prompt], base.SamplingSettings(temperature, top_p, max_tokens=1, seeds=(5,)))
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    probs = torch.softmax(logits / temperature, dim=-1)
    order = torch.argsort(probs, descending=True)
    keep = torch.cumsum(probs[order], 0) - probs[order] < top_p
    kept = set(order[keep].tolist())
    tok = out.token_ids[0]
    assert tok in kept
    expected = math.log(float(probs[tok]) / float(probs[list(kept)].sum()))
    assert out.logprobs[0] == pytest.approx(expected, abs=1e-5)
    # The raw log-prob (what vLLM V1 returns by default) differs whenever top-p cuts the tail.
    assert abs(float(torch.log_softmax(logits, -1)[tok]) - expected) > 1e-3


class _Recorder:
    """Wraps an engine Host: records every call, so the test sees the order the driver used."""

    def __init__(self, host: runtimes.Host, log: list[tuple[str, str, tuple]]) -> None:
        self._host, self._log = host, log
        self.obj = host.obj

    def call(self, method, *args, **kwargs):
        if method in ("sleep", "wake", "update_weights", "generate"):
            detail = args[1:2] if method == "update_weights" else (args[:1] if method != "generate" else ())
            self._log.append((self.obj.name, method, tuple(detail)))
        return self._host.call(method, *args, **kwargs)


class _RecordingRuntime(runtimes.LocalRuntime):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.calls: list[tuple[str, str, tuple]] = []

    def create_engine(self, name, *, colocated, pod_index):
        return _Recorder(super().create_engine(name, colocated=colocated, pod_index=pod_index), self.calls)


def test_driver_follows_vllms_rl_order_with_shared_and_dedicated_engines():
    cfg = _cfg(rollout={"sharedEngines": 1, "dedicatedEngines": 1})
    rt = _RecordingRuntime(cfg)
    d = driver.GRPODriver(cfg, rt)
    d.setup()
    d.shared_awake_target = 1  # the operator woke the shared engine: it generates each step
    for step in (1, 2, 3):
        rt.calls.clear()
        m = d.step()
        shared = [(m_, a) for n, m_, a in rt.calls if n == "shared-0"]
        dedicated = [(m_, a) for n, m_, a in rt.calls if n == "dedicated-0"]
        # Shared: weights awake, the last step's weights loaded, KV cache awake, generate, sleep (2).
        assert shared == [
            ("wake", (["weights"],)),
            ("update_weights", (step - 1,)),
            ("wake", (["kv_cache"],)),
            ("generate", ()),
            ("sleep", (2,)),
        ], (step, shared)
        # Dedicated: generates, then takes the new weights right after training.
        assert dedicated[-1] == ("update_weights", (step,)) and ("sleep", (2,)) not in dedicated
        assert m["rollout/weights_version_min"] == step - 1 and m["rollout/staleness_max"] == 0
    assert d.engines["shared-0"].handle.obj.is_sleeping


def test_enable_sleep_mode_false_never_calls_sleep():
    cfg = _cfg(rollout={"sharedEngines": 1, "dedicatedEngines": 0, "enableSleepMode": False})
    rt = _RecordingRuntime(cfg)
    d = driver.GRPODriver(cfg, rt)
    d.run(2)
    assert not any(method == "sleep" for _, method, _ in rt.calls)
    assert ("shared-0", "update_weights", (2,)) in rt.calls  # synced right after training instead

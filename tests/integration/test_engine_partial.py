"""Partial rollouts on the CPU engine: vLLM's pause rules (`engines.base.PauseState`) and resuming a
request from the tokens it already has.

vLLM's async-RL API (`AsyncLLM.pause_generation(mode="abort")`, then a weight update, then
`resume_generation()`): the pause aborts every request in flight and returns its partial output
(finish_reason "abort"); a request is resumed by submitting its prompt + the tokens it has. The CPU
engine follows the same rules: `interrupt()` (from another thread, as the Ray actor's control group
calls it) stops a running call before its next token and returns once none runs; a call made while
paused aborts every request before its first token; weights never change while a call runs
(`EngineBusyError`). The resumed output keeps each token's own version and log-prob.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from trainer_configs import toy_config

from rljob_trainer import config
from rljob_trainer.engines import base, build_engine
from rljob_trainer.model import modeling

pytestmark = [pytest.mark.torch]

CAP = 400


def _engine():
    cfg = toy_config(
        lengths={"maxResponseTokens": CAP},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
        rollout={"sharedEngines": 0, "dedicatedEngines": 1, "partialRollouts": True},
    )
    engine = build_engine(cfg, name="e", colocated=False)
    engine.load()
    tok = modeling.load_tokenizer(cfg.model)
    # No stop token: every request runs to its budget unless interrupted.
    prompts = [tok.encode(p, add_special_tokens=False) for p in ["3+4=", "1+2="]]
    return engine, prompts


def _sampling(n: int, **kw):
    return base.SamplingSettings(max_tokens=CAP, seeds=tuple(range(n)), stop_token_ids=(), **kw)


def _generate_in_thread(engine, prompts, sampling):
    out: dict[str, object] = {}

    def run() -> None:
        out["result"] = engine.generate(prompts, sampling)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _count_forwards(engine) -> list[int]:
    """Counts the engine model's forward passes (the prefill, then one per token)."""
    calls = [0]
    forward = engine.model.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    engine.model.forward = counted
    return calls


def _wait_generating(engine, forwards: list[int] | None = None, at_least: int = 0) -> None:
    """Until a generate call runs (and, with `forwards`, has made `at_least` forward passes: on a loaded
    machine the prefill alone can take longer than any fixed sleep)."""
    deadline = time.monotonic() + 30
    while engine.pause_state.generating == 0 or (forwards is not None and forwards[0] < at_least):
        assert time.monotonic() < deadline, "generate never started"
        time.sleep(0.001)


def test_interrupt_stops_the_call_in_flight_and_weights_wait_for_the_pause() -> None:
    engine, prompts = _engine()
    engine._eos_id = -1  # never stops early: only the interrupt or the budget ends a request
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
    forwards = _count_forwards(engine)
    t, out = _generate_in_thread(engine, prompts, _sampling(len(prompts)))
    _wait_generating(engine, forwards, at_least=3)  # the prefill and two tokens
    with pytest.raises(base.EngineBusyError, match="interrupt"):
        engine.update_weights(weights, 1)  # never halfway through a call, as after vLLM's pause
    engine.interrupt()  # returns only once no call runs
    assert engine.pause_state.generating == 0
    t.join(timeout=30)
    partial = out["result"]
    assert [o.finish_reason for o in partial] == [base.ABORTED, base.ABORTED]
    assert all(0 < len(o.token_ids) < CAP for o in partial)
    assert all(len(o.logprobs) == len(o.token_ids) == len(o.token_versions) for o in partial)
    # Paused: a call made now aborts every request before its first token.
    held = engine.generate(prompts, _sampling(len(prompts)))
    assert [(o.finish_reason, o.token_ids) for o in held] == [(base.ABORTED, ()), (base.ABORTED, ())]
    engine.update_weights(weights, 1)  # allowed while paused
    engine.resume()
    small = _sampling(len(prompts), max_tokens_per_request=(3, 5))
    done = engine.generate(prompts, small)
    assert [len(o.token_ids) for o in done] == [3, 5]
    assert [o.finish_reason for o in done] == ["length", "length"]
    assert all(o.token_versions == (1,) * len(o.token_ids) for o in done)


def test_a_resumed_request_keeps_each_tokens_version_and_logprob() -> None:
    engine, prompts = _engine()
    engine._eos_id = -1
    first = engine.generate(prompts[:1], _sampling(1, max_tokens_per_request=(4,)))[0]
    prefix = base.GenerationOutput(
        first.prompt_token_ids, first.token_ids, first.logprobs, base.ABORTED, {"version": 0}
    )
    # New weights, then the request goes on from prompt + its 4 tokens with the rest of its budget.
    with torch.no_grad():
        new = {k: v + 0.05 * torch.randn_like(v) for k, v in engine.model.state_dict().items()}
    engine.update_weights(new, 3)
    resumed = engine.generate(
        [list(prefix.prompt_token_ids) + list(prefix.token_ids)], _sampling(1, max_tokens_per_request=(6,))
    )[0]
    merged = base.continue_output(prefix, resumed)
    assert merged.prompt_token_ids == first.prompt_token_ids
    assert merged.token_ids == first.token_ids + resumed.token_ids
    assert len(merged.token_ids) == 10
    assert merged.token_versions == (0,) * 4 + (3,) * 6
    assert merged.logprobs[:4] == first.logprobs  # the old weights' log-probs stay with their tokens
    assert merged.meta["version"] == 0 and merged.meta["interrupts"] == 1
    with pytest.raises(ValueError, match="prompt"):
        base.continue_output(prefix, first)  # not a continuation of this prefix


def test_partial_rollouts_are_off_by_default_and_both_engine_kinds_implement_them() -> None:
    from rljob_trainer.engines import transformers_engine, vllm_engine

    assert config.RolloutSettings().partial_rollouts is False
    assert toy_config(rollout={"kind": "vllm", "partialRollouts": True}).rollout.partial_rollouts
    for cls in (transformers_engine.TransformersEngine, vllm_engine.VLLMEngine):
        assert cls.supports_partial_rollouts
        assert cls.interrupt is not base.RolloutEngine.interrupt
        assert cls.resume is not base.RolloutEngine.resume

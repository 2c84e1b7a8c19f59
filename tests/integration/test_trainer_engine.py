"""CPU rollout engine against a real training rank: sleep/wake determinism and in-place weight sync."""

from __future__ import annotations

import pytest
import torch
from trainer_configs import toy_config

from rljob_trainer.engines import base, build_engine
from rljob_trainer.model import modeling
from rljob_trainer.train import trainer

pytestmark = [pytest.mark.torch]


def _cfg():
    return toy_config(
        lengths={"maxResponseTokens": 4},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
        grpo={"learningRate": 5e-2, "maxSteps": 1},
    )


def _prompts():
    t = modeling.load_tokenizer(_cfg().model)
    return [t.encode(p, add_special_tokens=False) for p in ["3+4=", "1+2=", "9+0=", "5+5="]] * 3


def test_sleep_wake_cycles_keep_outputs_identical():
    engine = build_engine(_cfg(), name="e", colocated=True)
    engine.load()
    prompts = _prompts()
    sampling = base.SamplingSettings(max_tokens=4, seeds=tuple(range(100, 112)))
    first = engine.generate(prompts, sampling)
    for _ in range(3):
        engine.sleep()
        assert engine.is_sleeping
        assert all(p.numel() == 0 for p in engine.model.parameters())  # memory really released
        with pytest.raises(RuntimeError, match="asleep"):
            engine.generate(prompts, sampling)
        engine.wake()
        assert engine.generate(prompts, sampling) == first
    # A request's output depends on its seed, not on the batch it shares.
    alone = engine.generate(prompts[5:6], base.SamplingSettings(max_tokens=4, seeds=(105,)))
    assert alone[0].token_ids == first[5].token_ids


def test_weight_update_reaches_engine_and_matches_trainer_log_probs():
    cfg = _cfg()
    rank = trainer.TrainingRank(cfg, 0, 1)
    rank.setup("127.0.0.1", 0)
    engine = build_engine(cfg, name="e", colocated=False)
    engine.load()
    engine.update_weights(rank.engine_weights() or {})
    prompts = _prompts()
    sampling = base.SamplingSettings(max_tokens=4, seeds=tuple(range(12)))
    outs = engine.generate(prompts, sampling)
    samples = [
        trainer.TrainSample(o.prompt_token_ids, o.token_ids, 1.0 if i % 2 else -1.0)
        for i, o in enumerate(outs)
    ]

    def trainer_lps():
        return rank.compute_log_probs(samples)

    for o, lp in zip(outs, trainer_lps(), strict=True):  # same weights: engine and trainer agree
        assert torch.allclose(torch.tensor(o.logprobs), torch.tensor(lp), atol=1e-4)
    rank.train_step(
        [trainer.RankMiniBatch(tuple(samples), len(samples), sum(len(s.response_ids) for s in samples))]
    )
    after = trainer_lps()
    stale = engine.generate(prompts, sampling)
    assert any(
        not torch.allclose(torch.tensor(o.logprobs), torch.tensor(lp), atol=1e-3)
        for o, lp in zip(stale, after, strict=True)
    ), "training did not change the policy, the test would prove nothing"
    engine.update_weights(rank.engine_weights() or {})
    assert engine.weights_version == 2
    # After the sync the engine samples from the trainer's new policy: its log-probs of what it
    # generated equal the trainer's log-probs of the same sequences.
    fresh = engine.generate(prompts, sampling)
    fresh_samples = [trainer.TrainSample(o.prompt_token_ids, o.token_ids, 0.0) for o in fresh]
    for o, lp in zip(fresh, rank.compute_log_probs(fresh_samples), strict=True):
        assert torch.allclose(torch.tensor(o.logprobs), torch.tensor(lp), atol=1e-4)


def test_ignore_eos_generates_through_the_end_of_sequence_token_to_the_budget():
    """As vLLM's `ignore_eos`: the tests that act on requests mid-generation need them to run long."""
    engine = build_engine(_cfg(), name="e", colocated=False)
    engine.load()
    prompts = _prompts()
    normal = engine.generate(prompts, base.SamplingSettings(max_tokens=24, seeds=tuple(range(len(prompts)))))
    assert any(o.finish_reason == "stop" for o in normal)  # a random tiny model samples EOS early
    through = engine.generate(
        prompts, base.SamplingSettings(max_tokens=24, seeds=tuple(range(len(prompts))), ignore_eos=True)
    )
    assert all(o.finish_reason == "length" and len(o.token_ids) == 24 for o in through)

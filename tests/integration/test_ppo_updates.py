"""Old log-probs are taken once per step, so with more than one update per step the PPO clip acts.

Recomputing old log-probs from the current weights before every mini-batch (the old code) makes the
ratio exactly 1, `pg_clipfrac` 0 and the loss of every update -mean(advantage), whatever the clip.
"""

from __future__ import annotations

import pytest
from trainer_configs import toy_config

from rljob_trainer import driver, runtimes
from rljob_trainer.engines import base, build_engine
from rljob_trainer.model import modeling
from rljob_trainer.train import algos, trainer

pytestmark = [pytest.mark.torch]


def _cfg(**grpo):
    return toy_config(
        lengths={"maxResponseTokens": 3},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
        rollout={"sharedEngines": 0, "dedicatedEngines": 1},
        grpo={"learningRate": 5e-2, "maxSteps": 2, "promptsPerStep": 4, "groupSize": 4, **grpo},
    )


def _samples(cfg, n=8):
    engine = build_engine(cfg, name="e", colocated=False)
    engine.load()
    tok = modeling.load_tokenizer(cfg.model)
    prompts = [tok.encode(p, add_special_tokens=False) for p in ["3+4=", "1+2=", "9+0=", "5+5="]] * (n // 4)
    outs = engine.generate(prompts, base.SamplingSettings(max_tokens=3, seeds=tuple(range(n))))
    return [
        trainer.sample_from_output(o, 1.0 if i % 3 else -1.0, eos_id=tok.eos_token_id)
        for i, o in enumerate(outs)
    ]


def _mb(samples):
    return trainer.RankMiniBatch(tuple(samples), len(samples), sum(len(s.response_ids) for s in samples))


def _rank(cfg):
    rank = trainer.TrainingRank(cfg, 0, 1)
    rank.setup("127.0.0.1", 0)
    return rank


def test_second_update_uses_the_step_start_log_probs_and_equals_the_reference():
    cfg = _cfg(miniBatchesPerStep=2)
    samples = _samples(cfg)
    first, second = samples[:4], samples[4:]
    # Rank B: the old log-probs of the second mini-batch (step start), then the first update only,
    # then the second mini-batch's log-probs under the updated weights.
    b = _rank(cfg)
    old_second = b.compute_log_probs(second)
    b.train_step([_mb(first)])
    new_second = b.compute_log_probs(second)
    # Rank A (same seed, same weights): both updates in one step.
    a = _rank(cfg)
    stats = a.train_step([_mb(first), _mb(second)])
    per_token, seq_ids, adv_tok = [], [], []
    for n, (s, new, old) in enumerate(zip(second, new_second, old_second, strict=True)):
        adv = [s.advantage] * len(new)
        per_token += algos.clipped_policy_loss_reference(
            new, old, adv, clip_low=cfg.grpo.clip_low, clip_high=cfg.grpo.clip_high
        )
        seq_ids += [n] * len(new)
        adv_tok += adv
    expected = algos.aggregate_loss_reference(
        per_token,
        [1.0] * len(per_token),
        seq_ids,
        mode=cfg.grpo.loss_agg,
        global_num_seqs=len(second),
        global_num_tokens=len(per_token),
    )
    assert stats["pg_loss_updates"][1] == pytest.approx(expected, abs=1e-5)
    # ... and it is not the ratio-1 loss the old code computed.
    ratio_one = algos.aggregate_loss_reference(
        [-x for x in adv_tok],
        [1.0] * len(adv_tok),
        seq_ids,
        mode=cfg.grpo.loss_agg,
        global_num_seqs=len(second),
        global_num_tokens=len(adv_tok),
    )
    assert abs(stats["pg_loss_updates"][1] - ratio_one) > 1e-3
    assert stats["pg_clipfrac_tokens"] > 0


def test_driver_reports_clipfrac_and_logprob_diff():
    cfg = _cfg(miniBatchesPerStep=2, ppoEpochs=2)
    d = driver.GRPODriver(cfg, runtimes.LocalRuntime(cfg))
    metrics = d.run(2)
    assert all(len(m["pg_loss_updates"]) == 4 for m in metrics)  # 2 mini-batches x 2 epochs
    assert max(m["pg_clipfrac"] for m in metrics) > 0
    # The engine sampled with the trainer's weights: its log-probs match the trainer's.
    assert all(0 <= m["rollout/logprob_diff"] < 1e-4 for m in metrics), [
        m["rollout/logprob_diff"] for m in metrics
    ]


def test_a_single_update_per_step_never_clips():
    cfg = _cfg()
    samples = _samples(cfg)
    stats = _rank(cfg).train_step([_mb(samples)])
    assert stats["pg_clipfrac_tokens"] == 0 and len(stats["pg_loss_updates"]) == 1

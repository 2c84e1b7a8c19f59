"""A multi-turn episode is one sample whose observation tokens the loss masks out, everywhere.

A real `TrainingRank` trains on episodes (generated tokens, then tool-result tokens, then generated
tokens again): the policy loss, the importance weights and every per-token metric must equal a slow
reference taken over the generated tokens only, the step must not move by what the observation
tokens carry (their rollout log-probs, their log-probs outside a top-p nucleus), and it must move
when the mask is dropped (so the test can tell).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from trainer_configs import toy_config

from rljob_trainer.train import algos, trainer

pytestmark = [pytest.mark.torch]

CAP = 1.5
# A response of 12 tokens: 3 generated, 5 of a tool result, 4 generated again.
MASK = (1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1)


def _cfg(**grpo):
    return toy_config(
        lengths={"maxPromptTokens": 8, "maxResponseTokens": len(MASK)},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
        rollout={"sharedEngines": 0, "dedicatedEngines": 1},
        grpo={"maxSteps": 2, "promptsPerStep": 2, "groupSize": 2, "maxStaleness": 1, **grpo},
    )


def _rank(cfg):
    rank = trainer.TrainingRank(cfg, 0, 1)
    rank.setup("127.0.0.1", 0)
    return rank


def _episodes(rank, *, observation_logprob: float = 0.0) -> list[trainer.TrainSample]:
    """Four episodes over the 32-token vocabulary; the engine's log-probs of generated tokens are the
    trainer's own shifted (so the IS weights spread below 1, near 1 and above the cap); observation
    tokens carry `observation_logprob` (0.0 is what `rollout.agent` writes there)."""
    rng = random.Random(3)
    samples = [
        trainer.TrainSample(
            tuple(rng.randrange(3, 19) for _ in range(4)),
            tuple(rng.randrange(3, 19) for _ in MASK),
            adv,
            loss_mask=MASK if i != 2 else (1,) * len(MASK),  # one single-turn sample beside them
        )
        for i, adv in enumerate((1.0, -0.5, 0.7, -1.2))
    ]
    olds = rank.compute_log_probs(samples)
    shifts = [-0.7, -0.2, 0.0, 0.3, 0.9]
    return [
        dataclasses.replace(
            s,
            rollout_logprobs=tuple(
                o - shifts[(i + t) % len(shifts)] if m else observation_logprob
                for t, (o, m) in enumerate(zip(old, s.mask, strict=True))
            ),
        )
        for i, (s, old) in enumerate(zip(samples, olds, strict=True))
    ]


def _mini_batch(samples):
    return trainer.RankMiniBatch(tuple(samples), len(samples), sum(s.num_loss_tokens for s in samples))


def _reference(samples, olds, mode):
    """The TIS loss of the generated tokens only: observation tokens dropped from every list."""
    per_token, seq_ids, old_flat, roll_flat = [], [], [], []
    for n, (s, old) in enumerate(zip(samples, olds, strict=True)):
        keep = [t for t, m in enumerate(s.mask) if m]
        o = [old[t] for t in keep]
        r = [s.rollout_logprobs[t] for t in keep]
        per_token += algos.clipped_tis_policy_loss_reference(
            o, o, [s.advantage] * len(o), r, clip_low=0.2, clip_high=0.28, tis_cap=CAP
        )
        seq_ids += [n] * len(o)
        old_flat += o
        roll_flat += r
    ones = [1.0] * len(per_token)
    pg = algos.aggregate_loss_reference(
        per_token,
        ones,
        seq_ids,
        mode=mode,
        global_num_seqs=len(samples),
        global_num_tokens=len(per_token),
        token_sum_norm=len(MASK),
    )
    metrics = algos.compute_off_policy_metrics_reference(
        old_flat, roll_flat, ones, [0] * len(samples), trainer_version=0, tis_cap=CAP
    )
    return pg, metrics, len(per_token)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_the_loss_and_weights_of_an_episode_are_those_of_its_generated_tokens(mode: str) -> None:
    cfg = _cfg(policyLoss="clipped-tis", tisCap=CAP, lossAgg=mode)
    rank = _rank(cfg)
    samples = _episodes(rank)
    olds = rank.compute_log_probs(samples)
    stats = rank.train_step([_mini_batch(samples)])
    want, metrics, generated = _reference(samples, olds, mode)
    assert stats["pg_loss"] == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert stats["loss_tokens"] == generated == 3 * sum(MASK) + len(MASK)
    assert stats["is_weight_tokens"] == generated  # no IS weight on an observation token
    assert stats["is_weight_sum"] / stats["is_weight_tokens"] == pytest.approx(
        metrics["off_policy/is_weight_mean"], rel=1e-6
    )
    assert stats["is_weight_max"] == pytest.approx(metrics["off_policy/is_weight_max"], rel=1e-6)
    assert stats["corr/tokens"] == generated
    assert stats["corr/masked_tokens"] == generated
    # Observation tokens' 0.0 "log-probs" would give weights exp(old - 0) far below 1: had they
    # counted, the mean weight would not be the reference's.


def test_what_observation_tokens_carry_never_moves_the_step_and_the_mask_does() -> None:
    import torch

    cfg = _cfg(policyLoss="clipped-tis", tisCap=CAP)
    a, b, c = _rank(cfg), _rank(cfg), _rank(cfg)
    samples = _episodes(a)
    garbage = _episodes(b, observation_logprob=-40.0)  # their IS weight would be at the cap
    unmasked = [dataclasses.replace(s, loss_mask=()) for s in samples]
    sa = a.train_step([_mini_batch(samples)])
    sb = b.train_step([_mini_batch(garbage)])
    c.train_step([_mini_batch(unmasked)])
    assert sa["pg_loss"] == pytest.approx(sb["pg_loss"], rel=1e-6, abs=1e-7)
    assert sa["corr/abs_diff_sum"] == pytest.approx(sb["corr/abs_diff_sum"], rel=1e-6)
    pa, pb, pc = (dict(r._parts()[0].named_parameters()) for r in (a, b, c))
    moved = 0.0
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], rtol=0, atol=0, msg=name)
        moved = max(moved, float((pa[name] - pc[name]).abs().max()))
    assert moved > 1e-6  # training on the observation tokens would be another step


def test_observation_tokens_outside_the_nucleus_count_nowhere() -> None:
    """top-p < 1: a tool result's tokens were never sampled from the policy, so many lie outside the
    trainer's nucleus (log-prob -inf). They must not count as out-of-nucleus tokens, nor turn the
    loss non-finite; the generated tokens' out-of-nucleus count is the trainer's own."""
    import math

    cfg = _cfg(policyLoss="clipped-tis", tisCap=CAP, topP=0.3)
    rank = _rank(cfg)
    samples = _episodes(rank)
    olds = rank.compute_log_probs(samples)
    out_generated = sum(
        1
        for s, old in zip(samples, olds, strict=True)
        for m, o in zip(s.mask, old, strict=True)
        if m and not math.isfinite(o)
    )
    out_observed = sum(
        1
        for s, old in zip(samples, olds, strict=True)
        for m, o in zip(s.mask, old, strict=True)
        if not m and not math.isfinite(o)
    )
    assert out_observed > 0  # the case is real: observation tokens fall outside the nucleus
    stats = rank.train_step([_mini_batch(samples)])
    assert math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])
    assert stats["out_of_nucleus_tokens"] == out_generated
    assert stats["corr/out_of_nucleus_tokens"] == out_generated

"""The trainer applies truncated importance sampling with the engine's rollout log-probs.

A real `TrainingRank` trains one update on samples whose rollout log-probs are those of an older
policy (shifted per token, some far enough that the weight exceeds the cap); its policy loss and
its IS-weight statistics must equal a slow per-token reference built from
`algos.clipped_tis_policy_loss_reference`, `aggregate_loss_reference` and
`compute_off_policy_metrics_reference`. Without TIS (policy loss `clipped`) the same samples give
the uncorrected loss, so the test sees whether the correction is applied at all.
"""

from __future__ import annotations

import dataclasses

import pytest
from trainer_configs import toy_config

from rljob_trainer.engines import base, build_engine
from rljob_trainer.model import modeling
from rljob_trainer.train import algos, trainer

pytestmark = [pytest.mark.torch]

CAP = 1.5


def _cfg(**grpo):
    return toy_config(
        lengths={"maxResponseTokens": 3},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
        rollout={"sharedEngines": 0, "dedicatedEngines": 1},
        grpo={"maxSteps": 2, "promptsPerStep": 4, "groupSize": 4, **grpo},
    )


def _samples(cfg, rank):
    engine = build_engine(cfg, name="e", colocated=False)
    engine.load()
    tok = modeling.load_tokenizer(cfg.model)
    prompts = [tok.encode(p, add_special_tokens=False) for p in ["3+4=", "1+2=", "9+0=", "5+5="]] * 2
    outs = engine.generate(prompts, base.SamplingSettings(max_tokens=3, seeds=tuple(range(8))))
    samples = [
        trainer.sample_from_output(o, 1.0 if i % 3 else -1.0, eos_id=tok.eos_token_id)
        for i, o in enumerate(outs)
    ]
    # The behaviour policy: the trainer's own log-probs, shifted so exp(old - rollout) spans
    # below 1, near 1 and above the cap.
    olds = rank.compute_log_probs(samples)
    shifts = [-0.7, -0.2, 0.0, 0.3, 0.9]
    return [
        dataclasses.replace(
            s, rollout_logprobs=tuple(o - shifts[(i + t) % len(shifts)] for t, o in enumerate(old))
        )
        for i, (s, old) in enumerate(zip(samples, olds, strict=True))
    ], olds


def _rank(cfg):
    rank = trainer.TrainingRank(cfg, 0, 1)
    rank.setup("127.0.0.1", 0)
    return rank


def _reference(samples, olds, *, tis: bool):
    per_token, seq_ids, mask, old_flat, roll_flat = [], [], [], [], []
    for n, (s, old) in enumerate(zip(samples, olds, strict=True)):
        adv = [s.advantage] * len(old)
        if tis:
            loss = algos.clipped_tis_policy_loss_reference(
                old, old, adv, list(s.rollout_logprobs), clip_low=0.2, clip_high=0.28, tis_cap=CAP
            )
        else:
            loss = algos.clipped_policy_loss_reference(old, old, adv, clip_low=0.2, clip_high=0.28)
        per_token += loss
        seq_ids += [n] * len(old)
        mask += [1.0] * len(old)
        old_flat += old
        roll_flat += list(s.rollout_logprobs)
    pg = algos.aggregate_loss_reference(
        per_token,
        mask,
        seq_ids,
        mode="seq-mean-token-mean",
        global_num_seqs=len(samples),
        global_num_tokens=len(mask),
    )
    metrics = algos.compute_off_policy_metrics_reference(
        old_flat, roll_flat, mask, [0] * len(samples), trainer_version=0, tis_cap=CAP
    )
    return pg, metrics


def test_tis_loss_and_weights_equal_the_slow_reference():
    cfg = _cfg(policyLoss="clipped-tis", tisCap=CAP, maxStaleness=1)
    rank = _rank(cfg)
    samples, olds = _samples(cfg, rank)
    mb = trainer.RankMiniBatch(tuple(samples), len(samples), sum(len(s.response_ids) for s in samples))
    stats = rank.train_step([mb])
    want, metrics = _reference(samples, olds, tis=True)
    assert stats["pg_loss"] == pytest.approx(want, rel=1e-5, abs=1e-6)
    uncorrected, _ = _reference(samples, olds, tis=False)
    assert abs(want - uncorrected) > 1e-3  # the correction changes the loss: the test can tell
    assert stats["is_weight_sum"] / stats["is_weight_tokens"] == pytest.approx(
        metrics["off_policy/is_weight_mean"], rel=1e-6
    )
    assert stats["is_weight_max"] == pytest.approx(metrics["off_policy/is_weight_max"], rel=1e-6)
    assert stats["is_truncated_tokens"] / stats["is_weight_tokens"] == pytest.approx(
        metrics["off_policy/truncated_fraction"]
    )
    assert 0 < metrics["off_policy/truncated_fraction"] < 1


def test_without_tis_the_same_samples_train_on_the_uncorrected_loss():
    cfg = _cfg()
    rank = _rank(cfg)
    samples, olds = _samples(cfg, rank)
    mb = trainer.RankMiniBatch(tuple(samples), len(samples), sum(len(s.response_ids) for s in samples))
    stats = rank.train_step([mb])
    want, _ = _reference(samples, olds, tis=False)
    assert stats["pg_loss"] == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_one_update_on_stale_rollouts_skips_the_forward_only_pass_and_steps_the_same():
    """maxStaleness 1, one mini-batch, one epoch: the old log-probs are the training forward's own
    (no forward-only pass, a third of the step's compute), and the update is the one the separate
    pass gives: the same loss, IS weights and weights after the step."""
    import torch

    cfg = _cfg(policyLoss="clipped-tis", tisCap=CAP, maxStaleness=1)
    fused, separate = _rank(cfg), _rank(cfg)
    separate._fused_old_log_probs = lambda mini_batches: False  # type: ignore[method-assign]
    samples, _ = _samples(cfg, fused)
    mb = trainer.RankMiniBatch(tuple(samples), len(samples), sum(len(s.response_ids) for s in samples))
    passes: list[bool] = []
    forward_only = fused._forward_only

    def counted(samples_, *, reference):
        passes.append(reference)
        return forward_only(samples_, reference=reference)

    fused._forward_only = counted  # type: ignore[method-assign]
    got, want = fused.train_step([mb]), separate.train_step([mb])
    assert passes == []  # no old (nor, without KL, reference) forward-only pass
    for key in ("pg_loss", "is_weight_sum", "is_weight_max", "is_truncated_tokens", "corr/abs_diff_sum"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert got["is_truncated_tokens"] > 0  # the samples are off-policy: TIS acts on them
    after = dict(fused._parts()[0].named_parameters())
    for name, param in separate._parts()[0].named_parameters():
        torch.testing.assert_close(after[name], param, rtol=1e-5, atol=1e-6, msg=name)


def test_with_lora_dropout_stale_rollouts_keep_the_eval_mode_old_log_probs():
    """LoRA dropout > 0 and maxStaleness 1: the training forward carries dropout, which the IS weight
    old / engine must not, so the old log-probs still come from the eval-mode pass; without
    staleness (no IS weight from it) or without dropout one forward serves both."""
    from types import SimpleNamespace

    def fused(dropout: float, staleness: int, epochs: int = 1) -> bool:
        cfg = toy_config(
            model={"finetune": "lora", "lora": {"rank": 4, "alpha": 8, "dropout": dropout}},
            grpo={"maxStaleness": staleness, "ppoEpochs": epochs, "policyLoss": "clipped-tis"},
        )
        one = [trainer.RankMiniBatch((), 0, 0)]
        return trainer.TrainingRank._fused_old_log_probs(SimpleNamespace(cfg=cfg), one)  # type: ignore[arg-type]

    assert not fused(0.1, 1)
    assert fused(0.1, 0) and fused(0.0, 1) and fused(0.0, 0)
    assert not fused(0.0, 1, epochs=2)

"""Never NaN at top-p < 1: a sampled token outside the trainer's nucleus has log-prob -inf
(`rljob_trainer.model.sampling`), and -inf - (-inf) is NaN. Every registered policy loss, every KL
estimator, the rollout correction and the step metrics, fed -inf log-probs on both sides (the fused
single update: old = logp.detach()) and on one side, give finite losses, gradients and metrics, drop
exactly those tokens (value and gradient 0) and leave the other tokens as without them."""

from __future__ import annotations

import math

import pytest
import torch

from rljob_trainer.model import sampling
from rljob_trainer.train import algos, rollout_correction, train_metrics, trainer

pytestmark = pytest.mark.torch

NEG_INF = float("-inf")
# Two sequences; tokens 1 and 4 fell outside the trainer's nucleus.
LOGP = [-1.0, NEG_INF, -0.5, -2.0, NEG_INF, -0.3]
SEQ = [0, 0, 0, 1, 1, 1]
ADV = [1.0, 1.0, 1.0, -1.0, -1.0, -1.0]
ENGINE = [-1.1, -3.0, -0.4, -2.2, -4.0, -0.2]  # the engine sampled them: finite
DROPPED = [1, 4]
KEPT = [0, 2, 3, 5]


def _call(name: str, logp: torch.Tensor, old: torch.Tensor, **extra):
    kwargs = {"clip_low": 0.2, "clip_high": 0.28, "clip_ratio_c": 3.0, **extra}
    if algos.needs_seq_ids(name):
        kwargs["seq_ids"] = torch.tensor(SEQ)
    if algos.uses_rollout_logprobs(name):
        kwargs.update(rollout_logp=torch.tensor(ENGINE), tis_cap=2.0)
    return algos.get_policy_loss(name)(logp, old, torch.tensor(ADV), **kwargs)


@pytest.mark.parametrize("name", sorted(algos.POLICY_LOSSES))
@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_every_loss_is_finite_with_minus_inf_on_both_sides(name: str, mode: str) -> None:
    logp = torch.tensor(LOGP, requires_grad=True)
    old = logp.detach()  # the fused single update: the old policy is this very forward
    per_tok, clipped = _call(name, logp, old)
    loss = algos.aggregate_loss(
        per_tok,
        torch.ones(6),
        torch.tensor(SEQ),
        mode=mode,  # type: ignore[arg-type]
        global_num_seqs=2,
        global_num_tokens=6,
        token_sum_norm=8,
    )
    loss.backward()
    assert torch.isfinite(per_tok).all() and torch.isfinite(loss) and torch.isfinite(clipped).all()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    assert per_tok[DROPPED].tolist() == [0.0, 0.0] and logp.grad[DROPPED].tolist() == [0.0, 0.0]
    # the kept tokens are as if the dropped ones were not there (here: ratio 1 -> -A, times TIS)
    kept = torch.tensor([LOGP[i] for i in KEPT], requires_grad=True)
    ids = {"seq_ids": torch.tensor([SEQ[i] for i in KEPT])} if algos.needs_seq_ids(name) else {}
    extra = {"rollout_logp": torch.tensor([ENGINE[i] for i in KEPT]), "tis_cap": 2.0}
    base = algos.get_policy_loss(name)(
        kept,
        kept.detach(),
        torch.tensor([ADV[i] for i in KEPT]),
        clip_low=0.2,
        clip_high=0.28,
        **ids,
        **(extra if algos.uses_rollout_logprobs(name) else {}),
    )[0]
    assert per_tok[KEPT].tolist() == pytest.approx(base.tolist(), rel=1e-6)


@pytest.mark.parametrize("name", sorted(algos.POLICY_LOSSES))
def test_every_loss_is_finite_when_one_side_is_minus_inf(name: str) -> None:
    # multi-update: the old policy had the token in its nucleus, the updated one not (and back)
    logp = torch.tensor([NEG_INF, -1.0, -0.5, -2.0, -1.0, -0.3], requires_grad=True)
    old = torch.tensor([-1.0, NEG_INF, -0.5, -2.0, NEG_INF, -0.3])
    per_tok, _ = _call(name, logp, old)
    per_tok.sum().backward()
    assert torch.isfinite(per_tok).all() and logp.grad is not None and torch.isfinite(logp.grad).all()
    assert per_tok[[0, 1, 4]].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_drop_minus_inf_tokens(kind: str) -> None:
    logp = torch.tensor([NEG_INF, NEG_INF, -1.0, -0.5], requires_grad=True)
    ref = torch.tensor([NEG_INF, -1.0, NEG_INF, -0.7])
    kl = algos.kl_penalty(logp, ref, kind)  # type: ignore[arg-type]
    kl.sum().backward()
    assert torch.isfinite(kl).all() and logp.grad is not None and torch.isfinite(logp.grad).all()
    assert kl[:3].tolist() == [0.0, 0.0, 0.0] and kl[3].item() != 0.0


def test_tis_weights_and_off_policy_metrics_skip_minus_inf() -> None:
    old = torch.tensor(LOGP)
    w = algos.truncated_is_weights(old, torch.tensor(ENGINE), tis_cap=2.0)
    assert torch.isfinite(w).all() and w[DROPPED].tolist() == [0.0, 0.0]
    m = algos.compute_off_policy_metrics(
        old, torch.tensor(ENGINE), torch.ones(6), torch.tensor([3, 3]), trainer_version=4, tis_cap=2.0
    )
    assert all(math.isfinite(v.item()) for v in m.values())
    assert m["off_policy/is_weight_mean"].item() == pytest.approx(
        sum(math.exp(LOGP[i] - ENGINE[i]) for i in KEPT) / len(KEPT)
    )


def test_clip_metrics_count_the_dropped_tokens_and_nothing_else_there() -> None:
    logp = torch.tensor(LOGP)
    m = algos.ppo_clip_metrics(logp, logp, torch.tensor(ADV), clip_low=0.2, clip_high=0.28)
    assert all(torch.isfinite(v).all() for v in m.values())
    assert m["out_of_nucleus"].tolist() == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert m["ppo_kl"].tolist() == [0.0] * 6


@pytest.mark.parametrize(
    "correction",
    [
        rollout_correction.Correction(),
        rollout_correction.Correction(is_level="sequence"),
        rollout_correction.Correction(is_level="token", is_mode="mask", is_lower=0.5, is_upper=5.0),
        rollout_correction.Correction(is_level="geometric", reject_level="sequence", reject_upper=10.0),
        rollout_correction.Correction(is_level=None, reject_level="token"),
    ],
    ids=["token-tis", "seq-tis", "icepop", "geo-is-seq-rs", "token-rs"],
)
def test_rollout_corrections_and_their_metrics_are_finite_and_drop_minus_inf(
    correction: rollout_correction.Correction,
) -> None:
    old, engine, seq = torch.tensor(LOGP), torch.tensor(ENGINE), torch.tensor(SEQ)
    w = rollout_correction.correction_weights(old, engine, torch.ones(6), seq, correction)
    assert torch.isfinite(w["weight"]).all() and w["weight"][DROPPED].tolist() == [0.0, 0.0]
    sums = rollout_correction.correction_sums(old, engine, torch.ones(6), seq, correction)
    metrics = rollout_correction.correction_metrics({k: float(v) for k, v in sums.items()})
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["rollout/out_of_nucleus_fraction"] == pytest.approx(2 / 6)
    assert metrics["rollout/logprob_diff"] == pytest.approx(
        sum(abs(LOGP[i] - ENGINE[i]) for i in KEPT) / len(KEPT)
    )


def test_the_step_metrics_are_finite_with_out_of_nucleus_tokens() -> None:
    """The issue's case end to end on the real sampler: a nucleus of top-p 0.7 over real logits, a
    token sampled outside it, one fused update's loss, gradient and metrics."""
    torch.manual_seed(0)
    logits = torch.randn(6, 11, requires_grad=True)
    probs = torch.softmax(logits.detach(), -1)
    targets = torch.tensor(
        [int(probs[i].argmin()) if i in DROPPED else int(probs[i].argmax()) for i in range(6)]
    )
    logp, ent = sampling.token_log_probs(logits, targets, temperature=1.0, top_p=0.7, with_entropy=True)
    assert torch.isinf(logp[DROPPED]).all()  # the issue: -inf, and old = logp.detach() makes NaN
    per_tok, clipped = algos.get_policy_loss("clipped")(
        logp, logp.detach(), torch.tensor(ADV), clip_low=0.2, clip_high=0.28
    )
    pg = algos.aggregate_loss(
        per_tok,
        torch.ones(6),
        torch.tensor(SEQ),
        mode="seq-mean-token-mean",
        global_num_seqs=2,
        global_num_tokens=6,
    )
    pg.backward()
    assert torch.isfinite(pg) and logits.grad is not None and torch.isfinite(logits.grad).all()
    clip = algos.ppo_clip_metrics(
        logp.detach(), logp.detach(), torch.tensor(ADV), clip_low=0.2, clip_high=0.28
    )
    stats = dict.fromkeys(trainer.STAT_SUMS, 0.0)
    sums = rollout_correction.correction_sums(
        logp.detach().double(),
        torch.tensor(ENGINE, dtype=torch.float64),
        torch.ones(6),
        torch.tensor(SEQ),
        None,
    )
    stats.update({f"corr/{k}": float(v) for k, v in sums.items()})
    pg_value = float(pg.detach())
    stats.update(
        loss=pg_value,
        pg_loss=pg_value,
        entropy=float(ent.mean()),
        pg_clipfrac_tokens=float(clipped.sum()),
        ppo_kl_sum=float(clip["ppo_kl"].sum()),
        out_of_nucleus_tokens=float(clip["out_of_nucleus"].sum()),
        loss_tokens=6.0,
        grad_norm=1.0,
        pg_loss_updates=[pg_value],
        updates=1,
    )
    m = train_metrics.step_training_metrics([stats])
    numbers = {k: v for k, v in m.items() if isinstance(v, float)}
    assert all(math.isfinite(v) for v in numbers.values()), numbers
    assert m["out_of_nucleus_fraction"] == pytest.approx(2 / 6)

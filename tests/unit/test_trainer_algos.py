"""Unit tests for rljob_trainer.train.algos: vectorised functions agree with their slow references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rljob_trainer.train import algos

pytestmark = pytest.mark.torch


def test_grpo_advantages_known_values():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 5.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    adv = algos.compute_grpo_advantages(r, g)
    std = math.sqrt(0.25)  # unbiased std of [1,0,0,0] = sqrt(0.75/3)
    assert adv[0].item() == pytest.approx(0.75 / (std + 1e-6), rel=1e-5)
    assert adv[4:].tolist() == [0.0, 0.0, 0.0]  # equal rewards and single-sample group -> 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 4), st.floats(-3, 3, allow_nan=False)), min_size=1, max_size=30),
    st.booleans(),
)
def test_grpo_advantages_match_reference(items, norm):
    groups = [g for g, _ in items]
    rewards = [r for _, r in items]
    fast = algos.compute_grpo_advantages(torch.tensor(rewards), torch.tensor(groups), norm_by_std=norm)
    slow = algos.compute_grpo_advantages_reference(rewards, groups, norm_by_std=norm)
    assert fast.tolist() == pytest.approx(slow, rel=1e-4, abs=1e-4)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(-2, 0), st.floats(-2, 0), st.floats(-2, 2), st.integers(0, 3), st.booleans()),
        min_size=1,
        max_size=40,
    ),
    st.sampled_from(["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]),
)
def test_clipped_loss_and_aggregation_match_reference(rows, mode):
    lp, olp, adv, seq, m = (list(c) for c in zip(*rows, strict=True))
    mask = [float(x) for x in m]
    per_tok, _ = algos.clipped_policy_loss(
        torch.tensor(lp, dtype=torch.float64),
        torch.tensor(olp, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        clip_low=0.2,
        clip_high=0.28,
    )
    ref = algos.clipped_policy_loss_reference(lp, olp, adv, clip_low=0.2, clip_high=0.28)
    assert per_tok.tolist() == pytest.approx(ref, rel=1e-9, abs=1e-9)
    kw = {"mode": mode, "global_num_seqs": 7, "global_num_tokens": 50, "token_sum_norm": 16}
    fast = algos.aggregate_loss(per_tok, torch.tensor(mask, dtype=torch.float64), torch.tensor(seq), **kw)
    slow = algos.aggregate_loss_reference(ref, mask, seq, **kw)
    assert fast.item() == pytest.approx(slow, rel=1e-9, abs=1e-12)


def test_clip_bounds_and_gradient():
    old = torch.zeros(3)
    lp = torch.tensor([0.5, 0.5, -0.5], requires_grad=True)  # ratios e^.5=1.65, 1.65, e^-.5=0.61
    adv = torch.tensor([1.0, -1.0, 1.0])
    loss, clipped = algos.clipped_policy_loss(lp, old, adv, clip_low=0.2, clip_high=0.28)
    assert loss[0].item() == pytest.approx(-1.28)  # positive advantage capped at 1 + clip_high
    assert loss[1].item() == pytest.approx(math.exp(0.5))  # negative advantage: no cap above
    assert loss[2].item() == pytest.approx(-math.exp(-0.5))  # pessimistic min picks the unclipped
    assert clipped.tolist() == [1.0, 0.0, 0.0]
    loss.sum().backward()
    assert lp.grad is not None and lp.grad[0].item() == 0.0 and lp.grad[1].item() != 0.0


def test_per_sequence_mean_is_split_invariant():
    # The global-batch loss is the same however sequences are spread over micro-batches/ranks.
    torch.manual_seed(0)
    vals = torch.randn(10)
    mask = torch.tensor([1.0] * 10)
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    kw = {"mode": "seq-mean-token-mean", "global_num_seqs": 4, "global_num_tokens": 10}
    whole = algos.aggregate_loss(vals, mask, seq, **kw)
    a = algos.aggregate_loss(vals[:5], mask[:5], seq[:5], **kw)
    b = algos.aggregate_loss(vals[5:], mask[5:], seq[5:] - 2, **kw)
    assert (a + b).item() == pytest.approx(whole.item())


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_per_sequence_aggregations_are_split_invariant(mode):
    torch.manual_seed(1)
    vals, mask = torch.randn(10), torch.ones(10)
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    kw = {"mode": mode, "global_num_seqs": 4, "global_num_tokens": 10, "token_sum_norm": 8}
    whole = algos.aggregate_loss(vals, mask, seq, **kw)
    parts = algos.aggregate_loss(vals[:5], mask[:5], seq[:5], **kw) + algos.aggregate_loss(
        vals[5:], mask[5:], seq[5:] - 2, **kw
    )
    assert parts.item() == pytest.approx(whole.item())


def test_token_sum_norm_weighs_long_sequences_by_their_length():
    # Dr. GRPO: a 4-token and a 1-token sequence with equal per-token loss contribute 4:1.
    vals, mask, seq = torch.ones(5), torch.ones(5), torch.tensor([0, 0, 0, 0, 1])
    kw = {"mode": "seq-mean-token-sum-norm", "global_num_seqs": 2, "global_num_tokens": 5}
    loss = algos.aggregate_loss(vals, mask, seq, token_sum_norm=4, **kw)
    assert loss.item() == pytest.approx((4 / 4 + 1 / 4) / 2)
    with pytest.raises(ValueError, match="token_sum_norm"):
        algos.aggregate_loss(vals, mask, seq, **kw)


def test_kl_estimators():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0])
    k3 = algos.kl_penalty(lp, ref, "k3")
    d = -0.5
    assert k3[0].item() == pytest.approx(math.exp(d) - d - 1)
    assert k3[1].item() == 0.0
    assert algos.kl_penalty(lp, ref, "k1")[0].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="k1, k2, k3"):
        algos.kl_penalty(lp, ref, "k9")  # type: ignore[arg-type]


def test_registries_raise_listing_names():
    assert algos.get_adv_estimator("grpo") is algos.compute_grpo_advantages
    assert algos.get_policy_loss("clipped") is algos.clipped_policy_loss
    with pytest.raises(ValueError, match="valid names: grpo"):
        algos.get_adv_estimator("ppo")
    with pytest.raises(ValueError, match="valid names: clipped"):
        algos.get_policy_loss("nope")
    with pytest.raises(ValueError, match="already registered"):
        algos.register_adv_est("grpo")(algos.compute_grpo_advantages)


# ---- finite or skipped: log-ratio clamp, dual-clip, GSPO, clip metrics ---------------------------
def test_dual_clip_caps_a_negative_advantage_and_matches_the_reference() -> None:
    logp = torch.tensor([0.0, 3.0, -0.5, 2.0, 0.1])
    old = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0])
    adv = torch.tensor([1.0, -1.0, -2.0, 1.0, -0.5])
    loss, _ = algos.clipped_policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    ref = algos.clipped_policy_loss_reference(
        logp.tolist(), old.tolist(), adv.tolist(), clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0
    )
    assert loss.tolist() == pytest.approx(ref, rel=1e-6)
    assert loss[1].item() == pytest.approx(3.0)  # ratio e^3 = 20 on A = -1: capped at -A * c


def test_a_collapsed_log_prob_gives_a_finite_loss_and_gradient() -> None:
    # A token outside the trainer's top-p nucleus has log-prob -inf: no inf ratio, no 0 * inf.
    logp = torch.tensor([float("-inf"), -1.0, 50.0], requires_grad=True)
    old = torch.tensor([-1.0, -1.0, -1.0])
    adv = torch.tensor([1.0, -1.0, -1.0])
    loss, _ = algos.clipped_policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.2)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all()
    kl = algos.kl_penalty(logp, old, "k3")
    assert torch.isfinite(kl).all()


def test_gspo_uses_one_ratio_per_sequence_and_matches_the_reference() -> None:
    logp = torch.tensor([-1.0, -2.0, -0.5, -0.7, -0.1], requires_grad=True)
    old = torch.tensor([-1.2, -1.9, -0.5, -1.5, -0.2])
    seq = torch.tensor([0, 0, 0, 1, 1])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0])
    loss, _ = algos.get_policy_loss("gspo")(logp, old, adv, clip_low=0.2, clip_high=0.2, seq_ids=seq)
    ref = algos.gspo_policy_loss_reference(
        logp.tolist(), old.tolist(), adv.tolist(), seq.tolist(), clip_low=0.2, clip_high=0.2
    )
    assert loss.tolist() == pytest.approx(ref, rel=1e-6)
    assert loss[0].item() == loss[1].item() == loss[2].item()  # every token carries its sequence's ratio
    loss.sum().backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    assert algos.needs_seq_ids("gspo") and algos.uses_rollout_logprobs("gspo-tis")


def test_clip_metrics_split_the_clipped_tokens_by_bound() -> None:
    logp = torch.log(torch.tensor([1.5, 0.5, 1.0, 4.0]))
    old = torch.zeros(4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    m = algos.ppo_clip_metrics(logp, old, adv, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    assert m["clipped_high"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert m["clipped_low"].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert m["dual_clipped"].tolist() == [0.0, 0.0, 0.0, 1.0]
    _, clipped = algos.clipped_policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    assert (clipped[:3] == m["clipped_high"][:3] + m["clipped_low"][:3]).all()
    assert m["ppo_kl"].tolist() == pytest.approx((-logp).tolist())

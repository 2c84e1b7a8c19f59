"""Unit tests for the off-policy correction in rljob_trainer.train.algos: truncated importance sampling
(`clipped-tis`) and the off-policy metrics agree with their slow references and behave as the
decoupled-PPO form says."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rljob_trainer.train import algos

pytestmark = pytest.mark.torch

logps = st.floats(-6.0, 0.0, allow_nan=False)
token_rows = st.lists(
    st.tuples(logps, logps, logps, st.floats(-3, 3, allow_nan=False), st.sampled_from([0.0, 1.0])),
    min_size=1,
    max_size=40,
)


@settings(max_examples=120, deadline=None)
@given(token_rows, st.floats(1.01, 10.0), st.floats(0.0, 0.5), st.floats(0.0, 0.5))
def test_tis_loss_matches_its_reference(
    rows: list[tuple[float, float, float, float, float]], cap: float, low: float, high: float
) -> None:
    logp, old, rollout, adv, _ = (list(col) for col in zip(*rows, strict=True))
    loss, _ = algos.clipped_tis_policy_loss(
        torch.tensor(logp, dtype=torch.float64),
        torch.tensor(old, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        clip_low=low,
        clip_high=high,
        rollout_logp=torch.tensor(rollout, dtype=torch.float64),
        tis_cap=cap,
    )
    expected = algos.clipped_tis_policy_loss_reference(
        logp, old, adv, rollout, clip_low=low, clip_high=high, tis_cap=cap
    )
    assert loss.tolist() == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_tis_is_registered_and_plain_clipped_when_on_policy_or_without_rollout_logps() -> None:
    assert algos.get_policy_loss("clipped-tis") is algos.clipped_tis_policy_loss
    logp = torch.tensor([-1.0, -2.0, -0.5])
    old = torch.tensor([-1.2, -1.5, -0.5])
    adv = torch.tensor([1.0, -1.0, 0.5])
    plain, plain_clipped = algos.clipped_policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    for rollout in (None, old.clone()):
        loss, clipped = algos.clipped_tis_policy_loss(
            logp, old, adv, clip_low=0.2, clip_high=0.28, rollout_logp=rollout
        )
        assert torch.equal(loss, plain)
        assert torch.equal(clipped, plain_clipped)


def test_weights_are_truncated_at_the_cap_and_carry_no_gradient() -> None:
    logp = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    old = torch.tensor([-1.0, -1.0, -1.0])
    # Token 0: the engine thought it far less likely than the trainer does (weight e^3 > cap);
    # token 1: more likely (weight e^-1); token 2: on-policy.
    rollout = torch.tensor([-4.0, 0.0, -1.0], requires_grad=True)
    weights = algos.truncated_is_weights(old, rollout, tis_cap=2.0)
    assert weights.tolist() == pytest.approx([2.0, math.exp(-1.0), 1.0])
    adv = torch.ones(3)
    loss, _ = algos.clipped_tis_policy_loss(
        logp, old, adv, clip_low=0.2, clip_high=0.2, rollout_logp=rollout, tis_cap=2.0
    )
    loss.sum().backward()
    assert rollout.grad is None  # the weight is a constant of the update
    # d/dlogp of -A·ρ at ρ = 1 is -A, scaled by each token's weight.
    assert logp.grad is not None
    assert logp.grad.tolist() == pytest.approx([-2.0, -math.exp(-1.0), -1.0])


def test_a_non_positive_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="tis_cap must be > 0"):
        algos.truncated_is_weights(torch.zeros(1), torch.zeros(1), tis_cap=0.0)


@settings(max_examples=120, deadline=None)
@given(
    token_rows,
    st.lists(st.integers(0, 9), min_size=0, max_size=12),
    st.integers(0, 12),
    st.floats(1.01, 5.0),
)
def test_off_policy_metrics_match_their_reference(
    rows: list[tuple[float, float, float, float, float]],
    versions: list[int],
    trainer_version: int,
    cap: float,
) -> None:
    _, old, rollout, _, mask = (list(col) for col in zip(*rows, strict=True))
    fast = algos.compute_off_policy_metrics(
        torch.tensor(old, dtype=torch.float64),
        torch.tensor(rollout, dtype=torch.float64),
        torch.tensor(mask),
        torch.tensor(versions, dtype=torch.long),
        trainer_version=trainer_version,
        tis_cap=cap,
    )
    slow = algos.compute_off_policy_metrics_reference(
        old, rollout, mask, versions, trainer_version=trainer_version, tis_cap=cap
    )
    assert fast.keys() == slow.keys()
    for name, value in slow.items():
        assert fast[name].item() == pytest.approx(value, rel=1e-9, abs=1e-12), name


def test_off_policy_metrics_known_values() -> None:
    old = torch.tensor([0.0, 0.0, 0.0, 0.0])
    rollout = torch.tensor([0.0, -math.log(3.0), math.log(2.0), -5.0])  # weights 1, 3, 0.5, e^5
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the last token is padding: ignored
    metrics = algos.compute_off_policy_metrics(
        old, rollout, mask, torch.tensor([7, 6, 6]), trainer_version=7, tis_cap=2.0
    )
    values = {k: v.item() for k, v in metrics.items()}
    assert values == pytest.approx(
        {
            "off_policy/staleness_mean": 2 / 3,
            "off_policy/staleness_max": 1.0,
            "off_policy/is_weight_mean": 1.5,
            "off_policy/is_weight_max": 3.0,
            "off_policy/truncated_fraction": 1 / 3,
        }
    )

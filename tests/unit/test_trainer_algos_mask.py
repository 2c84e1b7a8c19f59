"""GSPO's sequence ratio over an episode's generated tokens only (`mask`): an observation token (a
tool result) is neither in its sequence's mean log-ratio nor given a gradient."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rljob_trainer.train import algos  # noqa: E402


def test_gspo_with_a_mask_is_gspo_of_the_generated_tokens_alone() -> None:
    logp = [-1.0, -0.5, -2.0, -0.1, -3.0, -0.7, -1.1]
    old = [-1.2, -0.4, -0.5, -2.5, -2.9, -0.9, -1.0]
    seq = [0, 0, 0, 0, 1, 1, 1]
    mask = [1, 0, 0, 1, 1, 0, 1]
    adv = [0.8] * 4 + [-0.6] * 3
    keep = [i for i, m in enumerate(mask) if m]
    want = algos.gspo_policy_loss_reference(
        [logp[i] for i in keep],
        [old[i] for i in keep],
        [adv[i] for i in keep],
        [seq[i] for i in keep],
        clip_low=0.2,
        clip_high=0.28,
    )
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    loss, _ = algos.gspo_policy_loss(
        lp,
        torch.tensor(old, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        clip_low=0.2,
        clip_high=0.28,
        seq_ids=torch.tensor(seq),
        mask=torch.tensor(mask, dtype=torch.float64),
    )
    got = [float(loss[i]) for i in keep]
    assert got == pytest.approx(want, rel=1e-9)
    m = torch.tensor(mask, dtype=torch.float64)
    (loss * m).sum().backward()
    assert lp.grad is not None
    assert all(float(lp.grad[i]) == 0.0 for i, x in enumerate(mask) if not x)
    unmasked, _ = algos.gspo_policy_loss(
        lp.detach(),
        torch.tensor(old, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        clip_low=0.2,
        clip_high=0.28,
        seq_ids=torch.tensor(seq),
    )
    assert [float(unmasked[i]) for i in keep] != pytest.approx(want, rel=1e-3)  # the mask matters

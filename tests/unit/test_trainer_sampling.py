"""The sampler's processed log-probs (rljob_trainer.model.sampling) against a slow copy of vLLM 0.33's."""

from __future__ import annotations

import math

import pytest
import torch

from rljob_trainer.model import sampling


def _vllm_reference(logits: list[float], temperature: float, top_p: float) -> list[float]:
    """vLLM 0.33 `apply_top_k_top_p_pytorch` + log_softmax, one row, in plain Python."""
    z = [x / temperature for x in logits]
    order = sorted(range(len(z)), key=lambda i: z[i])  # ascending
    m = max(z)
    total = sum(math.exp(v - m) for v in z)
    masked, cum = set(), 0.0
    for rank, i in enumerate(order):
        cum += math.exp(z[i] - m) / total
        if cum <= 1 - top_p and rank != len(order) - 1:
            masked.add(i)
    kept = [i for i in range(len(z)) if i not in masked]
    lse = m + math.log(sum(math.exp(z[i] - m) for i in kept))
    return [z[i] - lse if i not in masked else -math.inf for i in range(len(z))]


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.8), (1.3, 0.5), (0.5, 0.95)])
def test_processed_log_probs_follow_vllm(temperature: float, top_p: float) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 17, generator=gen) * 2
    got = sampling.processed_log_probs(logits, temperature=temperature, top_p=top_p)
    for row in range(logits.shape[0]):
        ref = _vllm_reference(logits[row].tolist(), temperature, top_p)
        for g, r in zip(got[row].tolist(), ref, strict=True):
            assert (g == r == -math.inf) or g == pytest.approx(r, abs=1e-5)


def test_token_log_probs_gather_the_processed_distribution_with_grad_and_entropy() -> None:
    logits = torch.randn(5, 11, requires_grad=True)
    targets = torch.argmax(logits, dim=-1)  # the most likely token is always in the nucleus
    lp, ent = sampling.token_log_probs(logits, targets, temperature=0.7, top_p=0.8, with_entropy=True)
    full = sampling.processed_log_probs(logits, temperature=0.7, top_p=0.8)
    assert torch.allclose(lp, full.gather(-1, targets[:, None])[:, 0])
    lp.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    p = full.exp()
    assert ent is not None and torch.allclose(ent, -(p * full.nan_to_num(neginf=0.0)).sum(-1), atol=1e-6)


def test_greedy_returns_the_raw_log_softmax() -> None:
    logits = torch.randn(3, 9)
    got = sampling.processed_log_probs(logits, temperature=0.0, top_p=0.5)
    assert torch.allclose(got, torch.log_softmax(logits, -1))

"""Integration tests for the packed forward with real torch: per-sample log-probs equal running each
sample alone (only with use_cache=False). Gradient invariance under DP balance, through the real
`TrainingRank.train_step`, is tests/integration/test_dp_invariance.py."""

from __future__ import annotations

import socket
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


from rljob_trainer.train import packing  # noqa: E402

pytestmark = pytest.mark.torch

VOCAB = 101


def tiny_model(attn_implementation: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation=attn_implementation,
    )
    return transformers.Qwen2ForCausalLM(config)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------------------------------------------
# (b) packed forward


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_log_probs_equal_each_sample_alone(attn_implementation: str) -> None:
    model = tiny_model(attn_implementation)
    gen = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (9, 17, 4, 12)]
    packed = packing.pack_sequences(samples)
    assert packed.input_ids.shape == (1, 42)
    assert packed.position_ids[0, 9].item() == 0  # restarts at each sample
    for mode in ("train", "eval"):
        getattr(model, mode)()
        got = packing.packed_token_log_probs(model, packed)
        want = [packing.token_log_probs(model, s) for s in samples]
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


class _AllLogits(torch.nn.Module):
    """A causal LM whose forward takes no logits_to_keep (it always returns every position's logits)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, use_cache: bool) -> Any:
        return self.inner(input_ids=input_ids, position_ids=position_ids, use_cache=use_cache)


@pytest.mark.parametrize("wrapped", [False, True], ids=["logits_to_keep", "every_position"])
def test_skipped_positions_give_the_same_log_probs_entropies_and_gradients(wrapped: bool) -> None:
    # The trainer skips each sample's prompt: only the response positions' logits are computed.
    model = tiny_model("sdpa")
    model.train()
    runner: torch.nn.Module = _AllLogits(model) if wrapped else model
    gen = torch.Generator().manual_seed(3)
    samples = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (9, 17, 4, 12)]
    skip = [5, 0, 3, 11]
    packed = packing.pack_sequences(samples)
    full, full_ent = packing.packed_log_probs_and_entropy(model, packed, temperature=0.7, with_entropy=True)
    sum(lp[s:].sum() for lp, s in zip(full, skip, strict=True)).backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    kept, kept_ent = packing.packed_log_probs_and_entropy(
        runner, packed, temperature=0.7, with_entropy=True, skip=skip
    )
    assert [len(k) for k in kept] == [n - 1 - s for n, s in zip((9, 17, 4, 12), skip, strict=True)]
    assert kept_ent is not None and full_ent is not None
    for a, b, ea, eb, s in zip(kept, full, kept_ent, full_ent, skip, strict=True):
        torch.testing.assert_close(a, b[s:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ea, eb[s:], atol=1e-5, rtol=1e-5)
    sum(lp.sum() for lp in kept).backward()
    for p, want in zip(model.parameters(), want_grads, strict=True):
        torch.testing.assert_close(p.grad, want, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="leaves out more"):
        packing.packed_log_probs_and_entropy(model, packed, skip=[9, 0, 0, 0])


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_packed_forward_without_use_cache_false_mixes_samples(mode: str) -> None:
    # transformers 5.x: use_cache defaults to config.use_cache (True) in train and eval mode; the model
    # then creates a DynamicCache and skips packed-sequence masking, so samples attend to each other.
    model = tiny_model("sdpa")
    getattr(model, mode)()
    assert model.config.use_cache is True
    gen = torch.Generator().manual_seed(2)
    samples = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (8, 8)]
    packed = packing.pack_sequences(samples)
    with torch.no_grad():
        naive = model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits[0]
        alone = model(input_ids=samples[1].unsqueeze(0), use_cache=False).logits[0]
        fixed = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits[0]
    # The first sample is unaffected either way (causal); the second sees the first without the fix.
    torch.testing.assert_close(fixed[8:], alone, atol=1e-5, rtol=1e-5)
    assert (naive[8:] - alone).abs().max().item() > 1e-2


def test_side_arrays_stay_aligned_and_mismatch_raises() -> None:
    samples = [[1, 2, 3], [4, 5]]
    nested = [[[0, 1, 1]], [[1, 0]]]  # [1, L] per sample, as rollouts store mm_token_type_ids
    packed = packing.pack_sequences(samples, {"mm_token_type_ids": nested})
    assert packed.side["mm_token_type_ids"].tolist() == [[0, 1, 1, 1, 0]]
    assert packed.side["mm_token_type_ids"].shape == packed.input_ids.shape
    assert [t.tolist() for t in packing.unpack(packed.side["mm_token_type_ids"], packed.lengths)] == [
        [0, 1, 1],
        [1, 0],
    ]
    with pytest.raises(ValueError, match=r"'mm_token_type_ids' of sample 1"):
        packing.pack_sequences(samples, {"mm_token_type_ids": [[0, 1, 1], [1]]})

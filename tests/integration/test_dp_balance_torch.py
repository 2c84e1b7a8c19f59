"""Integration tests for DP balance with real torch: gradient invariance on two gloo ranks, and the
packed forward (per-sample log-probs equal running each sample alone only with use_cache=False)."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from rljob_trainer import microbatch, packing  # noqa: E402
from rljob_trainer.dp_balance import CostModel, MicroBatchSpec, plan_dp_balance  # noqa: E402

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


# ---------------------------------------------------------------------------------------------------
# (a) gradient invariance on two gloo ranks

WORLD = 2
LENGTHS = [60, 7, 58, 9, 55, 6, 52, 8, 11, 50, 10, 49]  # long samples first: the contiguous split is uneven
SPEC = MicroBatchSpec(packed=True, dynamic=True, max_tokens_per_micro_batch=128)


def _rank_gradient(model: torch.nn.Module, order: list[int], rank: int, normalisation: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    samples = [torch.randint(0, VOCAB, (n,), generator=gen) for n in LENGTHS]
    advantages = torch.randn(len(LENGTHS), generator=gen)
    old = [torch.randn(n - 1, generator=gen) * 0.01 - 4.6 for n in LENGTHS]
    m = len(LENGTHS) // WORLD
    mine = order[rank * m : (rank + 1) * m]
    per_rank = [[LENGTHS[i] for i in order[r * m : (r + 1) * m]] for r in range(WORLD)]
    k = microbatch.max_micro_batch_count(per_rank, SPEC)  # in a real job: all_reduce(MAX)
    model.zero_grad(set_to_none=False)
    local_tokens = sum(LENGTHS[i] - 1 for i in mine)
    for mb in microbatch.plan_micro_batches([LENGTHS[i] for i in mine], SPEC, k):
        idx = [mine[j] for j in mb]
        lps = packing.packed_token_log_probs(model, packing.pack_sequences([samples[i] for i in idx]))
        if normalisation == "global_sequence_mean":
            loss = packing.sequence_mean_policy_loss(
                lps, advantages[idx], len(LENGTHS), old_log_probs=[old[i] for i in idx]
            )
        else:  # per-rank token mean: depends on which rank holds which sample
            loss = sum(
                -(torch.exp(lp - old[i]) * advantages[i]).sum() for lp, i in zip(lps, idx, strict=True)
            )
            loss = loss / local_tokens / WORLD
        loss.backward()
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    return flat


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = tiny_model("sdpa")
        plan = plan_dp_balance(LENGTHS, WORLD, micro_batch=SPEC, cost=CostModel.from_hidden_size(32))
        results = {"permutation": list(plan.permutation), "metrics": plan.metrics}
        for normalisation in ("global_sequence_mean", "rank_token_mean"):
            results[normalisation] = (
                _rank_gradient(model, list(range(len(LENGTHS))), rank, normalisation),
                _rank_gradient(model, list(plan.permutation), rank, normalisation),
            )
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_gradient_is_unchanged_by_reorder_on_two_gloo_ranks() -> None:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(free_port(), out_dir), nprocs=WORLD, join=True)
        ranks = [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    res = ranks[0]
    assert res["permutation"] != list(range(len(LENGTHS))), "the planner should reorder this skewed batch"
    assert res["metrics"]["dp_balance/applied"] == 1.0
    assert res["metrics"]["dp_balance/slowest_cost_after"] < res["metrics"]["dp_balance/slowest_cost_before"]
    base, balanced = res["global_sequence_mean"]
    assert base.abs().max() > 0
    torch.testing.assert_close(balanced, base, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ranks[1]["global_sequence_mean"][1], base, atol=1e-6, rtol=1e-5)
    # Negative control: a per-rank token mean weighs samples by their rank's token count, so the same
    # reorder changes the gradient (the test above can fail).
    base_tok, balanced_tok = res["rank_token_mean"]
    assert not torch.allclose(base_tok, balanced_tok, atol=1e-6, rtol=1e-5)

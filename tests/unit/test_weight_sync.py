"""Unit tests for rljob_trainer.weights.weight_sync's pure parts and in-process helpers (no group needed):
bucket planning, the manifest, what a model sends, the loaders' checks. The wire itself is tested
across real processes in tests/integration/test_weight_sync_processes.py."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from rljob_trainer.weights import weight_sync
from rljob_trainer.weights.weight_sync import TensorMeta

pytestmark = pytest.mark.torch

DTYPES = ["float32", "bfloat16", "float16", "int64", "uint8"]


def tiny_model(seed: int = 0) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return transformers.Qwen2ForCausalLM(config)


metas_strategy = st.lists(
    st.builds(
        TensorMeta,
        name=st.text("abc.", min_size=1, max_size=6),
        dtype=st.sampled_from(DTYPES),
        shape=st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(metas_strategy, st.integers(1, 4096))
def test_buckets_hold_every_tensor_once_in_order_aligned_and_within_the_limit(
    metas: list[TensorMeta], bucket_bytes: int
) -> None:
    buckets = weight_sync.plan_buckets(metas, bucket_bytes)
    assert [e.meta for b in buckets for e in b.entries] == metas
    for bucket in buckets:
        assert bucket.entries, "no empty buckets"
        end = 0
        for entry in bucket.entries:
            assert entry.offset % weight_sync.ALIGN_BYTES == 0
            assert entry.offset >= end, "entries overlap"
            end = entry.offset + entry.meta.nbytes
        assert bucket.nbytes == end
        # Over the limit only when a single tensor is larger than a bucket.
        assert bucket.nbytes <= bucket_bytes or len(bucket.entries) == 1


def test_small_tensors_share_a_bucket_and_a_large_one_gets_its_own() -> None:
    small = TensorMeta("a", "float32", (4,))  # 16 bytes
    large = TensorMeta("b", "float32", (100,))  # 400 bytes
    buckets = weight_sync.plan_buckets([small, small, large, small], bucket_bytes=64)
    assert [[e.meta.name for e in b.entries] for b in buckets] == [["a", "a"], ["b"], ["a"]]
    assert [e.offset for e in buckets[0].entries] == [0, 16]


@settings(max_examples=50, deadline=None)
@given(metas_strategy, st.integers(0, 10**6))
def test_manifest_round_trips(metas: list[TensorMeta], version: int) -> None:
    buckets = weight_sync.plan_buckets(metas, 256)
    assert weight_sync.decode_manifest(weight_sync.encode_manifest(version, buckets)) == (version, buckets)


def test_backend_follows_the_accelerator_and_names_the_valid_ones() -> None:
    assert [weight_sync.backend_for_device(d) for d in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]
    with pytest.raises(ValueError, match=r"'tpu'.*\['cpu', 'cuda', 'npu'\]"):
        weight_sync.backend_for_device("tpu")


def test_an_unknown_dtype_in_a_manifest_is_refused() -> None:
    with pytest.raises(ValueError, match="float99"):
        _ = TensorMeta("x", "float99", (1,)).nbytes


def test_model_tensors_are_references_and_send_a_tied_tensor_once() -> None:
    model = tiny_model()
    tensors = dict(weight_sync.model_tensors(model))
    assert "model.embed_tokens.weight" in tensors
    assert "lm_head.weight" not in tensors
    assert tensors["model.embed_tokens.weight"] is model.model.embed_tokens.weight
    state = model.state_dict()
    assert set(state) - set(tensors) == {"lm_head.weight"}


def test_module_loader_fills_tied_aliases_in_place() -> None:
    sender, receiver = tiny_model(0), tiny_model(1)
    embed = receiver.model.embed_tokens.weight
    weight_sync.module_loader(receiver)(list(weight_sync.model_tensors(sender)))
    assert receiver.model.embed_tokens.weight is embed  # same storage, loaded in place
    for name, value in sender.state_dict().items():
        assert torch.equal(receiver.state_dict()[name], value), name
    assert torch.equal(receiver.lm_head.weight, sender.model.embed_tokens.weight)


def test_loader_names_unknown_tensors_and_shape_mismatches() -> None:
    load = weight_sync.module_loader(tiny_model())
    with pytest.raises(ValueError, match=r"does not have.*no\.such\.weight"):
        load([("no.such.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(3,\).*\(16,\)"):
        load([("model.norm.weight", torch.zeros(3))])


def test_without_groups_every_rank_still_walks_every_bucket_in_the_engine_dtype() -> None:
    # Trainer ranks other than 0 pass no groups but must still gather each bucket (FSDP2 collectives).
    model = tiny_model()
    tensors = weight_sync.model_tensors(model)
    fp32 = weight_sync.send_weights({}, tensors, version=3, bucket_bytes=1024)
    bf16 = weight_sync.send_weights({}, tensors, version=3, dtype=torch.bfloat16, bucket_bytes=1024)
    assert fp32.tensors == bf16.tensors == len(tensors)
    assert fp32.buckets > 1 and fp32.failed == {}
    elements = sum(t.numel() for _, t in tensors)
    assert elements * 4 <= fp32.nbytes < elements * 4 + 16 * len(tensors)
    assert elements * 2 <= bf16.nbytes < elements * 2 + 16 * len(tensors)


def test_merged_syncs_leave_a_bf16_base_bit_for_bit_as_it_was() -> None:
    """A merged sync of a bf16 LoRA model, ten times: the trainer's base weights are exactly what they
    were (an in-place merge and unmerge in bf16 moves them by a rounding error each time), and each
    merged weight is W + the adapter's delta rounded once to bf16."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_model().to(torch.bfloat16),
        LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = "model.layers.0.self_attn.q_proj"
    layer = model.get_base_model().get_submodule(q)
    for _ in range(10):
        with weight_sync.merged_lora_tensors(model) as tensors:
            merged = dict(tensors)[f"{q}.weight"]
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    expected = (
        before[f"base_model.model.{q}.base_layer.weight"].float() + layer.get_delta_weight("default").float()
    )
    assert merged.dtype == torch.bfloat16 and torch.equal(merged, expected.to(torch.bfloat16))


def test_merged_lora_tensors_use_base_names_and_leave_training_weights_unmerged() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_model(), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    base = tiny_model()
    q = "model.layers.0.self_attn.q_proj.weight"
    with weight_sync.merged_lora_tensors(model) as tensors:
        named = dict(tensors)
        assert set(named) == set(dict(weight_sync.model_tensors(base)))
        assert not torch.equal(named[q], base.state_dict()[q])  # the adapter is merged into q_proj
        weight_sync.module_loader(base)(list(tensors))
    for name, value in model.state_dict().items():
        assert torch.allclose(value, before[name], atol=1e-6), name
    # Adapter-only sync: PEFT's saved-adapter names (no adapter name), nothing of the base model.
    adapter = dict(weight_sync.lora_adapter_tensors(model))
    assert set(adapter) == {k.replace(".default", "") for k in before if "lora_" in k}

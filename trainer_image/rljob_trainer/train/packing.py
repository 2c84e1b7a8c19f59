"""Padding-free packing: several samples in one row, and per-sample token log-probs from it.

Role: the trainer runs each micro-batch planned by `rljob_trainer.train.microbatch` (packed layout) as one
row built by `pack_sequences`, and reads per-sample log-probs with `packed_token_log_probs`.
Callers: the trainer's forward/backward and forward-only (old/ref log-prob) passes, the DP-balance
benchmark and tests.

Two bugs the seed hit, and how this module avoids them:

1. Per-token side arrays (e.g. `mm_token_type_ids`) must stay aligned with `input_ids` when samples
   are concatenated. Rollouts often store them as a nested [1, L] list; extending such a list flat
   gives 1 entry per sample instead of L. `pack_sequences` squeezes a leading batch dimension of
   size 1, then checks every side array's length against its sample and raises on a mismatch.

2. Sample boundaries in a packed row are only carried by `position_ids` restarting at 0. In
   transformers 5.x (checked on 5.24, `masking_utils._preprocess_mask_arguments`) the causal mask
   is split per sample (`find_packed_sequence_indices`) only when `attention_mask is None` AND the
   model has no cache object. `use_cache` defaults to `config.use_cache` (True for almost every
   causal LM) through `merge_with_config_defaults`, in train and eval mode alike, and the model then
   creates a `DynamicCache` before building the mask — so the row gets one plain causal mask and
   packed samples attend to each other (only the rotary positions restart). Every forward here
   passes `use_cache=False`. (Flash-attention 2 kernels derive `cu_seqlens` from `position_ids`
   themselves and are not affected; eager and sdpa, what CPUs and most tests run, are.)
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rljob_trainer.model import sampling


@dataclass(frozen=True)
class PackedBatch:
    """Samples concatenated into one row.

    Attributes:
        input_ids: [1, T] long, T = Σ lengths.
        position_ids: [1, T] long, 0..L_i−1 for each sample in turn.
        cu_seqlens: [N + 1] int32 cumulative offsets; sample i is columns cu_seqlens[i]:cu_seqlens[i+1].
        lengths: tokens per sample, len N.
        side: per-token side arrays, each [1, T, ...], aligned with `input_ids`.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]
    side: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def _as_1d_per_token(value: Any, length: int, *, name: str, sample: int) -> torch.Tensor:
    tensor = torch.as_tensor(value)
    # Rollouts store some side arrays as a nested [1, L] list (the seed's mm_token_type_ids bug).
    if tensor.dim() >= 2 and tensor.shape[0] == 1 and tensor.shape[1] == length:
        tensor = tensor[0]
    if tensor.dim() == 0 or tensor.shape[0] != length:
        raise ValueError(
            f"side array {name!r} of sample {sample} has shape {tuple(tensor.shape)}, expected {length} "
            "entries (one per token of input_ids) along its first dimension"
        )
    return tensor


def pack_sequences(
    sequences: Sequence[Sequence[int] | torch.Tensor],
    side_arrays: Mapping[str, Sequence[Any]] | None = None,
    *,
    device: torch.device | str | None = None,
) -> PackedBatch:
    """Concatenate samples into one row with per-sample `position_ids`.

    Args:
        sequences: N token-id sequences, sample i of length L_i (a list or a [L_i] / [1, L_i] tensor).
        side_arrays: name -> N per-token arrays (each [L_i, ...] or [1, L_i, ...]), concatenated the
            same way, e.g. {"mm_token_type_ids": [...]}.
        device: where the tensors go.

    Returns:
        PackedBatch with input_ids/position_ids [1, T] and side arrays [1, T, ...].
    """
    ids = [
        _as_1d_per_token(seq, len(torch.as_tensor(seq).flatten()), name="input_ids", sample=i)
        for i, seq in enumerate(sequences)
    ]
    ids = [t.flatten().long() for t in ids]
    lengths = tuple(int(t.shape[0]) for t in ids)
    if any(length == 0 for length in lengths):
        raise ValueError(f"empty sample at index {lengths.index(0)}; every packed sample needs >= 1 token")
    input_ids = torch.cat(ids).unsqueeze(0)
    position_ids = torch.cat([torch.arange(length) for length in lengths]).unsqueeze(0)
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    side: dict[str, torch.Tensor] = {}
    for name, values in (side_arrays or {}).items():
        if len(values) != len(ids):
            raise ValueError(f"side array {name!r} has {len(values)} samples, input_ids has {len(ids)}")
        parts = [_as_1d_per_token(v, lengths[i], name=name, sample=i) for i, v in enumerate(values)]
        side[name] = torch.cat(parts).unsqueeze(0).to(device)
    return PackedBatch(
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        cu_seqlens=torch.tensor(offsets, dtype=torch.int32, device=device),
        lengths=lengths,
        side=side,
    )


def unpack(values: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Split a packed per-token tensor [1, T, ...] or [T, ...] into N tensors [L_i, ...]."""
    flat = (
        values[0]
        if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == sum(lengths)
        else values
    )
    return list(torch.split(flat, list(lengths), dim=0))


def _next_token_log_probs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float, top_p: float, *, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # logits [T, V] predict input_ids[1:]: the sampler's processed log-probs (temperature, top-p), fp32.
    return sampling.token_log_probs(
        logits[:-1], input_ids[1:], temperature=temperature, top_p=top_p, with_entropy=with_entropy
    )


def packed_token_log_probs(
    model: torch.nn.Module,
    packed: PackedBatch,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    forward_side_keys: Sequence[str] = (),
) -> list[torch.Tensor]:
    """Per-sample next-token log-probs from one packed forward (`packed_log_probs_and_entropy`)."""
    return packed_log_probs_and_entropy(
        model, packed, temperature=temperature, top_p=top_p, forward_side_keys=forward_side_keys
    )[0]


def packed_log_probs_and_entropy(
    model: torch.nn.Module,
    packed: PackedBatch,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    forward_side_keys: Sequence[str] = (),
    with_entropy: bool = False,
    skip: Sequence[int] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Per-sample next-token log-probs from one packed forward, and optionally their entropies.

    Args:
        model: a causal LM returning `.logits` [1, T, V].
        packed: from `pack_sequences`.
        temperature, top_p: the sampler's processing (`rljob_trainer.model.sampling`), so the log-probs are
            those of the distribution the rollout engine sampled from.
        forward_side_keys: side arrays also passed to the model (e.g. "mm_token_type_ids").
        with_entropy: also return the processed distribution's entropy per token (no grad).
        skip: per sample, how many leading log-probs to leave out (the trainer's: its prompt, len − 1).
            Their logits are never computed (transformers' `logits_to_keep`): the LM head and the fp32
            softmax over the vocabulary run for the response positions only (SmolLM2, 49k vocabulary,
            47-token prompts and 24-token answers: a CPU training forward and backward 24 % faster).

    Returns:
        N tensors, sample i of shape [L_i − 1 − skip_i]: log p(x_t | x_<t) for t = 1 + skip_i..L_i−1
        (float32, with grad when grad is enabled), and the entropies in the same shapes (or None).
        Logits at a sample's last token would predict the next sample's first token and are dropped.
    """
    extra = {key: packed.side[key] for key in forward_side_keys}
    if skip is not None:
        return _kept_log_probs(model, packed, extra, skip, temperature, top_p, with_entropy)
    # use_cache=False: otherwise transformers builds a DynamicCache and skips packed-sequence masking
    # (module docstring, point 2), so samples would attend to each other.
    logits = model(
        input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False, **extra
    ).logits[0]
    token_lp, token_ent = _next_token_log_probs(
        logits, packed.input_ids[0], temperature, top_p, with_entropy=with_entropy
    )  # [T − 1]
    return _split_samples(token_lp, packed.lengths), (
        _split_samples(token_ent, packed.lengths) if token_ent is not None else None
    )


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    params = inspect.signature(model.forward).parameters.values()
    return any(p.name == "logits_to_keep" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _kept_log_probs(
    model: torch.nn.Module,
    packed: PackedBatch,
    extra: dict[str, torch.Tensor],
    skip: Sequence[int],
    temperature: float,
    top_p: float,
    with_entropy: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    if len(skip) != len(packed.lengths):
        raise ValueError(f"skip has {len(skip)} samples, the batch {len(packed.lengths)}")
    starts = packed.cu_seqlens.tolist()[:-1]
    sizes = [length - 1 - s for length, s in zip(packed.lengths, skip, strict=True)]
    if any(s < 0 or n < 0 for s, n in zip(skip, sizes, strict=True)):
        raise ValueError(f"skip {list(skip)} leaves out more than samples of lengths {packed.lengths} hold")
    device = packed.input_ids.device
    keep = torch.cat(
        [torch.arange(o + s, o + s + n, device=device) for o, s, n in zip(starts, skip, sizes, strict=True)]
    )
    if _takes_logits_to_keep(model):
        extra = {**extra, "logits_to_keep": keep}
    logits = model(
        input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False, **extra
    ).logits[0]
    if logits.shape[0] != keep.numel():  # a model that computes every position's logits anyway
        logits = logits[keep]
    token_lp, token_ent = sampling.token_log_probs(
        logits, packed.input_ids[0][keep + 1], temperature=temperature, top_p=top_p, with_entropy=with_entropy
    )
    return list(torch.split(token_lp, sizes)), (
        list(torch.split(token_ent, sizes)) if token_ent is not None else None
    )


def _split_samples(per_token: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    start = 0
    for length in lengths:
        out.append(per_token[start : start + length - 1])
        start += length
    return out


def token_log_probs(
    model: torch.nn.Module, sequence: Sequence[int] | torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """Reference: next-token log-probs [L − 1] of one sample run alone (no packing)."""
    ids = torch.as_tensor(sequence).flatten().long().unsqueeze(0)
    device = next(model.parameters()).device
    logits = model(input_ids=ids.to(device), use_cache=False).logits[0]
    return _next_token_log_probs(logits, ids[0].to(device), temperature, 1.0, with_entropy=False)[0]

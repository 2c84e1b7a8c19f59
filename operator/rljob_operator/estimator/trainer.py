"""Trainer memory for FSDP2: how many accelerators the policy update needs at minimum.

Role: per-accelerator bytes of a fully sharded (FSDP2, ``reshard_after_forward``) GRPO update
and the smallest trainer count that fits. Caller: :mod:`planner`.

Per accelerator with ``n`` FSDP ranks and ``P`` parameters:

* full fine-tuning, what the trainer holds (``rljob_trainer.model.precision``: FSDP2 with
  ``MixedPrecisionPolicy(param_dtype=<dtype>, reduce_dtype=float32)``): ``16 P / n`` = fp32 master
  weights 4 + fp32 gradients 4 + AdamW m and v 8, sharded; with a KL penalty the frozen reference
  in the model dtype, sharded too (``2 P / n``);
* LoRA: frozen base in the model dtype ``2 P / n`` plus ``16 T / n`` for the ``T`` fp32 adapter
  parameters (rank ``r`` on every projection: ``r x (in + out)``);
* unsharded compute copies in the model dtype, at any ``n`` (also 1: the policy casts the fp32
  masters): two decoder layers (current + prefetched), the root module's parameters (embeddings and
  an untied head, which FSDP2 keeps unsharded from forward to backward), and one layer's gradient in
  the model dtype plus its fp32 copy for the reduction;
* activations with gradient checkpointing at ``micro_batch_tokens``: the saved hidden state at
  every layer boundary, one layer's recompute working set, and fp32 logits + their gradient
  (the largest single term at 150k-token vocabularies); not sharded by FSDP;
* a runtime allowance (CUDA context, NCCL buckets, allocator fragmentation) and, in adaptive
  mode, the ~1 GiB a sleeping vLLM engine keeps on the device (seed note 004: "only ~1 GiB left").
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from rljob_operator import errors
from rljob_operator.estimator import devices, geometry

GIB = 1 << 30
#: CUDA context + NCCL buckets + allocator fragmentation on a training rank.
TRAINER_RUNTIME_BYTES = 3 * GIB
#: A CPU trainer rank (gloo, tests and the local demo): Python + allocator slack.
CPU_TRAINER_RUNTIME_BYTES = 256 * (1 << 20)
#: What a vLLM engine in sleep mode (level 1) keeps resident: CUDA context and graph pools.
SLEEPING_ENGINE_BYTES = 1 * GIB


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def lora_params(model: geometry.ModelGeometry, rank: int) -> int:
    """Adapter parameters for rank ``rank`` on q/k/v/o and the MLP projections of every layer."""
    h = model.hidden_size
    attn_in_out = (
        (h + model.num_attention_heads * model.head_dim)
        + 2 * (h + model.num_key_value_heads * model.head_dim)
        + (model.num_attention_heads * model.head_dim + h)
    )
    mlp_in_out = 3 * (h + model.intermediate_size) if model.intermediate_size else 0
    return rank * (model.num_attention_layers * attn_in_out + model.num_mlp_layers * mlp_in_out)


class TrainerMemory(BaseModel):
    """Bytes on one trainer accelerator, by component."""

    model_config = ConfigDict(frozen=True)

    accelerators: int
    sharded_state_bytes: int = Field(
        description="fp32 master weights + fp32 grads + AdamW state (LoRA: and the frozen base; with KL "
        "under full fine-tuning: and the reference), sharded over the ranks."
    )
    gathered_weight_bytes: int = Field(
        description="Unsharded compute copies in the model dtype during forward/backward (two layers, the "
        "root's embeddings/head) and one layer's gradient in the model dtype and in fp32."
    )
    activation_bytes: int
    runtime_bytes: int
    total_bytes: int
    trainable_params: int


def trainer_memory(
    model: geometry.ModelGeometry,
    accelerators: int,
    *,
    micro_batch_tokens: int,
    lora: bool = False,
    lora_rank: int = 64,
    sleeping_engine: bool = False,
    device: devices.DeviceSpec | None = None,
    reference: bool = False,
) -> TrainerMemory:
    """Per-accelerator memory of an FSDP2 mixed-precision update over ``accelerators`` ranks
    (``reference``: a frozen full copy for the KL penalty, as full fine-tuning with klCoef > 0 holds)."""
    if accelerators < 1:
        raise errors.InvalidPlanRequestError("trainer_accelerators", "must be at least 1")
    elem = geometry.dtype_bytes(model.dtype, "dtype")
    params = model.total_params
    if lora:
        trainable = lora_params(model, lora_rank)
        sharded = _ceil_div(params * elem + 16 * trainable, accelerators)
    else:
        trainable = params
        sharded = _ceil_div(16 * params + (params * elem if reference else 0), accelerators)
    block = model.layer_params(active=False) // model.num_hidden_layers
    gathered = (2 * block + model.embedding_params()) * elem + block * (elem + 4)
    h, tokens = model.hidden_size, micro_batch_tokens
    boundaries = model.num_hidden_layers * tokens * h * elem
    mlp_width = model.intermediate_size
    if model.moe is not None:
        mlp_width = max(mlp_width, model.moe.experts_per_token * model.moe.expert_intermediate_size)
    one_layer = tokens * elem * (16 * h + 4 * mlp_width)
    logits = tokens * model.vocab_size * (4 + 4)
    activation = boundaries + one_layer + logits
    if device is not None and device.runtime_overhead_bytes is not None:
        runtime = device.runtime_overhead_bytes
    elif device is not None and device.is_cpu:
        runtime = CPU_TRAINER_RUNTIME_BYTES  # no CUDA context, NCCL or sleeping-engine residue
    else:
        runtime = TRAINER_RUNTIME_BYTES + (SLEEPING_ENGINE_BYTES if sleeping_engine else 0)
    return TrainerMemory(
        accelerators=accelerators,
        sharded_state_bytes=sharded,
        gathered_weight_bytes=gathered,
        activation_bytes=activation,
        runtime_bytes=runtime,
        total_bytes=sharded + gathered + activation + runtime,
        trainable_params=trainable,
    )


def min_trainer_accelerators(
    model: geometry.ModelGeometry,
    device: devices.DeviceSpec,
    *,
    max_accelerators: int,
    micro_batch_tokens: int,
    memory_fraction: float = 0.95,
    lora: bool = False,
    lora_rank: int = 64,
    sleeping_engine: bool = False,
    reference: bool = False,
) -> tuple[TrainerMemory, str]:
    """Smallest FSDP size up to ``max_accelerators`` whose per-rank memory fits ``device``."""
    if max_accelerators < 1:
        raise errors.ModelDoesNotFitError(
            "total_accelerators",
            "no accelerators left for the trainer",
        )
    budget = int(device.memory_bytes * memory_fraction)
    last = trainer_memory(
        model,
        max_accelerators,
        micro_batch_tokens=micro_batch_tokens,
        lora=lora,
        lora_rank=lora_rank,
        sleeping_engine=sleeping_engine,
        reference=reference,
    )
    for n in range(1, max_accelerators + 1):
        mem = trainer_memory(
            model,
            n,
            micro_batch_tokens=micro_batch_tokens,
            lora=lora,
            lora_rank=lora_rank,
            sleeping_engine=sleeping_engine,
            device=device,
            reference=reference,
        )
        last = mem
        if mem.total_bytes <= budget:
            kind = f"LoRA r={lora_rank}" if lora else "full fine-tuning"
            held = (
                f"fp32 adapters + {model.dtype} frozen base"
                if lora
                else "fp32 masters, grads and AdamW state"
                + (f" + {model.dtype} KL reference" if reference else "")
            )
            return mem, (
                f"trainer needs >= {n} accelerator(s): FSDP2 {kind}, mixed precision ({held}, sharded; "
                f"compute in {model.dtype}) {mem.total_bytes / GIB:.1f} GiB/rank "
                f"(state {mem.sharded_state_bytes / GIB:.1f} + "
                f"{model.dtype} compute copies {mem.gathered_weight_bytes / GIB:.1f} + "
                f"activations at {micro_batch_tokens} tokens {mem.activation_bytes / GIB:.1f} + runtime "
                f"{mem.runtime_bytes / GIB:.1f}) <= {budget / GIB:.1f} GiB"
            )
    raise errors.ModelDoesNotFitError(
        "micro_batch_tokens",
        f"the trainer does not fit {max_accelerators} x {device.name}: {last.total_bytes / GIB:.1f} GiB/rank "
        f"(activations {last.activation_bytes / GIB:.1f} GiB at {micro_batch_tokens} tokens) "
        f"> {budget / GIB:.1f} GiB; "
        "lower micro_batch_tokens, use LoRA or add accelerators",
    )

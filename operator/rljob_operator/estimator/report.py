"""Render a :class:`ResourcePlan` for people (a table) and for machines (camelCase JSON).

Role: the presentation layer of ``rljob plan`` (``-o table`` default, ``-o json``) and of the
operator's status/event text. Callers: ``rljob_operator.cli.commands`` and ``handlers``.
"""

from __future__ import annotations

from typing import Any

from rljob_operator.estimator import planner

GIB = 1 << 30
KIB = 1 << 10


def plan_to_json(plan: planner.ResourcePlan) -> dict[str, Any]:
    """The plan as a JSON-ready dict with the contract's camelCase keys (``kvBytesPerToken`` ...)."""
    data: dict[str, Any] = plan.model_dump(mode="json", by_alias=True)
    return data


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def format_plan_table(plan: planner.ResourcePlan) -> str:
    """A three-column table (quantity, value, how it was derived) followed by the reasons."""
    p = plan
    rows: list[tuple[str, str, str]] = [
        ("mode", p.mode, "static: counts from the spec; estimate: balanced split; adaptive: + sleeping/idle"),
        ("accelerator", f"{p.accelerator} ({p.resource_name})", "device catalog entry"),
        (
            "model",
            f"{p.model_type}, {p.total_params / 1e9:.2f}B ({p.active_params / 1e9:.2f}B active)",
            "parameters from config.json (MoE: experts per token)",
        ),
        (
            "layers",
            f"{p.num_full_attention_layers} full / {p.num_sliding_window_layers} sliding / "
            f"{p.num_linear_attention_layers} linear",
            "only full-attention KV grows with every token",
        ),
        ("head_dim", str(p.head_dim), "config head_dim, else hidden_size / num_attention_heads"),
        (
            "kvBytesPerToken",
            f"{p.kv_bytes_per_token} B ({p.kv_bytes_per_token / KIB:.1f} KiB)",
            f"per accelerator at TP {p.tensor_parallel}: "
            "layers x 2 x max(1, kv_heads // tp) x head_dim x dtype",
        ),
        (
            "stateBytesPerSequence",
            f"{p.state_bytes_per_sequence} B ({p.state_bytes_per_sequence / (1 << 20):.1f} MiB)",
            "linear-attention conv + SSM state per sequence, per accelerator",
        ),
        (
            "blockSizeTokens",
            str(p.block_size_tokens),
            "vLLM block (raised for hybrid models to fit the state page)",
        ),
        (
            "weightBytesPerRank",
            _gib(p.weight_bytes_per_rank),
            "weights split over TP (replicated KV heads kept)",
        ),
        (
            "activationBytes",
            _gib(p.activation_bytes),
            f"profile-run peak for a {p.max_num_batched_tokens}-token prefill",
        ),
        (
            "runtimeOverheadBytes",
            _gib(p.runtime_overhead_bytes),
            "CUDA context, NCCL, CUDA graphs (allowance)",
        ),
        ("kvCacheBytes", _gib(p.kv_cache_bytes), "memory x gpu_memory_utilization - the three rows above"),
        ("kvCacheBlocks", str(p.kv_cache_blocks), "kvCacheBytes // (layers per group x page bytes)"),
        (
            "kvCacheTokens",
            f"{p.kv_cache_tokens:,}",
            f"what vLLM logs as 'GPU KV cache size' at max_model_len {p.max_model_len}",
        ),
        ("maxNumSeqs", str(p.max_num_seqs), "full-length rollout sequences that fit the blocks"),
        (
            "maxNumBatchedTokens",
            str(p.max_num_batched_tokens),
            "one prefill: <= max_model_len and KV, >= maxNumSeqs",
        ),
        ("tensorParallel", str(p.tensor_parallel), "smallest TP that fits weights and a useful batch"),
        (
            "trainerAccelerators",
            str(p.trainer_accelerators),
            f"FSDP2 needs {_gib(p.trainer_bytes_per_accelerator)} each",
        ),
        ("rolloutAccelerators", str(p.rollout_accelerators), "dedicated engines x tensor parallel"),
        ("rolloutEngines", str(p.rollout_engines), "dedicated vLLM engines"),
        ("sharedEngines", str(p.shared_engines), "engines asleep on trainer accelerators"),
        (
            "memoryOrder",
            "engines first" if p.shared_engines else "-",
            "shared engines reserve gpu_memory_utilization x memory while it is free, then sleep; "
            "the ranks then load model, optimizer and reference (sharded)",
        ),
        ("idleAccelerators", str(p.idle_accelerators), "free for extra engines (adaptive scale-up)"),
        ("generationTimeS", f"{p.generation_time_s:.1f} s", "one step's generation (bandwidth-bound decode)"),
        ("trainingTimeS", f"{p.training_time_s:.1f} s", "one step's update (compute-bound at MFU)"),
        ("stepTimeS", f"{p.step_time_s:.1f} s", "max of the two when pipelined, sum when colocated"),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{'QUANTITY'.ljust(w0)}  {'VALUE'.ljust(w1)}  HOW", "-" * (w0 + w1 + 40)]
    lines += [f"{a.ljust(w0)}  {b.ljust(w1)}  {c}" for a, b, c in rows]
    lines.append("")
    lines.append("Reasons:")
    lines += [f"  - {r}" for r in p.reasons]
    return "\n".join(lines)

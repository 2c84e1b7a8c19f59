"""Render a :class:`ResourcePlan` for people (a table) and for machines (camelCase JSON).

Role: the presentation layer of ``rljob plan`` (``-o table`` default, ``-o json``), of ``rljob plan
--from-job`` (the plan beside the job's measurements: ``format_refit_table``) and of the operator's
status/event text. Callers: ``rljob_operator.cli.commands`` and ``handlers``.
"""

from __future__ import annotations

from typing import Any

from rljob_operator.estimator import planner, refit

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
            "the engine's processes on CPU (measured)"
            if p.resource_name == "cpu"
            else "CUDA context, NCCL, CUDA graphs (allowance)",
        ),
        (
            "kvCacheBytes",
            _gib(p.kv_cache_bytes),
            "memory x gpu_memory_utilization - the three rows above"
            + (" (CPU: at most what maxNumSeqs sequences need)" if p.resource_name == "cpu" else ""),
        ),
        (
            "cpuKvCacheBytes",
            _gib(p.cpu_kv_cache_bytes),
            "vLLM's kv_cache_memory_bytes where the engine runs on CPU"
            + (
                ": kvCacheBytes"
                if p.resource_name == "cpu"
                else ": maxNumSeqs sequences in CPU blocks (a CPU run of this engine)"
            ),
        ),
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


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def format_refit_table(original: planner.ResourcePlan, fit: refit.Refit) -> str:
    """The plan beside what the job measured: rates (planned, measured, measured/planned), the step
    time predicted against the measured one, and the plan the estimator makes with the measured
    rates beside the original."""
    rates = [
        ("decode tokens/s per engine", fit.decode_tokens_per_s_per_engine),
        ("prefill tokens/s per engine", fit.prefill_tokens_per_s_per_engine),
        ("training tokens/s", fit.training_tokens_per_s),
    ]
    lines = [
        f"Measured over steps {fit.from_step}-{fit.to_step} ({fit.reports} SyncReports, "
        f"{fit.engines} engine(s); "
        f"mean prompt {fit.mean_prompt_tokens}, mean completion {fit.mean_completion_tokens} tokens)",
        "",
        f"{'RATE':30}  {'PLANNED':>12}  {'MEASURED':>12}  MEASURED/PLANNED",
    ]
    for name, rate in rates:
        ratio = rate.measured_over_planned
        lines.append(
            f"{name:30}  {_rate(rate.planned):>12}  {_rate(rate.measured):>12}  "
            f"{'-' if ratio is None else f'{ratio:.2f}'}"
        )
    if not fit.split_measured:
        lines.append("  (the engines did not time prefill and decode apart: one scale fits both)")
    lines += [
        "",
        f"step time: predicted {fit.predicted_step_s:.2f} s, measured {fit.measured_step_s:.2f} s, "
        f"predicted/measured {fit.step_time_ratio:.2f} (the refitted model: {fit.refit_step_s:.2f} s at "
        f"{fit.engines} engine(s))",
        f"scales (measured / modelled time): decode {fit.decode_scale:.2f}, prefill {fit.prefill_scale:.2f}, "
        f"training {fit.training_scale:.2f}",
        "",
        f"{'PLAN':24}  {'ORIGINAL':>10}  {'MEASURED RATES':>14}",
    ]
    p = fit.plan
    for name, a, b in [
        ("trainerAccelerators", original.trainer_accelerators, p.trainer_accelerators),
        ("rolloutEngines", original.rollout_engines, p.rollout_engines),
        ("sharedEngines", original.shared_engines, p.shared_engines),
        ("idleAccelerators", original.idle_accelerators, p.idle_accelerators),
        ("generationTimeS", f"{original.generation_time_s:.1f}", f"{p.generation_time_s:.1f}"),
        ("trainingTimeS", f"{original.training_time_s:.1f}", f"{p.training_time_s:.1f}"),
        ("stepTimeS", f"{original.step_time_s:.1f}", f"{p.step_time_s:.1f}"),
    ]:
        lines.append(f"{name:24}  {a!s:>10}  {b!s:>14}")
    return "\n".join(lines)


def refit_to_json(original: planner.ResourcePlan, fit: refit.Refit) -> dict[str, Any]:
    """``rljob plan --from-job -o json``: the original plan, the refit (camelCase) and its plan."""
    data = fit.model_dump(mode="json", by_alias=True, exclude={"plan"})
    data["stepTimeRatio"] = fit.step_time_ratio
    return {"plan": plan_to_json(original), "refit": data, "refitPlan": plan_to_json(fit.plan)}

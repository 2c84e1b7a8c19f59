"""Benchmark: time ``plan_resources`` for every shipped preset (it runs in every reconcile).

Usage: ``python bench/estimator.py [--repeat N] [--json]``. Prints, per preset and mode, the median
and p99 wall time of one plan plus the headline numbers, so a regression in either speed or
result is visible. Uses ``time.perf_counter`` here, in the shell; the planner itself stays pure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from rljob_operator.estimator import PlanRequest, load_preset, plan_resources, preset_names

MODES = ("static", "estimate", "adaptive")


def _request(preset: str, mode: str) -> PlanRequest:
    static = {"trainer_accelerators": 4, "rollout_accelerators": 4} if mode == "static" else {}
    return PlanRequest(
        hf_config=load_preset(preset),
        accelerator="H100-80GB",
        total_accelerators=8,
        mode=mode,
        max_prompt_tokens=1024,
        max_completion_tokens=8192,
        max_model_len=12288,
        prompts_per_step=64,
        group_size=8,
        lora=True,
        micro_batch_tokens=8192,
        **static,
    )


def run(repeat: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for preset in preset_names():
        for mode in MODES:
            request = _request(preset, mode)
            plan = plan_resources(request)  # warm-up (imports, pydantic schema caches)
            times_ms: list[float] = []
            for _ in range(repeat):
                start = time.perf_counter()
                plan = plan_resources(request)
                times_ms.append((time.perf_counter() - start) * 1e3)
            times_ms.sort()
            rows.append(
                {
                    "preset": preset,
                    "mode": mode,
                    "medianMs": round(statistics.median(times_ms), 3),
                    "p99Ms": round(times_ms[min(len(times_ms) - 1, int(0.99 * len(times_ms)))], 3),
                    "tensorParallel": plan.tensor_parallel,
                    "trainerAccelerators": plan.trainer_accelerators,
                    "rolloutEngines": plan.rollout_engines,
                    "sharedEngines": plan.shared_engines,
                    "kvCacheTokens": plan.kv_cache_tokens,
                    "maxNumSeqs": plan.max_num_seqs,
                    "maxNumBatchedTokens": plan.max_num_batched_tokens,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=50, help="timed plans per preset and mode")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = parser.parse_args()
    rows = run(args.repeat)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    header = (
        "preset",
        "mode",
        "medianMs",
        "p99Ms",
        "tensorParallel",
        "trainerAccelerators",
        "rolloutEngines",
        "sharedEngines",
        "kvCacheTokens",
        "maxNumSeqs",
        "maxNumBatchedTokens",
    )
    widths = [max(len(h), *(len(str(r[h])) for r in rows)) for h in header]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r[h]).ljust(w) for h, w in zip(header, widths, strict=True)))


if __name__ == "__main__":
    main()

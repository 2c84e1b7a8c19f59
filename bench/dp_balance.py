"""Benchmark for the DP-balance planner (issue 6).

Part 1 (simulated): suites of GRPO-like batch lengths (seeded), several DP sizes, batch sizes and
micro-batch layouts. For each batch: the slowest rank's simulated cost over `lower_bound` for the
original order, equal-size Karmarkar–Karp, snake and our plan; planning time.
Part 2 (measured): a training step on two CPU ranks (gloo) with a tiny Qwen2 built in code, balance
off vs on, alternated in one run; the ratio of median step times.

Run: `.venv/bin/python bench/dp_balance.py [--json] [--no-e2e]`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import statistics
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob_trainer import dp_balance
from rljob_trainer.dp_balance import CostModel, MicroBatchSpec
from rljob_trainer.train import microbatch

# Qwen3-4B-like geometry: the default cost model's shape for a realistic trainer.
COST = CostModel.from_hidden_size(2560, intermediate_size=9728)


@dataclass(frozen=True)
class Suite:
    name: str
    prompt_tokens: tuple[int, int]  # uniform range per prompt (shared by its group)
    response_median: float  # lognormal body
    response_sigma: float
    max_response_tokens: int  # the completion cap
    truncation_rate: float  # spike at the cap (responses that hit it)


SUITES = [
    # GSM8K: ~100–160 prompt tokens, short answers, total mostly ~230–320, a few hit the cap.
    Suite("gsm8k", (90, 160), 150.0, 0.35, 512, 0.03),
    # Competition math without thinking: long tail, more truncation.
    Suite("math", (120, 260), 700.0, 0.6, 2048, 0.10),
    # Thinking-style: thousands of tokens, a large spike at the cap.
    Suite("thinking", (150, 400), 3000.0, 0.55, 8192, 0.25),
]
GROUP_SIZE = 8  # GRPO responses per prompt


def sample_lengths(suite: Suite, batch_size: int, rng: random.Random) -> list[int]:
    """prompt + response tokens for `batch_size` samples in rollout order (groups contiguous)."""
    lengths: list[int] = []
    while len(lengths) < batch_size:
        prompt = rng.randint(*suite.prompt_tokens)
        # Prompt difficulty shifts the group's response lengths (rollout order is correlated).
        scale = math.exp(rng.gauss(0.0, 0.25))
        for _ in range(GROUP_SIZE):
            if rng.random() < suite.truncation_rate:
                response = suite.max_response_tokens
            else:
                body = rng.lognormvariate(math.log(suite.response_median * scale), suite.response_sigma)
                response = max(8, min(suite.max_response_tokens, int(body)))
            lengths.append(prompt + response)
    return lengths[:batch_size]


def layouts(suite: Suite) -> dict[str, MicroBatchSpec]:
    cap = 4 * (suite.prompt_tokens[1] + suite.max_response_tokens)
    return {
        "packed/fixed": MicroBatchSpec(packed=True, dynamic=False, micro_batch_size=4),
        "padded/fixed": MicroBatchSpec(packed=False, dynamic=False, micro_batch_size=4),
        "packed/dynamic": MicroBatchSpec(packed=True, dynamic=True, max_tokens_per_micro_batch=cap),
        "padded/dynamic": MicroBatchSpec(packed=False, dynamic=True, max_tokens_per_micro_batch=cap),
    }


def run_simulated(seeds: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for suite in SUITES:
        for layout, spec in layouts(suite).items():
            ratios: dict[str, list[float]] = {"original": [], "kk": [], "snake": [], "ours": []}
            plan_ms: list[float] = []
            better_than_kk = worse_than_kk = worse_than_original = batches = 0
            for dp in (2, 4, 8):
                for batch_size in (64, 256, 512):
                    for seed in range(seeds):
                        rng = random.Random(zlib.crc32(f"{suite.name}/{dp}/{batch_size}/{seed}".encode()))
                        lengths = sample_lengths(suite, batch_size, rng)
                        bound = dp_balance.lower_bound(lengths, dp, micro_batch=spec, cost=COST)
                        weights = [COST.sample_cost(x) for x in lengths]

                        def slowest(
                            perm: list[int] | tuple[int, ...],
                            lengths: list[int] = lengths,
                            dp: int = dp,
                            spec: MicroBatchSpec = spec,
                        ) -> float:
                            return max(dp_balance.simulate_rank_costs(lengths, perm, dp, spec, COST))

                        kk = [i for g in dp_balance.karmarkar_karp_equal_size(weights, dp) for i in g]
                        snake = [i for g in dp_balance.snake_order(lengths, dp) for i in g]
                        started = time.perf_counter()
                        plan = dp_balance.plan_dp_balance(lengths, dp, micro_batch=spec, cost=COST)
                        plan_ms.append((time.perf_counter() - started) * 1000.0)
                        original, kk_cost, ours = (
                            max(plan.original_rank_costs),
                            slowest(kk),
                            max(plan.rank_costs),
                        )
                        ratios["original"].append(original / bound)
                        ratios["kk"].append(kk_cost / bound)
                        ratios["snake"].append(slowest(snake) / bound)
                        ratios["ours"].append(ours / bound)
                        batches += 1
                        better_than_kk += ours < kk_cost * (1 - 1e-9)
                        worse_than_kk += ours > kk_cost * (1 + 1e-9)
                        worse_than_original += ours > original * (1 + 1e-9)
            rows.append(
                {
                    "suite": suite.name,
                    "layout": layout,
                    "batches": batches,
                    **{f"{k}_mean": statistics.fmean(v) for k, v in ratios.items()},
                    "ours_max": max(ratios["ours"]),
                    "better_than_kk": better_than_kk,
                    "worse_than_kk": worse_than_kk,
                    "worse_than_original": worse_than_original,
                    "plan_ms_mean": statistics.fmean(plan_ms),
                    "plan_ms_max": max(plan_ms),
                }
            )
    return rows


# ---------------------------------------------------------------------------------------------------
# Part 2: a measured training step on two gloo ranks.

E2E_WORLD = 2
E2E_SPEC = MicroBatchSpec(packed=True, dynamic=True, max_tokens_per_micro_batch=1024)


def _e2e_lengths() -> list[int]:
    # Thinking-style shape scaled to CPU: rollout order puts the long (truncated) groups together.
    rng = random.Random(7)
    suite = Suite("cpu", (16, 48), 120.0, 0.6, 448, 0.25)
    return sample_lengths(suite, 32, rng)


def _e2e_worker(rank: int, port: int, out_dir: str, repeats: int) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    from rljob_trainer.train import algos, packing

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=E2E_WORLD)
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    model = transformers.Qwen2ForCausalLM(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    lengths = _e2e_lengths()
    gen = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, 512, (n,), generator=gen) for n in lengths]
    advantages = torch.randn(len(lengths), generator=gen)
    plan = dp_balance.plan_dp_balance(
        lengths, E2E_WORLD, micro_batch=E2E_SPEC, cost=CostModel.from_hidden_size(128, intermediate_size=256)
    )
    m = len(lengths) // E2E_WORLD

    def step(order: list[int]) -> float:
        dist.barrier()
        started = time.perf_counter()
        mine = order[rank * m : (rank + 1) * m]
        per_rank = [[lengths[i] for i in order[r * m : (r + 1) * m]] for r in range(E2E_WORLD)]
        k = microbatch.max_micro_batch_count(per_rank, E2E_SPEC)
        optimizer.zero_grad()
        for mb in microbatch.plan_micro_batches([lengths[i] for i in mine], E2E_SPEC, k):
            idx = [mine[j] for j in mb]
            lps = packing.packed_token_log_probs(model, packing.pack_sequences([samples[i] for i in idx]))
            logp = torch.cat(lps)  # on-policy: ratio 1, the registered GRPO loss and aggregation
            adv = torch.cat(
                [torch.full((len(lp),), float(advantages[i])) for lp, i in zip(lps, idx, strict=True)]
            )
            seq_ids = torch.cat([torch.full((len(lp),), n, dtype=torch.long) for n, lp in enumerate(lps)])
            per_tok, _ = algos.clipped_policy_loss(logp, logp.detach(), adv, clip_low=0.2, clip_high=0.2)
            algos.aggregate_loss(
                per_tok,
                torch.ones_like(logp),
                seq_ids,
                mode="seq-mean-token-mean",
                global_num_seqs=len(lengths),
                global_num_tokens=max(1, len(logp)),
            ).backward()
        for p in model.parameters():  # the gradient sync every rank waits on
            dist.all_reduce(p.grad)
        optimizer.step()
        return time.perf_counter() - started  # ends when the slowest rank's all-reduce completes

    identity = list(range(len(lengths)))
    step(identity)  # warm-up
    step(list(plan.permutation))
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(repeats):  # alternate so drift in machine load hits both equally
        times["off"].append(step(identity))
        times["on"].append(step(list(plan.permutation)))
    if rank == 0:
        Path(out_dir, "e2e.json").write_text(
            json.dumps({"times": times, "metrics": plan.metrics, "lengths": lengths})
        )
    dist.destroy_process_group()


def run_e2e(repeats: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_e2e_worker, args=(port, out_dir, repeats), nprocs=E2E_WORLD, join=True)
        result = json.loads(Path(out_dir, "e2e.json").read_text())
    off = statistics.median(result["times"]["off"])
    on = statistics.median(result["times"]["on"])
    metrics = result["metrics"]
    return {
        "step_s_off_median": off,
        "step_s_on_median": on,
        "speedup": off / on,
        "estimated_speedup": metrics["dp_balance/estimated_speedup"],
        "strategy": metrics["dp_balance/strategy_name"],
        "repeats": repeats,
        "batch_tokens": sum(result["lengths"]),
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'suite':9} {'layout':15} {'n':>4} {'orig/LB':>8} {'KK/LB':>8} {'snake/LB':>9} {'ours/LB':>8} "
        f"{'ours max':>8} {'<KK':>5} {'>KK':>4} {'>orig':>5} {'ms mean':>8} {'ms max':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['suite']:9} {r['layout']:15} {r['batches']:>4} {r['original_mean']:>8.4f} "
            f"{r['kk_mean']:>8.4f} {r['snake_mean']:>9.4f} {r['ours_mean']:>8.4f} {r['ours_max']:>8.4f} "
            f"{r['better_than_kk']:>5} {r['worse_than_kk']:>4} {r['worse_than_original']:>5} "
            f"{r['plan_ms_mean']:>8.2f} {r['plan_ms_max']:>7.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--seeds", type=int, default=3, help="batches per (suite, layout, DP, batch size)")
    parser.add_argument("--no-e2e", action="store_true", help="skip the measured two-rank step")
    parser.add_argument("--repeats", type=int, default=7, help="alternated off/on steps in the e2e part")
    args = parser.parse_args(argv)
    rows = run_simulated(args.seeds)
    e2e = None if args.no_e2e else run_e2e(args.repeats)
    if args.json:
        print(json.dumps({"simulated": rows, "e2e": e2e}, indent=2))
        return 0
    print("Slowest rank's simulated cost / lower bound (mean over DP 2,4,8 × batch 64,256,512 × seeds)")
    print(
        "<KK / >KK / >orig: batches where ours is strictly better than KK / worse than KK / worse than "
        "original"
    )
    print_table(rows)
    if e2e:
        print(
            f"\nMeasured step on 2 CPU gloo ranks (tiny Qwen2, {e2e['batch_tokens']} tokens, packed dynamic, "
            f"median of {e2e['repeats']}): off {e2e['step_s_off_median'] * 1000:.0f} ms, "
            f"on {e2e['step_s_on_median'] * 1000:.0f} ms, speedup {e2e['speedup']:.3f}x "
            f"(cost model predicted {e2e['estimated_speedup']:.3f}x, strategy {e2e['strategy']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

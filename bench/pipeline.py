"""Pipeline benchmark: steps per hour of the synchronous loop vs `maxStaleness: 1`, side by side.

Role: measures what overlapping generation with training buys. Each run is the real trainer entry
point, `python -m rljob_trainer`, on a private local Ray node: one training rank (one torch thread)
and one dedicated transformers engine (one torch thread) as Ray actors in their own processes,
weights over the engine's gloo group. A tiny Qwen2 built from a config (random weights, nothing
downloaded) on the toy arithmetic task.

Generation and training are first balanced: short synchronous calibration runs in local mode (response
caps of 16 and 96 tokens, then one at the secant estimate of where generation time equals training
time) set the response cap where both take about as long (the regime where one-step-off overlap
pays most: perfect overlap gives 2x). The model is deep and thin (8 layers of width 64): a decode
step pays per-layer overhead for every token while training pays per-token arithmetic, so
generation can catch up with training at some cap (with 4 wide layers training was 2.6x slower at
any cap). Then the synchronous run (maxStaleness 0) and the asynchronous run (maxStaleness 1, truncated IS)
use that config. Steps/hour is over every step after the first (sum of the driver's step times:
waiting for rollouts, training and the weight sync), so start-up is not counted.

Overlap needs two free cores: the engine and the training rank each run one thread. On a shared
machine (other jobs, hypervisor steal) the cores the bench really gets can be fewer, and then
no pipeline can reach 2x. So the bench measures that too, before the sync run and after the async
run: `parallel capacity` is how much more one-thread work two processes get done side by side than
one alone (2.0: two free cores, 1.0: one). The ratio is meaningful against it (printed with it).

Run: `.venv/bin/python bench/pipeline.py [--quick] [--json]`. The last line is exactly
`pipeline: sync X steps/h, async Y steps/h, ratio R, staleness max K`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "trainer_image"))

from rljob_trainer import config, modeling  # noqa: E402


def make_config(
    *, steps: int, response_tokens: int, max_staleness: int, launcher: str = "ray"
) -> config.TrainerConfig:
    grpo: dict[str, Any] = {
        "groupSize": 8,
        "promptsPerStep": 6,
        "maxSteps": steps,
        "learningRate": 1e-3,
        "seed": 3,
        "maxStaleness": max_staleness,
    }
    if max_staleness > 0:
        grpo.update(policyLoss="clipped-tis", tisCap=2.0)
    return config.parse_config(
        {
            "model": {
                "name": "tiny-qwen2-bench",
                "source": "tiny",
                "hfConfig": modeling.tiny_hf_config(
                    32, hidden_size=64, num_hidden_layers=8, intermediate_size=128, num_attention_heads=4
                ),
                "dtype": "float32",
                "tokenizer": "builtin-digits",
                "finetune": "full",
            },
            "lengths": {"maxPromptTokens": 8, "maxResponseTokens": response_tokens},
            "grpo": grpo,
            "batching": {"packed": True, "dynamic": True, "maxTokensPerMicroBatch": 4096},
            "rollout": {
                "kind": "transformers",
                "sharedEngines": 0,
                "dedicatedEngines": 1,
                "maxDedicatedEngines": 1,
                "engineNumCpus": 1,
            },
            "data": {"builtin": "toy-arithmetic"},
            "rewards": [{"name": "mathAccuracy"}],
            "telemetry": {"enabled": False, "prometheusPort": None},
            "distributed": {
                "numTrainerRanks": 1,
                "launcher": launcher,
                "torchThreadsPerRank": 1,
                "rankNumCpus": 1,
            },
            "export": {"final": False, "everyCheckpoint": False},
        }
    )


def run(cfg: config.TrainerConfig, workdir: Path, name: str) -> list[dict[str, Any]]:
    """One `python -m rljob_trainer` run; its per-step metrics rows."""
    path = workdir / f"{name}.json"
    path.write_text(config.dump_config(cfg))
    metrics = workdir / f"{name}.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLJOB_")}
    env["PYTHONPATH"] = str(REPO / "trainer_image")
    env["OMP_NUM_THREADS"] = "1"
    for attempt in range(3):
        metrics.unlink(missing_ok=True)
        proc = subprocess.run(
            [sys.executable, "-m", "rljob_trainer", "--config", str(path), "--metrics-jsonl", str(metrics)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        # A loaded machine can miss Ray's fixed 30 s raylet start wait: start that run again.
        if proc.returncode == 0 or "timed out during startup" not in proc.stderr or attempt == 2:
            break
    if proc.returncode != 0:
        raise SystemExit(f"{name} run failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


PROBE_TOKENS = (16, 96)
MIN_TOKENS, MAX_TOKENS = 2, 192


def balanced_tokens(probes: dict[int, tuple[float, float]]) -> int:
    """The response cap where generation takes as long as training: the secant of gap = generation -
    training through the narrowest pair of neighbouring probes where its sign changes (else the two
    probes nearest zero).
    Generation grows with the longest response, training with the mean one (responses stop at EOS),
    so neither time is linear in the cap: a refinement probe at this estimate, then the secant
    again, lands close."""
    gaps = sorted((t, g - r) for t, (g, r) in probes.items())
    brackets = [(a, b) for a, b in itertools.pairwise(gaps) if (a[1] < 0) != (b[1] < 0)]
    if brackets:  # the sign changes between neighbouring caps: the narrowest such pair
        (t1, d1), (t2, d2) = min(brackets, key=lambda ab: ab[1][0] - ab[0][0])
    else:
        (t1, d1), (t2, d2) = sorted(gaps, key=lambda p: abs(p[1]))[:2]
    if d1 == d2:
        return MAX_TOKENS if d1 < 0 else MIN_TOKENS
    estimate = t1 - d1 * (t2 - t1) / (d2 - d1)
    return max(MIN_TOKENS, min(MAX_TOKENS, round(estimate)))


CAPACITY_PROBE = """
import time, torch
torch.set_num_threads(1)
a = torch.randn(96, 96)
started = time.perf_counter()
for _ in range(ROUNDS):
    a = torch.tanh(a @ a)
print(time.perf_counter() - started)
"""


def parallel_capacity(rounds: int = 12000) -> float:
    """Work done per second by two one-thread processes side by side over one alone (1.0 to 2.0)."""

    def spawn() -> subprocess.Popen[str]:
        code = CAPACITY_PROBE.replace("ROUNDS", str(rounds))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)

    def walls(procs: list[subprocess.Popen[str]]) -> list[float]:
        return [float(p.communicate()[0]) for p in procs]

    (before,) = walls([spawn()])
    together = walls([spawn(), spawn()])
    (after,) = walls([spawn()])
    return 2 * (before + after) / 2 / max(together)


def steps_per_hour(rows: list[dict[str, Any]]) -> float:
    timed = rows[1:]  # the first step pays for warm-up
    return 3600.0 * len(timed) / sum(r["step_s"] for r in timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="about 3 minutes on 2 cores")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 8 quick, 20 full)")
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = p.parse_args()
    steps = args.steps or (8 if args.quick else 20)
    with tempfile.TemporaryDirectory(prefix="rljob-bench-pipeline-") as tmp:
        work = Path(tmp)
        probes: dict[int, tuple[float, float]] = {}

        def probe(tokens: int) -> None:
            # Local mode (rank and engine in this one process, still one thread each) times generation
            # and training as the Ray runs do, within noise, without their 25 s of Ray start-up.
            cfg = make_config(steps=3, response_tokens=tokens, max_staleness=0, launcher="local")
            rows = run(cfg, work, "calibrate")
            gen = sum(r["generation_s"] for r in rows[1:]) / len(rows[1:])
            train = sum(r["training_s"] for r in rows[1:]) / len(rows[1:])
            probes[tokens] = (gen, train)
            print(f"calibration: {tokens} tokens: generation {gen:.2f} s, training {train:.2f} s")

        for tokens in PROBE_TOKENS:
            probe(tokens)
        refine = balanced_tokens(probes)
        if refine not in probes:
            probe(refine)
        tokens = balanced_tokens(probes)
        print(f"calibration: generation and training balance at {tokens} response tokens")
        capacity = [parallel_capacity()]
        sync = run(make_config(steps=steps, response_tokens=tokens, max_staleness=0), work, "sync")
        async_ = run(make_config(steps=steps, response_tokens=tokens, max_staleness=1), work, "async")
        capacity.append(parallel_capacity())
    for name, rows in (("sync", sync), ("async", async_)):
        timed = rows[1:]
        print(
            f"{name}: step {sum(r['step_s'] for r in timed) / len(timed):.2f} s, generation "
            f"{sum(r['generation_s'] for r in timed) / len(timed):.2f} s, training "
            f"{sum(r['training_s'] for r in timed) / len(timed):.2f} s, trainer wait "
            f"{sum(r['trainer_wait_s'] for r in timed) / len(timed):.2f} s, weight sync "
            f"{sum(r['weight_sync_s'] for r in timed) / len(timed):.3f} s"
        )
    s, a = steps_per_hour(sync), steps_per_hour(async_)
    staleness = max(int(r["rollout/staleness_max"]) for r in async_)
    figures = {
        "sync_steps_per_h": s,
        "async_steps_per_h": a,
        "ratio": a / s,
        "staleness_max": staleness,
        "response_tokens": tokens,
        "generation_s": sum(r["generation_s"] for r in sync[1:]) / len(sync[1:]),
        "training_s": sum(r["training_s"] for r in sync[1:]) / len(sync[1:]),
        "is_weight_max": max(r["off_policy/is_weight_max"] for r in async_),
        "truncated_fraction_max": max(r["off_policy/truncated_fraction"] for r in async_),
        "parallel_capacity": capacity,
    }
    print(
        f"parallel capacity: {capacity[0]:.2f} before the sync run, {capacity[1]:.2f} after the async "
        "run (2.00: two free cores; the ratio cannot exceed it)"
    )
    if args.json:
        print(json.dumps(figures))
    print(
        f"pipeline: sync {s:.0f} steps/h, async {a:.0f} steps/h, ratio {a / s:.2f}, staleness max {staleness}"
    )


if __name__ == "__main__":
    main()

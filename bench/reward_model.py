"""Reward-model judge benchmark: does a reward model's judgement reach the policy, and what it costs.

Role: GRPO on the toy task (`data.builtin` toy-arithmetic: "a+b=" answered with one digit) through
the real driver (local mode, one rank, one dedicated engine), three ways on the same seeds:
- `exact`: the task's own reward (`mathAccuracy`), the ceiling;
- `reward model`: a judge of kind rewardModel, the tiny reward model trained on preference pairs
  of the task (`tests/integration/reward_model_toy.py`: built once, cached), its raw score the only
  reward term (`mathAccuracy` at weight 0, logged, not trained on);
- `untrained reward model`: a judge of the same shape with random weights (`source: tiny`): what a
  job learns from a judge that knows nothing, the floor.
Each prints the sampled accuracy (the share of right answers among the step's samples, the same
measure for all three) over the first and the last `--window` steps, the judge's seconds a step and
the step time. The last line is

    reward_model: accuracy F -> L exact, F -> L reward model, F -> L untrained; judge J s/step of S

```sh
.venv/bin/python bench/reward_model.py [--steps 400] [--window 40] [--engine transformers|vllm] [--json]
```
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))

import reward_model_toy  # noqa: E402  (the tests' toy reward model, built once and cached)
from trainer_configs import toy_config  # noqa: E402


def judge_spec(variant: str, folder: Path) -> dict[str, Any] | None:
    if variant == "exact":
        return None
    if variant == "reward model":
        model = reward_model_toy.model_settings(folder)
    else:  # the same architecture and tokenizer, random weights
        hf = json.loads((folder / "config.json").read_text())
        model = {
            "name": "untrained",
            "source": "tiny",
            "hfConfig": hf,
            "tokenizer": "builtin-char",
            "dtype": "float32",
        }
    return {
        "kind": "rewardModel",
        "model": model,
        "weight": 1.0,
        "batchSize": 128,
        "maxModelLen": 64,
        "maxNumSeqs": 128,
        "maxNumBatchedTokens": 4096,
        "cpuKvCacheBytes": 32 << 20,
    }


def run(variant: str, folder: Path, steps: int, engine: str, work: Path) -> list[dict[str, Any]]:
    """One job of `steps` steps; each step's metrics with its wall seconds."""
    from rljob_trainer import driver, runtimes

    judge = judge_spec(variant, folder)
    rollout: dict[str, Any] = {"kind": engine, "sharedEngines": 0, "dedicatedEngines": 1}
    if engine == "vllm":
        rollout.update(maxNumSeqs=128, maxNumBatchedTokens=1024, cpuKvCacheBytes=32 << 20)
    cfg = toy_config(
        distributed={"numTrainerRanks": 1, "launcher": "local"},
        rollout=rollout,
        grpo={"maxSteps": steps},
        rewards=[{"name": "mathAccuracy", "weight": 1.0 if judge is None else 0.0}],
        **({"judge": judge} if judge else {}),
    )
    d = driver.GRPODriver(cfg, runtimes.LocalRuntime(cfg), metrics_path=work / f"{variant}.jsonl")
    rows = []
    try:
        d.setup()
        for _ in range(steps):
            t0 = time.perf_counter()
            row = d.step()
            rows.append({**row, "wall_s": time.perf_counter() - t0})
    finally:
        d.shutdown()
    return rows


def summary(variant: str, rows: list[dict[str, Any]], window: int) -> dict[str, Any]:
    acc = [r["reward/mathAccuracy"] for r in rows]
    timed = rows[1:]  # the first step includes start-up
    return {
        "variant": variant,
        "accuracy_first": sum(acc[:window]) / window,
        "accuracy_last": sum(acc[-window:]) / window,
        "judge_s_per_step": sum(r.get("judge/seconds", 0.0) for r in timed) / len(timed),
        "step_s": sum(r["wall_s"] for r in timed) / len(timed),
        "judge_mean_score_last": sum(r.get("judge/mean_score", 0.0) for r in rows[-window:]) / window,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--window", type=int, default=40)
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    folder = reward_model_toy.build()
    trained = json.loads((folder / "recipe.json").read_text())
    print(
        f"reward_model: the toy reward model ranks {trained['pairs_ranked_right']} of {trained['pairs']} "
        "preference pairs right"
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="rljob-bench-reward-model-") as tmp:
        for variant in ("exact", "reward model", "untrained reward model"):
            s = summary(variant, run(variant, folder, args.steps, args.engine, Path(tmp)), args.window)
            results.append(s)
            print(
                f"reward_model: {variant}: accuracy {s['accuracy_first']:.3f} (steps 1-{args.window}) -> "
                f"{s['accuracy_last']:.3f} (last {args.window}); judge {s['judge_s_per_step']:.3f} s "
                f"of a {s['step_s']:.2f} s step",
                flush=True,
            )
    exact, rm, untrained = results
    print(
        f"reward_model: accuracy {exact['accuracy_first']:.2f} -> {exact['accuracy_last']:.2f} exact, "
        f"{rm['accuracy_first']:.2f} -> {rm['accuracy_last']:.2f} reward model, "
        f"{untrained['accuracy_first']:.2f} -> {untrained['accuracy_last']:.2f} untrained; "
        f"judge {rm['judge_s_per_step']:.3f} s/step of {rm['step_s']:.2f} ({args.engine} engines, "
        f"{args.steps} steps)"
    )
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Precision benchmark: what bf16 compute costs on CPU against fp32, and what the fused old log-probs
save, measured side by side in one run.

Role: the CPU path trains in the job's dtype (bf16 by default) with fp32 master weights
(`rljob_trainer.model.precision`), as a GPU run does; on a CPU bf16 matmuls are not faster than fp32 and the
mixed-precision bookkeeping (casting the masters into the compute copy, fp32 gradient accumulation)
is extra work. This measures, on the tiny job (`examples/tiny-cpu.yaml` rendered by the operator's
builders, one rank in local mode, one torch thread), and on a larger model (4 layers of width 256,
64-token responses), the median `TrainingRank.train_step` time over the same batches:
  * bf16 over fp32 (the cost of training in the GPU's dtype on CPU);
  * a step with one update and fresh rollouts, whose old log-probs are the training forward's
    (`TrainingRank._fused_old_log_probs`), over the same step with the separate forward-only pass.
Rounds alternate the variants so load drift on a shared machine hits both.

Run: `.venv/bin/python bench/precision.py [--quick]`. The last line is
`precision: bf16/fp32 tiny R1 (step s1 vs s2 ms), larger R2; fused/separate old log-probs R3`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer_image")]

from rljob_operator import api, builders  # noqa: E402
from rljob_operator.decide import planning  # noqa: E402
from rljob_trainer import config  # noqa: E402
from rljob_trainer.engines import base, build_engine  # noqa: E402
from rljob_trainer.model import modeling  # noqa: E402
from rljob_trainer.train import trainer  # noqa: E402


def tiny_config(dtype: str, *, larger: bool) -> config.TrainerConfig:
    spec = api.RLJobSpec.model_validate(
        yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())["spec"]
    )
    model_config = dict(spec.model.config.inline or {})
    plan = planning.plan_status(planning.plan_job(spec, model_config))
    data = builders.render_trainer_config(spec, plan, model_config).model_dump()
    data["model"]["dtype"] = dtype
    if larger:
        data["model"]["hf_config"] = modeling.tiny_hf_config(
            32, hidden_size=256, num_hidden_layers=4, intermediate_size=512
        )
        data["lengths"]["max_response_tokens"] = 64
    data["distributed"].update(
        num_trainer_ranks=1, trainer_pod_ranks=None, launcher="local", torch_threads_per_rank=1
    )
    data["telemetry"].update(enabled=False, prometheus_port=None)
    return config.TrainerConfig.model_validate(data)


def batch(cfg: config.TrainerConfig) -> trainer.RankMiniBatch:
    engine = build_engine(cfg, name="e", colocated=False)
    engine.load()
    tok = modeling.load_tokenizer(cfg.model)
    prompts = [tok.encode(f"{a}+{b}=", add_special_tokens=False) for a in range(8) for b in range(16)]
    outs = engine.generate(
        prompts,
        base.SamplingSettings(max_tokens=cfg.lengths.max_response_tokens, seeds=tuple(range(len(prompts)))),
    )
    samples = tuple(
        trainer.sample_from_output(o, 1.0 if i % 3 else -1.0, eos_id=tok.eos_token_id)
        for i, o in enumerate(outs)
    )
    return trainer.RankMiniBatch(samples, len(samples), sum(len(s.response_ids) for s in samples))


def rank_for(cfg: config.TrainerConfig, *, fused: bool) -> trainer.TrainingRank:
    rank = trainer.TrainingRank(cfg, 0, 1)
    rank.setup("127.0.0.1", 0)
    if not fused:
        rank._fused_old_log_probs = lambda mini_batches: False  # type: ignore[method-assign]
    return rank


def median_ms(runs: dict[str, list[float]], key: str) -> float:
    return 1000 * statistics.median(runs[key])


def measure(
    variants: dict[str, tuple[trainer.TrainingRank, trainer.RankMiniBatch]], rounds: int
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in variants}
    for rank, mb in variants.values():  # warm-up
        rank.train_step([mb])
    for _ in range(rounds):
        for name, (rank, mb) in variants.items():
            t0 = time.perf_counter()
            rank.train_step([mb])
            out[name].append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="5 rounds instead of 15")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rounds = 5 if args.quick else 15
    results: dict[str, Any] = {}
    for size in ("tiny", "larger"):
        cfgs = {d: tiny_config(d, larger=size == "larger") for d in ("float32", "bfloat16")}
        mb = batch(cfgs["float32"])
        variants = {
            "fp32": (rank_for(cfgs["float32"], fused=True), mb),
            "bf16": (rank_for(cfgs["bfloat16"], fused=True), mb),
            "bf16-separate": (rank_for(cfgs["bfloat16"], fused=False), mb),
        }
        runs = measure(variants, rounds)
        results[size] = {k: median_ms(runs, k) for k in runs}
        r = results[size]
        print(
            f"{size}: train_step fp32 {r['fp32']:.1f} ms, bf16 {r['bf16']:.1f} ms "
            f"(x{r['bf16'] / r['fp32']:.2f}), bf16 with the separate old-log-prob pass "
            f"{r['bf16-separate']:.1f} ms (fused saves {100 * (1 - r['bf16'] / r['bf16-separate']):.0f} %)"
        )
    t, lg = results["tiny"], results["larger"]
    print(
        f"precision: bf16/fp32 tiny {t['bf16'] / t['fp32']:.2f} ({t['bf16']:.1f} vs {t['fp32']:.1f} ms), "
        f"larger {lg['bf16'] / lg['fp32']:.2f}; fused/separate old log-probs "
        f"{lg['bf16'] / lg['bf16-separate']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

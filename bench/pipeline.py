"""Pipeline benchmark: steps per hour of the synchronous loop vs the asynchronous pipeline, and how
close the asynchronous runs came to what their own phases allow.

Role: measures what overlapping generation with training buys, and how much of what it could buy.
Each run is the real trainer entry point, `python -m rljob_trainer`, on a private local Ray node: one
training rank (one torch thread) and one dedicated vLLM engine (vLLM's CPU build, its worker on one
thread: the actor's one Ray CPU) as Ray actors in their own processes, weights through the engine's
fallback (the object store, then `collective_rpc` into vLLM's worker: vLLM's weight-transfer backends
need CUDA). A tiny deep and thin Qwen2 built from a config (heads of 32, which vLLM's CPU attention
takes; float32; random weights, nothing downloaded) on the toy arithmetic task. The engine is sized
as the operator sizes one (`vllm_sizing`: a step's sequences, its KV bytes).

Calibration sets two knobs, so it balances on any machine: the batch (prompts per step, groups of
4) and the response cap. Each phase is taken as a power law in both (`PhaseLaw`, fitted through
every probe by least squares): training grows with the tokens trained (about linear in the batch,
and in the answers' mean length, which saturates with the cap as answers stop at EOS); generation
with the longest answer (about the cap) and, on vLLM's CPU build, almost as fast with the batch as
training does (the engine's per-sequence work is not small beside a tiny model's), so neither knob
alone moves the balance far and both are used. Four probes on a grid (12 and 48 prompts, 24 and 72
tokens), then up to three where the refitted laws put generation = training = `--target-s` (default
0.8 s: far from the regime where Ray calls and weight syncs decide the ratio), each step bounded
(`PhaseLaws.balanced`: power laws fitted to noisy probes describe the phases near them only).
A probe's generation is timed on one vLLM engine in this process, started once for every probe (a
vLLM start costs 20-60 s here, a run per probe would pay it each time): a step's requests, the runs'
sampling, 4 calls. Its training comes from a short synchronous run in local mode on the transformers
engine (same model, same sampling, so the same answer lengths; no vLLM start), 4 timed steps. When
the synchronous run on Ray finds its phases more than 1.25x apart, each law is scaled by what the
Ray run measured against it (the launcher and the moment differ from the probes'), the batch and cap
move to where the scaled laws balance, and it runs again (at most twice).

Then the synchronous run (maxStaleness 0) and the asynchronous runs (maxStaleness 1, or each value
of `--staleness`, truncated IS; with `--partial` also each with partial rollouts) use that config:
sync, the first asynchronous configuration, the others, the first again, sync again. The headline
figures pool the two synchronous runs and the first configuration's two runs (both pairs centred on
the same moment), so a machine that drifts over the minutes between runs cancels to first order
instead of reading as a gain or loss. Each run starts its own engine: the runs are the real entry
point, whose engine lives and dies with it.
Steps/hour is over every step but the first and the last (sum of the driver's step times: waiting
for rollouts, training, the weight sync and the step's bookkeeping): the first pays for start-up,
and the last has nothing left to generate beside its training.

The efficiency is taken from the asynchronous runs' own phases, step by step (`Overlap`): the
trainer's work in a step (the step less its waits for rollouts), and the engine's (the generation
that ran during the step, i.e. the batch trained k = maxStaleness steps later, plus the weight
sync's own work); a perfect pipeline's step takes the larger of the two. Efficiency = ideal time /
measured time over the timed steps, and ideal = ratio / efficiency: the ratio the asynchronous runs
would read had they lost nothing to waits. At maxStaleness 1 both engine intervals lie inside the
step they are counted in (the next batch cannot start before the step, the sync waits for it), so
efficiency <= 1 holds by construction. What overlap costs each phase (the other process's
contention) is inside the ideal, not the efficiency: the `contention` line shows it (each phase
overlapped against alone), beside the ratio the synchronous phases alone would allow. An earlier
ideal came from the synchronous runs' phases, so the overlapped phases of other runs could beat it
(efficiency 1.11 read on a quiet machine).

Overlap needs two free cores: the engine and the training rank each run one thread. On a shared
machine (other jobs, hypervisor steal) the cores the bench really gets can be fewer, and then no
pipeline reaches its ideal. So the bench measures that too, before the synchronous run and after the
last run: `parallel capacity` is how much more one-thread work two processes get done side by side
than one alone (2.0: two free cores, 1.0: one).

No ratio is printed from a degenerate regime; the last line then says why (`pipeline: no ratio:
...`, exit status 3): steps shorter than 0.5 s, a serial rest above 30 % of the step, phases more
than 1.6x apart after calibration, step times that scatter (coefficient of variation above 0.25), or
a parallel capacity below 1.6 (fewer than two free cores).

`--corrections` runs something else instead (docs/numerics.md has its table): the toy task learning
(2-layer model, answers of up to 4 tokens, `--learning-rate` 3e-3) at maxStaleness 2 under each rollout
correction (`spec.grpo.rolloutCorrection`), one Ray run each, and a table of the drift between the
engine's policy and the trainer's (|log-prob gap|, KL, chi^2, what the correction truncated, masked or
rejected) and the reward (first and last ten steps). It skips the calibration and the throughput runs,
and keeps the transformers engine its table was measured on: 16 runs, a vLLM start each would add
8-15 minutes, and the gap it tables is the lag's (vLLM's float32 log-probs equal the trainer's within
1e-5, tests/integration/test_vllm_engine.py).

Run: `.venv/bin/python bench/pipeline.py [--quick] [--staleness 1,2] [--partial] [--json]`. The last
line is exactly
`pipeline: sync X steps/h, async Y steps/h, ratio R, ideal I, efficiency E, staleness max K`
(the first `--staleness` value, without partial rollouts); the other configurations print the same
figures on `pipeline (...)` lines above it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "trainer_image"))

sys.path.insert(0, str(REPO / "operator"))

from rljob_operator import estimator  # noqa: E402
from rljob_operator.estimator import rollout as estimator_rollout  # noqa: E402
from rljob_trainer import config  # noqa: E402
from rljob_trainer.model import modeling  # noqa: E402

GROUP_SIZE = 4
MIN_PROMPTS, MAX_PROMPTS = 1, 64
MIN_TOKENS, MAX_TOKENS = 8, 480
MIN_STEP_S = 0.5  # below this, Ray call and weight-sync overheads decide the ratio
MAX_REST_FRACTION = 0.3
MAX_IMBALANCE = 1.6
MAX_STEP_CV = 0.25
MIN_CAPACITY = 1.6
# A packed row's tokens (`--row-tokens`): its causal mask is quadratic in its length, and 4096-token
# rows made training 2.6x slower and memory-bound.
ROW_TOKENS = 1024
# The calibration's first probes: a grid of two batches and two caps, around where the phases of a
# vLLM engine and the bench's rank met on this machine (about 40 prompts x 4 at 35 tokens).
GRID_PROMPTS, GRID_TOKENS = (12, 48), (24, 72)
GRID_CENTRE = (24, 42)
# Steps per calibration probe (all but the first and last timed): a step's generation lasts as long
# as its longest answer, so one timed step (the old 3) put the phases up to 2x off the Ray run's.
CALIBRATION_STEPS = 6
# The synchronous run is calibrated again (at most this often) when its phases are further apart than
# REBALANCE_AT: the probes run in one process, the runs on Ray.
REBALANCE_RUNS = 2
REBALANCE_AT = 1.25


# A tiny deep and thin Qwen2 (random weights, built from this config in each run): heads of 32, a size
# vLLM's CPU attention takes (`engines.platform.CPU_ATTENTION_HEAD_SIZES`); float32, which vLLM's CPU
# build runs without AMX.
BENCH_MODEL = modeling.tiny_hf_config(
    32,
    hidden_size=64,
    num_hidden_layers=8,
    intermediate_size=128,
    num_attention_heads=2,
    max_position_embeddings=512,
)
DTYPE = "float32"


def vllm_sizing(sequences: int, max_model_len: int) -> dict[str, int]:
    """The vLLM engine's scheduler and KV settings for a step of `sequences` requests, as the operator
    sizes them (`rljob_operator.estimator`): max_num_seqs the step's sequences (one call per step),
    one prefill of at least the step's prompts and never below the model length, and KV bytes for
    every sequence at full length in vLLM's CPU blocks (plus its null block). Without the bytes vLLM's
    CPU backend reserves 0.9 x the host's memory, and refuses to start on a shared machine."""
    geometry = estimator.ModelGeometry.from_hf_config(BENCH_MODEL)
    block = estimator_rollout.cpu_block_size_tokens(geometry)
    blocks = sequences * -(-max_model_len // block) + 1
    return {
        "maxNumSeqs": sequences,
        "maxNumBatchedTokens": max(2048, sequences, max_model_len),
        # In the runs' dtype: "auto" is vLLM's --dtype auto, which serves a float32 checkpoint in bf16.
        "cpuKvCacheBytes": blocks * block * geometry.kv_bytes_per_token(kv_cache_dtype=DTYPE),
    }


def make_config(
    *,
    steps: int,
    response_tokens: int,
    prompts: int,
    max_staleness: int,
    launcher: str = "ray",
    partial: bool = False,
    chunk: int | None = None,
    row_tokens: int = ROW_TOKENS,
    engine: str = "vllm",
) -> config.TrainerConfig:
    grpo: dict[str, Any] = {
        "groupSize": GROUP_SIZE,
        "promptsPerStep": prompts,
        "maxSteps": steps,
        # Throughput, not learning: with a learning rate this small the policy (so its answers'
        # lengths, so each step's work) stays the same across steps and runs. At 1e-3 an
        # asynchronous run drifted to 40% longer answers by step 5 and its training took twice the
        # synchronous run's: the ratio compared different work.
        "learningRate": 1e-7,
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
                "hfConfig": BENCH_MODEL,
                "dtype": DTYPE,
                "tokenizer": "builtin-digits",
                "finetune": "full",
            },
            "lengths": {"maxPromptTokens": 8, "maxResponseTokens": response_tokens},
            "grpo": grpo,
            "batching": {"packed": True, "dynamic": True, "maxTokensPerMicroBatch": row_tokens},
            "rollout": {
                "kind": engine,
                "sharedEngines": 0,
                "dedicatedEngines": 1,
                "maxDedicatedEngines": 1,
                "engineNumCpus": 1,
                "partialRollouts": partial,
                "chunkPromptGroups": chunk,
                **vllm_sizing(prompts * GROUP_SIZE, 8 + response_tokens),
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
        # A loaded machine can miss Ray's fixed 30 s raylet start wait, and a neighbour's memory
        # spike can make Ray's memory monitor kill this run's actors: start that run again.
        retry = "timed out during startup" in proc.stderr or "OutOfMemoryError" in proc.stderr
        if proc.returncode == 0 or not retry or attempt == 2:
            break
        why = "Ray's start timed out" if "timed out" in proc.stderr else "Ray killed it for memory"
        print(f"{name}: run again ({why})")
    if proc.returncode != 0:
        raise SystemExit(f"{name} run failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


# ---- phases and figures ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Phases:
    """Mean seconds per timed step (every step after the first) of one run."""

    steps: int
    step_s: float
    generation_s: float
    training_s: float
    weight_sync_s: float
    trainer_wait_s: float
    step_cv: float  # coefficient of variation of the step times

    @property
    def rest_s(self) -> float:
        """The serial rest of a synchronous step: the weight sync and the step's bookkeeping."""
        return max(0.0, self.step_s - self.generation_s - self.training_s)

    @property
    def steps_per_hour(self) -> float:
        return 3600.0 / self.step_s

    @property
    def serial_ideal(self) -> float:
        """The ratio perfect overlap would reach if each phase kept the time it takes alone (these
        synchronous phases). Shown beside the figures, never their ideal: the overlapped phases are
        timed in other runs, and this estimate read below the ratio measured (efficiency 1.11)."""
        g, t, s = self.generation_s, self.training_s, self.rest_s
        return (g + t + s) / (max(g, t) + s)


@dataclass(frozen=True)
class Overlap:
    """What the asynchronous runs' own phases allow, over the steps it judges (seconds, summed).

    Per timed step i of a run with maxStaleness k: the trainer's own work is the step less its waits
    for rollouts (`step_s - trainer_wait_s`: scoring, training, the sync's own work, bookkeeping);
    the engine's is the generation that ran during step i, the batch of step i + k
    (`generation_s` of row i + k), plus the weight sync's own work, which the engine cannot overlap
    (`weight_sync_s` less the trainer's waits of the step, which hold the sync's wait for the call in
    flight: a lower bound of the sync's own work). A perfect pipeline takes the slower of the two.
    - maxStaleness 1 (the headline), one generate call per engine and step: step i+1's batch is
      queued at step i's start (`RolloutPipeline.fill`, not before: it needs the weights synced at the
      end of step i-1) and collected before step i's sync ends (`quiesce` waits for the call in
      flight), so both engine intervals lie inside step i and neither overlaps the other; the ideal
      step max(trainer, engine) is at most the step measured, and efficiency <= 1 holds by
      construction, step by step.
    - maxStaleness >= 2 (or partial rollouts): the engine may run a step further ahead, so a step's
      work can move to the next one; the ideal is max(sum trainer, sum engine) over the run, with the
      batch k steps later as the steady state's; not bounded by construction (a batch's generation
      can straddle steps, and an interrupted one's `generation_s` spans the sync).
    """

    step_s: float
    ideal_s: float
    steps: int

    @property
    def efficiency(self) -> float:
        return self.ideal_s / self.step_s


def overlap(runs: list[list[dict[str, Any]]], max_staleness: int) -> Overlap:
    """`Overlap` of one asynchronous configuration's runs (pooled)."""
    step_total = ideal_total = 0.0
    steps = 0
    for rows in runs:
        trainer, engine, step = [], [], []
        for i in timed_indices(rows):
            j = i + max_staleness
            if j >= len(rows):  # the batch generated during this step is never trained: no figure
                continue
            r = rows[i]
            wait = float(r["trainer_wait_s"])
            trainer.append(float(r["step_s"]) - wait)
            engine.append(float(rows[j]["generation_s"]) + max(0.0, float(r["weight_sync_s"]) - wait))
            step.append(float(r["step_s"]))
        if max_staleness <= 1:
            ideal_total += sum(max(a, b) for a, b in zip(trainer, engine, strict=True))
        else:
            ideal_total += max(sum(trainer), sum(engine))
        step_total += sum(step)
        steps += len(step)
    return Overlap(step_total, ideal_total, steps)


def contention(sync: Phases, overlapped: Phases) -> str:
    """Where time goes besides waits (which the efficiency counts). Each phase of the overlapped run
    against the same phase alone (the synchronous run): above x1.00 the other phase's process slowed
    it (shared caches, memory bandwidth, a neighbour on the host), which the efficiency does not
    count (its ideal is made of the overlapped phases) and the capacity probe, a cache-resident
    matmul, does not see. And the ratio the synchronous phases alone would allow (`serial_ideal`)."""

    def slowdown(alone: float, together: float) -> float:
        return together / alone if alone > 0 else float("nan")

    generation = slowdown(sync.generation_s, overlapped.generation_s)
    training = slowdown(sync.training_s, overlapped.training_s)
    return (
        f"contention: overlapped, generation took x{generation:.2f} and training x{training:.2f} "
        f"their time alone; the synchronous phases alone would allow a ratio of {sync.serial_ideal:.2f}"
    )


def timed_indices(rows: list[dict[str, Any]]) -> range:
    """The steps that measure the steady state: not the first (warm-up) nor the last (nothing left to
    generate beside its training, so an asynchronous run's last step trains alone on a core)."""
    return range(1, len(rows) - 1) if len(rows) > 2 else range(1, len(rows))


def timed_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rows[i] for i in timed_indices(rows)]


def phases(*runs: list[dict[str, Any]]) -> Phases:
    """The timed steps of one run, or of several runs of one configuration pooled."""
    timed = [r for rows in runs for r in timed_rows(rows)]

    def mean(key: str) -> float:
        return sum(float(r[key]) for r in timed) / len(timed)

    steps = [float(r["step_s"]) for r in timed]
    cv = statistics.pstdev(steps) / statistics.fmean(steps) if len(steps) > 1 else 0.0
    return Phases(
        len(timed),
        mean("step_s"),
        mean("generation_s"),
        mean("training_s"),
        mean("weight_sync_s"),
        mean("trainer_wait_s"),
        cv,
    )


@dataclass(frozen=True)
class Figures:
    """One asynchronous configuration against the synchronous runs. `efficiency` is the asynchronous
    runs' ideal time over their measured time (`Overlap`); `ideal` = ratio / efficiency, the ratio
    those runs would read had they lost nothing to waits."""

    label: str
    max_staleness: int
    partial: bool
    sync_steps_per_h: float
    async_steps_per_h: float
    ratio: float
    ideal: float
    efficiency: float
    staleness_max: int
    partial_fraction: float
    staleness_tokens_mean: float
    async_phases: Phases
    overlap: Overlap

    def line(self) -> str:
        return (
            f"sync {self.sync_steps_per_h:.0f} steps/h, async {self.async_steps_per_h:.0f} steps/h, "
            f"ratio {self.ratio:.2f}, ideal {self.ideal:.2f}, efficiency {self.efficiency:.2f}, "
            f"staleness max {self.staleness_max}"
        )


def figures(
    label: str, sync: Phases, runs: list[list[dict[str, Any]]], *, max_staleness: int, partial: bool
) -> Figures:
    """The asynchronous configuration's runs (pooled) against the synchronous runs' step time."""
    a = phases(*runs)
    ratio = a.steps_per_hour / sync.steps_per_hour
    ov = overlap(runs, max_staleness)
    rows = [r for run_rows in runs for r in run_rows]
    timed = [r for run_rows in runs for r in timed_rows(run_rows)]
    return Figures(
        label,
        max_staleness,
        partial,
        sync.steps_per_hour,
        a.steps_per_hour,
        ratio,
        ratio / ov.efficiency,
        ov.efficiency,
        max(int(r["rollout/staleness_max"]) for r in rows),
        sum(float(r.get("rollout/partial_fraction", 0.0)) for r in timed) / len(timed),
        sum(float(r.get("rollout/staleness_tokens_mean", 0.0)) for r in timed) / len(timed),
        a,
        ov,
    )


def degenerate(sync: Phases, capacity: list[float]) -> list[str]:
    """Why a ratio from this regime would measure something other than overlap (empty: it is sound)."""
    why = []
    if max(sync.generation_s, sync.training_s) < MIN_STEP_S:
        why.append(
            f"the slower phase takes {max(sync.generation_s, sync.training_s):.2f} s < {MIN_STEP_S} s: Ray "
            "calls and weight syncs would decide the ratio"
        )
    if sync.rest_s > MAX_REST_FRACTION * sync.step_s:
        why.append(
            f"the serial rest (weight sync, bookkeeping) is {sync.rest_s:.2f} s of a "
            f"{sync.step_s:.2f} s step "
            f"(> {MAX_REST_FRACTION:.0%}): overlap cannot show"
        )
    g, t = sync.generation_s, sync.training_s
    if min(g, t) <= 0 or max(g, t) / min(g, t) > MAX_IMBALANCE:
        why.append(
            f"generation {g:.2f} s and training {t:.2f} s are more than {MAX_IMBALANCE}x apart after "
            "calibration: the ideal is near 1"
        )
    if sync.step_cv > MAX_STEP_CV:
        why.append(
            f"the synchronous run's step times scatter (coefficient of variation {sync.step_cv:.2f} > "
            f"{MAX_STEP_CV}): the machine's load changed during the run"
        )
    low = [c for c in capacity if c < MIN_CAPACITY]
    if low:
        why.append(
            f"parallel capacity {min(low):.2f} < {MIN_CAPACITY}: fewer than two free cores, the ratio would "
            "measure the machine's load"
        )
    return why


# ---- calibration ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Probe:
    prompts: int
    tokens: int
    generation_s: float
    training_s: float


@dataclass(frozen=True)
class PhaseLaw:
    """One phase's seconds as a power law in the batch and the cap:
    log(seconds) = log_scale + batch_exponent * log(prompts) + cap_exponent * log(tokens)."""

    log_scale: float
    batch_exponent: float
    cap_exponent: float

    def seconds(self, prompts: float, tokens: float) -> float:
        return math.exp(
            self.log_scale + self.batch_exponent * math.log(prompts) + self.cap_exponent * math.log(tokens)
        )

    def scaled(self, factor: float) -> PhaseLaw:
        """The same law, every time `factor` x (a machine or a launcher that runs the phase slower)."""
        return PhaseLaw(self.log_scale + math.log(factor), self.batch_exponent, self.cap_exponent)


def fit_law(points: list[tuple[int, int, float]]) -> PhaseLaw:
    """Least squares of log(seconds) on log(prompts) and log(tokens) through (prompts, tokens, s)."""
    import numpy as np

    a = np.array([[1.0, math.log(p), math.log(c)] for p, c, _ in points])
    b = np.array([math.log(max(s, 1e-4)) for _, _, s in points])
    (scale, batch, cap), *_ = np.linalg.lstsq(a, b, rcond=None)
    return PhaseLaw(float(scale), float(batch), float(cap))


@dataclass(frozen=True)
class PhaseLaws:
    """Both phases' laws. Two knobs, two conditions: generation = training (balance) and the slower
    = target_s (length). On vLLM both phases grow with the batch at nearly the same exponent (the
    engine's per-sequence work is not small beside a tiny model's), so the batch alone barely moves
    the balance; the cap does: a step's generation lasts as long as its longest answer (about the
    cap), its training as long as its answers' sum, whose mean saturates as answers stop at EOS."""

    generation: PhaseLaw
    training: PhaseLaw

    @classmethod
    def fit(cls, probes: list[Probe]) -> PhaseLaws:
        return cls(
            fit_law([(p.prompts, p.tokens, p.generation_s) for p in probes]),
            fit_law([(p.prompts, p.tokens, p.training_s) for p in probes]),
        )

    def scaled(self, generation: float, training: float) -> PhaseLaws:
        return PhaseLaws(self.generation.scaled(generation), self.training.scaled(training))

    def miss(self, prompts: int, tokens: int, target_s: float) -> float:
        """How far (prompts, tokens) is from balance and from the target, by the laws (log units;
        balance counts twice: it decides the ideal, the length only keeps clear of the overheads)."""
        g, t = self.generation.seconds(prompts, tokens), self.training.seconds(prompts, tokens)
        # Never steer into steps the degenerate check refuses: balance bought there is no figure.
        short = 10.0 if max(g, t) < 1.25 * MIN_STEP_S else 0.0
        return abs(math.log(g / t)) + 0.5 * abs(math.log(max(g, t) / target_s)) + short

    def balanced(self, target_s: float, around: tuple[int, int], within: float = 2.0) -> tuple[int, int]:
        """The (prompts, tokens) the laws put nearest balance at `target_s`, no further than `within`x
        from `around` in either knob (and within the bounds). A bounded step, not the laws' exact
        solution: their exponents are fitted to noisy probes and nearly equal (the solution of two
        near-parallel conditions jumped from 64 prompts at 20 tokens to 3 at 344 on one probe's
        noise), and a power law is only a local description."""
        p0, c0 = around
        steps = [within ** (k / 4) for k in range(-4, 5)]
        batches = {max(MIN_PROMPTS, min(MAX_PROMPTS, round(p0 * f))) for f in steps}
        caps = {max(MIN_TOKENS, min(MAX_TOKENS, round(c0 * f))) for f in steps}
        return min(((p, c) for p in batches for c in caps), key=lambda pc: self.miss(*pc, target_s))


class GenerationTimer:
    """The calibration's generation phase: one vLLM engine in this process, started once for every
    probe (a start costs 20-60 s here), generating what a step of the runs generates: `prompts`
    toy-task prompts x GROUP_SIZE at the response cap, the runs' sampling, seeds as the pipeline
    draws them. Its weights are the runs' initial ones (the tiny model from `grpo.seed`), which the
    runs' learning rate leaves as they are."""

    def __init__(self, *, row_tokens: int = ROW_TOKENS) -> None:
        from rljob_trainer import engines
        from rljob_trainer.data import sources

        # The engine's worker processes inherit it: one thread, as in the runs (the engine actor's
        # one Ray CPU sets OMP_NUM_THREADS=1 there).
        os.environ["OMP_NUM_THREADS"] = "1"
        self.cfg = make_config(
            steps=1,
            response_tokens=MAX_TOKENS,
            prompts=MAX_PROMPTS,
            max_staleness=0,
            launcher="local",
            row_tokens=row_tokens,
        )
        tokenizer = modeling.load_tokenizer(self.cfg.model)
        examples, _ = sources.load_fitting_examples(
            self.cfg.data, tokenizer, max_prompt_tokens=self.cfg.lengths.max_prompt_tokens
        )
        self._prompts = [sources.encode_data_prompt(tokenizer, e.prompt, self.cfg.data) for e in examples]
        self._calls = 0
        self.engine = engines.build_engine(self.cfg, name="calibration", colocated=False)
        self.engine.load()
        self.time(4, 8, calls=1)  # the first forward pays one-off set-up: not a probe's

    def time(self, prompts: int, tokens: int, *, calls: int = CALIBRATION_STEPS - 2) -> float:
        """Mean seconds of `calls` generate calls of one step's requests at cap `tokens`."""
        from rljob_trainer.engines import base
        from rljob_trainer.rollout import pipeline

        g = self.cfg.grpo
        walls = []
        for _ in range(calls):
            self._calls += 1
            start = self._calls * prompts
            requests = [
                self._prompts[(start + p) % len(self._prompts)]
                for p in range(prompts)
                for _ in range(GROUP_SIZE)
            ]
            seeds = tuple(pipeline.sample_seed(g.seed, self._calls, i) for i in range(len(requests)))
            sampling = base.SamplingSettings(g.temperature, g.top_p, tokens, seeds=seeds)
            started = time.perf_counter()
            self.engine.generate(requests, sampling)
            walls.append(time.perf_counter() - started)
        return statistics.fmean(walls)

    def shutdown(self) -> None:
        self.engine.shutdown()


def calibrate(
    work: Path, timer: GenerationTimer, *, target_s: float, log: Any, row_tokens: int = ROW_TOKENS
) -> tuple[int, int, list[Probe], PhaseLaws]:
    """(prompts, response cap, every probe, the phases' laws): where generation ≈ training ≈ target_s.
    Four probes on a grid of two batches and two caps fit each phase's law; each further probe sits
    where the laws refitted through every probe so far put the balance (at most three), and the last
    answer of the laws is taken."""
    probes: list[Probe] = []

    def probe(prompts: int, tokens: int) -> Probe:
        # Training from a local-mode run (rank and engine in one process, one thread each: the
        # phases near the Ray runs' without their Ray start-up) on the transformers engine: the
        # same model and sampling, so the same answer lengths, without a vLLM start per probe.
        # Generation on the one vLLM engine of `timer`. Where the Ray run's phases still come out
        # apart, `main` rebalances it from its own phases.
        cfg = make_config(
            steps=CALIBRATION_STEPS,
            response_tokens=tokens,
            prompts=prompts,
            max_staleness=0,
            launcher="local",
            row_tokens=row_tokens,
            engine="transformers",
        )
        ph = phases(run(cfg, work, "calibrate"))
        out = Probe(prompts, tokens, timer.time(prompts, tokens), ph.training_s)
        probes.append(out)
        log(
            f"calibration: {prompts} prompts x {GROUP_SIZE}, {tokens} tokens: generation "
            f"{out.generation_s:.2f} s, training {out.training_s:.2f} s"
        )
        return out

    for prompts in GRID_PROMPTS:
        for tokens in GRID_TOKENS:
            probe(prompts, tokens)
    laws = PhaseLaws.fit(probes)
    point = laws.balanced(target_s, GRID_CENTRE, within=4.0)  # anywhere in and around the grid
    for _ in range(3):
        if point in {(p.prompts, p.tokens) for p in probes}:
            break
        done = probe(*point)
        laws = PhaseLaws.fit(probes)
        near = abs(math.log(done.generation_s / done.training_s)) <= math.log(1.15)
        if near and abs(math.log(max(done.generation_s, done.training_s) / target_s)) <= math.log(1.25):
            break  # this probe's own phases are where they should be
        point = laws.balanced(target_s, point)
    return point[0], point[1], probes, laws


def rebalanced(
    sync: Phases, prompts: int, tokens: int, laws: PhaseLaws, target_s: float
) -> tuple[PhaseLaws, int, int]:
    """The synchronous (Ray) run's own phases against what the laws predicted at its batch and cap:
    each law scaled by its phase's factor (the Ray run's launcher and the machine's moment), and the
    point where the scaled laws balance at `target_s`."""
    moved = laws.scaled(
        sync.generation_s / laws.generation.seconds(prompts, tokens),
        sync.training_s / laws.training.seconds(prompts, tokens),
    )
    return moved, *moved.balanced(target_s, (prompts, tokens), within=4.0)


# ---- parallel capacity -----------------------------------------------------------------------------
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
    """Work done per second by two one-thread processes side by side over one alone (1.0 to 2.0),
    the median of three probes."""

    def spawn() -> subprocess.Popen[str]:
        code = CAPACITY_PROBE.replace("ROUNDS", str(rounds))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)

    def walls(procs: list[subprocess.Popen[str]]) -> list[float]:
        return [float(p.communicate()[0]) for p in procs]

    def once() -> float:
        (before,) = walls([spawn()])
        together = walls([spawn(), spawn()])
        (after,) = walls([spawn()])
        return 2 * (before + after) / 2 / max(together)

    # The median of three: one probe lasts a second or two, and a neighbour's burst on the host then
    # refused a whole run whose own steps never saw it (1.21 before the sync run, 2.08 after).
    return statistics.median(once() for _ in range(3))


# ---- rollout corrections at maxStaleness 2 (--corrections) -------------------------------------------
# (label, the trainer config's grpo settings): what `spec.grpo.rolloutCorrection` renders to.
CORRECTIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("none", {"policyLoss": "clipped"}),
    ("token TIS 2 (tisCap, default)", {"policyLoss": "clipped-tis", "tisCap": 2.0}),
    ("sequence TIS 2", {"rolloutCorrection": {"isLevel": "sequence"}}),
    ("geometric TIS 2", {"rolloutCorrection": {"isLevel": "geometric"}}),
    ("IcePop [0.5, 5]", {"rolloutCorrection": {"isMode": "mask", "isLower": 0.5, "isUpper": 5.0}}),
    (
        "sequence MIS [0.5, 2]",
        {"rolloutCorrection": {"isLevel": "sequence", "isMode": "mask", "isLower": 0.5, "isUpper": 2.0}},
    ),
    (
        "token rejection [0.5, 2]",
        {
            "rolloutCorrection": {
                "isLevel": None,
                "rejectLevel": "token",
                "rejectLower": 0.5,
                "rejectUpper": 2.0,
            }
        },
    ),
    (
        "geometric rejection [0.95, 1.05] + token TIS",
        {"rolloutCorrection": {"rejectLevel": "geometric", "rejectLower": 0.95, "rejectUpper": 1.05}},
    ),
)
CORRECTION_STALENESS = 2


def correction_config(
    grpo: dict[str, Any], *, steps: int, seed: int, learning_rate: float = 3e-3
) -> config.TrainerConfig:
    """The toy task learning at maxStaleness 2 on one rank and one dedicated engine (Ray)."""
    return config.parse_config(
        {
            "model": {
                "name": "tiny-qwen2",
                "source": "tiny",
                "hfConfig": modeling.tiny_hf_config(32),
                "dtype": "float32",
                "tokenizer": "builtin-digits",
                "finetune": "full",
            },
            "lengths": {"maxPromptTokens": 8, "maxResponseTokens": 4},
            "grpo": {
                "groupSize": 8,
                "promptsPerStep": 16,
                "maxSteps": steps,
                "learningRate": learning_rate,
                "seed": seed,
                "maxStaleness": CORRECTION_STALENESS,
                **grpo,
            },
            "batching": {"packed": True, "dynamic": True, "maxTokensPerMicroBatch": 512},
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
                "launcher": "ray",
                "torchThreadsPerRank": 1,
                "rankNumCpus": 1,
            },
            "export": {"final": False, "everyCheckpoint": False},
        }
    )


def correction_row(label: str, runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One table row: the drift and what the correction did (means over every step but the first),
    and the reward over the first and the last ten steps, pooled over the seeds' runs."""
    timed = [r for rows in runs for r in rows[1:]]

    def mean(key: str, rows: list[dict[str, Any]] | None = None) -> float:
        vals = [float(r.get(key, 0.0)) for r in (timed if rows is None else rows)]
        return sum(vals) / len(vals) if vals else float("nan")

    fraction = max(
        mean("rollout_corr/rollout_is_ratio_fraction_high") if "TIS" in label else 0.0,
        mean("rollout_corr/rollout_is_oob_ratio"),
        mean("rollout_corr/rollout_rs_masked_fraction"),
    )
    return {
        "correction": label,
        "staleness_mean": mean("rollout/staleness_mean"),
        "logprob_diff": mean("rollout/logprob_diff"),
        "kl": mean("rollout_corr/kl"),
        "chi2_token": mean("rollout_corr/chi2_token"),
        "ppl_ratio": mean("rollout_corr/ppl_ratio"),
        "acted_fraction": fraction,
        "is_weight_mean": mean("rollout_corr/rollout_is_mean"),
        "reward_first10": mean("mean_reward", [r for rows in runs for r in rows[:10]]),
        "reward_last10": mean("mean_reward", [r for rows in runs for r in rows[-10:]]),
        "out_of_nucleus": mean("rollout/out_of_nucleus_fraction"),
    }


def corrections_table(
    *, steps: int, seeds: list[int], log: Any, learning_rate: float = 3e-3
) -> list[dict[str, Any]]:
    """Each correction's row (see `correction_row`), after one Ray run per seed."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="rljob-bench-corrections-") as tmp:
        for i, (label, grpo) in enumerate(CORRECTIONS):
            runs = [
                run(
                    correction_config(grpo, steps=steps, seed=s, learning_rate=learning_rate),
                    Path(tmp),
                    f"corr-{i}-{s}",
                )
                for s in seeds
            ]
            rows.append(correction_row(label, runs))
            log(f"corrections: {label}: {rows[-1]}")
    return rows


def render_corrections(
    rows: list[dict[str, Any]], *, steps: int, seeds: list[int], learning_rate: float = 3e-3
) -> str:
    """The rows as the markdown table docs/numerics.md carries."""
    head = (
        "| correction | staleness mean | mean abs log-prob gap | KL(rollout‖old) | chi² token | PPL ratio "
        "| truncated / masked / rejected | mean IS weight | reward steps 1-10 | reward last 10 |"
    )
    lines = [
        f"maxStaleness {CORRECTION_STALENESS}, {steps} steps, learning rate {learning_rate:g}, "
        f"seeds {','.join(map(str, seeds))}:",
        head,
        "|" + "---|" * 10,
    ]
    for r in rows:
        weight = f"{r['is_weight_mean']:.3f}" if r["is_weight_mean"] > 0 else "-"  # no IS: no weight
        lines.append(
            f"| {r['correction']} | {r['staleness_mean']:.2f} | {r['logprob_diff']:.4f} | {r['kl']:.4f} "
            f"| {r['chi2_token']:.4f} | {r['ppl_ratio']:.3f} | {r['acted_fraction']:.4f} | {weight} "
            f"| {r['reward_first10']:.3f} | {r['reward_last10']:.3f} |"
        )
    return "\n".join(lines)


# ---- main ------------------------------------------------------------------------------------------
def _describe(name: str, ph: Phases) -> str:
    return (
        f"{name}: step {ph.step_s:.2f} s (cv {ph.step_cv:.2f}), generation {ph.generation_s:.2f} s, training "
        f"{ph.training_s:.2f} s, trainer wait {ph.trainer_wait_s:.2f} s, weight sync {ph.weight_sync_s:.3f} s"
    )


def main() -> None:
    # A SIGTERM unwinds through `finally` (the calibration's engine is stopped, a run in flight is
    # killed by subprocess.run) instead of leaving vLLM's processes behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps per run (about 4 minutes on 2 cores)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 10 quick, 18 full)")
    p.add_argument(
        "--staleness", default="1", help="maxStaleness values of the asynchronous runs, comma-separated"
    )
    p.add_argument("--partial", action="store_true", help="also run each with partial rollouts")
    p.add_argument(
        "--chunk", type=int, default=None, help="rollout.chunkPromptGroups of the asynchronous runs"
    )
    p.add_argument("--target-s", type=float, default=0.8, help="calibrate the slower phase to this, s")
    p.add_argument(
        "--row-tokens",
        type=int,
        default=ROW_TOKENS,
        help="batching.maxTokensPerMicroBatch: a packed row's tokens",
    )
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    p.add_argument(
        "--corrections",
        action="store_true",
        help="instead: the toy task at maxStaleness 2 under each rollout correction, a table of drift and "
        "reward (--steps default 60, --seeds)",
    )
    p.add_argument("--seeds", default="1", help="with --corrections: the seeds, comma-separated")
    p.add_argument(
        "--learning-rate", type=float, default=3e-3, help="with --corrections (drift grows with it)"
    )
    args = p.parse_args()
    if args.corrections:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        lr = args.learning_rate
        rows = corrections_table(steps=args.steps or 60, seeds=seeds, log=print, learning_rate=lr)
        if args.json:
            print(json.dumps(rows))
        print(render_corrections(rows, steps=args.steps or 60, seeds=seeds, learning_rate=lr))
        return
    steps = args.steps or (10 if args.quick else 18)
    staleness = [int(s) for s in args.staleness.split(",") if s.strip()]
    if not staleness or min(staleness) < 1:
        raise SystemExit("--staleness takes maxStaleness values >= 1, e.g. 1,2")
    with tempfile.TemporaryDirectory(prefix="rljob-bench-pipeline-") as tmp:
        work = Path(tmp)
        timer = GenerationTimer(row_tokens=args.row_tokens)
        try:
            prompts, tokens, probes, laws = calibrate(
                work, timer, target_s=args.target_s, row_tokens=args.row_tokens, log=print
            )
        finally:
            timer.shutdown()  # its ~2 GiB and three processes are not the runs'
        print(f"calibration: {prompts} prompts x {GROUP_SIZE} at {tokens} response tokens")
        capacity = [parallel_capacity()]
        for attempt in range(REBALANCE_RUNS + 1):
            common = {
                "steps": steps,
                "response_tokens": tokens,
                "prompts": prompts,
                "row_tokens": args.row_tokens,
            }
            sync_rows = run(make_config(**common, max_staleness=0), work, "sync")
            sync = phases(sync_rows)
            print(_describe("sync", sync))
            g, t = sync.generation_s, sync.training_s
            apart = max(g, t) / max(min(g, t), 1e-6)
            if apart <= REBALANCE_AT or attempt == REBALANCE_RUNS:
                break
            laws, *moved = rebalanced(sync, prompts, tokens, laws, args.target_s)
            if tuple(moved) == (prompts, tokens):
                break
            prompts, tokens = moved
            print(
                f"calibration: the Ray run's phases are {apart:.2f}x apart: "
                f"{prompts} prompts x {GROUP_SIZE} at {tokens} response tokens"
            )
        # Sync, the headline configuration, the others, the headline again, sync: both pairs sit
        # around the same middle, so the machine's drift over the minutes between runs (a neighbour
        # on the host) cancels to first order in the pooled means.
        configs = [
            (k, partial) for k in staleness for partial in ((False, True) if args.partial else (False,))
        ]
        runs: dict[tuple[int, bool], list[list[dict[str, Any]]]] = {c: [] for c in configs}
        for k, partial in [*configs, configs[0]]:
            cfg = make_config(**common, max_staleness=k, partial=partial, chunk=args.chunk)
            runs[(k, partial)].append(run(cfg, work, f"async-{k}-{int(partial)}-{len(runs[(k, partial)])}"))
        sync_runs = [sync_rows, run(make_config(**common, max_staleness=0), work, "sync-again")]
        print(_describe("sync, again", phases(sync_runs[1])))
        sync = phases(*sync_runs)
        print(_describe("sync (both runs)", sync))
        results: list[Figures] = []
        for k, partial in configs:
            label = f"maxStaleness {k}" + (", partial rollouts" if partial else "")
            fig = figures(label, sync, runs[(k, partial)], max_staleness=k, partial=partial)
            print(_describe(f"async ({label}, {len(runs[(k, partial)])} runs)", fig.async_phases))
            ov = fig.overlap
            print(
                f"overlap ({label}): {ov.steps} steps, ideal {ov.ideal_s / ov.steps:.2f} s a step from "
                f"their own phases, measured {ov.step_s / ov.steps:.2f} s"
            )
            print(contention(sync, fig.async_phases))
            results.append(fig)
        capacity.append(parallel_capacity())
    print(
        f"parallel capacity: {capacity[0]:.2f} before the sync run, {capacity[1]:.2f} after the last run "
        "(2.00: two free cores)"
    )
    why = degenerate(sync, capacity)
    if args.json:
        print(
            json.dumps(
                {
                    "prompts_per_step": prompts,
                    "group_size": GROUP_SIZE,
                    "response_tokens": tokens,
                    "probes": [asdict(p) for p in probes],
                    "sync": {**asdict(sync), "rest_s": sync.rest_s, "serial_ideal": sync.serial_ideal},
                    "runs": [asdict(f) for f in results],
                    "parallel_capacity": capacity,
                    "degenerate": why,
                }
            )
        )
    if why:
        print("pipeline: no ratio: " + "; ".join(why))
        raise SystemExit(3)
    for fig in results[1:]:
        print(
            f"pipeline ({fig.label}): {fig.line()}, partial fraction {fig.partial_fraction:.2f}, token "
            f"staleness mean {fig.staleness_tokens_mean:.2f}"
        )
    print(f"pipeline: {results[0].line()}")


if __name__ == "__main__":
    main()

"""Pipeline benchmark: steps per hour of the synchronous loop vs the asynchronous pipeline, measured
against the ideal the synchronous run's own phases allow.

Role: measures what overlapping generation with training buys, and how much of what it could buy.
Each run is the real trainer entry point, `python -m rljob_trainer`, on a private local Ray node: one
training rank (one torch thread) and one dedicated transformers engine (one torch thread) as Ray
actors in their own processes, weights over the engine's gloo group. A tiny Qwen2 built from a
config (random weights, nothing downloaded) on the toy arithmetic task.

Calibration (short synchronous runs in local mode: the same phases without Ray's start-up) sets two
knobs, so it balances on any machine:
- the batch (prompts per step, groups of 4) sets training against generation: a decode step of a
  tiny model costs about the same for 8 or 64 sequences (per-layer overhead), while training costs
  per token, so fewer prompts make training cheaper relative to generation and more make it
  dearer. Both phases are measured at two batches; each phase's power law through them gives the
  batch where they meet, and each further probe moves the batch along those laws to where its own
  phases would meet (the cap changes their ratio too: answers stop at EOS);
- the response cap sets the step's length: both phases grow with it, so it is scaled until the
  slower phase takes `--target-s` (default 0.8 s), far from the regime where Ray calls and weight
  syncs decide the ratio (the old calibration balanced at a 2-token cap: 0.1 s steps).
Each probe times 4 steps (a step's generation lasts as long as its longest answer). The probes run
in one process; when the synchronous run on Ray finds its phases more than 1.25x apart, its own
phases are carried along the same power laws to a new batch and cap, and it runs again (at most
twice).

Then the synchronous run (maxStaleness 0) and the asynchronous runs (maxStaleness 1, or each value
of `--staleness`, truncated IS; with `--partial` also each with partial rollouts) use that config:
sync, the first asynchronous configuration, the others, the first again, sync again. The headline
figures pool the two synchronous runs and the first configuration's two runs (both pairs centred on
the same moment), so a machine that drifts over the minutes between runs cancels to first order
instead of reading as a gain or loss.
Steps/hour is over every step but the first and the last (sum of the driver's step times: waiting
for rollouts, training, the weight sync and the step's bookkeeping): the first pays for start-up,
and the last has nothing left to generate beside its training.

The ideal comes from the synchronous run's own phases: per step generation g, training t and the
serial rest s (the weight sync and the step's bookkeeping: the step time less g and t). Perfect
overlap hides the shorter phase, so the ideal ratio is (g + t + s) / (max(g, t) + s) and the
efficiency is ratio / ideal: 1.0 means the pipeline lost nothing to waits, Ray calls or syncs.

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
rejected) and the reward (first and last ten steps). It skips the calibration and the throughput runs.

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
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "trainer_image"))

from rljob_trainer import config  # noqa: E402
from rljob_trainer.model import modeling  # noqa: E402

GROUP_SIZE = 4
MIN_PROMPTS, MAX_PROMPTS = 1, 32
MIN_TOKENS, MAX_TOKENS = 8, 480
MIN_STEP_S = 0.5  # below this, Ray call and weight-sync overheads decide the ratio
MAX_REST_FRACTION = 0.3
MAX_IMBALANCE = 1.6
MAX_STEP_CV = 0.25
MIN_CAPACITY = 1.6
# A packed row's tokens (`--row-tokens`): its causal mask is quadratic in its length, and 4096-token
# rows made training 2.6x slower and memory-bound.
ROW_TOKENS = 1024
# Steps per calibration probe (all but the first and last timed): a step's generation lasts as long
# as its longest answer, so one timed step (the old 3) put the phases up to 2x off the Ray run's.
CALIBRATION_STEPS = 6
# The synchronous run is calibrated again (at most this often) when its phases are further apart than
# REBALANCE_AT: the probes run in one process, the runs on Ray.
REBALANCE_RUNS = 2
REBALANCE_AT = 1.25


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
                "hfConfig": modeling.tiny_hf_config(
                    32,
                    hidden_size=64,
                    num_hidden_layers=8,
                    intermediate_size=128,
                    num_attention_heads=4,
                    max_position_embeddings=512,
                ),
                "dtype": "float32",
                "tokenizer": "builtin-digits",
                "finetune": "full",
            },
            "lengths": {"maxPromptTokens": 8, "maxResponseTokens": response_tokens},
            "grpo": grpo,
            "batching": {"packed": True, "dynamic": True, "maxTokensPerMicroBatch": row_tokens},
            "rollout": {
                "kind": "transformers",
                "sharedEngines": 0,
                "dedicatedEngines": 1,
                "maxDedicatedEngines": 1,
                "engineNumCpus": 1,
                "partialRollouts": partial,
                "chunkPromptGroups": chunk,
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
    def ideal(self) -> float:
        """The best ratio overlap can reach from these (synchronous) phases."""
        g, t, s = self.generation_s, self.training_s, self.rest_s
        return (g + t + s) / (max(g, t) + s)


def contention(sync: Phases, overlapped: Phases) -> str:
    """Where an efficiency below 1 goes. Each phase of the overlapped run against the same phase
    alone (the synchronous run): above x1.00 the other phase's process slowed it (shared caches,
    memory bandwidth, a neighbour on the host), which the ideal cannot count and the capacity probe,
    a cache-resident matmul, does not see. And the share of the overlapped step its slower phase and
    the serial rest explain: near 1.00 the pipeline itself hides all it can."""

    def slowdown(alone: float, together: float) -> float:
        return together / alone if alone > 0 else float("nan")

    explained = (max(overlapped.generation_s, overlapped.training_s) + sync.rest_s) / overlapped.step_s
    generation = slowdown(sync.generation_s, overlapped.generation_s)
    training = slowdown(sync.training_s, overlapped.training_s)
    return (
        f"contention: overlapped, generation took x{generation:.2f} and training x{training:.2f} "
        f"their time alone; the slower "
        f"phase and the serial rest are {explained:.2f} of the overlapped step"
    )


def timed_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps that measure the steady state: not the first (warm-up) nor the last (nothing left to
    generate beside its training, so an asynchronous run's last step trains alone on a core)."""
    return rows[1:-1] if len(rows) > 2 else rows[1:]


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
    """One asynchronous configuration against the synchronous run."""

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

    def line(self) -> str:
        return (
            f"sync {self.sync_steps_per_h:.0f} steps/h, async {self.async_steps_per_h:.0f} steps/h, "
            f"ratio {self.ratio:.2f}, ideal {self.ideal:.2f}, efficiency {self.efficiency:.2f}, "
            f"staleness max {self.staleness_max}"
        )


def figures(
    label: str, sync: Phases, runs: list[list[dict[str, Any]]], *, max_staleness: int, partial: bool
) -> Figures:
    """The asynchronous configuration's runs (pooled) against the synchronous run's phases."""
    a = phases(*runs)
    ratio = a.steps_per_hour / sync.steps_per_hour
    rows = [r for run_rows in runs for r in run_rows]
    timed = [r for run_rows in runs for r in timed_rows(run_rows)]
    return Figures(
        label,
        max_staleness,
        partial,
        sync.steps_per_hour,
        a.steps_per_hour,
        ratio,
        sync.ideal,
        ratio / sync.ideal,
        max(int(r["rollout/staleness_max"]) for r in rows),
        sum(float(r.get("rollout/partial_fraction", 0.0)) for r in timed) / len(timed),
        sum(float(r.get("rollout/staleness_tokens_mean", 0.0)) for r in timed) / len(timed),
        a,
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


def balanced_prompts(a: Probe, b: Probe) -> int:
    """The batch where generation meets training, from two probes at one cap and two batches: each
    phase follows a power law in the batch (training about linear, generation flatter), so
    log(generation / training) is linear in log(prompts); its zero is the estimate."""
    ra, rb = math.log(a.generation_s / a.training_s), math.log(b.generation_s / b.training_s)
    if a.prompts == b.prompts or ra == rb:
        return a.prompts if abs(ra) <= abs(rb) else b.prompts
    la, lb = math.log(a.prompts), math.log(b.prompts)
    estimate = math.exp(la - ra * (lb - la) / (rb - ra))
    return max(MIN_PROMPTS, min(MAX_PROMPTS, round(estimate)))


def scaled_tokens(p: Probe, target_s: float) -> int:
    """The cap at which the slower phase takes `target_s` (both phases grow about linearly with it)."""
    slower = max(p.generation_s, p.training_s)
    return max(MIN_TOKENS, min(MAX_TOKENS, round(p.tokens * target_s / max(slower, 1e-6))))


@dataclass(frozen=True)
class PowerLaws:
    """How each phase grows with the batch (prompts^exponent), from two probes at one cap."""

    generation: float
    training: float

    def carry(self, ref: Probe, prompts: int) -> Probe:
        """`ref`'s phases carried to `prompts` along the power laws."""
        scale = prompts / ref.prompts
        generation = ref.generation_s * scale**self.generation
        return Probe(prompts, ref.tokens, generation, ref.training_s * scale**self.training)

    def balanced(self, ref: Probe) -> int:
        """The batch where `ref`'s phases would meet (the cap changes their ratio too: answers stop at
        EOS, so generation grows with the longest and training with the mean)."""
        if self.training - self.generation < 0.05:
            return ref.prompts  # the batch cannot move the balance here
        gap = self.training - self.generation
        estimate = ref.prompts * (ref.generation_s / ref.training_s) ** (1 / gap)
        return max(MIN_PROMPTS, min(MAX_PROMPTS, round(estimate)))


def rebalanced(sync: Phases, prompts: int, tokens: int, laws: PowerLaws, target_s: float) -> tuple[int, int]:
    """The batch and cap where the synchronous (Ray) run's own phases would meet at `target_s`."""
    ref = Probe(prompts, tokens, sync.generation_s, sync.training_s)
    moved = laws.carry(ref, laws.balanced(ref))
    return moved.prompts, scaled_tokens(moved, target_s)


def calibrate(
    work: Path, *, target_s: float, log: Any, row_tokens: int = ROW_TOKENS
) -> tuple[int, int, list[Probe], PowerLaws]:
    """(prompts, response cap, every probe, the phases' power laws in the batch): where
    generation ≈ training ≈ target_s."""
    probes: list[Probe] = []

    def probe(prompts: int, tokens: int) -> Probe:
        # Local mode (rank and engine in this one process, still one thread each) times generation
        # and training near what the Ray runs take, without their 25 s of Ray start-up; where the
        # Ray run's phases still come out apart, `main` rebalances it from its own phases.
        cfg = make_config(
            steps=CALIBRATION_STEPS,
            response_tokens=tokens,
            prompts=prompts,
            max_staleness=0,
            launcher="local",
            row_tokens=row_tokens,
        )
        rows = run(cfg, work, "calibrate")
        ph = phases(rows)
        out = Probe(prompts, tokens, ph.generation_s, ph.training_s)
        probes.append(out)
        log(
            f"calibration: {prompts} prompts x {GROUP_SIZE}, {tokens} tokens: generation "
            f"{out.generation_s:.2f} s, training {out.training_s:.2f} s"
        )
        return out

    def imbalance(p: Probe) -> float:
        return abs(math.log(p.generation_s / p.training_s))

    a, b = probe(4, 48), probe(16, 48)
    # Each phase's power law in the batch, from the two probes at one cap (generation flat, training
    # about linear): how the phases move when the batch changes at any cap.
    span = math.log(b.prompts / a.prompts)
    laws = PowerLaws(
        math.log(b.generation_s / a.generation_s) / span, math.log(b.training_s / a.training_s) / span
    )

    prompts = balanced_prompts(a, b)
    ref = a if imbalance(a) <= imbalance(b) else b
    for _ in range(3):
        tokens = scaled_tokens(laws.carry(ref, prompts), target_s)
        if (prompts, tokens) in {(p.prompts, p.tokens) for p in probes}:
            break
        ref = probe(prompts, tokens)
        if (
            imbalance(ref) <= math.log(1.15)
            and abs(max(ref.generation_s, ref.training_s) / target_s - 1) <= 0.25
        ):
            break
        prompts = laws.balanced(ref)
    # The probe nearest to balance and to the target, its cap scaled to the target (on a shared
    # machine the last probe can be the noisiest).
    best = min(
        probes, key=lambda p: imbalance(p) + 0.5 * abs(math.log(max(p.generation_s, p.training_s) / target_s))
    )
    return best.prompts, scaled_tokens(best, target_s), probes, laws


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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps per run (about 4 minutes on 2 cores)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 8 quick, 18 full)")
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
    steps = args.steps or (8 if args.quick else 18)
    staleness = [int(s) for s in args.staleness.split(",") if s.strip()]
    if not staleness or min(staleness) < 1:
        raise SystemExit("--staleness takes maxStaleness values >= 1, e.g. 1,2")
    with tempfile.TemporaryDirectory(prefix="rljob-bench-pipeline-") as tmp:
        work = Path(tmp)
        prompts, tokens, probes, laws = calibrate(
            work, target_s=args.target_s, row_tokens=args.row_tokens, log=print
        )
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
            moved = rebalanced(sync, prompts, tokens, laws, args.target_s)
            if moved == (prompts, tokens):
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
                    "sync": {**asdict(sync), "rest_s": sync.rest_s, "ideal": sync.ideal},
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

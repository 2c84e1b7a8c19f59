"""Adaptive-mode benchmark: a seeded discrete-event simulator of a one-step-off GRPO job.

Role: shows what `rljob_operator.decide.policy.decide()` buys over a static split and over the seed's
snapshot rule when generation length drifts. Run `python bench/adaptive.py` (table) or
`python bench/adaptive.py --json`; `tests/unit/test_bench_adaptive.py` runs a short version. Pure
and deterministic: no clock, randomness only from `numpy.random.default_rng(seed + step)`, and
every policy sees the same response lengths at the same step (common random numbers).

The job (defaults: 8 accelerators, Qwen3-4B-like numbers on an H100-class card):
- 4 trainer accelerators; one colocated *shared* rollout engine sleeps on them; 2 *dedicated*
  engines (TP 1) on their own accelerators; 2 idle accelerators the policy may claim.
- One-step-off pipeline, as in the seed's run: at each weight sync the trainer pushes weights to
  the awake engines (`sync_base_s + sync_per_engine_s` per engine), the dedicated engines start
  generating the next batch with them while the trainer trains on the current one, and the
  trainer then waits for the batch. So nothing is in flight at any sync instant (the seed's blind
  spot). If requests are still *queued* when training ends and the shared engine is enabled, it
  wakes (`wake_s`), pulls queued requests, and sleeps again (`sleep_s`) before training resumes.
- Engines decode with continuous batching through one admission queue (the dispatcher). Each
  engine runs up to `min(max_num_seqs, kv_capacity_tokens // (prompt + mean response))`
  requests; one decode iteration takes `iter_base_s + iter_s_per_kv_token * Σ context tokens`
  (weights read + KV read), so longer responses lower both concurrency and per-token speed.
  Response lengths are lognormal around the trace's mean, capped at `max_response_tokens` (the
  spike at the completion cap), so long batches end in a tail no extra engine can shorten.
- Training on the trainer accelerators takes `train_fixed_s + tokens / train_tokens_per_s`.
- The operator sees one `SyncReport` per sync (integrated in-flight request-seconds, engine-seconds,
  the sync-instant snapshot, ...), calls `decide()`, and the driver applies shared targets at the
  next sync; a dedicated engine joins at the first sync `pod_start_s` after the decision and holds
  its accelerators from the decision on.

Policies: `static` (the launch plan, never changes), `static-max` (every accelerator from the start:
4 dedicated + shared enabled), `seed-snapshot` (`PolicySettings.seed_rule()`), `integrated` (ours,
the API defaults). Traces: `grow` (mean response 300 → 3000 tokens, as RL makes models think
longer), `grow-shrink` (300 → 3000 → 300), `flat-short` (300 throughout: adaptive must not act).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from rljob_operator.decide import policy
from rljob_trainer.outputs import telemetry, telemetry_sink


@dataclass(frozen=True)
class JobModel:
    """Numbers of the simulated job. Times in s, sizes in tokens."""

    prompts_per_step: int = 64
    group_size: int = 8
    prompt_tokens: int = 300
    max_response_tokens: int = 8192
    length_sigma: float = 0.7  # lognormal shape of response lengths
    # Decode model of one engine (TP 1).
    max_num_seqs: int = 256
    kv_capacity_tokens: int = 400_000
    iter_base_s: float = 0.008
    iter_s_per_kv_token: float = 4.4e-8
    # Trainer (4 accelerators).
    trainer_accelerators: int = 4
    train_fixed_s: float = 5.0
    train_tokens_per_s: float = 16_000.0
    # Engines and the cluster.
    total_accelerators: int = 8
    accelerators_per_engine: int = 1
    planned_dedicated_engines: int = 2
    shared_engines_total: int = 1
    wake_s: float = 5.0
    sleep_s: float = 2.0
    sync_base_s: float = 3.0
    sync_per_engine_s: float = 0.5
    pod_start_s: float = 120.0

    @property
    def responses_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


# ---- traces --------------------------------------------------------------------------------------


def _ramp(a: float, b: float, x: float) -> float:
    return a + (b - a) * min(1.0, max(0.0, x))


TRACES: dict[str, Callable[[int, int], float]] = {
    # mean response tokens at step `i` of `n`
    "grow": lambda i, n: _ramp(300.0, 3000.0, i / (0.8 * n)),
    "grow-shrink": lambda i, n: (
        _ramp(300.0, 3000.0, i / (0.4 * n))
        if i < 0.5 * n
        else _ramp(3000.0, 300.0, (i - 0.5 * n) / (0.3 * n))
    ),
    "flat-short": lambda i, n: 300.0,
}


def response_lengths(job: JobModel, mean_tokens: float, seed: int) -> np.ndarray:
    """Response lengths (tokens) of one batch: lognormal with mean `mean_tokens`, capped."""
    rng = np.random.default_rng(seed)
    mu = math.log(mean_tokens) - job.length_sigma**2 / 2
    raw = rng.lognormal(mu, job.length_sigma, job.responses_per_step)
    return np.clip(np.rint(raw), 16, job.max_response_tokens).astype(np.int64)


# ---- generation: continuous batching on several engines behind one admission queue ---------------


@dataclass
class _Engine:
    slots: int
    clock_tokens: int = 0  # tokens each running request has advanced since this engine started
    admit_sum: int = 0  # Σ over running requests of the clock at their admission
    running: list[tuple[int, int]] = field(default_factory=list)  # heap of (finish clock, admit clock)

    def iter_s(self, job: JobModel, ahead_tokens: float) -> float:
        """Seconds per decode iteration, context measured `ahead_tokens` into the segment."""
        c = len(self.running)
        ctx_tokens = c * (job.prompt_tokens + self.clock_tokens + ahead_tokens) - self.admit_sum
        return job.iter_base_s + job.iter_s_per_kv_token * ctx_tokens


class Generation:
    """One batch on engines that may join late; event-driven, exact up to the mid-segment context.

    All requests wait in one admission queue (the dispatcher); an engine admits while it has slots.
    Between two events of an engine its running requests advance in lockstep, so a segment ends
    when the first of them finishes."""

    def __init__(self, job: JobModel, lengths: np.ndarray, start_s: float, mean_tokens: float) -> None:
        self.job = job
        self.queue = [int(x) for x in lengths[::-1]]  # pop() from the end = dataset order
        self.outstanding = len(self.queue)
        self.now_s = start_s
        self.end_s = start_s
        self.inflight_request_seconds = 0.0
        kv_slots = job.kv_capacity_tokens // int(job.prompt_tokens + mean_tokens)
        self.slots = max(1, min(job.max_num_seqs, kv_slots))
        self.engines: list[_Engine] = []
        self.events: list[tuple[float, int]] = []  # (time s, engine index)

    def add_engine(self, join_s: float) -> None:
        self.engines.append(_Engine(self.slots))
        heapq.heappush(self.events, (join_s, len(self.engines) - 1))

    def run_until(self, limit_s: float = math.inf) -> None:
        """Process events up to `limit_s`, or until every response finished."""
        while self.outstanding and self.events and self.events[0][0] <= limit_s:
            t, idx = heapq.heappop(self.events)
            self.inflight_request_seconds += self.outstanding * (t - self.now_s)
            self.now_s = t
            eng = self.engines[idx]
            while eng.running and eng.running[0][0] <= eng.clock_tokens:
                _, admitted = heapq.heappop(eng.running)
                eng.admit_sum -= admitted
                self.outstanding -= 1
            if not self.outstanding:
                self.end_s = t
                return
            while self.queue and len(eng.running) < eng.slots:
                heapq.heappush(eng.running, (eng.clock_tokens + self.queue.pop(), eng.clock_tokens))
                eng.admit_sum += eng.clock_tokens
            if eng.running:
                step_tokens = eng.running[0][0] - eng.clock_tokens
                dt_s = step_tokens * eng.iter_s(self.job, step_tokens / 2)
                eng.clock_tokens += step_tokens
                heapq.heappush(self.events, (t + dt_s, idx))
        if self.outstanding and limit_s < math.inf:
            self.inflight_request_seconds += self.outstanding * (limit_s - self.now_s)
            self.now_s = limit_s


# ---- the job -------------------------------------------------------------------------------------

POLICIES = ("static", "static-max", "seed-snapshot", "integrated")


def policy_settings(name: str) -> policy.PolicySettings | None:
    """Settings for an adaptive policy name; None for the static splits."""
    if name == "seed-snapshot":
        return policy.PolicySettings.seed_rule()
    if name == "integrated":
        return policy.PolicySettings()
    if name in ("static", "static-max"):
        return None
    raise ValueError(f"unknown policy {name!r}; valid: {', '.join(POLICIES)}")


@dataclass(frozen=True)
class RunResult:
    trace: str
    policy: str
    steps: int
    total_s: float
    steps_per_hour: float
    accelerator_hours: float
    steps_per_accelerator_hour: float
    mean_trainer_wait_fraction: float
    actions: dict[str, int]
    first_action_step: int | None
    max_dedicated_engines: int


def simulate(
    trace: str, policy_name: str, *, steps: int = 200, seed: int = 0, job: JobModel | None = None
) -> RunResult:
    """Run one job of `steps` optimizer steps under one policy; returns its totals."""
    job = job or JobModel()
    mean_of = TRACES[trace]
    settings = policy_settings(policy_name)
    if policy_name == "static-max":
        spare = job.total_accelerators - job.trainer_accelerators
        job = replace(job, planned_dedicated_engines=spare // job.accelerators_per_engine)
    tp = job.accelerators_per_engine
    shared_target = job.shared_engines_total if policy_name == "static-max" else 0
    dedicated_target = job.planned_dedicated_engines
    driver_view = (shared_target, dedicated_target)  # what the driver read at the last sync
    ready_s: list[float] = [0.0] * job.planned_dedicated_engines  # pod ready times, allocated pods
    last_action_s: float | None = None
    history: list[telemetry.SyncReport] = []
    actions: dict[str, int] = {}
    first_action: int | None = None
    accel_s = 0.0
    waited_s = 0.0
    max_dedicated = 0

    def batch(i: int) -> tuple[np.ndarray, float]:
        mean = mean_of(i, steps)
        return response_lengths(job, mean, seed * 100_003 + i), mean

    # Batch 0: generated before the first step by the planned engines; the trainer waits for it.
    lengths, mean = batch(0)
    gen = Generation(job, lengths, 0.0, mean)
    for _ in range(job.planned_dedicated_engines):
        gen.add_engine(0.0)
    gen.run_until()
    t_s = gen.end_s
    accel_s += t_s * (job.trainer_accelerators + len(ready_s) * tp)
    current = lengths

    for k in range(steps):
        # Sync k: the driver applies the targets it read; dedicated pods that are ready join.
        shared_awake, dedicated_wanted = driver_view
        dedicated = min(dedicated_wanted, sum(1 for r in ready_s if r <= t_s))
        max_dedicated = max(max_dedicated, dedicated)
        sync_s = job.sync_base_s + job.sync_per_engine_s * (dedicated + shared_awake)
        gen_start_s = t_s + sync_s
        train_s = (
            job.train_fixed_s + (current.sum() + len(current) * job.prompt_tokens) / job.train_tokens_per_s
        )
        train_end_s = gen_start_s + train_s
        lengths, mean = batch(k + 1)
        gen = Generation(job, lengths, gen_start_s, mean)
        for _ in range(dedicated):
            gen.add_engine(gen_start_s)
        gen.run_until(train_end_s)
        shared_s = 0.0
        if gen.outstanding and shared_awake and gen.queue:
            for _ in range(shared_awake):
                gen.add_engine(train_end_s + job.wake_s)
            gen.run_until()
            resume_s = max(gen.end_s, train_end_s + job.wake_s) + job.sleep_s
            shared_s = shared_awake * max(0.0, gen.end_s - (train_end_s + job.wake_s))
        else:
            gen.run_until()
            resume_s = max(gen.end_s, train_end_s)
        wait_s = resume_s - train_end_s
        interval_s = resume_s - t_s
        accel_s += interval_s * (job.trainer_accelerators + len(ready_s) * tp)
        waited_s += wait_s
        report = telemetry.SyncReport(
            step=k,
            time=resume_s,
            interval_s=interval_s,
            trainer_wait_s=wait_s,
            generation_s=gen.end_s - gen_start_s,
            training_s=train_s,
            inflight_request_seconds=gen.inflight_request_seconds,
            engine_seconds=dedicated * interval_s + shared_s,
            snapshot_inflight=gen.outstanding,  # at the sync instant: the batch is complete, so 0
            shared_engines_awake=shared_awake,
            dedicated_engines=dedicated,
            mean_reward=0.0,
            loss=0.0,
            tokens_per_s=float(current.sum()) / train_s,
            response_len_mean=float(current.mean()),
        )
        history = telemetry.append_report(history, report)
        t_s = resume_s
        current = lengths
        driver_view = (shared_target, dedicated_target)  # the driver reads status at the next sync
        if settings is None:
            continue
        state = policy.RolloutState(
            shared_engines_total=job.shared_engines_total,
            shared_engines_awake=shared_target,
            dedicated_engines=dedicated_target,
            planned_dedicated_engines=job.planned_dedicated_engines,
            idle_accelerators=job.total_accelerators - job.trainer_accelerators - len(ready_s) * tp,
            accelerators_per_engine=tp,
            last_action_time_s=last_action_s,
        )
        decision = policy.decide(state, history, settings, t_s)
        if decision.action == "none":
            continue
        actions[decision.action] = actions.get(decision.action, 0) + 1
        first_action = k if first_action is None else first_action
        last_action_s = t_s
        shared_target = decision.desired_shared_awake
        while decision.desired_dedicated_engines > len(ready_s):
            ready_s.append(t_s + job.pod_start_s)
        del ready_s[decision.desired_dedicated_engines :]  # newest pods go first
        dedicated_target = decision.desired_dedicated_engines

    return RunResult(
        trace=trace,
        policy=policy_name,
        steps=steps,
        total_s=t_s,
        steps_per_hour=steps * 3600.0 / t_s,
        accelerator_hours=accel_s / 3600.0,
        steps_per_accelerator_hour=steps * 3600.0 / accel_s,
        mean_trainer_wait_fraction=waited_s / t_s,
        actions=actions,
        first_action_step=first_action,
        max_dedicated_engines=max_dedicated,
    )


def run_bench(traces: Sequence[str], *, steps: int, seed: int) -> list[RunResult]:
    return [simulate(t, p, steps=steps, seed=seed) for t in traces for p in POLICIES]


def ratios(results: Sequence[RunResult]) -> dict[str, dict[str, float]]:
    """Per trace: integrated's steps/hour over static's, static-max's and seed-snapshot's."""
    out: dict[str, dict[str, float]] = {}
    by = {(r.trace, r.policy): r for r in results}
    for trace in dict.fromkeys(r.trace for r in results):
        ours = by[(trace, "integrated")].steps_per_hour
        out[trace] = {
            f"integrated/{p}": ours / by[(trace, p)].steps_per_hour for p in POLICIES if p != "integrated"
        }
    return out


def format_table(results: Sequence[RunResult]) -> str:
    head = (
        f"{'trace':<12} {'policy':<14} {'steps/h':>8} {'accel-h':>8} {'steps/accel-h':>13} "
        f"{'wait':>6} {'maxDed':>6} {'first':>5}  actions"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        acts = ", ".join(f"{k}={v}" for k, v in sorted(r.actions.items())) or "-"
        first = "-" if r.first_action_step is None else str(r.first_action_step)
        lines.append(
            f"{r.trace:<12} {r.policy:<14} {r.steps_per_hour:>8.2f} {r.accelerator_hours:>8.2f} "
            f"{r.steps_per_accelerator_hour:>13.3f} {r.mean_trainer_wait_fraction * 100:>5.1f}% "
            f"{r.max_dedicated_engines:>6} {first:>5}  {acts}"
        )
    lines.append("")
    for trace, rs in ratios(results).items():
        lines.append(f"{trace:<12} " + "  ".join(f"{k} = {v:.3f}x" for k, v in rs.items()))
    return "\n".join(lines)


# ---- the real driver ------------------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]
REAL_EXAMPLE = REPO / "examples" / "adaptive-gpu-local.yaml"
REAL_REWARD = REPO / "examples" / "rewards" / "length_phases.py"


@dataclass
class RealDecision:
    t_s: float
    step: int
    action: str
    shared_awake: int
    dedicated: int
    reason: str


class PolicySink(telemetry_sink.TelemetrySink):
    """The operator's half, in process: each SyncReport history the driver publishes goes through
    `policy.decide()` with the state the operator would build (`steps._adapt`), and the targets
    come back at the driver's next `read_targets()`, as they would through `status.rollout`."""

    def __init__(
        self, settings: policy.PolicySettings, *, shared_total: int, total: int, trainer: int
    ) -> None:
        super().__init__(
            enabled=False,
            job_name="bench-adaptive",
            namespace=None,
            configmap_name=None,
            prometheus_port=None,
        )
        self.settings, self.shared_total, self.total, self.trainer = settings, shared_total, total, trainer
        self.shared_awake, self.dedicated, self.last_action_s = 0, 0, None
        self.decisions: list[RealDecision] = []
        self.reports: list[telemetry.SyncReport] = []
        self.t0 = time.time()

    def publish(self, history: Sequence[telemetry.SyncReport], metrics: Mapping[str, Any]) -> None:
        r = history[-1]
        self.reports.append(r)
        waited = r.trainer_wait_s / max(r.interval_s, 1e-9)
        print(
            f"  t={time.time() - self.t0:6.1f}s step {r.step:>3} waited {waited:4.0%} of {r.interval_s:.2f}s,"
            f" generation {r.generation_s:5.2f}s, response {r.response_len_mean:4.1f} tokens, "
            f"engines {r.shared_engines_awake}+{r.dedicated_engines}",
            flush=True,
        )
        state = policy.RolloutState(
            shared_engines_total=self.shared_total,
            shared_engines_awake=self.shared_awake,
            dedicated_engines=self.dedicated,
            idle_accelerators=max(0, self.total - self.trainer - self.dedicated),
            last_action_time_s=self.last_action_s,
        )
        now = time.time()
        d = policy.decide(state, history, self.settings, now)
        if d.action == "none":
            return
        self.shared_awake, self.dedicated, self.last_action_s = (
            d.desired_shared_awake,
            d.desired_dedicated_engines,
            now,
        )
        step = history[-1].step
        self.decisions.append(
            RealDecision(now - self.t0, step, d.action, self.shared_awake, self.dedicated, d.reason)
        )
        print(f"  t={now - self.t0:6.1f}s step {step:>3} {d.action}: {d.reason}", flush=True)

    def read_targets(self) -> telemetry_sink.EngineTargets:
        return telemetry_sink.EngineTargets(self.shared_awake, self.dedicated)

    def write_history(self, history: Sequence[telemetry.SyncReport]) -> None:
        del history


def real_driver_run(*, steps: int, short_from_step: int, workdir: Path) -> dict[str, Any]:
    """The real GRPO driver on `examples/adaptive-gpu-local.yaml` (rendered by the operator's own
    planner and builders, torch on CPU as on the local-exec GPU nodes), on a private Ray node that
    stands for trainer pod 0 and rollout pod 0: ranks and engines are Ray actors, i.e. their own
    processes. Its reward asks for long answers until `short_from_step`, then for short ones, so
    the waits the policy reads are the driver's own measurements."""
    import ray
    import yaml

    from rljob_operator import api, builders
    from rljob_operator.decide import planning
    from rljob_trainer import __main__ as trainer_main
    from rljob_trainer import config as config_mod
    from rljob_trainer import driver, runtimes

    manifest = yaml.safe_load(REAL_EXAMPLE.read_text())
    spec = api.RLJobSpec.model_validate(manifest["spec"])
    model_config = dict(spec.model.config.inline or {})
    plan = planning.plan_status(planning.plan_job(spec, model_config))
    reward = workdir / "reward.py"
    reward.write_text(
        REAL_REWARD.read_text().replace("SHORT_FROM_STEP = 50", f"SHORT_FROM_STEP = {short_from_step}")
    )
    data = config_mod.cpu_standin(builders.render_trainer_config(spec, plan, model_config)).model_dump()
    data["grpo"]["max_steps"] = steps
    data["rewards"][0]["path"] = str(reward)
    data["checkpoint"] = {"dir": None, "interval_steps": steps}
    data["export"]["final"] = False
    data["telemetry"].update(enabled=False, prometheus_port=None)
    data["distributed"]["torch_threads_per_rank"] = 1
    cfg = config_mod.TrainerConfig.model_validate(data)
    settings = policy.PolicySettings.from_adaptive_spec(spec.resources.adaptive)
    sink = PolicySink(
        settings,
        shared_total=plan.shared_engines or 0,
        total=spec.resources.total_accelerators,
        trainer=plan.trainer_accelerators or 0,
    )
    trainer_main._start_ray_driver(cfg, {}, local_rollout_pods=cfg.rollout.max_dedicated_engines)
    try:
        d = driver.GRPODriver(cfg, runtimes.RayRuntime(cfg), sink=sink)
        try:
            d.run(steps)
        finally:
            d.shutdown()
    finally:
        ray.shutdown()
    reports = sink.reports

    def median_step_s(keep: Callable[[telemetry.SyncReport], bool]) -> float | None:
        gaps = [b.time - a.time for a, b in itertools.pairwise(reports) if keep(a) and keep(b)]
        return sorted(gaps)[len(gaps) // 2] if len(gaps) >= 3 else None

    shared_only = median_step_s(lambda r: r.dedicated_engines == 0 and r.step < short_from_step)
    with_dedicated = median_step_s(lambda r: r.dedicated_engines >= 1 and r.step < short_from_step)
    return {
        "decisions": [asdict(x) for x in sink.decisions],
        "step_s_shared_only": shared_only,
        "step_s_with_dedicated": with_dedicated,
        "wait_fraction": [
            round(r.trainer_wait_s / r.interval_s, 2) if r.interval_s else 0.0 for r in reports
        ],
        "response_len": [round(r.response_len_mean, 1) for r in reports],
    }


def format_real(result: Mapping[str, Any]) -> str:
    acts = ", ".join(f"{d['action']}@step{d['step']}({d['t_s']:.0f}s)" for d in result["decisions"]) or "none"
    a, b = result["step_s_shared_only"], result["step_s_with_dedicated"]
    speed = f"{a:.2f} -> {b:.2f} s/step ({a / b:.2f}x steps/h)" if a and b else "not measured"
    return f"adaptive-real: decisions {acts}; generation-bound phase {speed}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", action="append", choices=sorted(TRACES), help="default: all")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--real",
        action="store_true",
        help="also run the real driver (Ray actors as processes, CPU) on examples/adaptive-gpu-local.yaml",
    )
    parser.add_argument("--real-steps", type=int, default=80)
    parser.add_argument(
        "--real-short-from", type=int, default=30, help="step the reward turns to short answers"
    )
    args = parser.parse_args(argv)
    if args.real:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            print(f"real driver: {args.real_steps} steps, short answers from step {args.real_short_from}")
            real = real_driver_run(
                steps=args.real_steps, short_from_step=args.real_short_from, workdir=Path(tmp)
            )
        print(json.dumps(real) if args.json else format_real(real))
        return 0
    results = run_bench(args.trace or list(TRACES), steps=args.steps, seed=args.seed)
    if args.json:
        print(json.dumps({"results": [asdict(r) for r in results], "ratios": ratios(results)}, indent=2))
    else:
        print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

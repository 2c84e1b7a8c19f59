"""The GRPO driver: places training ranks and rollout engines, and runs the step loop.

Role: on trainer pod 0 (inside the Ray head), or in one process in local mode, the driver
  1. places `num_trainer_ranks` training ranks (`trainer.TrainingRank`) and rollout engines
     (`engines.build_engine`) through a runtime: `RayRuntime` (Ray actors; a dedicated engine j is
     pinned to rollout pod j by the Ray custom resource `rljob_rollout_<j>` that pod advertises) or
     `LocalRuntime` (same objects, called in-process; one rank);
  2. per step: takes the step's complete batch of rollouts from its `pipeline.RolloutPipeline`
     (prompts sampled, `prompts × group` requests dispatched to the awake engines through the
     `dispatcher.Dispatcher`, generated up to `grpo.maxStaleness` steps ahead on dedicated engines,
     requeued when an engine is lost), scores rewards, computes group-normalised advantages,
     DP-balances each mini-batch (`dp_balance.plan_dp_balance`, same micro-batch planner the ranks
     execute) and trains while the pipeline keeps generating;
  3. at the sync point: pushes the new weights into every engine in place, closes the dispatcher's
     interval into a `telemetry.SyncReport`, publishes it (logs, Prometheus, ConfigMap), reads the
     desired engine counts back and wakes/sleeps shared engines and adds/drops dedicated ones (the
     engines are the driver's: the pipeline asks it to drop one that died or hung);
  4. checkpoints every `checkpoint.interval_steps` and resumes from the latest checkpoint;
  5. with config `endpoint` (an environment of mode agent), serves the job's OpenAI-compatible
     endpoint (`rollout.endpoint`) from `setup` to `shutdown`, its token from `$RLJOB_ENDPOINT_TOKEN`.
Callers: `rljob_trainer.__main__`, integration tests.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rljob_trainer import config as config_mod
from rljob_trainer import dp_balance, runtimes
from rljob_trainer.data import evaluation, judge, rewards, sources
from rljob_trainer.engines import base as engine_base
from rljob_trainer.model import modeling
from rljob_trainer.outputs import checkpoint, export, telemetry, telemetry_sink, tracking
from rljob_trainer.rollout import (
    agent,
    agent_loop,
    buffer,
    dispatcher,
    endpoint_episode,
    engine_sync,
    pipeline,
)
from rljob_trainer.rollout import endpoint as endpoint_mod
from rljob_trainer.train import algos, dynamic_sampling, train_metrics, trainer
from rljob_trainer.weights import weight_sync

log = logging.getLogger("rljob_trainer.driver")


# How long a dropped engine may take to stop its own processes before its actor is killed.
ENGINE_SHUTDOWN_TIMEOUT_S = 30.0
# How long a new engine may take to start (actor process, imports, model build) before it is lost.
ENGINE_START_TIMEOUT_S = 300.0

# The runtimes live in `rljob_trainer.runtimes`; these names stay importable from here.
Host = runtimes.Host
LocalRuntime = runtimes.LocalRuntime
RayRuntime = runtimes.RayRuntime
Runtime = runtimes.Runtime


# The pipeline's names stay importable from here.
EngineState = pipeline.EngineState
sample_seed = pipeline.sample_seed


# ---- pure helpers --------------------------------------------------------------------------------
def split_mini_batches(n: int, count: int) -> list[list[int]]:
    """Contiguous index ranges of `count` equal mini-batches (n divisible by count, checked in config)."""
    size = n // count
    return [list(range(i * size, (i + 1) * size)) for i in range(count)]


def shard_for_ranks(
    lengths: Sequence[int], dp_size: int, *, spec: Any, cost: Any, enabled: bool
) -> tuple[list[list[int]], dict[str, Any]]:
    """Indices each rank trains on, and the `dp_balance/*` metrics.

    Divisible batches go through `plan_dp_balance` (identity when disabled or not better);
    otherwise contiguous slices, the first n % P ranks one larger (what the planner assumes).
    """
    n = len(lengths)
    if enabled and n % dp_size == 0 and n > 0:
        plan = dp_balance.plan_dp_balance(lengths, dp_size, micro_batch=spec, cost=cost)
        return [plan.rank_indices(r) for r in range(dp_size)], dict(plan.metrics)
    sizes = trainer.split_evenly(n, dp_size)
    out, start = [], 0
    for s in sizes:
        out.append(list(range(start, start + s)))
        start += s
    return out, {}


# ---- the driver ----------------------------------------------------------------------------------
class EngineLost(RuntimeError):
    """An engine died or hung past rollout.engineTimeoutS."""


def describe_platform(caps: dict[str, Any]) -> str:
    """One line of what an engine's platform can do (`engines.platform.EngineCapabilities` as a dict),
    for the log, the SyncReport and the operator's status."""
    sleep = "sleep mode" if caps.get("sleep_mode") else "no sleep mode (sleep = stop, wake = restart)"
    return f"vLLM {caps.get('vllm_version')} on {caps.get('device_type')}, {sleep}"


@dataclass
class DriverState:
    step: int = 0
    sampler: sources.SamplerState = field(default_factory=sources.SamplerState)
    history: list[telemetry.SyncReport] = field(default_factory=list)


class GRPODriver:
    def __init__(
        self,
        cfg: config_mod.TrainerConfig,
        runtime: Runtime,
        *,
        sink: telemetry_sink.TelemetrySink | None = None,
        metrics_path: str | Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        endpoint_token: str | None = None,
    ) -> None:
        """`endpoint_token`: the endpoint's bearer token (default `$RLJOB_ENDPOINT_TOKEN`, which the
        operator sets on trainer pod 0 from the job's Secret); only read with config `endpoint`."""
        self.cfg = cfg
        self.rt = runtime
        self.sink = sink
        self.metrics_path = Path(metrics_path) if metrics_path else None
        self.clock = clock
        self.wall_clock = wall_clock
        self.tokenizer = modeling.load_tokenizer(cfg.model)
        # Prompts over lengths.maxPromptTokens are dropped, never cut (metric data/dropped_prompts).
        self.examples, dropped = sources.load_fitting_examples(
            cfg.data, self.tokenizer, max_prompt_tokens=cfg.lengths.max_prompt_tokens
        )
        # Multi-turn episodes (spec.rollout.agent): the tools are offered in the prompt, so it must fit too.
        self.agent_loop = agent_loop.AgentLoop(cfg, self.tokenizer) if cfg.agent else None
        if self.agent_loop is not None:
            self.examples, more = self.agent_loop.fitting_examples(self.examples, "agent prompts")
            dropped = [*dropped, *more]
        self.dropped_prompts = len(dropped)
        self.reward_fn = rewards.build_reward_fn(cfg.rewards)
        self.adv_fn = algos.get_adv_estimator(cfg.grpo.adv_estimator)
        self.spec = trainer.micro_batch_spec(cfg.batching)
        hf = cfg.model.hf_config
        self.cost = dp_balance.CostModel.from_hf_config(hf) if hf else None
        self.dispatcher = dispatcher.Dispatcher(clock)
        self.state = DriverState()
        self.ranks: list[Any] = []
        self.engines: dict[str, pipeline.EngineState] = {}
        self.shared_awake_target = cfg.rollout.shared_engines if cfg.rollout.dedicated_engines == 0 else 0
        self.dedicated_target = cfg.rollout.dedicated_engines
        self._last_sync = clock()
        self._weights: tuple[tuple[int, str], Any] | None = None
        self._checkpoint_acked: str | None = None  # the operator's last checkpoint request honoured
        self._resume_note: str | None = None  # checkpoints skipped at resume (checkpoint.load_latest)
        # An environment of mode agent: the job's OpenAI-compatible endpoint (started in setup).
        self.endpoint: endpoint_mod.Endpoint | None = None
        if cfg.endpoint is not None:
            token = (
                endpoint_token
                if endpoint_token is not None
                else os.environ.get(config_mod.ENV_ENDPOINT_TOKEN)
            )
            settings = cfg.endpoint
            if os.environ.get(config_mod.ENV_ENDPOINT_PORT):  # the pod's container port wins
                settings = settings.model_copy(update={"port": int(os.environ[config_mod.ENV_ENDPOINT_PORT])})
            self.endpoint = endpoint_mod.Endpoint(
                settings,
                token or "",
                modeling.load_tokenizer(cfg.model),  # its own: the endpoint's HTTP threads use it
                model_name=cfg.endpoint.model_name or cfg.model.name,
                limits=endpoint_mod.Limits.from_config(cfg),
                clock=clock,
                wall_clock=wall_clock,
            )
        self.pipeline = pipeline.RolloutPipeline(
            cfg,
            runtime,
            self.dispatcher,
            self.engines,
            self,
            examples=self.examples,
            encode_prompt=self._encode_prompt if self.agent_loop is None else self.agent_loop.prompt_ids,
            clock=clock,
            agent_loop=self.agent_loop,
            endpoint=self.endpoint,
        )
        self._lost_pods: set[int] = set()  # dropped since the last report (SyncReport.lostRolloutPods)
        # What each engine's platform said it can do (`engines.platform.EngineCapabilities`, from load()).
        self.engine_caps: dict[str, dict[str, Any]] = {}
        self._wakes: list[tuple[float, bool]] = []  # shared wakes since the last report: (s, restarted)
        self._released_pods: set[int] = set()  # drained after a lowered target, not re-added since
        self._vllm_api = weight_sync.detect_vllm_weight_transfer() if cfg.rollout.kind == "vllm" else None
        self.weight_transfer: dict[str, weight_sync.WeightTransferChoice] = {}  # by engine name
        self._collective = self._transfer_choice(colocated=False).path == weight_sync.PATH_COLLECTIVE
        self.tracker = tracking.Trackers.from_config(cfg, run_name=sink.job_name if sink else None)
        self.skip_guard = train_metrics.SkipGuard(cfg.grpo.max_skipped_steps)
        self.evaluator = evaluation.Evaluator.from_config(cfg, self.tokenizer) if cfg.evaluation else None
        self._unreported_baseline_eval: float | None = None  # `_evaluate_before_training`'s, until reported
        # spec.reward.judge: a served model's scores, on engines of its own (started in setup).
        self.judge = judge.Judge(cfg, runtime) if cfg.judge else None
        self._judge_metrics: dict[str, float] = {}

    # ---- setup -----------------------------------------------------------------------------------
    def setup(self) -> None:
        world = self.cfg.distributed.num_trainer_ranks
        self.ranks = self.rt.create_ranks(world)
        addr, port = self.rt.get(self.rt.submit(self.ranks[0], "node_address"))
        # Memory order: shared engines start while their accelerators are empty (vLLM reserves
        # gpu_memory_utilization x the device at start, and refuses to start with less free), then
        # sleep; the ranks load model, optimizer and reference into what the sleep freed.
        shared = [f"shared-{i}" for i in range(self.cfg.rollout.shared_engines)]
        self._start_engines({name: None for name in shared}, colocated=True)
        self.sleep_shared_engines()
        infos = self.rt.get([self.rt.submit(r, "setup", addr, port) for r in self.ranks])
        log.info("training ranks ready: %s", infos)
        for name in shared:  # their weight channels need the ranks' models
            if name in self.engines:
                self._join_engine(name)
        self._resume()
        self.pipeline.start_at(self.state.sampler, self.state.step + 1)
        self.reconcile_dedicated()
        self.placement = self.check_placement()
        if self.judge is not None:
            self.judge.start()
        if self.endpoint is not None:  # no episode opens before the first step's fill()
            self.endpoint.start()
        self._sync_awake_engines()
        self.sleep_shared_engines()
        self._last_sync = self.clock()
        self.dispatcher.close_interval()

    def check_placement(self) -> list[dict[str, Any]]:
        """Ray's record of where every rank and engine runs, checked against the plan; logged as one
        `placement: [...]` JSON line. Raises naming the first actor that is not in its planned pod."""
        if not isinstance(self.rt, runtimes.RayRuntime):
            return []
        actors: list[tuple[str, Any, str]] = [
            (f"rank-{r}", h, slot.pod)
            for r, (h, slot) in enumerate(zip(self.ranks, self.rt.rank_slots(), strict=True))
        ]
        for name, eng in sorted(self.engines.items()):
            slot = self.rt.engine_slot(name, colocated=eng.colocated, pod_index=eng.pod_index)
            actors.append((name, eng.handle, slot.pod))
        records = self.rt.get([self.rt.where(h) for _, h, _ in actors])
        pods = self.rt.node_pods()
        out = []
        for (name, _, planned), rec in zip(actors, records, strict=True):
            node = pods.get(rec["node_id"], ())
            where = planned if planned in node else ",".join(node) or None
            out.append(
                {"actor": name, "pod": where, "planned": planned, "accelerators": rec["accelerator_ids"]}
            )
            if where != planned:
                raise RuntimeError(
                    f"{name} runs on the Ray node of {where}, but the placement plan puts it on {planned}"
                )
        log.info("placement: %s", json.dumps(out, sort_keys=True))
        return out

    @property
    def weights_version(self) -> int:
        """Version of the trainer's current weights: the number of steps trained."""
        return self.state.step

    @property
    def _sleep_mode(self) -> bool:
        return self.cfg.rollout.enable_sleep_mode

    def _transfer_choice(self, *, colocated: bool) -> weight_sync.WeightTransferChoice:
        device, _ = trainer.resolve_device_and_backend(self.cfg.distributed)
        return weight_sync.choose_weight_transfer(
            engine_kind=self.cfg.rollout.kind,
            colocated=colocated,
            weight_sync=self.cfg.rollout.weight_sync,
            device_type=device,
            ray=isinstance(self.rt, runtimes.RayRuntime),
            vllm=self._vllm_api,
            engine_lora=self.cfg.rollout.engine_lora,
        )

    def _start_engines(self, pods: dict[str, int | None], *, colocated: bool) -> None:
        """Create the engines `pods` names (engine name -> rollout pod index, None when colocated)
        and load them all at once (vLLM reserves its memory here). Each sits on its own accelerators,
        so none waits for another's minute of process start, imports and model load; one that fails
        or hangs is dropped as lost, the others start."""
        loads = {}
        for name, pod_index in pods.items():
            handle = self.rt.create_engine(name, colocated=colocated, pod_index=pod_index)
            self.engines[name] = pipeline.EngineState(name, handle, colocated, pod_index)
            loads[name] = self.rt.submit(handle, "load")
        # Starting an engine (process, imports, model) may take longer than any call of a running one.
        start_timeout = max(self.cfg.rollout.engine_timeout_s, ENGINE_START_TIMEOUT_S)
        for name, caps in self._settle(loads, what="load", timeout_s=start_timeout).items():
            if caps:
                if not self.engine_caps:
                    log.info("rollout engine platform: %s", describe_platform(caps))
                self.engine_caps[name] = caps
            if colocated and self._sleeps_by_restart(name):
                # Such an engine is not started by load(): it would be stopped at once (`VLLMEngine.load`).
                self.engines[name].asleep = True
                if not self.cfg.rollout.engine_lora:
                    self.engines[name].version = engine_sync.DISCARDED

    @property
    def engine_platform(self) -> str | None:
        """What the engines' platform can do, in one line (`describe_platform`); None without vLLM."""
        caps = next(iter(self.engine_caps.values()), None)
        return describe_platform(caps) if caps else None

    def _sleeps_by_restart(self, name: str) -> bool:
        """A shared engine whose platform has no sleep mode: sleeping stops it, waking starts it."""
        caps = self.engine_caps.get(name)
        return self._sleep_mode and caps is not None and not caps.get("sleep_mode", True)

    def _join_engine(self, name: str) -> None:
        """Open a started engine's weight channel and hand it to the dispatcher."""
        if name not in self.engines:
            raise EngineLost(f"engine {name} was lost while it started")
        colocated, pod_index = self.engines[name].colocated, self.engines[name].pod_index
        choice = self._transfer_choice(colocated=colocated)
        if choice not in self.weight_transfer.values():  # once per kind of engine and path
            # A fallback path (collective_rpc: vLLM documents it for control messages) is a warning.
            log.log(
                logging.WARNING if choice.fallback and self.cfg.rollout.kind == "vllm" else logging.INFO,
                "weight transfer to %s engines: %s, backend %s (%s)",
                "colocated" if colocated else "dedicated",
                choice.path,
                choice.backend,
                choice.reason,
            )
        self.weight_transfer[name] = choice
        engine_sync.join(self, name, choice)
        if name not in self.engines:
            raise EngineLost(f"engine {name} was lost while it started")
        awake = self.engines[name].awake  # a shared engine started asleep (setup's memory order)
        self.dispatcher.set_engine(name, awake=awake, capacity=self.cfg.rollout.max_num_seqs)
        if pod_index is not None:
            self._released_pods.discard(pod_index)
        log.info("engine %s up (colocated=%s, pod=%s)", name, colocated, pod_index)

    def drop_engine(self, name: str, *, lost: bool = False) -> None:
        """Drop an engine: its queued and in-flight requests go back to the queue, its calls are
        forgotten, its weight group on rank 0 is closed. A lost dedicated engine's pod is reported."""
        eng = self.engines.pop(name)
        self.dispatcher.remove_engine(name)
        self.pipeline.forget_engine(name)
        choice = self.weight_transfer.get(name)
        if choice is not None and choice.path == weight_sync.PATH_COLLECTIVE:
            self.rt.submit(self.ranks[0], "weight_group_close", name)  # queued behind the rank's work
        elif choice is not None and choice.path == weight_sync.PATH_VLLM_NATIVE:
            for r in self.ranks:  # every rank holds an end of a vLLM channel
                self.rt.submit(r, "vllm_transfer_close", name)
        self._shutdown_engines({name: eng.handle})
        try:
            self.rt.kill(eng.handle)
        except Exception as e:  # already gone with its node
            log.debug("kill %s: %s", name, e)
        self.engine_caps.pop(name, None)
        if lost and eng.pod_index is not None:
            self._lost_pods.add(eng.pod_index)
        log.info("engine %s %s", name, "lost" if lost else "dropped")
        if lost and eng.colocated:
            self._restart_shared(name)

    def _shutdown_engines(self, handles: dict[str, Any]) -> None:
        """Let engines stop their own processes, all at once (vLLM's EngineCore and workers outlive a
        killed actor that did not shut them down); one that does not answer in time is killed anyway."""
        futures = {}
        for name, handle in handles.items():
            try:
                futures[name] = self.rt.submit(handle, "shutdown")
            except Exception as e:  # a dead actor
                log.debug("shutdown %s: %s", name, e)
        deadline = self.clock() + ENGINE_SHUTDOWN_TIMEOUT_S
        while futures:
            done = self.rt.wait_any(list(futures.values()), max(0.0, deadline - self.clock()))
            if not done:
                break
            for name, fut in list(futures.items()):
                if fut in done:
                    del futures[name]
                    try:
                        self.rt.get(fut)
                    except Exception as e:  # vLLM already gone
                        log.debug("shutdown %s: %s", name, e)

    def _restart_shared(self, name: str) -> None:
        """A lost shared engine is started again on its trainer pod (no pod to replace: the trainer
        pod holds it), asleep as at setup; it takes the current weights when it is next woken."""
        try:
            self._start_engines({name: None}, colocated=True)
            if name in self.engines:
                self.engines[name].awake = False
                self._join_engine(name)
        except EngineLost as e:
            log.warning("shared engine %s could not be started again: %s", name, e)
            return
        if name in self.engines and self._sleep_mode:
            self.rt.get(self.rt.submit(self.engines[name].handle, "sleep", self.cfg.rollout.sleep_level))
            self.engines[name].asleep = True
            self.engines[name].version = engine_sync.DISCARDED
        log.info("shared engine %s started again after it was lost", name)

    def _settle(
        self,
        futures: dict[str, Any],
        *,
        what: str,
        timeout_s: float | None = None,
        drop_on_error: bool = False,
    ) -> dict[str, Any]:
        """Results of one call per engine; an engine that died or did not answer within `timeout_s`
        (default rollout.engineTimeoutS) is dropped as lost (absent from the result), never failing
        the job. With `drop_on_error` (weight transfers) so is one whose call raised, unless it broke
        a sleep rule (`base.EngineStateError`: a driver bug, raised)."""
        out: dict[str, Any] = {}
        timeout = self.cfg.rollout.engine_timeout_s if timeout_s is None else timeout_s
        deadline = self.clock() + timeout
        pending = dict(futures)
        lost = self.rt.lost_errors()
        while pending:
            done = self.rt.wait_any(list(pending.values()), max(0.0, deadline - self.clock()))
            if not done:
                for name in pending:
                    log.warning("engine %s: %s hung past %.0f s", name, what, timeout)
                    if name in self.engines:
                        self.drop_engine(name, lost=True)
                break
            for name, fut in list(pending.items()):
                if fut not in done:
                    continue
                del pending[name]
                try:
                    out[name] = self.rt.get(fut)
                except lost as e:
                    log.warning("engine %s: %s failed, the engine is gone: %s", name, what, e)
                    if name in self.engines:
                        self.drop_engine(name, lost=True)
                except engine_base.EngineStateError:
                    raise
                except Exception as e:
                    if not drop_on_error:
                        raise
                    log.warning("engine %s: %s failed, the engine is dropped: %s", name, what, e)
                    if name in self.engines:
                        self.drop_engine(name, lost=True)
        return out

    def reconcile_dedicated(self) -> None:
        """Add dedicated engines on live rollout pods up to the target (each gets the weights first);
        drain the highest above it: no new requests, dropped (and reported released) once idle."""
        target = min(self.dedicated_target, self.cfg.rollout.max_dedicated_engines)
        have = sorted(
            (e.pod_index, e.name)
            for e in self.engines.values()
            if not e.colocated and e.pod_index is not None and not e.draining
        )
        for _, name in have[target:]:
            self.engines[name].draining = True
            self.engines[name].awake = False
            self.dispatcher.set_engine(name, awake=False, capacity=self.cfg.rollout.max_num_seqs)
            log.info("engine %s draining (dedicated target %s)", name, target)
        self.release_drained()
        pods = {j for j, _ in have[:target]}
        # A draining engine's pod comes back once released.
        free = [j for j in self.rt.rollout_pods() if j not in pods and f"dedicated-{j}" not in self.engines]
        while len(pods) < target and free:
            batch = {f"dedicated-{j}": j for j in free[: target - len(pods)]}
            del free[: len(batch)]
            self._start_engines(batch, colocated=False)
            joined = []
            for name in batch:
                try:
                    self._join_engine(name)
                except EngineLost as e:
                    log.warning("%s", e)
                    continue
                joined.append(name)
            try:
                self._update_engine_weights(joined)
            except EngineLost as e:
                log.warning("%s", e)
            pods.update(batch[name] for name in joined if name in self.engines)

    def release_drained(self) -> None:
        for name, eng in list(self.engines.items()):
            if eng.draining and not self.pipeline.busy({name}):
                self.drop_engine(name)
                if eng.pod_index is not None:
                    self._released_pods.add(eng.pod_index)

    # ---- the engine order (vLLM's RL recipe, one code path for both engines) ---------------------
    # After training: every engine that is awake (dedicated ones; shared ones without sleep mode)
    # takes the new weights at once. Shared engines with sleep mode slept at level 2 right after
    # they generated; before they generate again: wake(tags=["weights"]), load the current weights,
    # wake(tags=["kv_cache"]). So weights never move into a sleeping engine (vLLM refuses that) and
    # a level-2 engine never generates from discarded weights.
    def _generating_shared(self) -> list[str]:
        """Shared engines that serve this step: the target number, or all without a dedicated engine."""
        shared = sorted(n for n, e in self.engines.items() if e.colocated)
        dedicated_up = any(not e.colocated for e in self.engines.values())
        want = self.shared_awake_target if dedicated_up else len(shared)
        return shared[:want]

    def prepare_generation(self) -> None:
        """Wake (weights, load, KV cache) the shared engines that generate now; mark who serves."""
        serving = set(self._generating_shared())
        waking = [n for n in sorted(serving) if self.engines[n].asleep]
        t0 = self.clock()
        if waking:
            self.rt.get([self.rt.submit(self.engines[n].handle, "wake", ["weights"]) for n in waking])
            if self.cfg.rollout.engine_lora:
                engine_sync.readd_lost_adapters(self, waking)
        stale = [n for n in sorted(serving) if self.engines[n].version != self.weights_version]
        if stale:
            self._update_engine_weights(stale)
        if waking:
            self.rt.get([self.rt.submit(self.engines[n].handle, "wake", ["kv_cache"]) for n in waking])
            for n in waking:
                self.engines[n].asleep = False
            # What waking cost, weights included: on a platform without sleep mode a full restart.
            restarted = any(self._sleeps_by_restart(n) for n in waking)
            self._wakes.append((self.clock() - t0, restarted))
            log.info(
                "woke %s in %.1f s%s",
                ", ".join(waking),
                self.clock() - t0,
                " (restarted)" if restarted else "",
            )
        for name, eng in self.engines.items():
            awake = (not eng.colocated and not eng.draining) or name in serving
            if eng.awake != awake:
                eng.awake = awake
                self.dispatcher.set_engine(name, awake=awake, capacity=self.cfg.rollout.max_num_seqs)

    def sleep_shared_engines(self) -> None:
        """Shared engines free the accelerators for training (level `rollout.sleepLevel`); never
        without sleep mode. Every shared engine leaves the dispatcher until it is woken."""
        level = self.cfg.rollout.sleep_level
        sleeping = []
        # A shared engine that sleeps by restarting stays up while it serves: stopping it after each
        # generation would cost a full start every step, to free host memory a CPU trainer does not
        # need back. It stops once the target no longer wants it.
        serving = set(self._generating_shared())
        for name, eng in self.engines.items():
            if not eng.colocated:
                continue
            keep_running = self._sleeps_by_restart(name) and name in serving and not eng.asleep
            if self._sleep_mode and not eng.asleep and not keep_running:
                sleeping.append(name)
            if eng.awake:
                eng.awake = False
                self.dispatcher.set_engine(name, awake=False, capacity=self.cfg.rollout.max_num_seqs)
        self.rt.get([self.rt.submit(self.engines[n].handle, "sleep", level) for n in sleeping])
        for n in sleeping:
            self.engines[n].asleep = True
            # Level 2 discards the weights; so does a restart, except a LoRA-serving engine's frozen
            # base (its adapter is re-added: engine_sync.readd_lost_adapters).
            if level == 2 or (self._sleeps_by_restart(n) and not self.cfg.rollout.engine_lora):
                self.engines[n].version = engine_sync.DISCARDED  # reloaded when it wakes

    def _sync_awake_engines(self) -> None:
        """Right after training: the new weights into every engine that is not asleep (or draining).
        Engines first finish the chunk they are on, or are interrupted (`RolloutPipeline.quiesce`)."""
        names = [
            n
            for n, e in self.engines.items()
            if not e.asleep and not e.draining and e.version != self.weights_version
        ]
        if names:
            t0 = self.clock()  # the trainer idles here until the engines stop generating
            interrupted = self.pipeline.quiesce(names)
            self.pipeline.trainer_wait_s += self.clock() - t0
            self._update_engine_weights([n for n in names if n in self.engines])
            self.pipeline.resume_engines(interrupted)

    # ---- checkpoints -----------------------------------------------------------------------------
    def _resume(self) -> None:
        root = self.cfg.checkpoint.dir
        found = checkpoint.load_latest(root) if root else None
        self._resume_note = found.fallback_note() if found else None  # the next SyncReport says it
        if self._resume_note:
            log.warning("checkpoint fallback: %s", self._resume_note)
        if found is None or found.path is None or found.state is None or found.meta is None:
            return
        path, state, meta = found.path, found.state, found.meta
        self.rt.get([self.rt.submit(r, "set_train_state", state["ranks"]) for r in self.ranks])
        self.state = DriverState(
            step=int(meta["step"]),
            sampler=sources.SamplerState.from_dict(meta["sampler"]),
            history=[telemetry.SyncReport.model_validate(h) for h in meta.get("history", [])],
        )
        log.info("resumed from %s at step %s", path, self.state.step)

    def _save(self) -> Path | None:
        root = self.cfg.checkpoint.dir
        if not root:
            return None
        states = self.rt.get([self.rt.submit(r, "get_train_state") for r in self.ranks])
        meta = {
            "sampler": self.state.sampler.to_dict(),
            "history": [h.model_dump(mode="json", by_alias=True) for h in self.state.history],
            "config": json.loads(config_mod.dump_config(self.cfg)),
        }
        path = checkpoint.save_checkpoint(
            root, self.state.step, {"ranks": states[0]}, meta, keep_last=self.cfg.checkpoint.keep_last
        )
        log.info("checkpoint %s", path)
        return path

    # ---- weights ---------------------------------------------------------------------------------
    def _current_weights(self, what: str = weight_sync.SEND_MERGED) -> Any:
        """The trainer's engine weights of this version (`weight_sync.SEND_*`), fetched once per
        version and kind from the ranks."""
        key = (self.weights_version, what)
        if self._weights is not None and self._weights[0] == key:
            return self._weights[1]
        futures = [self.rt.submit(r, "engine_weights", what) for r in self.ranks]
        weights = futures[0]  # rank 0 holds the full weights; the others only take part
        self.rt.get(futures[1:])
        if isinstance(self.rt, runtimes.LocalRuntime):
            weights = self.rt.get(weights)
        self._weights = (key, weights)
        return weights

    def _update_engine_weights(self, names: Sequence[str]) -> None:
        engine_sync.update(self, names)

    # ---- generation ------------------------------------------------------------------------------
    def _encode_prompt(self, text: str) -> list[int]:
        return sources.encode_data_prompt(self.tokenizer, text, self.cfg.data)

    def _score(self, job: pipeline.GenJob) -> dynamic_sampling.ScoredBatch:
        """One generation job's completions with their rewards (one entry per sample)."""
        outs = [o for o in job.outputs if o is not None]
        completions = [agent.completion_text(o, self.tokenizer.decode) for o in outs]  # an episode's turns
        example_ids = [job.prompt_indices[p] for p in job.group_ids]
        exs = [self.examples[i] for i in example_ids]
        if self.agent_loop is not None and self.agent_loop.environment:
            # The environment's reward (the sum of its steps', or the final one `done` gave).
            env = [float(getattr(o, "env_reward", None) or 0.0) for o in outs]
            tasks = [self.tokenizer.decode(list(o.prompt_token_ids), skip_special_tokens=True) for o in outs]
            batch = dynamic_sampling.ScoredBatch(
                outs, example_ids, list(job.group_ids), env, {"environment": env}
            )
            return self._with_judge(batch, tasks, completions, [e.answer for e in exs])
        totals, parts = self.reward_fn.score_batch(
            [e.prompt for e in exs], completions, [e.answer for e in exs]
        )
        batch = dynamic_sampling.ScoredBatch(outs, example_ids, list(job.group_ids), totals, parts)
        return self._with_judge(batch, [e.prompt for e in exs], completions, [e.answer for e in exs])

    def _with_judge(
        self,
        batch: dynamic_sampling.ScoredBatch,
        prompts: list[str],
        completions: list[str],
        answers: list[str],
    ) -> dynamic_sampling.ScoredBatch:
        """The judge's scores added to the rewards (weight judge.weight, part `judge`); a response it
        could not score is marked `unscored` (its advantage is 0: `agent.advantage_groups`)."""
        if self.judge is None:
            return batch
        scored = self.judge.score(prompts, completions, answers)
        acc = self._judge_metrics
        for k, v in scored.metrics.items():  # summed over the step's generation rounds
            acc[k] = acc.get(k, 0.0) + (v * scored.metrics["judge/scored"] if k == "judge/mean_score" else v)
        w = self.judge.settings.weight
        part = [s or 0.0 for s in scored.scores]
        outs = [
            o if s is not None else dataclasses.replace(o, meta={**o.meta, "unscored": "judge"})
            for o, s in zip(batch.outputs, scored.scores, strict=True)
        ]
        totals = [t + w * p for t, p in zip(batch.totals, part, strict=True)]
        return dataclasses.replace(batch, outputs=outs, totals=totals, parts={**batch.parts, "judge": part})

    def _take_judge_metrics(self) -> dict[str, float]:
        m, self._judge_metrics = self._judge_metrics, {}
        if "judge/scored" in m:  # the mean over every scored response of the step's rounds
            m["judge/mean_score"] = m["judge/mean_score"] / max(1.0, m["judge/scored"])
        return m

    @property
    def lookahead(self) -> int:
        """How many steps generation may run ahead now (`RolloutPipeline.lookahead`)."""
        return self.pipeline.lookahead

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        cfg, g = self.cfg, self.cfg.grpo
        step = self.state.step + 1
        t_start = self.clock()
        self.pipeline.fill()
        job = self.pipeline.wait_for_batch(step)
        self.pipeline.take_job(step)
        gen_s = (job.finished or self.clock()) - (job.started or t_start)
        sampler_next = job.sampler_after
        batch = self._score(job)
        ds_metrics: dict[str, float] = {}
        if g.dynamic_sampling.enabled:
            extra_rounds = iter(range(1, g.dynamic_sampling.max_generation_rounds))
            batch, ds_metrics = dynamic_sampling.fill_batch(
                batch,
                want_groups=g.prompts_per_step,
                max_rounds=g.dynamic_sampling.max_generation_rounds,
                generate=lambda: self._score(
                    self.pipeline.extra_job(step, g.prompts_per_step, next(extra_rounds))
                ),
            )
        outs, group_ids, totals, parts = batch.outputs, batch.group_ids, batch.totals, batch.parts
        idx = [batch.example_ids[grp[0]] for grp in batch.groups()]  # the step's prompts, in order
        import torch

        agent.check_not_all_failed(outs, step)  # some failed episodes cost themselves; all fail the job
        adv = self.adv_fn(
            torch.tensor(totals, dtype=torch.float64),
            torch.tensor(agent.advantage_groups(outs, group_ids)),  # a failed episode: its own group
            norm_by_std=g.norm_adv_by_std,
        ).tolist()
        eos = self.tokenizer.eos_token_id
        # An endpoint episode may be several samples (`endpoint_episode`): each trains with its
        # episode's advantage, and a mini-batch holds whole episodes (split by episode, then expanded).
        samples: list[trainer.TrainSample] = []
        episode_mbs: list[list[int]] = []
        for mb in split_mini_batches(len(outs), g.mini_batches_per_step):
            parts_out, parts_adv = endpoint_episode.training_outputs(
                [outs[i] for i in mb], [adv[i] for i in mb]
            )
            episode_mbs.append(list(range(len(samples), len(samples) + len(parts_out))))
            samples += [
                trainer.sample_from_output(o, a, eos_id=eos)
                for o, a in zip(parts_out, parts_adv, strict=True)
            ]
        versions = [s.weights_version for s in samples]
        staleness = [buffer.staleness(step - 1, v) for v in versions]

        world = len(self.ranks)
        per_rank: list[list[trainer.RankMiniBatch]] = [[] for _ in range(world)]
        balance_metrics: dict[str, Any] = {}
        for mb in episode_mbs:
            lengths = [samples[i].length for i in mb]
            shards, m = shard_for_ranks(
                lengths, world, spec=self.spec, cost=self.cost, enabled=cfg.batching.dp_balance
            )
            balance_metrics = balance_metrics or m
            # token-mean's denominator: the tokens the loss trains on (an episode's observations not)
            n_resp = sum(samples[i].num_loss_tokens for i in mb)
            for r, shard in enumerate(shards):
                per_rank[r].append(
                    trainer.RankMiniBatch(tuple(samples[mb[j]] for j in shard), len(mb), n_resp)
                )
        t_train = self.clock()
        futures = [self.rt.submit(h, "train_step", per_rank[r]) for r, h in enumerate(self.ranks)]
        self.pipeline.fill()  # dedicated engines generate the next steps while the ranks train
        pending = list(futures)

        def trained() -> bool:
            pending[:] = [f for f in pending if f not in self.rt.wait_any(pending, 0)] if pending else []
            return not pending

        self.pipeline.pump(trained, current=step + 1, also=pending)
        stats = self.rt.get(futures)
        train_s = self.clock() - t_train
        self.state.step = step
        self.state.sampler = sampler_next
        t_sync = self.clock()
        self._sync_awake_engines()  # dedicated engines now; sleeping shared ones when they wake
        sync_s = self.clock() - t_sync
        tokens = sum(s["tokens"] for s in stats)
        resp_lens = [len(o.token_ids) for o in outs]
        metrics: dict[str, Any] = {
            "step": step,
            "mean_reward": sum(totals) / len(totals),
            **{f"reward/{k}": sum(v) / len(v) for k, v in parts.items()},
            **train_metrics.step_training_metrics(stats),
            "rollout/weights_version_min": min(versions),
            "rollout/staleness_max": max(staleness),
            "rollout/staleness_mean": sum(staleness) / len(staleness),
            "rollout/regenerated_stale": self.pipeline.regenerated,
            **ds_metrics,
            "data/dropped_prompts": self.dropped_prompts,
            **pipeline.rollout_step_metrics(endpoint_episode.training_outputs(outs, adv)[0], step - 1),
            **agent.agent_step_metrics(outs, env_failures=self.pipeline.take_env_failures()),
            **self._take_judge_metrics(),
            "trainer_wait_s": self.pipeline.trainer_wait_s,
            "lookahead": self.lookahead,
            "response_len_mean": sum(resp_lens) / len(resp_lens),
            "tokens_per_s": tokens / train_s if train_s > 0 else 0.0,
            "trained_tokens": tokens,
            "generation_s": gen_s,
            "training_s": train_s,
            "weight_sync_s": sync_s,
            "step_s": self.clock() - t_start,
            "prompt_indices": idx,
            **balance_metrics,
        }
        if self.evaluator is not None and self.evaluator.due(step):
            metrics.update(self.evaluator.run(self, step))
        self._sync_point(metrics, gen_s, train_s)
        self.skip_guard.record(step, metrics)  # raises after grpo.maxSkippedSteps in a row
        if cfg.checkpoint.dir and (step % cfg.checkpoint.interval_steps == 0 or step == g.max_steps):
            self._save()
            if cfg.export.every_checkpoint and not (cfg.export.final and step == g.max_steps):
                self._export(export.step_name(step))  # the last step's export is `final`
        self.tracker.log_step(metrics, self.state.history[-1] if self.state.history else None)
        if self.metrics_path:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(metrics, default=str) + "\n")
        return metrics

    def _sync_point(self, metrics: dict[str, Any], gen_s: float, train_s: float) -> None:
        load = self.dispatcher.close_interval()
        eval_reward, eval_step = metrics.get("eval/mean_reward"), metrics["step"]
        if eval_reward is None and self._unreported_baseline_eval is not None:
            # the evaluation before training has no report of its own: the first one carries it, so
            # `kubectl get rljobs` shows EVAL from step 1 instead of from the first `everySteps`
            eval_reward, eval_step = self._unreported_baseline_eval, 0
        self._unreported_baseline_eval = None
        report = telemetry.SyncReport(
            step=metrics["step"],
            time=self.wall_clock(),
            interval_s=load.interval_s,
            trainer_wait_s=self.pipeline.trainer_wait_s,  # the ranks idled waiting for rollouts this interval
            generation_s=gen_s,
            training_s=train_s,
            inflight_request_seconds=load.inflight_request_seconds,
            engine_seconds=load.engine_seconds,
            snapshot_inflight=load.snapshot_inflight,
            shared_engines_awake=self.shared_awake_target,
            dedicated_engines=sum(1 for e in self.engines.values() if not e.colocated and not e.draining),
            mean_reward=metrics["mean_reward"],
            loss=metrics["loss"],
            tokens_per_s=metrics["tokens_per_s"],
            response_len_mean=metrics["response_len_mean"],
            released_rollout_pods=sorted(self._released_pods),
            lost_rollout_pods=sorted(self._lost_pods),
            staleness_max=metrics["rollout/staleness_max"],
            eval_mean_reward=eval_reward,
            eval_step=eval_step if eval_reward is not None else None,
            dropped_prompts=self.dropped_prompts,
            tracker_errors=self.tracker.errors,
            checkpoint_fallback=self._resume_note,
            prompt_tokens=int(metrics["rollout/prompt_tokens"]),
            generated_tokens=int(metrics["rollout/generated_tokens"]),
            trained_tokens=int(metrics["trained_tokens"]),
            generation_engines=int(metrics["rollout/generation_engines"]),
            prefill_engine_s=metrics.get("rollout/prefill_engine_s"),
            decode_engine_s=metrics.get("rollout/decode_engine_s"),
            engine_platform=self.engine_platform,
            shared_wake_s=max((s for s, _ in self._wakes), default=None),
            shared_wake_restarted=any(r for _, r in self._wakes),
            numerics={k: metrics[k] for k in telemetry.NUMERICS_KEYS if k in metrics},
        )
        self._wakes.clear()
        self._resume_note = None
        self.pipeline.trainer_wait_s = 0.0
        self._lost_pods.clear()
        self.state.history = telemetry.append_report(self.state.history, report)
        metrics["busy_mean"] = report.mean_busy
        metrics["engines_awake"] = report.shared_engines_awake + report.dedicated_engines
        metrics["engines_total"] = self.cfg.rollout.shared_engines + report.dedicated_engines
        metrics["inflight_request_seconds"] = load.inflight_request_seconds
        metrics["engine_seconds"] = load.engine_seconds
        targets = None
        if self.sink is not None:
            self.sink.publish(self.state.history, metrics)
            targets = self.sink.read_targets() if self.cfg.telemetry.read_targets else None
        if targets is not None:
            self.apply_targets(targets)
        else:
            self.reconcile_dedicated()  # a rollout pod that joined since the last sync gets its engine

    def apply_targets(self, targets: telemetry_sink.EngineTargets) -> None:
        """Follow the operator's desired counts (None leaves a count as it is), and checkpoint now
        when it asks (cooperative preemption)."""
        self._honour_checkpoint_request(targets.checkpoint_request)
        if targets.desired_shared_awake is not None:
            self.shared_awake_target = max(
                0, min(targets.desired_shared_awake, self.cfg.rollout.shared_engines)
            )
        if targets.desired_dedicated_engines is not None:
            self.dedicated_target = max(0, targets.desired_dedicated_engines)
        if self.dedicated_target < 1 and not self.cfg.rollout.shared_engines:
            log.warning("dedicated target 0 without a shared engine: keeping one dedicated engine")
            self.dedicated_target = 1
        self.reconcile_dedicated()

    def _honour_checkpoint_request(self, request: telemetry_sink.CheckpointRequest | None) -> None:
        """A new checkpoint request: save at once and acknowledge it (id, step) in the newest
        SyncReport, published right away, so the operator can delete the pods without losing a step."""
        request_id = telemetry_sink.checkpoint_to_honour(request, self._checkpoint_acked)
        if request_id is None:
            return
        self._checkpoint_acked = request_id
        if self._save() is None:
            log.warning("checkpoint request %s: no checkpoint directory, nothing to acknowledge", request_id)
            return
        log.info("checkpoint request %s honoured at step %s", request_id, self.state.step)
        if self.state.history:
            ack = {"checkpoint_ack": request_id, "checkpoint_ack_step": self.state.step}
            self.state.history[-1] = self.state.history[-1].model_copy(update=ack)
            if self.sink is not None:
                self.sink.write_history(self.state.history)

    # ---- run -------------------------------------------------------------------------------------
    def run(self, max_steps: int | None = None) -> list[dict[str, Any]]:
        """Set up, then step until `max_steps` (default grpo.maxSteps) counting resumed steps."""
        self.setup()
        last = min(max_steps or self.cfg.grpo.max_steps, self.cfg.grpo.max_steps)
        out = []
        if self.evaluator is not None and self.state.step == 0 and self.evaluator.settings.before_training:
            out.append(self._evaluate_before_training())
        while self.state.step < last:
            out.append(self.step())
        if self.cfg.export.final and self.state.step >= self.cfg.grpo.max_steps:
            self._export(export.FINAL)
        return out

    def _evaluate_before_training(self) -> dict[str, Any]:
        """The held-out evaluation of the initial weights, as step 0 (verl's val_before_train): the
        baseline every later `eval/*` is compared with, in the trackers and the metrics JSONL."""
        if self.evaluator is None:
            raise RuntimeError("evaluation is not configured")
        metrics: dict[str, Any] = {"step": 0, **self.evaluator.run(self, 0)}
        self._unreported_baseline_eval = metrics.get("eval/mean_reward")
        self.tracker.log_step(metrics, None)
        if self.metrics_path:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(metrics, default=str) + "\n")
        return metrics

    def _export(self, name: str) -> None:
        """Export the policy (`rljob_trainer.outputs.export`) and report its path in the latest SyncReport."""
        root = export.export_root(self.cfg)
        if root is None:
            return
        out = root / name
        self.rt.get([self.rt.submit(r, "export_hf", str(out), self.state.step) for r in self.ranks])
        export.prune_step_exports(root, keep_last=self.cfg.checkpoint.keep_last)
        if self.state.history:
            last = self.state.history[-1].model_copy(update={"export_path": str(out)})
            self.state.history[-1] = last
            if self.sink is not None:
                self.sink.write_history(self.state.history)

    def shutdown(self) -> None:
        if self.endpoint is not None:  # its waiting calls fail at once (their episodes are over)
            self.endpoint.stop()
        self.tracker.close()
        if self.agent_loop is not None:
            self.agent_loop.close()
        if self.judge is not None:
            self.judge.shutdown()
        self._shutdown_engines({name: eng.handle for name, eng in self.engines.items()})
        for r in self.ranks:
            try:
                self.rt.get(self.rt.submit(r, "shutdown"))
            except Exception as e:  # a dead rank must not hide the real error
                log.warning("rank shutdown failed: %s", e)
        self.rt.shutdown()

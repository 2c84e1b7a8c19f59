"""The rollout pipeline: generation that runs ahead of training within the staleness bound.

Role: the driver's generation side. It samples each step's prompts (resumable sampler), queues
`prompts × group` requests in the `dispatcher.Dispatcher`, hands them to idle awake engines one
generate call per engine at a time, collects what finishes, requeues the requests of an engine that
died or hung past `rollout.engineTimeoutS` (the engine owner drops it), and hands the trainer a step's
complete batch once every output is within `grpo.maxStaleness` (older ones are regenerated and
counted).

Generation runs ahead of training by up to `grpo.maxStaleness` steps on dedicated engines (step s
may start generating once the weights of step s-1-maxStaleness are synced), so every sample trained
at step s is at most maxStaleness updates old; shared engines (on the trainer's accelerators) only
ever serve the step the trainer is waiting for. Ray futures make it overlap: generate calls are in
flight while the ranks train, and `pump` collects what finishes. `trainer_wait_s` is the time the
trainer blocked waiting for rollouts since the last sync point (SyncReport.trainerWaitS).

The engines themselves (adding, dropping, waking, weights) belong to the driver, the pipeline's
`EngineOwner`; the pipeline reads their `EngineState` and asks the owner to drop a lost one.
Callers: `rljob_trainer.driver.GRPODriver`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rljob_trainer import config as config_mod
from rljob_trainer import data
from rljob_trainer.engines import base
from rljob_trainer.rollout import buffer, dispatcher

log = logging.getLogger("rljob_trainer.driver")


def sample_seed(seed: int, step: int, index: int) -> int:
    """Sampling seed of request `index` at `step`: a function of (seed, step, index) only, so a resumed
    job draws the same samples as an uninterrupted one."""
    return (seed * 1_000_003 + step * 100_003 + index) % (2**31 - 1)


@dataclass
class EngineState:
    """The driver's view of one engine: `awake` = serves this step's requests (the dispatcher's view);
    `asleep` = the engine itself sleeps (vLLM sleep mode); `version` = weights version it holds."""

    name: str
    handle: Any
    colocated: bool
    pod_index: int | None
    awake: bool = True
    asleep: bool = False
    version: int = 0
    draining: bool = False  # above a lowered dedicated target: no new requests, dropped once idle


@dataclass
class GenJob:
    """The rollouts of one training step: its prompts, their requests and the outputs so far."""

    step: int
    prompt_indices: list[int]
    sampler_after: data.SamplerState
    group_ids: list[int]
    prompts: list[list[int]]
    seeds: list[int]
    outputs: list[base.GenerationOutput | None]
    started: float | None = None  # first request dispatched
    finished: float | None = None  # last output received

    @property
    def complete(self) -> bool:
        return all(o is not None for o in self.outputs)


@dataclass
class Call:
    """One generate call in flight: its engine, its request ids and when it was submitted."""

    engine: str
    ids: list[int]
    submitted: float


class EngineOwner(Protocol):
    """What the pipeline needs from whoever owns the engines (the driver)."""

    @property
    def weights_version(self) -> int: ...

    def drop_engine(self, name: str, *, lost: bool = False) -> None:
        """Drop an engine; it calls `RolloutPipeline.forget_engine` so its requests are requeued."""

    def release_drained(self) -> None:
        """Drop draining engines that have no call in flight any more."""

    def prepare_generation(self) -> None:
        """Wake and load the shared engines that serve the step the trainer waits for."""

    def sleep_shared_engines(self) -> None:
        """Put the shared engines back to sleep once that step's rollouts are complete."""

    def reconcile_dedicated(self) -> None:
        """Bring up dedicated engines on the rollout pods that are alive, up to the target."""


class RolloutPipeline:
    """Generation jobs by step, request -> (step, index), generate calls in flight."""

    def __init__(
        self,
        cfg: config_mod.TrainerConfig,
        runtime: Any,
        dispatch: dispatcher.Dispatcher,
        engines: dict[str, EngineState],
        owner: EngineOwner,
        *,
        examples: Sequence[Any],
        encode_prompt: Callable[[str], list[int]],
        clock: Callable[[], float],
    ) -> None:
        self.cfg = cfg
        self.rt = runtime
        self.dispatcher = dispatch
        self.engines = engines  # the owner's dict, shared
        self.owner = owner
        self.examples = examples
        self.encode_prompt = encode_prompt
        self.clock = clock
        self.jobs: dict[int, GenJob] = {}
        self.calls: dict[Any, Call] = {}
        self._request_of: dict[int, tuple[int, int]] = {}
        self._sampler = data.SamplerState()
        self._next_step = 1
        self.regenerated = 0  # requests regenerated because their output was too stale
        self.trainer_wait_s = 0.0  # trainer blocked waiting for rollouts since the last sync point

    def start_at(self, sampler: data.SamplerState, next_step: int) -> None:
        """Generation resumes here (after a checkpoint): the sampler state and the next step to queue."""
        self._sampler, self._next_step = sampler, next_step

    # ---- what is in flight -----------------------------------------------------------------------
    @property
    def lookahead(self) -> int:
        """How many steps generation may run ahead now: maxStaleness with a dedicated engine up, else 0."""
        dedicated = any(not e.colocated and not e.draining for e in self.engines.values())
        return self.cfg.grpo.max_staleness if dedicated else 0

    def busy(self, names: Sequence[str] | set[str]) -> bool:
        """Whether any of these engines has a generate call in flight."""
        return any(c.engine in names for c in self.calls.values())

    def forget_engine(self, name: str) -> None:
        """An engine is dropped: forget its calls (the dispatcher requeues its requests)."""
        for fut in [f for f, c in self.calls.items() if c.engine == name]:
            del self.calls[fut]

    def take_job(self, step: int) -> GenJob:
        return self.jobs.pop(step)

    def _queued_requests(self) -> bool:
        return any(self.dispatcher.is_queued(rid) for rid in self._request_of)

    # ---- queue, admit, collect -------------------------------------------------------------------
    def fill(self) -> None:
        """Queue the requests of every step within the staleness bound that has not started."""
        g = self.cfg.grpo
        last = min(g.max_steps, self.owner.weights_version + self.lookahead + 1)
        while self._next_step <= last:
            self.jobs[self._next_step] = self._new_job(self._next_step, g.prompts_per_step)
            self._next_step += 1

    def _new_job(self, step: int, prompts: int, *, key: int | None = None, seed_offset: int = 0) -> GenJob:
        """The next `prompts` prompts from the sampler as step `step`'s job, queued under `key`."""
        g = self.cfg.grpo
        idx, self._sampler = data.next_prompts(
            self._sampler,
            prompts,
            num_examples=len(self.examples),
            seed=g.seed,
            shuffle=self.cfg.data.shuffle,
        )
        group_ids = [p for p in range(len(idx)) for _ in range(g.group_size)]
        requests = [self.encode_prompt(self.examples[idx[p]].prompt) for p in group_ids]
        n = len(requests)
        seeds = [sample_seed(g.seed, step, seed_offset + i) for i in range(n)]
        job = GenJob(step, idx, self._sampler, group_ids, requests, seeds, [None] * n)
        for i, rid in enumerate(self.dispatcher.submit(n)):
            self._request_of[rid] = (step if key is None else key, i)
        return job

    def extra_job(self, step: int, prompts: int, round_index: int) -> GenJob:
        """Dynamic sampling's refill (`rljob_trainer.dynamic_sampling`): `prompts` more prompts from the
        sampler, generated now with the current weights by the engines that serve step `step` (its
        shared engines woken and put back to sleep as for the step itself); blocks until complete."""
        key = -(step * 1000 + round_index)  # never a step number
        job = self._new_job(step, prompts, key=key, seed_offset=round_index * self.cfg.samples_per_step)
        self.jobs[key] = job
        self.owner.prepare_generation()
        t0 = self.clock()
        self.pump(lambda: job.complete, current=key)
        self.trainer_wait_s += self.clock() - t0
        self.owner.sleep_shared_engines()
        return self.jobs.pop(key)

    def _admit(self, current: int) -> None:
        """Hand queued requests to idle awake engines, one generate call per engine at a time:
        shared engines take only step `current`'s, dedicated ones the oldest of any step."""
        busy = {c.engine for c in self.calls.values()}
        idle = [n for n, e in self.engines.items() if e.awake and n not in busy]
        if not idle:
            return
        per_call = -(-self.cfg.samples_per_step // max(1, sum(1 for e in self.engines.values() if e.awake)))
        job = self.jobs.get(current)
        current_ids = {rid for rid, (st, _) in self._request_of.items() if st == current} if job else set()
        shared = [n for n in idle if self.engines[n].colocated]
        dedicated = [n for n in idle if not self.engines[n].colocated]
        batches: dict[str, list[int]] = {}
        if shared and current_ids:
            batches.update(self.dispatcher.admit(per_call, engines=shared, requests=current_ids))
        if dedicated:
            batches.update(self.dispatcher.admit(per_call, engines=dedicated))
        g = self.cfg.grpo
        for name, ids in batches.items():
            where = [self._request_of[r] for r in ids]
            sampling = base.SamplingSettings(
                temperature=g.temperature,
                top_p=g.top_p,
                max_tokens=self.cfg.lengths.max_response_tokens,
                seeds=tuple(self.jobs[st].seeds[i] for st, i in where),
            )
            now = self.clock()
            for st, _ in where:
                if self.jobs[st].started is None:
                    self.jobs[st].started = now
            batch = [self.jobs[st].prompts[i] for st, i in where]
            fut = self.rt.submit(self.engines[name].handle, "generate", batch, sampling)
            self.dispatcher.mark_generating(ids)
            self.calls[fut] = Call(name, ids, now)

    def _collect(self, fut: Any) -> None:
        """One finished generate call: its outputs into their jobs, or its engine dropped as lost."""
        call = self.calls.pop(fut)
        try:
            outs = self.rt.get(fut)
        except self.rt.lost_errors() as e:
            log.warning("engine %s lost while generating: %s", call.engine, e)
            self.calls[fut] = call  # drop_engine forgets it and requeues its requests
            self.owner.drop_engine(call.engine, lost=True)
            return
        now = self.clock()
        for rid, out in zip(call.ids, outs, strict=True):
            st, i = self._request_of.pop(rid)
            job = self.jobs[st]
            job.outputs[i] = out
            if job.complete:
                job.finished = now
        self.dispatcher.finish(call.ids)
        eng = self.engines.get(call.engine)
        if eng is not None and eng.draining:
            self.owner.release_drained()

    # ---- run it ----------------------------------------------------------------------------------
    def pump(
        self,
        done: Callable[[], bool],
        *,
        current: int | None = None,
        admit: bool = True,
        also: Sequence[Any] = (),
    ) -> None:
        """Run the pipeline (admit, collect, drop hung engines) until `done()`; `also` are other futures
        (the ranks' training) whose completion is a reason to re-check `done`."""
        timeout = self.cfg.rollout.engine_timeout_s
        while not done():
            if admit and current is not None:
                self._admit(current)
            if not self.calls and not also:
                if not (admit and self._queued_requests()):
                    return
                self._await_engine()
                continue
            now = self.clock()
            oldest = min((c.submitted for c in self.calls.values()), default=now)
            wait = max(0.0, min(timeout - (now - oldest), 1.0)) if self.calls else 1.0
            for fut in self.rt.wait_any([*self.calls, *also], wait):
                if fut in self.calls:
                    self._collect(fut)
            now = self.clock()
            for fut, call in list(self.calls.items()):
                if fut in self.calls and now - call.submitted > timeout:
                    log.warning("engine %s hung past %.0f s", call.engine, timeout)
                    self.owner.drop_engine(call.engine, lost=True)

    def _await_engine(self) -> None:
        """Requests are queued and no engine can take them (every dedicated engine was lost): bring
        engines up on the rollout pods that are back, waiting up to rollout.engineTimeoutS for one."""
        deadline = time.monotonic() + self.cfg.rollout.engine_timeout_s
        while not any(e.awake for e in self.engines.values()):
            self.owner.reconcile_dedicated()
            if any(e.awake for e in self.engines.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    "requests are queued but no rollout engine is up: every dedicated engine was lost, "
                    f"no rollout pod came back within {self.cfg.rollout.engine_timeout_s:.0f} s "
                    "(rollout.engineTimeoutS) and there is no shared engine to fall back on"
                )
            time.sleep(1.0)

    def wait_for_batch(self, step: int) -> GenJob:
        """Block until step `step`'s rollouts are complete and within the staleness bound; outputs too
        stale (an engine's weights were older than the bound allows) are regenerated and counted."""
        bound = self.cfg.grpo.max_staleness
        job = self.jobs[step]
        while True:
            if not job.complete:
                self.owner.prepare_generation()
                t0 = self.clock()
                self.pump(lambda: job.complete, current=step)
                self.trainer_wait_s += self.clock() - t0
                self.owner.sleep_shared_engines()
            stale = [
                i
                for i, o in enumerate(job.outputs)
                if o is not None and buffer.staleness(step - 1, int(o.meta.get("version", 0))) > bound
            ]
            if not stale:
                return job
            log.warning("step %s: %d rollouts beyond staleness %d, regenerating", step, len(stale), bound)
            self.regenerated += len(stale)
            for i, rid in zip(stale, self.dispatcher.submit(len(stale)), strict=True):
                job.outputs[i] = None
                self._request_of[rid] = (step, i)

"""The rollout pipeline: generation that runs ahead of training within the staleness bound.

Role: the driver's generation side. It samples each step's prompts (resumable sampler), queues
`prompts × group` requests in the `dispatcher.Dispatcher`, hands them to idle awake engines one
generate call per engine at a time, collects what finishes, requeues the requests of an engine that
died or hung past `rollout.engineTimeoutS` (the engine owner drops it), and hands the trainer a step's
complete batch once every output is within `grpo.maxStaleness` (older ones are regenerated and
counted).

Dedicated engines take requests in chunks of `rollout.chunkPromptGroups` prompt groups per generate
call (default: a step's share), so a weight sync waits for at most the chunk in flight. With
`rollout.partialRollouts` it does not wait for a call that runs ahead of the next step either
(AReaL's interruptible generation, slime's partial rollout): `quiesce` interrupts it, it returns
what it has; after the weights are updated `resume_engines` lets the engines serve again, and each
unfinished request is dispatched again as its prompt + the tokens it has, with the rest of its
budget (`engines.base.continue_output`): every token keeps the weights version and log-prob it was
sampled with, so staleness and truncated importance sampling are per token.

Generation runs ahead of training by up to `grpo.maxStaleness` steps on dedicated engines (step s
may start generating once the weights of step s-1-maxStaleness are synced), so every sample trained
at step s is at most maxStaleness updates old; shared engines (on the trainer's accelerators) only
ever serve the step the trainer is waiting for. Ray futures make it overlap: generate calls are in
flight while the ranks train, and `pump` collects what finishes. `trainer_wait_s` is the time the
trainer blocked waiting for rollouts since the last sync point (SyncReport.trainerWaitS).

The engines themselves (adding, dropping, waking, weights) belong to the driver, the pipeline's
`EngineOwner`; the pipeline reads their `EngineState` and asks the owner to drop a lost one.

Multi-turn episodes (`agent`, `rljob_trainer.rollout.agent`): with an `agent_loop.AgentLoop` every
request of a job is an episode, and each of its turns is one dispatcher request (its prompt the
episode's tokens so far, its budget the episode's tokens left), pinned to the engine of the turn
before it (its prefix cache; `Dispatcher` drops the pin when that engine is gone and the episode
continues on another from its tokens). Between turns the episode's tool calls or environment step
run on the loop's worker threads (`side` futures) while `pump` goes on dispatching other turns and
collecting training: tool and environment time overlaps training as generation does. An
interrupted turn (partial rollouts) resumes as any request does; a turn lost with its engine is
generated again from the episode's tokens. A job is complete once every episode is finished.

Episodes of an environment of mode agent (`rollout.endpoint`): the episode is one call to the
environment (`POST /episode`, on the loop's threads), whose own agent calls the job's
OpenAI-compatible endpoint meanwhile; `pump` drains those calls (`Endpoint.drain`) into the
dispatcher, each choice one request pinned to the episode's engine, with the episode's sampling and
seeds, resumed like any request after an interrupt, and answers them; when the environment answers,
the episode's recorded calls become its samples (`endpoint_episode.episode_output`).
Callers: `rljob_trainer.driver.GRPODriver`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rljob_trainer import config as config_mod
from rljob_trainer.data import sources
from rljob_trainer.engines import base
from rljob_trainer.rollout import (
    agent,
    agent_loop,
    buffer,
    dispatcher,
    endpoint_episode,
    environment_client,
)
from rljob_trainer.rollout import endpoint as endpoint_mod

log = logging.getLogger("rljob_trainer.driver")


def sample_seed(seed: int, step: int, index: int) -> int:
    """Sampling seed of request `index` at `step`: a function of (seed, step, index) only, so a resumed
    job draws the same samples as an uninterrupted one."""
    return (seed * 1_000_003 + step * 100_003 + index) % (2**31 - 1)


def resumed_seed(seed: int, tokens_so_far: int) -> int:
    """Seed of a request resumed after `tokens_so_far` tokens (a partial rollout): a function of its own
    seed and where it resumes only, so its continuation does not depend on the engine or batch."""
    return (seed * 1_000_003 + tokens_so_far * 7_919 + 1) % (2**31 - 1)


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
    sampler_after: sources.SamplerState
    group_ids: list[int]
    prompts: list[list[int]]
    seeds: list[int]
    outputs: list[base.GenerationOutput | None]
    started: float | None = None  # first request dispatched
    finished: float | None = None  # last output received
    # Interrupted requests' tokens so far (partial rollouts), until the call that finishes them.
    partial: dict[int, base.GenerationOutput] = field(default_factory=dict)
    # Multi-turn jobs: request i's episode (None until its environment's reset answered).
    episodes: dict[int, agent.Episode | None] | None = None
    # Multi-turn jobs: each prompt group's reset seed and task (environments).
    tasks: list[tuple[int, str | None]] = field(default_factory=list)
    # (temperature, top_p) of this job's requests when not the training's (evaluation).
    sampling: tuple[float, float] | None = None

    @property
    def complete(self) -> bool:
        return all(o is not None for o in self.outputs)


@dataclass
class Call:
    """One generate call in flight: its engine, its request ids and when it was submitted."""

    engine: str
    ids: list[int]
    submitted: float


@dataclass
class SideCall:
    """A multi-turn episode's call off the engines in flight: its tool calls, or an environment's
    reset or step, on the agent loop's threads."""

    kind: str  # "tools", "reset", "step" or "episode" (an environment of mode agent runs it whole)
    key: int
    index: int
    submitted: float
    turn_cut: bool = False  # step: the turn stopped at the episode's budget
    episode_id: str | None = None  # episode: the endpoint episode it runs


# Job keys of evaluation runs (below any dynamic-sampling key, -(step * 1000 + round)).
EVAL_KEY = -(10**12)
# How often `pump` looks at tool and environment calls while it waits for the engines.
SIDE_POLL_S = 0.02


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
        agent_loop: agent_loop.AgentLoop | None = None,
        endpoint: endpoint_mod.Endpoint | None = None,
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
        self.agent = agent_loop
        self.side: dict[concurrent.futures.Future[Any], SideCall] = {}
        # Environments of mode agent: each open episode, each endpoint request's call and choice, the
        # outputs of a call so far, an interrupted request's tokens so far.
        self.endpoint = endpoint
        self._endpoint_eps: dict[tuple[int, int], endpoint_mod.EndpointEpisode] = {}
        self._call_of: dict[int, tuple[endpoint_mod.PendingCall, int]] = {}
        self._call_results: dict[endpoint_mod.PendingCall, list[base.GenerationOutput | None]] = {}
        self._call_partial: dict[int, base.GenerationOutput] = {}
        self.env_failures = 0  # episodes failed by their environment since the last step's metrics
        self._eval_runs = 0
        self._request_of: dict[int, tuple[int, int]] = {}
        self._sampler = sources.SamplerState()
        self._next_step = 1
        self.regenerated = 0  # requests regenerated because their output was too stale
        self.interrupted = 0  # requests interrupted at a weight sync and resumed (partial rollouts)
        self.trainer_wait_s = 0.0  # trainer blocked waiting for rollouts since the last sync point

    def start_at(self, sampler: sources.SamplerState, next_step: int) -> None:
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

    def take_env_failures(self) -> int:
        """Episodes failed by their environment since the last call (metric agent/env_failures)."""
        n, self.env_failures = self.env_failures, 0
        return n

    def _pending(self) -> bool:
        """Work that will queue requests without an engine call: tool and environment calls."""
        return bool(self.side)

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
        idx, self._sampler = sources.next_prompts(
            self._sampler,
            prompts,
            num_examples=len(self.examples),
            seed=g.seed,
            shuffle=self.cfg.data.shuffle,
        )
        group_ids = [p for p in range(len(idx)) for _ in range(g.group_size)]
        env = self.agent is not None and self.agent.environment
        # With an environment the prompt is its reset's first observation, known once it answers.
        requests = [[] if env else self.encode_prompt(self.examples[idx[p]].prompt) for p in group_ids]
        n = len(requests)
        seeds = [sample_seed(g.seed, step, seed_offset + i) for i in range(n)]
        job = GenJob(step, idx, self._sampler, group_ids, requests, seeds, [None] * n)
        if self.agent is None:
            for i, rid in enumerate(self.dispatcher.submit(n)):
                self._request_of[rid] = (step if key is None else key, i)
            return job
        job.episodes = {}
        job.tasks = [
            (agent_loop.reset_seed(g.seed, step, seed_offset + p), self.examples[idx[p]].prompt)
            for p in range(len(idx))
        ]
        job.started = self.clock() if env else None
        for i in range(n):
            self._start_episode(job, step if key is None else key, i)
        return job

    # ---- multi-turn episodes -----------------------------------------------------------------------
    def _start_episode(self, job: GenJob, key: int, i: int) -> None:
        """Episode i of a job from its start: its environment's reset, or its first turn queued."""
        loop = self.agent
        assert loop is not None and job.episodes is not None
        if loop.agent_mode:
            self._start_endpoint_episode(job, key, i)
            return
        if loop.environment:
            job.episodes[i] = None
            seed, _ = job.tasks[job.group_ids[i]]
            self.side[loop.submit_reset(seed)] = SideCall("reset", key, i, self.clock())
            return
        ep = job.episodes[i] = loop.new_episode(job.prompts[i])
        self._queue_turn(key, i, ep)

    # ---- episodes of an environment of mode agent (the job's endpoint) ----------------------------
    def _start_endpoint_episode(self, job: GenJob, key: int, i: int) -> None:
        """Episode i as one `POST /episode` to the environment, its agent calling the endpoint with the
        episode's base URL; an earlier run of the same episode (too stale) is closed first."""
        loop, endpoint = self.agent, self.endpoint
        if loop is None or endpoint is None:
            raise RuntimeError(
                "an environment of mode agent needs the job's endpoint (trainer config `endpoint`)"
            )
        old = self._endpoint_eps.pop((key, i), None)
        if old is not None:
            self._close_endpoint_episode(old)
        assert job.episodes is not None
        job.episodes[i] = None
        seed, _ = job.tasks[job.group_ids[i]]
        g = self.cfg.grpo
        ep = endpoint.open_episode(key, i, sampling=job.sampling or (g.temperature, g.top_p))
        ep.started_s = self.clock()
        self._endpoint_eps[(key, i)] = ep
        fut = loop.submit_episode(ep.id, seed, endpoint.episode_url(ep), endpoint.model_name)
        self.side[fut] = SideCall("episode", key, i, ep.started_s, episode_id=ep.id)

    def _close_endpoint_episode(self, ep: endpoint_mod.EndpointEpisode) -> None:
        """Its later calls are refused and waiting ones fail; its queued requests leave the dispatcher
        (one already generating is dropped when it comes back)."""
        assert self.endpoint is not None
        self.endpoint.close_episode(ep)
        for rid, (call, _) in list(self._call_of.items()):
            if call.episode is ep and self.dispatcher.is_queued(rid):
                self.dispatcher.finish([rid])
                del self._call_of[rid]
                self._request_of.pop(rid, None)
                self._call_partial.pop(rid, None)
                self._call_results.pop(call, None)

    def _drain_endpoint(self) -> None:
        """The endpoint's waiting calls into the dispatcher: one request per choice, pinned to the engine
        of the episode's last call (its prefix cache)."""
        if self.endpoint is None:
            return
        for call in self.endpoint.drain():
            ep = call.episode
            if self._endpoint_eps.get((ep.key, ep.index)) is not ep:
                if not call.future.done():
                    call.future.set_exception(endpoint_mod.EpisodeClosed(f"episode {ep.id} is over"))
                continue
            self._call_results[call] = [None] * call.n
            for j, rid in enumerate(self.dispatcher.submit(call.n, engine=ep.engine)):
                self._request_of[rid] = (ep.key, ep.index)
                self._call_of[rid] = (call, j)

    def _collect_call(self, rid: int, out: base.GenerationOutput) -> bool:
        """One endpoint request's output; False when it was interrupted and resumes (partial
        rollouts). A call is answered once all its choices are in."""
        call, j = self._call_of[rid]
        merged = base.continue_output(self._call_partial.pop(rid, None), out)
        if out.aborted and len(merged.token_ids) < call.max_tokens and call.episode.open:
            if merged.token_ids:
                self._call_partial[rid] = merged
            return False
        if out.aborted:  # interrupted exactly at its budget: it is complete
            merged = dataclasses.replace(merged, finish_reason="length")
        del self._call_of[rid]
        del self._request_of[rid]
        results = self._call_results.get(call)
        if results is None or not call.episode.open:
            self._call_results.pop(call, None)
            return True  # its episode is over: nobody waits for it
        results[j] = merged
        call.episode.engine = merged.meta.get("engine") or call.episode.engine
        if all(r is not None for r in results):
            del self._call_results[call]
            if not call.future.done():
                call.future.set_result([r for r in results if r is not None])
        return True

    def _endpoint_episode_done(self, call: SideCall, fut: concurrent.futures.Future[Any]) -> None:
        """The environment answered `POST /episode` (or failed): the episode's recorded calls become its
        samples with its reward; an episode that failed, or whose agent made no call, trains nothing."""
        ep = self._endpoint_eps.get((call.key, call.index))
        if ep is None or ep.id != call.episode_id:
            return  # it started over meanwhile (too stale)
        del self._endpoint_eps[(call.key, call.index)]
        self._close_endpoint_episode(ep)
        job, loop = self.jobs[call.key], self.agent
        assert loop is not None
        result, _ = fut.result()
        now = self.clock()
        turns = [] if isinstance(result, environment_client.EnvironmentCallError) else ep.turns()
        meta = {"episode_id": ep.id}
        if isinstance(result, environment_client.EnvironmentCallError) or not turns:
            failure = (
                f"{result.reason}: {result}"
                if isinstance(result, environment_client.EnvironmentCallError)
                else "no_calls: the environment's agent made no call to the endpoint"
            )
            log.warning("step %s: episode %d failed: %s", call.key, call.index, failure)
            self.env_failures += 1
            eos = next(iter(sorted(loop.format.eos_ids)), 0)
            out: base.GenerationOutput = endpoint_episode.failed_output(
                eos, failure, started_s=call.submitted, finished_s=now, meta=meta
            )
        else:
            out = endpoint_episode.episode_output(
                turns, reward=result.reward, started_s=call.submitted, finished_s=now, meta=meta
            )
        job.outputs[call.index] = out
        if job.complete:
            job.finished = now

    def _episode(self, key: int, i: int) -> agent.Episode:
        episodes = self.jobs[key].episodes
        ep = episodes.get(i) if episodes is not None else None
        if ep is None:
            raise RuntimeError(f"request {i} of step {key} has no episode")
        return ep

    def _queue_turn(self, key: int, i: int, ep: agent.Episode) -> None:
        """The episode's next turn, pinned to the engine of its last one."""
        (rid,) = self.dispatcher.submit(1, engine=ep.engine)
        self._request_of[rid] = (key, i)

    def _finish_episode(self, key: int, i: int) -> None:
        job, ep = self.jobs[key], self._episode(key, i)
        now = self.clock()
        ep.finished_s = now
        if self.agent is not None:
            self.agent.close_episode(ep)  # an environment episode that ended before `done`
        job.outputs[i] = ep.output()
        if job.complete:
            job.finished = now

    def _after_turn(self, key: int, i: int, turn: base.GenerationOutput) -> None:
        """A finished turn: the episode ends, or its tools or environment step run on the loop's threads."""
        loop, ep = self.agent, self._episode(key, i)
        assert loop is not None
        action = loop.after_turn(ep, turn)
        now = self.clock()
        if isinstance(action, agent.Finish):
            ep.finish(action.reason)
            self._finish_episode(key, i)
        elif isinstance(action, agent.CallTools):
            self.side[loop.submit_tools(action.calls)] = SideCall("tools", key, i, now)
        else:
            cut = turn.finish_reason == "length"
            self.side[loop.submit_step(ep, action.action)] = SideCall("step", key, i, now, cut)

    def _collect_side(self, fut: concurrent.futures.Future[Any]) -> None:
        """A tool or environment call that finished: the episode goes on, or ends (its environment
        failed: the episode fails, counted, never the job)."""
        call = self.side.pop(fut)
        job = self.jobs.get(call.key)
        if job is None or job.episodes is None:
            return  # its job was dropped meanwhile
        loop = self.agent
        assert loop is not None
        if call.kind == "episode":
            self._endpoint_episode_done(call, fut)
            return
        if call.kind == "tools":
            ep = self._episode(call.key, call.index)
            done = fut.result()
            ep.wait_s += done.seconds  # as the calls ran on the loop's thread
            if loop.observe_tools(ep, done):
                self._queue_turn(call.key, call.index, ep)
            else:
                self._finish_episode(call.key, call.index)
            return
        result, seconds = fut.result()
        if call.kind == "reset":
            if not isinstance(result, environment_client.EnvironmentCallError):
                try:
                    ep = loop.start_from_reset(result)
                except environment_client.EnvironmentCallError as e:
                    result = e
            if isinstance(result, environment_client.EnvironmentCallError):
                # Nothing to train on: a placeholder the loss ignores (mask 0), failed.
                eos = next(iter(sorted(loop.format.eos_ids)), 0)
                ep = loop.new_episode([eos])
                ep.add_observation([eos])
                job.episodes[call.index] = ep
                self._fail_episode(call.key, call.index, result, call.submitted)
                return
            ep.started_s, ep.wait_s = call.submitted, seconds
            job.episodes[call.index] = ep
            job.prompts[call.index] = list(ep.prompt_ids)
            self._queue_turn(call.key, call.index, ep)
            return
        ep = self._episode(call.key, call.index)
        ep.wait_s += seconds
        if isinstance(result, environment_client.EnvironmentCallError):
            self._fail_episode(call.key, call.index, result, None)
        elif loop.observe_step(ep, result, turn_cut=call.turn_cut):
            self._queue_turn(call.key, call.index, ep)
        else:
            self._finish_episode(call.key, call.index)

    def _fail_episode(
        self, key: int, i: int, error: environment_client.EnvironmentCallError, started: float | None
    ) -> None:
        ep = self._episode(key, i)
        if ep.started_s is None:
            ep.started_s = started
        log.warning("step %s: episode %d failed: %s", key, i, error)
        self.env_failures += 1
        ep.finish(agent.FINISH_FAILED, failure=f"{error.reason}: {error}")
        self._finish_episode(key, i)

    def _wait_side(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for a tool or environment call (or a call to the endpoint), and collect
        every one that finished."""
        self._drain_endpoint()
        if not self.side:
            return
        waiting: list[concurrent.futures.Future[Any]] = list(self.side)
        if self.endpoint is not None:
            waiting.append(self.endpoint.wake)
        done, _ = concurrent.futures.wait(
            waiting, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED
        )
        for fut in done:
            if fut in self.side:
                self._collect_side(fut)
        self._drain_endpoint()

    def extra_job(self, step: int, prompts: int, round_index: int) -> GenJob:
        """Dynamic sampling's refill (`rljob_trainer.train.dynamic_sampling`): `prompts` more prompts from the
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

    def run_episodes(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], *, temperature: float, top_p: float
    ) -> list[base.GenerationOutput]:
        """Evaluation's episodes (`data.evaluation`): one per prompt (with an environment: per reset seed,
        its prompts unused), sampled at `temperature`/`top_p`, on the engines that serve now (shared
        ones woken and put back to sleep), in generate calls of their own; blocks until all are done."""
        if self.agent is None:
            raise ValueError("run_episodes needs an agent loop")
        self._eval_runs += 1
        key = EVAL_KEY - self._eval_runs
        n = len(seeds)
        env = self.agent.environment
        job = GenJob(
            key,
            list(range(n)),
            self._sampler,
            list(range(n)),
            [[] for _ in range(n)] if env else [list(p) for p in prompts],  # env: its resets say
            list(seeds),
            [None] * n,
        )
        job.episodes, job.sampling = {}, (temperature, top_p)
        job.tasks = [(int(seed), None) for seed in seeds]
        self.jobs[key] = job
        for i in range(n):
            self._start_episode(job, key, i)
        self.owner.prepare_generation()
        try:
            self.pump(lambda: job.complete, current=key, only=key)
        finally:
            self.owner.sleep_shared_engines()
        return [o for o in self.jobs.pop(key).outputs if o is not None]

    def _admit(self, current: int, only: int | None = None) -> None:
        """Hand queued requests to idle awake engines, one generate call per engine at a time:
        shared engines take only step `current`'s, dedicated ones the oldest of any step (only job
        `only`'s when given: an evaluation's calls hold nothing else)."""
        busy = {c.engine for c in self.calls.values()}
        idle = [n for n, e in self.engines.items() if e.awake and n not in busy]
        if not idle:
            return
        share = -(-self.cfg.samples_per_step // max(1, sum(1 for e in self.engines.values() if e.awake)))
        chunk = self.cfg.rollout.chunk_prompt_groups
        per_chunk = min(share, chunk * self.cfg.grpo.group_size) if chunk else share
        job = self.jobs.get(current)
        current_ids = {rid for rid, (st, _) in self._request_of.items() if st == current} if job else set()
        shared = [n for n in idle if self.engines[n].colocated]
        dedicated = [n for n in idle if not self.engines[n].colocated]
        batches: dict[str, list[int]] = {}
        if shared and current_ids:  # they serve the step the trainer waits for: its share at once
            batches.update(self.dispatcher.admit(share, engines=shared, requests=current_ids))
        if dedicated:
            mine = (
                {rid for rid, (st, _) in self._request_of.items() if st == only} if only is not None else None
            )
            batches.update(self.dispatcher.admit(per_chunk, engines=dedicated, requests=mine))
        for name, ids in batches.items():
            self._submit_generate(name, ids)

    def _submit_generate(self, name: str, ids: Sequence[int]) -> None:
        """One generate call of requests `ids` on engine `name`; an interrupted request continues from
        the tokens it has (its prompt + those tokens, the rest of its budget, a seed of where it is)."""
        g, cap = self.cfg.grpo, self.cfg.lengths.max_response_tokens
        where = [self._request_of[r] for r in ids]
        prefixes = [self.jobs[st].partial.get(i) for st, i in where]
        prompts, budgets, seeds = [], [], []
        now = self.clock()
        for rid, (st, i), prefix in zip(ids, where, prefixes, strict=True):
            job = self.jobs[st]
            if rid in self._call_of:  # a call to the endpoint: its prompt, its budget, a seed per choice
                call, j = self._call_of[rid]
                part = self._call_partial.get(rid)
                have = part.token_ids if part is not None else ()
                prompts.append([*call.prompt_ids, *have])
                budgets.append(call.max_tokens - len(have))
                seeds.append(resumed_seed(sample_seed(job.seeds[i], call.call, j), len(have)))
                continue
            have = prefix.token_ids if prefix is not None else ()
            if job.episodes is None:
                prompts.append([*job.prompts[i], *have])
                budgets.append(cap - len(have))
                seeds.append(resumed_seed(job.seeds[i], len(have)) if have else job.seeds[i])
                continue
            # A turn: the episode's tokens so far, the tokens it has left; its own seed per turn.
            ep = self._episode(st, i)
            ep.started_s = now if ep.started_s is None else ep.started_s
            prompts.append([*ep.context, *have])
            budgets.append(ep.remaining - len(have))
            seeds.append(resumed_seed(job.seeds[i], len(ep.token_ids) + len(have)))
        agent_turns = any(self.jobs[st].episodes is not None for st, _ in where)
        # A call holds one job's requests when that job samples otherwise (`_admit(only=...)`).
        temperature, top_p = self.jobs[where[0][0]].sampling or (g.temperature, g.top_p)
        sampling = base.SamplingSettings(
            temperature=temperature,
            top_p=top_p,
            max_tokens=cap,
            seeds=tuple(seeds),
            max_tokens_per_request=tuple(budgets)
            if agent_turns or any(p is not None for p in prefixes)
            else None,
        )
        for st, _ in where:
            if self.jobs[st].started is None:
                self.jobs[st].started = now
        fut = self.rt.submit(self.engines[name].handle, "generate", prompts, sampling)
        self.dispatcher.mark_generating(ids)
        self.calls[fut] = Call(name, list(ids), now)

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
        finished, interrupted = [], []
        turns: list[tuple[int, int, base.GenerationOutput]] = []
        for rid, out in zip(call.ids, outs, strict=True):
            if rid in self._call_of:
                (finished if self._collect_call(rid, out) else interrupted).append(rid)
                continue
            st, i = self._request_of[rid]
            job = self.jobs[st]
            merged = base.continue_output(job.partial.pop(i, None), out)
            budget = (
                self._episode(st, i).remaining
                if job.episodes is not None
                else self.cfg.lengths.max_response_tokens
            )
            if out.aborted and len(merged.token_ids) < budget:
                if merged.token_ids:  # resumed from these tokens once the engines serve again
                    job.partial[i] = merged
                interrupted.append(rid)
                continue
            if out.aborted:  # interrupted exactly at its budget: it is complete
                merged = dataclasses.replace(merged, finish_reason="length")
            del self._request_of[rid]
            finished.append(rid)
            if job.episodes is not None:
                turns.append((st, i, merged))  # after the dispatcher knows the turn is done
                continue
            job.outputs[i] = merged
            if job.complete:
                job.finished = now
        self.dispatcher.finish(finished)
        self.dispatcher.requeue(interrupted)
        self.interrupted += len(interrupted)
        for st, i, turn in turns:
            self._after_turn(st, i, turn)
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
        only: int | None = None,
    ) -> None:
        """Run the pipeline (admit, collect, drop hung engines) until `done()`; `also` are other futures
        (the ranks' training) whose completion is a reason to re-check `done`."""
        timeout = self.cfg.rollout.engine_timeout_s
        while not done():
            self._drain_endpoint()
            if admit and current is not None:
                self._admit(current, only)
            if not self.calls and not also:
                if self._pending():  # only tools or environments at work: wait for one of them
                    self._wait_side(1.0)
                    continue
                if not (admit and self._queued_requests()):
                    return
                self.await_engine()
                continue
            now = self.clock()
            oldest = min((c.submitted for c in self.calls.values()), default=now)
            wait = max(0.0, min(timeout - (now - oldest), 1.0)) if self.calls else 1.0
            if self._pending():  # a tool result may queue a turn an idle engine can take
                wait = min(wait, SIDE_POLL_S)
            for fut in self.rt.wait_any([*self.calls, *also], wait) if (self.calls or also) else ():
                if fut in self.calls:
                    self._collect(fut)
            self._wait_side(0.0)
            now = self.clock()
            for fut, call in list(self.calls.items()):
                if fut in self.calls and now - call.submitted > timeout:
                    log.warning("engine %s hung past %.0f s", call.engine, timeout)
                    self.owner.drop_engine(call.engine, lost=True)

    # ---- weight sync points ----------------------------------------------------------------------
    def quiesce(self, names: Sequence[str]) -> list[str]:
        """Before a weight sync: engines `names` stop generating. With rollout.partialRollouts a call
        in flight that holds requests of a step beyond the next one to train is interrupted (it
        returns what it has, resumed after the sync; the returned engines must be `resume_engines`d
        once their weights are in); the sync waits for the other calls (at most a chunk each). A call
        of only the next step's requests is not interrupted: the trainer waits for them right after
        the sync anyway, and resuming them would only prefill them again in smaller batches."""
        ahead = self.owner.weights_version + 1  # the step the trainer takes next
        busy = [
            n
            for n in names
            if n in self.engines
            and any(
                c.engine == n and any(self._request_of[r][0] > ahead for r in c.ids if r in self._request_of)
                for c in self.calls.values()
            )
        ]
        control: dict[str, Any] = {}
        if self.cfg.rollout.partial_rollouts:
            control = {n: self.rt.submit_control(self.engines[n].handle, "interrupt") for n in busy}
        self.pump(lambda: not self.busy(names), admit=False)
        self._settle_control(control, "interrupted")
        return [n for n in control if n in self.engines]

    def resume_engines(self, names: Sequence[str]) -> None:
        """Interrupted engines serve again (their weights are in); an engine lost meanwhile is dropped."""
        futures = {
            n: self.rt.submit_control(self.engines[n].handle, "resume") for n in names if n in self.engines
        }
        self._settle_control(futures, "resumed")

    def _settle_control(self, futures: dict[str, Any], what: str) -> None:
        """The answers of interrupt/resume calls; an engine that died or failed to (an interrupt its
        generate call did not obey within rollout.engineTimeoutS) is dropped as lost."""
        for name, fut in futures.items():
            try:
                self.rt.get(fut)
            except Exception as e:  # lost, or the engine's own error (its requests are requeued)
                log.warning("engine %s was not %s: %s", name, what, e)
                if name in self.engines:
                    self.owner.drop_engine(name, lost=True)

    def await_engine(self) -> None:
        """Work is waiting and no engine can take it (no dedicated engine yet, its rollout pod still
        being scheduled, or every one lost): bring engines up on the rollout pods that are up, waiting
        up to rollout.engineTimeoutS for one."""
        deadline = time.monotonic() + self.cfg.rollout.engine_timeout_s
        while not any(e.awake for e in self.engines.values()):
            self.owner.reconcile_dedicated()
            if any(e.awake for e in self.engines.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    "no rollout engine is up: no rollout pod joined or came back within "
                    f"{self.cfg.rollout.engine_timeout_s:.0f} s "
                    "(spec.resources.rollout.engineTimeoutSeconds) and there is no shared engine to fall "
                    "back on (`kubectl describe rljob` says why its rollout pods are not running)"
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
            if job.episodes is not None:  # an episode starts over (its environment too)
                for i in stale:
                    job.outputs[i] = None
                    job.partial.pop(i, None)
                    self._start_episode(job, step, i)
                continue
            for i, rid in zip(stale, self.dispatcher.submit(len(stale)), strict=True):
                job.outputs[i] = None
                job.partial.pop(i, None)
                self._request_of[rid] = (step, i)


def rollout_step_metrics(outputs: Sequence[base.GenerationOutput], trainer_version: int) -> dict[str, float]:
    """One step's outputs, trained at `trainer_version`: per-token staleness and partial rollouts
    (`algos.compute_token_staleness_metrics`: `rollout/partial_fraction`, the share of requests
    interrupted at a weight sync and resumed, `rollout/staleness_tokens_mean` / `_max`), and what
    generating them cost (`rollout/prompt_tokens`, `generated_tokens`, `generation_engines`,
    `prefill_engine_s`, `decode_engine_s`: the SyncReport's inputs to a refit of the estimator)."""
    import torch  # the pipeline itself imports no torch

    from rljob_trainer.train import algos

    # Generated tokens only: an episode's observation tokens were not sampled (`agent.loss_mask_of`).
    masks = [agent.loss_mask_of(o) for o in outputs]
    versions = torch.tensor(
        [v for o, m in zip(outputs, masks, strict=True) for v, k in zip(o.versions, m, strict=True) if k],
        dtype=torch.long,
    )
    interrupted = torch.tensor([bool(o.meta.get("interrupts", 0)) for o in outputs], dtype=torch.bool)
    metrics = algos.compute_token_staleness_metrics(versions, interrupted, trainer_version=trainer_version)
    out = {k: float(v.item()) for k, v in metrics.items()}
    out["rollout/prompt_tokens"] = float(sum(len(o.prompt_token_ids) for o in outputs))
    out["rollout/generated_tokens"] = float(sum(sum(m) for m in masks))
    out["rollout/generation_engines"] = float(len({o.meta.get("engine") for o in outputs}))
    for key in base.TIMING_KEYS:
        if outputs and all(key in o.timing for o in outputs):
            out[f"rollout/{key.replace('_s', '')}_engine_s"] = float(sum(o.timing[key] for o in outputs))
    return out

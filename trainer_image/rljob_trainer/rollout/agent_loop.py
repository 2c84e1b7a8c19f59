"""The agent loop's shell: tools and environment calls on worker threads, between the engine's turns.

Role: what the pipeline (`rljob_trainer.rollout.pipeline`) needs to run episodes beside training: the
chat format (`agent.ChatFormat`), the tool box (`tools.ToolBox`, the Python sandbox in
`rollout.sandbox`), the environment's client (`environment_client.EnvironmentClient`) and a thread
pool on which tool calls, resets and steps run, so the driver's loop keeps dispatching turns and
collecting the ranks' training while a tool or an environment works (their time overlaps training,
as generation does). Each method is either pure over an `agent.Episode` or submits one call to the
pool and returns its future; the pipeline collects the futures in its `pump`.
Callers: `rljob_trainer.rollout.pipeline`, `rljob_trainer.driver`, tests.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rljob_trainer import config as config_mod
from rljob_trainer.data import sources
from rljob_trainer.rollout import agent, environment_client, tools

# Threads running tool calls and environment calls at once (each is I/O or a sandbox process).
DEFAULT_WORKERS = 16


@dataclass(frozen=True)
class ToolsDone:
    results: tuple[tools.ToolResult, ...]
    errors: tuple[str, ...]
    seconds: float


def reset_seed(seed: int, step: int, prompt: int) -> int:
    """The environment's reset seed of prompt group `prompt` at `step`: the same for every sample of a
    group (GRPO compares answers to one task), a function of (seed, step, group) only."""
    return (seed * 1_000_003 + step * 100_003 + prompt * 7_919 + 17) % (2**31 - 1)


class AgentLoop:
    """One job's agent settings made runnable (`TrainerConfig.agent`, its environment and tools)."""

    def __init__(
        self,
        cfg: config_mod.TrainerConfig,
        tokenizer: Any,
        *,
        python_runner: Callable[..., Any] | None = None,
        workers: int = DEFAULT_WORKERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if cfg.agent is None:
            raise ValueError("AgentLoop needs a config with agent settings")
        self.settings = cfg.agent
        self.tokenizer = tokenizer
        self.format = agent.ChatFormat(
            tokenizer,
            tools.tool_schemas(self.settings.tools),
            system_prompt=getattr(cfg.data, "system_prompt", None),
            demonstrations=[m.model_dump(exclude_none=True) for m in self.settings.demonstrations],
        )
        self.toolbox = tools.ToolBox(self.settings.tools, python_runner=python_runner, clock=clock)
        env = next((e for e in cfg.environments if e.name == self.settings.environment), None)
        self.env = environment_client.EnvironmentClient(env) if env is not None else None
        self.budget = self.settings.max_total_tokens or cfg.lengths.max_response_tokens
        self.max_prompt_tokens = cfg.lengths.max_prompt_tokens
        self.clock = clock
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="rljob-agent")

    @property
    def environment(self) -> bool:
        return self.env is not None

    @property
    def agent_mode(self) -> bool:
        """The environment runs whole episodes with its own agent, which calls the job's endpoint."""
        return self.env is not None and self.env.settings.mode == "agent"

    def fitting_examples(
        self, examples: list[sources.Example], source: str
    ) -> tuple[list[sources.Example], list[int]]:
        """The examples whose prompt, with the tools offered, fits lengths.maxPromptTokens (dropped, never
        cut: `sources.drop_overlong_prompts`). With an environment every example is its task, kept: the
        prompt is the environment's first observation (checked when it comes)."""
        if self.environment:
            return examples, []
        tokens = [len(self.prompt_ids(e.prompt)) for e in examples]
        return sources.drop_overlong_prompts(
            examples, tokens, max_prompt_tokens=self.max_prompt_tokens, source=source
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- episodes ------------------------------------------------------------------------------
    def prompt_ids(self, text: str) -> list[int]:
        """A task's (or an environment's first observation's) prompt with the tools offered."""
        return self.format.prompt_ids(text)

    def new_episode(self, prompt_ids: Sequence[int]) -> agent.Episode:
        return agent.Episode(tuple(prompt_ids), budget=self.budget, max_turns=self.settings.max_turns)

    def turn_text(self, token_ids: Sequence[int]) -> str:
        """A turn's text as the model wrote it, special tokens kept (a tokenizer may hold <tool_call> as
        one) less the end-of-turn token it stopped on."""
        ids = list(token_ids)
        if ids and ids[-1] in self.format.eos_ids:
            ids = ids[:-1]
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def after_turn(self, episode: agent.Episode, out: Any) -> agent.Action:
        """A finished turn into the episode, and what follows it (`agent.decide_after_turn`)."""
        text = self.turn_text(out.token_ids)
        episode.add_turn(out, text)
        return agent.decide_after_turn(episode, out, text, environment=self.environment)

    def observe(self, episode: agent.Episode, messages: Sequence[dict[str, Any]]) -> bool:
        """Append an observation turn (tool results, an environment's observation); False (and the
        episode finished at its budget) when it does not fit with a token to spare."""
        ids = self.format.observation_ids(
            messages, turn_ended_with_eos=self.format.ended_with_eos(episode.token_ids)
        )
        if not episode.fits(ids):
            episode.finish(agent.FINISH_LENGTH)
            return False
        episode.add_observation(ids)
        return True

    def observe_tools(self, episode: agent.Episode, done: ToolsDone) -> bool:
        episode.tool_calls += len(done.results) + len(done.errors)
        episode.tool_errors += sum(1 for r in done.results if not r.ok) + len(done.errors)
        episode.tool_s += done.seconds
        return self.observe(episode, agent.tool_messages(done.results, done.errors))

    def start_from_reset(self, reset: environment_client.Reset) -> agent.Episode:
        """The episode an environment's reset begins: its observation is the first user message.
        Raises `EnvironmentBadAnswer` when that prompt is longer than lengths.maxPromptTokens."""
        text = agent.observation_message(reset.observation)["content"]
        ids = self.prompt_ids(text)
        if len(ids) > self.max_prompt_tokens:
            raise environment_client.EnvironmentBadAnswer(
                f"environment {self.settings.environment}: the first observation is {len(ids)} tokens with "
                f"the chat template, over lengths.maxPromptTokens ({self.max_prompt_tokens})"
            )
        episode = self.new_episode(ids)
        episode.env_episode_id, episode.env_replica = reset.episode_id, reset.replica
        return episode

    def observe_step(self, episode: agent.Episode, step: environment_client.Step, *, turn_cut: bool) -> bool:
        """An environment step's reward and observation into the episode; True when a turn follows."""
        episode.env_rewards.append(step.reward)
        episode.env_done = step.done
        if step.final_reward is not None:
            episode.env_final_reward = step.final_reward
        decision = agent.decide_after_step(episode, done=step.done, turn_cut=turn_cut)
        if isinstance(decision, agent.Finish):
            episode.finish(decision.reason)
            return False
        return self.observe(episode, [agent.observation_message(step.observation)])

    # ---- calls on the pool ---------------------------------------------------------------------
    def submit_tools(self, calls: tools.ParsedCalls) -> concurrent.futures.Future[ToolsDone]:
        return self._pool.submit(self._run_tools, calls)

    def _run_tools(self, calls: tools.ParsedCalls) -> ToolsDone:
        t0 = self.clock()
        results = tuple(
            self.toolbox.run(c) for c in calls.calls
        )  # in order: a later call may need an earlier's
        return ToolsDone(results, calls.errors, self.clock() - t0)

    def submit_reset(self, seed: int) -> concurrent.futures.Future[Any]:
        """A reset with the environment's task (`environments[].task`) and the group's seed."""
        if self.env is None:
            raise ValueError("no environment to reset")
        return self._pool.submit(self._timed, self.env.reset, seed, self.env.settings.task)

    def submit_step(self, episode: agent.Episode, action: str) -> concurrent.futures.Future[Any]:
        if self.env is None or episode.env_episode_id is None or episode.env_replica is None:
            raise ValueError("no environment episode to step")
        return self._pool.submit(
            self._timed, self.env.step, episode.env_replica, episode.env_episode_id, action
        )

    def submit_episode(
        self, episode_id: str, seed: int, base_url: str, model: str
    ) -> concurrent.futures.Future[Any]:
        """A whole episode run by an environment of mode agent (`POST /episode`), with the environment's
        task and the group's seed; its agent calls the endpoint at `base_url` meanwhile."""
        if self.env is None:
            raise ValueError("no environment to run an episode")
        return self._pool.submit(
            self._timed, self.env.run_episode, episode_id, seed, self.env.settings.task, base_url, model
        )

    def close_episode(self, episode: agent.Episode) -> None:
        """An environment episode that ended before `done` is closed (on the pool; nobody waits)."""
        if (
            self.env is None
            or episode.env_done
            or episode.env_episode_id is None
            or episode.env_replica is None
        ):
            return
        self._pool.submit(self._timed, self.env.close, episode.env_replica, episode.env_episode_id)

    def _timed(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        """(what `fn` returned, or the `EnvironmentCallError` it raised; the seconds it took)."""
        t0 = self.clock()
        try:
            out: Any = fn(*args)
        except environment_client.EnvironmentCallError as e:
            out = e
        return out, self.clock() - t0

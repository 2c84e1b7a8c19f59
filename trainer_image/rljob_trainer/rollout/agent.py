"""Multi-turn episodes (`spec.rollout.agent`): the token list of one episode and what comes next.

Role: the pure core of the agent loop the pipeline runs (`rljob_trainer.rollout.pipeline`). An
episode is ONE token list, token-in/token-out: the prompt's ids, then each model turn's ids exactly as
the engine returned them (with the engine's log-prob and weights version of every token: an episode
can straddle weight syncs), then each observation's ids (a tool message, or an environment's
observation, rendered by the model's chat template and tokenised alone), and so on. Nothing the
engine produced is ever decoded and encoded again, so the trained tokens and log-probs are the
engine's. The loss mask is 1 on generated tokens and 0 on observation tokens
(`rljob_trainer.train.trainer.TrainSample.loss_mask`).

- `ChatFormat`: the prompt with the tools offered through the chat template
  (`apply_chat_template(..., tools=...)`; a template that ignores `tools` gets a hermes system
  message instead, as Qwen2.5's template writes one), and the ids of an observation turn: the
  template's text after an assistant message, less the end-of-turn token the engine already
  produced, then the new messages and the generation prompt (`observation_text`).
- `Episode`: the growing token list, its budget (`agent.maxTotalTokens`, response tokens generated and
  observed together) and turns (`agent.maxTurns`), and `output()`, an `AgentOutput`: an engine
  `GenerationOutput` of the whole episode plus its loss mask and what it did.
- `decide_after_turn` / `decide_after_step`: what follows a model turn (finish, run the tool calls,
  step the environment) and an environment step: pure functions of the episode and what happened.

Callers: `rljob_trainer.rollout.pipeline`, `rljob_trainer.driver`, tests.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rljob_trainer.engines import base
from rljob_trainer.rollout import tools as tools_mod

# Why an episode ended (`AgentOutput.finish_reason`, metric `agent/finish/<reason>`).
FINISH_ANSWERED = "stop"  # a model turn without a tool call: its answer
FINISH_LENGTH = "length"  # the token budget is spent
FINISH_MAX_TURNS = "max_turns"  # it still called a tool after agent.maxTurns turns
FINISH_ENV_DONE = "env_done"  # the environment said done
FINISH_FAILED = "failed"  # the environment failed (no answer, an error): reward 0, counted
FINISH_REASONS = (FINISH_ANSWERED, FINISH_LENGTH, FINISH_MAX_TURNS, FINISH_ENV_DONE, FINISH_FAILED)

# A string no chat template writes, to find where an assistant message's content ends.
_SENTINEL = "\u2063rljob-assistant-content\u2063"


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot render an agent's turns (named, with the fix)."""


@dataclass(frozen=True)
class AgentOutput(base.GenerationOutput):
    """One episode as an engine output: `token_ids` are every response token (generated and observed,
    in order), `logprobs` and `token_versions` aligned with them (the engine's on generated tokens, 0.0
    and the preceding turn's version on observation tokens), `loss_mask` 1 on generated tokens and 0
    on observation tokens. `meta["version"]` is the oldest generated token's version (the staleness
    bound's), `meta["engine"]` the engine of its first turn."""

    loss_mask: tuple[int, ...] = ()
    turns: int = 0
    turn_texts: tuple[str, ...] = ()
    tool_calls: int = 0
    tool_errors: int = 0
    tool_s: float = 0.0
    env_reward: float | None = None
    failure: str | None = None
    episode_s: float = 0.0  # wall seconds from its first turn (or reset) to its end
    wait_s: float = 0.0  # of which in tool and environment calls

    @property
    def generated_versions(self) -> tuple[int, ...]:
        """The weights version of each generated (trained) token."""
        return tuple(v for v, m in zip(self.versions, self.loss_mask, strict=True) if m)

    @property
    def generated_tokens(self) -> int:
        return sum(self.loss_mask)


def loss_mask_of(out: base.GenerationOutput) -> tuple[int, ...]:
    """The loss mask of any engine output: an episode's own, else every token trained."""
    mask = getattr(out, "loss_mask", ())
    return tuple(mask) if mask else (1,) * len(out.token_ids)


# ---- the chat template ---------------------------------------------------------------------------
def hermes_system_prompt(schemas: Sequence[Mapping[str, Any]]) -> str:
    """The tools in a system message, hermes style, for templates that ignore `tools=`: one line per
    tool (name, arguments, description) and how to call one."""
    lines = ["You can call these tools:"]
    for s in schemas:
        fn = s["function"]
        args = ", ".join(fn.get("parameters", {}).get("properties", {}))
        lines.append(f"- {fn['name']}({args}): {fn.get('description', '')}")
    lines.append(
        'To call one, write <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>; '
        "its result comes back in the next message. Give your final answer without a tool call."
    )
    return "\n".join(lines)


class ChatFormat:
    """How one tokenizer's chat template renders an agent's prompt and observation turns."""

    def __init__(
        self,
        tokenizer: Any,
        tool_schemas: Sequence[Mapping[str, Any]] = (),
        *,
        system_prompt: str | None = None,
        demonstrations: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                "rollout.agent needs a tokenizer with a chat template (tools are offered through it and "
                "tool results are rendered by it); use a chat model, or a tokenizer_config.json with one"
            )
        self.tokenizer = tokenizer
        self.tool_schemas = [dict(s) for s in tool_schemas]
        self.system_prompt = system_prompt  # the data's (data.systemPrompt), before the tools'
        self.demonstrations = [dict(m) for m in demonstrations]  # worked examples before each task
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.eos_text = tokenizer.decode(sorted(self.eos_ids)[:1]) if self.eos_ids else ""
        self.system_tools = bool(self.tool_schemas) and not self._template_uses_tools()
        self._tail = self._assistant_tail()

    def _render(self, messages: list[dict[str, Any]], *, generation_prompt: bool, tools: bool) -> str:
        kwargs: dict[str, Any] = {"tools": self.tool_schemas} if tools and self.tool_schemas else {}
        return str(
            self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs
            )
        )

    def _template_uses_tools(self) -> bool:
        msgs = [{"role": "user", "content": "hi"}]
        return self._render(msgs, generation_prompt=True, tools=True) != self._render(
            msgs, generation_prompt=True, tools=False
        )

    def _assistant_tail(self) -> str:
        """What the template writes after an assistant message's content (e.g. '<|im_end|>\\n')."""
        text = self._render(
            [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}],
            generation_prompt=False,
            tools=False,
        )
        at = text.rfind(_SENTINEL)
        if at < 0:
            raise ChatTemplateError("the chat template drops the assistant's content; it cannot run an agent")
        return text[at + len(_SENTINEL) :]

    # ---- prompts -------------------------------------------------------------------------------
    def prompt_messages(self, text: str) -> list[dict[str, Any]]:
        system = [self.system_prompt] if self.system_prompt else []
        if self.system_tools:
            system.append(hermes_system_prompt(self.tool_schemas))
        msgs = [{"role": "system", "content": "\n\n".join(system)}] if system else []
        return [*msgs, *self.demonstrations, {"role": "user", "content": text}]

    def prompt_text(self, text: str) -> str:
        return self._render(self.prompt_messages(text), generation_prompt=True, tools=not self.system_tools)

    def prompt_ids(self, text: str) -> list[int]:
        """The first user message (a task, or an environment's first observation) with the tools offered
        and the generation prompt: the episode's prompt ids."""
        return list(self.tokenizer.encode(self.prompt_text(text), add_special_tokens=False))

    # ---- observation turns ---------------------------------------------------------------------
    def observation_text(self, messages: Sequence[Mapping[str, Any]], *, turn_ended_with_eos: bool) -> str:
        """The text between a model turn's last generated token and the next model turn: the rest of
        the template's end of the assistant message (its end-of-turn token is in the turn already
        when the engine stopped on it), the `messages` (tool results, or an environment's observation
        as a user message) and the generation prompt. Rendered as the template renders them after an
        assistant message, so consecutive tool results group as the template groups them."""
        base_msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        before = self._render(base_msgs, generation_prompt=False, tools=False)
        after = self._render([*base_msgs, *map(dict, messages)], generation_prompt=True, tools=False)
        if not after.startswith(before):
            raise ChatTemplateError(
                "the chat template renders earlier messages differently once a "
                f"{messages[0].get('role') if messages else ''} message follows; it cannot append turns "
                "token by token"
            )
        tail = self._tail
        if turn_ended_with_eos and self.eos_text and tail.startswith(self.eos_text):
            tail = tail[len(self.eos_text) :]
        return tail + after[len(before) :]

    def observation_ids(
        self, messages: Sequence[Mapping[str, Any]], *, turn_ended_with_eos: bool
    ) -> list[int]:
        """`observation_text` tokenised alone (never the model's tokens with it)."""
        text = self.observation_text(messages, turn_ended_with_eos=turn_ended_with_eos)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def ended_with_eos(self, token_ids: Sequence[int]) -> bool:
        return bool(token_ids) and token_ids[-1] in self.eos_ids


def tool_messages(
    results: Sequence[tools_mod.ToolResult], errors: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """One tool message per result, then one per malformed call (its error)."""
    msgs = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
    msgs += [{"role": "tool", "name": "error", "content": f"error: {e}"} for e in errors]
    return msgs


def observation_message(observation: Any) -> dict[str, Any]:
    """An environment's observation as the next user message (a non-string is sent as JSON)."""
    text = observation if isinstance(observation, str) else json.dumps(observation)
    return {"role": "user", "content": text}


# ---- one episode ---------------------------------------------------------------------------------
@dataclass
class Episode:
    """One episode's token list as it grows (the pipeline owns it; one per request of a step)."""

    prompt_ids: tuple[int, ...]
    budget: int  # response tokens (generated + observed) the episode may hold
    max_turns: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    engine: str | None = None  # the engine of its last turn: the next goes there (its prefix cache)
    turn_texts: list[str] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    tool_s: float = 0.0
    env_episode_id: str | None = None
    env_replica: str | None = None  # the environment replica that holds it
    env_done: bool = False
    env_rewards: list[float] = field(default_factory=list)
    env_final_reward: float | None = None
    interrupts: int = 0
    timing: dict[str, float] = field(default_factory=dict)
    finish_reason: str | None = None
    failure: str | None = None
    started_s: float | None = None  # the pipeline's clock: first turn dispatched (or reset sent)
    finished_s: float | None = None
    wait_s: float = 0.0  # seconds its tool and environment calls ran (on the agent loop's threads)

    @property
    def context(self) -> list[int]:
        """What the next turn is generated from: the prompt and every response token so far."""
        return [*self.prompt_ids, *self.token_ids]

    @property
    def remaining(self) -> int:
        return self.budget - len(self.token_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add_turn(self, out: base.GenerationOutput, text: str) -> None:
        """A model turn as the engine returned it: its ids, log-probs and per-token versions, trained."""
        if tuple(out.prompt_token_ids) != tuple(self.context):
            raise ValueError("a turn's prompt must be the episode's context (token-in/token-out)")
        if len(out.token_ids) > self.remaining:
            raise ValueError(
                f"a turn of {len(out.token_ids)} tokens exceeds the episode's {self.remaining} left"
            )
        if out.token_ids and len(out.logprobs) != len(out.token_ids):
            raise ValueError("an engine output without a log-prob per token cannot be trained on")
        # Its next turn goes where this one ran: the first turn's engine, or the one it continued on
        # after that engine was lost.
        self.engine = out.meta.get("engine") or self.engine
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.versions += out.versions
        self.mask += [1] * len(out.token_ids)
        self.turns += 1
        self.turn_texts.append(text)
        self.interrupts += int(out.meta.get("interrupts", 0))
        for k, v in out.timing.items():
            self.timing[k] = self.timing.get(k, 0.0) + v

    def fits(self, ids: Sequence[int]) -> bool:
        """Whether an observation of `ids` fits and leaves room for at least one generated token."""
        return len(ids) < self.remaining

    def add_observation(self, ids: Sequence[int]) -> None:
        """Observation tokens (a tool message, an environment's observation): masked out of the loss."""
        if not self.fits(ids):
            raise ValueError(f"an observation of {len(ids)} tokens does not fit the {self.remaining} left")
        version = self.versions[-1] if self.versions else 0
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.mask += [0] * len(ids)

    def finish(self, reason: str, failure: str | None = None) -> None:
        if reason not in FINISH_REASONS:
            raise ValueError(f"unknown finish reason {reason!r}; valid: {', '.join(FINISH_REASONS)}")
        self.finish_reason = reason
        self.failure = failure

    @property
    def env_reward(self) -> float | None:
        """The environment's reward: the final one `done` gave, else the sum of the step rewards
        (None without an environment; 0 for one that failed)."""
        if self.failure is not None and self.env_episode_id is not None:
            return 0.0
        if self.env_final_reward is not None:
            return self.env_final_reward
        return sum(self.env_rewards) if self.env_episode_id is not None else None

    def output(self, meta: Mapping[str, Any] | None = None) -> AgentOutput:
        """The finished episode as one engine output (`AgentOutput`)."""
        generated = [v for v, m in zip(self.versions, self.mask, strict=True) if m]
        out_meta = {
            **(meta or {}),
            "engine": self.engine,
            "version": min(generated, default=0),
            "interrupts": self.interrupts,
            "generated_tokens": len(generated),
        }
        # A failed episode (its environment did not answer) trains nothing: its mask is all 0.
        mask = tuple(self.mask) if self.failure is None else (0,) * len(self.mask)
        return AgentOutput(
            prompt_token_ids=self.prompt_ids,
            token_ids=tuple(self.token_ids),
            logprobs=tuple(self.logprobs),
            finish_reason=self.finish_reason or FINISH_LENGTH,
            meta=out_meta,
            token_versions=tuple(self.versions),
            timing=dict(self.timing),
            loss_mask=mask,
            turns=self.turns,
            turn_texts=tuple(self.turn_texts),
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
            tool_s=self.tool_s,
            env_reward=self.env_reward,
            failure=self.failure,
            episode_s=(self.finished_s - self.started_s)
            if self.finished_s is not None and self.started_s is not None
            else 0.0,
            wait_s=self.wait_s,
        )


# ---- what follows a turn -------------------------------------------------------------------------
@dataclass(frozen=True)
class Finish:
    reason: str


@dataclass(frozen=True)
class CallTools:
    calls: tools_mod.ParsedCalls


@dataclass(frozen=True)
class StepEnvironment:
    action: str


Action = Finish | CallTools | StepEnvironment


def decide_after_turn(
    episode: Episode, out: base.GenerationOutput, text: str, *, environment: bool
) -> Action:
    """What follows a model turn that `episode` already holds (`Episode.add_turn`).

    With an environment every turn is its action (`StepEnvironment`), even one the budget cut: the
    environment scores it. Without one: a turn the budget cut ends the episode (`length`); a turn
    without a tool call is the answer (`stop`); one with calls runs them (`CallTools`), unless it was
    the last turn `agent.maxTurns` allows (`max_turns`) or no token is left for the next turn."""
    if environment:
        return StepEnvironment(text)
    if out.finish_reason == "length" or episode.remaining <= 0:
        return Finish(FINISH_LENGTH)
    calls = tools_mod.parse_tool_calls(text)
    if not calls.any:
        return Finish(FINISH_ANSWERED)
    if episode.turns >= episode.max_turns:
        return Finish(FINISH_MAX_TURNS)
    return CallTools(calls)


def decide_after_step(episode: Episode, *, done: bool, turn_cut: bool) -> Literal["observe"] | Finish:
    """What follows an environment step: `done` ends it, so do the turn limit and a spent budget
    (`turn_cut`: the turn stopped at the budget); else its observation is appended."""
    if done:
        return Finish(FINISH_ENV_DONE)
    if turn_cut or episode.remaining <= 0:
        return Finish(FINISH_LENGTH)
    if episode.turns >= episode.max_turns:
        return Finish(FINISH_MAX_TURNS)
    return "observe"


# ---- what the driver reads of a step's episodes ---------------------------------------------------
class AllEpisodesFailedError(RuntimeError):
    """Every episode of a step failed (the environment answers nothing): the job fails, naming why."""


def completion_text(out: base.GenerationOutput, decode: Any) -> str:
    """What the rewards read of an output: an episode's own turns (never the tool results or the
    observations, so a tool cannot answer for the model), a single turn's text otherwise."""
    if isinstance(out, AgentOutput):
        return "\n".join(out.turn_texts)
    return str(decode(list(out.token_ids), skip_special_tokens=True))


def advantage_groups(outputs: Sequence[base.GenerationOutput], group_ids: Sequence[int]) -> list[int]:
    """The group of each sample for the advantage: its prompt's, except a failed episode's or a
    response the judge could not score (`meta["unscored"]`), which is a group of its own (advantage 0,
    `algos.compute_grpo_advantages`), so its placeholder reward never moves its group's mean or std;
    a failed episode trains nothing either (its loss mask is 0)."""
    fresh = max(group_ids, default=-1) + 1
    out = []
    for o, g in zip(outputs, group_ids, strict=True):
        if getattr(o, "failure", None) is not None or o.meta.get("unscored"):
            out.append(fresh)
            fresh += 1
        else:
            out.append(g)
    return out


def check_not_all_failed(outputs: Sequence[base.GenerationOutput], step: int) -> None:
    """Raise `AllEpisodesFailedError` when every episode of a step failed: an environment that fails
    some episodes costs them, one that fails them all leaves nothing to train."""
    failures = [o.failure for o in outputs if isinstance(o, AgentOutput) and o.failure is not None]
    if outputs and len(failures) == len(outputs):
        raise AllEpisodesFailedError(
            f"every episode of step {step} failed ({len(failures)}): {failures[0]}; check the environment's "
            "pods and logs, or raise environments[].timeoutS"
        )


def agent_step_metrics(
    outputs: Sequence[base.GenerationOutput], *, env_failures: int = 0
) -> dict[str, float]:
    """A step's `agent/*` metrics (pure): turns, tool calls and their errors, tokens generated and
    observed per episode, how episodes ended (a share per reason), failures, and the share of an
    episode's wall time spent in tools and environment calls (`agent/tool_time_share`)."""
    eps = [o for o in outputs if isinstance(o, AgentOutput)]
    if not eps:
        return {}
    n = len(eps)
    generated = [int(o.meta.get("generated_tokens", o.generated_tokens)) for o in eps]
    wall = sum(o.episode_s for o in eps)
    calls = sum(o.tool_calls for o in eps)
    metrics = {
        "agent/episodes": float(n),
        "agent/turns_mean": sum(o.turns for o in eps) / n,
        "agent/tool_calls": float(calls),
        "agent/tool_calls_mean": calls / n,
        "agent/tool_errors": float(sum(o.tool_errors for o in eps)),
        "agent/tool_error_fraction": sum(o.tool_errors for o in eps) / calls if calls else 0.0,
        "agent/generated_tokens_mean": sum(generated) / n,
        "agent/observation_tokens_mean": sum(
            len(o.token_ids) - g for o, g in zip(eps, generated, strict=True)
        )
        / n,
        "agent/episode_s_mean": wall / n,
        "agent/wait_s": sum(o.wait_s for o in eps),
        "agent/tool_time_share": sum(o.wait_s for o in eps) / wall if wall > 0 else 0.0,
        "agent/env_failures": float(env_failures),
        "agent/failed_fraction": sum(1 for o in eps if o.failure is not None) / n,
    }
    for reason in FINISH_REASONS:
        metrics[f"agent/finish/{reason}"] = sum(1 for o in eps if o.finish_reason == reason) / n
    return metrics

"""An agent's calls to the job's endpoint, as tokens: their prompts, and the training samples they make.

Role: the functional core of the endpoint's episodes (`rljob_trainer.rollout.endpoint` is the shell).
Two questions, both answered token-in/token-out (what an engine generated is never re-tokenised):

1. **What does a call send to the engine?** (`PromptRenderer`) An agent written against an OpenAI
   client sends its whole conversation every call. When that conversation is an earlier call's
   messages, then one of the answers the endpoint returned for it (the same text and tool calls),
   then new messages (tool results, the environment's next words), the prompt is that earlier
   call's prompt ids + the answer's token ids exactly as the engine generated them + the new
   messages rendered by the chat template after an assistant message and tokenised alone
   (`agent.ChatFormat.observation_ids`, the trainer's own agent loop's rule). Otherwise the
   conversation is rendered whole by the chat template (`apply_chat_template(..., tools=...)`; a
   template that ignores `tools` gets the hermes system message the agent loop writes). The legacy
   completions API does the same by text: a prompt that is an earlier prompt + one of its
   completions' text + more continues from their tokens.
2. **What does an episode train on?** (`assemble_segments`) Each choice of each call is a turn: its
   prompt ids and the engine's output (ids, log-probs, the weights version of every token). A turn
   whose prompt starts with a segment's tokens so far (its prompt and every turn and observation
   since) extends that segment: the prompt's new tokens are an observation (loss mask 0), the
   turn's tokens are trained (1). Any other turn starts a segment of its own. Each segment is one
   training sample (`agent.AgentOutput`), every one of an episode's segments gets the episode's
   reward and advantage (`training_outputs`). With the prefix reuse above, an agent that sends its
   conversation back as it received it makes ONE sample per episode, as the trainer's own loop does;
   an agent that rewrites its history (drops a thought, summarises, edits a message) starts a new
   segment at each rewrite: still exact, but the episode weighs as several samples in a
   sequence-mean loss, and the rewritten prefix is prefilled again.

Callers: `rljob_trainer.rollout.endpoint`, `rljob_trainer.rollout.pipeline`, `rljob_trainer.driver`,
tests.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rljob_trainer.engines import base
from rljob_trainer.rollout import agent, openai_wire

# Formats kept per tool set (each probes the template a few times when made).
_FORMATS_KEPT = 32


@dataclass(frozen=True)
class RecordedTurn:
    """One choice of one call, as the engine generated it: `output.prompt_token_ids` is what the engine
    was given, `output.token_ids` what the choice kept (cut before a stop string), with their log-probs
    and per-token weights versions."""

    call: int  # the call's place in its episode (0, 1, ...)
    choice: int
    output: base.GenerationOutput
    text: str
    tool_calls: int
    seconds: float  # the call's wall time in the endpoint, queue included


@dataclass(frozen=True)
class ChatRecord:
    """A chat call's conversation and what each of its choices answered (for prefix reuse)."""

    messages: tuple[openai_wire.Message, ...]
    tools_key: str
    prompt_ids: tuple[int, ...]
    answers: tuple[tuple[openai_wire.Message, tuple[int, ...]], ...]  # (assistant message, its token ids)


@dataclass(frozen=True)
class CompletionRecord:
    """A completions call's prompt text and each choice's (text, token ids), for prefix reuse."""

    prompt_text: str
    prompt_ids: tuple[int, ...]
    answers: tuple[tuple[str, tuple[int, ...]], ...]


def tools_key(tools: Sequence[dict[str, Any]]) -> str:
    return json.dumps(list(tools), sort_keys=True)


def find_chat_continuation(
    records: Sequence[ChatRecord], messages: Sequence[openai_wire.Message], key: str
) -> tuple[ChatRecord, tuple[int, ...], tuple[openai_wire.Message, ...]] | None:
    """The longest earlier call whose messages, then one of its answers, begin `messages` (with the
    same tools): (that record, the answer's token ids, the messages after it), or None."""
    best = None
    for rec in records:
        n = len(rec.messages)
        if rec.tools_key != key or len(messages) <= n + 1 or tuple(messages[:n]) != rec.messages:
            continue
        for answer, ids in rec.answers:
            if messages[n].same_turn(answer) and (best is None or n > len(best[0].messages)):
                best = (rec, ids, tuple(messages[n + 1 :]))
    return best


def find_completion_continuation(
    records: Sequence[CompletionRecord], prompt: str, eos_ids: frozenset[int]
) -> tuple[tuple[int, ...], str] | None:
    """The longest earlier prompt + completion text that begins `prompt`: (their token ids, the rest of
    the text), or None. A completion that ended on the end-of-text token is not continued (its text
    does not hold that token)."""
    best: tuple[tuple[int, ...], str] | None = None
    for rec in records:
        for text, ids in rec.answers:
            head = rec.prompt_text + text
            if (ids and ids[-1] in eos_ids) or not prompt.startswith(head) or len(prompt) == len(head):
                continue
            if best is None or len(rec.prompt_ids) + len(ids) > len(best[0]):
                best = ((*rec.prompt_ids, *ids), prompt[len(head) :])
    return best


class PromptRenderer:
    """The prompt ids of a call (see the module docstring, question 1), for one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self._formats: dict[str, agent.ChatFormat] = {}

    def format(self, tools: Sequence[dict[str, Any]]) -> agent.ChatFormat:
        key = tools_key(tools)
        fmt = self._formats.get(key)
        if fmt is None:
            try:
                fmt = agent.ChatFormat(self.tokenizer, tools)
            except agent.ChatTemplateError as exc:
                raise openai_wire.bad(f"chat completions: {exc}", "messages") from None
            if len(self._formats) >= _FORMATS_KEPT:
                self._formats.pop(next(iter(self._formats)))
            self._formats[key] = fmt
        return fmt

    def render_chat(
        self, messages: Sequence[openai_wire.Message], tools: Sequence[dict[str, Any]]
    ) -> list[int]:
        """The whole conversation through the chat template, with the generation prompt."""
        fmt = self.format(tools)
        msgs = [m.template_message() for m in messages]
        kwargs: dict[str, Any] = {}
        if tools and fmt.system_tools:  # the template ignores tools: the agent loop's hermes system message
            hermes = agent.hermes_system_prompt(fmt.tool_schemas)
            if msgs and msgs[0]["role"] == "system":
                msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{hermes}"}
            else:
                msgs.insert(0, {"role": "system", "content": hermes})
        elif tools:
            kwargs["tools"] = list(tools)
        try:
            text = self.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=True, tokenize=False, **kwargs
            )
        except Exception as exc:  # the template's own error (jinja raise_exception, a missing field)
            raise openai_wire.bad(
                f"the model's chat template refused these messages: {exc}", "messages"
            ) from None
        return list(self.tokenizer.encode(str(text), add_special_tokens=False))

    def chat_prompt(
        self,
        messages: Sequence[openai_wire.Message],
        tools: Sequence[dict[str, Any]],
        records: Sequence[ChatRecord],
    ) -> tuple[list[int], bool]:
        """(prompt ids, whether they continue an earlier call's tokens)."""
        found = find_chat_continuation(records, messages, tools_key(tools))
        if found is not None:
            rec, answer_ids, tail = found
            fmt = self.format(tools)
            try:
                obs = fmt.observation_ids(
                    [m.template_message() for m in tail], turn_ended_with_eos=fmt.ended_with_eos(answer_ids)
                )
            except agent.ChatTemplateError:
                obs = None  # the template renders history differently once these follow: render it whole
            if obs is not None:
                return [*rec.prompt_ids, *answer_ids, *obs], True
        return self.render_chat(messages, tools), False

    def completion_prompt(
        self, prompt: str | tuple[int, ...], records: Sequence[CompletionRecord]
    ) -> tuple[list[int], bool]:
        """(prompt ids, whether they continue earlier tokens): token ids as given; text continued from an
        earlier prompt + completion's tokens when it extends them, else encoded as vLLM encodes it."""
        if not isinstance(prompt, str):
            vocab = len(self.tokenizer)
            bad = next((t for t in prompt if t >= vocab), None)
            if bad is not None:
                raise openai_wire.bad(
                    f"prompt holds token id {bad}, outside the vocabulary ({vocab})", "prompt"
                )
            return list(prompt), False
        found = find_completion_continuation(records, prompt, self.eos_ids)
        if found is not None:
            head, rest = found
            return [*head, *self.tokenizer.encode(rest, add_special_tokens=False)], True
        return list(self.tokenizer.encode(prompt)), False


# ---- an episode's samples ------------------------------------------------------------------------
@dataclass(frozen=True)
class EndpointEpisodeOutput(agent.AgentOutput):
    """An episode of an environment of mode agent: its fields are its first segment's (so it reads as
    one `AgentOutput` for the rewards and the metrics), `segments` all of its samples (empty for a
    failed episode: the placeholder trains nothing). `meta["version"]` is the oldest generated token's
    over every segment (the staleness bound's), `meta["generated_tokens"]` their sum."""

    segments: tuple[agent.AgentOutput, ...] = ()


def assemble_segments(turns: Iterable[RecordedTurn]) -> list[agent.Episode]:
    """An episode's turns (in call order, choices in order) as segments: a turn whose prompt begins
    with a segment's tokens so far extends the longest such segment (the prompt's new tokens an
    observation, masked), any other starts one. Each segment is one training sample."""
    segments: list[agent.Episode] = []
    for t in sorted(turns, key=lambda t: (t.call, t.choice)):
        prompt = tuple(t.output.prompt_token_ids)
        fits = [
            s
            for s in segments
            if len(s.context) <= len(prompt) and prompt[: len(s.context)] == tuple(s.context)
        ]
        seg = max(fits, key=lambda s: len(s.context), default=None)
        if seg is None:
            seg = agent.Episode(prompt, budget=sys.maxsize, max_turns=sys.maxsize)
            segments.append(seg)
        else:
            seg.add_observation(prompt[len(seg.context) :])
        seg.add_turn(t.output, t.text)
    for seg in segments:
        seg.finish(agent.FINISH_ENV_DONE)
    return segments


def episode_output(
    turns: Sequence[RecordedTurn],
    *,
    reward: float,
    started_s: float,
    finished_s: float,
    meta: dict[str, Any] | None = None,
) -> EndpointEpisodeOutput:
    """A finished episode's samples and what it did. Its wait (`agent/tool_time_share`) is the episode's
    time outside the endpoint's calls: the agent's own tools and the environment's work."""
    if not turns:
        raise ValueError("an episode without a call has nothing to train on (`failed_output`)")
    segments = [s.output() for s in assemble_segments(turns)]
    first = segments[0]
    fields = {f.name: getattr(first, f.name) for f in dataclasses.fields(first)}
    calls = {t.call: t.seconds for t in turns}
    episode_s = max(0.0, finished_s - started_s)
    fields.update(
        meta={
            **first.meta,
            **(meta or {}),
            "version": min(int(s.meta["version"]) for s in segments),
            "generated_tokens": sum(s.generated_tokens for s in segments),
            "segments": len(segments),
        },
        turns=len(turns),
        turn_texts=tuple(t.text for t in sorted(turns, key=lambda t: (t.call, t.choice))),
        tool_calls=sum(t.tool_calls for t in turns),
        env_reward=float(reward),
        episode_s=episode_s,
        wait_s=max(0.0, episode_s - sum(calls.values())),
    )
    return EndpointEpisodeOutput(**fields, segments=tuple(segments))


def failed_output(
    eos_id: int, failure: str, *, started_s: float, finished_s: float, meta: dict[str, Any] | None = None
) -> EndpointEpisodeOutput:
    """A failed episode's placeholder (the environment did not answer, or the agent made no call): one
    masked token, no segment; it trains nothing and is a group of its own (`agent.advantage_groups`)."""
    ep = agent.Episode((eos_id,), budget=2, max_turns=1)
    ep.add_observation([eos_id])
    ep.finish(agent.FINISH_FAILED, failure=failure)
    out = ep.output(meta)
    fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    fields.update(env_reward=0.0, episode_s=max(0.0, finished_s - started_s))
    return EndpointEpisodeOutput(**fields)


def training_outputs(
    outputs: Sequence[base.GenerationOutput], advantages: Sequence[float]
) -> tuple[list[base.GenerationOutput], list[float]]:
    """One entry per training sample: an endpoint episode's segments each with its episode's advantage,
    every other output as it is."""
    outs: list[base.GenerationOutput] = []
    advs: list[float] = []
    for o, a in zip(outputs, advantages, strict=True):
        parts: tuple[base.GenerationOutput, ...] = (
            o.segments if isinstance(o, EndpointEpisodeOutput) and o.segments else (o,)
        )
        outs.extend(parts)
        advs.extend([a] * len(parts))
    return outs, advs

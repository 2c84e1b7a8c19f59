"""OpenAI's wire format for the job's endpoint: requests checked, responses built (pure).

Role: the functional core of `rljob_trainer.rollout.endpoint` (the server is its shell). A request
body becomes a `ChatRequest` or a `CompletionRequest`, or a `WireError` naming the field and the fix
(HTTP 400 in OpenAI's error shape, so any OpenAI client raises `BadRequestError` with that message);
the engine's outputs become a `chat.completion` or `text_completion` body; `authorized` checks the
bearer token in constant time. Nothing here reads a clock, an id generator or the environment: the
shell passes `created` and ids in.

What the endpoint serves, and why it refuses the rest (it trains on what it serves, so it may not
serve what it cannot train on exactly):
- Sampling is the job's, never the request's: `temperature` and `top_p` are accepted (an agent may
  set them) and ignored, because the trainer computes its log-probs under the job's temperature and
  top-p (`rljob_trainer.model.sampling`), and a token sampled otherwise would be trained with the
  wrong behaviour probability. `seed` is ignored too (each call's seed is the job's, per episode).
- `frequency_penalty`, `presence_penalty`, `logit_bias`, `response_format` other than text,
  `top_logprobs` above 0 (the engine returns the sampled token's log-prob only), `echo`, `suffix`,
  `best_of` above 1 and `tool_choice` other than auto/none are refused by name; unknown top-level
  arguments are refused as OpenAI refuses them.
- `stream: true` is served as Server-Sent Events in OpenAI's chunk format (`chat_chunks`,
  `completion_chunks`; `stream_options.include_usage` adds the usage chunk). The engines generate a
  call's whole completion before it is answered, so its chunks are cut from the finished choice
  (one per token, text held back while a character is incomplete, `stream_pieces`): the text they
  join to is the non-streaming answer's, and what is trained on is the same either way.
- `stop` strings are applied to the engine's output (`apply_stop`): the tokens kept are the longest
  prefix whose text ends before the first stop string, and the text returned is theirs, so a
  choice's text always decodes the tokens recorded for training.
- With `tools`, hermes tool calls in the text (`<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`, `rollout.tools.parse_tool_calls`) come back as `message.tool_calls`.
- `return_token_ids` (vLLM's extension, through `extra_body`): the prompt's and each choice's token
  ids in the response.
Callers: `rljob_trainer.rollout.endpoint`, tests.
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rljob_trainer.rollout import tools as tools_mod

#: Most choices one call may ask for (`n`).
MAX_CHOICES = 16
#: Most stop strings (OpenAI's limit).
MAX_STOP_STRINGS = 4
ROLES = ("system", "developer", "user", "assistant", "tool")
# Arguments accepted and ignored (they do not change what is sampled, or the job's sampling wins).
_IGNORED = frozenset(
    {
        "temperature",
        "top_p",
        "seed",
        "user",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "reasoning_effort",
        "prompt_cache_key",
        "safety_identifier",
    }
)
_CHAT_FIELDS = frozenset(
    {
        "model",
        "messages",
        "tools",
        "tool_choice",
        "n",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "logprobs",
        "top_logprobs",
        "stream",
        "stream_options",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "response_format",
        "return_token_ids",
    }
)
_COMPLETION_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "n",
        "max_tokens",
        "stop",
        "logprobs",
        "stream",
        "stream_options",
        "echo",
        "suffix",
        "best_of",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "return_token_ids",
    }
)
# A hermes tool call in a turn's text (`rollout.tools`), removed from the content it is returned apart from.
_TOOL_CALL = re.compile(
    re.escape(tools_mod.TOOL_CALL_OPEN) + r".*?" + re.escape(tools_mod.TOOL_CALL_CLOSE), re.DOTALL
)
# The legacy completions API's default (OpenAI's).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class WireError(Exception):
    """A request the endpoint refuses: its HTTP status and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> WireError:
    return WireError(400, message, param=param, code=code)


# ---- authentication ------------------------------------------------------------------------------
def authorized(header: str | None, token: str) -> bool:
    """Whether an `Authorization` header carries the job's bearer token (constant-time compare)."""
    if not header or not token:
        return False
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(value.strip().encode(), token.encode())


def unauthorized() -> WireError:
    return WireError(
        401,
        "this endpoint needs the job's token: send Authorization: Bearer $OPENAI_API_KEY (the "
        "environment pods of mode agent have it; the operator's Secret <job>-endpoint-<uid> holds it)",
        code="invalid_api_key",
    )


# ---- requests ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Message:
    """One chat message as the endpoint keeps it: text content, and an assistant's tool calls as
    (name, arguments) pairs (the arguments decoded from OpenAI's JSON string)."""

    role: str
    content: str
    tool_calls: tuple[tuple[str, str], ...] = ()  # (name, arguments as canonical JSON)
    tool_call_id: str | None = None
    name: str | None = None

    def template_message(self) -> dict[str, Any]:
        """What a Hugging Face chat template takes (arguments as objects, `developer` as `system`)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [
                {"type": "function", "function": {"name": n, "arguments": json.loads(a)}}
                for n, a in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def same_turn(self, other: Message) -> bool:
        """Whether two messages say the same (role, text, tool calls): how an assistant message the
        endpoint returned is recognised when the agent sends it back (ids and extra fields aside)."""
        return (self.role, self.content, self.tool_calls) == (other.role, other.content, other.tool_calls)


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...] = ()  # offered through the chat template (empty: none)
    n: int = 1
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    return_token_ids: bool = False
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | tuple[int, ...]
    n: int = 1
    max_tokens: int = COMPLETIONS_DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    return_token_ids: bool = False
    stream: bool = False
    include_usage: bool = False


def _int(body: Mapping[str, Any], key: str, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{key} must be an integer, got {value!r}", key)
    if value < low or (high is not None and value > high):
        limit = f"{low}..{high}" if high is not None else f">= {low}"
        raise bad(f"{key} must be {limit}, got {value}", key)
    return value


def _number(body: Mapping[str, Any], key: str, low: float, high: float) -> None:
    value = body.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise bad(f"{key} must be a number in [{low:g}, {high:g}], got {value!r}", key)


def _common(body: Any, allowed: frozenset[str]) -> None:
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    unknown = sorted(set(body) - allowed - _IGNORED)
    if unknown:
        raise bad(
            f"unrecognized request argument supplied: {', '.join(unknown)} (this endpoint serves the "
            "job's rollout engines; see docs/agents.md for what it takes)",
            unknown[0],
        )
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise bad("model is required: the name GET /v1/models lists", "model")
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0)
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise bad(
                f"{key} changes what is sampled, and the trainer could not train on it exactly: omit it", key
            )
    if body.get("logit_bias"):
        raise bad(
            "logit_bias changes what is sampled, and the trainer could not train on it: omit it", "logit_bias"
        )
    if not isinstance(body.get("return_token_ids", False), bool):
        raise bad("return_token_ids must be true or false", "return_token_ids")


def _stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage), checked as OpenAI checks them."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream must be true or false", "stream")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False
    if not stream:
        raise bad("stream_options is only allowed when stream is true", "stream_options")
    # include_obfuscation asks for random padding against length side channels; the endpoint is
    # in-cluster only and sends none, so it is accepted and has nothing to do.
    unknown = (
        sorted(set(options) - {"include_usage", "include_obfuscation"}) if isinstance(options, dict) else []
    )
    if not isinstance(options, dict) or unknown or not isinstance(options.get("include_usage", False), bool):
        raise bad("stream_options must be an object {include_usage: true or false}", "stream_options")
    return True, bool(options.get("include_usage", False))


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or not all(isinstance(s, str) and s for s in stops)
        or len(stops) > MAX_STOP_STRINGS
    ):
        raise bad(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them", "stop")
    return tuple(stops)


def _content(value: Any, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts (joined)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad(
                    f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are served; the "
                    "job's model reads text",
                    "messages",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where}.content must be a string, null or a list of text parts", "messages")


def _arguments(value: Any, where: str) -> str:
    """A tool call's arguments (OpenAI's JSON string, or an object) as canonical JSON of an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise bad(f"{where}.function.arguments is not JSON: {exc.msg}", "messages") from None
    if not isinstance(value, dict):
        raise bad(f"{where}.function.arguments must be a JSON object", "messages")
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def parse_message(raw: Any, index: int) -> Message:
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise bad(f"{where} must be an object with a role", "messages")
    role = raw.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
    calls: list[tuple[str, str]] = []
    if role == "assistant" and raw.get("tool_calls"):
        if not isinstance(raw["tool_calls"], list):
            raise bad(f"{where}.tool_calls must be a list", "messages")
        for k, call in enumerate(raw["tool_calls"]):
            w = f"{where}.tool_calls[{k}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad(f"{w} needs a function with a name", "messages")
            calls.append((fn["name"], _arguments(fn.get("arguments", {}), w)))
    tool_call_id = raw.get("tool_call_id")
    name = raw.get("name")
    return Message(
        role,
        _content(raw.get("content"), where),
        tuple(calls),
        tool_call_id if isinstance(tool_call_id, str) else None,
        name if isinstance(name, str) else None,
    )


def _tools(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    raw = body.get("tools")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise bad(
            "tool_choice: only auto and none are served (the model decides whether to call a tool); "
            "omit tool_choice",
            "tool_choice",
        )
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad("tools must be a list of {'type': 'function', 'function': {...}}", "tools")
    out = []
    for k, tool in enumerate(raw):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad(f"tools[{k}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"tools[{k}].function.name is required", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad(f"tools[{k}].function.parameters must be a JSON schema object", "tools")
        entry = {"name": fn["name"], "parameters": params}
        if isinstance(fn.get("description"), str):
            entry["description"] = fn["description"]
        out.append({"type": "function", "function": entry})
    return () if choice == "none" else tuple(out)


def parse_chat_request(body: Any) -> ChatRequest:
    """A `POST /v1/chat/completions` body, checked; raises `WireError` naming the field and the fix."""
    _common(body, _CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    parsed = tuple(parse_message(m, i) for i, m in enumerate(messages))
    if body.get("top_logprobs") not in (None, 0):
        raise bad(
            "top_logprobs: this endpoint returns the sampled token's log-prob only (what the trainer "
            "trains on); omit top_logprobs or set it to 0",
            "top_logprobs",
        )
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad(
            "response_format: only text is served (constrained decoding would change what is sampled)",
            "response_format",
        )
    if not isinstance(body.get("logprobs", False), bool | None):
        raise bad("logprobs must be true or false", "logprobs")
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    stream, include_usage = _stream(body)
    return ChatRequest(
        model=body["model"],
        messages=parsed,
        tools=_tools(body),
        n=_int(body, "n", 1, MAX_CHOICES) or 1,
        max_tokens=max_tokens,
        stop=_stop(body),
        logprobs=bool(body.get("logprobs")),
        return_token_ids=bool(body.get("return_token_ids", False)),
        stream=stream,
        include_usage=include_usage,
    )


def parse_completion_request(body: Any) -> CompletionRequest:
    """A `POST /v1/completions` body, checked: one prompt, text or token ids."""
    _common(body, _COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise bad("prompt must be a string or a list of token ids (one prompt per call)", "prompt")
        prompt = tuple(prompt)
    elif not isinstance(prompt, str) or not prompt:
        raise bad("prompt must be a non-empty string or a list of token ids (one prompt per call)", "prompt")
    if body.get("echo"):
        raise bad("echo is not supported: set it to false", "echo")
    if body.get("suffix"):
        raise bad("suffix is not supported: omit it", "suffix")
    if body.get("best_of") not in (None, 1):
        raise bad("best_of: only 1 is served (use n for several completions)", "best_of")
    logprobs = _int(body, "logprobs", 0, 5)
    if logprobs:
        raise bad(
            "logprobs: this endpoint returns the sampled token's log-prob only; set logprobs to 0",
            "logprobs",
        )
    max_tokens = _int(body, "max_tokens", 1)
    stream, include_usage = _stream(body)
    return CompletionRequest(
        model=body["model"],
        prompt=prompt,
        n=_int(body, "n", 1, MAX_CHOICES) or 1,
        max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        stop=_stop(body),
        logprobs=logprobs is not None,
        return_token_ids=bool(body.get("return_token_ids", False)),
        stream=stream,
        include_usage=include_usage,
    )


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise WireError(
            404,
            f"the model {requested!r} does not exist: this endpoint serves {served!r} (GET /v1/models)",
            param="model",
            code="model_not_found",
        )


def budget_tokens(requested: int | None, prompt_tokens: int, *, context_tokens: int, max_tokens: int) -> int:
    """How many tokens a call may generate: what it asks (default: all it may), at most the job's
    `max_tokens` (lengths.maxResponseTokens) and the context left after its prompt. Raises when the
    prompt leaves no room (OpenAI's context_length_exceeded)."""
    room = context_tokens - prompt_tokens
    if room < 1:
        raise bad(
            f"the prompt is {prompt_tokens} tokens with the chat template, and the context an episode may "
            f"hold is {context_tokens} (lengths.maxPromptTokens + agent.maxTotalTokens): shorten the "
            "conversation, or raise those lengths",
            "messages",
            "context_length_exceeded",
        )
    return max(1, min(requested if requested is not None else room, max_tokens, room))


# ---- what the engine produced, as text ------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    """One choice as returned: the tokens kept (the engine's, cut after a stop string), their
    log-probs, the text, the assistant message it becomes and why it finished."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish_reason: str  # stop, length, tool_calls
    message: Message
    tool_calls: tuple[dict[str, Any], ...] = ()  # OpenAI's tool_calls objects
    text_tokens: int = 0  # how many of token_ids `text` decodes (all but an end-of-turn token)


def apply_stop(
    token_ids: Sequence[int], text_of: Callable[[Sequence[int]], str], stop: Sequence[str]
) -> int | None:
    """How many tokens to keep when a stop string appears in their text, or None: the longest prefix
    whose text ends at or before the first stop string. The text returned is that prefix's text, so a
    choice's text always decodes its recorded tokens (a token that holds the stop string's first
    characters is dropped with it); the tokens after it were generated and are discarded (a prefix's
    probability does not depend on them)."""
    full = text_of(token_ids)
    hits = [full.find(s) for s in stop if s in full]
    if not hits:
        return None
    before = full[: min(hits)]
    lo, hi = 0, len(token_ids)
    while lo < hi:  # the longest prefix whose text is a prefix of `before`
        mid = (lo + hi + 1) // 2
        if before.startswith(text_of(token_ids[:mid])):
            lo = mid
        else:
            hi = mid - 1
    return lo


def make_choice(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    finish_reason: str,
    *,
    text_of: Callable[[Sequence[int]], str],
    eos_ids: frozenset[int],
    stop: Sequence[str] = (),
    tools: bool = False,
    call_id: str = "call",
) -> Choice:
    """One engine output as a choice: its text (the end-of-turn token it stopped on left out, special
    tokens kept: a tokenizer may hold <tool_call> as one), cut before a stop string, and with `tools`
    its hermes tool calls as `tool_calls` (the text around them is the content). The choice's tokens
    are the engine's, and its text is theirs decoded."""
    ids, lps = list(token_ids), list(logprobs)
    reason = finish_reason
    if stop:
        body = ids[:-1] if ids and ids[-1] in eos_ids else ids
        kept = apply_stop(body, text_of, stop)
        if kept is not None:
            ids, lps, reason = ids[:kept], lps[:kept], "stop"
    text_tokens = len(ids) - 1 if ids and ids[-1] in eos_ids else len(ids)
    text = text_of(ids[:text_tokens])
    content, calls = text, []
    if tools:
        parsed = tools_mod.parse_tool_calls(text)
        if parsed.calls and not parsed.errors:
            content = _TOOL_CALL.sub("", text).strip()
            calls = [
                {
                    "id": f"{call_id}_{k}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
                }
                for k, c in enumerate(parsed.calls)
            ]
            reason = "tool_calls" if reason == "stop" else reason
    message = Message(
        "assistant",
        content,
        tuple((c["function"]["name"], _arguments(c["function"]["arguments"], "tool_calls")) for c in calls),
    )
    return Choice(tuple(ids), tuple(lps), text, reason, message, tuple(calls), text_tokens)


def _logprob_entries(
    token_ids: Sequence[int], logprobs: Sequence[float], token_text: Callable[[int], str]
) -> list[dict[str, Any]]:
    """chat.completion's `logprobs.content`: one entry per token (the sampled token's only)."""
    out = []
    for t, lp in zip(token_ids, logprobs, strict=True):
        s = token_text(t)
        out.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []})
    return out


def _completion_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[float], token_text: Callable[[int], str], offset: int = 0
) -> dict[str, Any]:
    """text_completion's `logprobs` for these tokens, their text offsets counted from `offset`."""
    texts = [token_text(t) for t in token_ids]
    offsets = []
    for s in texts:
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": texts,
        "token_logprobs": list(logprobs),
        "top_logprobs": None,
        "text_offset": offsets,
    }


def chat_response(
    request: ChatRequest,
    choices: Sequence[Choice],
    prompt_ids: Sequence[int],
    *,
    response_id: str,
    created: int,
    model: str,
    token_text: Callable[[int], str],
) -> dict[str, Any]:
    """A `chat.completion` body."""
    out_choices = []
    for i, c in enumerate(choices):
        message: dict[str, Any] = {"role": "assistant", "content": c.message.content or None}
        if c.tool_calls:
            message["tool_calls"] = [dict(tc) for tc in c.tool_calls]
        entry: dict[str, Any] = {
            "index": i,
            "message": message,
            "finish_reason": c.finish_reason,
            "logprobs": (
                {"content": _logprob_entries(c.token_ids, c.logprobs, token_text)}
                if request.logprobs
                else None
            ),
        }
        if request.return_token_ids:
            entry["token_ids"] = list(c.token_ids)
        out_choices.append(entry)
    return _envelope("chat.completion", out_choices, choices, prompt_ids, request.return_token_ids,
                     response_id=response_id, created=created, model=model)  # fmt: skip


def completion_response(
    request: CompletionRequest,
    choices: Sequence[Choice],
    prompt_ids: Sequence[int],
    *,
    response_id: str,
    created: int,
    model: str,
    token_text: Callable[[int], str],
) -> dict[str, Any]:
    """A `text_completion` body (legacy completions)."""
    out_choices = []
    for i, c in enumerate(choices):
        entry: dict[str, Any] = {
            "index": i,
            "text": c.text,
            "finish_reason": c.finish_reason,
            "logprobs": None,
        }
        if request.logprobs:
            entry["logprobs"] = _completion_logprobs(c.token_ids, c.logprobs, token_text)
        if request.return_token_ids:
            entry["token_ids"] = list(c.token_ids)
        out_choices.append(entry)
    return _envelope("text_completion", out_choices, choices, prompt_ids, request.return_token_ids,
                     response_id=response_id, created=created, model=model)  # fmt: skip


def _envelope(
    kind: str,
    out_choices: list[dict[str, Any]],
    choices: Sequence[Choice],
    prompt_ids: Sequence[int],
    return_token_ids: bool,
    *,
    response_id: str,
    created: int,
    model: str,
) -> dict[str, Any]:
    """What both response bodies share around their choices: ids, usage, the prompt's token ids."""
    body: dict[str, Any] = {
        "id": response_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": out_choices,
        "usage": _usage(prompt_ids, choices),
    }
    if return_token_ids:
        body["prompt_token_ids"] = list(prompt_ids)
    return body


def _usage(prompt_ids: Sequence[int], choices: Sequence[Choice]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": completion,
        "total_tokens": len(prompt_ids) + completion,
    }


# ---- streaming: the same answer as Server-Sent Events ------------------------------------------------
#: Tokens decoded before a new one to read its text (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET):
#: a token's leading space, or a character split over several byte tokens, needs its neighbours.
_DETOKENIZE_WINDOW = 5


@dataclass(frozen=True)
class EventStream:
    """A streamed answer: its chunks, each sent as a Server-Sent Event `data: <JSON>`, then
    `data: [DONE]` (OpenAI's stream; any OpenAI client iterates it with `stream=True`)."""

    chunks: tuple[dict[str, Any], ...]

    def events(self) -> Iterator[bytes]:
        for chunk in self.chunks:
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"


def stream_pieces(token_ids: Sequence[int], text: str, text_of: Callable[[Sequence[int]], str]) -> list[str]:
    """One text piece per token, joining to exactly `text` (`text_of(token_ids)`): incremental
    detokenisation as vLLM's `detokenize_incrementally` does it (each token read after a few before
    it; a piece ending in an incomplete character, U+FFFD, is held back and comes with the next).
    A tokenizer whose pieces do not join to its whole decode (a clean-up of spaces, say) gets the
    whole text in the first piece: what a client reassembles is always the answer's text."""
    pieces: list[str] = []
    prefix_at = read_at = 0
    before = text_of(token_ids[prefix_at:read_at])  # decoded again only when the window moves
    for i in range(len(token_ids)):
        after = text_of(token_ids[prefix_at : i + 1])
        if len(after) > len(before) and not after.endswith("\ufffd") and after.startswith(before):
            pieces.append(after[len(before) :])
            prefix_at, read_at = max(0, i + 1 - _DETOKENIZE_WINDOW), i + 1
            before = text_of(token_ids[prefix_at:read_at])
        else:
            pieces.append("")
    if "".join(pieces) != text:
        return [text, *[""] * (len(token_ids) - 1)] if token_ids else []
    return pieces


def _stream_groups(choice: Choice, text_of: Callable[[Sequence[int]], str]) -> list[tuple[int, int, str]]:
    """A choice's content chunks as (first token, end token, text): a token whose text is held back
    (or an end-of-turn token, which has none) is sent with the chunk after it (or the last one)."""
    n = len(choice.token_ids)
    pieces = stream_pieces(choice.token_ids[: choice.text_tokens], choice.text, text_of)
    pieces += [""] * (n - len(pieces))
    groups: list[tuple[int, int, str]] = []
    start = 0
    for k, piece in enumerate(pieces):
        if piece:
            groups.append((start, k + 1, piece))
            start = k + 1
    if start < n:
        if groups:
            first, _, piece = groups[-1]
            groups[-1] = (first, n, piece)
        else:
            groups.append((0, n, ""))
    return groups


def _chunk(kind: str, choices: list[dict[str, Any]], include_usage: bool, **envelope: Any) -> dict[str, Any]:
    body: dict[str, Any] = {**envelope, "object": kind, "choices": choices}
    if include_usage:
        body["usage"] = None  # OpenAI's: null on every chunk but the last
    return body


def _stream_end(
    kind: str,
    chunks: list[dict[str, Any]],
    choices: Sequence[Choice],
    prompt_ids: Sequence[int],
    request: ChatRequest | CompletionRequest,
    envelope: dict[str, Any],
) -> EventStream:
    """What both streams share: the prompt's ids on the first chunk, the usage chunk last."""
    if request.return_token_ids and chunks:
        chunks[0]["prompt_token_ids"] = list(prompt_ids)
    if request.include_usage:
        chunks.append({**envelope, "object": kind, "choices": [], "usage": _usage(prompt_ids, choices)})
    return EventStream(tuple(chunks))


def chat_chunks(
    request: ChatRequest,
    choices: Sequence[Choice],
    prompt_ids: Sequence[int],
    *,
    response_id: str,
    created: int,
    model: str,
    token_text: Callable[[int], str],
    text_of: Callable[[Sequence[int]], str],
) -> EventStream:
    """A `chat.completion.chunk` stream of the same answer as `chat_response`: per choice, a chunk
    with the role, a chunk per piece of content (its tokens' log-probs and, on request, ids), then
    one with `finish_reason`. A choice with tool calls sends its content and its calls in one chunk
    (the calls are parsed from the whole text, so their tokens cannot be cut apart)."""
    kind, envelope = "chat.completion.chunk", {"id": response_id, "created": created, "model": model}
    chunks: list[dict[str, Any]] = []

    def add(index: int, delta: dict[str, Any], c: Choice, start: int, end: int, finish: str | None) -> None:
        ids, lps = c.token_ids[start:end], c.logprobs[start:end]
        entry: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": {"content": _logprob_entries(ids, lps, token_text)}
            if request.logprobs and ids
            else None,
            "finish_reason": finish,
        }
        if request.return_token_ids and ids:
            entry["token_ids"] = list(ids)
        chunks.append(_chunk(kind, [entry], request.include_usage, **envelope))

    for i, c in enumerate(choices):
        add(i, {"role": "assistant", "content": ""}, c, 0, 0, None)
        if c.tool_calls:
            delta: dict[str, Any] = {"content": c.message.content} if c.message.content else {}
            delta["tool_calls"] = [{"index": k, **tc} for k, tc in enumerate(c.tool_calls)]
            add(i, delta, c, 0, len(c.token_ids), None)
        else:
            for start, end, piece in _stream_groups(c, text_of):
                add(i, {"content": piece}, c, start, end, None)
        add(i, {}, c, 0, 0, c.finish_reason)
    return _stream_end(kind, chunks, choices, prompt_ids, request, envelope)


def completion_chunks(
    request: CompletionRequest,
    choices: Sequence[Choice],
    prompt_ids: Sequence[int],
    *,
    response_id: str,
    created: int,
    model: str,
    token_text: Callable[[int], str],
    text_of: Callable[[Sequence[int]], str],
) -> EventStream:
    """A `text_completion` stream of the same answer as `completion_response`: per choice, a chunk
    per piece of text (its tokens' log-probs and, on request, ids), then one with `finish_reason`."""
    kind, envelope = "text_completion", {"id": response_id, "created": created, "model": model}
    chunks: list[dict[str, Any]] = []
    for i, c in enumerate(choices):
        offset = 0
        for start, end, piece in _stream_groups(c, text_of):
            ids, lps = c.token_ids[start:end], c.logprobs[start:end]
            logprobs = _completion_logprobs(ids, lps, token_text, offset) if request.logprobs else None
            if logprobs is not None:  # offsets run on over the whole text, as in the whole answer
                offset += sum(len(s) for s in logprobs["tokens"])
            entry: dict[str, Any] = {"index": i, "text": piece, "logprobs": logprobs, "finish_reason": None}
            if request.return_token_ids:
                entry["token_ids"] = list(ids)
            chunks.append(_chunk(kind, [entry], request.include_usage, **envelope))
        end_entry = {"index": i, "text": "", "logprobs": None, "finish_reason": c.finish_reason}
        chunks.append(_chunk(kind, [end_entry], request.include_usage, **envelope))
    return _stream_end(kind, chunks, choices, prompt_ids, request, envelope)


def models_response(model: str, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": "rljob"}],
    }

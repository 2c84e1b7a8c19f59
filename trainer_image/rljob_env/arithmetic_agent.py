"""Multi-step arithmetic as an environment of mode agent (`python -m rljob_env.arithmetic_agent`).

Role: the environment of mode agent shipped with rljob, for the examples and the end-to-end test of
the job's OpenAI-compatible endpoint. Each `POST /episode` (docs/contracts.md §4) plays one episode
of `rljob_env.arithmetic` (the same tasks, seeds, checks and reward) with a small agent of its own:
the agent asks the job's endpoint for the reply of each turn (chat completions at the episode's
`base_url`, with the token in $OPENAI_API_KEY), steps the episode with that reply, and sends the
conversation back as it was answered with the environment's next words as the user's turn, until
the episode ends or the endpoint refuses another call (`agent.maxTurns` calls made, or the context
full). The reward is the episode's; every call the agent made is what the trainer trains on.

The agent speaks OpenAI's wire format with the standard library (`urllib`), as any OpenAI client
sends it, so the environment runs in the trainer image and any image with a Python, without the
openai package. `--stream` has it ask for Server-Sent Events (`stream: true`) and read the chunks,
as streaming agents do; the episode trains the same tokens either way.

Callers: an environment pod (`spec.environments[].command`), tests.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from typing import Any

from rljob_env import arithmetic, server

NAME = "arithmetic_agent"
#: Where an OpenAI client reads its key; the operator sets both on the pods of mode agent.
TOKEN_ENVS = ("OPENAI_API_KEY", "RLJOB_ENDPOINT_TOKEN")
#: How long one call may wait. The trainer bounds the whole episode (environments[].timeoutSeconds)
#: and closes it when that passes, which answers a waiting call at once; this only guards against a
#: connection that never answers at all.
CALL_TIMEOUT_S = 900.0
#: The endpoint's refusals that mean the episode's budget is spent, as the trainer's own loop ends
#: an episode: it made agent.maxTurns calls, or its conversation fills the context an episode may
#: hold (lengths.maxPromptTokens + agent.maxTotalTokens).
BUDGET_SPENT_CODES = frozenset({"episode_call_limit", "context_length_exceeded"})


class EndpointError(Exception):
    """A call the endpoint refused: its HTTP status and OpenAI's error code and message."""

    def __init__(self, status: int, code: str | None, message: str) -> None:
        super().__init__(f"HTTP {status} {code or ''}: {message}")
        self.status, self.code, self.message = status, code, message


def read_events(lines: Iterable[bytes]) -> list[dict[str, Any]]:
    """The JSON chunks of a Server-Sent Events stream (`data: <JSON>` lines, up to `data: [DONE]`)."""
    chunks = []
    for raw in lines:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue  # blank lines between events, comments, other fields
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        chunks.append(json.loads(data))
    return chunks


def fold_chat_chunks(chunks: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """A chat stream's first choice as a whole answer's: `{"message": {...}, "finish_reason"}`."""
    content, finish = [], None
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            content.append((choice.get("delta") or {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
    return {"message": {"role": "assistant", "content": "".join(content)}, "finish_reason": finish}


def chat(
    base_url: str, token: str, body: Mapping[str, Any], *, timeout_s: float = CALL_TIMEOUT_S
) -> dict[str, Any]:
    """One `POST <base_url>/chat/completions`: the first choice (`message`, `finish_reason`), read
    whole or, with `stream` in the body, folded from its chunks. Raises `EndpointError` on a refusal."""
    req = urllib.request.Request(f"{base_url.rstrip('/')}/chat/completions", data=json.dumps(body).encode())
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            if body.get("stream"):
                return fold_chat_chunks(read_events(resp))
            return dict(json.loads(resp.read())["choices"][0])
    except urllib.error.HTTPError as exc:
        try:
            error = json.loads(exc.read() or b"{}").get("error") or {}
        except ValueError:
            error = {}
        raise EndpointError(exc.code, error.get("code"), error.get("message") or str(exc.reason)) from None


class ArithmeticAgent:
    """`rljob_env.arithmetic`'s episodes, each played by an agent calling the job's endpoint."""

    name = NAME

    def __init__(self, token: str, *, stream: bool = False, timeout_s: float = CALL_TIMEOUT_S) -> None:
        if not token:
            raise ValueError(
                f"no token: set ${TOKEN_ENVS[0]} (the operator sets it from the job's Secret "
                "<job>-endpoint-<uid> on the environment pods of mode agent)"
            )
        self._token = token
        self.stream = stream
        self.timeout_s = timeout_s
        self._game = arithmetic.Arithmetic()

    def run_episode(
        self, episode_id: str, seed: int, task: str | Mapping[str, Any] | None, base_url: str, model: str
    ) -> tuple[float, dict[str, Any]]:
        episode, observation, info = self._game.reset(seed, task)
        messages: list[dict[str, Any]] = [{"role": "user", "content": observation}]
        reward, calls, result = 0.0, 0, ""
        while True:
            body: dict[str, Any] = {"model": model, "messages": messages, "stream": self.stream}
            try:
                answer = chat(base_url, self._token, body, timeout_s=self.timeout_s)
            except EndpointError as exc:
                if exc.code in BUDGET_SPENT_CODES and calls:
                    # The episode's turns or tokens are used up: it ends here with the share of steps
                    # done right, as the arithmetic environment rewards an episode that ends early.
                    reward, result = episode.step_index / len(episode.ops), str(exc.code)
                    break
                # Anything else is the episode's failure, named for the trainer (it trains nothing).
                raise server.ProtocolError(502, f"episode {episode_id}: call {calls + 1}: {exc}") from None
            except OSError as exc:
                raise server.ProtocolError(
                    502, f"episode {episode_id}: call {calls + 1}: the endpoint at {base_url}: {exc}"
                ) from None
            calls += 1
            reply = answer["message"].get("content") or ""
            observation, step_reward, done, step_info = episode.step(reply)
            reward += step_reward
            result = str(step_info.get("result", result))
            if done:
                break
            # Sent back as answered: the endpoint continues from the tokens it generated, one sample.
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": observation}]
        return reward, {**info, "calls": calls, "result": result, "stream": self.stream}


def main(argv: list[str] | None = None) -> int:
    """`python -m rljob_env.arithmetic_agent [--stream] [--port N] ...`: the token from the pod's
    environment ($OPENAI_API_KEY, else $RLJOB_ENDPOINT_TOKEN), the rest as `rljob_env.server.main`."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--stream", action="store_true", help="ask the endpoint for Server-Sent Events")
    args, rest = parser.parse_known_args(argv)
    token = next((os.environ[k] for k in TOKEN_ENVS if os.environ.get(k)), "")
    try:
        agent = ArithmeticAgent(token, stream=args.stream)
    except ValueError as exc:
        raise SystemExit(f"{NAME}: {exc}") from None
    return server.main(agent, rest)


if __name__ == "__main__":
    raise SystemExit(main())

"""An environment of mode agent for the endpoint's tests (unit and integration), served by rljob_env's
stdlib HTTP server (`rljob_env.server`, on a thread): its `POST /episode` runs an agent written
against OpenAI's wire format (plain `urllib`, as any OpenAI client sends it) on the base URL the
trainer gives it, and answers the episode's reward. It keeps every answer the endpoint gave, by
episode, for the tests to read.

The agent says what it is asked: its first call asks for 42, its second (the conversation sent back
as it was answered, then the environment's next words) asks again; half a point per answer that says
42. With `api="completions"` it makes the same two calls through the legacy completions API."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from http.server import ThreadingHTTPServer
from typing import Any

from rljob_env import server


def free_port() -> int:
    """A loopback port free now, for an endpoint the test starts on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def call(url: str, body: dict[str, Any] | None, token: str | None) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of one call; GET without a body."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


class AgentEnvironment:
    """The server's state: the token its agent sends, the API it uses, what the endpoint answered."""

    name = "agent"

    def __init__(
        self, token: str | None, api: str = "chat", calls: int = 2, max_tokens: int | None = None
    ) -> None:
        self.token = token
        self.api = api
        self.calls = calls
        self.max_tokens = max_tokens  # the chat calls' `max_tokens`; None: not sent (the endpoint's)
        self.lock = threading.Lock()
        self.answers: dict[str, list[tuple[int, dict[str, Any]]]] = {}  # episode id -> (status, body)
        self.requests: list[dict[str, Any]] = []  # the POST /episode bodies

    def run_episode(
        self, episode_id: str, seed: int, task: str | Mapping[str, Any] | None, base_url: str, model: str
    ) -> tuple[float, dict[str, Any]]:
        base = base_url
        answers: list[tuple[int, dict[str, Any]]] = []
        reward = 0.0
        if self.api == "chat":
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"Say 42 (seed {seed})."}]
            for _ in range(self.calls):
                status, out = call(
                    f"{base}/chat/completions",
                    {
                        "model": model,
                        "messages": messages,
                        "logprobs": True,
                        "return_token_ids": True,
                        "temperature": 0.3,
                        **({"max_tokens": self.max_tokens} if self.max_tokens is not None else {}),
                    },
                    self.token,
                )
                answers.append((status, out))
                if status != 200:
                    break
                message = out["choices"][0]["message"]
                reward += 0.5 if "42" in (message["content"] or "") else 0.0
                messages += [
                    {"role": "assistant", "content": message["content"]},
                    {"role": "user", "content": "Again: say 42."},
                ]
        else:
            prompt = f"Say 42 (seed {seed}).\n"
            for _ in range(self.calls):
                status, out = call(
                    f"{base}/completions",
                    {"model": model, "prompt": prompt, "logprobs": 0, "max_tokens": 32},
                    self.token,
                )
                answers.append((status, out))
                if status != 200:
                    break
                text = out["choices"][0]["text"]
                reward += 0.5 if "42" in text else 0.0
                prompt += text + "\nAgain: say 42.\n"
        body = {"episode_id": episode_id, "seed": seed, "task": task, "base_url": base_url, "model": model}
        with self.lock:
            self.answers[episode_id] = answers
            self.requests.append(body)
        return reward, {"calls": len(answers)}


class OpenAIClientEnvironment:
    """The same agent written against the official `openai` client, as an environment of mode agent
    really is: `stream=True` iterates Server-Sent Events (`stream_options.include_usage`), else whole
    answers. Per episode it keeps what the client reassembled from each call: the text, the
    log-probs and token ids it read, the finish reason, the usage, and how many chunks came."""

    name = "openai-agent"

    def __init__(self, token: str, api: str = "chat", *, stream: bool = True, calls: int = 2) -> None:
        self.token, self.api, self.stream, self.calls = token, api, stream, calls
        self.lock = threading.Lock()
        self.answers: dict[str, list[dict[str, Any]]] = {}

    def run_episode(
        self, episode_id: str, seed: int, task: str | Mapping[str, Any] | None, base_url: str, model: str
    ) -> tuple[float, dict[str, Any]]:
        import openai  # the test environment's (vLLM's dependency); rljob_env itself never imports it

        client = openai.OpenAI(base_url=base_url, api_key=self.token, max_retries=0, timeout=30)
        read: list[dict[str, Any]] = []
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Say 42 (seed {seed})."}]
        prompt = f"Say 42 (seed {seed}).\n"
        for _ in range(self.calls):
            if self.api == "chat":
                got = self._chat(client, model, messages)
                messages += [
                    {"role": "assistant", "content": got["text"]},
                    {"role": "user", "content": "Again: say 42."},
                ]
            else:
                got = self._completion(client, model, prompt)
                prompt += got["text"] + "\nAgain: say 42.\n"
            read.append(got)
        with self.lock:
            self.answers[episode_id] = read
        return sum(0.5 for r in read if "42" in r["text"]), {"calls": len(read)}

    def _chat(self, client: Any, model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "logprobs": True,
            "temperature": 0.3,  # ignored: the job's sampling serves (X-RLJob-Sampling says which)
            "extra_body": {"return_token_ids": True},
        }
        if not self.stream:
            resp = client.chat.completions.create(**kw)
            (choice,) = resp.choices
            return {
                "text": choice.message.content or "",
                "logprobs": [e.logprob for e in choice.logprobs.content],
                "token_ids": choice.model_extra["token_ids"],
                "prompt_token_ids": resp.model_extra["prompt_token_ids"],
                "finish_reason": choice.finish_reason,
                "usage": resp.usage.model_dump(
                    include={"prompt_tokens", "completion_tokens", "total_tokens"}
                ),
                "chunks": 0,
            }
        chunks = list(
            client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        )
        got = _reassemble(chunks)
        got["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        got["roles"] = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
        got["logprobs"] = [
            e.logprob
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content
        ]
        return got

    def _completion(self, client: Any, model: str, prompt: str) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "logprobs": 0,
            "max_tokens": 32,
            "extra_body": {"return_token_ids": True},
        }
        if not self.stream:
            resp = client.completions.create(**kw)
            (choice,) = resp.choices
            return {"text": choice.text, "logprobs": choice.logprobs.token_logprobs, "chunks": 0}
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        got = _reassemble(chunks)
        got["text"] = "".join(c.choices[0].text for c in chunks if c.choices)
        got["logprobs"] = [
            x
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for x in c.choices[0].logprobs.token_logprobs
        ]
        got["text_offset"] = [
            x
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for x in c.choices[0].logprobs.text_offset
        ]
        return got


def _reassemble(chunks: list[Any]) -> dict[str, Any]:
    """What both streams carry beside their text: ids, the finish reason, the usage chunk."""
    with_choices = [c for c in chunks if c.choices]
    (usage,) = [c.usage for c in chunks if c.usage is not None]
    return {
        "token_ids": [t for c in with_choices for t in (c.choices[0].model_extra or {}).get("token_ids", [])],
        "prompt_token_ids": (chunks[0].model_extra or {}).get("prompt_token_ids"),
        "finish_reason": [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason],
        "usage": usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}),
        "chunks": len(chunks),
        "last_has_choices": bool(chunks[-1].choices),
    }


def serve(env: AgentEnvironment | OpenAIClientEnvironment) -> tuple[str, ThreadingHTTPServer]:
    httpd = server.make_server(env, 0, "127.0.0.1")
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{httpd.server_address[1]}", httpd

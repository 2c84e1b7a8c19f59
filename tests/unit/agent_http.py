"""An environment of mode agent for the endpoint's tests, served by rljob_env's stdlib HTTP server
(`rljob_env.server`, on a thread): its `POST /episode` runs an agent written against OpenAI's wire
format (plain `urllib`, as any OpenAI client sends it) on the base URL the trainer gives it, and
answers the episode's reward. It keeps every answer the endpoint gave, by episode, for the tests to
read.

The agent says what it is asked: its first call asks for 42, its second (the conversation sent back
as it was answered, then the environment's next words) asks again; half a point per answer that says
42. With `api="completions"` it makes the same two calls through the legacy completions API."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from http.server import ThreadingHTTPServer
from typing import Any

from rljob_env import server


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

    def __init__(self, token: str | None, api: str = "chat", calls: int = 2) -> None:
        self.token = token
        self.api = api
        self.calls = calls
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


def serve(env: AgentEnvironment) -> tuple[str, ThreadingHTTPServer]:
    httpd = server.make_server(env, 0, "127.0.0.1")
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{httpd.server_address[1]}", httpd

"""An environment of mode agent for the endpoint's tests: a stdlib HTTP server whose `POST /episode`
runs an agent written against OpenAI's wire format (plain `urllib`, as any OpenAI client sends it)
on the base URL the trainer gives it, and answers the episode's reward. It keeps every answer the
endpoint gave, by episode, for the tests to read.

The agent says what it is asked: its first call asks for 42, its second (the conversation sent back
as it was answered, then the environment's next words) asks again; half a point per answer that says
42. With `api="completions"` it makes the same two calls through the legacy completions API."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


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

    def __init__(self, token: str | None, api: str = "chat", calls: int = 2) -> None:
        self.token = token
        self.api = api
        self.calls = calls
        self.lock = threading.Lock()
        self.answers: dict[str, list[tuple[int, dict[str, Any]]]] = {}  # episode id -> (status, body)
        self.requests: list[dict[str, Any]] = []  # the POST /episode bodies

    def run(self, body: dict[str, Any]) -> dict[str, Any]:
        base, model, seed = body["base_url"], body["model"], body["seed"]
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
        with self.lock:
            self.answers[body["episode_id"]] = answers
            self.requests.append(body)
        return {"reward": reward, "info": {"calls": len(answers)}}


def serve(env: AgentEnvironment) -> tuple[str, ThreadingHTTPServer]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._send(200 if self.path == "/healthz" else 404, {})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path != "/episode":
                self._send(404, {"error": f"no path {self.path}"})
                return
            self._send(200, env.run(body))

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{httpd.server_address[1]}", httpd

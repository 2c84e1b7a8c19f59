"""The reset/step protocol over HTTP (docs/contracts.md §4), for any `Environment`.

Role: `serve(env, port)` runs a threaded HTTP server; `EnvironmentServer` holds the episodes.
Callers: each environment module's `main` (`python -m rljob_env.arithmetic`), and tests.

The protocol (JSON bodies, UTF-8):
- `POST /reset {"seed": int, "task": string or object?}` -> 200 `{"episode_id", "observation", "info"}`
  (the environment reads `task`: a name, or its fields);
- `POST /step {"episode_id", "action": str}` -> 200 `{"observation", "reward", "done", "info"}`;
  an episode's reward is the sum of its steps' rewards; after `done` the episode is gone;
- `POST /close {"episode_id"}` -> 200 `{"closed": bool}` (an episode the client abandons);
- `GET /healthz` -> 200 `{"status": "ok", "episodes": n}` (the pod's readiness probe).
An environment of mode agent (an `AgentEnvironment`: it runs whole episodes with its own agent)
serves instead
- `POST /episode {"episode_id", "seed": int, "task"?, "base_url": str, "model": str}` -> 200
  `{"reward", "info"}` once the episode is over: its agent calls the job's OpenAI-compatible
  endpoint at `base_url` with `model` and the token in $OPENAI_API_KEY, and every call is trained on.
Errors are JSON `{"error": message}`: 400 (not JSON, a field missing or of the wrong type, a task
the environment refuses), 404 (no such episode, or no such path), 405, 413 (a body over
`MAX_BODY_BYTES`). At most `max_episodes` episodes are open; opening one more closes the oldest.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import signal
import threading
import uuid
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

#: The port the operator sets on an environment's container (`spec.environments[].port`).
ENV_PORT = "RLJOB_ENV_PORT"
DEFAULT_PORT = 8080
MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_EPISODES = 10_000

log = logging.getLogger("rljob_env")


class TaskError(ValueError):
    """A reset's task (or seed) the environment cannot make an episode of: HTTP 400."""


class Episode(Protocol):
    """One episode's state; `step` returns (observation, reward, done, info)."""

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]: ...


class Environment(Protocol):
    """What a server serves: `reset(seed, task)` makes an episode and its first observation."""

    name: str

    def reset(
        self, seed: int, task: str | Mapping[str, Any] | None
    ) -> tuple[Episode, str, dict[str, Any]]: ...


class AgentEnvironment(Protocol):
    """An environment of mode agent: `run_episode` runs one whole episode with its own agent (any
    OpenAI client on `base_url`, `model`, the key in $OPENAI_API_KEY) and returns (reward, info)."""

    name: str

    def run_episode(
        self, episode_id: str, seed: int, task: str | Mapping[str, Any] | None, base_url: str, model: str
    ) -> tuple[float, dict[str, Any]]: ...


class ProtocolError(Exception):
    """A request that breaks the protocol: its HTTP status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class EnvironmentServer:
    """The episodes of one environment, safe to use from the server's threads."""

    def __init__(
        self, env: Environment | AgentEnvironment, *, max_episodes: int = DEFAULT_MAX_EPISODES
    ) -> None:
        self.env = env
        self.max_episodes = max_episodes
        self._episodes: collections.OrderedDict[str, Episode] = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def open_episodes(self) -> int:
        with self._lock:
            return len(self._episodes)

    @property
    def agent_mode(self) -> bool:
        return callable(getattr(self.env, "run_episode", None))

    def episode(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """One whole episode of an environment of mode agent (its agent calls the job's endpoint)."""
        run = getattr(self.env, "run_episode", None)
        if run is None:
            raise ProtocolError(404, "episode: this environment is reset and stepped (mode steps)")
        seed, task = body.get("seed"), body.get("task")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ProtocolError(400, "episode: seed must be an integer")
        if task is not None and not isinstance(task, (dict, str)):
            raise ProtocolError(400, "episode: task must be a string or a JSON object when given")
        fields = {k: body.get(k) for k in ("episode_id", "base_url", "model")}
        for key, value in fields.items():
            if not isinstance(value, str) or not value:
                raise ProtocolError(400, f"episode: {key} must be a non-empty string")
        try:
            reward, info = run(fields["episode_id"], seed, task, fields["base_url"], fields["model"])
        except TaskError as exc:
            raise ProtocolError(400, f"episode: {exc}") from exc
        return {"reward": float(reward), "info": info}

    def reset(self, body: Mapping[str, Any]) -> dict[str, Any]:
        if self.agent_mode:
            raise ProtocolError(
                404, "reset: this environment runs whole episodes (mode agent): POST /episode"
            )
        seed = body.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ProtocolError(400, "reset: seed must be an integer")
        task = body.get("task")
        if task is not None and not isinstance(task, (dict, str)):
            raise ProtocolError(400, "reset: task must be a string or a JSON object when given")
        try:
            episode, observation, info = self.env.reset(seed, task)
        except TaskError as exc:
            raise ProtocolError(400, f"reset: {exc}") from exc
        episode_id = uuid.uuid4().hex
        with self._lock:
            self._episodes[episode_id] = episode
            while len(self._episodes) > self.max_episodes:
                self._episodes.popitem(last=False)  # the oldest: a client that never finished it
        return {"episode_id": episode_id, "observation": observation, "info": info}

    def step(self, body: Mapping[str, Any]) -> dict[str, Any]:
        episode_id, action = body.get("episode_id"), body.get("action")
        if not isinstance(episode_id, str):
            raise ProtocolError(400, "step: episode_id must be a string")
        if not isinstance(action, str):
            raise ProtocolError(400, "step: action must be a string")
        with self._lock:
            episode = self._episodes.get(episode_id)
        if episode is None:
            raise ProtocolError(404, f"step: no episode {episode_id!r} (never reset, finished or closed)")
        observation, reward, done, info = episode.step(action)
        if done:
            with self._lock:
                self._episodes.pop(episode_id, None)
        return {"observation": observation, "reward": float(reward), "done": bool(done), "info": info}

    def close(self, body: Mapping[str, Any]) -> dict[str, Any]:
        episode_id = body.get("episode_id")
        if not isinstance(episode_id, str):
            raise ProtocolError(400, "close: episode_id must be a string")
        with self._lock:
            return {"closed": self._episodes.pop(episode_id, None) is not None}


def _handler(server: EnvironmentServer) -> type[BaseHTTPRequestHandler]:
    routes: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
        "/reset": server.reset,
        "/step": server.step,
        "/close": server.close,
        "/episode": server.episode,
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: an episode's steps reuse one connection
        server_version = f"rljob-env/{server.env.name}"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s %s", self.address_string(), format % args)

        def _send(self, status: int, payload: Mapping[str, Any]) -> None:
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                # The trainer stopped waiting (the episode timed out, or the job moved on): nothing to
                # answer, and not the server's fault; a traceback in the pod's log would say it was.
                self.close_connection = True
                log.info("%s went away before %s was answered", self.address_string(), self.path)

        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] == "/healthz":
                self._send(
                    200, {"status": "ok", "environment": server.env.name, "episodes": server.open_episodes}
                )
            elif self.path in routes:
                self._send(405, {"error": f"{self.path} takes POST"})
            else:
                self._send(
                    404,
                    {"error": f"no path {self.path}: POST /reset, /step, /close (or /episode); GET /healthz"},
                )

        def do_POST(self) -> None:
            route = routes.get(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                self.close_connection = True  # the body is not read: the connection cannot be reused
                self._send(413, {"error": f"the body is {length} bytes, at most {MAX_BODY_BYTES}"})
                return
            raw = self.rfile.read(length) if length else b""
            if route is None:
                self._send(
                    404,
                    {"error": f"no path {self.path}: POST /reset, /step, /close (or /episode); GET /healthz"},
                )
                return
            try:
                body = json.loads(raw or b"{}")
            except ValueError as exc:
                self._send(400, {"error": f"the body is not JSON: {exc}"})
                return
            if not isinstance(body, dict):
                self._send(400, {"error": "the body must be a JSON object"})
                return
            try:
                self._send(200, route(body))
            except ProtocolError as exc:
                self._send(exc.status, {"error": exc.message})

    return Handler


def make_server(
    env: Environment | AgentEnvironment, port: int, host: str = "0.0.0.0", **kwargs: Any
) -> ThreadingHTTPServer:
    """A bound, not yet serving, HTTP server for `env` (port 0: any free port)."""
    httpd = ThreadingHTTPServer((host, port), _handler(EnvironmentServer(env, **kwargs)))
    httpd.daemon_threads = True
    return httpd


def main(env: Environment | AgentEnvironment, argv: list[str] | None = None) -> int:
    """`python -m rljob_env.<name> [--port N] [--host H]`: serve `env` until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(prog=f"python -m rljob_env.{env.name}", description=main.__doc__)
    parser.add_argument(
        "--port", type=int, default=int(os.environ.get(ENV_PORT) or DEFAULT_PORT), help=f"default ${ENV_PORT}"
    )
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--max-episodes", type=int, default=DEFAULT_MAX_EPISODES)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    httpd = make_server(env, args.port, args.host, max_episodes=args.max_episodes)

    def stop(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)  # the kubelet's stop: a clean exit, not the grace period
    signal.signal(signal.SIGINT, stop)
    log.info("environment %s serving on %s:%d", env.name, args.host, httpd.server_address[1])
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
    return 0

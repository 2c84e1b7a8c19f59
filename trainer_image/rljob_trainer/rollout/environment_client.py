"""The trainer's client of an environment server (`spec.environments[]`, trainer config `environments`).

Role: the reset/step protocol over HTTP (docs/contracts.md, the operator runs the servers as pods
behind a Service inside the job's NetworkPolicy):
  POST /reset {"seed": int, "task": str|object?}   -> {"episode_id": str, "observation": ..., "info": {}}
  POST /step  {"episode_id": str, "action": str}   -> {"observation": ..., "reward": float,
                                                       "done": bool, "info": {}}
  POST /close {"episode_id": str}                  -> {"closed": bool}
  GET  /healthz                                     -> 200 once it serves
An environment of mode agent runs whole episodes instead, its own agent calling the job's
OpenAI-compatible endpoint at `base_url` (`rollout.endpoint`):
  POST /episode {"episode_id": str, "seed": int, "task": str|object?, "base_url": str, "model": str}
                                                    -> {"reward": float, "info": {}}
`reset` gives the episode's first observation (its prompt), each model turn's text is a `step`'s
action; an episode that ends before `done` (the turn limit, the token budget) is closed. An episode
lives in the replica that reset it: with `replicaUrls` each reset goes to the next replica in turn
(another one when it does not answer) and that episode's steps and close go to that replica. A call
that does not answer within the environment's `timeoutS`, answers an HTTP error or an answer of
another shape raises an `EnvironmentCallError` subclass naming the environment, the call and why:
the pipeline fails that episode (counted, `agent/env_failures`), never the job.
Callers: `rljob_trainer.rollout.pipeline` (on its worker threads), tests.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from rljob_trainer import config as config_mod

# The most an answer may hold (an observation is text for a model's context, not a file).
MAX_ANSWER_BYTES = 4 << 20


class EnvironmentCallError(RuntimeError):
    """A reset or step that failed; `reason` is one of timeout, unreachable, http_error, bad_answer."""

    reason = "error"


class EnvironmentTimeout(EnvironmentCallError):
    reason = "timeout"


class EnvironmentUnreachable(EnvironmentCallError):
    reason = "unreachable"


class EnvironmentHTTPError(EnvironmentCallError):
    reason = "http_error"


class EnvironmentBadAnswer(EnvironmentCallError):
    reason = "bad_answer"


@dataclass(frozen=True)
class Reset:
    episode_id: str
    observation: Any
    info: dict[str, Any] = field(default_factory=dict)
    replica: str = ""  # the base URL of the replica that holds the episode


@dataclass(frozen=True)
class Step:
    observation: Any
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def final_reward(self) -> float | None:
        """The episode's reward when `done` gives one (`info.final_reward`), which replaces the sum of
        the step rewards."""
        value = self.info.get("final_reward") if self.done else None
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def parse_reset(data: Any, where: str) -> Reset:
    """A /reset answer, checked (pure)."""
    if not isinstance(data, dict) or not isinstance(data.get("episode_id"), str) or "observation" not in data:
        raise EnvironmentBadAnswer(f"{where}: the answer needs a string episode_id and an observation")
    return Reset(data["episode_id"], data["observation"], _info(data, where))


def parse_step(data: Any, where: str) -> Step:
    """A /step answer, checked (pure): a finite number `reward` and a boolean `done`."""
    if not isinstance(data, dict):
        raise EnvironmentBadAnswer(f"{where}: the answer must be a JSON object")
    reward, done = data.get("reward", 0.0), data.get("done")
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise EnvironmentBadAnswer(f"{where}: reward must be a finite number, got {reward!r}")
    if not isinstance(done, bool):
        raise EnvironmentBadAnswer(f"{where}: done must be true or false, got {done!r}")
    if not done and "observation" not in data:
        raise EnvironmentBadAnswer(f"{where}: an episode that is not done needs an observation")
    return Step(data.get("observation", ""), float(reward), done, _info(data, where))


@dataclass(frozen=True)
class EpisodeResult:
    """What an environment of mode agent answers once its episode is over."""

    reward: float
    info: dict[str, Any] = field(default_factory=dict)
    replica: str = ""


def parse_episode(data: Any, where: str) -> EpisodeResult:
    """A /episode answer, checked (pure): a finite number `reward`."""
    if not isinstance(data, dict):
        raise EnvironmentBadAnswer(f"{where}: the answer must be a JSON object")
    reward = data.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise EnvironmentBadAnswer(f"{where}: reward must be a finite number, got {reward!r}")
    return EpisodeResult(float(reward), _info(data, where))


def _info(data: dict[str, Any], where: str) -> dict[str, Any]:
    info = data.get("info", {})
    if not isinstance(info, dict):
        raise EnvironmentBadAnswer(f"{where}: info must be a JSON object")
    return info


class EnvironmentClient:
    """One environment server of the job, called from any thread (each call its own connection)."""

    def __init__(self, settings: config_mod.EnvironmentSettings) -> None:
        self.settings = settings
        self.base_url = settings.url.rstrip("/")
        self.replicas = [u.rstrip("/") for u in settings.replica_urls] or [self.base_url]
        self._next = itertools.count()
        self._lock = threading.Lock()

    def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, base: str | None = None
    ) -> Any:
        base = base or self.base_url
        where = f"environment {self.settings.name} {method} {path}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            base + path,
            data=data,
            headers={"Content-Type": "application/json"} if data is not None else {},
            method=method,
        )
        timeout = self.settings.timeout_s
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read(MAX_ANSWER_BYTES + 1)
        except urllib.error.HTTPError as e:
            detail = e.read(300).decode(errors="replace")
            raise EnvironmentHTTPError(f"{where}: HTTP {e.code} {detail}".rstrip()) from None
        except TimeoutError:
            raise EnvironmentTimeout(f"{where}: no answer within {timeout:g} s (timeoutS)") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError):
                raise EnvironmentTimeout(f"{where}: no answer within {timeout:g} s (timeoutS)") from None
            raise EnvironmentUnreachable(f"{where}: unreachable at {base}: {reason}") from None
        if len(raw) > MAX_ANSWER_BYTES:
            raise EnvironmentBadAnswer(f"{where}: the answer is over {MAX_ANSWER_BYTES} bytes")
        if method == "GET":
            return raw
        try:
            return json.loads(raw)
        except ValueError:
            raise EnvironmentBadAnswer(f"{where}: the answer is not JSON") from None

    def reset(self, seed: int, task: str | dict[str, Any] | None = None) -> Reset:
        """A new episode on the next replica; a replica that is unreachable or does not answer in time
        is passed over for the next (each at most once); its HTTP errors are the episode's."""
        body: dict[str, Any] = {"seed": int(seed)}
        if task is not None:
            body["task"] = task
        data, base = self._on_next_replica("/reset", body, (EnvironmentUnreachable, EnvironmentTimeout))
        reset = parse_reset(data, f"environment {self.settings.name} reset")
        return Reset(reset.episode_id, reset.observation, reset.info, base)

    def run_episode(
        self, episode_id: str, seed: int, task: str | dict[str, Any] | None, base_url: str, model: str
    ) -> EpisodeResult:
        """A whole episode on the next replica (mode agent): it answers once its agent is done, within
        `timeoutS`. A replica that is unreachable is passed over (each at most once); one that does not
        answer in time fails the episode (its agent may have called the endpoint already)."""
        body: dict[str, Any] = {
            "episode_id": episode_id,
            "seed": int(seed),
            "base_url": base_url,
            "model": model,
        }
        if task is not None:
            body["task"] = task
        data, base = self._on_next_replica("/episode", body, (EnvironmentUnreachable,))
        result = parse_episode(data, f"environment {self.settings.name} episode")
        return EpisodeResult(result.reward, result.info, base)

    def _on_next_replica(
        self, path: str, body: dict[str, Any], passed_over: tuple[type[EnvironmentCallError], ...]
    ) -> tuple[Any, str]:
        """POST `body` to the next replica in turn, passing over (each at most once) one whose call
        fails with one of `passed_over`; the answer and the replica that gave it."""
        with self._lock:
            first = next(self._next)
        error: EnvironmentCallError | None = None
        for k in range(len(self.replicas)):
            base = self.replicas[(first + k) % len(self.replicas)]
            try:
                return self._call("POST", path, body, base=base), base
            except passed_over as e:
                error = e
        assert error is not None
        raise error

    def step(self, replica: str, episode_id: str, action: str) -> Step:
        data = self._call("POST", "/step", {"episode_id": episode_id, "action": action}, base=replica)
        return parse_step(data, f"environment {self.settings.name} step")

    def close(self, replica: str, episode_id: str) -> None:
        """Free an episode that ended before `done`; a failure to is only logged by the caller."""
        self._call("POST", "/close", {"episode_id": episode_id}, base=replica)

    def healthy(self) -> bool:
        try:
            self._call("GET", "/healthz")
        except EnvironmentCallError:
            return False
        return True

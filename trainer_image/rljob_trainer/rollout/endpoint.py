"""The job's OpenAI-compatible endpoint: an agent written against any OpenAI client, trained as it runs.

Role: the shell around `openai_wire` (requests and responses) and `endpoint_episode` (prompts and
samples). The GRPO driver serves it on trainer pod 0 (`EndpointSettings`: port 8000, the container
port `endpoint`) for environments of mode agent: the driver asks such an environment to run a whole
episode (`POST /episode`, docs/contracts.md §4), and the environment's agent calls this endpoint with
the episode's base URL, `<url>/episodes/<episode id>/v1` (or `/v1` with the header `X-Episode-Id`).
Every call needs the job's bearer token (`Authorization: Bearer $OPENAI_API_KEY`, compared in constant
time); a call names an open episode or is refused, so only the job's episodes reach its engines.

Served: `POST /v1/chat/completions`, `POST /v1/completions` (whole, or with `stream: true` as
Server-Sent Events cut from the finished completion: `openai_wire.chat_chunks`), `GET /v1/models`,
and `GET /healthz` (no token). A call is rendered and tokenised on its HTTP thread (its own tokenizer,
one call at a time), then handed to the driver's loop (`drain`): the rollout pipeline queues it in
the same dispatcher as every other request (pinned to its episode's engine: the episode's prefix
cache), so the engines' admission, the load the adaptive policy reads and the weight versions
recorded per token are the same as for the trainer's own episodes. The HTTP thread waits for the
engine's outputs, records each choice's tokens and log-probs in the episode (what the trainer will
train on: `endpoint_episode.assemble_segments`) and answers; a streamed answer is recorded the same
way before its first chunk is sent.

Callers: `rljob_trainer.driver` (start, stop), `rljob_trainer.rollout.pipeline` (open and close
episodes, drain calls), tests.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rljob_trainer import config as config_mod
from rljob_trainer.engines import base
from rljob_trainer.rollout import endpoint_episode, openai_wire

log = logging.getLogger("rljob_trainer.endpoint")

#: The header naming a call's episode when its URL does not (`/v1/...`).
EPISODE_HEADER = "X-Episode-Id"
#: The header saying which sampling served a call (the job's: the request's temperature is ignored).
SAMPLING_HEADER = "X-RLJob-Sampling"
MAX_BODY_BYTES = 8 << 20
_EPISODE_PATH = re.compile(r"^/episodes/([A-Za-z0-9_.-]{1,128})(/v1/.*)$")


#: What a request is answered with: a JSON body, or (`stream: true`) a stream of events.
Answer = dict[str, Any] | openai_wire.EventStream


class EpisodeClosed(RuntimeError):
    """The call's episode ended (or started over) before its outputs came."""


@dataclass(eq=False)  # hashable by identity: the pipeline keys its results by call
class PendingCall:
    """A call rendered and waiting for the engines (the pipeline takes it from `Endpoint.drain`)."""

    episode: EndpointEpisode
    call: int
    prompt_ids: tuple[int, ...]
    n: int
    max_tokens: int
    submitted_s: float
    future: concurrent.futures.Future[list[base.GenerationOutput]] = field(
        default_factory=concurrent.futures.Future
    )


class EndpointEpisode:
    """One open episode: the calls its agent made and what they returned. HTTP threads add calls and
    records (under its lock); the pipeline reads them once the episode is over."""

    def __init__(
        self, episode_id: str, key: int, index: int, *, max_calls: int, sampling: tuple[float, float]
    ) -> None:
        self.id = episode_id
        self.key, self.index = key, index  # its pipeline job and request
        self.max_calls = max_calls
        self.sampling = sampling
        self.open = True
        self.started_s: float | None = None  # the pipeline's clock, when its POST /episode was sent
        self.engine: str | None = None  # the pipeline's: the engine of its last call (its prefix cache)
        self._lock = threading.Lock()
        self._calls = 0
        self._turns: list[endpoint_episode.RecordedTurn] = []
        self._chat: list[endpoint_episode.ChatRecord] = []
        self._completions: list[endpoint_episode.CompletionRecord] = []

    def begin_call(self) -> int:
        """The next call's number; refused once `max_calls` (agent.maxTurns) were made."""
        with self._lock:
            if self._calls >= self.max_calls:
                raise openai_wire.bad(
                    f"episode {self.id} made {self.max_calls} calls, the most an episode may "
                    "(spec.rollout.agent.maxTurns): end the episode, or raise maxTurns",
                    code="episode_call_limit",
                )
            self._calls += 1
            return self._calls - 1

    def chat_records(self) -> list[endpoint_episode.ChatRecord]:
        with self._lock:
            return list(self._chat)

    def completion_records(self) -> list[endpoint_episode.CompletionRecord]:
        with self._lock:
            return list(self._completions)

    def record(
        self,
        turns: list[endpoint_episode.RecordedTurn],
        chat: endpoint_episode.ChatRecord | None = None,
        completion: endpoint_episode.CompletionRecord | None = None,
    ) -> None:
        with self._lock:
            self._turns += turns
            if chat is not None:
                self._chat.append(chat)
            if completion is not None:
                self._completions.append(completion)

    def turns(self) -> list[endpoint_episode.RecordedTurn]:
        with self._lock:
            return list(self._turns)


@dataclass(frozen=True)
class Limits:
    """What one call may hold: the context an episode may hold (lengths.maxPromptTokens +
    agent.maxTotalTokens), the tokens one call may generate (lengths.maxResponseTokens), the calls an
    episode may make (agent.maxTurns), and how long a call waits for the engines."""

    context_tokens: int
    max_tokens: int
    max_calls: int
    call_timeout_s: float

    @classmethod
    def from_config(cls, cfg: config_mod.TrainerConfig) -> Limits:
        agent = cfg.agent
        total = (agent.max_total_tokens if agent else None) or cfg.lengths.max_response_tokens
        env = next((e for e in cfg.environments if e.mode == "agent"), None)
        return cls(
            context_tokens=cfg.lengths.max_prompt_tokens + total,
            max_tokens=cfg.lengths.max_response_tokens,
            max_calls=agent.max_turns if agent else 4,
            call_timeout_s=env.timeout_s if env is not None else 600.0,
        )


class Endpoint:
    """The server, its open episodes and the calls waiting for the pipeline."""

    def __init__(
        self,
        settings: config_mod.EndpointSettings,
        token: str,
        tokenizer: Any,
        *,
        model_name: str,
        limits: Limits,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not token:
            raise ValueError(
                f"the endpoint needs its token (${config_mod.ENV_ENDPOINT_TOKEN}, from the job's Secret "
                "<job>-endpoint-<uid>): the operator sets it on trainer pod 0"
            )
        self.settings = settings
        self.model_name = model_name
        self.limits = limits
        self.clock, self.wall_clock = clock, wall_clock
        self._token = token
        self._tokenizer = tokenizer  # the endpoint's own: its HTTP threads never share the driver's
        self._renderer = endpoint_episode.PromptRenderer(tokenizer)
        self._tok_lock = threading.Lock()
        self._lock = threading.Lock()
        self._episodes: dict[str, EndpointEpisode] = {}
        self._pending: dict[str, set[PendingCall]] = {}
        self._inbox: list[PendingCall] = []
        self._wake: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- the pipeline's side ---------------------------------------------------------------------
    def open_episode(self, key: int, index: int, *, sampling: tuple[float, float]) -> EndpointEpisode:
        ep = EndpointEpisode(
            secrets.token_hex(16), key, index, max_calls=self.limits.max_calls, sampling=sampling
        )
        with self._lock:
            self._episodes[ep.id] = ep
            self._pending[ep.id] = set()
        return ep

    def close_episode(self, ep: EndpointEpisode) -> None:
        """The episode is over (or starts over): later calls are refused, waiting ones fail."""
        with self._lock:
            ep.open = False
            self._episodes.pop(ep.id, None)
            waiting = self._pending.pop(ep.id, set())
            self._inbox = [c for c in self._inbox if c.episode is not ep]
        for call in waiting:
            if not call.future.done():
                call.future.set_exception(
                    EpisodeClosed(f"episode {ep.id} ended before this call was answered")
                )

    def drain(self) -> list[PendingCall]:
        """The calls waiting for the engines, oldest first (the pipeline queues them)."""
        with self._lock:
            calls, self._inbox = self._inbox, []
            if self._wake.done():
                self._wake = concurrent.futures.Future()
        return calls

    @property
    def wake(self) -> concurrent.futures.Future[None]:
        """Done once a call is waiting (the pipeline waits on it with its tool and environment calls)."""
        with self._lock:
            return self._wake

    def episode_url(self, ep: EndpointEpisode) -> str:
        """The base URL the episode's agent is given (an OpenAI client's `base_url`)."""
        return f"{self.settings.url.rstrip('/')}/episodes/{ep.id}/v1"

    # ---- the server ------------------------------------------------------------------------------
    def start(self) -> None:
        self._server = ThreadingHTTPServer((self.settings.host, self.settings.port), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="rljob-endpoint", daemon=True)
        self._thread.start()
        log.info(
            "OpenAI-compatible endpoint on %s:%d (model %s)", self.settings.host, self.port, self.model_name
        )

    @property
    def port(self) -> int:
        return self._server.server_address[1] if self._server is not None else self.settings.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            episodes = list(self._episodes.values())
        for ep in episodes:
            self.close_episode(ep)

    # ---- one request -----------------------------------------------------------------------------
    def handle(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes
    ) -> tuple[int, Answer, dict[str, str]]:
        """(status, JSON body or event stream, extra headers) of one request (the HTTP handler's
        whole work)."""
        path = path.split("?", 1)[0]
        if method == "GET" and path == "/healthz":
            return 200, {"status": "ok", "model": self.model_name}, {}
        try:
            if not openai_wire.authorized(headers.get("Authorization"), self._token):
                raise openai_wire.unauthorized()
            episode_id = headers.get(EPISODE_HEADER)
            m = _EPISODE_PATH.match(path)
            if m:
                episode_id, path = m.group(1), m.group(2)
            if method == "GET" and path == "/v1/models":
                return 200, openai_wire.models_response(self.model_name, int(self.wall_clock())), {}
            routes = {"/v1/chat/completions": self._chat, "/v1/completions": self._completion}
            if path not in routes:
                raise openai_wire.WireError(
                    404,
                    f"no path {path}: POST /v1/chat/completions, /v1/completions; GET /v1/models",
                    code="not_found",
                )
            if method != "POST":
                raise openai_wire.WireError(405, f"{path} takes POST", code="method_not_allowed")
            try:
                data = json.loads(body or b"{}")
            except ValueError as exc:
                raise openai_wire.bad(f"the body is not JSON: {exc}") from None
            return routes[path](data, self._episode(episode_id))
        except openai_wire.WireError as exc:
            return exc.status, exc.body(), {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}

    def _episode(self, episode_id: str | None) -> EndpointEpisode:
        if not episode_id:
            raise openai_wire.bad(
                "no episode: this endpoint serves the job's episodes only; use the base URL the environment "
                f"was given in POST /episode (<endpoint>/episodes/<episode id>/v1), or send {EPISODE_HEADER}",
                code="episode_required",
            )
        with self._lock:
            ep = self._episodes.get(episode_id)
        if ep is None:
            raise openai_wire.WireError(
                404,
                f"no open episode {episode_id!r}: it ended, started over, or was never opened by the trainer",
                code="episode_not_found",
            )
        return ep

    def _wait(
        self, ep: EndpointEpisode, prompt_ids: list[int], n: int, max_tokens: int, call: int
    ) -> list[base.GenerationOutput]:
        pending = PendingCall(ep, call, tuple(prompt_ids), n, max_tokens, self.clock())
        with self._lock:
            if not ep.open:
                raise openai_wire.WireError(404, f"episode {ep.id} ended", code="episode_not_found")
            self._pending[ep.id].add(pending)
            self._inbox.append(pending)
            if not self._wake.done():
                self._wake.set_result(None)
        try:
            return pending.future.result(timeout=self.limits.call_timeout_s)
        except EpisodeClosed as exc:
            raise openai_wire.WireError(404, str(exc), code="episode_not_found") from None
        except concurrent.futures.TimeoutError:
            raise openai_wire.WireError(
                504,
                f"no engine answered within {self.limits.call_timeout_s:g} s (the environment's timeoutS)",
                code="timeout",
                kind="server_error",
            ) from None
        finally:
            with self._lock:
                self._pending.get(ep.id, set()).discard(pending)

    def _choices(
        self, outs: list[base.GenerationOutput], *, stop: tuple[str, ...], tools: bool, call_id: str
    ) -> list[openai_wire.Choice]:
        with self._tok_lock:
            return [
                openai_wire.make_choice(
                    o.token_ids,
                    o.logprobs,
                    o.finish_reason,
                    text_of=self._text,
                    eos_ids=self._renderer.eos_ids,
                    stop=stop,
                    tools=tools,
                    call_id=f"{call_id}_{j}",
                )
                for j, o in enumerate(outs)
            ]

    def _text(self, ids: Any) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))

    def _token_text(self, token_id: int) -> str:
        with self._tok_lock:
            return self._token_text_locked(token_id)

    def _token_text_locked(self, token_id: int) -> str:  # the caller holds _tok_lock
        return self._text([token_id])

    def _turns(
        self,
        call: int,
        outs: list[base.GenerationOutput],
        choices: list[openai_wire.Choice],
        seconds: float,
    ) -> list[endpoint_episode.RecordedTurn]:
        turns = []
        for j, (o, c) in enumerate(zip(outs, choices, strict=True)):
            kept = len(c.token_ids)
            out = dataclasses.replace(
                o, token_ids=c.token_ids, logprobs=c.logprobs, token_versions=o.versions[:kept]
            )
            turns.append(endpoint_episode.RecordedTurn(call, j, out, c.text, len(c.tool_calls), seconds))
        return turns

    def _headers(self, ep: EndpointEpisode) -> dict[str, str]:
        temperature, top_p = ep.sampling
        return {SAMPLING_HEADER: f"temperature={temperature:g}; top_p={top_p:g}"}

    def _chat(self, data: Any, ep: EndpointEpisode) -> tuple[int, Answer, dict[str, str]]:
        req = openai_wire.parse_chat_request(data)
        openai_wire.check_model(req.model, self.model_name)
        call = ep.begin_call()
        t0 = self.clock()
        with self._tok_lock:
            prompt_ids, _ = self._renderer.chat_prompt(req.messages, req.tools, ep.chat_records())
        budget = openai_wire.budget_tokens(
            req.max_tokens,
            len(prompt_ids),
            context_tokens=self.limits.context_tokens,
            max_tokens=self.limits.max_tokens,
        )
        outs = self._wait(ep, prompt_ids, req.n, budget, call)
        rid = f"chatcmpl-{secrets.token_hex(12)}"
        choices = self._choices(outs, stop=req.stop, tools=bool(req.tools), call_id=f"call_{rid[9:]}")
        record = endpoint_episode.ChatRecord(
            req.messages,
            endpoint_episode.tools_key(req.tools),
            tuple(prompt_ids),
            tuple((c.message, c.token_ids) for c in choices),
        )
        ep.record(self._turns(call, outs, choices, self.clock() - t0), chat=record)
        return self._answer(
            req, choices, prompt_ids, rid, ep, openai_wire.chat_response, openai_wire.chat_chunks
        )

    def _completion(self, data: Any, ep: EndpointEpisode) -> tuple[int, Answer, dict[str, str]]:
        req = openai_wire.parse_completion_request(data)
        openai_wire.check_model(req.model, self.model_name)
        call = ep.begin_call()
        t0 = self.clock()
        with self._tok_lock:
            prompt_ids, _ = self._renderer.completion_prompt(req.prompt, ep.completion_records())
        budget = openai_wire.budget_tokens(
            req.max_tokens,
            len(prompt_ids),
            context_tokens=self.limits.context_tokens,
            max_tokens=self.limits.max_tokens,
        )
        outs = self._wait(ep, prompt_ids, req.n, budget, call)
        choices = self._choices(outs, stop=req.stop, tools=False, call_id="call")
        record = None
        if isinstance(req.prompt, str):
            record = endpoint_episode.CompletionRecord(
                req.prompt, tuple(prompt_ids), tuple((c.text, c.token_ids) for c in choices)
            )
        ep.record(self._turns(call, outs, choices, self.clock() - t0), completion=record)
        rid = f"cmpl-{secrets.token_hex(12)}"
        return self._answer(
            req, choices, prompt_ids, rid, ep, openai_wire.completion_response, openai_wire.completion_chunks
        )

    def _answer(
        self,
        req: Any,
        choices: list[openai_wire.Choice],
        prompt_ids: list[int],
        response_id: str,
        ep: EndpointEpisode,
        whole: Callable[..., dict[str, Any]],
        chunks: Callable[..., openai_wire.EventStream],
    ) -> tuple[int, Answer, dict[str, str]]:
        """A recorded call's answer: `whole(...)`, or with `stream` the same cut into `chunks(...)`."""
        ids = {"response_id": response_id, "created": int(self.wall_clock()), "model": self.model_name}
        if not req.stream:
            body = whole(req, choices, prompt_ids, token_text=self._token_text, **ids)
            return 200, body, self._headers(ep)
        with self._tok_lock:  # the tokenizer serves one HTTP thread at a time; the chunks decode a lot
            stream = chunks(
                req, choices, prompt_ids, token_text=self._token_text_locked, text_of=self._text, **ids
            )
        return 200, stream, self._headers(ep)


def _handler(endpoint: Endpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: an agent's calls reuse its connection
        server_version = "rljob-endpoint"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s %s", self.address_string(), format % args)

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                self.close_connection = True  # the body is not read: the connection cannot be reused
                err = openai_wire.WireError(413, f"the body is {length} bytes, at most {MAX_BODY_BYTES}")
                self._send(413, err.body(), {})
                return
            body = self.rfile.read(length) if length else b""
            try:
                status, payload, headers = endpoint.handle(method, self.path, self.headers, body)
            except Exception as exc:  # a bug must answer, never hang the agent
                log.exception("endpoint: %s %s failed", method, self.path)
                err = openai_wire.WireError(500, f"internal error: {exc}", kind="server_error")
                status, payload, headers = 500, err.body(), {}
            self._send(status, payload, headers)

        def _send(self, status: int, payload: Answer, headers: Mapping[str, str]) -> None:
            if isinstance(payload, openai_wire.EventStream):
                self._send_events(payload, headers)
                return
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _send_events(self, stream: openai_wire.EventStream, headers: Mapping[str, str]) -> None:
            # Chunked transfer encoding: each event its own HTTP chunk, flushed as it is written, so the
            # connection stays reusable (HTTP/1.1 keep-alive) without a Content-Length known up front.
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            for event in stream.events():
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

    return Handler

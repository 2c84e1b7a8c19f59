"""The job's OpenAI-compatible endpoint (rollout.endpoint, endpoint_episode, the pipeline's agent mode)
through real HTTP on loopback: an environment of mode agent (a stdlib server, `agent_http`) runs each
episode with its own agent calling the endpoint as any OpenAI client does, while the pipeline serves
those calls on the scripted engines. What the agent reads is OpenAI's wire format with the engine's
log-probs; what the trainer trains on is each call's tokens and log-probs exactly as the engine
generated them; an episode's calls stay on one engine; no token, no call."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from agent_http import AgentEnvironment, OpenAIClientEnvironment, call, free_port, serve
from agent_scripted import TOK, make_pipeline

from rljob_env import arithmetic_agent
from rljob_trainer import config
from rljob_trainer.model import modeling
from rljob_trainer.rollout import endpoint, endpoint_episode, environment_client

TOKEN = "s3cret-token"


def say(prompt_text: str) -> str:
    return "42" if "say 42" in prompt_text.lower() else "?"


def _cfg(
    env_url: str, port: int, *, timeout_s: float = 10.0, max_turns: int = 4, task: str | None = None
) -> config.TrainerConfig:
    return config.parse_config(
        {
            "model": {
                "name": "t",
                "source": "tiny",
                "hfConfig": modeling.tiny_hf_config(len(TOK)),
                "tokenizer": "builtin-char",
            },
            "lengths": {"maxPromptTokens": 256, "maxResponseTokens": 200},
            "grpo": {"groupSize": 2, "promptsPerStep": 2, "maxSteps": 5, "maxStaleness": 1},
            "rollout": {"kind": "transformers", "sharedEngines": 0, "dedicatedEngines": 2},
            "data": {"builtin": "toy-arithmetic", "chatTemplate": True},
            "agent": {"maxTurns": max_turns, "environment": "say"},
            "environments": [
                {"name": "say", "url": env_url, "timeoutS": timeout_s, "mode": "agent", "task": task}
            ],
            "endpoint": {"url": f"http://127.0.0.1:{port}", "port": port, "host": "127.0.0.1"},
        }
    )


def _endpoint(cfg: config.TrainerConfig, token: str = TOKEN) -> endpoint.Endpoint:
    assert cfg.endpoint is not None
    return endpoint.Endpoint(
        cfg.endpoint, token, TOK, model_name="t", limits=endpoint.Limits.from_config(cfg)
    )


@pytest.fixture
def running() -> Iterator[Any]:
    """start(api, token) -> (pipeline, engines, agent environment, endpoint); all stopped afterwards."""
    stop: list[Any] = []

    def start(
        api: str = "chat", token: str | None = TOKEN, script: Any = None, env: Any = None, **kw: Any
    ) -> Any:
        env = env or AgentEnvironment(token, api=api)
        url, httpd = serve(env)
        stop.append(httpd.shutdown)
        cfg = _cfg(url, free_port(), **kw)
        ep = _endpoint(cfg)
        ep.start()
        stop.append(ep.stop)
        pipe, engines, _, loop = make_pipeline(cfg, script or say, endpoint=ep)
        stop.append(loop.close)
        return pipe, engines, env, ep

    yield start
    for fn in reversed(stop):
        fn()


# ---- the wire, as an OpenAI client reads it --------------------------------------------------------
def test_chat_completions_answer_in_openai_format_with_the_engines_logprobs(running) -> None:
    pipe, _, env, _ = running("chat")
    job = pipe.wait_for_batch(1)
    assert len(env.answers) >= 4  # step 2 runs ahead (maxStaleness 1)
    out = job.outputs[0]
    answers = env.answers[out.meta["episode_id"]]
    assert [s for s, _ in answers] == [200, 200]
    body = answers[0][1]
    assert body["object"] == "chat.completion" and body["model"] == "t"
    assert body["id"].startswith("chatcmpl-") and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "42"}
    # One entry per generated token (the EOS the engine stopped on included), the engine's log-prob.
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == ["4", "2", TOK.eos_token]
    assert choice["token_ids"] == [*TOK.encode("42", add_special_tokens=False), TOK.eos_token_id]
    prompt_ids = body["prompt_token_ids"]
    (request,) = [r for r in env.requests if r["episode_id"] == out.meta["episode_id"]]
    assert request["base_url"].endswith(f"/episodes/{request['episode_id']}/v1") and request["model"] == "t"
    # The conversation through the model's chat template, as the trainer's own loop renders it.
    assert TOK.decode(prompt_ids) == f"user: Say 42 (seed {request['seed']}).\nassistant: "
    mark = round(-content[0]["logprob"])  # the scripted engine's log-probs name the engine
    assert [c["logprob"] for c in content] == pytest.approx(
        [-(mark + 0.001 * (len(prompt_ids) + k)) for k in range(3)]
    )
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 3,
        "total_tokens": len(prompt_ids) + 3,
    }
    assert out.env_reward == 1.0


def test_completions_answer_in_openai_format_with_logprobs(running) -> None:
    pipe, _, env, _ = running("completions")
    job = pipe.wait_for_batch(1)
    out = job.outputs[0]
    (s1, first), (s2, _) = env.answers[out.meta["episode_id"]]
    assert (s1, s2) == (200, 200)
    assert first["object"] == "text_completion" and first["id"].startswith("cmpl-")
    (choice,) = first["choices"]
    assert choice["text"] == "42" and choice["finish_reason"] == "stop"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["4", "2", TOK.eos_token] and lp["text_offset"] == [0, 1, 2]
    assert len(lp["token_logprobs"]) == 3 and all(x < 0 for x in lp["token_logprobs"])
    assert out.env_reward == 1.0
    # A completion that ended on EOS is not continued (its text does not hold it): two samples, each
    # one call's tokens and log-probs as the engine gave them.
    assert isinstance(out, endpoint_episode.EndpointEpisodeOutput) and len(out.segments) == 2
    for seg in out.segments:
        assert TOK.decode(seg.token_ids) == "42" + TOK.eos_token and seg.loss_mask == (1, 1, 1)
    assert out.segments[0].logprobs == pytest.approx(tuple(lp["token_logprobs"]))
    # What the driver trains: each segment a sample, with its episode's advantage.
    other = job.outputs[1]
    samples, advs = endpoint_episode.training_outputs([out, other], [0.5, -1.0])
    assert samples == [*out.segments, *other.segments] and advs == [0.5, 0.5, -1.0, -1.0]


def test_a_call_without_the_jobs_token_is_refused_401(running) -> None:
    pipe, _, env, ep = running("chat", token="wrong")
    job = pipe.wait_for_batch(1)
    for out in job.outputs:
        ((status, body),) = env.answers[out.meta["episode_id"]]
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        # The agent made no call the endpoint served: the episode failed, trains nothing.
        assert out.finish_reason == "failed" and "no_calls" in out.failure
        assert set(out.loss_mask) == {0}
    base = f"http://127.0.0.1:{ep.port}"
    assert call(f"{base}/v1/models", None, None)[0] == 401
    assert call(f"{base}/v1/models", None, "nope")[0] == 401
    status, models = call(f"{base}/v1/models", None, TOKEN)
    assert status == 200 and models["data"][0]["id"] == "t"
    assert call(f"{base}/healthz", None, None)[0] == 200  # the probe needs no token
    # With the token, a call must name an open episode: the endpoint serves the job's episodes only.
    status, body = call(
        f"{base}/episodes/nope/v1/chat/completions",
        {"model": "t", "messages": [{"role": "user", "content": "hi"}]},
        TOKEN,
    )
    assert status == 404 and body["error"]["code"] == "episode_not_found"
    status, body = call(
        f"{base}/v1/chat/completions", {"model": "t", "messages": [{"role": "user", "content": "hi"}]}, TOKEN
    )
    assert status == 400 and body["error"]["code"] == "episode_required"


def test_an_endpoint_without_its_token_does_not_start() -> None:
    cfg = _cfg("http://127.0.0.1:9", 8000)
    with pytest.raises(ValueError, match="RLJOB_ENDPOINT_TOKEN"):
        _endpoint(cfg, token="")


# ---- the official openai client, whole answers and streamed ---------------------------------------
ANSWER = "The answer: 42."  # one token per character here: a stream of many chunks


def say_long(prompt_text: str) -> str:
    return ANSWER if "say 42" in prompt_text.lower() else "?"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_the_openai_client_reads_chat_answers_and_the_episode_trains_the_engines_tokens(
    running, stream: bool
) -> None:
    env = OpenAIClientEnvironment(TOKEN, "chat", stream=stream)
    pipe, _, _, _ = running(env=env, script=say_long)
    job = pipe.wait_for_batch(1)
    answer_ids = [*TOK.encode(ANSWER, add_special_tokens=False), TOK.eos_token_id]
    for out in job.outputs:
        assert isinstance(out, endpoint_episode.EndpointEpisodeOutput) and out.failure is None
        first, second = env.answers[out.meta["episode_id"]]
        for got in (first, second):
            # What the client put back together is the whole answer: its text, ids, finish, usage.
            assert got["text"] == ANSWER and got["token_ids"] == answer_ids
            assert got["finish_reason"] == (["stop"] if stream else "stop")
            n_prompt = len(got["prompt_token_ids"])
            assert got["usage"] == {
                "prompt_tokens": n_prompt,
                "completion_tokens": len(answer_ids),
                "total_tokens": n_prompt + len(answer_ids),
            }
            # The engine's log-probs, one per token (the scripted engine's mark their engine and place).
            mark = round(-got["logprobs"][0])
            assert got["logprobs"] == pytest.approx(
                [-(mark + 0.001 * (n_prompt + k)) for k in range(len(answer_ids))]
            )
        if stream:
            # A chunk with the role, one per character (the EOS rides with the last), one with the
            # finish reason, the usage chunk (no choices) last.
            assert first["roles"] == ["assistant"] and not first["last_has_choices"]
            assert first["chunks"] == 1 + len(ANSWER) + 1 + 1
        # The episode trains exactly what the engine generated, whichever way the agent read it: its
        # conversation went back as answered, so one sample, the two calls' ids and log-probs in it.
        (seg,) = out.segments
        assert list(seg.prompt_token_ids) == first["prompt_token_ids"]
        assert list(seg.token_ids[: len(answer_ids)]) == answer_ids
        assert list(seg.token_ids[-len(answer_ids) :]) == answer_ids
        assert second["prompt_token_ids"] == [*seg.prompt_token_ids, *seg.token_ids[: -len(answer_ids)]]
        n_gap = len(seg.token_ids) - 2 * len(answer_ids)
        assert list(seg.logprobs) == [*first["logprobs"], *[0.0] * n_gap, *second["logprobs"]]
        assert seg.loss_mask == (1,) * len(answer_ids) + (0,) * n_gap + (1,) * len(answer_ids)
        assert out.env_reward == 1.0


def test_the_openai_client_streams_completions_with_logprobs(running) -> None:
    env = OpenAIClientEnvironment(TOKEN, "completions", stream=True)
    pipe, _, _, _ = running(env=env, script=say_long)
    job = pipe.wait_for_batch(1)
    answer_ids = [*TOK.encode(ANSWER, add_special_tokens=False), TOK.eos_token_id]
    for out in job.outputs:
        assert out.failure is None and out.env_reward == 1.0
        read = env.answers[out.meta["episode_id"]]
        for got, seg in zip(read, out.segments, strict=True):
            assert got["text"] == ANSWER and got["finish_reason"] == ["stop"]
            assert got["token_ids"] == answer_ids and list(seg.token_ids) == answer_ids
            # Each chunk's offsets run on over the whole text, as in a whole answer.
            assert got["text_offset"] == list(range(len(answer_ids)))
            assert list(seg.logprobs) == pytest.approx(got["logprobs"]) and len(got["logprobs"]) == len(
                answer_ids
            )
            assert got["usage"]["completion_tokens"] == len(answer_ids)


class RawStream:
    """An agent reading the endpoint's stream as bytes: the wire itself (headers, events, [DONE])."""

    name = "raw"

    def __init__(self) -> None:
        self.read: dict[str, tuple[Mapping[str, str], bytes]] = {}

    def run_episode(
        self, episode_id: str, seed: int, task: Any, base_url: str, model: str
    ) -> tuple[float, dict[str, Any]]:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Say 42."}],
            "stream": True,
            "temperature": 0.0,
        }
        req = urllib.request.Request(f"{base_url}/chat/completions", data=json.dumps(body).encode())
        req.add_header("Authorization", f"Bearer {TOKEN}")
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=30) as resp:
            self.read[episode_id] = (dict(resp.headers), resp.read())
        return 1.0, {}


def test_a_stream_is_server_sent_events_ending_in_done(running) -> None:
    env = RawStream()
    pipe, _, _, _ = running(env=env, script=say_long)
    job = pipe.wait_for_batch(1)
    headers, raw = env.read[job.outputs[0].meta["episode_id"]]
    assert headers["Content-Type"] == "text/event-stream" and headers["Transfer-Encoding"] == "chunked"
    # The request's temperature (0) was not what served: the job's sampling did, and says so.
    assert headers[endpoint.SAMPLING_HEADER] == "temperature=1; top_p=1"
    events = raw.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert "usage" not in chunks[0]  # no stream_options.include_usage: no usage at all
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == ANSWER
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}


# ---- the environment of mode agent shipped in the image ---------------------------------------------
_STEP = re.compile(
    r"(?:Start with|Correct:) (-?\d+)\. Step \d+ of \d+: (add|subtract|multiply it by) (\d+)\."
)
_OPS = {"add": int.__add__, "subtract": int.__sub__, "multiply it by": int.__mul__}


def solve(prompt_text: str) -> str:
    """A policy that does the arithmetic the conversation's last instruction asks for."""
    *_, (value, op, n) = _STEP.findall(prompt_text)
    return f"It is {_OPS[op](int(value), int(n))}."


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_shipped_arithmetic_agent_plays_its_episodes_through_the_endpoint(running, stream: bool) -> None:
    env = arithmetic_agent.ArithmeticAgent(TOKEN, stream=stream, timeout_s=30)
    pipe, _, _, _ = running(env=env, script=solve, task="easy")  # 2 steps an episode
    job = pipe.wait_for_batch(1)
    for out in job.outputs:
        assert isinstance(out, endpoint_episode.EndpointEpisodeOutput) and out.failure is None
        # Solved: each step's reply was the engine's answer to the environment's instruction.
        assert out.env_reward == 1.0 and out.turns == 2
        (seg,) = out.segments  # the conversation went back as answered: one sample
        text = TOK.decode(seg.token_ids)
        replies = re.findall(r"It is -?\d+\.", text)
        assert len(replies) == 2 and text.startswith(replies[0] + TOK.eos_token + "\nuser: Correct: ")
        # Trained: the two replies' tokens (the engine's, with its log-probs); masked: what the
        # environment said between them.
        trained = [t for t, m in zip(seg.token_ids, seg.loss_mask, strict=True) if m]
        assert TOK.decode(trained) == (replies[0] + TOK.eos_token) + (replies[1] + TOK.eos_token)
        assert all(lp < 0 for lp, m in zip(seg.logprobs, seg.loss_mask, strict=True) if m)


def test_the_shipped_arithmetic_agent_ends_on_a_wrong_reply_and_names_a_refusal(running) -> None:
    env = arithmetic_agent.ArithmeticAgent(TOKEN, timeout_s=30)
    pipe, _, _, _ = running(env=env, script=lambda _: "It is 7.", task={"steps": 3, "max_operand": 1000})
    for out in pipe.wait_for_batch(1).outputs:
        assert out.failure is None and out.turns == 1 and out.env_reward == 0.0  # wrong at step 1
    # Without the job's token the endpoint refuses the first call: the episode fails, named.
    refused = arithmetic_agent.ArithmeticAgent("wrong", timeout_s=30)
    pipe, _, _, _ = running(env=refused, script=solve, task="easy")
    for out in pipe.wait_for_batch(1).outputs:
        assert out.finish_reason == "failed" and "401" in out.failure and "invalid_api_key" in out.failure
    with pytest.raises(ValueError, match="OPENAI_API_KEY"):
        arithmetic_agent.ArithmeticAgent("")


@pytest.mark.parametrize("budget", ["max_turns", "context"])
def test_the_shipped_arithmetic_agent_ends_when_the_episodes_budget_is_spent(running, budget: str) -> None:
    env = arithmetic_agent.ArithmeticAgent(TOKEN, timeout_s=30)
    task = {"steps": 4, "max_operand": 50}
    if budget == "max_turns":
        # maxTurns 2 against 4 steps: the endpoint refuses the third call.
        pipe, _, _, _ = running(env=env, script=solve, task=task, max_turns=2)
    else:
        # Long right replies (185 characters of padding, then 60: each fits the room its call has):
        # the third call's conversation is over the context an episode may hold (maxPromptTokens
        # 256 + 200), and the endpoint refuses it (context_length_exceeded).
        def padded(text: str) -> str:
            return "." * (185 if text.count("assistant:") == 1 else 60) + solve(text)

        pipe, _, _, _ = running(env=env, script=padded, task=task)
    for out in pipe.wait_for_batch(1).outputs:
        # The episode ends there with the share of steps done right (2 of 4), as the arithmetic
        # environment rewards an early end; its two calls are trained on.
        assert out.failure is None and out.turns == 2 and out.env_reward == 0.5


# ---- what the trainer trains on ---------------------------------------------------------------------
def test_an_episodes_calls_are_its_sample_with_the_engines_tokens_and_logprobs(running) -> None:
    pipe, (a, b), env, _ = running("chat")
    pins: dict[tuple[str, int], str | None] = {}  # (episode, call) -> the engine its request waits for

    class Recorded(dict):
        def __setitem__(self, rid: int, value: Any) -> None:
            call, _ = value
            pins[(call.episode.id, call.call)] = pipe.dispatcher.pinned_to(rid)
            super().__setitem__(rid, value)

    pipe._call_of = Recorded()
    pipe.pump(lambda: pipe.jobs[1].complete and pipe.jobs[2].complete, current=1)
    outs = [*pipe.jobs[1].outputs, *pipe.jobs[2].outputs]
    engine_of = {a.name: a.mark, b.name: b.mark}
    for out in outs:
        assert isinstance(out, endpoint_episode.EndpointEpisodeOutput) and out.failure is None
        # The agent sent its conversation back as it was answered: one sample, as the trainer's loop.
        assert len(out.segments) == 1 and out.turns == 2 and out.env_reward == 1.0
        (status1, first), (status2, second) = env.answers[out.meta["episode_id"]]
        assert (status1, status2) == (200, 200)
        # The sample is the first call's prompt ids, its tokens, the next user turn rendered alone
        # (masked), the second call's tokens: exactly the ids the endpoint returned, never re-encoded.
        assert list(out.prompt_token_ids) == first["prompt_token_ids"]
        t1, t2 = first["choices"][0]["token_ids"], second["choices"][0]["token_ids"]
        assert list(out.token_ids[: len(t1)]) == t1 and list(out.token_ids[-len(t2) :]) == t2
        assert second["prompt_token_ids"] == [*out.prompt_token_ids, *out.token_ids[: -len(t2)]]
        assert (
            TOK.decode(out.token_ids)
            == "42" + TOK.eos_token + "\nuser: Again: say 42.\nassistant: 42" + TOK.eos_token
        )
        assert out.loss_mask == (1,) * len(t1) + (0,) * (len(out.token_ids) - len(t1) - len(t2)) + (1,) * len(
            t2
        )
        lps = [c["logprob"] for c in first["choices"][0]["logprobs"]["content"]]
        lps2 = [c["logprob"] for c in second["choices"][0]["logprobs"]["content"]]
        assert list(out.logprobs) == [*lps, *[0.0] * (len(out.token_ids) - len(t1) - len(t2)), *lps2]
        # Both calls ran on one engine (pinned: its prefix cache holds the episode).
        mark = round(-lps[0])
        assert round(-lps2[0]) == mark and out.meta["engine"] in engine_of
        assert engine_of[out.meta["engine"]] == mark
        # The second call was queued pinned to the first call's engine (the first went anywhere).
        episode = out.meta["episode_id"]
        assert pins[(episode, 0)] is None and pins[(episode, 1)] == out.meta["engine"]
        # What the driver trains on: the sample itself, with its episode's advantage.
        samples, advs = endpoint_episode.training_outputs([out], [0.5])
        assert samples == [out.segments[0]] and advs == [0.5]
    # Each engine call of an episode asked for that episode's context: the second call's prompt on
    # the engine is the first call's prompt + tokens + observation.
    prompts = [tuple(p) for e in (a, b) for c in e.calls for p in c.prompts]
    for out in outs:
        assert tuple(out.prompt_token_ids) in prompts
    assert len(prompts) == 2 * len(outs)  # two calls per episode, no request generated twice


def test_an_environment_that_does_not_answer_fails_its_episode_named() -> None:
    port = free_port()
    cfg = _cfg("http://127.0.0.1:9", port, timeout_s=1.0)
    ep = _endpoint(cfg)
    ep.start()
    pipe, _, _, loop = make_pipeline(cfg, say, endpoint=ep)
    try:
        job = pipe.wait_for_batch(1)
        for out in job.outputs:
            assert out.finish_reason == "failed" and "unreachable" in out.failure
            assert set(out.loss_mask) == {0}
        assert pipe.take_env_failures() >= 4
    finally:
        ep.stop()
        loop.close()


def test_episode_answers_are_checked() -> None:
    assert environment_client.parse_episode({"reward": 1, "info": {"x": 1}}, "e").reward == 1.0
    with pytest.raises(environment_client.EnvironmentBadAnswer, match="reward must be a finite number"):
        environment_client.parse_episode({"reward": "1"}, "e")
    with pytest.raises(environment_client.EnvironmentBadAnswer, match="JSON object"):
        environment_client.parse_episode([1], "e")


def test_config_mode_agent_needs_the_endpoint_and_no_tools() -> None:
    good = _cfg("http://e", 8000).model_dump(by_alias=True, exclude_none=True)
    del good["endpoint"]
    with pytest.raises(ValueError, match=r"`endpoint` must be set"):
        config.parse_config(good)
    good = _cfg("http://e", 8000).model_dump(by_alias=True, exclude_none=True)
    good["agent"]["tools"] = [{"name": "calc", "kind": "calculator"}]
    with pytest.raises(ValueError, match=r"remove agent\.tools"):
        config.parse_config(good)


def test_a_call_interrupted_at_a_weight_sync_resumes_and_keeps_each_tokens_version(running) -> None:
    long_answer = "42" * 12  # 25 tokens with EOS: several polls of the scripted engine

    def script(text: str) -> str:  # a resumed call goes on from the tokens it has, as an engine does
        if "say 42" not in text.lower():
            return "?"
        return long_answer[len(text.rsplit("assistant: ", 1)[1]) :]

    pipe, (a, b), env, _ = running("chat", script=script)
    pipe.cfg.rollout.partial_rollouts = True
    # Steps 1 and 2 are in flight (maxStaleness 1); the trainer takes step 1 next, so a call of step
    # 2 is interrupted at the sync. Run until one is generating (it has some of its tokens).

    def ahead() -> bool:
        return any(
            r in pipe._call_of and pipe._request_of[r][0] > 1 and c.engine in ("a", "b")
            for c in pipe.calls.values()
            for r in c.ids
        )

    pipe.pump(ahead, current=1)
    assert ahead()
    interrupted = pipe.quiesce(["a", "b"])
    assert interrupted and pipe.interrupted > 0
    a.version = b.version = 1
    pipe.resume_engines(interrupted)
    pipe.pump(lambda: all(j.complete for j in pipe.jobs.values()), current=1)
    resumed = [
        s for j in pipe.jobs.values() for o in j.outputs for s in o.segments if s.meta.get("interrupts")
    ]
    assert resumed
    for s in resumed:
        gen = [v for v, m in zip(s.token_versions, s.loss_mask, strict=True) if m]
        assert gen == sorted(gen) and gen[0] == 0 and gen[-1] == 1  # each token its own version
        assert s.meta["version"] == 0  # the oldest: what the staleness bound reads
        # The agent read the whole answer, across the sync, and the sample holds exactly its tokens.
        assert TOK.decode(s.token_ids).startswith(long_answer + TOK.eos_token)
    assert sorted(pipe.jobs) == [1, 2]
    assert all(o.env_reward == 1.0 for j in pipe.jobs.values() for o in j.outputs)
    for j in pipe.jobs.values():
        for o in j.outputs:
            for _, body in env.answers[o.meta["episode_id"]]:
                assert body["choices"][0]["message"]["content"] == long_answer


def test_evaluation_runs_endpoint_episodes_at_its_own_sampling(running) -> None:
    pipe, (a, b), env, _ = running("chat")
    pipe.wait_for_batch(1)  # training's episodes first (the job's temperature, 1.0)
    before = {id(c) for e in (a, b) for c in e.calls}
    outs = pipe.run_episodes([], [11, 12], temperature=0.25, top_p=0.5)
    assert len(outs) == 2 and all(o.env_reward == 1.0 and len(o.segments) == 1 for o in outs)
    calls = [c for e in (a, b) for c in e.calls if id(c) not in before]
    # The evaluation's calls hold only its own requests, sampled at its settings.
    assert calls and {(c.sampling.temperature, c.sampling.top_p) for c in calls} == {(0.25, 0.5)}
    seeds = sorted(r["seed"] for r in env.requests if r["episode_id"] in {o.meta["episode_id"] for o in outs})
    assert seeds == [11, 12]

"""Multi-turn episodes on real engines, through the real driver: the calculator-calling tiny model
(agent_model) runs episodes of tool calls and answers on the transformers engine and on vLLM's CPU
build, and every token the trainer trains on, with its log-prob, is the engine's (token-in/token-out:
nothing re-tokenised), while the tool results sit in the episode masked out. On vLLM the trainer's
own log-probs of those tokens also match the engine's (the same weights, fp32). The job's
OpenAI-compatible endpoint serves from vLLM too: an agent written against OpenAI's wire format, in
an environment server of mode agent, runs its episodes through it, and trains on vLLM's tokens."""

from __future__ import annotations

from pathlib import Path

import agent_model
import pytest
from agent_http import AgentEnvironment, free_port, serve
from agent_runs import Recorder, agent_config, check_trained_tokens_are_the_engines, write_questions

pytest.importorskip("torch")

from rljob_trainer import config, driver, runtimes

# slow: the tool-calling model is built on first use (a few minutes of CPU, then cached).
pytestmark = [pytest.mark.torch, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return agent_model.build()


def _run(cfg, tmp_path: Path, steps: int = 2):
    d = driver.GRPODriver(cfg, runtimes.LocalRuntime(cfg), metrics_path=tmp_path / "metrics.jsonl")
    try:
        d.setup()
        rec = Recorder(d)
        rows = [d.step() for _ in range(steps)]
    finally:
        d.shutdown()
    return rows, rec


def _check(rows, rec) -> None:
    assert rec.samples and len(rec.samples) == 2 * 2 * 2  # groups x prompts x steps: one sample an episode
    multi = check_trained_tokens_are_the_engines(rec.samples, rec.outputs)
    assert multi >= len(rec.samples) // 2  # the model calls the tool: most episodes have two turns
    assert any(0 in s.mask for s in rec.samples)  # tool results sit in the episode, masked out
    for row in rows:
        assert row["agent/tool_calls"] > 0 and row["agent/turns_mean"] > 1
        assert 0 <= row["agent/tool_time_share"] < 1
        assert row["rollout/generated_tokens"] < sum(len(s.response_ids) for s in rec.samples)


def _judge(model_dir: Path) -> dict:
    """The same tiny model as a judge (its scores are noise; the path is the real one)."""
    return {
        "model": agent_model.model_settings(model_dir, name="tiny-judge"),
        "promptTemplate": "Q {prompt} A {answer} R {response} score:",
        "maxTokens": 4,
        "maxModelLen": 384,
        "batchSize": 3,
        "weight": 0.5,
        "cpuKvCacheBytes": 32 << 20,
        "maxNumSeqs": 8,
    }


def _check_judge(rows) -> None:
    for row in rows:
        assert row["judge/scored"] + row["judge/failed"] == 4  # every response of the step went to it
        assert row["judge/failed"] == 0 and row["judge/seconds"] > 0
        assert "reward/judge" in row


def test_episodes_on_the_transformers_engine_train_on_its_tokens(tmp_path: Path, model_dir: Path) -> None:
    cfg = agent_config(model_dir, write_questions(tmp_path / "q.jsonl"), judge=_judge(model_dir))
    rows, rec = _run(cfg, tmp_path)
    _check(rows, rec)
    _check_judge(rows)


@pytest.mark.vllm
def test_episodes_on_vllm_train_on_its_tokens_and_log_probs(tmp_path: Path, model_dir: Path) -> None:
    pytest.importorskip("vllm")
    cfg = agent_config(
        model_dir,
        write_questions(tmp_path / "q.jsonl"),
        rollout={
            "kind": "vllm",
            "maxNumSeqs": 8,
            "maxNumBatchedTokens": 512,
            "cpuKvCacheBytes": 64 << 20,
        },
        judge=_judge(model_dir),  # a second vLLM engine, the judge's own
    )
    rows, rec = _run(cfg, tmp_path)
    _check(rows, rec)
    _check_judge(rows)
    assert {o.meta.get("engine") for o in rec.outputs} == {"dedicated-0"}
    # The trainer's log-probs of the generated tokens under the weights the engine sampled with (the
    # first step's: version 0) are the engine's processed log-probs.
    first = [
        (s, lp) for s, lp in zip(rec.samples, rec.trainer_logprobs, strict=True) if s.weights_version == 0
    ]
    assert first
    worst = max(
        abs(t - e) for s, lp in first for t, e, m in zip(lp, s.rollout_logprobs, s.mask, strict=True) if m
    )
    assert worst < 2e-3, worst


@pytest.mark.vllm
def test_the_endpoint_serves_an_openai_agent_from_vllm(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The endpoint in front of a vLLM CPU engine: each chat call of the agent is one vLLM
    generation whose token ids and log-probs the trainer trains on; the conversation it sends back
    continues the same sample (the environment's words masked out)."""
    pytest.importorskip("vllm")
    token = "vllm-endpoint-token"
    monkeypatch.setenv(config.ENV_ENDPOINT_TOKEN, token)
    env = AgentEnvironment(token, max_tokens=24)  # the second call's conversation fits the context
    url, httpd = serve(env)
    port = free_port()
    cfg = agent_config(
        model_dir,
        write_questions(tmp_path / "q.jsonl"),
        lengths={"maxPromptTokens": 64, "maxResponseTokens": 96},
        rollout={"kind": "vllm", "maxNumSeqs": 8, "maxNumBatchedTokens": 512, "cpuKvCacheBytes": 64 << 20},
        agent={"maxTurns": 3, "environment": "agent", "tools": []},  # the agent brings its own
        environments=[{"name": "agent", "url": url, "timeoutS": 120, "mode": "agent"}],
        endpoint={"url": f"http://127.0.0.1:{port}", "port": port, "host": "127.0.0.1"},
    )
    try:
        rows, rec = _run(cfg, tmp_path)
    finally:
        httpd.shutdown()
    assert env.requests and all(
        r["base_url"].startswith(f"http://127.0.0.1:{port}/episodes/") for r in env.requests
    )
    calls = {
        episode: [(status, body.get("error")) for status, body in a] for episode, a in env.answers.items()
    }
    assert all([status for status, _ in a] == [200, 200] for a in calls.values()), calls
    assert {o.meta.get("engine") for o in rec.outputs} == {"dedicated-0"}
    assert len(rec.samples) == 2 * 2 * 2  # one sample an episode
    assert check_trained_tokens_are_the_engines(rec.samples, rec.outputs) > 0  # a call continued a sample
    for row in rows:
        assert row["agent/env_failures"] == 0 and "reward/environment" in row

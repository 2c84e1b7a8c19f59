"""The real driver with config `endpoint` (LocalRuntime, the transformers engine, a tiny random model):
it serves the endpoint from `setup` (token from `$RLJOB_ENDPOINT_TOKEN`) to `shutdown`, an
environment of mode agent runs every episode through it over HTTP, and every trained token and
log-prob is one the engine generated for that call (nothing decoded and encoded again)."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from agent_http import AgentEnvironment, free_port, serve

pytest.importorskip("torch")

from rljob_trainer import config, driver, runtimes
from rljob_trainer.model import modeling

pytestmark = [pytest.mark.torch]

TOKEN = "driver-token"


def _cfg(env_url: str, port: int) -> config.TrainerConfig:
    return config.parse_config(
        {
            "model": {
                "name": "tiny",
                "source": "tiny",
                "hfConfig": modeling.tiny_hf_config(128),
                "dtype": "float32",
                "tokenizer": "builtin-char",
                "finetune": "full",
            },
            "lengths": {"maxPromptTokens": 128, "maxResponseTokens": 16},
            "grpo": {"groupSize": 2, "promptsPerStep": 2, "maxSteps": 2, "learningRate": 1e-3, "seed": 1},
            "batching": {"packed": True, "dynamic": True, "maxTokensPerMicroBatch": 512},
            "rollout": {"kind": "transformers", "sharedEngines": 0, "dedicatedEngines": 1},
            "data": {"builtin": "toy-arithmetic", "chatTemplate": True},
            "telemetry": {"enabled": False, "prometheusPort": None},
            "distributed": {"numTrainerRanks": 1, "launcher": "local", "torchThreadsPerRank": 1},
            "agent": {"maxTurns": 3, "environment": "agent"},
            "environments": [{"name": "agent", "url": env_url, "timeoutS": 60, "mode": "agent"}],
            "endpoint": {"url": f"http://127.0.0.1:{port}", "port": port, "host": "127.0.0.1"},
        }
    )


def _healthz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return int(r.status)
    except (urllib.error.URLError, OSError):
        return 0


def test_the_driver_serves_the_endpoint_and_trains_on_the_engines_tokens(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(config.ENV_ENDPOINT_TOKEN, TOKEN)
    env = AgentEnvironment(TOKEN)
    url, httpd = serve(env)
    port = free_port()
    cfg = _cfg(url, port)
    # The port trainer pod 0's container declares (RLJOB_ENDPOINT_PORT) wins over trainer.json's.
    monkeypatch.setenv(config.ENV_ENDPOINT_PORT, str(port))
    cfg = cfg.model_copy(update={"endpoint": cfg.endpoint.model_copy(update={"port": 9})})
    d = driver.GRPODriver(cfg, runtimes.LocalRuntime(cfg), metrics_path=tmp_path / "m.jsonl")
    generated: list[Any] = []
    trained: list[Any] = []
    try:
        assert _healthz(port) == 0  # not before setup
        d.setup()
        assert _healthz(port) == 200
        engine = next(iter(d.engines.values())).handle.obj
        generate = engine.generate

        def recorded(prompts: Any, sampling: Any) -> Any:
            outs = generate(prompts, sampling)
            generated.extend(outs)
            return outs

        engine.generate = recorded
        rank = d.ranks[0].obj
        train_step = rank.train_step

        def recorded_train(mini_batches: Any) -> Any:
            for mb in mini_batches:
                trained.extend(mb.samples)
            return train_step(mini_batches)

        rank.train_step = recorded_train
        rows = [d.step() for _ in range(2)]
    finally:
        d.shutdown()
        httpd.shutdown()
    assert _healthz(port) == 0  # stopped with the driver
    assert len(env.requests) >= 8
    assert all([status for status, _ in a] == [200, 200] for a in env.answers.values())
    assert all(r["base_url"].startswith(f"http://127.0.0.1:{port}/episodes/") for r in env.requests)
    assert len(trained) >= 2 * 2 * 2
    by_prompt: dict[tuple[int, ...], list[Any]] = {}
    for out in generated:
        by_prompt.setdefault(tuple(out.prompt_token_ids), []).append(out)
    multi = 0
    for s in trained:
        # Walk the sample: each trained run is one engine output for the context so far, its ids and
        # log-probs the engine's; each masked run an observation (log-prob 0).
        context, k, turns = list(s.prompt_ids), 0, 0
        while k < len(s.response_ids):
            if s.mask[k]:
                match = next(
                    o
                    for o in by_prompt[tuple(context)]
                    if o.token_ids and tuple(s.response_ids[k : k + len(o.token_ids)]) == o.token_ids
                )
                n = len(match.token_ids)
                assert s.rollout_logprobs[k : k + n] == match.logprobs
                turns += 1
            else:
                n = next((j for j in range(k, len(s.mask)) if s.mask[j]), len(s.mask)) - k
                assert all(lp == 0.0 for lp in s.rollout_logprobs[k : k + n])
            context += s.response_ids[k : k + n]
            k += n
        assert turns >= 1
        multi += turns > 1
    assert multi > 0  # the random model's answers are sent back: its next call continues the sample
    for row in rows:
        assert row["agent/turns_mean"] >= 1 and "reward/environment" in row
        assert row["agent/env_failures"] == 0

"""Episodes driven by an environment server (rollout.environment_client, the pipeline's environment
mode), against rljob_env's real HTTP server on loopback: the reset/step/close protocol, episodes
pinned to the replica that reset them, rewards summed from the steps, observations masked, and an
environment that does not answer failing its episodes (named, counted), never the job, unless every
episode of a step fails."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
from agent_scripted import TOK, make_pipeline

from rljob_env import arithmetic, server
from rljob_trainer import config
from rljob_trainer.model import modeling
from rljob_trainer.rollout import agent, environment_client


@dataclass
class SayEpisode:
    """Two steps: say 42 twice, half a point each time; `delay_s` makes every step slow."""

    delay_s: float = 0.0
    steps: int = 0

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        time.sleep(self.delay_s)
        self.steps += 1
        reward = 0.5 if "42" in action else 0.0
        return "Again: say 42.", reward, self.steps >= 2, {}


@dataclass
class SayEnvironment:
    delay_s: float = 0.0
    name: str = "say"

    def reset(
        self, seed: int, task: str | Mapping[str, Any] | None
    ) -> tuple[SayEpisode, str, dict[str, Any]]:
        return SayEpisode(self.delay_s), f"Say 42 (task {task}, seed {seed}).", {}


def _serve(env: Any) -> tuple[str, Any]:
    httpd = server.make_server(env, 0, "127.0.0.1")
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{httpd.server_address[1]}", httpd


@pytest.fixture
def servers() -> Iterator[list[tuple[str, Any]]]:
    started: list[tuple[str, Any]] = []

    def start(env: Any) -> str:
        url, httpd = _serve(env)
        started.append((url, httpd))
        return url

    yield start  # type: ignore[misc]
    for _, httpd in started:
        httpd.shutdown()


def _settings(url: str, replicas: list[str] | None = None, **kw: Any) -> config.EnvironmentSettings:
    return config.EnvironmentSettings(name="say", url=url, replica_urls=replicas or [], **kw)


def test_an_episode_lives_on_the_replica_that_reset_it(servers) -> None:
    a, b = servers(arithmetic.Arithmetic()), servers(arithmetic.Arithmetic())
    client = environment_client.EnvironmentClient(_settings("http://unused.invalid", [a, b]))
    resets = [client.reset(seed=s, task="easy") for s in range(4)]
    assert [r.replica for r in resets] == [a, b, a, b]  # each reset on the next replica
    assert "Step 1 of 2" in resets[0].observation
    step = client.step(resets[1].replica, resets[1].episode_id, "7")  # b holds it
    assert isinstance(step.reward, float) and isinstance(step.done, bool)
    with pytest.raises(environment_client.EnvironmentHTTPError, match="404"):
        client.step(a, resets[1].episode_id, "7")  # a never heard of it
    client.close(resets[0].replica, resets[0].episode_id)
    with pytest.raises(environment_client.EnvironmentHTTPError, match="no episode"):
        client.step(a, resets[0].episode_id, "7")
    with pytest.raises(environment_client.EnvironmentHTTPError, match="unknown task"):
        client.reset(seed=1, task="impossible")


def test_a_replica_that_does_not_answer_is_passed_over_at_reset(servers) -> None:
    a = servers(arithmetic.Arithmetic())
    client = environment_client.EnvironmentClient(_settings(a, ["http://127.0.0.1:9", a], timeout_s=1.0))
    assert {client.reset(seed=s).replica for s in range(3)} == {a}
    dead = environment_client.EnvironmentClient(_settings("http://127.0.0.1:9", timeout_s=1.0))
    with pytest.raises(environment_client.EnvironmentUnreachable, match="environment say POST /reset"):
        dead.reset(seed=0)


def test_a_slow_step_times_out_named(servers) -> None:
    url = servers(SayEnvironment(delay_s=1.0))
    client = environment_client.EnvironmentClient(_settings(url, timeout_s=0.2))
    reset = client.reset(seed=0)
    t0 = time.monotonic()
    with pytest.raises(environment_client.EnvironmentTimeout, match=r"no answer within 0.2 s \(timeoutS\)"):
        client.step(reset.replica, reset.episode_id, "42")
    assert time.monotonic() - t0 < 0.9


def test_answers_of_another_shape_are_refused_naming_the_field() -> None:
    with pytest.raises(environment_client.EnvironmentBadAnswer, match="episode_id"):
        environment_client.parse_reset({"observation": "x"}, "env reset")
    with pytest.raises(environment_client.EnvironmentBadAnswer, match="reward must be a finite number"):
        environment_client.parse_step({"reward": float("nan"), "done": True}, "env step")
    with pytest.raises(environment_client.EnvironmentBadAnswer, match="done must be true or false"):
        environment_client.parse_step({"reward": 1, "done": "yes"}, "env step")
    with pytest.raises(environment_client.EnvironmentBadAnswer, match="needs an observation"):
        environment_client.parse_step({"reward": 1, "done": False}, "env step")
    done = environment_client.parse_step({"reward": 0.2, "done": True, "info": {"final_reward": 0.9}}, "s")
    assert done.final_reward == 0.9
    assert (
        environment_client.parse_step({"reward": 0, "done": False, "observation": "o"}, "s").final_reward
        is None
    )


# ---- the pipeline with an environment -------------------------------------------------------------
def _cfg(url: str, *, max_turns: int = 4, timeout_s: float = 5.0) -> config.TrainerConfig:
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
            "environments": [{"name": "say", "url": url, "timeoutS": timeout_s, "task": "t1"}],
        }
    )


def say(prompt_text: str) -> str:
    return "42" if "say 42" in prompt_text.lower() else "?"


def test_environment_episodes_sum_their_step_rewards_and_mask_observations(servers) -> None:
    url = servers(SayEnvironment())
    pipe, _, _, loop = make_pipeline(_cfg(url), say)
    job = pipe.wait_for_batch(1)
    for out in job.outputs:
        assert isinstance(out, agent.AgentOutput)
        assert out.finish_reason == agent.FINISH_ENV_DONE and out.turns == 2
        assert out.env_reward == 1.0 and out.failure is None
        prompt = TOK.decode(out.prompt_token_ids)
        assert "user: Say 42 (task t1, seed" in prompt  # the reset's observation, the environment's task
        text = TOK.decode(out.token_ids)
        assert text == "42" + TOK.eos_token + "\nuser: Again: say 42.\nassistant: 42" + TOK.eos_token
        assert sum(out.loss_mask) == 2 * (len("42") + 1)
    # The two samples of a group share their task: one seed per group.
    assert job.outputs[0].prompt_token_ids == job.outputs[1].prompt_token_ids
    assert job.outputs[0].prompt_token_ids != job.outputs[2].prompt_token_ids
    loop.close()


def test_an_episode_cut_by_the_turn_limit_is_closed_on_its_replica(servers) -> None:
    env = SayEnvironment()
    url, httpd = _serve(env)
    try:
        pipe, _, _, loop = make_pipeline(_cfg(url, max_turns=1), say)
        pipe.pump(lambda: pipe.jobs[1].complete and pipe.jobs[2].complete, current=1)  # every episode
        job = pipe.jobs[1]
        assert {o.finish_reason for o in job.outputs} == {agent.FINISH_MAX_TURNS}
        assert all(o.env_reward == 0.5 for o in job.outputs)  # the one step's reward
        deadline = time.monotonic() + 5
        health = environment_client.EnvironmentClient(_settings(url))
        while time.monotonic() < deadline and b'"episodes": 0' not in health._call("GET", "/healthz"):
            time.sleep(0.05)
        assert b'"episodes": 0' in health._call("GET", "/healthz")  # closed, not left open
        loop.close()
    finally:
        httpd.shutdown()


def test_an_environment_that_does_not_answer_fails_its_episodes_not_the_job(servers) -> None:
    url = servers(SayEnvironment(delay_s=1.0))
    pipe, _, _, loop = make_pipeline(_cfg(url, timeout_s=0.2), say)
    job = pipe.wait_for_batch(1)
    assert {o.finish_reason for o in job.outputs} == {agent.FINISH_FAILED}
    assert all("timeout" in o.failure and "no answer within 0.2 s" in o.failure for o in job.outputs)
    assert all(set(o.loss_mask) == {0} for o in job.outputs)  # nothing of it trains
    assert pipe.take_env_failures() >= 4 and pipe.take_env_failures() == 0  # step 2 runs ahead too
    metrics = agent.agent_step_metrics(job.outputs, env_failures=4)
    assert metrics["agent/env_failures"] == 4 and metrics["agent/failed_fraction"] == 1.0
    with pytest.raises(agent.AllEpisodesFailedError, match="every episode of step 1 failed"):
        agent.check_not_all_failed(job.outputs, 1)
    # Some failed: the step trains on the others, the failed ones in groups of their own.
    mixed = [job.outputs[0], agent.Episode((1,), budget=4, max_turns=1).output()]
    agent.check_not_all_failed(mixed, 1)
    assert agent.advantage_groups(mixed, [0, 0]) == [1, 0]
    loop.close()


def test_an_environment_that_is_down_fails_the_resets_with_a_placeholder_that_trains_nothing() -> None:
    pipe, _, _, loop = make_pipeline(_cfg("http://127.0.0.1:9", timeout_s=1.0), say)
    job = pipe.wait_for_batch(1)
    for out in job.outputs:
        assert out.finish_reason == agent.FINISH_FAILED and "unreachable" in out.failure
        assert set(out.loss_mask) == {0} and out.turns == 0
    loop.close()

"""Unit tests for the shipped environment (rljob_env.arithmetic) and the protocol's episode table
(rljob_env.server.EnvironmentServer), without a socket: tests/integration/test_env_server.py
serves it over HTTP."""

from __future__ import annotations

import pytest

from rljob_env import arithmetic, server


def solve(episode: arithmetic.ArithmeticEpisode) -> list[int]:
    """The right answer of every step, computed from the episode's own operations."""
    value, out = episode.start, []
    for op, n in episode.ops:
        value = {"+": value + n, "-": value - n, "*": value * n}[op]
        out.append(value)
    return out


def test_the_same_seed_gives_the_same_task_and_another_seed_another() -> None:
    env = arithmetic.Arithmetic()
    a, obs_a, _ = env.reset(7, None)
    b, obs_b, _ = env.reset(7, None)
    c, _, _ = env.reset(8, None)
    assert (a.start, a.ops, obs_a) == (b.start, b.ops, obs_b)
    assert (a.start, a.ops) != (c.start, c.ops)
    assert obs_a.startswith(f"Start with {a.start}. Step 1 of 3:") and "Reply with the result" in obs_a


def test_right_answers_take_every_step_and_earn_1_at_the_end() -> None:
    episode, _, info = arithmetic.Arithmetic().reset(3, {"steps": 4})
    assert info == {"steps": 4, "max_operand": 100}
    answers = solve(episode)
    rewards = []
    for i, answer in enumerate(answers):
        observation, reward, done, step_info = episode.step(f"The result is {answer:,}.")
        rewards.append(reward)
        assert done == (i == len(answers) - 1)
        assert step_info["result"] == ("solved" if done else "right")
        if not done:
            assert f"Step {i + 2} of 4" in observation
    assert rewards == [0.0, 0.0, 0.0, 1.0]  # the episode's reward (their sum) comes at the end


def test_a_wrong_answer_ends_the_episode_with_the_share_done_right() -> None:
    episode, _, _ = arithmetic.Arithmetic().reset(5, {"steps": 4})
    answers = solve(episode)
    episode.step(str(answers[0]))
    observation, reward, done, info = episode.step(str(answers[1] + 1))
    assert done and reward == pytest.approx(0.25)
    assert info == {"result": "wrong", "expected": answers[1], "got": answers[1] + 1}
    assert f"the result was {answers[1]}" in observation


def test_a_reply_without_a_number_asks_again_once() -> None:
    episode, _, _ = arithmetic.Arithmetic().reset(1, None)
    observation, reward, done, _ = episode.step("<tool_call>calculator</tool_call>")
    assert not done and reward == 0.0 and "No number found" in observation and "Step 1 of 3" in observation
    _, reward, done, info = episode.step("I do not know")
    assert done and reward == 0.0 and info["result"] == "no-number"


@pytest.mark.parametrize(
    "task",
    [
        {"steps": 0},
        {"steps": 17},
        {"steps": "3"},
        {"max_operand": 1},
        {"max_operand": True},
        {"level": 2},
        "impossible",
    ],
)
def test_a_task_out_of_its_bounds_is_refused_naming_the_field(task: dict | str) -> None:
    with pytest.raises(server.TaskError, match=r"task\.|unknown task"):
        arithmetic.Arithmetic().reset(0, task)


def test_a_task_by_name_is_its_preset() -> None:
    episode, _, info = arithmetic.Arithmetic().reset(2, "hard")
    assert info == {"steps": 5, "max_operand": 1000} and len(episode.ops) == 5


def test_negative_and_separated_numbers_parse_and_the_last_one_counts() -> None:
    assert arithmetic.parse_number("first 3, then -1,234") == -1234
    assert arithmetic.parse_number("no digits") is None


def test_the_server_table_follows_the_protocol_and_forgets_finished_episodes() -> None:
    table = server.EnvironmentServer(arithmetic.Arithmetic(), max_episodes=2)
    opened = table.reset({"seed": 11, "task": {"steps": 1}})
    assert set(opened) == {"episode_id", "observation", "info"} and table.open_episodes == 1
    episode_id = opened["episode_id"]
    with pytest.raises(server.ProtocolError) as bad:
        table.step({"episode_id": episode_id, "action": 5})
    assert bad.value.status == 400 and "action must be a string" in bad.value.message
    result = table.step({"episode_id": episode_id, "action": "0"})
    assert set(result) == {"observation", "reward", "done", "info"}
    assert result["done"] and table.open_episodes == 0  # one step: right or wrong, the episode is over
    with pytest.raises(server.ProtocolError) as gone:
        table.step({"episode_id": episode_id, "action": "1"})
    assert gone.value.status == 404
    with pytest.raises(server.ProtocolError) as seedless:
        table.reset({"seed": "7"})
    assert seedless.value.status == 400


def test_at_most_max_episodes_stay_open_and_the_oldest_goes() -> None:
    table = server.EnvironmentServer(arithmetic.Arithmetic(), max_episodes=2)
    ids = [table.reset({"seed": s})["episode_id"] for s in range(3)]
    assert table.open_episodes == 2
    assert table.close({"episode_id": ids[0]}) == {"closed": False}  # the oldest went
    assert table.close({"episode_id": ids[2]}) == {"closed": True}


class _Agentic:
    """An environment of mode agent: its episode's reward is its seed, its info what it was given."""

    name = "agentic"

    def run_episode(self, episode_id, seed, task, base_url, model):
        if task == "impossible":
            raise server.TaskError("unknown task impossible")
        return float(seed), {"url": base_url, "model": model, "id": episode_id}


def test_an_environment_of_mode_agent_runs_whole_episodes_and_refuses_reset() -> None:
    table = server.EnvironmentServer(_Agentic())
    body = {"episode_id": "e1", "seed": 3, "base_url": "http://t:8000/episodes/e1/v1", "model": "m"}
    assert table.episode(body) == {"reward": 3.0, "info": {"url": body["base_url"], "model": "m", "id": "e1"}}
    for bad, field in (({"seed": "3"}, "seed"), ({"base_url": ""}, "base_url"), ({"model": None}, "model")):
        with pytest.raises(server.ProtocolError, match=field) as exc:
            table.episode({**body, **bad})
        assert exc.value.status == 400
    with pytest.raises(server.ProtocolError, match="unknown task"):
        table.episode({**body, "task": "impossible"})
    with pytest.raises(server.ProtocolError, match="mode agent") as exc:
        table.reset({"seed": 1})
    assert exc.value.status == 404
    steps = server.EnvironmentServer(arithmetic.Arithmetic())
    with pytest.raises(server.ProtocolError, match="mode steps") as exc:
        steps.episode(body)
    assert exc.value.status == 404

"""Episodes token-in/token-out (rljob_trainer.rollout.agent): the prompt offers the tools through the
chat template, an observation turn's ids are the template's own text after the model's turn, and the
episode's ids are exactly the template's rendering of the whole conversation, the model's turns
kept as generated; what follows a turn and a step."""

from __future__ import annotations

import pytest
from agent_chat import DEMONSTRATIONS, char_tokenizer, chatml_tokenizer

from rljob_trainer import config
from rljob_trainer.engines import base
from rljob_trainer.rollout import agent, tools

SCHEMAS = tools.tool_schemas([config.ToolSettings(name="calc", kind="calculator")])


def _turn(ep: agent.Episode, tok, text: str, *, eos: bool = True, version: int = 0, reason: str = "stop"):
    ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
    lps = tuple(-0.1 * (i + 1) for i in range(len(ids)))
    return base.GenerationOutput(
        tuple(ep.context), tuple(ids), lps, reason, {"engine": "e1", "version": version}
    )


@pytest.mark.parametrize("make", [chatml_tokenizer, char_tokenizer])
def test_demonstrations_come_after_the_tools_and_before_the_task_as_the_template_renders_them(make) -> None:
    tok = make()
    plain = agent.ChatFormat(tok, SCHEMAS)
    fmt = agent.ChatFormat(tok, SCHEMAS, demonstrations=DEMONSTRATIONS)
    task = "What is 6*7?"
    system = plain.prompt_messages(task)[:-1]
    assert fmt.prompt_messages(task) == [*system, *DEMONSTRATIONS, {"role": "user", "content": task}]
    kwargs = {} if fmt.system_tools else {"tools": SCHEMAS}
    expected = tok.apply_chat_template(
        fmt.prompt_messages(task), add_generation_prompt=True, tokenize=False, **kwargs
    )
    text = tok.decode(fmt.prompt_ids(task))
    assert text == expected
    # The tools' offer, then the worked call and its result, then the task, then the generation prompt.
    offer = text.index("<tools>") if not fmt.system_tools else text.index("calc(expression)")
    call, result, answer = (text.index(s) for s in ('"23+58"', "81", task))
    assert offer < text.index("What is 23+58?") < call < result < answer
    assert "23+58" not in tok.decode(plain.prompt_ids(task))


@pytest.mark.parametrize("make", [chatml_tokenizer, char_tokenizer])
def test_an_episode_is_the_templates_rendering_of_the_conversation(make) -> None:
    tok = make()
    fmt = agent.ChatFormat(tok, SCHEMAS)
    ep = agent.Episode(tuple(fmt.prompt_ids("What is 6*7?")), budget=400, max_turns=3)
    call = tools.format_tool_call(tools.ToolCall("calc", {"expression": "6*7"}))
    out1 = _turn(ep, tok, call, version=3)
    ep.add_turn(out1, call)
    results = [tools.ToolResult("calc", "42", True), tools.ToolResult("calc", "0", True)]
    obs = fmt.observation_ids(
        agent.tool_messages(results), turn_ended_with_eos=fmt.ended_with_eos(out1.token_ids)
    )
    ep.add_observation(obs)
    out2 = _turn(ep, tok, "The answer is 42.", version=4)
    ep.add_turn(out2, "The answer is 42.")

    msgs = [
        *fmt.prompt_messages("What is 6*7?"),
        {"role": "assistant", "content": call},
        *agent.tool_messages(results),
        {"role": "assistant", "content": "The answer is 42."},
    ]
    kwargs = {} if fmt.system_tools else {"tools": SCHEMAS}
    rendered = tok.apply_chat_template(msgs, tokenize=False, **kwargs)
    text = tok.decode(ep.context)
    if make is chatml_tokenizer:
        assert not fmt.system_tools and "<tools>" in tok.decode(ep.prompt_ids)
        assert rendered == text + "\n"  # token for token, <|im_end|> included
        assert "<tool_response>\n42\n</tool_response>\n<tool_response>\n0\n</tool_response>" in text
    else:
        # The plain template has no end-of-turn token: the model's EOS stays in the episode where it
        # stopped, and the template's own text follows it.
        assert fmt.system_tools and "calc(expression)" in tok.decode(ep.prompt_ids)
        assert rendered == text.replace(tok.eos_token, "") + "\n"
        assert text.count(tok.eos_token) == 2

    out = ep.output()
    n1, n_obs = len(out1.token_ids), len(obs)
    assert out.loss_mask == (1,) * n1 + (0,) * n_obs + (1,) * len(out2.token_ids)
    # The engine's ids and log-probs, untouched, where the loss trains.
    assert out.token_ids[:n1] == out1.token_ids and out.logprobs[:n1] == out1.logprobs
    assert out.token_ids[n1 + n_obs :] == out2.token_ids and out.logprobs[n1 + n_obs :] == out2.logprobs
    assert out.token_versions[:n1] == (3,) * n1 and out.generated_versions[-1] == 4
    assert out.meta["version"] == 3 and out.meta["engine"] == "e1" and out.turns == 2
    assert agent.loss_mask_of(out) == out.loss_mask
    assert agent.loss_mask_of(out1) == (1,) * n1


def test_a_turn_must_continue_the_episodes_own_tokens() -> None:
    tok = chatml_tokenizer()
    ep = agent.Episode((1, 2, 3), budget=10, max_turns=2)
    with pytest.raises(ValueError, match="token-in/token-out"):
        ep.add_turn(base.GenerationOutput((1, 2), (5,), (-1.0,), "stop"), "x")
    with pytest.raises(ValueError, match="exceeds"):
        ep.add_turn(base.GenerationOutput((1, 2, 3), tuple(range(11)), (-1.0,) * 11, "length"), "x")
    with pytest.raises(ValueError, match="log-prob per token"):
        ep.add_turn(base.GenerationOutput((1, 2, 3), (5, 6), (), "stop"), "x")
    ep.add_turn(_turn(ep, tok, "ab", eos=False), "ab")
    assert not ep.fits([0] * 8) and ep.fits([0] * 7)


def test_what_follows_a_turn() -> None:
    tok = chatml_tokenizer()
    call = tools.format_tool_call(tools.ToolCall("calc", {"expression": "1"}))

    def after(text: str, *, turns: int = 1, budget: int = 400, reason: str = "stop", environment=False):
        ep = agent.Episode((1,), budget=budget, max_turns=2)
        for _ in range(turns):
            out = _turn(ep, tok, text, reason=reason)
            ep.add_turn(out, text)
        return agent.decide_after_turn(ep, out, text, environment=environment)

    assert after("42") == agent.Finish(agent.FINISH_ANSWERED)
    assert isinstance(after(call), agent.CallTools)
    assert after(call, turns=2) == agent.Finish(agent.FINISH_MAX_TURNS)
    assert after(call, reason="length") == agent.Finish(agent.FINISH_LENGTH)
    assert isinstance(after("<tool_call>{bad", turns=1), agent.CallTools)  # told about its error
    assert after("anything", environment=True) == agent.StepEnvironment("anything")
    ep = agent.Episode((1,), budget=100, max_turns=2)
    ep.add_turn(_turn(ep, tok, "go"), "go")
    assert agent.decide_after_step(ep, done=True, turn_cut=False) == agent.Finish(agent.FINISH_ENV_DONE)
    assert agent.decide_after_step(ep, done=False, turn_cut=True) == agent.Finish(agent.FINISH_LENGTH)
    assert agent.decide_after_step(ep, done=False, turn_cut=False) == "observe"
    ep.add_turn(_turn(ep, tok, "go"), "go")
    assert agent.decide_after_step(ep, done=False, turn_cut=False) == agent.Finish(agent.FINISH_MAX_TURNS)


def test_environment_rewards_sum_unless_done_gives_a_final_one() -> None:
    ep = agent.Episode((1,), budget=10, max_turns=3, env_episode_id="e")
    ep.env_rewards += [0.5, 0.25]
    assert ep.env_reward == 0.75
    ep.env_final_reward = 1.0
    assert ep.env_reward == 1.0
    ep.finish(agent.FINISH_FAILED, failure="environment timed out")
    assert ep.env_reward == 0.0 and ep.output().failure == "environment timed out"
    assert agent.Episode((1,), budget=1, max_turns=1).env_reward is None


def test_a_tokenizer_without_a_chat_template_is_refused_naming_the_fix() -> None:
    tok = chatml_tokenizer()
    tok.chat_template = None
    with pytest.raises(agent.ChatTemplateError, match="chat template"):
        agent.ChatFormat(tok, SCHEMAS)

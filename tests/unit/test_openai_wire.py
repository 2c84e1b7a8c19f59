"""OpenAI's wire format for the job's endpoint (rollout.openai_wire, pure): what is refused by name
(what the trainer could not train on exactly), the bearer token, stop strings cutting the engine's
tokens so a choice's text always decodes its recorded tokens, hermes tool calls returned as
`tool_calls`, and the budget a call may generate."""

from __future__ import annotations

import json

import pytest
from agent_scripted import TOK

from rljob_trainer.rollout import openai_wire, tools


def _chat(**kw):
    return openai_wire.parse_chat_request(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    )


def _text(ids):
    return TOK.decode(list(ids), skip_special_tokens=False)


def _ids(text: str) -> list[int]:
    return list(TOK.encode(text, add_special_tokens=False))


def test_the_bearer_token_is_required_and_compared() -> None:
    assert openai_wire.authorized("Bearer tok", "tok") and openai_wire.authorized("bearer  tok ", "tok")
    assert not openai_wire.authorized(None, "tok")
    assert not openai_wire.authorized("Bearer other", "tok")
    assert not openai_wire.authorized("Basic tok", "tok")
    assert not openai_wire.authorized("Bearer ", "")  # no token configured: nothing is authorized
    assert openai_wire.unauthorized().status == 401


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"stream": True}, "stream"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"n": 17}, "n"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_what_could_not_be_trained_on_exactly_is_refused_by_name(extra, field) -> None:
    with pytest.raises(openai_wire.WireError) as exc:
        _chat(**extra)
    assert exc.value.status == 400 and exc.value.param == field
    assert exc.value.body()["error"]["type"] == "invalid_request_error"


def test_sampling_arguments_are_accepted_and_the_jobs_sampling_wins() -> None:
    req = _chat(temperature=0.1, top_p=0.5, seed=3, logprobs=True, max_completion_tokens=7, stop="\n")
    assert req.logprobs and req.max_tokens == 7 and req.stop == ("\n",)
    assert not hasattr(req, "temperature")  # never reaches the engines
    with pytest.raises(openai_wire.WireError, match="model is required"):
        openai_wire.parse_chat_request({"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(openai_wire.WireError) as exc:
        openai_wire.check_model("gpt-4", "m")
    assert exc.value.status == 404 and exc.value.code == "model_not_found"


def test_completions_requests() -> None:
    req = openai_wire.parse_completion_request({"model": "m", "prompt": ["abc"], "logprobs": 0})
    assert req.prompt == "abc" and req.logprobs and req.max_tokens == 16  # OpenAI's default
    assert openai_wire.parse_completion_request({"model": "m", "prompt": [1, 2, 3]}).prompt == (1, 2, 3)
    for bad in ({"echo": True}, {"best_of": 2}, {"logprobs": 2}, {"suffix": "x"}, {"prompt": []}):
        with pytest.raises(openai_wire.WireError):
            openai_wire.parse_completion_request({"model": "m", "prompt": "abc", **bad})


def test_assistant_tool_calls_are_read_back_as_sent() -> None:
    msg = openai_wire.parse_message(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "calc", "arguments": '{"b": 1, "a": 2}'}}
            ],
        },
        1,
    )
    assert msg.content == "" and msg.tool_calls == (("calc", '{"a": 2, "b": 1}'),)
    assert msg.template_message()["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 1}


def test_a_stop_string_cuts_the_engines_tokens_and_the_text_is_theirs() -> None:
    ids = [*_ids("abc\ndef"), TOK.eos_token_id]
    lps = [-float(k) for k in range(len(ids))]
    c = openai_wire.make_choice(
        ids, lps, "stop", text_of=_text, eos_ids=frozenset({TOK.eos_token_id}), stop=("\n",)
    )
    assert c.text == "abc" and c.token_ids == tuple(_ids("abc")) and c.logprobs == (0.0, -1.0, -2.0)
    assert c.finish_reason == "stop"
    plain = openai_wire.make_choice(ids, lps, "stop", text_of=_text, eos_ids=frozenset({TOK.eos_token_id}))
    assert plain.text == "abc\ndef" and plain.token_ids == tuple(ids)  # EOS kept in the tokens, not the text


def test_hermes_tool_calls_come_back_as_tool_calls() -> None:
    call = tools.format_tool_call(tools.ToolCall("calc", {"expression": "6*7"}))
    ids = [*_ids("Let me compute. " + call), TOK.eos_token_id]
    c = openai_wire.make_choice(
        ids,
        [0.0] * len(ids),
        "stop",
        text_of=_text,
        eos_ids=frozenset({TOK.eos_token_id}),
        tools=True,
        call_id="x",
    )
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me compute."
    (tc,) = c.tool_calls
    assert tc["id"] == "x_0" and tc["function"]["name"] == "calc"
    assert json.loads(tc["function"]["arguments"]) == {"expression": "6*7"}
    assert c.message.tool_calls == (("calc", '{"expression": "6*7"}'),)
    # The agent sends that message back as an OpenAI client does: it is recognised as the same turn.
    back = openai_wire.parse_message(
        {"role": "assistant", "content": "Let me compute.", "tool_calls": [dict(tc)]}, 1
    )
    assert back.same_turn(c.message)


def test_a_calls_budget() -> None:
    assert openai_wire.budget_tokens(None, 10, context_tokens=100, max_tokens=50) == 50
    assert openai_wire.budget_tokens(8, 10, context_tokens=100, max_tokens=50) == 8
    assert openai_wire.budget_tokens(None, 90, context_tokens=100, max_tokens=50) == 10
    with pytest.raises(openai_wire.WireError) as exc:
        openai_wire.budget_tokens(None, 100, context_tokens=100, max_tokens=50)
    assert exc.value.code == "context_length_exceeded"

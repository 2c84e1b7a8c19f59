"""OpenAI's wire format for the job's endpoint (rollout.openai_wire, pure): what is refused by name
(what the trainer could not train on exactly), the bearer token, stop strings cutting the engine's
tokens so a choice's text always decodes its recorded tokens, hermes tool calls returned as
`tool_calls`, and the budget a call may generate."""

from __future__ import annotations

import json
from typing import Any

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


# ---- streaming ----------------------------------------------------------------------------------------
def test_stream_and_its_options_are_checked_as_openai_checks_them() -> None:
    req = _chat(stream=True, stream_options={"include_usage": True})
    assert req.stream and req.include_usage
    assert not _chat(stream=False).stream and not _chat(stream=True).include_usage
    done = openai_wire.parse_completion_request({"model": "m", "prompt": "x", "stream": True})
    assert done.stream and not done.include_usage
    for extra, field in (
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
        ({"stream": True, "stream_options": {"frobnicate": True}}, "stream_options"),
    ):
        with pytest.raises(openai_wire.WireError) as exc:
            _chat(**extra)
        assert exc.value.status == 400 and exc.value.param == field


def _trained_tokenizer(kind: str) -> Any:
    """A real subword tokenizer trained here: byte-level BPE (GPT-2's, Qwen's: a character may span
    tokens) or Metaspace BPE (SentencePiece's: a word's space is the token's leading ▁)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>" if kind == "metaspace" else None))
    if kind == "byte":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, special_tokens=["<unk>"])
    tok.train_from_iterator(["the answer is forty two", "naïve café", "the cat sat"] * 20, trainer)
    return tok


@pytest.mark.parametrize("kind", ["byte", "metaspace"])
def test_streamed_pieces_join_to_exactly_the_text_with_a_real_subword_tokenizer(kind: str) -> None:
    tok = _trained_tokenizer(kind)

    def text_of(ids: Any) -> str:
        return str(tok.decode(list(ids), skip_special_tokens=False))

    text = "The answer is 42: naïve café, 日本語 🙂 done." if kind == "byte" else "the answer is forty two"
    ids = tok.encode(text).ids
    assert text_of(ids) == text
    pieces = openai_wire.stream_pieces(ids, text, text_of)
    assert len(pieces) == len(ids) and "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)  # a character split over byte tokens is held back
    if kind == "byte":
        assert "" in pieces and "日" in "".join(pieces)  # ...and comes whole with its last byte
    else:
        assert any(p.startswith(" ") for p in pieces)  # a word's space with its word, not lost
    assert sum(1 for p in pieces if p) > len(text.split()) // 2  # many chunks, not the text at once


def test_streamed_pieces_fall_back_to_the_whole_text_when_pieces_would_not_join() -> None:
    # A tokenizer whose whole decode cleans up spaces before punctuation (clean_up_tokenization_spaces):
    # pieces read token by token would join to "a ,b"; the stream sends the answer's text instead.
    def text_of(ids: Any) -> str:
        return _text(ids).replace(" ,", ",")

    ids = _ids("a ,b")
    pieces = openai_wire.stream_pieces(ids, text_of(ids), text_of)
    assert pieces == ["a,b", "", "", ""]


def _reassemble(stream: openai_wire.EventStream) -> dict[str, Any]:
    """What a client folds a chat stream into (as the openai client's stream helpers do)."""
    content, calls, finish, lps = "", [], None, []
    for chunk in stream.chunks:
        for ch in chunk["choices"]:
            content += ch["delta"].get("content") or ""
            calls += ch["delta"].get("tool_calls", [])
            finish = ch["finish_reason"] or finish
            lps += [e["logprob"] for e in (ch["logprobs"] or {"content": []})["content"]]
    return {"content": content, "tool_calls": calls, "finish_reason": finish, "logprobs": lps}


def test_a_chat_stream_is_the_whole_answer_cut_in_chunks() -> None:
    eos = frozenset({TOK.eos_token_id})
    call = tools.format_tool_call(tools.ToolCall("calc", {"expression": "6*7"}))
    plain = [*_ids("It is 42."), TOK.eos_token_id]
    called = [*_ids("Let me compute. " + call), TOK.eos_token_id]
    choices = [
        openai_wire.make_choice(
            ids,
            [-0.5 - k for k in range(len(ids))],
            "stop",
            text_of=_text,
            eos_ids=eos,
            tools=True,
            call_id="c",
        )
        for ids in (plain, called)
    ]
    req = _chat(stream=True, stream_options={"include_usage": True}, logprobs=True, return_token_ids=True)
    args = {"response_id": "r", "created": 1, "model": "m", "token_text": lambda t: _text([t])}
    whole = openai_wire.chat_response(req, choices, [1, 2, 3], **args)
    stream = openai_wire.chat_chunks(req, choices, [1, 2, 3], **args, text_of=_text)
    assert stream.chunks[0]["prompt_token_ids"] == [1, 2, 3]
    assert stream.chunks[-1]["choices"] == [] and stream.chunks[-1]["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in stream.chunks[:-1])
    for i, expected in enumerate(whole["choices"]):
        folded = _reassemble(
            openai_wire.EventStream(
                tuple({**c, "choices": [x for x in c["choices"] if x["index"] == i]} for c in stream.chunks)
            )
        )
        message = expected["message"]
        assert folded["content"] == (message["content"] or "")
        assert [{k: v for k, v in tc.items() if k != "index"} for tc in folded["tool_calls"]] == message.get(
            "tool_calls", []
        )
        assert folded["finish_reason"] == expected["finish_reason"]
        assert folded["logprobs"] == [e["logprob"] for e in expected["logprobs"]["content"]]
    assert whole["choices"][1]["finish_reason"] == "tool_calls"
    events = list(stream.events())
    assert events[-1] == b"data: [DONE]\n\n" and json.loads(events[0][6:]) == stream.chunks[0]

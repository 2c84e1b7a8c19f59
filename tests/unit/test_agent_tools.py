"""The agent's tools (rljob_trainer.rollout.tools): the hermes call parser, the calculator's whitelist
and bounds, results cut at maxResultChars, and user tools over HTTP against a real local server."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time
from collections.abc import Iterator

import pytest

from rljob_trainer import config
from rljob_trainer.rollout import tools


def test_parse_hermes_calls_in_order_with_the_errors_named() -> None:
    text = (
        'Let me compute. <tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>\n'
        '<tool_call>\n{"name": "py", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "x", "arguments": 3}</tool_call>'
        '<tool_call>{"name": "late"'
    )
    parsed = tools.parse_tool_calls(text)
    assert parsed.calls == (
        tools.ToolCall("calc", {"expression": "2+3"}),
        tools.ToolCall("py", {"code": "print(1)"}),  # arguments as a JSON string, as some models write
    )
    assert len(parsed.errors) == 5
    assert "not valid JSON" in parsed.errors[0]
    assert "must be a JSON object" in parsed.errors[1]
    assert 'string "name"' in parsed.errors[2]
    assert '"arguments" of x must be a JSON object' in parsed.errors[3]
    assert "not closed" in parsed.errors[4]
    assert not tools.parse_tool_calls("The answer is 5.").any
    call = tools.ToolCall("calc", {"expression": "1+1"})
    assert tools.parse_tool_calls(tools.format_tool_call(call)).calls == (call,)


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2+3*4", 14),
        ("(2+3)*4", 20),
        ("7/2", 3.5),
        ("7//2", 3),
        ("-7 % 3", 2),
        ("2**10", 1024),
        ("-(3 - 5) * +2", 4),
        ("1.5e3 + 0.5", 1500.5),
        ("2 ** -1", 0.5),
    ],
)
def test_the_calculator_computes_arithmetic(expression: str, value: float) -> None:
    assert tools.evaluate_arithmetic(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('id')", "not allowed"),
        ("open('/etc/passwd')", "not allowed"),
        ("x + 1", "not allowed"),
        ("(1).__class__", "not allowed"),
        ("[1, 2][0]", "not allowed"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1 if 1 else 2", "not allowed"),
        ("lambda: 1", "not allowed"),
        ("2 ^ 3", r"write \*\*"),
        ("1/0", "division by zero"),
        ("9**9**9", "too large"),
        ("10**5000", "too large"),
        ("(10**1000)*(10**1000)*(10**1000)*(10**1000)*(10**1000)", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1e308 * 10", "not a finite number"),
        ("1 +", "does not parse"),
        ("", "empty"),
        ("+".join(["1"] * 150), "parts"),
    ],
)
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expression: str, message: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(tools.CalculatorError, match=message):
        tools.evaluate_arithmetic(expression)
    assert time.monotonic() - t0 < 0.5  # refused before it is computed


def test_results_are_cut_saying_so_and_never_exceed_the_limit() -> None:
    assert tools.cut("short", 100) == "short"
    out = tools.cut("x" * 500, 100)
    assert len(out) == 100 and out.endswith("more characters]") and "[cut: 4" in out
    assert len(tools.cut("y" * 50, 16)) == 16
    assert tools.format_number(6 / 3) == "2" and tools.format_number(0.1 + 0.2) == "0.30000000000000004"


def _box(*settings: dict) -> tools.ToolBox:
    return tools.ToolBox([config.ToolSettings.model_validate(s) for s in settings])


def test_the_tool_box_never_raises_and_names_what_failed() -> None:
    box = _box({"name": "calc", "kind": "calculator", "maxResultChars": 20})
    ok = box.run(tools.ToolCall("calc", {"expression": "6*7"}))
    assert (ok.content, ok.ok, ok.name) == ("42", True, "calc")
    assert not box.run(tools.ToolCall("calc", {"expr": "1"})).ok
    unknown = box.run(tools.ToolCall("search", {}))
    assert not unknown.ok and "unknown tool 'search'" in unknown.content and "calc" in unknown.content
    big = box.run(tools.ToolCall("calc", {"expression": "2**4000"}))
    assert big.ok and len(big.content) == 20  # cut at maxResultChars


def test_tool_schemas_are_what_the_chat_template_takes() -> None:
    schemas = tools.tool_schemas(
        [
            config.ToolSettings(name="calc", kind="calculator"),
            config.ToolSettings(
                name="lookup",
                kind="http",
                url="http://x",
                description="Look a word up.",
                parameters={"type": "object", "properties": {"word": {"type": "string"}}},
            ),
        ]
    )
    assert schemas[0]["function"]["parameters"]["required"] == ["expression"]
    assert schemas[1]["function"] == {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
    }


# ---- user tools over HTTP, against a real server on loopback -------------------------------------
class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body)  # type: ignore[attr-defined]
        word = body["arguments"].get("word", "")
        if word == "slow":
            time.sleep(2)
        if word == "boom":
            self.send_response(500)
            self.end_headers()
            return
        answer = {"result": f"{body['name']}:{word.upper()}"} if word != "bad" else {"answer": 1}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError):  # the client gave up (the timeout case)
            self.wfile.write(data)


@pytest.fixture
def tool_server() -> Iterator[tuple[str, list]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.seen = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/call", server.seen  # type: ignore[attr-defined]
    finally:
        server.shutdown()


def test_an_http_tool_posts_name_and_arguments_and_reads_result(tool_server) -> None:
    url, seen = tool_server
    box = _box({"name": "lookup", "kind": "http", "url": url, "timeoutS": 0.5})
    res = box.run(tools.ToolCall("lookup", {"word": "hi"}))
    assert (res.content, res.ok) == ("lookup:HI", True)
    assert seen[0] == {"name": "lookup", "arguments": {"word": "hi"}}
    timed = box.run(tools.ToolCall("lookup", {"word": "slow"}))
    assert not timed.ok and "did not answer within 0.5 s" in timed.content and timed.seconds < 1.5
    assert "HTTP 500" in box.run(tools.ToolCall("lookup", {"word": "boom"})).content
    assert 'without a string "result"' in box.run(tools.ToolCall("lookup", {"word": "bad"})).content
    gone = _box({"name": "lookup", "kind": "http", "url": "http://127.0.0.1:9/x", "timeoutS": 0.5})
    assert "unreachable" in gone.run(tools.ToolCall("lookup", {})).content

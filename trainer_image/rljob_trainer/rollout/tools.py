"""Tools an agent calls between turns: the hermes call parser, the calculator, user tools over HTTP.

Role: the pure core of `spec.rollout.agent.tools` (trainer config `agent.tools`) and a thin shell
that runs one call. `parse_tool_calls` reads the calls out of what the engine generated (hermes
format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format Qwen2.5's, SmolLM2's
and the Hermes models' chat templates teach); `tool_schemas` gives the OpenAI-style function
schemas the chat template renders (`tokenizer.apply_chat_template(..., tools=...)`);
`evaluate_arithmetic` is the calculator: an AST whitelist of number literals and arithmetic
operators, never `eval`, with bounds so one call cannot take the driver's CPU or memory (a
`9**9**9` is refused before it is computed); `ToolBox.run` runs one call of any kind and always
returns a `ToolResult` (a failing tool is a result the model reads, never an exception that fails
the episode), cut at the tool's `maxResultChars`.

The Python interpreter tool runs in `rljob_trainer.rollout.sandbox` (a separate, fenced process).
Callers: `rljob_trainer.rollout.agent` (episodes), `rljob_trainer.rollout.pipeline` (runs calls on
its worker threads), tests.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rljob_trainer import config as config_mod

# ---- the hermes tool-call format -----------------------------------------------------------------
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedCalls:
    """The calls of one model turn, in order, and the malformed ones (each an error the model is told
    about in its tool message, so it can write the call again)."""

    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()

    @property
    def any(self) -> bool:
        return bool(self.calls or self.errors)


def parse_tool_calls(text: str) -> ParsedCalls:
    """Every `<tool_call>...</tool_call>` of `text` (hermes). A call's body must be a JSON object with
    a string `name` and an object `arguments` (a JSON string holding an object is accepted too, as
    some models write it); anything else is an error naming what is wrong. An opened call never
    closed (the turn ran out of tokens) is an error too."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for match in _CALL_RE.finditer(text):
        call, error = _parse_call_body(match.group(1).strip())
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)
    tail = text[text.rfind(TOOL_CALL_CLOSE) + len(TOOL_CALL_CLOSE) :] if TOOL_CALL_CLOSE in text else text
    if TOOL_CALL_OPEN in tail:
        errors.append(f"a {TOOL_CALL_OPEN} was not closed with {TOOL_CALL_CLOSE}")
    return ParsedCalls(tuple(calls), tuple(errors))


def _parse_call_body(body: str) -> tuple[ToolCall | None, str]:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"the tool call is not valid JSON ({e.msg} at character {e.pos})"
    if not isinstance(data, dict):
        return None, 'the tool call must be a JSON object {"name": ..., "arguments": {...}}'
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return None, 'the tool call needs a string "name"'
    args = data.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None, f'the "arguments" of {name} are not a JSON object'
    if not isinstance(args, dict):
        return None, f'the "arguments" of {name} must be a JSON object'
    return ToolCall(name, args), ""


def format_tool_call(call: ToolCall) -> str:
    """The hermes text of one call (what a model that learned the format writes; tests, examples)."""
    return f"{TOOL_CALL_OPEN}{json.dumps({'name': call.name, 'arguments': call.arguments})}{TOOL_CALL_CLOSE}"


# ---- the schemas the chat template renders --------------------------------------------------------
DEFAULT_DESCRIPTIONS: dict[str, str] = {
    "calculator": "Evaluate an arithmetic expression of numbers with + - * / // % ** and parentheses.",
    "python": "Run a short Python program and return what it prints (no network, no files outside "
    "its working directory, a few seconds of CPU).",
    "http": "A tool of the job.",
}
_ARGUMENT_OF_KIND: dict[str, tuple[str, str]] = {
    "calculator": ("expression", "The arithmetic expression, e.g. (12+7)*3/2."),
    "python": ("code", "The Python source to run; print() what you want back."),
}


def tool_schema(tool: config_mod.ToolSettings) -> dict[str, Any]:
    """One tool as an OpenAI-style function schema (what `apply_chat_template(tools=...)` takes)."""
    description = tool.description or DEFAULT_DESCRIPTIONS[tool.kind]
    if tool.kind in _ARGUMENT_OF_KIND:
        arg, arg_doc = _ARGUMENT_OF_KIND[tool.kind]
        parameters: dict[str, Any] = {
            "type": "object",
            "properties": {arg: {"type": "string", "description": arg_doc}},
            "required": [arg],
        }
    else:
        parameters = dict(tool.parameters or {"type": "object", "properties": {}})
    return {
        "type": "function",
        "function": {"name": tool.name, "description": description, "parameters": parameters},
    }


def tool_schemas(tools: Sequence[config_mod.ToolSettings]) -> list[dict[str, Any]]:
    return [tool_schema(t) for t in tools]


# ---- the calculator ------------------------------------------------------------------------------
MAX_EXPRESSION_CHARS = 1000
MAX_NODES = 200
# A result (or operand) larger than this many bits is refused: 2**4096 is ~1233 digits, far beyond
# any arithmetic task, and bounding it keeps every operation below a millisecond.
MAX_INT_BITS = 4096


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot compute (the message is the tool's result)."""


_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _bits(x: int | float) -> float:
    """How many bits |x| needs (a float's magnitude as an integer's would)."""
    if isinstance(x, int):
        return float(x.bit_length())
    return math.log2(abs(x)) + 1 if x and math.isfinite(x) else 0.0


def _check_size(x: int | float) -> int | float:
    if isinstance(x, float) and not math.isfinite(x):
        raise CalculatorError("the result is not a finite number")
    if _bits(x) > MAX_INT_BITS:
        raise CalculatorError(f"a number in the expression exceeds {MAX_INT_BITS} bits")
    return x


def _pow(base: int | float, exp: int | float) -> int | float:
    # Refuse before computing: |base|**exp needs exp * log2|base| bits.
    if abs(base) > 1 and exp > 0 and exp * math.log2(abs(base)) > MAX_INT_BITS:
        raise CalculatorError(f"the power is too large (more than {MAX_INT_BITS} bits)")
    if base == 0 and exp < 0:
        raise CalculatorError("0 cannot be raised to a negative power")
    result = base**exp
    if isinstance(result, complex):
        raise CalculatorError("a negative number to a fractional power is not a real number")
    return result


def _eval_node(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval_node(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_pow(left, right))
        if isinstance(node.op, ast.Mult) and _bits(left) + _bits(right) > MAX_INT_BITS + 1:
            raise CalculatorError(f"the product is too large (more than {MAX_INT_BITS} bits)")
        try:
            return _check_size(_BINOPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise CalculatorError("^ is not a power here: write ** (e.g. 2**3)")
    what = type(getattr(node, "op", node)).__name__
    raise CalculatorError(f"{what} is not allowed: only numbers, + - * / // % ** and parentheses")


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression: number literals, unary + and -, binary + - * / // % **
    and parentheses; nothing else parses (no names, calls, attributes, subscripts, comprehensions),
    and sizes are bounded (`MAX_EXPRESSION_CHARS`, `MAX_NODES`, `MAX_INT_BITS`). Raises
    `CalculatorError` with a message the model can read."""
    text = expression.strip()
    if not text:
        raise CalculatorError("the expression is empty")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"the expression does not parse: {e.msg}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"the expression has more than {MAX_NODES} parts")
    return _eval_node(tree)


def format_number(value: int | float) -> str:
    """A calculator result as text: integers exactly, an integral float without its '.0', else repr."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


# ---- results and the tool box --------------------------------------------------------------------
@dataclass(frozen=True)
class ToolResult:
    """What one call returned, as the model will read it, and what it cost."""

    name: str
    content: str
    ok: bool
    seconds: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)


def cut(text: str, max_chars: int) -> str:
    """`text` within `max_chars`, saying how much was cut (the note fits inside the limit)."""
    if len(text) <= max_chars:
        return text
    note = f"\n[cut: {len(text) - max_chars} more characters]"
    keep = max(0, max_chars - len(note))
    return text[:keep] + note[: max_chars - keep]


class ToolBox:
    """The tools of one job by name; `run` executes one call. `python_runner` is the sandbox's
    `run_python` (injected so tests can count calls; never a laxer stand-in)."""

    def __init__(
        self,
        tools: Sequence[config_mod.ToolSettings],
        *,
        python_runner: Callable[..., Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tools: dict[str, config_mod.ToolSettings] = {t.name: t for t in tools}
        self._python = python_runner
        self._clock = clock

    def run(self, call: ToolCall) -> ToolResult:
        """Run one call; every failure is a result saying so (`ok` False), never an exception."""
        t0 = self._clock()
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return ToolResult(call.name, f"error: unknown tool {call.name!r} (tools: {known})", False)
        try:
            content, ok, meta = self._dispatch(tool, call.arguments)
        except Exception as e:  # a tool's own failure is the model's to read, not the episode's
            content, ok, meta = f"error: {type(e).__name__}: {e}", False, {}
        return ToolResult(call.name, cut(content, tool.max_result_chars), ok, self._clock() - t0, meta)

    def _dispatch(
        self, tool: config_mod.ToolSettings, args: Mapping[str, Any]
    ) -> tuple[str, bool, dict[str, Any]]:
        if tool.kind == "calculator":
            expression = args.get("expression")
            if not isinstance(expression, str):
                return 'error: calculator needs {"expression": "<arithmetic>"}', False, {}
            try:
                return format_number(evaluate_arithmetic(expression)), True, {}
            except CalculatorError as e:
                return f"error: {e}", False, {}
        if tool.kind == "python":
            code = args.get("code")
            if not isinstance(code, str):
                return 'error: python needs {"code": "<source>"}', False, {}
            if self._python is None:
                from rljob_trainer.rollout import sandbox

                self._python = sandbox.run_python
            res = self._python(
                code,
                cpu_seconds=tool.cpu_seconds,
                memory_bytes=tool.memory_bytes,
                timeout_s=tool.timeout_s,
                max_output_chars=tool.max_result_chars,
            )
            return res.as_tool_text(), res.ok, {"reason": res.reason}
        if tool.kind == "http":
            return call_http_tool(tool, args)
        raise ValueError(f"unknown tool kind {tool.kind!r}; valid: {', '.join(config_mod.TOOL_KINDS)}")


def call_http_tool(
    tool: config_mod.ToolSettings, args: Mapping[str, Any]
) -> tuple[str, bool, dict[str, Any]]:
    """A user tool: POST {"name", "arguments"} to its url, answered {"result": text}. A timeout, an
    HTTP error or an answer without a string `result` is an error result naming it."""
    body = json.dumps({"name": tool.name, "arguments": dict(args)}).encode()
    req = urllib.request.Request(
        str(tool.url), data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=tool.timeout_s) as resp:
            raw = resp.read(tool.max_result_chars * 4 + 4096)
    except urllib.error.HTTPError as e:
        return f"error: tool {tool.name} answered HTTP {e.code}", False, {"reason": "http_error"}
    except TimeoutError:
        return (
            f"error: tool {tool.name} did not answer within {tool.timeout_s:g} s",
            False,
            {"reason": "timeout"},
        )
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError):
            return (
                f"error: tool {tool.name} did not answer within {tool.timeout_s:g} s",
                False,
                {"reason": "timeout"},
            )
        return f"error: tool {tool.name} is unreachable: {reason}", False, {"reason": "unreachable"}
    try:
        data = json.loads(raw)
    except ValueError:
        return f"error: tool {tool.name} did not answer JSON", False, {"reason": "bad_answer"}
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(result, str):
        return f'error: tool {tool.name} answered without a string "result"', False, {"reason": "bad_answer"}
    return result, True, {}

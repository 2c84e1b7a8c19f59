"""A multi-step arithmetic environment: the environment shipped with rljob (`python -m rljob_env.arithmetic`).

Role: the default of spec.environments[].command, for the tests and the examples. An episode starts
from a number and applies `steps` operations one turn at a time ("add 5", "multiply it by 3",
"subtract 12"): each turn the policy replies with the running result (it may call the calculator
tool first); a right answer gets the next operation, a wrong one ends the episode. The reward comes
at the end: 1 when every step was right, else the share of steps done right. A reply with no number
asks again; a second in a row ends the episode. The episode is fixed by its seed (the same seed, the
same numbers), so a group of GRPO samples shares one task.

Task (`reset`'s `task`): a name, `easy` (2 steps, operands up to 20), `medium` (the default: 3, 100)
or `hard` (5, 1000), or an object with `steps` (1..16, default 3) and `max_operand` (2..1000000,
default 100).
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Mapping
from typing import Any

from rljob_env import server

NAME = "arithmetic"
DEFAULT_STEPS = 3
DEFAULT_MAX_OPERAND = 100
MAX_STEPS = 16
MAX_OPERAND = 1_000_000
MULTIPLIER_MAX = 9  # a product's operand stays small: numbers a tiny model can still learn to carry
_NUMBER = re.compile(r"-?\d[\d,]*")
PRESETS: dict[str, dict[str, int]] = {
    "easy": {"steps": 2, "max_operand": 20},
    "medium": {"steps": DEFAULT_STEPS, "max_operand": DEFAULT_MAX_OPERAND},
    "hard": {"steps": 5, "max_operand": 1000},
}
_OPS = {
    "+": ("add {n}", lambda a, b: a + b),
    "-": ("subtract {n}", lambda a, b: a - b),
    "*": ("multiply it by {n}", lambda a, b: a * b),
}


def parse_number(text: str) -> int | None:
    """The last integer in `text` (thousands separators allowed), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return int(found[-1].replace(",", ""))
    except ValueError:
        return None


@dataclasses.dataclass
class ArithmeticEpisode:
    start: int
    ops: list[tuple[str, int]]
    step_index: int = 0
    value: int = 0
    misses: int = 0

    def __post_init__(self) -> None:
        self.value = self.start

    def instruction(self) -> str:
        op, n = self.ops[self.step_index]
        what = _OPS[op][0].format(n=n)
        return f"Step {self.step_index + 1} of {len(self.ops)}: {what}. Reply with the result."

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        op, n = self.ops[self.step_index]
        expected = _OPS[op][1](self.value, n)
        got = parse_number(action)
        done_right = self.step_index / len(self.ops)
        if got is None:
            self.misses += 1
            if self.misses >= 2:
                return "No number again: the episode ends.", done_right, True, {"result": "no-number"}
            return f"No number found in your reply. {self.instruction()}", 0.0, False, {"result": "no-number"}
        self.misses = 0
        if got != expected:
            info = {"result": "wrong", "expected": expected, "got": got}
            return f"Wrong: the result was {expected}. The episode ends.", done_right, True, info
        self.value = expected
        self.step_index += 1
        if self.step_index == len(self.ops):
            return f"Correct: {expected}. Done.", 1.0, True, {"result": "solved"}
        return f"Correct: {expected}. {self.instruction()}", 0.0, False, {"result": "right"}


def _int_field(task: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = task.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise server.TaskError(f"task.{key} must be an integer in {low}..{high}, got {value!r}")
    return value


class Arithmetic:
    """Multi-step arithmetic (see the module docstring)."""

    name = NAME

    def reset(
        self, seed: int, task: str | Mapping[str, Any] | None
    ) -> tuple[ArithmeticEpisode, str, dict[str, Any]]:
        if isinstance(task, str):
            if task not in PRESETS:
                raise server.TaskError(f"unknown task {task!r}; valid: {', '.join(PRESETS)}, or an object")
            task = PRESETS[task]
        task = task or {}
        unknown = sorted(set(task) - {"steps", "max_operand"})
        if unknown:
            raise server.TaskError(f"unknown task fields {unknown}; valid: steps, max_operand")
        steps = _int_field(task, "steps", DEFAULT_STEPS, 1, MAX_STEPS)
        high = _int_field(task, "max_operand", DEFAULT_MAX_OPERAND, 2, MAX_OPERAND)
        rng = random.Random(seed)
        ops = []
        for _ in range(steps):
            op = rng.choice("+-*")
            ops.append((op, rng.randint(2, min(high, MULTIPLIER_MAX)) if op == "*" else rng.randint(1, high)))
        episode = ArithmeticEpisode(start=rng.randint(1, high), ops=ops)
        observation = f"Start with {episode.start}. {episode.instruction()}"
        return episode, observation, {"steps": steps, "max_operand": high}


def main(argv: list[str] | None = None) -> int:
    return server.main(Arithmetic(), argv)


if __name__ == "__main__":
    raise SystemExit(main())

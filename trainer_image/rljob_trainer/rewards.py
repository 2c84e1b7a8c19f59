"""Verifiable rewards: final-answer extraction, math accuracy, format, user modules, and the registry.

Role: turn (prompt, response, reference answer) strings into scalar rewards. Pure string functions;
the only side effect is importing a user module named in the config. Callers:
`rljob_trainer.driver` (through `build_reward_fn`), tests.

A reward function has the signature `f(prompt: str, response: str, answer: str) -> float`.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rljob_trainer import config as config_mod

RewardFn = Callable[[str, str, str], float]

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_HASHES_RE = re.compile(r"####\s*(" + _NUMBER + r"|\S+)")
_NUMBER_RE = re.compile(_NUMBER)
_ONLY_NUMBER_RE = re.compile(r"^\s*" + _NUMBER + r"\s*$")


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}`, honouring nested braces; None when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def extract_final_answer(text: str) -> str | None:
    """The final answer of a response: after the last `####`, else the last `\\boxed{}`, else the last
    number. None when the text holds none of them."""
    hashes = _HASHES_RE.findall(text)
    if hashes:
        return hashes[-1].strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def normalize_answer(answer: str) -> str:
    """Canonical form for comparison: no `$`, commas or surrounding spaces; numbers as numbers
    (`7.0` == `7`, `1,000` == `1000`)."""
    a = answer.strip().strip("$").replace(",", "").strip()
    a = a.rstrip(".")
    try:
        value = float(a)
    except ValueError:
        return a
    if value.is_integer():
        return str(int(value))
    return repr(value)


def math_accuracy(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response's final answer equals the reference's final answer, else 0.0."""
    del prompt
    got = extract_final_answer(response)
    if got is None:
        return 0.0
    ref = extract_final_answer(answer)
    ref = answer if ref is None else ref
    return 1.0 if normalize_answer(got) == normalize_answer(ref) else 0.0


def format_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response states its answer in a recognised form: `#### <answer>`, a `\\boxed{}`, or
    the whole response is one number; else 0.0."""
    del prompt, answer
    if _HASHES_RE.search(response) or _last_boxed(response) is not None:
        return 1.0
    return 1.0 if _ONLY_NUMBER_RE.match(response) else 0.0


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "mathAccuracy": math_accuracy,
    "format": format_reward,
}


def get_reward_fn(name: str) -> RewardFn:
    """Look up a builtin reward by name; ValueError lists the valid names."""
    try:
        return REWARD_FUNCTIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown reward {name!r}; valid names: {', '.join(sorted(REWARD_FUNCTIONS))}, or 'module' "
            "with module and function"
        ) from None


def load_user_reward(module: str, function: str) -> RewardFn:
    """Import `module` and return its callable `function` (a user-supplied reward)."""
    mod = importlib.import_module(module)
    fn = getattr(mod, function, None)
    if not callable(fn):
        raise ValueError(f"reward module {module!r} has no callable {function!r}")
    return fn


@dataclass(frozen=True)
class WeightedReward:
    """The configured reward: Σ weight_i · f_i(prompt, response, answer)."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    fns: tuple[RewardFn, ...]

    def score(self, prompt: str, response: str, answer: str) -> tuple[float, dict[str, float]]:
        """(total, {name: unweighted component})."""
        parts = {n: float(f(prompt, response, answer)) for n, f in zip(self.names, self.fns, strict=True)}
        total = sum(w * parts[n] for n, w in zip(self.names, self.weights, strict=True))
        return total, parts


def build_reward_fn(settings: Sequence[config_mod.RewardFunctionSettings]) -> WeightedReward:
    """The weighted reward the config asks for."""
    names: list[str] = []
    fns: list[RewardFn] = []
    for s in settings:
        if s.name == "module":
            if not (s.module and s.function):
                raise ValueError("rewards[].module and rewards[].function are required for name 'module'")
            fns.append(load_user_reward(s.module, s.function))
            names.append(f"{s.module}:{s.function}")
        else:
            fns.append(get_reward_fn(s.name))
            names.append(s.name)
    return WeightedReward(tuple(names), tuple(s.weight for s in settings), tuple(fns))

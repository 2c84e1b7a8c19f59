"""Verifiable rewards: final-answer extraction, math accuracy, format, user modules, and the registry.

Role: turn (prompt, response, reference answer) strings into scalar rewards. Pure string functions;
the only side effect is loading a user module named in the config: `importPath` (a module in the
image) or `path` (a `.py` file, e.g. on a mounted ConfigMap or PVC). Callers:
`rljob_trainer.driver` (through `build_reward_fn`), tests.

One batch signature, the one the CRD documents and the driver calls (like TRL's reward functions):
`fn(prompts: list[str], completions: list[str], answers: list[str], **kwargs) -> list[float]`.
The builtins are written per sample (`math_accuracy(prompt, response, answer) -> float`) and lifted
to it by `batched`. A user function that raises, or returns the wrong number of values, fails the
step with `RewardError` naming the module, the function and the exception.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob_trainer import config as config_mod

RewardFn = Callable[[str, str, str], float]
BatchRewardFn = Callable[..., Sequence[float]]


class RewardError(RuntimeError):
    """A reward function failed: the message names the function, its module and the exception."""


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


def batched(fn: RewardFn) -> BatchRewardFn:
    """A per-sample reward as a batch reward function."""

    def batch(
        prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str], **kwargs: Any
    ) -> list[float]:
        del kwargs
        return [fn(p, c, a) for p, c, a in zip(prompts, completions, answers, strict=True)]

    batch.__name__ = getattr(fn, "__name__", "reward")
    return batch


def _reasoning_gym_scores(
    prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str], **kwargs: Any
) -> list[float]:
    from rljob_trainer.data import reasoning_gym  # imports reasoning-gym only for jobs that use it

    return reasoning_gym.score_batch(prompts, completions, answers, **kwargs)


# Builtins written for the whole batch (`reasoningGym`: the task's own score_answer, data.reasoning_gym).
BATCH_REWARD_FUNCTIONS: dict[str, BatchRewardFn] = {"reasoningGym": _reasoning_gym_scores}


def get_reward_fn(name: str) -> RewardFn:
    """Look up a builtin reward by name; ValueError lists the valid names."""
    try:
        return REWARD_FUNCTIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown reward {name!r}; valid names: "
            f"{', '.join(sorted([*REWARD_FUNCTIONS, *BATCH_REWARD_FUNCTIONS]))}, or 'module' "
            "with module and function"
        ) from None


def _load_module(*, import_path: str | None, path: str | None) -> Any:
    if import_path:
        return importlib.import_module(import_path)
    file = Path(str(path))
    if file.suffix != ".py" or not file.is_file():
        raise ValueError(f"reward module path {file} is not a .py file (is its volume mounted?)")
    name = f"rljob_user_reward_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"reward module path {file} cannot be loaded as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module


def load_user_reward(
    *, function: str, import_path: str | None = None, path: str | None = None
) -> BatchRewardFn:
    """The callable `function` of a user module: `import_path` (importable) or `path` (a .py file).
    It is called as `fn(prompts, completions, answers, **kwargs) -> list[float]`."""
    if bool(import_path) == bool(path):
        raise ValueError("a reward module needs exactly one of importPath or path")
    where = import_path or str(path)
    try:
        mod = _load_module(import_path=import_path, path=path)
    except ValueError:
        raise
    except Exception as e:
        raise RewardError(f"reward module {where}: loading failed: {type(e).__name__}: {e}") from e
    fn = getattr(mod, function, None)
    if not callable(fn):
        raise ValueError(f"reward module {where} has no callable {function!r}")
    return fn


@dataclass(frozen=True)
class WeightedReward:
    """The configured reward: Σ weight_i · fn_i(prompts, completions, answers)."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    fns: tuple[BatchRewardFn, ...]
    # Metric keys of the parts (`reward/<key>`): the builtin's name, or `<module or file stem>:<fn>`,
    # since trackers refuse a path as a metric name (a real MLflow server: "must not resolve to other
    # names"). Default: the names.
    keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.keys:
            object.__setattr__(self, "keys", self.names)

    def score_batch(
        self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str], **kwargs: Any
    ) -> tuple[list[float], dict[str, list[float]]]:
        """(totals, {name: unweighted values}) for a batch; `RewardError` names a failing function."""
        n = len(completions)
        parts: dict[str, list[float]] = {}
        for name, key, fn in zip(self.names, self.keys, self.fns, strict=True):
            try:
                values = [float(v) for v in fn(list(prompts), list(completions), list(answers), **kwargs)]
            except Exception as e:
                raise RewardError(f"reward {name} raised {type(e).__name__}: {e}") from e
            if len(values) != n or not all(math.isfinite(v) for v in values):
                raise RewardError(
                    f"reward {name} must return {n} finite floats (one per completion), got "
                    f"{len(values)}: {values[:4]}"
                )
            parts[key] = values
        totals = [
            sum(w * parts[key][i] for key, w in zip(self.keys, self.weights, strict=True)) for i in range(n)
        ]
        return totals, parts

    def score(self, prompt: str, response: str, answer: str) -> tuple[float, dict[str, float]]:
        """(total, {name: unweighted component}) of one sample."""
        totals, parts = self.score_batch([prompt], [response], [answer])
        return totals[0], {k: v[0] for k, v in parts.items()}


def build_reward_fn(settings: Sequence[config_mod.RewardFunctionSettings]) -> WeightedReward:
    """The weighted reward the config asks for."""
    names: list[str] = []
    keys: list[str] = []
    fns: list[BatchRewardFn] = []
    for s in settings:
        if s.name == "module":
            if not s.function:
                raise ValueError("rewards[].function is required for name 'module'")
            fns.append(load_user_reward(function=s.function, import_path=s.import_path, path=s.path))
            names.append(f"{s.import_path or s.path}:{s.function}")
            key = f"{Path(s.path).stem if s.path else s.import_path}:{s.function}"
            keys.append(key if key not in keys else f"{key}#{len(keys)}")
        elif s.name in BATCH_REWARD_FUNCTIONS:
            fns.append(BATCH_REWARD_FUNCTIONS[s.name])
            names.append(s.name)
            keys.append(s.name)
        else:
            fns.append(batched(get_reward_fn(s.name)))
            names.append(s.name)
            keys.append(s.name)
    return WeightedReward(tuple(names), tuple(s.weight for s in settings), tuple(fns), tuple(keys))

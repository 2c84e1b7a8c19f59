"""Prompt datasets and the deterministic, resumable prompt sampler.

Role: load (prompt, answer) examples from a dataset shipped with the package (`datasets/*.jsonl`,
written by hand for this project, nothing downloaded) or from a JSONL file on a volume, and hand
out prompt indices in a seeded order whose position is saved in checkpoints. Pure apart from
reading the file; randomness comes only from the seed passed in. Callers: `rljob_trainer.driver`,
tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from rljob_trainer import config as config_mod


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


def builtin_datasets() -> list[str]:
    """Names of the datasets shipped with the package."""
    root = resources.files("rljob_trainer") / "datasets"
    return sorted(p.name[: -len(".jsonl")] for p in root.iterdir() if p.name.endswith(".jsonl"))


def _read_jsonl(text: str, prompt_field: str, answer_field: str, source: str) -> list[Example]:
    out: list[Example] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        try:
            out.append(Example(prompt=str(row[prompt_field]), answer=str(row[answer_field])))
        except KeyError as e:
            raise ValueError(f"{source}:{lineno}: missing field {e.args[0]!r}") from None
    if not out:
        raise ValueError(f"{source}: no examples")
    return out


def load_examples(settings: config_mod.DataSettings) -> list[Example]:
    """The examples `settings` names (data.path wins over data.builtin)."""
    if settings.path:
        text = Path(settings.path).read_text()
        return _read_jsonl(text, settings.prompt_field, settings.answer_field, settings.path)
    names = builtin_datasets()
    if settings.builtin not in names:
        raise ValueError(f"unknown builtin dataset {settings.builtin!r}; valid names: {', '.join(names)}")
    text = (resources.files("rljob_trainer") / "datasets" / f"{settings.builtin}.jsonl").read_text()
    return _read_jsonl(text, "prompt", "answer", f"builtin:{settings.builtin}")


@dataclass(frozen=True)
class SamplerState:
    """Where the sampler is: `epoch` and `index` within that epoch's order."""

    epoch: int = 0
    index: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplerState:
        return cls(epoch=int(d["epoch"]), index=int(d["index"]))


def epoch_order(num_examples: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The example order of one epoch: a permutation seeded by (seed, epoch), or 0..n-1."""
    if not shuffle:
        return list(range(num_examples))
    rng = np.random.default_rng([seed, epoch])
    return [int(i) for i in rng.permutation(num_examples)]


def next_prompts(
    state: SamplerState, count: int, *, num_examples: int, seed: int, shuffle: bool
) -> tuple[list[int], SamplerState]:
    """`count` example indices from `state` on, and the state after them (crosses epochs as needed).

    Pure: the same (state, count, n, seed) always gives the same indices, so a job resumed from a
    saved state sees exactly the prompts the uninterrupted job would have seen.
    """
    if num_examples < 1:
        raise ValueError("num_examples must be >= 1")
    out: list[int] = []
    epoch, index = state.epoch, state.index
    order = epoch_order(num_examples, seed, epoch, shuffle)
    while len(out) < count:
        if index >= num_examples:
            epoch, index = epoch + 1, 0
            order = epoch_order(num_examples, seed, epoch, shuffle)
        take = min(count - len(out), num_examples - index)
        out.extend(order[index : index + take])
        index += take
    return out, SamplerState(epoch, index)

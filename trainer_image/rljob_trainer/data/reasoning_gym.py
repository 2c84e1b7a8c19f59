"""Tasks from reasoning-gym as prompts and rewards: a procedural task, its config, size and seed.

Role: `load_pairs` turns `data.reasoningGym` (a task name such as `chain_sum`, the task's own config
fields, a size and a seed) into (prompt, answer) pairs; `score_batch` is the reward `reasoningGym`:
the task's own `score_answer` on the answer extracted from each completion. reasoning-gym builds
item i of a dataset from `Random(seed + i)`, so the same settings always give the same items, and
the answer string each example carries is a reference (`encode_reference`: task, config, seed,
size, index, and the reference answer for people reading it) from which the scorer rebuilds the
exact entry `score_answer` wants (its metadata included; nothing but the settings travels).

Answer extraction (`extract_answer`), chosen per data source (`answerFormat`):
  - `answerTag` (default): what reasoning-gym's own system prompts ask for and its `extract_answer`
    reads: the text inside the last `<answer>...</answer>`; none -> no answer (reward 0).
  - `answerTagOrLastNumber`: the answer tag when there is one, else the completion's last number
    (for tasks whose answer is a number: chain_sum, basic_arithmetic, gsm_symbolic). A small chat
    model that was not trained on the tag format states the number in prose ("The answer is 42."):
    SmolLM2-135M-Instruct, asked by reasoning-gym's own system prompts, wrote no tag in 48 of 48
    chain_sum answers (docs/reasoning-gym.md), so `answerTag` alone scores it 0 and GRPO has nothing
    to learn from.
`score_answer` itself does the task's comparison (chain_sum: numbers equal up to sign, commas and
trailing zeros; partial credit where the task gives it).

Held out: the evaluation is the same task under another seed, and training leaves out every item
whose question the evaluation asks (`ReasoningGymSettings.held_out`, filled in by the trainer
config): procedural tasks with a small space repeat questions across seeds, and dropping them from
the evaluation instead would leave it only the rarer, harder questions (measured on chain_sum with
1-2 digits: 217 of 400 evaluation items were training questions, and the 183 left were mostly the
2-digit ones, 0.04 right where the task as a whole is about 0.3). Callers: `data.sources`
(loading), `data.rewards` (the reward), tests. reasoning-gym is imported only when a job uses it.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from rljob_trainer import config as config_mod

log = logging.getLogger("rljob_trainer.data.reasoning_gym")

# Marks an answer string as a reasoning-gym reference (the first key of its JSON object).
REFERENCE_KEY = "reasoningGym"
ANSWER_TAG_RE = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
# A number as the tasks write them: a sign, digits with optional thousands commas, a decimal part.
NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _task_settings(settings: config_mod.ReasoningGymSettings) -> dict[str, Any]:
    # What identifies the items (`held_out` only removes some: an item keeps its index).
    return {
        "task": settings.task,
        "config": dict(sorted(settings.config.items())),
        "seed": settings.seed,
        "size": settings.size,
        "answerFormat": settings.answer_format,
    }


@functools.lru_cache(maxsize=32)
def _dataset(task: str, config_json: str, seed: int, size: int) -> Any:
    import reasoning_gym

    names = sorted(reasoning_gym.factory.DATASETS)
    if task not in names:
        raise ValueError(
            f"data.reasoningGym.task {task!r} is not a reasoning-gym task; valid names: {', '.join(names)}"
        )
    config = json.loads(config_json)
    try:
        return reasoning_gym.create_dataset(task, seed=seed, size=size, **config)
    except (TypeError, AssertionError, ValueError) as e:
        _, config_cls = reasoning_gym.factory.DATASETS[task]
        fields = sorted(
            f for f in getattr(config_cls, "__dataclass_fields__", {}) if f not in ("seed", "size")
        )
        raise ValueError(
            f"data.reasoningGym.config {config} is not a valid {task} config ({type(e).__name__}: {e}); "
            f"its fields: {', '.join(fields)}"
        ) from None


def dataset(settings: config_mod.ReasoningGymSettings) -> Any:
    """The reasoning-gym dataset `settings` names (built once per process and settings)."""
    return _dataset(settings.task, json.dumps(settings.config, sort_keys=True), settings.seed, settings.size)


def encode_reference(settings: config_mod.ReasoningGymSettings, index: int, answer: str) -> str:
    """The answer string of item `index` (pure): what the scorer needs to rebuild the entry."""
    return json.dumps({REFERENCE_KEY: {**_task_settings(settings), "index": index}, "answer": answer})


def decode_reference(answer: str) -> tuple[config_mod.ReasoningGymSettings, int]:
    """(settings, index) of an answer string `encode_reference` wrote; ValueError for anything else."""
    try:
        ref = json.loads(answer)[REFERENCE_KEY]
        settings = config_mod.ReasoningGymSettings(
            task=ref["task"],
            config=ref["config"],
            seed=ref["seed"],
            size=ref["size"],
            answer_format=ref["answerFormat"],
        )
        return settings, int(ref["index"])
    except (ValueError, TypeError, KeyError):
        raise ValueError(
            "reward reasoningGym scores reasoning-gym prompts only: this answer is not a reasoning-gym "
            f"reference ({answer[:60]!r}); set spec.data.source.reasoningGym or use another reward"
        ) from None


def load_pairs(settings: config_mod.ReasoningGymSettings) -> list[tuple[str, str]]:
    """(question, answer reference) of every item, in index order, without the items whose question
    is one of `settings.held_out`'s (the job's held-out evaluation: never trained on)."""
    ds = dataset(settings)
    pairs = [(str(e["question"]), encode_reference(settings, i, str(e["answer"]))) for i, e in enumerate(ds)]
    if settings.held_out is None:
        return pairs
    h = settings.held_out
    held = _dataset(h.task, json.dumps(h.config, sort_keys=True), h.seed, h.size)
    kept, dropped = heldout_filter(pairs, {str(e["question"]) for e in held})
    if not kept:
        raise ValueError(
            f"data.reasoningGym: every one of the {len(pairs)} {settings.task} items asks a question of the "
            "held-out evaluation; make the task's space larger (its config) or the evaluation smaller"
        )
    log.info(
        "%s: %d of %d items ask a held-out question and are left out of training",
        settings.task,
        dropped,
        len(pairs),
    )
    return kept


def extract_answer(completion: str, answer_format: str) -> str | None:
    """The answer a completion states, as `answer_format` reads it (module docstring); None if none."""
    tagged = ANSWER_TAG_RE.findall(completion)
    if tagged:
        return tagged[-1].strip()
    if answer_format == "answerTag":
        return None
    numbers = NUMBER_RE.findall(completion)
    return numbers[-1] if numbers else None


def score_batch(
    prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str], **kwargs: Any
) -> list[float]:
    """The reward `reasoningGym`: each task's own `score_answer` on the extracted answer (0..1)."""
    del prompts, kwargs
    out: list[float] = []
    for completion, answer in zip(completions, answers, strict=True):
        settings, index = decode_reference(answer)
        ds = dataset(settings)
        got = extract_answer(completion, settings.answer_format)
        out.append(float(ds.score_answer(got, ds[index])))
    return out


def heldout_filter(
    eval_pairs: Sequence[tuple[str, str]], train_questions: set[str]
) -> tuple[list[tuple[str, str]], int]:
    """(the evaluation pairs whose question is not a training question, how many were dropped)."""
    kept = [p for p in eval_pairs if p[0] not in train_questions]
    return kept, len(eval_pairs) - len(kept)

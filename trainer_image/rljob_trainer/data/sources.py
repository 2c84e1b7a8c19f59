"""Prompt datasets and the deterministic, resumable prompt sampler.

Role: load (prompt, answer) examples from a dataset shipped with the package (`datasets/*.jsonl`,
written by hand for this project, nothing downloaded), from a reasoning-gym task
(`data.reasoning_gym`: generated offline, seeded), from files on a volume (a `.jsonl`, `.json`,
`.parquet` or `.arrow` file, a directory of them, or a `Dataset.save_to_disk` folder) or from the
Hugging Face Hub (id, subset, split; `HF_ENDPOINT` and the token from the environment), all through
the `datasets` library; encode prompts (optionally with the tokenizer's chat template); and hand
out prompt indices in a seeded order whose position is saved in checkpoints. Randomness comes only
from the seed passed in. Callers: `rljob_trainer.driver`, tests.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from rljob_trainer import config as config_mod

log = logging.getLogger("rljob_trainer.data.sources")


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


def builtin_datasets() -> list[str]:
    """Names of the datasets shipped with the package."""
    root = resources.files("rljob_trainer.data") / "builtin"
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


# `datasets` builder of each file suffix.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def _data_files(path: Path) -> tuple[str, list[str]]:
    """(builder, files) of a data file or a directory of data files (one format)."""
    if path.is_file():
        builder = FILE_BUILDERS.get(path.suffix)
        if builder is None:
            raise ValueError(
                f"data file {path}: unsupported suffix {path.suffix!r}; use {', '.join(FILE_BUILDERS)}"
            )
        return builder, [str(path)]
    if not path.is_dir():
        raise ValueError(f"data path {path} does not exist (is the volume mounted at that path?)")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in FILE_BUILDERS)
    builders = {FILE_BUILDERS[p.suffix] for p in files}
    if not files:
        raise ValueError(f"data directory {path} holds no {', '.join(FILE_BUILDERS)} files")
    if len(builders) > 1:
        raise ValueError(f"data directory {path} mixes formats {sorted(builders)}; keep one per directory")
    return builders.pop(), [str(p) for p in files]


def _is_saved_dataset(path: Path) -> bool:
    # `Dataset.save_to_disk` writes state.json + dataset_info.json; a DatasetDict writes dataset_dict.json.
    return path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists())


def _rows_from_path(path: Path, split: str) -> Any:
    import datasets

    if _is_saved_dataset(path):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"saved dataset {path} has splits {sorted(loaded)}, not {split!r}")
            return loaded[split]
        return loaded
    builder, files = _data_files(path)
    return datasets.load_dataset(builder, data_files=files, split="train")


def _rows_from_hub(settings: config_mod.DataSettings) -> Any:
    import datasets

    token = os.environ.get(settings.hub_token_env) if settings.hub_token_env else None
    # HF_ENDPOINT (a mirror or a private hub) is read by huggingface_hub from the environment.
    return datasets.load_dataset(
        settings.hub_id, settings.hub_subset, split=settings.hub_split, token=token or None
    )


def _examples_from_rows(rows: Any, prompt_field: str, answer_field: str, source: str) -> list[Example]:
    columns = set(rows.column_names)
    missing = [f for f in (prompt_field, answer_field) if f not in columns]
    if missing:
        raise ValueError(
            f"{source}: no field {missing[0]!r}; the records have {sorted(columns)} "
            "(set spec.data.promptField / answerField)"
        )
    out = [
        Example(prompt=str(p), answer=str(a))
        for p, a in zip(rows[prompt_field], rows[answer_field], strict=True)
    ]
    if not out:
        raise ValueError(f"{source}: no examples")
    return out


def load_examples(settings: config_mod.DataSettings) -> list[Example]:
    """The examples `settings` names (data.reasoningGym, then data.hubId, then data.path, win over
    data.builtin)."""
    if settings.reasoning_gym is not None:
        from rljob_trainer.data import reasoning_gym

        return [Example(prompt=p, answer=a) for p, a in reasoning_gym.load_pairs(settings.reasoning_gym)]
    if settings.hub_id:
        rows = _rows_from_hub(settings)
        return _examples_from_rows(
            rows, settings.prompt_field, settings.answer_field, f"hub:{settings.hub_id}"
        )
    if settings.path:
        rows = _rows_from_path(Path(settings.path), settings.hub_split)
        return _examples_from_rows(rows, settings.prompt_field, settings.answer_field, settings.path)
    names = builtin_datasets()
    if settings.builtin not in names:
        raise ValueError(f"unknown builtin dataset {settings.builtin!r}; valid names: {', '.join(names)}")
    text = (resources.files("rljob_trainer.data") / "builtin" / f"{settings.builtin}.jsonl").read_text()
    return _read_jsonl(text, "prompt", "answer", f"builtin:{settings.builtin}")


def encode_prompt(
    tokenizer: Any, text: str, *, chat_template: bool, system_prompt: str | None = None
) -> list[int]:
    """Token ids of a prompt: the raw text, or one user message (after `system_prompt` as a system
    message, when given) rendered by the tokenizer's chat template with the generation prompt
    appended (what a chat model was trained to answer)."""
    if not chat_template:
        return list(tokenizer.encode(text, add_special_tokens=False))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "data.chatTemplate is true but the tokenizer has no chat template; set it to false or use "
            "a model whose tokenizer_config.json has one"
        )
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    messages.append({"role": "user", "content": text})
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def encode_data_prompt(tokenizer: Any, text: str, settings: config_mod.DataSettings) -> list[int]:
    """`encode_prompt` as `settings` ask (chat template, system prompt)."""
    return encode_prompt(
        tokenizer, text, chat_template=settings.chat_template, system_prompt=settings.system_prompt
    )


def source_name(settings: config_mod.DataSettings) -> str:
    """How logs and errors name a data source."""
    if settings.reasoning_gym is not None:
        rg = settings.reasoning_gym
        return f"reasoning-gym:{rg.task}(seed={rg.seed}, size={rg.size})"
    return settings.path or settings.hub_id or f"builtin:{settings.builtin}"


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


def drop_overlong_prompts(
    examples: list[Example], prompt_tokens: list[int], *, max_prompt_tokens: int, source: str
) -> tuple[list[Example], list[int]]:
    """(the examples whose prompt fits `max_prompt_tokens`, the row indices of those that do not).

    A prompt is never cut: cutting from the left drops the chat template's header and the question's
    start, and the model trains on a prompt nobody wrote (verl's `filter_overlong_prompts` drops them
    too). Raises naming the first row when no prompt fits.
    """
    dropped = [i for i, n in enumerate(prompt_tokens) if n > max_prompt_tokens]
    if len(dropped) == len(examples):
        first = dropped[0]
        raise ValueError(
            f"{source}: every prompt is longer than lengths.maxPromptTokens ({max_prompt_tokens}): row "
            f"{first} has {prompt_tokens[first]} tokens; raise spec.lengths.maxPromptTokens"
        )
    skip = set(dropped)
    return [e for i, e in enumerate(examples) if i not in skip], dropped


def load_fitting_examples(
    settings: config_mod.DataSettings, tokenizer: Any, *, max_prompt_tokens: int
) -> tuple[list[Example], list[int]]:
    """`load_examples`, without the prompts longer than `max_prompt_tokens` (`drop_overlong_prompts`):
    (the examples kept, the row indices dropped; a warning names the first ones)."""
    examples = load_examples(settings)
    tokens = [len(encode_data_prompt(tokenizer, e.prompt, settings)) for e in examples]
    source = source_name(settings)
    kept, dropped = drop_overlong_prompts(
        examples, tokens, max_prompt_tokens=max_prompt_tokens, source=source
    )
    if dropped:
        log.warning(
            "%s: %d of %d prompts are longer than lengths.maxPromptTokens (%d) and are dropped (rows %s)",
            source,
            len(dropped),
            len(examples),
            max_prompt_tokens,
            dropped[:10],
        )
    return kept, dropped

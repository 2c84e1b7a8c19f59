"""Shipped model presets: real Hugging Face ``config.json`` files packaged as JSON data.

Role: let ``rljob plan`` and RLJob specs name a well-known model (``qwen3.5-4b``) instead of
shipping its config. Callers: the CLI, the operator (spec ``model.preset``), the benchmark.
The files are copies of ``tests/data/model_configs`` (public configs, no weights).
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from rljob_operator import errors

_PACKAGE = "rljob_operator.estimator"


def preset_names() -> tuple[str, ...]:
    """Sorted names of the shipped presets."""
    folder = resources.files(_PACKAGE).joinpath("presets")
    return tuple(sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json")))


def load_preset(name: str) -> dict[str, Any]:
    """The config dict of preset ``name`` (or a Hugging Face id such as ``Qwen/Qwen3.5-4B``).

    Raises ``EstimatorError`` (reason ``UnknownPreset``) listing the valid names.
    """
    names = preset_names()
    key = name.lower().rsplit("/", 1)[-1]  # Hugging Face ids work too: "Qwen/Qwen3-8B" -> "qwen3-8b"
    if key not in names:
        raise errors.UnknownPresetError(
            "preset",
            f"unknown preset {name!r}; valid: {', '.join(names)}",
        )
    text = resources.files(_PACKAGE).joinpath("presets", f"{key}.json").read_text(encoding="utf-8")
    config: dict[str, Any] = json.loads(text)
    return config

"""The rollout-engine interface every engine implements, and its value types.

Role: one contract between the GRPO driver and the engines (vLLM on accelerators, transformers on
CPU), so the driver's dispatch, sleep/wake and weight-sync code is engine-agnostic. Callers:
`rljob_trainer.driver`, `rljob_trainer.engines.*`, tests.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingSettings:
    """Sampling for one generate call. `seeds[i]` seeds request i, so a request's output depends only
    on (weights, prompt, seed), not on which engine or batch it landed in."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    seeds: tuple[int, ...] | None = None
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class GenerationOutput:
    """One finished request: sampled token ids and their log-probs under the sampling distribution."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" (a stop/eos token) or "length"
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineLoad:
    """What an engine reports about itself (its admission state lives in the driver's dispatcher)."""

    name: str
    sleeping: bool
    requests_served: int
    tokens_generated: int


class RolloutEngine(abc.ABC):
    """A generation engine that can be put to sleep (free accelerator memory) and re-weighted in place."""

    name: str

    @abc.abstractmethod
    def load(self) -> None:
        """Build the model and allocate what generation needs (idempotent)."""

    @abc.abstractmethod
    def generate(
        self, prompts_token_ids: Sequence[Sequence[int]], sampling: SamplingSettings
    ) -> list[GenerationOutput]:
        """Generate one completion per prompt (same order). Raises RuntimeError while sleeping."""

    @abc.abstractmethod
    def sleep(self) -> None:
        """Release accelerator memory (weights offloaded, KV cache dropped); generate() is refused."""

    @abc.abstractmethod
    def wake(self) -> None:
        """Undo `sleep`: weights back where they were, outputs identical to before the sleep."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, Any]] | dict[str, Any]) -> int:
        """Load new weights in place (no checkpoint written); returns the number of tensors loaded."""

    @abc.abstractmethod
    def load_report(self) -> EngineLoad:
        """Counters for logs and telemetry."""

    @property
    @abc.abstractmethod
    def is_sleeping(self) -> bool: ...

    @property
    @abc.abstractmethod
    def weights_version(self) -> int:
        """How many weight updates this engine has applied."""

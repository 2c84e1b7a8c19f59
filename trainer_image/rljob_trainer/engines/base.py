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
    """One finished request: sampled token ids, their log-probs under the distribution they were sampled
    from (after temperature and top-p: vLLM's `processed_logprobs`), and `meta["version"]`, the weights
    version that generated them."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" (a stop/eos token), "length", or "abort" (vLLM: paused or aborted)
    meta: dict[str, Any] = field(default_factory=dict)


# ---- vLLM's sleep and weight rules, one state machine for every engine ----------------------------
# vLLM (docs "Sleep Mode", RLHF examples): `sleep(level=1)` offloads weights to host memory and drops
# the KV cache; `sleep(level=2)` discards both (weights must be reloaded); `wake_up(tags=["weights"])`
# reallocates weights only, so an RL trainer can load new ones before `wake_up(tags=["kv_cache"])`;
# `sleep()` needs `enable_sleep_mode=True`; weights cannot be loaded while they are asleep.
# The release these rules are read from (the CUDA image's pin; tests/conformance/
# test_vllm_sleep_rules_mirror.py runs vLLM's executor logic against them): its executor's sleep tags
# are WAKE_TAGS; a second sleep is a no-op; a wake naming a tag that is awake wakes nothing; the engine
# is fully awake (and schedules requests) only once every tag is; level 2 discards parameters and
# keeps buffers; vLLM itself does not refuse a weight load into sleeping weights (it corrupts them),
# so the rules here refuse first.
MIRRORS_VLLM = "0.33.0"
WAKE_TAGS: tuple[str, ...] = ("weights", "kv_cache")


class EngineStateError(RuntimeError):
    """An engine call its current sleep state does not allow (vLLM refuses or corrupts it)."""


class EngineAsleepError(EngineStateError):
    """generate() or update_weights() on an engine whose weights or KV cache are asleep."""


class WeightsDiscardedError(EngineStateError):
    """generate() after a level-2 sleep before new weights were loaded (vLLM would emit garbage)."""


class SleepModeDisabledError(EngineStateError):
    """sleep() on an engine built without sleep mode (vLLM: enable_sleep_mode=False)."""


@dataclass
class SleepState:
    """What of an engine is awake, and whether its weights are real (the rules both engines obey)."""

    name: str
    sleep_enabled: bool
    awake: set[str] = field(default_factory=lambda: set(WAKE_TAGS))
    weights_valid: bool = True
    level: int = 0

    @property
    def fully_awake(self) -> bool:
        return self.awake == set(WAKE_TAGS)

    def check_generate(self) -> None:
        if not self.fully_awake:
            raise EngineAsleepError(
                f"engine {self.name} is asleep ({sorted(set(WAKE_TAGS) - self.awake)} not awake); "
                "wake() it before generate()"
            )
        if not self.weights_valid:
            raise WeightsDiscardedError(
                f"engine {self.name} slept at level 2 and its weights were discarded; "
                "update_weights() after wake(tags=['weights']) before generate()"
            )

    def check_update(self) -> None:
        if "weights" not in self.awake:
            raise EngineAsleepError(
                f"engine {self.name}: update_weights() while its weights are asleep (vLLM sleep level "
                f"{self.level}); call wake(tags=['weights']) first"
            )

    def on_sleep(self, level: int) -> None:
        if not self.sleep_enabled:
            raise SleepModeDisabledError(
                f"engine {self.name} was built without sleep mode (rollout.enableSleepMode false or a "
                "dedicated engine); sleep() is refused, as vLLM does"
            )
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self.awake = set()
        self.level = level
        if level == 2:
            self.weights_valid = False

    def on_wake(self, tags: Sequence[str] | None) -> set[str]:
        """The tags this call wakes (None: all); raises on an unknown tag."""
        want = set(WAKE_TAGS if tags is None else tags)
        unknown = want - set(WAKE_TAGS)
        if unknown:
            raise ValueError(f"unknown wake tags {sorted(unknown)}; valid: {', '.join(WAKE_TAGS)}")
        new = want - self.awake
        self.awake |= want
        if self.fully_awake:
            self.level = 0
        return new


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
    def sleep(self, level: int = 1) -> None:
        """Release accelerator memory: level 1 offloads weights to host memory, level 2 discards them;
        the KV cache is dropped. generate() and update_weights() are refused until wake().
        Raises `SleepModeDisabledError` on an engine built without sleep mode."""

    @abc.abstractmethod
    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Undo `sleep` for `tags` (`weights`, `kv_cache`; None: both). After level 1 the weights are
        back as they were; after level 2 they must be loaded with update_weights() before generate()."""

    @abc.abstractmethod
    def update_weights(
        self, named_tensors: Iterable[tuple[str, Any]] | dict[str, Any], version: int | None = None
    ) -> int:
        """Load new weights in place (no checkpoint written) and take `version` (default: +1); returns
        the number of tensors loaded. Raises `EngineAsleepError` while the weights are asleep."""

    @abc.abstractmethod
    def load_report(self) -> EngineLoad:
        """Counters for logs and telemetry."""

    def adapter_version(self) -> int | None:
        """Engines serving LoRA (rollout.engineLora): the weights version of the adapter they serve
        now, None when they serve none (never loaded, discarded, or lost across a sleep)."""
        return None

    @property
    @abc.abstractmethod
    def is_sleeping(self) -> bool: ...

    @property
    @abc.abstractmethod
    def weights_version(self) -> int:
        """How many weight updates this engine has applied."""

"""The rollout-engine interface every engine implements, and its value types.

Role: one contract between the GRPO driver and the engines (vLLM on accelerators, transformers on
CPU), so the driver's dispatch, sleep/wake and weight-sync code is engine-agnostic. Callers:
`rljob_trainer.driver`, `rljob_trainer.engines.*`, tests.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar


@dataclass(frozen=True)
class SamplingSettings:
    """Sampling for one generate call. `seeds[i]` seeds request i, so a request's output depends only
    on (weights, prompt, seed), not on which engine or batch it landed in."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    seeds: tuple[int, ...] | None = None
    stop_token_ids: tuple[int, ...] = ()
    # Per request (same order as the prompts): the tokens request i may still generate, for requests
    # resumed after an interrupt (`continue_output`); None: `max_tokens` for every request.
    max_tokens_per_request: tuple[int, ...] | None = None
    # Generate through the end-of-sequence token to the budget (vLLM's `ignore_eos`): for tests and
    # benches that need requests of a known length; never set by training.
    ignore_eos: bool = False

    def budget(self, i: int) -> int:
        """How many tokens request `i` of the call may generate."""
        return self.max_tokens if self.max_tokens_per_request is None else self.max_tokens_per_request[i]


@dataclass(frozen=True)
class GenerationOutput:
    """One request's output: sampled token ids, their log-probs under the distribution they were sampled
    from (after temperature and top-p: vLLM's `processed_logprobs`), and `meta["version"]`, the weights
    version that generated them (the oldest one for a resumed request). `token_versions[t]` is the
    weights version token t was sampled with (empty: every token has `meta["version"]`), so a request
    resumed across a weight sync keeps each token's own version and log-prob."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" (a stop/eos token), "length", or ABORTED (interrupted: not finished)
    meta: dict[str, Any] = field(default_factory=dict)
    token_versions: tuple[int, ...] = ()
    # Engine-seconds spent on this request (`TIMING_KEYS`: its share of its calls' prefill and
    # decode), where the engine measures them; not part of what the request generated.
    timing: dict[str, float] = field(default_factory=dict, compare=False)

    @property
    def versions(self) -> tuple[int, ...]:
        """The weights version of every token (one per token id)."""
        if self.token_versions:
            return self.token_versions
        return (int(self.meta.get("version", 0)),) * len(self.token_ids)

    @property
    def aborted(self) -> bool:
        return self.finish_reason == ABORTED


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


class EngineDiedError(RuntimeError):
    """The engine's own processes are gone (vLLM's EngineCore or a worker died): it cannot serve again.
    Runtimes count it among the errors that mean an engine is lost (`Runtime.lost_errors`), so the
    driver drops it, requeues its requests and replaces it (a dedicated engine's pod is reported lost,
    a shared engine is started again)."""


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
    #: Whether `interrupt`/`resume` are implemented (partial rollouts; both engine kinds do): an
    #: engine kind without them refuses the first interrupt, naming `rollout.partialRollouts`.
    supports_partial_rollouts: ClassVar[bool] = False

    def interrupt(self) -> None:
        """Stop every generate call in flight at its next token (each returns what it has, unfinished
        requests with finish_reason ABORTED) and pause: returns once none runs; generate() calls made
        while paused abort every request at once. Weights may be updated while paused. vLLM:
        `pause_generation(mode="abort")`."""
        raise PartialRolloutsUnsupportedError(
            f"engine {self.name} ({type(self).__name__}) does not implement partial rollouts; "
            "set rollout.partialRollouts to false"
        )

    def resume(self) -> None:
        """Undo `interrupt`: generate() serves requests again. vLLM: `resume_generation()`."""
        raise PartialRolloutsUnsupportedError(
            f"engine {self.name} ({type(self).__name__}) does not implement partial rollouts"
        )

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

    def shutdown(self) -> None:
        """Stop what the engine runs outside this process (vLLM: EngineCore and its workers) before
        its host goes away; in-process engines have nothing to stop."""
        return None

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


# ---- partial rollouts: interrupt, update, resume (vLLM's pause/resume API for async RL) -----------
# vLLM (docs "Async Reinforcement Learning"): `AsyncLLM.pause_generation(mode="abort")` aborts every
# request in flight, returns their partial results (finish_reason "abort") and pauses the scheduler
# until `resume_generation()`; weights are updated in between. A resumed request is submitted again
# as prompt + the tokens it already has (its KV recomputed under the new weights: clear_cache=True),
# with the rest of its token budget. Both engines obey `PauseState`: interrupt() returns only once no
# generate call runs any more; generate() while paused aborts every request before its first token
# (vLLM would hold it until resume; neither samples a token under weights about to change);
# update_weights() while a generate call runs is refused (`EngineBusyError`), never applied halfway.
ABORTED = "abort"  # vLLM's FinishReason.ABORT, as RequestOutput.finish_reason reports it
STOP_POLL_S = 0.05  # how often an interrupt stops what is still running (`PauseState.pause`)
# `GenerationOutput.timing` keys: the engine-seconds of prefill and decode spent on a request (its
# share of the call's), which a refit of the estimator's rates reads (SyncReport).
TIMING_KEYS: tuple[str, ...] = ("prefill_s", "decode_s")


class EngineBusyError(EngineStateError):
    """update_weights() while a generate call is running: interrupt() (pause) the engine first."""


class PartialRolloutsUnsupportedError(EngineStateError):
    """interrupt()/resume() on an engine kind that does not implement partial rollouts."""


@dataclass
class PauseState:
    """Whether an engine is paused and how many generate calls run in it (the rules of both engines)."""

    name: str
    paused: bool = False
    generating: int = 0
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)

    def begin_generate(self) -> bool:
        """A generate call starts; False when the engine is paused (the call aborts every request)."""
        with self._cond:
            if self.paused:
                return False
            self.generating += 1
            return True

    def end_generate(self) -> None:
        with self._cond:
            self.generating -= 1
            self._cond.notify_all()

    def run_generate(
        self,
        prompts_token_ids: Sequence[Sequence[int]],
        meta: dict[str, Any],
        generate: Callable[[], list[GenerationOutput]],
    ) -> list[GenerationOutput]:
        """One generate call under the pause rules: while paused every request aborts before its first
        token (`aborted_outputs`, with `meta`), nothing sampled under weights about to change; else
        `generate()`, counted as running until it returns."""
        if not self.begin_generate():
            return aborted_outputs(prompts_token_ids, meta)
        try:
            return generate()
        finally:
            self.end_generate()

    def should_stop(self) -> bool:
        """Checked between tokens: an interrupt asked the running calls to stop."""
        return self.paused

    def pause(self, timeout_s: float, stop_running: Callable[[], None] | None = None) -> None:
        """Pause and wait until no generate call runs (they stop at their next token).

        `stop_running` is for an engine whose calls do not check `should_stop` themselves (vLLM:
        abort what is in flight): called once the pause is set, so no new call starts, and again
        every `STOP_POLL_S` while calls still run, so a request submitted just as the pause began
        is stopped too."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self.paused = True
        while True:
            if stop_running is not None:
                stop_running()
            left_s = deadline - time.monotonic()
            with self._cond:
                wait_s = max(0.0, min(left_s, STOP_POLL_S) if stop_running is not None else left_s)
                if self._cond.wait_for(lambda: self.generating == 0, timeout=wait_s):
                    return
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"engine {self.name}: {self.generating} generate call(s) still running "
                    f"{timeout_s:.0f} s after interrupt()"
                )

    def resume(self) -> None:
        with self._cond:
            self.paused = False

    def check_update(self) -> None:
        with self._cond:
            if self.generating:
                raise EngineBusyError(
                    f"engine {self.name}: update_weights() while {self.generating} generate call(s) run; "
                    "interrupt() the engine (vLLM: pause_generation) before updating its weights"
                )


def aborted_outputs(
    prompts_token_ids: Sequence[Sequence[int]], meta: dict[str, Any]
) -> list[GenerationOutput]:
    """What a generate call made while paused returns: every request aborted before its first token."""
    return [GenerationOutput(tuple(p), (), (), ABORTED, dict(meta)) for p in prompts_token_ids]


def continue_output(prefix: GenerationOutput | None, rest: GenerationOutput) -> GenerationOutput:
    """One request's output so far: the tokens of earlier (interrupted) calls, then `rest`, produced by
    the call that resumed it with `prefix.token_ids` appended to its prompt. Each token keeps the
    version and log-prob it was sampled with; `meta["version"]` becomes the oldest version and
    `meta["interrupts"]` counts the interruptions."""
    if prefix is None:
        return rest
    n = len(prefix.prompt_token_ids)
    if tuple(rest.prompt_token_ids[:n]) != tuple(prefix.prompt_token_ids) or tuple(
        rest.prompt_token_ids[n:]
    ) != tuple(prefix.token_ids):
        raise ValueError("a resumed request's prompt must be its original prompt + the tokens it already has")
    versions = prefix.versions + rest.versions
    meta = {
        **rest.meta,
        "version": min(versions, default=int(rest.meta.get("version", 0))),
        "interrupts": int(prefix.meta.get("interrupts", 0)) + (1 if prefix.aborted else 0),
    }
    timing = {  # engine-seconds add up over the calls that served the request
        k: prefix.timing.get(k, 0.0) + rest.timing.get(k, 0.0)
        for k in TIMING_KEYS
        if k in prefix.timing or k in rest.timing
    }
    return replace(
        rest,
        prompt_token_ids=prefix.prompt_token_ids,
        token_ids=prefix.token_ids + rest.token_ids,
        logprobs=prefix.logprobs + rest.logprobs,
        meta=meta,
        token_versions=versions,
        timing=timing,
    )

"""Unit tests for rljob_trainer.rollout.pipeline: chunked dispatch and partial rollouts at a sync.

A scripted runtime stands in for Ray: each engine call advances by one token per `wait_any` poll,
`interrupt` makes the call in flight return what it has (finish_reason "abort") and pauses the
engine, and a call made while paused aborts every request before its first token, as
`engines.base.PauseState` and vLLM's pause_generation(mode="abort") do. The engines' own behaviour
is tested on the real CPU engine (tests/integration/test_engine_partial.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rljob_trainer import config
from rljob_trainer.data import sources
from rljob_trainer.engines import base
from rljob_trainer.model import modeling
from rljob_trainer.rollout import dispatcher, pipeline

CAP = 6


def _cfg(**rollout: Any) -> config.TrainerConfig:
    return config.parse_config(
        {
            "model": {
                "name": "t",
                "source": "tiny",
                "hfConfig": modeling.tiny_hf_config(32),
                "tokenizer": "builtin-digits",
            },
            "lengths": {"maxPromptTokens": 8, "maxResponseTokens": CAP},
            "grpo": {"groupSize": 2, "promptsPerStep": 4, "maxSteps": 5, "maxStaleness": 1},
            "rollout": {"kind": "transformers", "sharedEngines": 0, "dedicatedEngines": 1, **rollout},
        }
    )


@dataclass
class Call:
    prompts: list[list[int]]
    sampling: base.SamplingSettings
    version: int
    tokens: list[list[int]] = field(default_factory=list)
    done: bool = False
    aborted: bool = False

    def outputs(self) -> list[base.GenerationOutput]:
        outs = []
        for i, (p, t) in enumerate(zip(self.prompts, self.tokens, strict=True)):
            finished = len(t) >= self.sampling.budget(i)
            reason = "length" if finished else base.ABORTED
            lps = tuple(-1.0 - self.version for _ in t)  # the version's mark on every log-prob
            outs.append(base.GenerationOutput(tuple(p), tuple(t), lps, reason, {"version": self.version}))
        return outs


@dataclass
class Engine:
    version: int = 0
    paused: bool = False
    calls: list[Call] = field(default_factory=list)


class ScriptedRuntime:
    def __init__(self) -> None:
        self.futures: dict[int, tuple[Engine, Call]] = {}

    def submit(self, handle: Engine, method: str, *args: Any) -> int:
        assert method == "generate"
        prompts, sampling = args
        call = Call(prompts, sampling, handle.version, [[] for _ in prompts])
        if handle.paused:
            call.done = call.aborted = True  # aborted before its first token
        handle.calls.append(call)
        fut = len(self.futures)
        self.futures[fut] = (handle, call)
        return fut

    def submit_control(self, handle: Engine, method: str) -> str:
        if method == "interrupt":
            handle.paused = True
            for call in handle.calls:
                if not call.done:
                    call.done = call.aborted = True
        else:
            assert method == "resume"
            handle.paused = False
        return method

    def wait_any(self, futures: list[Any], timeout_s: float | None = None) -> list[Any]:
        del timeout_s
        out = []
        for fut in futures:
            if fut not in self.futures:
                continue
            engine, call = self.futures[fut]
            if not call.done:  # one more token for every unfinished request
                for i, t in enumerate(call.tokens):
                    if len(t) < call.sampling.budget(i):
                        t.append(10 + engine.version)
                call.done = all(len(t) >= call.sampling.budget(i) for i, t in enumerate(call.tokens))
            if call.done:
                out.append(fut)
        return out

    def get(self, fut: Any) -> Any:
        if isinstance(fut, str):
            return None
        return self.futures[fut][1].outputs()

    def lost_errors(self) -> tuple[type[BaseException], ...]:
        return ()


class Owner:
    weights_version = 0

    def drop_engine(self, name: str, *, lost: bool = False) -> None:
        raise AssertionError(f"no engine is lost here ({name})")

    def release_drained(self) -> None: ...
    def prepare_generation(self) -> None: ...
    def sleep_shared_engines(self) -> None: ...
    def reconcile_dedicated(self) -> None: ...


def _pipeline(cfg: config.TrainerConfig) -> tuple[pipeline.RolloutPipeline, Engine, ScriptedRuntime]:
    clock = iter(range(10**6)).__next__
    dispatch = dispatcher.Dispatcher(lambda: float(clock()))
    engine = Engine()
    engines = {"e": pipeline.EngineState("e", engine, colocated=False, pod_index=0)}
    dispatch.set_engine("e", awake=True, capacity=64)
    rt = ScriptedRuntime()
    pipe = pipeline.RolloutPipeline(
        cfg,
        rt,
        dispatch,
        engines,
        Owner(),
        examples=sources.load_examples(cfg.data),
        encode_prompt=lambda text: [1, 2, 3],
        clock=lambda: 0.0,
    )
    pipe.start_at(sources.SamplerState(), 1)
    pipe.fill()
    return pipe, engine, rt


def test_dedicated_engines_take_chunks_so_a_sync_waits_for_one_chunk() -> None:
    pipe, engine, _ = _pipeline(_cfg(chunkPromptGroups=1))
    pipe._admit(1)
    assert [len(c.prompts) for c in engine.calls] == [2]  # one prompt group, not the step's 8
    pipe.quiesce(["e"])  # a sync point: without partial rollouts it waits for the chunk in flight
    assert [c.done and not c.aborted for c in engine.calls] == [True]
    assert sum(o is not None for o in pipe.jobs[1].outputs) == 2  # the rest of the step stays queued


def test_without_chunks_a_call_holds_the_steps_share() -> None:
    pipe, engine, _ = _pipeline(_cfg())
    pipe._admit(1)
    assert [len(c.prompts) for c in engine.calls] == [8]


def test_partial_rollouts_interrupt_at_the_sync_and_resume_from_the_tokens_they_have() -> None:
    cfg = _cfg(chunkPromptGroups=2, partialRollouts=True)
    cfg = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"max_staleness": 2})})
    pipe, engine, rt = _pipeline(cfg)
    pipe.pump(lambda: pipe.jobs[2].complete, current=1)  # steps 1 and 2 generated: it runs ahead
    pipe.owner.weights_version = 1  # step 1 trained; the trainer takes step 2 next
    pipe._admit(2)
    ahead = engine.calls[-1]
    assert {pipe._request_of[r][0] for r in pipe.calls[len(rt.futures) - 1].ids} == {3}
    rt.wait_any([len(rt.futures) - 1])
    rt.wait_any([len(rt.futures) - 1])  # two tokens generated of each request's six
    interrupted = pipe.quiesce(["e"])
    assert interrupted == ["e"] and ahead.aborted and engine.paused
    assert all(o is None for o in pipe.jobs[3].outputs)  # nothing of step 3 is complete yet
    assert pipe.interrupted == 4
    engine.version = 1  # the weight sync
    pipe.resume_engines(interrupted)
    assert not engine.paused
    pipe.pump(lambda: pipe.jobs[3].complete, current=3)
    resumed = next(c for c in engine.calls if c.prompts[0] == [1, 2, 3, 10, 10])  # prompt + its 2 tokens
    assert resumed.sampling.max_tokens_per_request[:4] == (4, 4, 4, 4)
    outs = pipe.jobs[3].outputs
    interrupted_outs = [o for o in outs if o is not None and o.meta.get("interrupts")]
    assert len(interrupted_outs) == 4
    for o in interrupted_outs:
        assert o.token_ids == (10, 10, 11, 11, 11, 11)
        assert o.token_versions == (0, 0, 1, 1, 1, 1)
        assert o.logprobs == (-1.0, -1.0, -2.0, -2.0, -2.0, -2.0)  # each token's own log-prob
        assert o.prompt_token_ids == (1, 2, 3) and o.finish_reason == "length"
        assert o.meta["version"] == 0  # the oldest: what the staleness bound reads
    metrics = pipeline.rollout_step_metrics([o for o in outs if o is not None], trainer_version=2)
    assert metrics["rollout/partial_fraction"] == 0.5
    # Trained at version 2: 4 resumed requests have 2 tokens 2 behind and 4 tokens 1 behind; the 4
    # fresh ones (generated at version 1) 6 tokens 1 behind.
    assert metrics["rollout/staleness_tokens_mean"] == (4 * (2 * 2 + 4) + 4 * 6) / (8 * 6)
    assert metrics["rollout/staleness_tokens_max"] == 2.0


def test_a_call_of_the_next_steps_requests_is_waited_for_not_interrupted() -> None:
    pipe, engine, _ = _pipeline(_cfg(chunkPromptGroups=2, partialRollouts=True))
    pipe._admit(1)  # step 1's requests: the trainer takes step 1 next
    assert pipe.quiesce(["e"]) == [] and not engine.paused
    assert not engine.calls[0].aborted and pipe.interrupted == 0


def test_a_call_that_reaches_the_paused_engine_aborts_before_its_first_token_and_is_requeued() -> None:
    pipe, engine, rt = _pipeline(_cfg(chunkPromptGroups=1, partialRollouts=True))
    pipe.owner.weights_version = -1  # the call below runs ahead of the step the trainer takes next
    rt.submit_control(engine, "interrupt")  # paused before the call starts (a race the sync can hit)
    pipe._admit(1)
    pipe.quiesce(["e"])
    assert engine.calls[0].aborted and pipe.interrupted == 2
    assert all(o is None for o in pipe.jobs[1].outputs) and not pipe.jobs[1].partial  # nothing to resume from
    pipe.resume_engines(["e"])
    pipe.pump(lambda: pipe.jobs[1].complete, current=1)
    assert all(len(o.token_ids) == CAP and not o.meta.get("interrupts") for o in pipe.jobs[1].outputs)

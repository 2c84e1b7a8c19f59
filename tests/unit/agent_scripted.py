"""A scripted runtime and two engines for the agent pipeline's unit tests (`rollout.pipeline` with an
`AgentLoop`).

Each call generates, `TOKENS_PER_POLL` tokens per `wait_any` poll, the text `script(prompt text)`
asks for, ends it with EOS as an engine stops on it, or stops at the request's budget; every token
carries the engine's version and a log-prob that marks the engine and the token's place
(-(mark + 0.001 * position)). It obeys the engines' contract: the prompt as given, the per-request
budget, interrupt (`finish_reason` abort, paused until resume, a call while paused aborts before its
first token) and a lost engine (`EngineLost`, one of `lost_errors`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent_chat import char_tokenizer

from rljob_trainer import config
from rljob_trainer.data import sources
from rljob_trainer.engines import base
from rljob_trainer.rollout import agent_loop, dispatcher, pipeline, tools

TOK = char_tokenizer()
CALL = tools.format_tool_call(tools.ToolCall("calc", {"expression": "6*7"}))


TOKENS_PER_POLL = 8


class EngineLost(RuntimeError):
    pass


@dataclass
class Call:
    engine: Engine
    prompts: list[list[int]]
    sampling: base.SamplingSettings
    version: int
    targets: list[list[int]]
    tokens: list[list[int]] = field(default_factory=list)
    done: bool = False
    aborted: bool = False
    lost: bool = False

    def outputs(self) -> list[base.GenerationOutput]:
        if self.lost:
            raise EngineLost(f"engine {self.engine.name} died")
        outs = []
        for i, (p, t) in enumerate(zip(self.prompts, self.tokens, strict=True)):
            target = self.targets[i]
            if len(t) == len(target):
                reason = "stop" if target[-1] == TOK.eos_token_id else "length"
            else:
                reason = base.ABORTED
            start = len(p)
            lps = tuple(-(self.engine.mark + 0.001 * (start + k)) for k in range(len(t)))
            meta = {"engine": self.engine.name, "version": self.version}
            outs.append(base.GenerationOutput(tuple(p), tuple(t), lps, reason, meta))
        return outs


@dataclass
class Engine:
    name: str
    mark: float  # log-probs of this engine's tokens are -(mark + 0.001 * position)
    version: int = 0
    paused: bool = False
    lose_on_call: int | None = None  # the call number at which this engine dies
    calls: list[Call] = field(default_factory=list)


class ScriptedRuntime:
    def __init__(self, script: Callable[[str], str]) -> None:
        self.script = script
        self.futures: dict[int, Call] = {}
        self.submitted_while_tools_ran = 0
        self.pipe: pipeline.RolloutPipeline | None = None

    def submit(self, handle: Engine, method: str, *args: Any) -> int:
        assert method == "generate"
        prompts, sampling = args
        targets = []
        for i, p in enumerate(prompts):
            ids = [*TOK.encode(self.script(TOK.decode(p)), add_special_tokens=False), TOK.eos_token_id]
            targets.append(ids[: sampling.budget(i)])
        call = Call(handle, prompts, sampling, handle.version, targets, [[] for _ in prompts])
        if handle.paused:
            call.done = call.aborted = True
        if handle.lose_on_call is not None and len(handle.calls) == handle.lose_on_call:
            call.done = call.lost = True
        handle.calls.append(call)
        if self.pipe is not None and any(not f.done() for f in self.pipe.side):
            self.submitted_while_tools_ran += 1
        fut = len(self.futures)
        self.futures[fut] = call
        return fut

    def submit_control(self, handle: Engine, method: str) -> str:
        if method == "interrupt":
            handle.paused = True
            for call in handle.calls:
                if not call.done:
                    call.done = call.aborted = True
        else:
            handle.paused = False
        return method

    def wait_any(self, futures: list[Any], timeout_s: float | None = None) -> list[Any]:
        out = []
        for fut in futures:
            call = self.futures.get(fut)
            if call is None:
                continue
            if not call.done:
                for t, target in zip(call.tokens, call.targets, strict=True):
                    t.extend(target[len(t) : len(t) + TOKENS_PER_POLL])
                call.done = all(len(t) == len(g) for t, g in zip(call.tokens, call.targets, strict=True))
            if call.done:
                out.append(fut)
        if not out and timeout_s:
            time.sleep(min(timeout_s, 0.01))
        return out

    def get(self, fut: Any) -> Any:
        return None if isinstance(fut, str) else self.futures[fut].outputs()

    def lost_errors(self) -> tuple[type[BaseException], ...]:
        return (EngineLost,)


class Owner:
    weights_version = 0

    def __init__(self) -> None:
        self.pipe: pipeline.RolloutPipeline | None = None
        self.dropped: list[str] = []

    def drop_engine(self, name: str, *, lost: bool = False) -> None:
        assert self.pipe is not None
        self.dropped.append(name)
        del self.pipe.engines[name]
        self.pipe.dispatcher.remove_engine(name)
        self.pipe.forget_engine(name)

    def release_drained(self) -> None: ...
    def prepare_generation(self) -> None: ...
    def sleep_shared_engines(self) -> None: ...
    def reconcile_dedicated(self) -> None: ...


def make_pipeline(
    cfg: config.TrainerConfig, script: Callable[[str], str], *, endpoint: Any = None, **loop_kwargs: Any
):
    dispatch = dispatcher.Dispatcher(time.monotonic)
    a, b = Engine("a", mark=1.0), Engine("b", mark=2.0)
    engines = {
        e.name: pipeline.EngineState(e.name, e, colocated=False, pod_index=i) for i, e in enumerate((a, b))
    }
    for name in engines:
        dispatch.set_engine(name, awake=True, capacity=64)
    rt = ScriptedRuntime(script)
    owner = Owner()
    loop = agent_loop.AgentLoop(cfg, TOK, **loop_kwargs)
    pipe = pipeline.RolloutPipeline(
        cfg,
        rt,
        dispatch,
        engines,
        owner,
        examples=sources.load_examples(cfg.data),
        encode_prompt=loop.prompt_ids,
        clock=time.monotonic,
        agent_loop=loop,
        endpoint=endpoint,
    )
    owner.pipe = rt.pipe = pipe
    pipe.start_at(sources.SamplerState(), 1)
    pipe.fill()
    return pipe, (a, b), rt, loop

"""Multi-turn episodes in the rollout pipeline (rljob_trainer.rollout.pipeline with an AgentLoop).

A scripted runtime (agent_scripted) stands in for Ray and two engines: each call generates tokens
per `wait_any` poll, the text its prompt asks for (a calculator call on a first turn, an answer once
a tool result is in the prompt), ends it with EOS as an engine stops on it, or stops at the
request's budget; every token carries the engine's version and a log-prob that marks the engine and
the token's place. It obeys the engines' contract (the prompt as given, the per-request budget,
interrupt and lost-engine rules), so the pipeline's episode logic runs as it does on real engines
(those are in tests/integration/test_agent_*.py).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import pytest
from agent_chat import DEMONSTRATIONS
from agent_scripted import CALL, TOK, Engine, make_pipeline

from rljob_trainer import config
from rljob_trainer.data import sources
from rljob_trainer.model import modeling
from rljob_trainer.rollout import agent, agent_loop, tools


def _cfg(
    *, budget: int = 400, max_turns: int = 3, demonstrations: list[dict[str, str]] | None = None, **grpo: Any
) -> config.TrainerConfig:
    return config.parse_config(
        {
            "model": {
                "name": "t",
                "source": "tiny",
                "hfConfig": modeling.tiny_hf_config(len(TOK)),
                "tokenizer": "builtin-char",
            },
            "lengths": {"maxPromptTokens": 512, "maxResponseTokens": budget},
            "grpo": {"groupSize": 2, "promptsPerStep": 2, "maxSteps": 5, "maxStaleness": 1, **grpo},
            "rollout": {"kind": "transformers", "sharedEngines": 0, "dedicatedEngines": 2},
            "data": {"builtin": "toy-arithmetic", "chatTemplate": True},
            "agent": {
                "maxTurns": max_turns,
                "tools": [{"name": "calc", "kind": "calculator", "description": "Arithmetic."}],
                "demonstrations": demonstrations or [],
            },
        }
    )


def test_every_prompt_carries_the_demonstrations_and_they_count_against_max_prompt_tokens() -> None:
    plain = agent_loop.AgentLoop(_cfg(), TOK)
    shown = agent_loop.AgentLoop(_cfg(demonstrations=DEMONSTRATIONS), TOK)
    try:
        text = TOK.decode(shown.prompt_ids("6*7="))
        assert "23+58" not in TOK.decode(plain.prompt_ids("6*7="))
        assert text.index("What is 23+58?") < text.index('"23+58"') < text.index("81") < text.index("6*7=")
        # A task that fits alone but not after the demonstrations is dropped, never cut.
        extra = len(shown.prompt_ids("6*7=")) - len(plain.prompt_ids("6*7="))
        task = "1+" * ((512 - len(plain.prompt_ids("")) - extra // 2) // 2) + "1="
        assert len(plain.prompt_ids(task)) <= 512 < len(shown.prompt_ids(task))
        examples = [sources.Example("6*7=", "42"), sources.Example(task, "0")]
        assert plain.fitting_examples(examples, "data")[0] == examples
        assert shown.fitting_examples(examples, "data")[0] == examples[:1]
    finally:
        plain.close()
        shown.close()


def script(prompt_text: str) -> str:
    """What the scripted model writes: a calculator call until a tool result is in its context."""
    return "The answer is 42." if "tool: " in prompt_text else CALL


def _pipeline(cfg: config.TrainerConfig, **loop_kwargs: Any):
    return make_pipeline(cfg, script, **loop_kwargs)


def _turn_prompts(engine: Engine) -> list[str]:
    return [TOK.decode(p) for c in engine.calls for p in c.prompts]


def test_episodes_call_the_tool_answer_and_keep_every_engine_token() -> None:
    pipe, (a, b), _, loop = _pipeline(_cfg())
    job = pipe.wait_for_batch(1)
    assert job.complete
    for out in job.outputs:
        assert isinstance(out, agent.AgentOutput)
        assert out.turns == 2 and out.tool_calls == 1 and out.tool_errors == 0
        assert out.finish_reason == agent.FINISH_ANSWERED
        text = TOK.decode(out.token_ids)
        assert text.startswith(CALL) and "\ntool: 42\nassistant: The answer is 42." in text
        # The loss trains the engine's own tokens: each turn's ids and log-probs as generated.
        gen = [t for t, m in zip(out.token_ids, out.loss_mask, strict=True) if m]
        assert TOK.decode(gen) == CALL + TOK.eos_token + "The answer is 42." + TOK.eos_token
        engine = a if out.meta["engine"] == "a" else b
        start = len(out.prompt_token_ids)
        for k, (lp, m) in enumerate(zip(out.logprobs, out.loss_mask, strict=True)):
            assert lp == (pytest.approx(-(engine.mark + 0.001 * (start + k))) if m else 0.0)
        assert sum(1 - m for m in out.loss_mask) == len("\ntool: 42\nassistant: ")
        assert agent.completion_text(out, TOK.decode) == CALL + "\nThe answer is 42."
    metrics = agent.agent_step_metrics(job.outputs)
    assert metrics["agent/turns_mean"] == 2 and metrics["agent/finish/stop"] == 1.0
    assert 0.0 <= metrics["agent/tool_time_share"] < 1.0
    loop.close()


def test_every_later_turn_goes_to_the_engine_of_the_first() -> None:
    pipe, (a, b), _, loop = _pipeline(_cfg())
    pipe.pump(lambda: pipe.jobs[1].complete and pipe.jobs[2].complete, current=1)
    for engine in (a, b):
        firsts = [p for p in _turn_prompts(engine) if "tool: " not in p]
        seconds = [p for p in _turn_prompts(engine) if "tool: " in p]
        # Each episode it began came back to it for its next turn, and only those did.
        began = Counter(p.split("tool: ")[0].removesuffix(CALL + TOK.eos_token + "\n") for p in seconds)
        assert firsts and began == Counter(firsts)
    loop.close()


def test_an_episode_whose_engine_is_lost_continues_on_the_other_from_its_tokens() -> None:
    pipe, (a, _b), _, loop = _pipeline(_cfg())
    a.lose_on_call = 1  # a serves the first turns, then dies on the call of its episodes' next turns
    job = pipe.wait_for_batch(1)
    assert pipe.owner.dropped == ["a"]
    moved = [
        o for o in job.outputs if TOK.decode(o.token_ids).count("tool: 42") == 1 and o.meta["engine"] == "b"
    ]
    assert len(moved) == 4  # every episode finished on b, the ones a began among them
    began_on_a = [
        o
        for o in moved
        if any(lp == pytest.approx(-(1.0 + 0.001 * len(o.prompt_token_ids))) for lp in o.logprobs[:1])
    ]
    assert began_on_a  # their first turn's tokens are a's, kept as a generated them
    loop.close()


def test_tools_run_beside_the_engines_and_a_slow_one_delays_only_its_episode() -> None:
    pipe, (_a, _b), rt, loop = _pipeline(_cfg())
    run, count, lock = loop.toolbox.run, [0], threading.Lock()
    running, most = [0], [0]

    def timed(call: tools.ToolCall) -> tools.ToolResult:  # every other tool call takes 0.4 s
        with lock:
            count[0] += 1
            slow = count[0] % 2 == 0
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.4 if slow else 0.01)
        with lock:
            running[0] -= 1
        return run(call)

    loop.toolbox.run = timed  # type: ignore[method-assign]
    job = pipe.wait_for_batch(1)
    assert job.complete and all(o.turns == 2 for o in job.outputs)
    # The fast episodes' next turns were dispatched while the slow tools still ran, and the calls
    # ran at once on the loop's threads, not one after another.
    assert rt.submitted_while_tools_ran >= 1
    assert most[0] >= 2
    waits = sorted(o.wait_s for o in job.outputs)
    assert waits[0] < 0.3 < waits[-1]
    loop.close()


def test_the_budget_and_the_turn_limit_end_episodes() -> None:
    pipe, _, _, loop = _pipeline(_cfg(max_turns=1))
    job = pipe.wait_for_batch(1)
    assert {o.finish_reason for o in job.outputs} == {agent.FINISH_MAX_TURNS}
    assert all(o.turns == 1 and o.tool_calls == 0 for o in job.outputs)
    loop.close()
    pipe, _, _, loop = _pipeline(_cfg(budget=len(CALL) + 10))
    job = pipe.wait_for_batch(1)
    # The tool result and the next turn's header do not fit with a token to spare: it ends there.
    assert {o.finish_reason for o in job.outputs} == {agent.FINISH_LENGTH}
    assert all(len(o.token_ids) <= len(CALL) + 10 for o in job.outputs)
    loop.close()


def test_a_turn_interrupted_at_a_sync_resumes_and_keeps_each_tokens_version() -> None:
    cfg = _cfg(maxStaleness=2)
    cfg.rollout.partial_rollouts = True
    pipe, (a, b), rt, loop = _pipeline(cfg)
    pipe.pump(lambda: pipe.jobs[2].complete, current=1)  # steps 1 and 2
    pipe.owner.weights_version = 1
    pipe.fill()  # step 3 may start: it runs ahead of the step the trainer takes next
    pipe._admit(2)
    futs = list(pipe.calls)
    assert any(pipe._request_of[r][0] == 3 for f in futs for r in pipe.calls[f].ids)
    rt.wait_any(futs)  # one more token of each turn in flight, then the sync point
    interrupted = pipe.quiesce(["a", "b"])
    assert set(interrupted) == {"a", "b"} and pipe.interrupted > 0
    a.version = b.version = 1
    pipe.resume_engines(interrupted)
    pipe.pump(lambda: pipe.jobs[3].complete, current=3)
    resumed = [o for o in pipe.jobs[3].outputs if o.meta.get("interrupts")]
    assert resumed
    for o in resumed:
        gen = [v for v, m in zip(o.token_versions, o.loss_mask, strict=True) if m]
        assert gen == sorted(gen) and gen[0] == 0 and gen[-1] == 1  # each token its own version
        switch, first_turn = gen.index(1), len(TOK.encode(CALL, add_special_tokens=False)) + 1
        assert switch not in (0, first_turn)  # the sync fell inside a turn, which went on after it
        assert o.meta["version"] == 0  # the oldest: what the staleness bound reads
        assert TOK.decode(o.token_ids).startswith(CALL + TOK.eos_token)  # one call, across the sync
        assert o.turns == 2
    loop.close()


def test_evaluation_episodes_run_in_calls_of_their_own_at_their_sampling() -> None:
    pipe, (a, b), _, loop = _pipeline(_cfg())  # steps 1 and 2 are queued, nothing dispatched yet
    prompt = loop.prompt_ids("What is 2+2?")
    outs = pipe.run_episodes([prompt] * 3, [7, 8, 9], temperature=0.0, top_p=0.5)
    assert len(outs) == 3 and all(o.turns == 2 and o.tool_calls == 1 for o in outs)
    eval_calls = [c for e in (a, b) for c in e.calls if c.sampling.temperature == 0.0]
    assert eval_calls and all(c.sampling.top_p == 0.5 for c in eval_calls)
    for call in eval_calls:  # nothing of the training steps rode along at the evaluation's sampling
        assert all(TOK.decode(p).startswith(TOK.decode(prompt)) for p in call.prompts)
    assert all(c.sampling.temperature == 1.0 for e in (a, b) for c in e.calls if c not in eval_calls)
    assert not any(k < 0 for k in pipe.jobs)  # the evaluation's job is gone, the steps' remain
    assert pipe.wait_for_batch(1).complete
    loop.close()


def test_dynamic_samplings_refill_rounds_are_episodes_too() -> None:
    pipe, _, _, loop = _pipeline(_cfg())
    job = pipe.extra_job(1, 2, round_index=1)  # two more prompts for step 1, generated now
    assert job.complete and len(job.outputs) == 4
    assert all(isinstance(o, agent.AgentOutput) and o.turns == 2 for o in job.outputs)
    assert not any(k < 0 for k in pipe.jobs)  # its job was handed over, none left behind
    loop.close()


def test_an_episode_beyond_the_staleness_bound_starts_over() -> None:
    pipe, (a, b), _, loop = _pipeline(_cfg(maxStaleness=1))
    pipe.owner.weights_version = 1
    pipe.fill()  # step 3 may start now: it is generated by engines still at version 0
    pipe.pump(lambda: pipe.jobs[3].complete, current=3)
    pipe.owner.weights_version = 2  # step 3 trains on version 2: version-0 episodes are 2 behind
    a.version = b.version = 2
    job = pipe.wait_for_batch(3)
    assert pipe.regenerated == 4
    assert all(o.meta["version"] == 2 and o.turns == 2 for o in job.outputs)  # every turn again
    assert all(set(o.generated_versions) == {2} for o in job.outputs)
    loop.close()

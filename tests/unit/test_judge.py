"""The judge's pure parts (rljob_trainer.data.judge) and how it schedules batches: spread over the
engines at once, a batch that times out or fails tried once more on another engine, what is left
unscored named and counted, and a step the judge scores none of failed with the cause."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from agent_chat import char_tokenizer

from rljob_trainer import config
from rljob_trainer.data import judge
from rljob_trainer.engines import base
from rljob_trainer.model import modeling

TOK = char_tokenizer()


def test_the_prompt_fills_only_its_placeholders() -> None:
    text = judge.render_prompt(
        'Score {response} against {answer} (of {max_score}); JSON {"keep": {braces}} {prompt}',
        prompt="Q",
        response="R has {answer} in it",
        answer="A",
        max_score=10,
    )
    assert text == 'Score R has {answer} in it against A (of 10); JSON {"keep": {braces}} Q'
    assert "{max_score}" not in judge.render_prompt(None, prompt="p", response="r", answer="a", max_score=5)


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("8", 0.8),
        ("Grade: 7/10. Final: 9", 0.9),
        ("10", 1.0),
        ("0", 0.0),
        ("4.5", 0.45),
        ("none", None),
        ("11", None),
        ("-1", None),
    ],
)
def test_a_score_is_the_last_number_within_range(text: str, score: float | None) -> None:
    assert judge.parse_score(text, 10.0) == (pytest.approx(score) if score is not None else None)


def _cfg(**j: Any) -> config.TrainerConfig:
    model = {
        "name": "t",
        "source": "tiny",
        "hfConfig": modeling.tiny_hf_config(len(TOK)),
        "tokenizer": "builtin-char",
    }
    return config.parse_config(
        {
            "model": model,
            "lengths": {"maxPromptTokens": 16, "maxResponseTokens": 8},
            "rollout": {"kind": "vllm", "maxNumSeqs": 256, "cpuKvCacheBytes": 1 << 30},
            "judge": {
                "model": {**model, "name": "judge"},
                "maxTokens": 4,
                "maxModelLen": 1024,
                "batchSize": 3,
                **j,
            },
        }
    )


def test_the_judge_engine_is_built_from_the_judge_settings() -> None:
    cfg = _cfg(engines=2, maxNumSeqs=8, cpuKvCacheBytes=2 << 20, tensorParallel=2)
    jc = judge.judge_engine_config(cfg)
    assert jc.model.name == "judge" and jc.rollout.kind == "vllm"
    assert (jc.lengths.max_prompt_tokens, jc.lengths.max_response_tokens) == (1020, 4)
    assert (jc.rollout.max_num_seqs, jc.rollout.cpu_kv_cache_bytes, jc.rollout.tensor_parallel) == (
        8,
        2 << 20,
        2,
    )
    assert jc.judge is None and jc.agent is None
    # A reward model answers with one score position, not maxTokens of text.
    rm = judge.judge_engine_config(_cfg(kind="rewardModel"))
    assert (rm.lengths.max_prompt_tokens, rm.lengths.max_response_tokens) == (1023, 1)
    assert judge.batches(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]


# ---- scheduling, with a runtime whose engines answer, fail or never answer ---------------------------
@dataclass
class Engine:
    name: str
    mode: str = "answer"  # answer, fail, hang
    calls: list[int] = field(default_factory=list)


class Runtime:
    def __init__(self, modes: dict[int, str]) -> None:
        self.modes = modes
        self.futures: dict[int, tuple[Engine, list[list[int]]]] = {}
        self.now = 0.0
        self.kinds: list[str] = []
        self.methods: list[str] = []

    def create_judge(self, index: int, cfg: Any, kind: str) -> Engine:
        self.kinds.append(kind)
        return Engine(f"judge-{index}", self.modes.get(index, "answer"))

    def submit(self, handle: Engine, method: str, *args: Any) -> int:
        fut = len(self.futures)
        self.methods.append(method)
        self.futures[fut] = (handle, list(args[0]) if method in ("generate", "score") else [])
        if method in ("generate", "score"):
            handle.calls.append(len(args[0]))
        return fut

    def wait_any(self, futures: list[int], timeout_s: float | None = None) -> list[int]:
        done = [f for f in futures if self.futures[f][0].mode != "hang"]
        if not done:
            self.now += timeout_s or 0.0  # nothing answers: the wait runs out
        return done

    def get(self, fut: int) -> Any:
        engine, prompts = self.futures[fut]
        if engine.mode == "fail" and prompts:
            raise RuntimeError(f"{engine.name} broke")
        if not prompts:
            return None
        if self.methods[fut] == "score":  # a reward model: one float per sequence, its length here
            return [float(len(p)) for p in prompts]
        # The judge "answers" each prompt with its length mod 11: a number in [0, 10].
        return [
            base.GenerationOutput(tuple(p), tuple(TOK.encode(str(len(p) % 11))), (), "stop") for p in prompts
        ]

    def kill(self, handle: Engine) -> None:
        pass


def _judge(modes: dict[int, str], engines: int, **j: Any) -> tuple[judge.Judge, Runtime]:
    rt = Runtime(modes)
    out = judge.Judge(_cfg(engines=engines, timeoutS=5.0, **j), rt, tokenizer=TOK, clock=lambda: rt.now)
    out.start()
    return out, rt


def test_a_reward_model_scores_the_conversation_with_its_raw_score() -> None:
    j, rt = _judge({0: "hang"}, engines=2, kind="rewardModel")
    assert rt.kinds == ["reward_model", "reward_model"]  # its engines are reward models, not LLMs
    out = j.score(["What is 2+3?", "q"], ["5", "r"], ["5", "a"])
    # The user's turn and the assistant's, in the judge's chat template; no template of its own, no
    # reference answer.
    ids = judge.conversation_ids(TOK, "What is 2+3?", "5")
    assert TOK.decode(ids) == "user: What is 2+3?\nassistant: 5\n"
    assert out.scores == [float(len(ids)), float(len(judge.conversation_ids(TOK, "q", "r")))]
    assert "score" in rt.methods and "generate" not in rt.methods
    assert rt.now >= 5.0  # judge-0 hung: its batch timed out and judge-1 scored it, as for an llm
    assert out.metrics["judge/unparsed"] == 0 and out.metrics["judge/scored"] == 2


def test_a_reward_model_without_a_chat_template_is_refused_before_any_engine() -> None:
    plain = char_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match=r"judge\.model's tokenizer has no chat template"):
        judge.Judge(_cfg(kind="rewardModel"), Runtime({}), tokenizer=plain)


def test_batches_spread_over_the_engines_and_every_response_is_scored() -> None:
    j, _ = _judge({}, engines=2)
    out = j.score(["q"] * 7, [f"r{i}" for i in range(7)], ["a"] * 7)
    assert all(s is not None and 0 <= s <= 1 for s in out.scores)
    # Batches of 3: two at once on the two engines, the third on the first free one.
    assert [j.engines[n].calls for n in sorted(j.engines)] == [[3, 1], [3]]
    assert out.metrics["judge/scored"] == 7 and out.metrics["judge/failed"] == 0


def test_a_batch_that_times_out_is_scored_on_another_engine() -> None:
    j, rt = _judge({0: "hang"}, engines=2)
    out = j.score(["q"] * 4, ["r"] * 4, ["a"] * 4)
    assert all(s is not None for s in out.scores)  # judge-1 took judge-0's batch too
    assert rt.now >= 5.0  # the hung batch waited its timeoutS before it moved


def test_what_no_engine_scores_is_left_unscored_and_named() -> None:
    j, _ = _judge({0: "fail"}, engines=1)
    with pytest.raises(judge.JudgeError, match="judge-0: RuntimeError: judge-0 broke"):
        j.score(["q"] * 4, ["r"] * 4, ["a"] * 4)


def test_a_prompt_over_the_judges_context_is_unscored_and_counted() -> None:
    j, _ = _judge({}, engines=1)
    out = j.score(["q", "q" * 2000], ["r", "r"], ["a", "a"])
    assert out.scores[0] is not None and out.scores[1] is None
    assert out.metrics["judge/too_long"] == 1 and out.metrics["judge/failed"] == 1


def test_judge_pods_join_ray_advertising_their_marker() -> None:
    from rljob_trainer import __main__ as entry

    env = {
        config.ENV_RAY_HEAD: "job-trainer-0.job.ns.svc",
        config.ENV_NUM_ACCELERATORS: "2",
        config.ENV_RAY_ACCELERATOR: "GPU",
    }
    cmd = entry.ray_worker_command(env, config.ROLE_JUDGE, 1, "ray")
    assert cmd[:3] == ["ray", "start", "--address=job-trainer-0.job.ns.svc:6379"]
    assert "--num-gpus=2" in cmd and '--resources={"rljob_judge_1": 1}' in cmd
    assert config.ROLE_JUDGE in config.ROLES

"""Rewards from a served judge model (`spec.reward.judge`, trainer config `judge`).

Role: a judge model on engines of its own, scoring each step's responses in batches. Two kinds:
- `llm`: a generative judge asked with `promptTemplate`; its engines are built like rollout engines
  (the job's `rollout.kind`: vLLM, or the transformers engine);
- `rewardModel`: a sequence-classification model that scores the prompt and the response as one
  conversation of its chat template (the user's turn, then the assistant's); its engines are
  `engines.reward_model`'s (vLLM's pooling runner, or transformers), and the reward is the score head's
  raw logit.
Both are built from `JudgeSettings` (`judge_engine_config`: the judge's model, its geometry, its
lengths), and live where the runtime puts them: Ray actors on the judge pods (`rljob_judge_<k>`,
ROLE_JUDGE) in a cluster, in-process in local mode. They never take weights: the judge is frozen.

Per step `Judge.score(prompts, responses, answers)` renders each response into the judge's input
(llm: `promptTemplate` with {prompt}, {response}, {answer} filled in, its chat template around it when
it has one; rewardModel: `conversation_ids`), sends `batchSize` of them per call (llm: a greedy
generate of `maxTokens`; rewardModel: a score), batches spread over the engines at once, each
batch bounded by `timeoutS`; a batch that fails or times out is tried once more on another engine,
then its responses are left unscored (None: the driver gives such a sample an advantage of 0,
`rollout.agent.advantage_groups`), and the failures are named in the log and counted (`judge/failed`);
an llm's score is the last number of its answer in [0, maxScore], scaled to [0, 1] (`parse_score`;
none or out of range: `judge/unparsed`, scored 0). Every response unscored
fails the step (`JudgeError`, naming the cause). Pure parts: `judge_engine_config`, `render_prompt`,
`parse_score`, `conversation_ids`, `batches`. Callers: `rljob_trainer.driver`, tests.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rljob_trainer import config as config_mod
from rljob_trainer.data import sources
from rljob_trainer.engines import base

log = logging.getLogger("rljob_trainer.data.judge")

DEFAULT_TEMPLATE = (
    "Grade the response to the task from 0 (wrong) to {max_score} (right).\n"
    "Task: {prompt}\nReference answer: {answer}\nResponse: {response}\n"
    "Reply with the grade, a number, only."
)
# The judge's prompt budget when `maxModelLen` is not set: the estimator's plan renders it.
DEFAULT_MAX_MODEL_LEN = 2048
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class JudgeError(RuntimeError):
    """The judge could not score a step (every batch failed): the message names why."""


def judge_engine_config(cfg: config_mod.TrainerConfig) -> config_mod.TrainerConfig:
    """The config a judge engine is built from: the job's, with the judge's model, its engine
    geometry and its lengths (prompt = maxModelLen - the answer, response = the answer: maxTokens for
    an llm, the one score position for a rewardModel). Pure."""
    j = cfg.judge
    if j is None:
        raise ValueError("the job has no judge")
    answer = j.max_tokens if j.kind == "llm" else 1
    max_len = j.max_model_len or DEFAULT_MAX_MODEL_LEN
    if max_len <= answer:
        raise ValueError(f"judge.maxModelLen ({max_len}) must exceed judge.maxTokens ({answer})")
    data = cfg.model_dump()
    data["model"] = j.model.model_dump()
    data["lengths"] = {"max_prompt_tokens": max_len - answer, "max_response_tokens": answer}
    data["rollout"].update(
        shared_engines=0,
        dedicated_engines=1,
        tensor_parallel=j.tensor_parallel,
        gpu_memory_utilization=j.gpu_memory_utilization,
        max_num_seqs=j.max_num_seqs,
        max_num_batched_tokens=min(j.max_num_batched_tokens, max(max_len, j.max_num_seqs)),
        cpu_kv_cache_bytes=j.cpu_kv_cache_bytes,
        engine_lora=False,
        partial_rollouts=False,
    )
    data["agent"], data["judge"], data["evaluation"] = None, None, None
    return config_mod.TrainerConfig.model_validate(data)


def render_prompt(template: str | None, *, prompt: str, response: str, answer: str, max_score: float) -> str:
    """The judge's prompt: the placeholders {prompt}, {response}, {answer}, {max_score} replaced, and
    nothing else of the template read as a format string (a template may hold JSON braces)."""
    text = template or DEFAULT_TEMPLATE
    values = {"prompt": prompt, "response": response, "answer": answer, "max_score": f"{max_score:g}"}
    # One pass, so a response that contains "{answer}" is never filled in itself.
    return re.sub(r"\{(prompt|response|answer|max_score)\}", lambda m: values[m.group(1)], text)


def parse_score(text: str, max_score: float) -> float | None:
    """The last number of the judge's answer in [0, max_score], scaled to [0, 1]; None when there is
    no number or it lies outside."""
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    value = float(numbers[-1])
    if not 0.0 <= value <= max_score:
        return None
    return value / max_score


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """The token ids the judge is sent for a rendered template: as the user's turn of the judge's
    chat template (with the assistant's opening) when it has one, else the text itself
    (`sources.encode_prompt`, as a policy's prompt is encoded)."""
    return sources.encode_prompt(
        tokenizer, text, chat_template=bool(getattr(tokenizer, "chat_template", None))
    )


def conversation_ids(tokenizer: Any, prompt: str, response: str) -> list[int]:
    """What a reward model scores: the prompt as the user's turn and the response as the assistant's,
    rendered by its chat template (how reward models are trained and served)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "judge.model's tokenizer has no chat template, and a rewardModel scores the prompt and the "
            "response as a conversation of its template: use a reward model whose tokenizer_config.json "
            "has one"
        )
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def batches(n: int, size: int) -> list[list[int]]:
    """Indices 0..n-1 in batches of at most `size`."""
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)]


@dataclass
class JudgeScores:
    scores: list[float | None]  # per response; None: unscored (its batch failed)
    metrics: dict[str, float] = field(default_factory=dict)


class Judge:
    """The judge's engines and how a step is scored (module docstring)."""

    def __init__(
        self,
        cfg: config_mod.TrainerConfig,
        runtime: Any,
        *,
        tokenizer: Any | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if cfg.judge is None:
            raise ValueError("the job has no judge")
        self.settings = cfg.judge
        self.engine_cfg = judge_engine_config(cfg)
        self.rt = runtime
        self.clock = clock
        if tokenizer is None:
            from rljob_trainer.model import modeling

            tokenizer = modeling.load_tokenizer(self.engine_cfg.model)
        self.tokenizer = tokenizer
        self.reward_model = self.settings.kind == "rewardModel"
        if self.reward_model:
            conversation_ids(tokenizer, "", "")  # no chat template: named before any engine starts
        self.engines: dict[str, Any] = {}

    def start(self) -> None:
        """Create and load the judge's engines (each on its judge pod in a cluster); an engine that
        cannot start is named and left out, and none starting is a `JudgeError`."""
        kind = "reward_model" if self.reward_model else "engine"
        handles = {
            f"judge-{k}": self.rt.create_judge(k, self.engine_cfg, kind) for k in range(self.settings.engines)
        }
        loads = {name: self.rt.submit(h, "load") for name, h in handles.items()}
        errors = {}
        for name, fut in loads.items():
            try:
                self.rt.get(fut)
                self.engines[name] = handles[name]
            except Exception as e:  # one judge pod down must not stop the others
                errors[name] = f"{type(e).__name__}: {e}"
                log.warning("judge engine %s did not start: %s", name, e)
        if not self.engines:
            raise JudgeError(f"no judge engine started: {errors}")
        log.info("judge engines up: %s", ", ".join(sorted(self.engines)))

    def shutdown(self) -> None:
        for name, handle in self.engines.items():
            try:
                self.rt.get(self.rt.submit(handle, "shutdown"))
                self.rt.kill(handle)
            except Exception as e:  # already gone
                log.debug("judge %s shutdown: %s", name, e)
        self.engines = {}

    # ---- scoring -------------------------------------------------------------------------------
    def request_ids(self, prompt: str, response: str, answer: str) -> list[int]:
        """What the judge is sent for one response (module docstring)."""
        if self.reward_model:
            return conversation_ids(self.tokenizer, prompt, response)
        j = self.settings
        text = render_prompt(
            j.prompt_template, prompt=prompt, response=response, answer=answer, max_score=j.max_score
        )
        return prompt_ids(self.tokenizer, text)

    def _call(self, engine: Any, prompts: list[list[int]]) -> Any:
        if self.reward_model:
            return self.rt.submit(engine, "score", prompts)
        return self.rt.submit(engine, "generate", prompts, self._sampling(len(prompts)))

    def _score_of(self, out: Any) -> float | None:
        """A response's score from what its engine returned (None: an llm's answer held no score)."""
        if self.reward_model:
            return float(out)
        return parse_score(
            self.tokenizer.decode(list(out.token_ids), skip_special_tokens=True), self.settings.max_score
        )

    def _sampling(self, n: int) -> base.SamplingSettings:
        return base.SamplingSettings(
            temperature=0.0, top_p=1.0, max_tokens=self.settings.max_tokens, seeds=tuple(range(n))
        )

    def score(self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str]) -> JudgeScores:
        """Score every response (module docstring); raises `JudgeError` when none could be scored."""
        t0 = self.clock()
        j = self.settings
        limit = self.engine_cfg.lengths.max_prompt_tokens
        ids: list[list[int] | None] = []
        for p, r, a in zip(prompts, responses, answers, strict=True):
            x = self.request_ids(p, r, a)
            ids.append(x if len(x) <= limit else None)  # over the judge's context: unscored, counted
        too_long = sum(1 for x in ids if x is None)
        todo = [i for i, x in enumerate(ids) if x is not None]
        pending = [[todo[k] for k in b] for b in batches(len(todo), j.batch_size)]
        results: dict[int, Any] = {}
        failures: list[str] = []
        tried: dict[int, set[str]] = {}
        attempts = {b: 0 for b in range(len(pending))}
        queue = list(range(len(pending)))
        while queue:
            inflight: dict[Any, tuple[int, str, float]] = {}
            busy: set[str] = set()
            for b in list(queue):
                free = [n for n in sorted(self.engines) if n not in busy and n not in tried.get(b, set())]
                if not free:
                    continue
                name = free[0]
                fut = self._call(self.engines[name], [ids[i] for i in pending[b]])
                inflight[fut] = (b, name, self.clock())
                busy.add(name)
                queue.remove(b)
            if not inflight:  # every engine left was tried for these batches
                failures += [f"batch {b}: no engine left to try" for b in queue]
                break
            self._settle(inflight, pending, results, failures, tried, attempts, queue)
        scores: list[float | None] = [None] * len(ids)
        unparsed = 0
        for i, out in results.items():
            s = self._score_of(out)
            if s is None:
                unparsed += 1
                s = 0.0
            scores[i] = s
        scored = [s for s in scores if s is not None]
        metrics = {
            "judge/seconds": self.clock() - t0,
            "judge/scored": float(len(scored)),
            "judge/failed": float(len(ids) - len(scored)),
            "judge/too_long": float(too_long),
            "judge/unparsed": float(unparsed),
            "judge/mean_score": sum(scored) / len(scored) if scored else 0.0,
        }
        if ids and not scored:
            raise JudgeError(
                f"the judge scored none of {len(ids)} responses: "
                + ("; ".join(failures[:3]) or f"every prompt is over its {limit} tokens (judge.maxModelLen)")
            )
        return JudgeScores(scores, metrics)

    def _settle(
        self,
        inflight: dict[Any, tuple[int, str, float]],
        pending: list[list[int]],
        results: dict[int, Any],
        failures: list[str],
        tried: dict[int, set[str]],
        attempts: dict[int, int],
        queue: list[int],
    ) -> None:
        """Wait for one round of batch calls; a failed or timed-out batch goes back to the queue for
        another engine, once."""
        timeout = self.settings.timeout_s
        while inflight:
            oldest = min(t for _, _, t in inflight.values())
            done = self.rt.wait_any(list(inflight), max(0.0, oldest + timeout - self.clock()))
            now = self.clock()
            for fut in list(inflight):
                b, name, t = inflight[fut]
                if fut in done:
                    del inflight[fut]
                    try:
                        outs = self.rt.get(fut)
                    except Exception as e:
                        self._retry(b, name, f"{type(e).__name__}: {e}", failures, tried, attempts, queue)
                        continue
                    results.update(zip(pending[b], outs, strict=True))
                elif now - t >= timeout:
                    del inflight[fut]
                    self._retry(
                        b,
                        name,
                        f"no answer within {timeout:g} s (judge.timeoutS)",
                        failures,
                        tried,
                        attempts,
                        queue,
                    )

    def _retry(
        self,
        b: int,
        name: str,
        why: str,
        failures: list[str],
        tried: dict[int, set[str]],
        attempts: dict[int, int],
        queue: list[int],
    ) -> None:
        log.warning("judge batch %d on %s failed: %s", b, name, why)
        failures.append(f"batch {b} on {name}: {why}")
        tried.setdefault(b, set()).add(name)
        attempts[b] += 1
        if attempts[b] < 2 and len(tried[b]) < len(self.engines):
            queue.append(b)

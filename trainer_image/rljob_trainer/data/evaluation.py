"""Held-out evaluation between training steps (`spec.evaluation`; verl's `test_freq`, OpenRLHF's
`eval_steps`).

Role: every `evaluation.everySteps` steps, after the step's weights are in the engines, the driver
calls `Evaluator.run`: the first `maxSamples` prompts of `evaluation.data` (loaded once; prompts over
`lengths.maxPromptTokens` dropped as for training), `samplesPerPrompt` completions each (default one,
greedy: temperature 0), generated on the engines that serve generation now under their sleep rules
(the driver's `prepare_generation` wakes and loads the shared engines that serve, and
`sleep_shared_engines` puts them back; dedicated engines first finish the generate calls of the
pipeline they are on, so the evaluation sees exactly the step's weights), scored with the job's
rewards. Metrics: `eval/mean_reward`, `eval/reward/<name>`, `eval/response_len_mean`, `eval/samples`,
`eval/seconds`; the driver puts them in the metrics JSONL and the trackers, and `eval/mean_reward`
in the SyncReport (`evalMeanReward`, the operator's `status.progress.evalReward`).
Callers: `rljob_trainer.driver`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from rljob_trainer import config as config_mod
from rljob_trainer.data import sources
from rljob_trainer.engines import base

log = logging.getLogger("rljob_trainer.data.evaluation")

# Request seeds of the evaluation: fixed, so a sampled evaluation is comparable from step to step.
EVAL_SEED = 7_919


class EvalOwner(Protocol):
    """What the evaluator needs from the driver that owns the engines and the rewards."""

    engines: dict[str, Any]
    rt: Any
    reward_fn: Any
    pipeline: Any

    def prepare_generation(self) -> None: ...

    def sleep_shared_engines(self) -> None: ...

    def _settle(
        self, futures: dict[str, Any], *, what: str, timeout_s: float | None = None
    ) -> dict[str, Any]: ...


def split_evenly(items: Sequence[int], parts: int) -> list[list[int]]:
    """`items` in `parts` contiguous slices, the first len % parts one larger (empty ones dropped)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        n = size + (1 if i < extra else 0)
        if n:
            out.append(list(items[start : start + n]))
        start += n
    return out


def summarize(
    totals: Sequence[float], parts: dict[str, Sequence[float]], response_lens: Sequence[int]
) -> dict[str, float]:
    """The `eval/*` metrics of one evaluation run (pure)."""
    n = max(len(totals), 1)
    return {
        "eval/mean_reward": sum(totals) / n,
        **{f"eval/reward/{k}": sum(v) / max(len(v), 1) for k, v in parts.items()},
        "eval/response_len_mean": sum(response_lens) / max(len(response_lens), 1),
        "eval/samples": float(len(totals)),
    }


class Evaluator:
    """The held-out prompts, encoded once, and how to sample them."""

    def __init__(
        self,
        settings: config_mod.EvaluationSettings,
        *,
        examples: list[sources.Example],
        prompts: list[list[int]],
        max_response_tokens: int,
    ) -> None:
        self.settings = settings
        self.examples = examples
        self.prompts = prompts
        self.max_response_tokens = max_response_tokens

    @classmethod
    def from_config(cls, cfg: config_mod.TrainerConfig, tokenizer: Any) -> Evaluator:
        ev = cfg.evaluation
        if ev is None:
            raise ValueError("evaluation is not configured")
        examples, _ = sources.load_fitting_examples(
            ev.data, tokenizer, max_prompt_tokens=cfg.lengths.max_prompt_tokens
        )
        examples = examples[: ev.max_samples]
        prompts = [sources.encode_data_prompt(tokenizer, e.prompt, ev.data) for e in examples]
        return cls(
            ev, examples=examples, prompts=prompts, max_response_tokens=cfg.lengths.max_response_tokens
        )

    def due(self, step: int) -> bool:
        return step % self.settings.every_steps == 0

    def requests(self) -> tuple[list[list[int]], list[int]]:
        """(prompt ids of every request, the example index of each): samplesPerPrompt per prompt."""
        k = self.settings.samples_per_prompt
        example_ids = [i for i in range(len(self.prompts)) for _ in range(k)]
        return [self.prompts[i] for i in example_ids], example_ids

    def sampling(self, n: int) -> base.SamplingSettings:
        s = self.settings
        return base.SamplingSettings(
            temperature=s.temperature,
            top_p=s.top_p,
            max_tokens=self.max_response_tokens,
            seeds=tuple(EVAL_SEED + i for i in range(n)),
        )

    def run(self, owner: EvalOwner, step: int, *, tokenizer: Any | None = None) -> dict[str, float]:
        """Generate and score the held-out prompts on the engines that serve now; the `eval/*` metrics."""
        t0 = time.monotonic()
        loop = getattr(owner, "agent_loop", None)
        if loop is not None:
            return self._run_episodes(owner, loop, step, t0)
        owner.prepare_generation()
        try:
            if not any(e.awake for e in owner.engines.values()):
                # A dedicated engine whose rollout pod is not up yet (still scheduling, or coming
                # back): wait for it as generation does, rather than fail the job.
                owner.pipeline.await_engine()
            names = sorted(n for n, e in owner.engines.items() if e.awake)
            # Each engine first finishes the pipeline's calls it is on: evaluation takes it alone.
            owner.pipeline.pump(lambda: not owner.pipeline.busy(names), admit=False)
            names = [n for n in names if n in owner.engines]
            if not names:
                raise RuntimeError("evaluation: no rollout engine is up to generate on")
            prompts, example_ids = self.requests()
            sampling = self.sampling(len(prompts))
            shares = split_evenly(list(range(len(prompts))), len(names))
            futures = {
                name: owner.rt.submit(
                    owner.engines[name].handle,
                    "generate",
                    [prompts[i] for i in share],
                    base.SamplingSettings(
                        temperature=sampling.temperature,
                        top_p=sampling.top_p,
                        max_tokens=sampling.max_tokens,
                        seeds=tuple(sampling.seeds[i] for i in share) if sampling.seeds else None,
                    ),
                )
                for name, share in zip(names, shares, strict=False)
            }
            done = owner._settle(futures, what="evaluation")
        finally:
            owner.sleep_shared_engines()
        outs: list[Any] = []
        ids: list[int] = []
        for name, share in zip(names, shares, strict=False):
            if name in done:  # a lost engine's share is left out of this evaluation
                outs += done[name]
                ids += [example_ids[i] for i in share]
        tok = tokenizer if tokenizer is not None else getattr(owner, "tokenizer", None)
        completions = [tok.decode(list(o.token_ids), skip_special_tokens=True) for o in outs]
        exs = [self.examples[i] for i in ids]
        totals, parts = owner.reward_fn.score_batch(
            [e.prompt for e in exs], completions, [e.answer for e in exs]
        )
        metrics = summarize(totals, parts, [len(o.token_ids) for o in outs])
        metrics["eval/seconds"] = time.monotonic() - t0
        return self._logged(metrics, step)

    def _run_episodes(self, owner: EvalOwner, loop: Any, step: int, t0: float) -> dict[str, float]:
        """A multi-turn job (spec.rollout.agent): the held-out prompts as episodes, their tools offered
        (or its environment's resets, one seed a request), run by the pipeline on the engines that
        serve now in calls of their own (`RolloutPipeline.run_episodes`), scored as training scores
        them: the model's own turns by the job's rewards, or the environment's reward."""
        k = self.settings.samples_per_prompt
        example_ids = [i for i in range(len(self.examples)) for _ in range(k)]
        prompts = [] if loop.environment else [loop.prompt_ids(self.examples[i].prompt) for i in example_ids]
        outs = owner.pipeline.run_episodes(
            prompts,
            [EVAL_SEED + i for i in range(len(example_ids))],
            temperature=self.settings.temperature,
            top_p=self.settings.top_p,
        )
        exs = [self.examples[i] for i in example_ids]
        if loop.environment:
            totals = [float(o.env_reward or 0.0) for o in outs]
            parts: dict[str, Any] = {"environment": totals}
        else:
            completions = ["\n".join(o.turn_texts) for o in outs]
            totals, parts = owner.reward_fn.score_batch(
                [e.prompt for e in exs], completions, [e.answer for e in exs]
            )
        metrics = summarize(totals, parts, [sum(o.loss_mask) for o in outs])  # generated tokens
        metrics["eval/turns_mean"] = sum(o.turns for o in outs) / max(len(outs), 1)
        metrics["eval/tool_calls_mean"] = sum(o.tool_calls for o in outs) / max(len(outs), 1)
        metrics["eval/seconds"] = time.monotonic() - t0
        return self._logged(metrics, step)

    @staticmethod
    def _logged(metrics: dict[str, float], step: int) -> dict[str, float]:
        log.info(
            "evaluation after step %s: mean reward %.4f over %d samples",
            step,
            metrics["eval/mean_reward"],
            int(metrics["eval/samples"]),
        )
        return metrics

"""What the agent tests on real engines share: the tool-calling model's job config, a driver whose
engine calls and training steps are recorded, and the check that an episode's trained tokens and
log-probs are the engine's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import agent_model

from rljob_trainer import config
from rljob_trainer.engines import base
from rljob_trainer.train import trainer


def write_questions(path: Path, n: int = 16) -> Path:
    rows = [
        {"prompt": agent_model.question(a, b), "answer": str(a + b)}
        for a, b in zip(range(3, 3 + n), range(40, 40 + n), strict=True)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def agent_config(model_dir: Path, data: Path, **over: Any) -> config.TrainerConfig:
    base_cfg: dict[str, Any] = {
        "model": agent_model.model_settings(model_dir),
        "lengths": {"maxPromptTokens": 64, "maxResponseTokens": 192},
        "grpo": {
            "groupSize": 2,
            "promptsPerStep": 2,
            "maxSteps": 2,
            "learningRate": 1e-4,
            "temperature": 0.7,
            "seed": 3,
        },
        "batching": {"packed": True, "dynamic": True, "maxTokensPerMicroBatch": 1024},
        "rollout": {"kind": "transformers", "sharedEngines": 0, "dedicatedEngines": 1},
        "data": {"path": str(data), "chatTemplate": True},
        "rewards": [{"name": "mathAccuracy"}],
        "telemetry": {"enabled": False, "prometheusPort": None},
        "distributed": {"numTrainerRanks": 1, "launcher": "local", "torchThreadsPerRank": 1},
        "agent": {"maxTurns": 3, "tools": [agent_model.TOOL]},
    }
    for key, value in over.items():
        base_cfg[key] = (
            {**base_cfg[key], **value}
            if isinstance(value, dict) and isinstance(base_cfg.get(key), dict)
            else value
        )
    return config.parse_config(base_cfg)


class Recorder:
    """Wraps a local driver's engines and rank: every generate call's outputs, every trained sample."""

    def __init__(self, driver: Any) -> None:
        self.outputs: list[base.GenerationOutput] = []
        self.samples: list[trainer.TrainSample] = []
        self.trainer_logprobs: list[list[float]] = []  # each sample's, before the step trained on it
        for eng in driver.engines.values():
            engine = eng.handle.obj
            generate = engine.generate

            def recorded(prompts: Any, sampling: Any, _generate: Any = generate) -> Any:
                outs = _generate(prompts, sampling)
                self.outputs.extend(outs)
                return outs

            engine.generate = recorded
        rank = driver.ranks[0].obj
        train_step = rank.train_step

        def recorded_train(mini_batches: Any) -> Any:
            for mb in mini_batches:
                self.samples.extend(mb.samples)
                self.trainer_logprobs.extend(rank.compute_log_probs(mb.samples))
            return train_step(mini_batches)

        rank.train_step = recorded_train


def check_trained_tokens_are_the_engines(
    samples: list[trainer.TrainSample], outputs: list[base.GenerationOutput]
) -> int:
    """Walk each sample's response: every run of trained tokens is exactly one engine output (its ids
    and log-probs) for the sample's context so far; every run of masked tokens is an observation.
    Returns how many samples had more than one turn."""
    by_prompt: dict[tuple[int, ...], list[base.GenerationOutput]] = {}
    for out in outputs:
        by_prompt.setdefault(tuple(out.prompt_token_ids), []).append(out)
    multi = 0
    for s in samples:
        context, k, turns = list(s.prompt_ids), 0, 0
        mask = s.mask
        while k < len(s.response_ids):
            if mask[k]:
                candidates = by_prompt.get(tuple(context), [])
                match = next(
                    (
                        o
                        for o in candidates
                        if tuple(s.response_ids[k : k + len(o.token_ids)]) == o.token_ids and o.token_ids
                    ),
                    None,
                )
                assert match is not None, f"trained tokens at {k} are no engine output for that context"
                n = len(match.token_ids)
                assert all(mask[k : k + n]), "an engine output's tokens are all trained"
                assert s.rollout_logprobs[k : k + n] == match.logprobs  # the engine's own log-probs
                turns += 1
            else:
                n = 0
                while k + n < len(mask) and not mask[k + n]:
                    n += 1
                assert all(lp == 0.0 for lp in s.rollout_logprobs[k : k + n])
            context += s.response_ids[k : k + n]
            k += n
        multi += turns > 1
    return multi

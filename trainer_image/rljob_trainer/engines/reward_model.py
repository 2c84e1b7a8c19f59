"""Reward-model engines: a sequence-classification model's score of whole sequences (`judge.kind`
rewardModel), on vLLM's pooling runner or on transformers.

Role: the judge (`rljob_trainer.data.judge`) sends each engine batches of token ids (a prompt and
its response as the reward model's chat template gives them) and gets one float each: the model's
score head on the sequence's last token, the raw logit (no sigmoid: a Bradley-Terry reward model's
scores are logits, and GRPO normalises them within a group). Both engines agree with each other and
with Hugging Face's model on the same weights (tests/integration/test_reward_model_engines.py).
- `VLLMRewardModel`: `vllm.LLM(runner="pooling")`, `classify` with `use_activation=False` (vLLM's
  default applies a sigmoid to a one-label head); its engine arguments are a rollout engine's
  (`vllm_engine.engine_args`: the platform's needs, the planned geometry), less what only generation
  uses.
- `TransformersRewardModel`: the backbone over right-padded batches, the score head on each
  sequence's last real token (not Hugging Face's last non-pad token: a response that ends with its
  EOS, which is the pad token of many tokenizers, is scored at that EOS, as vLLM does).
Reward models never take weights and never sleep. A model whose head has other than one label is
refused at load, naming the field. Callers: `runtimes.Host` (kind `reward_model`), tests.
"""

from __future__ import annotations

import abc
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from rljob_trainer import config as config_mod

log = logging.getLogger(__name__)


def check_one_label(num_labels: int, architectures: Sequence[str] | None, *, name: str) -> None:
    """A reward model scores with one label; anything else cannot be read as a reward."""
    if num_labels != 1:
        raise ValueError(
            f"engine {name}: judge.model has a classification head of {num_labels} labels "
            f"({', '.join(architectures or ()) or 'no architectures'}); a reward model scores with one "
            "(config.json id2label of one entry), or use judge.kind llm"
        )


def engine_args(cfg: config_mod.TrainerConfig, *, model: str, capabilities: Any) -> dict[str, Any]:
    """`vllm.LLM`'s keywords for a reward model: a rollout engine's (`vllm_engine.engine_args`: the
    platform's needs, the planned geometry) on the pooling runner, without sleep mode and without what
    only sampling reads. Pure: the conformance tier builds vLLM's `EngineArgs` from it."""
    from rljob_trainer.engines import vllm_engine

    args = vllm_engine.engine_args(cfg, model=model, sleep_enabled=False, capabilities=capabilities)
    del args["logprobs_mode"]
    return {**args, "runner": "pooling"}


def last_token_scores(model: Any, prompts: Sequence[Sequence[int]], pad_id: int) -> Any:
    """A Hugging Face sequence classifier's first-label score of each sequence at its last real token:
    the backbone over a right-padded batch, the `score` head at each sequence's end (module docstring).
    A tensor on the model's device, with autograd as the caller has it (training a reward model)."""
    import torch

    device = next(model.parameters()).device
    lengths = torch.tensor([len(p) for p in prompts])
    ids = torch.full((len(prompts), int(lengths.max())), pad_id, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, : len(p)] = torch.tensor(list(p), dtype=torch.long)
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    hidden = model.base_model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
    return model.score(hidden[torch.arange(len(prompts)), lengths.to(device) - 1])[:, 0]


class RewardModelEngine(abc.ABC):
    """One reward model: `load()` once, then `score(batch)`; `shutdown()` frees it."""

    name: str

    @abc.abstractmethod
    def load(self) -> dict[str, Any]:
        """Build the model; returns what the engine runs on (for the log)."""

    @abc.abstractmethod
    def score(self, prompts: Sequence[Sequence[int]]) -> list[float]:
        """The model's score of each whole token sequence."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Free the model (the actor is going away)."""


class TransformersRewardModel(RewardModelEngine):
    """The reward model on Hugging Face transformers (CPU, and the rollout.kind transformers pools)."""

    def __init__(self, cfg: config_mod.TrainerConfig, *, name: str, device: str = "cpu") -> None:
        self.name = name
        self._cfg = cfg
        self._device = device
        self._model: Any = None
        self._pad_id = 0

    def load(self) -> dict[str, Any]:
        if self._model is None:
            from rljob_trainer.model import modeling

            model = modeling.build_reward_model(self._cfg.model, init_seed=self._cfg.grpo.seed)
            check_one_label(model.config.num_labels, model.config.architectures, name=self.name)
            if not hasattr(model, "score"):
                raise ValueError(
                    f"engine {self.name}: judge.model {type(model).__name__} has no `score` head (the "
                    "decoder reward models' layout: Llama, Qwen2, Mistral, Gemma, ...); use such a model"
                )
            self._model = model.to(self._device).eval()
            self._pad_id = int(model.config.pad_token_id or 0)
        return {"engine": "transformers", "device": self._device}

    def score(self, prompts: Sequence[Sequence[int]]) -> list[float]:
        import torch

        if self._model is None:
            raise RuntimeError(f"engine {self.name}: load() has not been called")
        if not prompts:
            return []
        with torch.no_grad():
            scores = last_token_scores(self._model, prompts, self._pad_id)
        return [float(v) for v in scores.float().cpu()]

    def shutdown(self) -> None:
        self._model = None


class VLLMRewardModel(RewardModelEngine):
    """The reward model on vLLM's pooling runner (`vllm.LLM(runner="pooling")`, `classify`)."""

    def __init__(self, cfg: config_mod.TrainerConfig, *, name: str) -> None:
        self.name = name
        self._cfg = cfg
        self._llm: Any = None

    def load(self) -> dict[str, Any]:
        from rljob_trainer.engines import vllm_engine

        if self._llm is not None:
            return {"engine": "vllm"}
        caps = vllm_engine.probe_or_raise(self.name)
        vllm_engine.check_head_size(self._cfg.model.hf_config, caps, name=self.name, field="judge.model")
        if caps.host_memory_kv:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # as a rollout engine's
        from rljob_trainer.model import modeling

        model = vllm_engine.model_folder(
            self._cfg,
            self.name,
            lambda: modeling.build_reward_model(self._cfg.model, init_seed=self._cfg.grpo.seed),
        )
        from vllm import LLM

        t0 = time.monotonic()
        self._llm = LLM(**engine_args(self._cfg, model=model, capabilities=caps))
        try:
            hf = self._llm.llm_engine.model_config.hf_config
            check_one_label(int(hf.num_labels), getattr(hf, "architectures", None), name=self.name)
            if "classify" not in self._llm.supported_tasks:
                raise ValueError(
                    f"engine {self.name}: vLLM {caps.vllm_version} serves judge.model only for "
                    f"{list(self._llm.supported_tasks)}, not classify (a sequence-classification head); "
                    "use a ...ForSequenceClassification reward model"
                )
        except ValueError:
            self.shutdown()
            raise
        log.info("reward model %s: vLLM pooling runner up in %.1f s", self.name, time.monotonic() - t0)
        return {"engine": "vllm", **caps.to_dict()}

    def score(self, prompts: Sequence[Sequence[int]]) -> list[float]:
        from vllm import PoolingParams

        if self._llm is None:
            raise RuntimeError(f"engine {self.name}: load() has not been called")
        outs = self._llm.classify(
            [{"prompt_token_ids": list(p)} for p in prompts],
            pooling_params=PoolingParams(use_activation=False),  # the raw logit (module docstring)
            use_tqdm=False,
        )
        return [float(o.outputs.probs[0]) for o in outs]

    def shutdown(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

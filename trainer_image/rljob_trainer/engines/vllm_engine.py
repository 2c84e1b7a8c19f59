"""vLLM rollout engine: the accelerator implementation of `base.RolloutEngine`.

Role: wrap `vllm.LLM` with sleep mode for engines colocated with training (`enable_sleep_mode=True`,
`llm.sleep(level=1)` offloads weights to host memory and drops the KV cache, `llm.wake_up()`
restores them) and in-place weight sync (`llm.collective_rpc` runs `model.load_weights` on every
worker; nothing is written to disk). vLLM is imported lazily, so the module imports on machines
without it. Callers: `rljob_trainer.engines.build_engine` inside a Ray actor on an accelerator pod.

NOT RUN in this repository's tests: there is no GPU here. The calls follow vLLM's public API
(LLM, SamplingParams, TokensPrompt, sleep/wake_up, collective_rpc, reset_prefix_cache).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

from rljob_trainer import config as config_mod
from rljob_trainer.engines import base


def _load_weights_on_worker(worker: Any, weights: list[tuple[str, Any]]) -> int:
    # Runs inside each vLLM worker process (collective_rpc passes the worker as `self`); vLLM's
    # model.load_weights shards full tensors for tensor parallelism and fuses q/k/v, gate/up itself.
    model = worker.model_runner.model
    model.load_weights(weights=iter(weights))
    return len(weights)


class VLLMEngine(base.RolloutEngine):
    def __init__(
        self, cfg: config_mod.TrainerConfig, *, name: str, colocated: bool, model_path: str | None = None
    ) -> None:
        self.name = name
        self.colocated = colocated
        self._cfg = cfg
        self._model_path = model_path
        self._llm: Any = None
        self._sleeping = False
        self._version = 0
        self._served = 0
        self._tokens = 0

    def _resolve_model_path(self) -> str:
        m = self._cfg.model
        if self._model_path:
            return self._model_path
        if m.source == "pvc":
            return str(m.path)
        if m.source == "hub":
            return str(m.hub_id)
        # A tiny model has no files: write its config, tokenizer and initial weights once so vLLM can
        # build it; later weights arrive through update_weights, never through disk.
        from rljob_trainer import modeling

        out = tempfile.mkdtemp(prefix=f"rljob-{self.name}-")
        modeling.build_base_model(m, init_seed=self._cfg.grpo.seed).save_pretrained(out)
        modeling.load_tokenizer(m).save_pretrained(out)
        return out

    def load(self) -> None:
        if self._llm is not None:
            return
        # collective_rpc with a Python callable needs pickled functions across vLLM's processes.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        import vllm

        r, lengths = self._cfg.rollout, self._cfg.lengths
        self._llm = vllm.LLM(
            model=self._resolve_model_path(),
            dtype=self._cfg.model.dtype,
            tensor_parallel_size=r.tensor_parallel,
            gpu_memory_utilization=r.gpu_memory_utilization,
            max_num_seqs=r.max_num_seqs,
            max_num_batched_tokens=r.max_num_batched_tokens,
            max_model_len=lengths.max_model_len_tokens,
            enable_sleep_mode=self.colocated and r.enable_sleep_mode,
            seed=self._cfg.grpo.seed,
        )

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    @property
    def weights_version(self) -> int:
        return self._version

    def generate(
        self, prompts_token_ids: Sequence[Sequence[int]], sampling: base.SamplingSettings
    ) -> list[base.GenerationOutput]:
        if self._sleeping:
            raise RuntimeError(f"engine {self.name} is asleep; wake() it before generate()")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        seeds = sampling.seeds or tuple(range(len(prompts_token_ids)))
        params = [
            SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                seed=int(s),
                logprobs=0,  # the sampled token's log-prob
                stop_token_ids=list(sampling.stop_token_ids) or None,
            )
            for s in seeds
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts_token_ids]
        outs = self._llm.generate(prompts, params, use_tqdm=False)
        results = []
        for p, o in zip(prompts_token_ids, outs, strict=True):
            c = o.outputs[0]
            toks = tuple(int(t) for t in c.token_ids)
            lps = tuple(float(c.logprobs[i][t].logprob) for i, t in enumerate(toks)) if c.logprobs else ()
            reason = "stop" if c.finish_reason == "stop" else "length"
            results.append(base.GenerationOutput(tuple(p), toks, lps, reason, {"engine": self.name}))
        self._served += len(results)
        self._tokens += sum(len(r.token_ids) for r in results)
        return results

    def sleep(self) -> None:
        if not self._sleeping:
            self._llm.sleep(level=1)
            self._sleeping = True

    def wake(self) -> None:
        if self._sleeping:
            self._llm.wake_up()
            self._sleeping = False

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]] | dict[str, Any]) -> int:
        if self._sleeping:
            raise RuntimeError(f"engine {self.name}: wake() before update_weights() (vLLM sleep level 1)")
        weights = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        self._llm.collective_rpc(_load_weights_on_worker, args=(weights,))
        self._llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self._version += 1
        return len(weights)

    def load_report(self) -> base.EngineLoad:
        return base.EngineLoad(self.name, self._sleeping, self._served, self._tokens)

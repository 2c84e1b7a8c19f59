"""vLLM rollout engine: the accelerator implementation of `base.RolloutEngine`.

Role: wrap `vllm.LLM` with sleep mode for engines colocated with training (`enable_sleep_mode=True`;
`llm.sleep(level=2)` discards weights and KV cache, and the driver follows vLLM's RL order:
`wake_up(tags=["weights"])`, load weights, `wake_up(tags=["kv_cache"])`), in-place weight sync
(`llm.collective_rpc` runs `model.load_weights` on every worker; nothing is written to disk), and
processed log-probs (`logprobs_mode="processed_logprobs"`: after temperature and top-p, what the
sampler drew from). The rules are `base.SleepState`, shared with the CPU engine. vLLM is imported
lazily, so the module imports on machines without it. Callers: `rljob_trainer.engines.build_engine`
inside a Ray actor on an accelerator pod.

Full weights arrive one of two ways, chosen by `weight_sync.choose_weight_transfer` from what the
installed vLLM has (`weight_sync.detect_vllm_weight_transfer`): vLLM's own weight-transfer API
(`WeightTransferConfig(backend="nccl")` for a dedicated engine, `"ipc"` for a colocated one; the
trainer broadcasts, `receive_weight_transfer` runs start/update/finish_weight_update), or, without
it, `update_weights` (a whole-model dict through the object store, loaded by `collective_rpc`).

With `rollout.engineLora` (model.finetune lora) the engine serves base + the trainer's adapter, as
vLLM serves LoRA: it is built with `enable_lora=True`, `max_loras=1` and `max_lora_rank` the
trainer's rank rounded up to a value vLLM accepts (`config.vllm_max_lora_rank`); the base loads
from its path as without LoRA. A sync then sends only the adapter tensors
(`weight_sync.PATH_VLLM_LORA`: PEFT saved-adapter names, through the object store, a small fraction
of the model; never vLLM's weight-transfer API, which moves full weights). `update_weights` writes
them as a PEFT adapter directory under /dev/shm (`lora_adapter.AdapterStore`), adds it as a new adapter
(`LoRARequest(name, new lora_int_id, path)`, `llm.llm_engine.add_lora`), removes the previous one
(`remove_lora`) and deletes its directory, and resets the prefix cache; `generate` passes
`lora_request=` for the current adapter (none before the first sync: the trainer's adapter starts
with B = 0, so the base is the policy). Level-2 sleep is refused for such an engine (config load
refuses it first): vLLM's level 2 discards the base weights, and reloading them into a LoRA-enabled
vLLM is not plain `load_weights`: vLLM wraps every LoRA-capable linear layer, so their base
parameters are named `<module>.base_layer.weight` (verl renames them model by model before
`load_weights`, its `replace_lora_wrapper`), and vLLM does not document whether the adapter slots
survive level 2. Level 1 keeps the weights in host memory and restores them, so rljob requires it.

NOT RUN in this repository's tests: there is no GPU and no vLLM here. The calls follow vLLM's public
API (LLM, SamplingParams, TokensPrompt, sleep/wake_up, collective_rpc, reset_prefix_cache,
init_weight_transfer_engine/update_weights as in vLLM's examples/rl/rlhf_nccl.py, commit 3a383407;
enable_lora/max_lora_rank/max_loras, vllm.lora.request.LoRARequest, LLMEngine.add_lora/remove_lora
as in vllm/v1/engine/llm_engine.py). What is tested: the adapter directory this engine writes loads
with real peft onto the base and computes the trainer's logits (tests/integration/
test_vllm_lora_adapter.py), and the config rules and path choice around it (unit tests).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

from rljob_trainer import config as config_mod
from rljob_trainer import lora_adapter
from rljob_trainer.engines import base


def _load_weights_on_worker(worker: Any, weights: list[tuple[str, Any]]) -> int:
    # Runs inside each vLLM worker process (collective_rpc passes the worker as `self`); vLLM's
    # model.load_weights shards full tensors for tensor parallelism and fuses q/k/v, gate/up itself.
    model = worker.model_runner.model
    model.load_weights(weights=iter(weights))
    return len(weights)


def _lora_request(adapter: lora_adapter.AdapterVersion) -> Any:
    """vLLM's LoRARequest for one adapter version (what add_lora registers, what generate names)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=adapter.name, lora_int_id=adapter.lora_int_id, lora_path=str(adapter.path))


def lora_engine_args(cfg: config_mod.TrainerConfig) -> dict[str, Any]:
    """The vllm.LLM arguments of an engine that serves the trainer's LoRA adapter (none without)."""
    if not cfg.rollout.engine_lora:
        return {}
    # One adapter at a time: the policy. vLLM refuses a max_lora_rank outside its list: rounded up.
    rank = config_mod.vllm_max_lora_rank(cfg.model.lora.rank)
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1}


class VLLMEngine(base.RolloutEngine):
    def __init__(
        self,
        cfg: config_mod.TrainerConfig,
        *,
        name: str,
        colocated: bool,
        model_path: str | None = None,
        tp_workers_in_placement_group: bool = False,
    ) -> None:
        self.name = name
        self.colocated = colocated
        self._cfg = cfg
        self._model_path = model_path
        self._tp_in_group = tp_workers_in_placement_group
        self._llm: Any = None
        self._state = base.SleepState(name, sleep_enabled=colocated and cfg.rollout.enable_sleep_mode)
        self._version = 0
        self._served = 0
        self._tokens = 0
        self._transfer: Any = None  # weight_sync.WeightTransferChoice, decided at load()
        self.serves_lora = cfg.rollout.engine_lora and cfg.model.finetune == "lora"
        self._adapters: lora_adapter.AdapterStore | None = None
        self._adapter: lora_adapter.AdapterVersion | None = None  # what generate() serves

    @property
    def weight_transfer(self) -> Any:
        """How this engine takes weights (`weight_sync.WeightTransferChoice`), decided at load()."""
        if self._transfer is None:
            from rljob_trainer.rollout import weight_sync

            self._transfer = weight_sync.choose_weight_transfer(
                engine_kind="vllm",
                colocated=self.colocated,
                weight_sync=self._cfg.rollout.weight_sync,
                device_type="cuda",
                ray=True,
                vllm=weight_sync.detect_vllm_weight_transfer(),
                engine_lora=self.serves_lora,
            )
        return self._transfer

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
        extra: dict[str, Any] = {}
        if self._tp_in_group:
            # A shared engine of TP > 1: vLLM's Ray executor puts one worker on each bundle named in
            # VLLM_RAY_BUNDLE_INDICES of this actor's placement group (runtimes.RayRuntime sets it).
            extra["distributed_executor_backend"] = "ray"
        from rljob_trainer.rollout import weight_sync

        if self.weight_transfer.path == weight_sync.PATH_VLLM_NATIVE:
            from vllm.config import WeightTransferConfig

            extra["weight_transfer_config"] = WeightTransferConfig(backend=self.weight_transfer.backend)
        if self.serves_lora:
            extra.update(lora_engine_args(self._cfg))
            self._adapters = lora_adapter.AdapterStore(self.name)
        self._llm = vllm.LLM(
            model=self._resolve_model_path(),
            dtype=self._cfg.model.dtype,
            tensor_parallel_size=r.tensor_parallel,
            gpu_memory_utilization=r.gpu_memory_utilization,
            max_num_seqs=r.max_num_seqs,
            max_num_batched_tokens=r.max_num_batched_tokens,
            max_model_len=lengths.max_model_len_tokens,
            enable_sleep_mode=self._state.sleep_enabled,
            seed=self._cfg.grpo.seed,
            # V1 returns raw log-probs (before temperature/top-p) unless asked; the trainer compares
            # with the distribution the sample was drawn from.
            logprobs_mode="processed_logprobs",
            # spec.model.source.hub.revision: the weights and the tokenizer of that commit, as the trainer's.
            revision=self._cfg.model.hub_revision,
            tokenizer_revision=self._cfg.model.hub_revision,
            **extra,
        )

    @property
    def is_sleeping(self) -> bool:
        return not self._state.fully_awake

    @property
    def weights_version(self) -> int:
        return self._version

    def generate(
        self, prompts_token_ids: Sequence[Sequence[int]], sampling: base.SamplingSettings
    ) -> list[base.GenerationOutput]:
        self._state.check_generate()
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
        lora = {"lora_request": _lora_request(self._adapter)} if self._adapter is not None else {}
        outs = self._llm.generate(prompts, params, use_tqdm=False, **lora)
        results = []
        for p, o in zip(prompts_token_ids, outs, strict=True):
            c = o.outputs[0]
            toks = tuple(int(t) for t in c.token_ids)
            lps = tuple(float(c.logprobs[i][t].logprob) for i, t in enumerate(toks)) if c.logprobs else ()
            reason = "stop" if c.finish_reason == "stop" else "length"
            meta = {"engine": self.name, "version": self._version}
            results.append(base.GenerationOutput(tuple(p), toks, lps, reason, meta))
        self._served += len(results)
        self._tokens += sum(len(r.token_ids) for r in results)
        return results

    def sleep(self, level: int = 1) -> None:
        if self.is_sleeping:
            return
        if self.serves_lora and level == 2:  # see the module docstring; config load refuses it first
            raise base.EngineStateError(
                f"engine {self.name} serves LoRA on vLLM: sleep level 2 would discard the base weights, "
                "which rljob cannot reload into vLLM's LoRA layers; use rollout.sleepLevel 1"
            )
        self._state.on_sleep(level)
        self._llm.sleep(level=level)

    def wake(self, tags: Sequence[str] | None = None) -> None:
        new = self._state.on_wake(tags)
        if new:
            self._llm.wake_up(tags=sorted(new))
        if "kv_cache" in new:
            self._llm.reset_prefix_cache()  # nothing cached before the sleep may be reused

    def update_weights(
        self, named_tensors: Iterable[tuple[str, Any]] | dict[str, Any], version: int | None = None
    ) -> int:
        self._state.check_update()
        weights = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        if self.serves_lora:
            return self._update_adapter(dict(weights), version)
        self._llm.collective_rpc(_load_weights_on_worker, args=(weights,))
        if self._state.fully_awake:
            self._llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self._state.weights_valid = True
        self._version = self._version + 1 if version is None else int(version)
        return len(weights)

    def _update_adapter(self, tensors: dict[str, Any], version: int | None) -> int:
        """A new adapter version (weight_sync.PATH_VLLM_LORA): written as a PEFT directory, added to
        vLLM under a new lora_int_id, the old one removed once the new one is in."""
        new_version = self._version + 1 if version is None else int(version)
        if not tensors:  # nothing new (a version bump only)
            self._version = new_version
            return 0
        if self._adapters is None:
            raise RuntimeError(f"engine {self.name}: load() has not been called")
        adapter = self._adapters.write(tensors, self._cfg.model, new_version)  # refuses base tensors
        engine = getattr(self._llm, "llm_engine", self._llm)
        try:
            if not engine.add_lora(_lora_request(adapter)):
                raise RuntimeError(f"engine {self.name}: vLLM did not add LoRA adapter {adapter.name}")
        except BaseException:
            self._adapters.retire(adapter)  # the previous adapter stays current
            raise
        previous, self._adapter = self._adapter, adapter
        if previous is not None:
            remove = getattr(engine, "remove_lora", None)
            if remove is not None:
                remove(previous.lora_int_id)
            self._adapters.retire(previous)
        if self._state.fully_awake:
            self._llm.reset_prefix_cache()  # as after new weights (wake() resets it otherwise)
        self._state.weights_valid = True
        self._version = new_version
        return len(tensors)

    # ---- vLLM's weight-transfer API (weight_sync.PATH_VLLM_NATIVE) ---------------------------------
    def world_size(self) -> int:
        """The engine's workers (the ranks after the trainer's in an nccl weight-transfer group)."""
        return self._cfg.rollout.tensor_parallel

    def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's weight-transfer channel (nccl: master address/port, rank_offset 1,
        world size; ipc: nothing). Blocks until the trainer side has joined too (nccl)."""
        self._llm.init_weight_transfer_engine({"init_info": init_info})

    def receive_weight_transfer(self, update_info: dict[str, Any], version: int) -> int:
        """One weight update over the channel: the trainer sends at the same time (nccl broadcast) or
        passes IPC handles in `update_info` (ipc). Same sleep rules as `update_weights`."""
        if self.serves_lora:  # weight_sync.choose_weight_transfer never picks this path for LoRA
            raise base.EngineStateError(
                f"engine {self.name} serves LoRA: it takes adapters, not full weights"
            )
        self._state.check_update()
        start = getattr(self._llm, "start_weight_update", None)  # the four-phase API of later releases
        if start is not None:
            start(is_checkpoint_format=True)
        self._llm.update_weights({"update_info": update_info})
        finish = getattr(self._llm, "finish_weight_update", None)
        if finish is not None:
            finish()
        if self._state.fully_awake:
            self._llm.reset_prefix_cache()
        self._state.weights_valid = True
        self._version = int(version)
        return len(update_info.get("names", ()))

    def load_report(self) -> base.EngineLoad:
        return base.EngineLoad(self.name, self.is_sleeping, self._served, self._tokens)

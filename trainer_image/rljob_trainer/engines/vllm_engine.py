"""vLLM rollout engine: the accelerator implementation of `base.RolloutEngine`, on vLLM's `AsyncLLM`.

Role: one `vllm.v1.engine.async_llm.AsyncLLM` per engine actor, on a private asyncio loop in a daemon
thread; each method submits a coroutine to it and waits (so several calls may be in flight at once:
a `generate` and, from another thread, `pause_generation`). Callers: `engines.build_engine` inside a
Ray actor on an accelerator pod; `weights.vllm_transfer.EngineClient` (rank 0) for the transfer calls.

Why AsyncLLM and not the offline `LLM`: both have vLLM's RL weight-transfer methods
(`init_weight_transfer_engine`, `start_weight_update`, `update_weights`, `finish_weight_update`),
sleep/wake and LoRA; only AsyncLLM can stop requests that are in flight, which partial rollouts need
(`pause_generation(mode=...)`, `abort`, `resume_generation`: `LLM.generate` blocks until every request
of the call is done). The partial-rollout methods of this class:
- `pause_generation(mode="keep", clear_cache=True)`: in-flight requests freeze where they are
  (vLLM's "keep"; "abort" ends them with finish_reason "abort" and their tokens so far), the KV
  cache is dropped, so on resume vLLM recomputes each frozen request's prompt + tokens so far under
  the weights loaded meanwhile;
- `abort_requests(request_ids=None)`: ends requests (all in flight when None);
- `resume_generation()`; `is_paused()`; `inflight_request_ids()`.
(The Ray actor must admit concurrent calls for a pause to reach an engine that is generating: that
wiring, and what the driver does with the tokens, belong to the pipeline.)

Rules (`base.SleepState`, shared with the transformers engine, mirroring vLLM 0.33.0): sleep needs
`enable_sleep_mode`; level 1 offloads weights to host memory and drops the KV cache, level 2 discards
both; `wake_up(tags=["weights"])`, load, `wake_up(tags=["kv_cache"])`; no weight load while the
weights sleep; generation only when fully awake. Log-probs are vLLM's `processed_logprobs` (after
temperature and top-p: what the sampler drew from).

Full weights arrive one of two ways (`weight_sync.choose_weight_transfer` from the installed vLLM):
vLLM's weight-transfer API (`WeightTransferConfig(backend="nccl")` for a dedicated engine, `"ipc"` for
a colocated one; rank 0 drives `init_weight_transfer` / `start_weight_update` /
`receive_weight_update` / `finish_weight_update` here through `weights.vllm_transfer`, each bounded
by rollout.engineTimeoutS), or the named fallback `update_weights` (a whole-model dict through the
object store, which the engine writes as one safetensors file on its pod's tmpfs and its workers
load through `collective_rpc`, only the file's path sent: vLLM documents collective_rpc for control
messages, so the driver logs this path as a warning). `VLLM_ALLOW_INSECURE_SERIALIZATION` is set
only where vLLM's engine-core channel must pickle (`needs_pickle`: that fallback's callable, IPC
handles).

With `rollout.engineLora` (model.finetune lora) the engine serves base + the trainer's adapter: built
with `enable_lora=True`, `max_loras=1` and `max_lora_rank` the trainer's rank rounded up to a value
vLLM accepts (`config.vllm_max_lora_rank`). A sync writes the adapter as a PEFT directory under
/dev/shm (`lora_adapter.AdapterStore`), `add_lora`s it under a new id, `remove_lora`s the previous one;
`generate` passes `lora_request=` for the current one. `adapter_version()` reports whether vLLM still
lists it (`list_loras`): after a level-1 wake the driver re-adds a lost one (vLLM issue 53888 reports
silent loss). Level-2 sleep is refused for such an engine (config load refuses it first): it discards
base weights rljob cannot reload into vLLM's LoRA layers (named `<module>.base_layer.weight`).

NOT RUN in this repository's tests: no GPU. `make test-vllm` checks every call here against the
installed vLLM (tests/conformance/: each AsyncLLM method bound to its real signature with the exact
arguments passed, `AsyncEngineArgs(**engine_args(...))`, `SamplingParams`, `LoRARequest`,
`WeightTransferConfig`, the request dataclasses), and the adapter directory loads with real peft onto
the base and computes the trainer's logits (tests/integration/test_vllm_lora_adapter.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from rljob_trainer import config as config_mod
from rljob_trainer.engines import base, platform
from rljob_trainer.model import lora_adapter

log = logging.getLogger(__name__)

T = TypeVar("T")


def _reload_weights_on_worker(worker: Any, *, path: str) -> int:
    """Runs inside each vLLM worker process (collective_rpc passes the worker first): loads the
    weights file the engine wrote (`write_weights_file`), memory-mapped, so each tensor is read when
    the model's loader asks for it.

    Only the path travels in the callable (`functools.partial(..., path=...)`): vLLM's engine-core
    channel pickles a callable with everything bound to it and copies it through ZeroMQ, 2.2 s for
    SmolLM2-135M's 326 MB of bf16 tensors on two cores, against 0.25 s for the load itself (a file on
    tmpfs: 0.2 s to write). `Worker.reload_weights` (0.32 and 0.33 alike) loads checkpoint-format
    tensors through the model's own loader and then redoes the platform's post-load processing:
    `model.load_weights` alone fails on CPU once the backend has repacked its linear weights
    ('Parameter' object has no attribute 'weight_loader'). It shards full tensors for tensor
    parallelism and fuses q/k/v and gate/up as a checkpoint load does."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        names = list(f.keys())
        worker.reload_weights(weights_iterator=((n, f.get_tensor(n)) for n in names))
    return len(names)


def write_weights_file(weights: Sequence[tuple[str, Any]], root: str | os.PathLike[str]) -> str:
    """The named tensors as one safetensors file under `root` (the engine's scratch: tmpfs where the
    pod has it), for this engine's vLLM workers to load (`_reload_weights_on_worker`); the caller
    deletes it. Tensors that share storage (tied embeddings at the trainer's own dtype) are written
    as copies: safetensors refuses shared storage."""
    from safetensors.torch import save_file

    tensors: dict[str, Any] = {}
    storages: set[int] = set()
    for name, tensor in weights:
        t = tensor.detach().contiguous()
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if ptr in storages else t
        storages.add(ptr)
    fd, path = tempfile.mkstemp(prefix="rljob-weights-", suffix=".safetensors", dir=root)
    os.close(fd)
    try:
        save_file(tensors, path)
    except BaseException:
        os.unlink(path)
        raise
    return path


def _lora_request(adapter: lora_adapter.AdapterVersion) -> Any:
    """vLLM's LoRARequest for one adapter version (what add_lora registers, what generate names)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=adapter.name, lora_int_id=adapter.lora_int_id, lora_path=str(adapter.path))


def lora_engine_args(cfg: config_mod.TrainerConfig) -> dict[str, Any]:
    """The engine arguments of an engine that serves the trainer's LoRA adapter (none without)."""
    if not cfg.rollout.engine_lora:
        return {}
    # One adapter at a time: the policy. vLLM refuses a max_lora_rank outside its list: rounded up.
    rank = config_mod.vllm_max_lora_rank(cfg.model.lora.rank)
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1}


#: HF `layer_types` of layers that keep a recurrent state rather than a KV cache (Qwen3.5's Gated
#: DeltaNet, Mamba layers of hybrid models).
STATE_SPACE_LAYER_TYPES = frozenset({"linear_attention", "mamba"})


def has_state_space_layers(model: str) -> bool:
    """Whether the model directory's config.json (or its text_config) declares layers vLLM serves
    from a mamba-style state cache; False where there is no config.json to read."""
    try:
        hf = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    text = hf.get("text_config") or hf
    return bool(STATE_SPACE_LAYER_TYPES.intersection(text.get("layer_types") or ()))


def engine_args(
    cfg: config_mod.TrainerConfig,
    *,
    model: str,
    sleep_enabled: bool,
    transfer_backend: str | None = None,
    tp_workers_in_placement_group: bool = False,
    capabilities: platform.EngineCapabilities | None = None,
) -> dict[str, Any]:
    """The `vllm.AsyncEngineArgs` keywords of one engine (plain values; `WeightTransferConfig` is
    built from `weight_transfer_backend` at load). Pure: tests build `AsyncEngineArgs` from it and
    vLLM's own `create_engine_config()` checks it. `capabilities` (what the platform said,
    `platform.probe`) adds what that platform needs: a KV cache sized in bytes where it lives in host
    memory, eager execution where vLLM captures no static graphs (unless `rollout.enforceEager` says)."""
    r, lengths = cfg.rollout, cfg.lengths
    args: dict[str, Any] = {
        "model": model,
        "dtype": cfg.model.dtype,
        "tensor_parallel_size": r.tensor_parallel,
        "gpu_memory_utilization": r.gpu_memory_utilization,
        "max_num_seqs": r.max_num_seqs,
        "max_num_batched_tokens": r.max_num_batched_tokens,
        "max_model_len": lengths.max_model_len_tokens,
        "enable_sleep_mode": sleep_enabled,
        "seed": cfg.grpo.seed,
        # vLLM returns raw log-probs (before temperature/top-p) unless asked; the trainer compares
        # with the distribution the sample was drawn from.
        "logprobs_mode": "processed_logprobs",
        "disable_log_stats": True,
        # spec.model.source.hub.revision: the weights and the tokenizer of that commit, as the trainer's.
        "revision": cfg.model.hub_revision,
        "tokenizer_revision": cfg.model.hub_revision,
    }
    caps = capabilities
    if r.enforce_eager is not None:
        args["enforce_eager"] = r.enforce_eager
    elif caps is not None and not caps.static_graphs:
        # Without CUDA graphs compiling buys little for RL's short engine lives and costs a torch
        # inductor compile at every start (CPU: 18 s eager, 54 s compiled for the tiny model).
        args["enforce_eager"] = True
    if caps is not None and not caps.seeded_chunked_prefill:
        # Every request is seeded: a prompt split over two scheduler steps would kill the EngineCore
        # (`platform.EngineCapabilities.seeded_chunked_prefill`). Unchunked, a prompt waits for a step
        # with room for all of it, which needs a batch of at least one whole sequence.
        args["enable_chunked_prefill"] = False
        args["max_num_batched_tokens"] = max(r.max_num_batched_tokens, lengths.max_model_len_tokens)
        if has_state_space_layers(model):
            # vLLM caches a hybrid model's prefixes in mamba cache mode "align", which needs chunked
            # prefill: without it, no prefix caching (mamba cache mode "none").
            args["enable_prefix_caching"] = False
    if caps is not None and caps.host_memory_kv and r.cpu_kv_cache_bytes is not None:
        # vLLM's CPU backend reserves gpu_memory_utilization x the host's memory unless told the bytes.
        args["kv_cache_memory_bytes"] = r.cpu_kv_cache_bytes
    if tp_workers_in_placement_group:
        # A shared engine of TP > 1: vLLM's Ray executor puts one worker on each bundle named in
        # VLLM_RAY_BUNDLE_INDICES of this actor's placement group (runtimes.RayRuntime sets it).
        args["distributed_executor_backend"] = "ray"
    if cfg.rollout.engine_lora and cfg.model.finetune == "lora":
        args.update(lora_engine_args(cfg))
    if transfer_backend is not None:
        args["weight_transfer_backend"] = transfer_backend
    return args


def sampling_kwargs(
    sampling: base.SamplingSettings, seed: int, max_tokens: int | None = None
) -> dict[str, Any]:
    """The `vllm.SamplingParams` keywords of one request (its own seed; its own token budget, the
    rest of it for a request resumed after an interrupt)."""
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens if max_tokens is None else int(max_tokens),
        "seed": int(seed),
        "logprobs": 0,  # the sampled token's log-prob
        "stop_token_ids": list(sampling.stop_token_ids) or None,
        "ignore_eos": sampling.ignore_eos,
    }


def needs_pickle(transfer: Any) -> bool:
    """Whether this engine's weight path sends what vLLM's msgpack channel to its engine core refuses
    without VLLM_ALLOW_INSECURE_SERIALIZATION: a Python callable (the collective_rpc fallback) or CUDA
    IPC handles (classes and dtypes in `reduce_tensor`'s rebuild arguments). Both stay inside the
    engine's own processes; no other engine allows pickle."""
    from rljob_trainer.weights import weight_sync

    if transfer.path == weight_sync.PATH_COLLECTIVE_RPC:
        return True
    return transfer.path == weight_sync.PATH_VLLM_NATIVE and transfer.backend == "ipc"


def _pause_refusal() -> type[BaseException] | tuple[()]:
    """What vLLM raises for a request submitted while generation is paused in mode "abort"
    (`RetryableRequestError`, 0.33); vLLM 0.23 (the Ascend image) queues such a request instead."""
    try:
        from vllm.exceptions import RetryableRequestError
    except ImportError:
        return ()
    return RetryableRequestError


class EngineCallTimeout(RuntimeError):
    """A call into vLLM did not finish within rollout.engineTimeoutS."""


class EngineCoreGone(RuntimeError):
    """vLLM says its engine core is dead (`AsyncLLM.errored`) while a call waits for it."""


# How often a waiting call asks vLLM whether its engine core is still alive.
DEAD_CHECK_S = 1.0


def _engine_dead_errors() -> tuple[type[BaseException], ...]:
    """What the installed vLLM raises once its engine core process is gone (`EngineDeadError`)."""
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:
        return ()
    return (EngineDeadError,)


class _Loop:
    """A private asyncio loop on a daemon thread; AsyncLLM lives on it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"{name}-vllm", daemon=True)
        self._thread.start()

    def run(
        self,
        coro: Coroutine[Any, Any, T],
        timeout_s: float | None = None,
        dead: Callable[[], bool] | None = None,
    ) -> T:
        """The coroutine's result, waited for in slices of DEAD_CHECK_S: where `dead()` says the engine
        core is gone the call is given up at once (vLLM never answers a utility call, such as a
        weight reload, whose EngineCore was killed while it ran: it would wait out `timeout_s`)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = DEAD_CHECK_S if deadline is None else min(DEAD_CHECK_S, deadline - time.monotonic())
            try:
                return future.result(max(0.0, wait))
            except concurrent.futures.TimeoutError:
                if dead is not None and dead():
                    future.cancel()
                    raise EngineCoreGone("its EngineCore exited while a call was in flight") from None
                if deadline is not None and time.monotonic() >= deadline:
                    future.cancel()
                    raise EngineCallTimeout(f"vLLM call did not finish within {timeout_s:.0f} s") from None


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
        self._loop: _Loop | None = None
        self._state = base.SleepState(name, sleep_enabled=colocated and cfg.rollout.enable_sleep_mode)
        self._version = 0
        self._served = 0
        self._tokens = 0
        self._transfer: Any = None  # weight_sync.WeightTransferChoice, decided at load()
        self.serves_lora = cfg.rollout.engine_lora and cfg.model.finetune == "lora"
        self._adapters: lora_adapter.AdapterStore | None = None
        self._adapter: lora_adapter.AdapterVersion | None = None  # what generate() serves
        self._request_ids = itertools.count()
        self._inflight: set[str] = set()
        self._timeout_s = cfg.rollout.engine_timeout_s
        self._pause = base.PauseState(name)  # partial rollouts: interrupt() / resume()
        self._caps: platform.EngineCapabilities | None = None
        self._engine_kwargs: dict[str, Any] | None = None  # decided at load(), kept for restarts
        self.starts = 0  # engine starts: 1 + restarts to wake from a sleep the platform lacks
        self.last_start_s: float | None = None  # seconds the last start took

    @property
    def capabilities(self) -> platform.EngineCapabilities:
        """What the installed vLLM says it can do here (`platform.probe`), asked once."""
        if self._caps is None:
            self._caps = probe_or_raise(self.name)
        return self._caps

    @property
    def sleeps_by_restart(self) -> bool:
        """Sleep on a platform without sleep mode: the engine is shut down (its memory freed) and
        started again on wake, never trusted to sleep (vLLM 0.32 on CPU: sleep() does nothing and
        AsyncLLM.is_sleeping() then says True)."""
        return self._state.sleep_enabled and not self.capabilities.sleep_mode

    @property
    def weight_transfer(self) -> Any:
        """How this engine takes weights (`weight_sync.WeightTransferChoice`), decided at load()."""
        if self._transfer is None:
            from rljob_trainer.weights import weight_sync

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
        if self._model_path:
            return self._model_path
        from rljob_trainer.model import modeling

        # A tiny model's later weights arrive through a weight transfer, never through disk.
        return model_folder(
            self._cfg,
            self.name,
            lambda: modeling.build_base_model(self._cfg.model, init_seed=self._cfg.grpo.seed),
        )

    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        if self._loop is None:
            raise RuntimeError(f"engine {self.name}: load() has not been called")
        try:
            return self._loop.run(coro, timeout_s, dead=self._core_dead)
        except (EngineCoreGone, *_engine_dead_errors()) as e:
            raise base.EngineDiedError(
                f"engine {self.name}: vLLM's engine core died ({type(e).__name__}: {e}); the engine "
                "cannot serve again and is replaced"
            ) from e

    def _core_dead(self) -> bool:
        """vLLM's own word (`AsyncLLM.errored`: its engine core process exited, or its output handler
        failed)."""
        llm = self._llm
        return llm is not None and bool(llm.errored)

    def _llm_or_raise(self) -> Any:
        if self._llm is None:
            raise base.EngineAsleepError(f"engine {self.name} is stopped (asleep); wake() it first")
        return self._llm

    def load(self) -> dict[str, Any]:
        """Decide the engine arguments and start vLLM; returns what the platform can do
        (`EngineCapabilities` as a dict) for the driver and the telemetry. A shared engine whose
        platform has no sleep mode is not started here: the driver puts it to sleep at once, which on
        such a platform means stopped; it starts when first woken."""
        caps = self.capabilities
        if self._engine_kwargs is not None:
            return caps.to_dict()
        from rljob_trainer.weights import weight_sync

        check_head_size(self._cfg.model.hf_config, caps, name=self.name, field="spec.model")
        transfer = self.weight_transfer
        if needs_pickle(transfer):
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        if caps.host_memory_kv:
            # "auto" pins the worker's threads to a core of every physical core of the NUMA node: on a
            # small machine (or a pod sharing a node) under the trainer's own threads. The OS places
            # them instead, OMP_NUM_THREADS as Ray sets it for the actor (its CPUs).
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        self._engine_kwargs = engine_args(
            self._cfg,
            model=self._resolve_model_path(),
            sleep_enabled=self._state.sleep_enabled and caps.sleep_mode,
            transfer_backend=transfer.backend if transfer.path == weight_sync.PATH_VLLM_NATIVE else None,
            tp_workers_in_placement_group=self._tp_in_group,
            capabilities=caps,
        )
        if self.serves_lora:
            self._adapters = lora_adapter.AdapterStore(self.name)
        self._loop = _Loop(self.name)
        if self.sleeps_by_restart and self.colocated:
            self._state.on_sleep(2)  # asleep from the start: stopped, nothing of it in memory
            self._state.weights_valid = self.serves_lora  # see sleep(): a restart reloads the folder
            return caps.to_dict()
        self._start()
        return caps.to_dict()

    def _start(self) -> None:
        """Start AsyncLLM (EngineCore and its workers: processes of their own) from the kept args."""
        if self._loop is None or self._engine_kwargs is None:
            raise RuntimeError(f"engine {self.name}: load() has not been called")
        t0 = time.monotonic()
        self._llm = self._run(self._build(self._engine_kwargs))
        self.starts += 1
        self.last_start_s = time.monotonic() - t0
        log.info("engine %s: vLLM started in %.1f s (start %d)", self.name, self.last_start_s, self.starts)

    def _stop(self) -> None:
        """Shut vLLM down (its processes exit, their memory freed); what it served is gone with it."""
        llm, self._llm = self._llm, None
        self._inflight.clear()
        self._adapter = None  # vLLM's adapters went with it; the driver re-adds the current one
        if llm is not None:
            llm.shutdown()

    @staticmethod
    async def _build(kwargs: dict[str, Any]) -> Any:
        # Built on the loop that will run it: AsyncLLM starts its output handler on the running loop.
        from vllm.config import WeightTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = dict(kwargs)
        backend = kwargs.pop("weight_transfer_backend", None)
        if backend is not None:
            kwargs["weight_transfer_config"] = WeightTransferConfig(backend=backend)
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

    @property
    def is_sleeping(self) -> bool:
        return not self._state.fully_awake

    @property
    def sleep_state(self) -> base.SleepState:
        return self._state

    @property
    def weights_version(self) -> int:
        return self._version

    @property
    def pause_state(self) -> base.PauseState:
        return self._pause

    # ---- generation ------------------------------------------------------------------------------
    def generate(
        self, prompts_token_ids: Sequence[Sequence[int]], sampling: base.SamplingSettings
    ) -> list[base.GenerationOutput]:
        self._state.check_generate()
        if not prompts_token_ids:
            return []
        meta = {"engine": self.name, "version": self._version}
        return self._pause.run_generate(
            prompts_token_ids, meta, lambda: self._generate(prompts_token_ids, sampling)
        )

    def _generate(
        self, prompts_token_ids: Sequence[Sequence[int]], sampling: base.SamplingSettings
    ) -> list[base.GenerationOutput]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        seeds = sampling.seeds or tuple(range(len(prompts_token_ids)))
        params = [
            SamplingParams(**sampling_kwargs(sampling, s, sampling.budget(i))) for i, s in enumerate(seeds)
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts_token_ids]
        lora = _lora_request(self._adapter) if self._adapter is not None else None
        ids = [f"{self.name}-{next(self._request_ids)}" for _ in prompts]
        finals = self._run(self._generate_all(prompts, params, ids, lora))
        results = []
        for p, o in zip(prompts_token_ids, finals, strict=True):
            if o is None:  # refused by vLLM's pause (submitted as it began): aborted before a token
                results.extend(base.aborted_outputs([p], {"engine": self.name, "version": self._version}))
                continue
            c = o.outputs[0]
            toks = tuple(int(t) for t in c.token_ids)
            lps = tuple(float(c.logprobs[i][t].logprob) for i, t in enumerate(toks)) if c.logprobs else ()
            reason = c.finish_reason if c.finish_reason in ("stop", "abort") else "length"
            meta = {"engine": self.name, "version": self._version, "request_id": o.request_id}
            results.append(base.GenerationOutput(tuple(p), toks, lps, reason, meta))
        self._served += len(results)
        self._tokens += sum(len(r.token_ids) for r in results)
        return results

    async def _generate_all(
        self, prompts: list[Any], params: list[Any], ids: list[str], lora: Any
    ) -> list[Any]:
        refused = _pause_refusal()

        async def one(prompt: Any, param: Any, request_id: str) -> Any:
            self._inflight.add(request_id)
            final = None
            try:
                async for out in self._llm.generate(prompt, param, request_id, lora_request=lora):
                    final = out
            except refused:
                return None  # vLLM refuses new requests while paused (mode "abort"): not a failure
            finally:
                self._inflight.discard(request_id)
            return final

        return list(
            await asyncio.gather(*(one(p, s, i) for p, s, i in zip(prompts, params, ids, strict=True)))
        )

    # ---- partial rollouts (vLLM's pause / abort / resume) ----------------------------------------
    supports_partial_rollouts = True

    def interrupt(self) -> None:
        """The engine contract's interrupt (`base.RolloutEngine.interrupt`) on vLLM's RL API:
        `pause_generation(mode="abort")` ends every request in flight with the tokens it has
        (finish_reason "abort") and clears the KV cache (a resumed request is prefilled again under
        the new weights); returns once no generate call runs. A request submitted as the pause began
        (refused by vLLM 0.33, queued by 0.23) is aborted by id."""
        paused = False

        def stop_running() -> None:
            nonlocal paused
            if not paused:
                self.pause_generation(mode="abort", clear_cache=True)
                paused = True
            elif self._inflight:
                self.abort_requests()

        self._pause.pause(self._timeout_s, stop_running)

    def resume(self) -> None:
        """vLLM schedules again (`resume_generation`), then generate() calls are taken again."""
        self.resume_generation()
        self._pause.resume()

    def pause_generation(self, mode: str = "keep", clear_cache: bool = True) -> None:
        """Stop scheduling: "keep" freezes in-flight requests (they go on at `resume_generation`),
        "abort" ends them (finish_reason "abort", tokens so far returned), "wait" lets them finish.
        New requests wait (keep) or are refused (abort, wait) until resumed."""
        self._run(self._llm.pause_generation(mode=mode, clear_cache=clear_cache), self._timeout_s)

    def resume_generation(self) -> None:
        self._run(self._llm.resume_generation(), self._timeout_s)

    def is_paused(self) -> bool:
        return bool(self._run(self._llm.is_paused(), self._timeout_s))

    def abort_requests(self, request_ids: Sequence[str] | None = None) -> list[str]:
        """End `request_ids` (every request in flight when None); returns the ids aborted."""
        ids = sorted(self._inflight) if request_ids is None else list(request_ids)
        if ids:
            self._run(self._llm.abort(ids), self._timeout_s)
        return ids

    def inflight_request_ids(self) -> list[str]:
        return sorted(self._inflight)

    # ---- sleep -----------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep where the platform has it; elsewhere (`sleeps_by_restart`) the engine shuts
        down, which frees its memory and, at any level, loses the weights loaded since it started
        (a LoRA-serving engine keeps its frozen base, which it reloads from the model folder, and
        loses its adapter, which the driver re-adds)."""
        if self.is_sleeping:
            return
        if self.serves_lora and level == 2:  # see the module docstring; config load refuses it first
            raise base.EngineStateError(
                f"engine {self.name} serves LoRA on vLLM: sleep level 2 would discard the base weights, "
                "which rljob cannot reload into vLLM's LoRA layers; use rollout.sleepLevel 1"
            )
        self._state.on_sleep(level)
        if self.sleeps_by_restart:
            self._stop()
            self._state.weights_valid = self.serves_lora
            return
        self._run(self._llm.sleep(level=level), self._timeout_s)

    def wake(self, tags: Sequence[str] | None = None) -> None:
        new = self._state.on_wake(tags)
        if self.sleeps_by_restart:
            if new and self._llm is None:
                self._start()  # the weights the trainer has come with the next update_weights
            return
        if new:  # only the tags still asleep: vLLM ignores a whole wake_up naming an awake tag
            self._run(self._llm.wake_up(tags=sorted(new)), self._timeout_s)
        if "kv_cache" in new:
            self._run(self._llm.reset_prefix_cache(), self._timeout_s)  # nothing cached before the sleep

    # ---- weights: the named fallback (collective_rpc) and LoRA adapters --------------------------
    def update_weights(
        self, named_tensors: Iterable[tuple[str, Any]] | dict[str, Any], version: int | None = None
    ) -> int:
        self._state.check_update()
        self._pause.check_update()
        weights = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        if self.serves_lora:
            return self._update_adapter(dict(weights), version)
        llm = self._llm_or_raise()
        path = write_weights_file(weights, lora_adapter.scratch_root())
        try:
            reload = functools.partial(_reload_weights_on_worker, path=path)
            self._run(llm.collective_rpc(reload, timeout=self._timeout_s), self._timeout_s)
        finally:
            os.unlink(path)
        if self._state.fully_awake:
            self._run(self._llm.reset_prefix_cache(), self._timeout_s)  # KV of the old weights
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
        try:
            if not self._run(self._llm.add_lora(_lora_request(adapter)), self._timeout_s):
                raise RuntimeError(f"engine {self.name}: vLLM did not add LoRA adapter {adapter.name}")
        except BaseException:
            self._adapters.retire(adapter)  # the previous adapter stays current
            raise
        previous, self._adapter = self._adapter, adapter
        if previous is not None:
            self._run(self._llm.remove_lora(previous.lora_int_id), self._timeout_s)
            self._adapters.retire(previous)
        if self._state.fully_awake:
            self._run(self._llm.reset_prefix_cache(), self._timeout_s)
        self._state.weights_valid = True
        self._version = new_version
        return len(tensors)

    def adapter_version(self) -> int | None:
        """The weights version of the LoRA adapter vLLM serves now; None when it serves none (never
        added, or lost: vLLM no longer lists its id)."""
        if self._adapter is None:
            return None
        listed = self._run(self._llm.list_loras(), self._timeout_s)
        if self._adapter.lora_int_id not in listed:
            return None
        return self._version

    # ---- vLLM's weight-transfer API, engine side (weight_sync.PATH_VLLM_NATIVE) ------------------
    def world_size(self) -> int:
        """The engine's workers (the ranks after the trainer's in an nccl weight-transfer group)."""
        return self._cfg.rollout.tensor_parallel

    def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's channel (nccl: blocks until the trainer side joins too; ipc: records the
        must-agree `packed`)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        request = WeightTransferInitRequest(init_info=init_info)
        self._run(self._llm.init_weight_transfer_engine(request), self._timeout_s)

    def start_weight_update(self) -> None:
        """Start one update round; refused while the weights sleep, as `update_weights` is."""
        if self.serves_lora:  # weight_sync.choose_weight_transfer never picks this path for LoRA
            raise base.EngineStateError(
                f"engine {self.name} serves LoRA: it takes adapters, not full weights"
            )
        self._state.check_update()
        self._pause.check_update()
        self._run(self._llm.start_weight_update(), self._timeout_s)

    def receive_weight_update(self, update_info: dict[str, Any]) -> None:
        """One chunk of the round (nccl: the trainer broadcasts meanwhile; ipc: handles to map)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._state.check_update()
        request = WeightTransferUpdateRequest(update_info=update_info)
        self._run(self._llm.update_weights(request), self._timeout_s)

    def finish_weight_update(self, version: int) -> None:
        """End the round: the new weights serve from now on, as weights version `version`."""
        self._run(self._llm.finish_weight_update(), self._timeout_s)
        if self._state.fully_awake:
            self._run(self._llm.reset_prefix_cache(), self._timeout_s)
        self._state.weights_valid = True
        self._version = int(version)

    def load_report(self) -> base.EngineLoad:
        return base.EngineLoad(self.name, self.is_sleeping, self._served, self._tokens)

    def start_report(self) -> dict[str, Any]:
        """How often vLLM started and how long the last start took (a wake by restart is a start)."""
        return {"starts": self.starts, "last_start_s": self.last_start_s}

    def engine_core_pids(self) -> list[int]:
        """The pids of vLLM's engine-core processes, from vLLM's own process manager (none while
        stopped). Their process title is not a reliable handle: a CI run found an EngineCore that
        still read `python`."""
        core = getattr(self._llm, "engine_core", None)
        manager = getattr(getattr(core, "resources", None), "engine_manager", None)
        return [p.pid for p in getattr(manager, "processes", []) if p.pid is not None]

    def shutdown(self) -> None:
        """Stop vLLM's processes (the actor is going away)."""
        self._stop()


def probe_or_raise(name: str) -> platform.EngineCapabilities:
    """What the installed vLLM can do here (`platform.probe`); an image without vLLM is named."""
    caps = platform.probe()
    if caps is None:
        raise RuntimeError(
            f"engine {name}: rollout.kind is vllm but vLLM is not installed in this image "
            "(use the trainer image's CUDA, CPU or Ascend flavour, or rollout.kind transformers)"
        )
    return caps


def check_head_size(
    hf_config: dict[str, Any] | None, caps: platform.EngineCapabilities, *, name: str, field: str
) -> None:
    """Refuse, naming `field`, a model whose head size the platform's attention does not take."""
    head_dim = _head_dim(hf_config)
    if caps.head_sizes and head_dim is not None and head_dim not in caps.head_sizes:
        raise ValueError(
            f"engine {name}: vLLM {caps.vllm_version}'s attention on {caps.device_type} supports "
            f"head sizes {list(caps.head_sizes)}, and this model's head_dim is {head_dim} ({field}); "
            "use a model with a supported head size, or spec.resources.rollout.kind transformers"
        )


def model_folder(cfg: config_mod.TrainerConfig, name: str, build: Callable[[], Any]) -> str:
    """Where vLLM loads `cfg.model` from: its volume path or hub id, or for a tiny model (no files) a
    folder written once with `build()`'s config and initial weights and the tokenizer."""
    m = cfg.model
    if m.source == "pvc":
        return str(m.path)
    if m.source == "hub":
        return str(m.hub_id)
    from rljob_trainer.model import modeling

    out = tempfile.mkdtemp(prefix=f"rljob-{name}-")
    build().save_pretrained(out)
    modeling.load_tokenizer(m).save_pretrained(out)
    return out


def _head_dim(hf_config: dict[str, Any] | None) -> int | None:
    """The attention head size of a Hugging Face config (its text config's for a multimodal model)."""
    if not hf_config:
        return None
    text = hf_config.get("text_config") or hf_config
    if text.get("head_dim"):
        return int(text["head_dim"])
    heads = text.get("num_attention_heads")
    return int(text["hidden_size"]) // int(heads) if heads and text.get("hidden_size") else None

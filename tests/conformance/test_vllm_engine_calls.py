"""Every AsyncLLM call `engines.vllm_engine.VLLMEngine` makes, bound to the installed vLLM's signatures
with the exact arguments it passes; the engine's arguments, sampling parameters, LoRA requests and
weight-transfer requests built with vLLM's own classes. See conftest.py."""

from __future__ import annotations

import inspect
import os
import typing
from typing import Any

import pytest
import torch
from spy import SignatureSpy
from trainer_configs import toy_config

from rljob_trainer import config as config_mod
from rljob_trainer.engines import base, platform, vllm_engine
from rljob_trainer.model import modeling


def _cfg(**rollout: Any) -> config_mod.TrainerConfig:
    return toy_config(rollout={"kind": "vllm", "engineTimeoutS": 30, **rollout})


def _lora_cfg(rank: int = 4) -> config_mod.TrainerConfig:
    return toy_config(
        model={"finetune": "lora", "lora": {"rank": rank}},
        rollout={
            "kind": "vllm",
            "engineLora": True,
            "sharedEngines": 1,
            "sleepLevel": 1,
            "engineTimeoutS": 30,
        },
    )


def _request_output(
    arguments: dict[str, Any], *, tokens_made: int | None = None, finish_reason: str = "length"
) -> Any:
    """What AsyncLLM.generate yields last for one request, built with vLLM's own output classes: its
    whole budget, or `tokens_made` tokens when it was aborted."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    n = arguments["sampling_params"].max_tokens if tokens_made is None else tokens_made
    tokens = [3 + i for i in range(n)]
    completion = CompletionOutput(
        index=0,
        text="",
        token_ids=tokens,
        cumulative_logprob=None,
        logprobs=[{t: Logprob(logprob=-0.25)} for t in tokens],
        finish_reason=finish_reason,
    )
    prompt = arguments["prompt"]
    return RequestOutput(
        request_id=arguments["request_id"],
        prompt=None,
        prompt_token_ids=list(prompt["prompt_token_ids"]),
        prompt_logprobs=None,
        outputs=[completion],
        finished=True,
    )


@pytest.fixture
def spy() -> SignatureSpy:
    from vllm.v1.engine.async_llm import AsyncLLM

    return SignatureSpy(
        AsyncLLM,
        results={
            "generate": _request_output,
            "add_lora": True,
            "remove_lora": True,
            "wake_up": True,
            "reset_prefix_cache": True,
            "is_paused": False,
        },
    )


def _engine(cfg: config_mod.TrainerConfig, spy: SignatureSpy, *, colocated: bool) -> vllm_engine.VLLMEngine:
    engine = vllm_engine.VLLMEngine(cfg, name="shared-0" if colocated else "dedicated-0", colocated=colocated)
    engine._loop = vllm_engine._Loop(engine.name)  # load() would start AsyncLLM: no GPU here
    engine._llm = spy
    # The images this tier checks run on GPUs and NPUs, whose vLLM sleeps in place; probing this
    # GPU-less machine would say otherwise (sleep by restart: tests/integration/test_vllm_engine.py).
    engine._caps = platform.EngineCapabilities(
        vllm_version="conformance",
        device_type="cuda",
        sleep_mode=True,
        weight_transfer_backends=("nccl", "ipc"),
    )
    return engine


def test_the_installed_vllm_is_the_one_the_image_lock_pins(vllm_version: str) -> None:
    from conftest import pinned

    # The Ascend image builds vLLM from its sdist with VLLM_TARGET_DEVICE=empty: "0.23.0+empty".
    assert vllm_version.split("+")[0] == pinned("vllm")


@pytest.mark.parametrize(
    ("rollout", "colocated", "transfer"),
    [
        ({"sharedEngines": 1}, True, "ipc"),
        ({"sharedEngines": 0, "dedicatedEngines": 1}, False, "nccl"),
        ({"sharedEngines": 0, "dedicatedEngines": 1, "tensorParallel": 2}, False, None),
    ],
)
def test_the_engine_arguments_are_ones_vllm_takes(
    rollout: dict[str, Any], colocated: bool, transfer: str | None, tmp_path: Any, monkeypatch: Any
) -> None:
    from vllm.config import CacheConfig, WeightTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    cfg = _cfg(**rollout)
    modeling.build_base_model(cfg.model, init_seed=0).save_pretrained(tmp_path)
    modeling.load_tokenizer(cfg.model).save_pretrained(tmp_path)
    kwargs = vllm_engine.engine_args(
        cfg,
        model=str(tmp_path),
        sleep_enabled=colocated,
        transfer_backend=transfer,
        tp_workers_in_placement_group=cfg.rollout.tensor_parallel > 1,
    )
    accepted = set(inspect.signature(AsyncEngineArgs).parameters)
    backend = kwargs.pop("weight_transfer_backend", None)
    assert set(kwargs) <= accepted, sorted(set(kwargs) - accepted)
    if backend is not None:
        assert "weight_transfer_config" in accepted
        kwargs["weight_transfer_config"] = WeightTransferConfig(backend=backend)
    args = AsyncEngineArgs(**kwargs)
    # This machine has no accelerator platform; the image's CUDA platform has sleep mode.
    from vllm.config import model as model_config

    monkeypatch.setattr(model_config.current_platform, "is_sleep_mode_available", lambda: True)
    # The configs vLLM builds from them without a device: the model (dtype, max_model_len, logprobs
    # mode, sleep mode against the tiny model's files) and the cache (gpu_memory_utilization).
    model = args.create_model_config()
    assert model.logprobs_mode == "processed_logprobs" and model.enable_sleep_mode == colocated
    assert model.max_model_len == cfg.lengths.max_model_len_tokens
    CacheConfig(gpu_memory_utilization=kwargs["gpu_memory_utilization"])
    if cfg.rollout.tensor_parallel > 1:
        from vllm.config.parallel import DistributedExecutorBackend

        assert kwargs["distributed_executor_backend"] in typing.get_args(DistributedExecutorBackend)


def test_logprobs_mode_and_lora_ranks_are_values_vllm_allows() -> None:
    from vllm.config import LoRAConfig
    from vllm.config.lora import MaxLoRARanks
    from vllm.config.model import LogprobsMode

    assert "processed_logprobs" in typing.get_args(LogprobsMode)
    assert typing.get_args(MaxLoRARanks) == config_mod.VLLM_MAX_LORA_RANKS
    for rank in (1, 4, 9, 300, 512):
        args = vllm_engine.lora_engine_args(_lora_cfg(rank))
        LoRAConfig(max_lora_rank=args["max_lora_rank"], max_loras=args["max_loras"])


def test_weight_transfer_backends_are_ones_vllm_accepts() -> None:
    from vllm.config import WeightTransferConfig

    for backend in ("nccl", "ipc"):
        assert WeightTransferConfig(backend=backend).backend == backend


def test_generate_passes_tokens_prompts_and_sampling_params_vllm_takes(spy: SignatureSpy) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = _engine(_cfg(), spy, colocated=False)
    sampling = base.SamplingSettings(
        temperature=0.7, top_p=0.9, max_tokens=3, seeds=(11, 12), stop_token_ids=(2,)
    )
    out = engine.generate([[5, 6], [7]], sampling)
    calls = spy.called("generate")
    assert len(calls) == 2 and len({c["request_id"] for c in calls}) == 2
    for call, seed in zip(calls, (11, 12), strict=True):
        params = call["sampling_params"]
        assert isinstance(params, SamplingParams)
        assert (params.temperature, params.top_p, params.max_tokens, params.seed) == (0.7, 0.9, 3, seed)
        assert params.logprobs == 0 and params.stop_token_ids == [2]
        assert call["lora_request"] is None
        assert set(call["prompt"]) <= set(typing.get_type_hints(TokensPrompt))
    # What rljob reads from vLLM's RequestOutput: token ids, the sampled token's log-prob, the reason.
    assert [o.token_ids for o in out] == [(3, 4, 5), (3, 4, 5)]
    assert out[0].logprobs == (-0.25, -0.25, -0.25) and out[0].finish_reason == "length"
    assert out[0].meta["request_id"] == calls[0]["request_id"]


def test_sleep_and_wake_follow_vllms_rl_order(spy: SignatureSpy) -> None:
    engine = _engine(_cfg(sharedEngines=1), spy, colocated=True)
    engine.sleep(2)
    engine.wake(["weights"])
    engine.wake(["kv_cache"])
    assert spy.called("sleep") == [{"level": 2}]
    assert spy.called("wake_up") == [{"tags": ["weights"]}, {"tags": ["kv_cache"]}]
    assert spy.called("reset_prefix_cache") == [{}]


def test_the_collective_rpc_fallback_sends_a_weights_files_path_with_a_timeout(spy: SignatureSpy) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    embed = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    weights = {"embed.weight": embed, "lm_head.weight": embed, "norm.weight": torch.ones(3)}
    loaded: list[tuple[str, torch.Tensor]] = []

    class Worker:  # vLLM's Worker.reload_weights forwards to its model runner's: bound to that signature
        def reload_weights(self, *args: Any, **kwargs: Any) -> None:
            bound = inspect.signature(GPUModelRunner.reload_weights).bind(None, *args, **kwargs)
            loaded.extend(bound.arguments["weights_iterator"])

    def run_on_workers(arguments: dict[str, Any]) -> list[int]:
        return [arguments["method"](Worker())]  # what each worker process does with the callable

    spy.results["collective_rpc"] = run_on_workers
    engine = _engine(_cfg(), spy, colocated=False)
    assert engine.update_weights(weights, version=4) == 3
    (call,) = spy.called("collective_rpc")
    reload = call["method"]  # only the file's path is bound: the tensors never cross vLLM's channel
    assert reload.func is vllm_engine._reload_weights_on_worker and call["timeout"] == 30
    assert set(reload.keywords) == {"path"} and not call.get("args")
    assert not os.path.exists(reload.keywords["path"]), "the engine deletes the file once loaded"
    got = dict(loaded)  # tied tensors (one storage) arrive as two tensors, each the trainer's values
    assert sorted(got) == sorted(weights)
    assert all(torch.equal(got[n], t) and got[n].dtype == t.dtype for n, t in weights.items())
    assert engine.weights_version == 4


def test_the_weight_transfer_calls_build_vllms_requests(spy: SignatureSpy) -> None:
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

    engine = _engine(_cfg(sharedEngines=0, dedicatedEngines=1), spy, colocated=False)
    engine.init_weight_transfer({"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2})
    engine.start_weight_update()
    engine.receive_weight_update({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]})
    engine.finish_weight_update(7)
    (init,) = spy.called("init_weight_transfer_engine")
    assert (
        isinstance(init["request"], WeightTransferInitRequest)
        and init["request"].init_info["world_size"] == 2
    )
    (update,) = spy.called("update_weights")
    assert isinstance(update["request"], WeightTransferUpdateRequest)
    assert spy.called("start_weight_update") == [{}] and spy.called("finish_weight_update") == [{}]
    assert engine.weights_version == 7


def test_a_weight_update_into_sleeping_weights_is_refused_before_vllm_is_called(spy: SignatureSpy) -> None:
    engine = _engine(_cfg(sharedEngines=1), spy, colocated=True)
    engine.sleep(1)
    with pytest.raises(base.EngineAsleepError):
        engine.start_weight_update()
    assert spy.called("start_weight_update") == []


def test_pause_abort_and_resume_are_calls_vllm_takes(spy: SignatureSpy) -> None:
    from vllm.v1.engine.core import PauseMode

    engine = _engine(_cfg(), spy, colocated=False)
    for mode in ("keep", "abort", "wait"):
        assert mode in typing.get_args(PauseMode)
        engine.pause_generation(mode=mode)
    engine.resume_generation()
    assert engine.is_paused() is False
    engine._inflight.update({"dedicated-0-3", "dedicated-0-4"})
    assert engine.abort_requests() == ["dedicated-0-3", "dedicated-0-4"]
    assert spy.called("pause_generation")[0] == {"mode": "keep", "clear_cache": True}
    assert spy.called("abort") == [{"request_id": ["dedicated-0-3", "dedicated-0-4"]}]
    assert spy.called("resume_generation") == [{}]


def test_lora_adapters_are_added_listed_and_removed_with_vllms_lora_request(spy: SignatureSpy) -> None:
    from vllm.lora.request import LoRARequest

    cfg = _lora_cfg()
    engine = _engine(cfg, spy, colocated=True)
    from rljob_trainer.model import lora_adapter

    engine._adapters = lora_adapter.AdapterStore(engine.name)
    peft_model = modeling.apply_finetune_mode(modeling.build_base_model(cfg.model, init_seed=0), cfg.model)
    from peft import get_peft_model_state_dict

    adapter = dict(get_peft_model_state_dict(peft_model))
    engine.update_weights(adapter, version=1)
    engine.update_weights(adapter, version=2)
    added = spy.called("add_lora")
    assert len(added) == 2 and all(isinstance(a["lora_request"], LoRARequest) for a in added)
    assert spy.called("remove_lora") == [{"lora_id": added[0]["lora_request"].lora_int_id}]
    spy.results["list_loras"] = {added[1]["lora_request"].lora_int_id}
    assert engine.adapter_version() == 2
    spy.results["list_loras"] = set()  # lost (vLLM issue 53888)
    assert engine.adapter_version() is None
    engine.generate([[5]], base.SamplingSettings(max_tokens=1))
    assert spy.called("generate")[0]["lora_request"] == added[1]["lora_request"]


def test_only_the_paths_whose_payload_vllm_cannot_msgpack_allow_pickle(monkeypatch: Any) -> None:
    """vLLM's engine-core channel refuses a torch.dtype or a class (what CUDA IPC handles carry) and a
    Python callable unless VLLM_ALLOW_INSECURE_SERIALIZATION is set; NCCL's update info is plain."""
    from vllm.v1.serial_utils import MsgpackEncoder

    from rljob_trainer.weights import weight_sync as ws

    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    MsgpackEncoder().encode({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]})
    with pytest.raises(TypeError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
        MsgpackEncoder().encode({"ipc_handles": [{"uuid": (torch.Tensor, torch.bfloat16)}]})
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    MsgpackEncoder().encode({"ipc_handles": [{"uuid": (torch.Tensor, torch.bfloat16)}]})
    choice = ws.WeightTransferChoice
    assert vllm_engine.needs_pickle(choice(ws.PATH_VLLM_NATIVE, "ipc", ""))
    assert vllm_engine.needs_pickle(choice(ws.PATH_COLLECTIVE_RPC, "object-store", ""))
    assert not vllm_engine.needs_pickle(choice(ws.PATH_VLLM_NATIVE, "nccl", ""))
    assert not vllm_engine.needs_pickle(choice(ws.PATH_VLLM_LORA, "object-store", ""))


# ---- partial rollouts: the engine contract's interrupt/resume on vLLM's pause API ----------------
def _generating(engine: vllm_engine.VLLMEngine, prompts: list[list[int]], sampling: base.SamplingSettings):
    """engine.generate on another thread (as the Ray actor's generate group runs it); returns once its
    requests are in flight, with the thread and a dict that gets the result."""
    import threading
    import time

    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.setdefault("result", engine.generate(prompts, sampling)))
    thread.start()
    deadline = time.monotonic() + 30
    while len(engine.inflight_request_ids()) < len(prompts):
        assert time.monotonic() < deadline, "the requests never reached vLLM"
        time.sleep(0.005)
    return thread, out


def _aborted_by(spy: SignatureSpy, method: str, *, tokens_made: int) -> None:
    """vLLM over time: each generate request runs until the engine calls AsyncLLM.`method`, then
    ends aborted with `tokens_made` tokens."""
    import asyncio

    called = asyncio.Event()

    def generate(arguments: dict[str, Any]) -> Any:
        async def until_called() -> Any:
            await called.wait()
            yield _request_output(arguments, tokens_made=tokens_made, finish_reason="abort")

        return until_called()

    async def mark() -> None:
        called.set()

    spy.results["generate"] = generate
    spy.results[method] = lambda _: mark()


def test_an_interrupt_aborts_what_runs_through_vllms_pause_and_resume_serves_the_rest(
    spy: SignatureSpy,
) -> None:
    """vLLM's pause_generation(mode="abort") ends each request in flight with the tokens it has
    (finish_reason "abort"); the engine returns them, refuses new calls and weight-update rounds
    in between as the contract says, and resume_generation lets it serve the rest of a budget."""
    _aborted_by(spy, "pause_generation", tokens_made=2)  # generating until vLLM's pause, 2 tokens in
    engine = _engine(_cfg(), spy, colocated=False)
    sampling = base.SamplingSettings(temperature=1.0, max_tokens=6, seeds=(1, 2))
    thread, out = _generating(engine, [[5, 6], [7]], sampling)
    with pytest.raises(base.EngineBusyError, match="interrupt"):
        engine.start_weight_update()  # never while a call runs
    engine.interrupt()  # returns once the call has returned
    thread.join(timeout=30)
    assert spy.called("pause_generation") == [{"mode": "abort", "clear_cache": True}]
    partial = out["result"]
    assert [(o.token_ids, o.finish_reason) for o in partial] == [((3, 4), base.ABORTED)] * 2
    assert all(o.aborted and o.logprobs == (-0.25, -0.25) for o in partial)
    # Paused: a call aborts every request before its first token, without reaching vLLM.
    held = engine.generate([[5, 6]], sampling)
    assert [(o.token_ids, o.finish_reason) for o in held] == [((), base.ABORTED)]
    assert len(spy.called("generate")) == 2
    engine.update_weights({"w": torch.ones(2)}, version=1)  # allowed while paused
    spy.results["generate"] = _request_output
    engine.resume()
    assert spy.called("resume_generation") == [{}]
    # Each request goes on from prompt + its 2 tokens with the 4 of its budget left.
    resumed = engine.generate(
        [[5, 6, 3, 4], [7, 3, 4]],
        base.SamplingSettings(temperature=1.0, max_tokens=6, seeds=(1, 2), max_tokens_per_request=(4, 4)),
    )
    assert [c["sampling_params"].max_tokens for c in spy.called("generate")[2:]] == [4, 4]
    merged = base.continue_output(partial[0], resumed[0])
    assert merged.token_ids == (3, 4, 3, 4, 5, 6) and merged.versions == (0, 0, 1, 1, 1, 1)
    assert merged.meta["interrupts"] == 1


def test_a_request_that_reaches_vllm_as_the_pause_begins_is_aborted_by_id(spy: SignatureSpy) -> None:
    """A request submitted just as the pause began is not aborted by it (vLLM 0.23 queues it until
    resume_generation): the interrupt aborts what is still in flight by id, so it never waits for
    the resume that only comes after it returns."""
    _aborted_by(spy, "abort", tokens_made=0)  # queued until aborted by id
    engine = _engine(_cfg(), spy, colocated=False)
    thread, out = _generating(engine, [[5]], base.SamplingSettings(temperature=1.0, max_tokens=6))
    (request_id,) = engine.inflight_request_ids()
    engine.interrupt()
    thread.join(timeout=30)
    assert spy.called("abort") == [{"request_id": [request_id]}]
    assert [(o.token_ids, o.finish_reason) for o in out["result"]] == [((), base.ABORTED)]


def test_a_request_vllm_refuses_while_paused_is_aborted_not_failed(spy: SignatureSpy) -> None:
    exceptions = pytest.importorskip("vllm.exceptions")
    if not hasattr(exceptions, "RetryableRequestError"):
        pytest.skip("this vLLM queues requests while paused (0.23) instead of refusing them")

    def refuse(arguments: dict[str, Any]) -> Any:
        raise exceptions.RetryableRequestError("paused")

    spy.results["generate"] = refuse
    engine = _engine(_cfg(), spy, colocated=False)
    out = engine.generate([[5], [6]], base.SamplingSettings(temperature=1.0, max_tokens=6))
    assert [(o.token_ids, o.finish_reason) for o in out] == [((), base.ABORTED)] * 2


def test_a_waiting_call_asks_vllm_whether_its_engine_core_is_alive() -> None:
    """`VLLMEngine._core_dead` reads `AsyncLLM.errored` while a call waits (vLLM never answers a
    utility call whose EngineCore died): a property of every release the images ship."""
    from vllm.v1.engine.async_llm import AsyncLLM

    assert isinstance(inspect.getattr_static(AsyncLLM, "errored"), property)

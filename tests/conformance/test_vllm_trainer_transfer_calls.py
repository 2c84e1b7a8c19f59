"""The trainer side of vLLM's weight transfer (`weights.vllm_transfer`) against the installed vLLM:
the generation rljob detects, the init/update infos built with vLLM's own dataclasses from the values
rljob passes, the client checked against vLLM's `VLLMWeightSyncClient` protocol, and the weight source
run through vLLM's own sender code where that needs no GPU. See conftest.py."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from trainer_configs import toy_config

from rljob_trainer.engines import vllm_engine
from rljob_trainer.model import modeling
from rljob_trainer.weights import vllm_transfer, weight_sync


@pytest.fixture(scope="module")
def api() -> weight_sync.VLLMWeightTransferAPI:
    detected = weight_sync.detect_vllm_weight_transfer()
    assert detected is not None
    return detected


@pytest.fixture(scope="module")
def src() -> Any:
    """The source of a tiny bf16 model (tied embeddings), as every trainer rank builds it."""
    cfg = toy_config(model={"dtype": "bfloat16"})
    model = modeling.build_base_model(cfg.model, init_seed=0)

    @contextlib.contextmanager
    def tensors() -> Iterator[list[tuple[str, torch.Tensor]]]:
        with weight_sync.engine_tensors(model) as ts:
            yield ts

    return vllm_transfer.source(tensors, torch.bfloat16)


def test_the_pinned_release_gets_vllms_own_api_for_both_kinds_of_engine(
    api: weight_sync.VLLMWeightTransferAPI, tier: str
) -> None:
    assert {"nccl", "ipc"} <= api.backends
    assert api.generation == (
        weight_sync.GEN_STATIC_SENDER if tier == "ascend" else weight_sync.GEN_TRAINER_ENGINES
    )
    for colocated, backend in ((False, "nccl"), (True, "ipc")):
        choice = weight_sync.choose_weight_transfer(
            engine_kind="vllm",
            colocated=colocated,
            weight_sync="collective",
            device_type="cuda",
            ray=True,
            vllm=api,
        )
        assert (choice.path, choice.backend, choice.fallback) == (
            weight_sync.PATH_VLLM_NATIVE,
            backend,
            False,
        )
    assert vllm_transfer.GEN_TRAINER_ENGINES == weight_sync.GEN_TRAINER_ENGINES
    assert vllm_transfer.GEN_STATIC_SENDER == weight_sync.GEN_STATIC_SENDER


def test_the_client_is_a_vllm_weight_sync_client_and_names_engine_methods_that_exist(
    api: weight_sync.VLLMWeightTransferAPI,
) -> None:
    for method in vllm_transfer.ENGINE_METHODS.values():
        assert callable(getattr(vllm_engine.VLLMEngine, method))
    if api.generation != weight_sync.GEN_TRAINER_ENGINES:
        pytest.skip("vLLM 0.23's static senders take no client")
    from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient

    client = vllm_transfer.EngineClient({}, timeout_s=1.0)
    assert isinstance(client, VLLMWeightSyncClient)
    for name in (
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        ["finish_weight_update"][0],
    ):
        ours = inspect.signature(getattr(client, name)).parameters
        theirs = inspect.signature(getattr(VLLMWeightSyncClient, name)).parameters
        assert list(ours) == [p for p in theirs if p != "self"], name


def test_the_source_is_a_vllm_weight_source_that_vllms_sender_accepts(
    api: weight_sync.VLLMWeightTransferAPI, src: Any
) -> None:
    metas = src.metadata
    assert [(m.name, m.dtype, tuple(m.shape)) for m in metas] == [
        (n, t.dtype, tuple(t.shape)) for n, t in src.iter_full()
    ]
    assert all(m.dtype == torch.bfloat16 for m in metas)
    if api.generation == weight_sync.GEN_TRAINER_ENGINES:
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

        assert isinstance(src, WeightSource) and src.implements_iter_full()
        assert all(isinstance(m, ParamMeta) for m in metas)
        # IPC needs every rank to own every tensor; NCCL a single sender at rank 0 (owners unset).
        assert len(src.owned_names(0)) == len(src.owned_names(3)) == len(metas)
    names = [m.name for m in metas]
    assert len(names) == len(set(names)) and "lm_head.weight" not in names  # tied: sent once


def test_vllm_0_33s_nccl_sender_runs_over_the_source(
    api: weight_sync.VLLMWeightTransferAPI, src: Any
) -> None:
    """What runs on a non-sending trainer rank is vLLM's own code with no GPU: it iterates the source
    under vLLM's metadata check. Rank 0's init info builds the worker's, as vLLM sends it."""
    if api.generation != weight_sync.GEN_TRAINER_ENGINES:
        pytest.skip("vLLM 0.33's trainer engines")
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_common import (
        NCCLWeightTransferInitInfo,
        build_worker_init_payload,
    )
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerWeightTransferEngine,
        NCCLWeightTransferUpdateInfo,
    )

    info = vllm_transfer.nccl_trainer_init_info(
        api.generation, rank=0, host="10.0.0.1", port=29500, world_size=3
    )
    assert info.is_sender and info.packed and info.backend == "nccl"
    NCCLWeightTransferInitInfo(**build_worker_init_payload(info, packed=info.packed))
    assert list(NCCLTrainerWeightTransferEngine._checked_iter(src, src.metadata))
    NCCLWeightTransferUpdateInfo(
        names=[m.name for m in src.metadata],
        dtype_names=[str(m.dtype).split(".")[-1] for m in src.metadata],
        shapes=[list(m.shape) for m in src.metadata],
    )
    rank1 = vllm_transfer.nccl_trainer_init_info(
        api.generation, rank=1, host="10.0.0.1", port=29500, world_size=3
    )
    client = vllm_transfer.EngineClient({}, timeout_s=1.0)
    engine = WeightTransferTrainerFactory.trainer_init(rank1, client=client, source=src)
    assert isinstance(engine, NCCLTrainerWeightTransferEngine) and not engine.is_sender
    engine.send_weights()  # a non-sender: iterates the source (the FSDP gathers), touches no engine


def test_vllm_0_33s_ipc_init_infos_are_built_from_rljobs_values(
    api: weight_sync.VLLMWeightTransferAPI,
) -> None:
    if api.generation != weight_sync.GEN_TRAINER_ENGINES:
        pytest.skip("vLLM 0.33's trainer engines")
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import (
        IPCTrainerWeightTransferEngine,
        IPCWeightTransferInitInfo,
        IPCWeightTransferUpdateInfo,
    )

    info = vllm_transfer.ipc_trainer_init_info(rank=0)
    assert info.backend == "ipc" and info.packed and info.is_sender
    IPCWeightTransferInitInfo(**{"packed": True})  # IPCSession.add's handshake, as trainer_init sends it
    assert WeightTransferTrainerFactory._registry["ipc"]() is IPCTrainerWeightTransferEngine
    inspect.signature(WeightTransferTrainerFactory.trainer_init).bind(info, client=object(), source=object())
    fields = {f.name for f in dataclasses.fields(IPCWeightTransferUpdateInfo)}
    assert {"names", "dtype_names", "shapes", "ipc_handles", "tensor_sizes"} <= fields


def test_vllm_0_23s_static_senders_take_rljobs_arguments(
    api: weight_sync.VLLMWeightTransferAPI, src: Any
) -> None:
    if api.generation != weight_sync.GEN_STATIC_SENDER:
        pytest.skip("vLLM 0.23's static senders (the Ascend pin)")
    from vllm.distributed.weight_transfer import ipc_engine, nccl_engine

    engine_cls, args_cls = vllm_transfer._static_classes("cuda", "nccl")
    inspect.signature(engine_cls.trainer_init).bind(
        vllm_transfer.nccl_trainer_init_info(api.generation, rank=0, host="h", port=1, world_size=2)
    )
    inspect.signature(engine_cls.trainer_send_weights).bind(iter(()), args_cls(group=object(), packed=True))
    nccl_engine.NCCLWeightTransferInitInfo(**vllm_transfer.static_nccl_engine_init_info("h", 1, 2))
    nccl_engine.NCCLWeightTransferUpdateInfo(**vllm_transfer.static_nccl_update_info(src.metadata))
    ipc_cls, ipc_args = vllm_transfer._static_classes("cuda", "ipc")
    assert ipc_cls is ipc_engine.IPCWeightTransferEngine
    inspect.signature(ipc_cls.trainer_send_weights).bind(
        iter(()), ipc_args(send_mode=lambda info: None, packed=True)
    )
    ipc_engine.IPCWeightTransferInitInfo(**{})  # IPCSession.add's handshake on 0.23

"""How the driver gets the trainer's weights into its engines.

Role: the weight half of the driver's engine lifecycle: opening each engine's channel when it joins
(`join`: a gloo/NCCL/HCCL group of our own, or vLLM's weight-transfer channel), one sync of the current
weights to a set of engines on the path `weight_sync.choose_weight_transfer` gave each (`update`), and
a LoRA adapter an engine lost across a sleep added again (`readd_lost_adapters`). Every wait is bounded
by rollout.engineTimeoutS; an engine that fails or hangs is dropped as lost (`GRPODriver.drop_engine`,
its pod in `lostRolloutPods`) and the others carry on. Functions over the driver (`d`: its config,
runtime, ranks and engines). Callers: `rljob_trainer.driver.GRPODriver`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from rljob_trainer.train import trainer
from rljob_trainer.weights import vllm_transfer, weight_sync

log = logging.getLogger("rljob_trainer.driver")  # the driver's log: these lines are its

# EngineState.version of an engine whose weights a level-2 sleep discarded, or whose LoRA adapter was
# lost (its base intact): never the current version, so the next sync refills it.
DISCARDED, ADAPTER_LOST = -1, -2


def join(d: Any, name: str, choice: weight_sync.WeightTransferChoice) -> None:
    """Open engine `name`'s channel for its path (nothing to open for the object store and LoRA)."""
    if name in d.engines and choice.path == weight_sync.PATH_COLLECTIVE:
        join_weight_group(d, name)
    elif name in d.engines and choice.path == weight_sync.PATH_VLLM_NATIVE:
        join_vllm_transfer(d, name, choice)


def join_weight_group(d: Any, name: str) -> None:
    """Open engine `name`'s own weight group with trainer rank 0 (both sides block until joined)."""
    r = d.cfg.rollout
    device, _ = trainer.resolve_device_and_backend(d.cfg.distributed)
    backend = weight_sync.backend_for_device(device)
    timeout = r.engine_timeout_s
    address = d.rt.get(d.rt.submit(d.ranks[0], "weight_group_create", name, backend, timeout))
    rank_side = d.rt.submit(d.ranks[0], "weight_group_open", address, 0)
    d._settle(
        {name: d.rt.submit(d.engines[name].handle, "weight_group_open", address, 1)},
        what="weight group",
    )
    if name in d.engines:
        d.rt.get(rank_side)


def join_vllm_transfer(d: Any, name: str, choice: weight_sync.WeightTransferChoice) -> None:
    """vLLM's weight-transfer channel of engine `name` (`vllm_transfer.open_channel`); an engine
    whose channel does not open within rollout.engineTimeoutS is dropped as lost."""
    error = vllm_transfer.open_channel(d.rt, d.ranks, name, d.engines[name].handle, choice, **rank_wait(d))
    if error is not None:
        log.warning("engine %s: weight transfer did not open: %s", name, error)
        d.drop_engine(name, lost=True)


def rank_wait(d: Any) -> dict[str, Any]:
    return {"timeout_s": d.cfg.rollout.engine_timeout_s, "clock": d.clock}


def readd_lost_adapters(d: Any, names: Sequence[str]) -> None:
    """Engines serving LoRA that kept their base across a level-1 sleep but no longer serve their
    adapter (vLLM issue 53888: silent loss) take it again, adapter only, before they generate."""
    kept = [n for n in names if d.engines[n].version >= 0]
    served = d.rt.get([d.rt.submit(d.engines[n].handle, "adapter_version") for n in kept])
    for name, version in zip(kept, served, strict=True):
        if version != d.engines[name].version:
            log.warning("engine %s lost its LoRA adapter across its sleep: adding it again", name)
            d.engines[name].version = ADAPTER_LOST


def what_to_send(d: Any, name: str) -> str:
    """Engines serving LoRA (rollout.engineLora) take only the adapter while their base is intact,
    base and adapter once a level-2 sleep discarded it; other engines the merged model."""
    if not d.cfg.rollout.engine_lora:
        return weight_sync.SEND_MERGED
    discarded = d.engines[name].version == DISCARDED
    return weight_sync.SEND_BASE_AND_ADAPTER if discarded else weight_sync.SEND_ADAPTER


def update(d: Any, names: Sequence[str]) -> None:
    """The current weights into `names`: over each engine's weight group (the default), or as one
    whole-model dict through the object store (rollout.weightSync object-store, vLLM, local mode).
    An engine that fails or hangs is dropped as lost; the others carry on."""
    version = d.weights_version
    native = [
        n
        for n in names
        if d.weight_transfer.get(n) and d.weight_transfer[n].path == weight_sync.PATH_VLLM_NATIVE
    ]
    if native:
        update_vllm_native(d, native, version)
    by_what: dict[str, list[str]] = {}
    for n in names:
        if n not in native:
            by_what.setdefault(what_to_send(d, n), []).append(n)
    for what, group in sorted(by_what.items()):
        send_weights(d, group, version, what)


def send_weights(d: Any, names: Sequence[str], version: int, what: str) -> None:
    if d._collective:
        receiving = {n: d.rt.submit(d.engines[n].handle, "receive_engine_weights") for n in names}
        sends = [d.rt.submit(r, "send_engine_weights", version, list(names), what) for r in d.ranks]
        failed = vllm_transfer.rank_results(
            d.rt, sends, what="weight sync", engines=len(names), **rank_wait(d)
        )[0]
        for name, error in failed.items():
            log.warning("weight sync to %s failed: %s", name, error)
        done = d._settle(receiving, what="weight sync", drop_on_error=True)
        for name in failed:
            if name in d.engines:
                d.drop_engine(name, lost=True)
    else:
        weights = d._current_weights(what)
        done = d._settle(
            {n: d.rt.submit(d.engines[n].handle, "update_weights", weights, version) for n in names},
            what="weight sync",
            drop_on_error=True,
        )
    for n in done:
        if n in d.engines:
            d.engines[n].version = version


def update_vllm_native(d: Any, names: Sequence[str], version: int) -> None:
    """The current weights through vLLM's weight-transfer API (`vllm_transfer.send_round`: every
    rank takes part, rank 0 drives the engines, each call bounded); an engine that fails is dropped
    as lost, the others go on. NOT RUN here (no GPU, no vLLM)."""
    choices = {n: d.weight_transfer[n] for n in names}
    failed = vllm_transfer.send_round(d.rt, d.ranks, choices, version, **rank_wait(d))
    for name in names:
        if name in failed:
            log.warning("weight transfer to %s failed: %s", name, failed[name])
            if name in d.engines:
                d.drop_engine(name, lost=True)
        elif name in d.engines:
            d.engines[name].version = version

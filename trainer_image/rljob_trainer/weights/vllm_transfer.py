"""vLLM's weight-transfer API, trainer side: what rank 0 and the other ranks run for vLLM engines.

Role: `weight_sync.PATH_VLLM_NATIVE` engines take full weights over vLLM's own transfer engines, NCCL
for dedicated engines and IPC for colocated ones, driven from the trainer ranks:
- `EngineClient`: vLLM's `VLLMWeightSyncClient` protocol (`init_weight_transfer_engine`,
  `start_weight_update`, `update_weights`, `finish_weight_update`) over rljob's engine actors. Every
  call has a timeout (rollout.engineTimeoutS); an engine whose call fails or times out is marked
  failed and skipped from then on, so vLLM's sender never sees an exception from a dead engine
  mid-round (the other engines go on, and the trainer ranks' collectives stay aligned).
- `source`: a vLLM `WeightSource` over the engine tensors of one sync (`weight_sync.engine_tensors`:
  LoRA merged, floating tensors cast to the engine dtype; FSDP2 DTensors gathered one tensor at a time
  with `full_tensor()` on every rank, owners unset, so every rank iterates every tensor).
- `NCCLSession` (one per dedicated engine, on every rank; rank 0 the sender) and `IPCSession` (one per
  rank for every colocated engine: each rank exports handles of its own GPU's copy, vLLM all-gathers
  them over the default process group, rank 0 ships the merged handles, each engine worker maps its
  own GPU's). Both speak the two generations `weight_sync.detect_vllm_weight_transfer` tells apart:
  vLLM 0.33's trainer engines (`WeightTransferTrainerFactory.trainer_init(init_info, client=,
  source=)`, `send_weights()`), and vLLM 0.23's static senders (`trainer_init` /
  `trainer_send_weights(iterator, trainer_args)`; on Ascend vllm-ascend's `HCCLWeightTransferEngine`
  and `NPUIPCWeightTransferEngine`, which vllm-ascend maps "nccl" and "ipc" to on its workers).
  Both packed (vLLM's bucketed double-buffered broadcast, its RL examples' setting).
- `send_with_watchdog`: rank 0's NCCL send runs on a thread; past the timeout the communicator is
  aborted (vLLM's `PyNcclCommunicator.destroy`, ncclCommAbort), which frees the blocked broadcast;
  the sender then finishes the round as no-ops, so the other ranks' FSDP gathers line up, and the
  engine is reported failed. Rank 0 never waits forever. (vllm-ascend 0.23's HCCL communicator has no
  abort: there the engine is reported failed after the timeout, and a blocked stream stays blocked.)

NOT RUN here (no GPU): the calls are checked against the installed vLLM by `make test-vllm`
(tests/conformance/); the timeout and failure logic is unit-tested with stand-in senders.
Callers: `rljob_trainer.runtimes.Host` (the `vllm_transfer_*` methods), tests.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

log = logging.getLogger("rljob_trainer.weights.vllm_transfer")

GEN_TRAINER_ENGINES = "trainer-engines"  # == weight_sync.GEN_TRAINER_ENGINES (no torch import here)
GEN_STATIC_SENDER = "static-sender"
# How long an aborted send may take to unwind before rank 0 gives up on it (its thread is a daemon).
ABORT_GRACE_S = 30.0
# What the driver allows a rank beyond its own bounded waits (the Ray call, gathers) before it fails.
_RANK_MARGIN_S = 60.0
# The engine methods (engines.vllm_engine.VLLMEngine, behind runtimes.Host.call) the client calls.
ENGINE_METHODS = {
    "init_weight_transfer_engine": "init_weight_transfer",
    "start_weight_update": "start_weight_update",
    "update_weights": "receive_weight_update",
    "finish_weight_update": "finish_weight_update",
}

Call = Callable[[Mapping[str, Any], str, tuple[Any, ...], float], dict[str, str | None]]
Tensors = Callable[[], AbstractContextManager[Sequence[tuple[str, Any]]]]


def ray_call(
    handles: Mapping[str, Any], method: str, args: tuple[Any, ...], timeout_s: float
) -> dict[str, str | None]:
    """`method(*args)` on every engine actor at once; {engine: None, or the error} within timeout_s."""
    import ray

    refs = {name: h.call.remote(method, *args) for name, h in handles.items()}
    done, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    out: dict[str, str | None] = {}
    for name, ref in refs.items():
        if ref not in done:
            out[name] = f"{method} timed out after {timeout_s:.0f} s"
            continue
        try:
            ray.get(ref)
            out[name] = None
        except Exception as exc:
            out[name] = f"{method}: {type(exc).__name__}: {exc}"
    return out


class EngineClient:
    """vLLM's `VLLMWeightSyncClient` over rljob's engine actors, fanning out to `targets`.

    Never raises into vLLM's sender: an engine that fails or times out lands in `failed` (and
    `on_failure` runs, e.g. to abort the NCCL group that engine would leave hanging) and is skipped by
    every later call. `version` is the weights version `finish_weight_update` hands the engines.
    """

    def __init__(
        self,
        engines: Mapping[str, Any],
        *,
        timeout_s: float,
        call: Call = ray_call,
        on_failure: Callable[[str, str], None] | None = None,
    ) -> None:
        self.engines = dict(engines)
        self.targets: list[str] = sorted(self.engines)
        self.failed: dict[str, str] = {}
        self.version = 0
        self.timeout_s = timeout_s
        self._call = call
        self._on_failure = on_failure

    def add(self, name: str, handle: Any) -> None:
        self.engines[name] = handle
        self.failed.pop(name, None)

    def remove(self, name: str) -> None:
        self.engines.pop(name, None)
        self.failed.pop(name, None)

    def live(self) -> list[str]:
        return [n for n in self.targets if n in self.engines and n not in self.failed]

    def _fan_out(self, protocol_method: str, *args: Any) -> None:
        names = self.live()
        if not names:
            return
        method = ENGINE_METHODS[protocol_method]
        results = self._call({n: self.engines[n] for n in names}, method, args, self.timeout_s)
        for name, error in results.items():
            if error is not None and name not in self.failed:
                log.warning("weight transfer to %s failed: %s", name, error)
                self.failed[name] = error
                if self._on_failure is not None:
                    self._on_failure(name, error)

    # ---- vLLM's VLLMWeightSyncClient protocol ------------------------------------------------------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._fan_out("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._fan_out("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._fan_out("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        del weight_version  # rljob's weights version rides `self.version`
        self._fan_out("finish_weight_update", self.version)


def send_with_watchdog(
    send: Callable[[], None],
    *,
    abort: Callable[[], None],
    timeout_s: float,
    grace_s: float = ABORT_GRACE_S,
    prepare: Callable[[], None] | None = None,
) -> str | None:
    """Run `send` on a thread; past `timeout_s` call `abort` (which must free what `send` blocks on)
    and wait up to `grace_s` more. Returns None, or the error (raised, timed out, or stuck)."""
    done = threading.Event()
    raised: list[BaseException] = []

    def run() -> None:
        try:
            if prepare is not None:
                prepare()  # e.g. the rank's CUDA device: the current device is per thread
            send()
        except BaseException as exc:
            raised.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="rljob-weight-send", daemon=True).start()
    if not done.wait(timeout_s):
        log.warning("weight transfer hung past %.0f s: aborting its communicator", timeout_s)
        try:
            abort()
        except Exception as exc:
            log.warning("aborting the weight transfer failed: %s", exc)
        if not done.wait(grace_s):
            return f"hung past {timeout_s:.0f} s and still blocked {grace_s:.0f} s after the abort"
        return f"timed out after {timeout_s:.0f} s (communicator aborted)"
    if raised:
        return f"{type(raised[0]).__name__}: {raised[0]}"
    return None


# ---- the weights, as vLLM's WeightSource ----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """A tensor of the source (vLLM 0.23 has no `ParamMeta`): name, wire dtype, full shape."""

    name: str
    dtype: Any
    shape: tuple[int, ...]


@functools.cache
def _source_class() -> type:
    from rljob_trainer.weights import weight_sync

    try:  # vLLM 0.33: a WeightSource the trainer engines take; 0.23's static senders take an iterator
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    except ImportError:
        ParamMeta, WeightSource = TensorMeta, object

    class EngineTensorsSource(WeightSource):  # type: ignore[misc, valid-type]
        """The engine tensors of a sync, in the engine's dtype; every rank owns (iterates) each one."""

        def __init__(self, tensors: Tensors, dtype: Any) -> None:
            self._tensors = tensors
            self._dtype = dtype

        @functools.cached_property
        def metadata(self) -> list[Any]:
            with self._tensors() as tensors:
                return [
                    ParamMeta(name, weight_sync._wire_dtype(t, self._dtype), tuple(t.shape))
                    for name, t in tensors
                ]

        def iter_full(self) -> Iterator[tuple[str, Any]]:
            with self._tensors() as tensors:
                for name, t in tensors:
                    yield name, weight_sync._materialize(t, self._dtype)

    return EngineTensorsSource


def source(tensors: Tensors, dtype: Any) -> Any:
    """A vLLM `WeightSource` over `tensors()` (a context manager yielding (name, tensor) pairs)."""
    return _source_class()(tensors, dtype)


def _iter_full(src: Any) -> Iterator[tuple[str, Any]]:
    return src.iter_full()


# ---- init infos, built from the installed vLLM's own dataclasses ------------------------------------
def nccl_trainer_init_info(generation: str, *, rank: int, host: str, port: int, world_size: int) -> Any:
    """vLLM 0.33: `NCCLTrainerInitInfo` (packed; rank 0 the sender). vLLM 0.23: the dict its static
    `trainer_init` reads (the trainer is always rank 0 there)."""
    if generation == GEN_TRAINER_ENGINES:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(
            master_address=host, master_port=port, world_size=world_size, packed=True, rank=rank
        )
    return {"master_address": host, "master_port": port, "world_size": world_size}


def static_nccl_engine_init_info(host: str, port: int, world_size: int) -> dict[str, Any]:
    """vLLM 0.23 (and vllm-ascend's HCCL engine): what the engine's `init_weight_transfer_engine` takes;
    its workers join at ranks 1.. after the trainer's rank 0."""
    return {"master_address": host, "master_port": port, "rank_offset": 1, "world_size": world_size}


def static_nccl_update_info(metadata: Sequence[Any]) -> dict[str, Any]:
    """vLLM 0.23: `NCCLWeightTransferUpdateInfo` fields of one packed round (names, dtypes, shapes)."""
    return {
        "names": [m.name for m in metadata],
        "dtype_names": [str(m.dtype).removeprefix("torch.") for m in metadata],
        "shapes": [list(m.shape) for m in metadata],
        "packed": True,
    }


def ipc_trainer_init_info(*, rank: int) -> Any:
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    return IPCTrainerInitInfo(packed=True, rank=rank)


def _static_classes(platform: str, backend: str) -> tuple[Any, Any]:
    """(engine class with the static trainer methods, its trainer-args dataclass) of vLLM 0.23."""
    if platform == "ascend" and backend == "nccl":
        from vllm_ascend.distributed.weight_transfer import hccl_engine

        return hccl_engine.HCCLWeightTransferEngine, hccl_engine.HCCLTrainerSendWeightsArgs
    if platform == "ascend":
        from vllm_ascend.distributed.weight_transfer import npu_ipc_engine

        return npu_ipc_engine.NPUIPCWeightTransferEngine, npu_ipc_engine.NPUIPCTrainerSendWeightsArgs
    if backend == "nccl":
        from vllm.distributed.weight_transfer import nccl_engine

        return nccl_engine.NCCLWeightTransferEngine, nccl_engine.NCCLTrainerSendWeightsArgs
    from vllm.distributed.weight_transfer import ipc_engine

    return ipc_engine.IPCWeightTransferEngine, ipc_engine.IPCTrainerSendWeightsArgs


# ---- sessions -------------------------------------------------------------------------------------
@dataclasses.dataclass
class NCCLSession:
    """One dedicated engine's NCCL channel, on one trainer rank (rank 0 sends; others only iterate)."""

    name: str
    rank: int
    generation: str
    platform: str
    client: EngineClient
    src: Any
    timeout_s: float
    trainer: Any = None  # vLLM 0.33: the NCCLTrainerWeightTransferEngine
    group: Any = None  # vLLM 0.23: the PyNcclCommunicator (PyHcclCommunicator on Ascend)

    @classmethod
    def open(
        cls,
        name: str,
        handle: Any,
        *,
        rank: int,
        generation: str,
        platform: str,
        src: Any,
        host: str,
        port: int,
        world_size: int,
        timeout_s: float,
        call: Call = ray_call,
    ) -> NCCLSession:
        """Rendezvous with the engine's workers (rank 0; both sides block until joined: bounded by
        `timeout_s`). Other ranks hold a non-sending end. Raises RuntimeError when it does not open."""
        session = cls(name, rank, generation, platform, EngineClient({}, timeout_s=timeout_s), src, timeout_s)
        session.client = EngineClient(
            {name: handle} if rank == 0 else {}, timeout_s=timeout_s, call=call, on_failure=session._abort
        )
        info = nccl_trainer_init_info(generation, rank=rank, host=host, port=port, world_size=world_size)
        if generation == GEN_TRAINER_ENGINES:
            from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

            def rendezvous() -> None:  # rank 0 drives the engine's init through the client meanwhile
                session.trainer = WeightTransferTrainerFactory.trainer_init(
                    info, client=session.client, source=src
                )

        else:
            engine_cls, _ = _static_classes(platform, "nccl")
            worker_init = static_nccl_engine_init_info(host, port, world_size)

            def rendezvous() -> None:  # as vLLM 0.33 does it: the engine joins while the trainer opens
                def open_group() -> None:
                    session.group = engine_cls.trainer_init(info)

                _concurrently(lambda: session.client.init_weight_transfer_engine(worker_init), open_group)

        if rank != 0 and generation != GEN_TRAINER_ENGINES:
            return session  # vLLM 0.23: only the sender holds a communicator
        error = send_with_watchdog(
            rendezvous, abort=lambda: None, timeout_s=timeout_s, prepare=_current_device_setter()
        )
        error = session.client.failed.get(name) or error
        if error is not None:
            session.close()
            raise RuntimeError(f"weight transfer to {name} did not open: {error}")
        return session

    def _abort(self, name: str, error: str) -> None:
        del name, error
        # Frees a broadcast blocked on a peer that will never come (ncclCommAbort); later broadcasts
        # on the communicator are no-ops, so the round unwinds without more collectives on this group.
        comm = self.trainer.model_update_group if self.trainer is not None else self.group
        destroy = getattr(comm, "destroy", None)
        if callable(destroy):
            destroy()

    def send(self, version: int) -> str | None:
        """One full-weights round to this engine; None or the error (rank 0; others return None)."""
        self.client.version = version
        if self.rank != 0:
            if self.trainer is not None:
                self.trainer.send_weights()  # joins the trainer-side gathers only
            else:
                for _ in _iter_full(self.src):
                    pass
            return None
        if self.name in self.client.failed:
            return self.client.failed[self.name]
        error = send_with_watchdog(
            self._send_round,
            abort=lambda: self._abort(self.name, "timeout"),
            timeout_s=self.timeout_s,
            prepare=_current_device_setter(),
        )
        return self.client.failed.get(self.name) or error

    def _send_round(self) -> None:
        if self.trainer is not None:
            self.trainer.send_weights()
            return
        engine_cls, args_cls = _static_classes(self.platform, "nccl")
        self.client.start_weight_update()
        update = static_nccl_update_info(self.src.metadata)
        args = args_cls(group=self.group, packed=True)
        _concurrently(
            lambda: self.client.update_weights(update),
            lambda: engine_cls.trainer_send_weights(_iter_full(self.src), args),
        )
        self.client.finish_weight_update()

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.shutdown()
        else:
            self._abort(self.name, "closed")
        self.trainer = self.group = None


@dataclasses.dataclass
class IPCSession:
    """Every colocated engine's IPC channel, on one trainer rank. Every rank sends (collective)."""

    rank: int
    generation: str
    platform: str
    client: EngineClient
    src: Any
    trainer: Any = None  # vLLM 0.33: the IPCTrainerWeightTransferEngine

    @classmethod
    def open(
        cls, *, rank: int, generation: str, platform: str, src: Any, timeout_s: float, call: Call = ray_call
    ) -> IPCSession:
        session = cls(rank, generation, platform, EngineClient({}, timeout_s=timeout_s, call=call), src)
        if generation == GEN_TRAINER_ENGINES:
            from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

            # trainer_init's handshake goes to no engine yet: each joins through `add`.
            session.trainer = WeightTransferTrainerFactory.trainer_init(
                ipc_trainer_init_info(rank=rank), client=session.client, source=src
            )
        return session

    def add(self, name: str, handle: Any) -> str | None:
        """A colocated engine joins (rank 0 calls it): vLLM's IPC handshake, the must-agree `packed`."""
        self.client.add(name, handle)
        targets, self.client.targets = self.client.targets, [name]
        try:
            self.client.init_weight_transfer_engine(
                {"packed": True} if self.generation == GEN_TRAINER_ENGINES else {}
            )
        finally:
            self.client.targets = sorted(set(targets) | {name})
        return self.client.failed.get(name)

    def send(self, version: int, names: Sequence[str]) -> dict[str, str]:
        """One round to `names` (every rank calls; rank 0 ships); {engine: error} of those that failed."""
        self.client.version = version
        self.client.targets = sorted(names) if self.rank == 0 else []
        before = dict(self.client.failed)
        if self.trainer is not None:
            self.trainer.send_weights()
        else:
            engine_cls, args_cls = _static_classes(self.platform, "ipc")

            def ship(update_info: Any) -> None:  # vLLM 0.23 calls it on global rank 0 only
                info = (
                    dataclasses.asdict(update_info) if dataclasses.is_dataclass(update_info) else update_info
                )
                self.client.update_weights(info)

            if self.rank == 0:
                self.client.start_weight_update()
            engine_cls.trainer_send_weights(_iter_full(self.src), args_cls(send_mode=ship, packed=True))
            if self.rank == 0:
                self.client.finish_weight_update()
        return {n: e for n, e in self.client.failed.items() if n in names and n not in before}

    def remove(self, name: str) -> None:
        self.client.remove(name)


# ---- the driver's side: every rank at once, bounded ------------------------------------------------
def rank_results(
    rt: Any,
    futures: Sequence[Any],
    *,
    what: str,
    timeout_s: float,
    clock: Callable[[], float],
    engines: int = 1,
) -> list[Any]:
    """Every rank's result of a call whose engine waits the ranks bound themselves (`timeout_s` each,
    `engines` of them). A rank past that has hung: raise, saying so (a training rank cannot be dropped
    like an engine), rather than wait forever."""
    limit = (timeout_s + ABORT_GRACE_S) * max(1, engines) + _RANK_MARGIN_S
    deadline = clock() + limit
    pending = list(futures)
    while pending:
        done = rt.wait_any(pending, max(0.0, deadline - clock()))
        if not done:
            ranks = [i for i, f in enumerate(futures) if f in pending]
            raise RuntimeError(f"trainer rank(s) {ranks} did not return from {what} within {limit:.0f} s")
        pending = [f for f in pending if f not in done]
    return list(rt.get(list(futures)))


def open_channel(
    rt: Any,
    ranks: Sequence[Any],
    name: str,
    handle: Any,
    choice: Any,
    *,
    timeout_s: float,
    clock: Callable[[], float],
) -> str | None:
    """Open engine `name`'s channel on every rank (`runtimes.Host.vllm_transfer_open`); rank 0's error."""
    address, world = None, 1
    if choice.backend == "nccl":
        address = tuple(rt.get(rt.submit(ranks[0], "vllm_transfer_address")))
        world = 1 + int(rt.get(rt.submit(handle, "world_size")))
    opens = [
        rt.submit(
            r,
            "vllm_transfer_open",
            name,
            choice.backend,
            handle,
            address,
            world,
            choice.generation,
            choice.platform,
        )
        for r in ranks
    ]
    return rank_results(
        rt, opens, what=f"opening the weight transfer to {name}", timeout_s=timeout_s, clock=clock
    )[0]


def send_round(
    rt: Any,
    ranks: Sequence[Any],
    choices: Mapping[str, Any],
    version: int,
    *,
    timeout_s: float,
    clock: Callable[[], float],
) -> dict[str, str]:
    """One round of the current weights to the engines of `choices` (name -> WeightTransferChoice) on
    every rank (`runtimes.Host.vllm_transfer_send`); {engine: error} of those that failed."""
    by_backend: dict[str, list[str]] = {}
    for n in sorted(choices):
        by_backend.setdefault(choices[n].backend, []).append(n)
    sends = [rt.submit(r, "vllm_transfer_send", version, by_backend) for r in ranks]
    return rank_results(
        rt, sends, what="weight transfer", timeout_s=timeout_s, clock=clock, engines=len(choices)
    )[0]


def _concurrently(background: Callable[[], None], foreground: Callable[[], None]) -> None:
    """Run `background` on a thread while `foreground` runs here (a rendezvous, a broadcast); raise the
    first error. The engine side and the trainer side of a NCCL call must be in flight together."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            background()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, name="rljob-weight-rpc", daemon=True)
    thread.start()
    foreground()
    thread.join()
    if raised:
        raise raised[0]


def _current_device_setter() -> Callable[[], None] | None:
    """A callable that makes this thread's accelerator device current in another thread."""
    import torch

    if not torch.accelerator.is_available():
        return None
    index = torch.accelerator.current_device_index()
    return lambda: torch.accelerator.set_device_index(index)

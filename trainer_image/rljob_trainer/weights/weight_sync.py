"""Weight transfer from the trainer to rollout engines over a torch.distributed collective.

Role: at a sync point trainer rank 0 broadcasts the new weights to every engine's workers, one
process group per engine, bucket by bucket, so neither side ever builds a whole-model copy:
- `create_group_store` / `open_group`: a stateless group per engine (gloo on CPU, NCCL on GPU,
  HCCL on Ascend) over that engine's own TCPStore. It is never registered in torch.distributed's
  global world, so the trainer's gradient group is untouched and adding or dropping one engine
  never tears down another engine's group (the same approach as vLLM's
  `stateless_init_torch_distributed_process_group` and OpenRLHF's weight-sync groups).
- `send_weights`: streams tensors from the model's own state (FSDP2 DTensors are gathered with
  `full_tensor()` one bucket at a time on every trainer rank), casts them to the engine dtype,
  packs each bucket into one flat byte buffer and broadcasts it. A group that fails (its engine
  died or hung past the timeout) is dropped from the rest of the sync and reported; the others go on.
- `receive_weights`: the engine side; unpacks each bucket into views and hands them to a loader:
  `module_loader` copies into a transformers model in place, `peft_adapter_loader` into a PEFT
  model's LoRA adapter. `model_tensors` / `lora_adapter_tensors` pick what the trainer sends (the
  whole model with LoRA merged, or only the adapter when the engine serves LoRA itself).
- `send_weights_via_object_store`: the fallback, one whole-model dict through Ray's object store
  (what the driver did before); vLLM's docs reserve `collective_rpc` for control messages, so this
  path is for engines that cannot join a group.

Wire format of one sync: an int64 header [PROTOCOL, manifest bytes], the manifest (JSON: weights
version, then per bucket its byte size and entries name/dtype/shape/offset), then each bucket's bytes.
Planning (`plan_buckets`, `encode_manifest`, `decode_manifest`) is pure; the rest is the edge.

Callers: the GRPO driver and the engines (a later round wires them in), `bench/weight_sync.py`, tests.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import distributed as dist

PROTOCOL = 1
DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
# Every entry starts on this boundary, so its view of the byte buffer is aligned for any dtype.
ALIGN_BYTES = 16

BACKEND_BY_DEVICE = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}

Loader = Callable[[list[tuple[str, torch.Tensor]]], None]


# ---- pure planning ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorMeta:
    """One tensor on the wire: its name in the engine's naming, dtype name (`torch.<dtype>`), shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _dtype(self.dtype).itemsize


@dataclass(frozen=True)
class BucketEntry:
    meta: TensorMeta
    offset: int  # bytes from the start of the bucket


@dataclass(frozen=True)
class Bucket:
    nbytes: int
    entries: tuple[BucketEntry, ...]


def backend_for_device(device_type: str) -> str:
    """The collective backend for an accelerator kind: gloo (cpu), nccl (cuda), hccl (npu)."""
    try:
        return BACKEND_BY_DEVICE[device_type]
    except KeyError:
        raise ValueError(
            f"no weight-sync backend for device type {device_type!r}; "
            f"expected one of {sorted(BACKEND_BY_DEVICE)}"
        ) from None


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Pack tensors, in order, into buckets of at most `bucket_bytes` (a larger tensor gets its own).

    Order is kept so the receiver can load bucket by bucket in the sender's order; each entry is
    aligned to `ALIGN_BYTES` inside its bucket.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[Bucket] = []
    entries: list[BucketEntry] = []
    used = 0
    for meta in metas:
        start = _align(used)
        if entries and start + meta.nbytes > bucket_bytes:
            buckets.append(Bucket(used, tuple(entries)))
            entries, start = [], 0
        entries.append(BucketEntry(meta, start))
        used = start + meta.nbytes
    if entries:
        buckets.append(Bucket(used, tuple(entries)))
    return buckets


def encode_manifest(version: int, buckets: Sequence[Bucket]) -> bytes:
    """The manifest the receiver needs to unpack every bucket (JSON, UTF-8)."""
    return json.dumps(
        {
            "version": version,
            "buckets": [
                {
                    "nbytes": b.nbytes,
                    "entries": [[e.meta.name, e.meta.dtype, list(e.meta.shape), e.offset] for e in b.entries],
                }
                for b in buckets
            ],
        },
        separators=(",", ":"),
    ).encode()


def decode_manifest(data: bytes) -> tuple[int, list[Bucket]]:
    """Inverse of `encode_manifest`: (weights version, buckets)."""
    doc = json.loads(data.decode())
    buckets = [
        Bucket(
            int(b["nbytes"]),
            tuple(
                BucketEntry(TensorMeta(name, dtype, tuple(int(s) for s in shape)), int(offset))
                for name, dtype, shape, offset in b["entries"]
            ),
        )
        for b in doc["buckets"]
    ]
    return int(doc["version"]), buckets


def _align(offset: int) -> int:
    return -(-offset // ALIGN_BYTES) * ALIGN_BYTES


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a weight-sync manifest")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- which path: vLLM's weight-transfer API, our collective, or the object store (pure) ----------
# vLLM's own weight-transfer API (`vllm.config.WeightTransferConfig(backend=...)` on the engine, whose
# workers then take `init_weight_transfer_engine` / `start_weight_update` / `update_weights` /
# `finish_weight_update`) has two trainer sides, told apart by what the installed vLLM has
# (`detect_vllm_weight_transfer`); `weights.vllm_transfer` speaks both:
# - GEN_TRAINER_ENGINES (vLLM 0.33.0, the CUDA image's pin): trainer engines built by
#   `WeightTransferTrainerFactory.trainer_init(init_info, client=, source=)` on every trainer rank,
#   `send_weights()` drives the engine through a `VLLMWeightSyncClient`
#   (vllm/distributed/weight_transfer/{base,factory,nccl_engine,ipc_engine}.py);
# - GEN_STATIC_SENDER (vLLM 0.23.0, the Ascend image's pin, with vllm-ascend's HCCL / NPU-IPC classes):
#   static `NCCLWeightTransferEngine.trainer_init` / `trainer_send_weights(iterator, trainer_args)`.
# `make test-vllm` checks each against its release.
PATH_VLLM_NATIVE = "vllm-native"  # vLLM's WeightTransferConfig backend (nccl dedicated, ipc colocated)
PATH_COLLECTIVE = "collective"  # our bucketed broadcast over one torch.distributed group per engine
PATH_COLLECTIVE_RPC = "collective-rpc"  # whole-model dict via the object store, loaded by collective_rpc
PATH_OBJECT_STORE = "object-store"  # whole-model dict via the object store (named fallback)
# rollout.engineLora on vLLM: only the adapter (SEND_ADAPTER), through the object store, written as a
# PEFT adapter directory and added with vLLM's add_lora (engines.vllm_engine). It wins over
# PATH_VLLM_NATIVE, which moves full weights into the model (`load_weights`), never an adapter.
PATH_VLLM_LORA = "vllm-lora-adapter"
GEN_TRAINER_ENGINES = "trainer-engines"
GEN_STATIC_SENDER = "static-sender"


@dataclass(frozen=True)
class VLLMWeightTransferAPI:
    """What the installed vLLM offers for weight transfer, as plain data (`detect_vllm_weight_transfer`).

    `backends`: the WeightTransferConfig backends this vLLM has (empty: no WeightTransferConfig);
    `generation`: the trainer side rljob drives (`GEN_*`; None: one rljob does not speak);
    `platform`: "ascend" where vllm-ascend is installed (its HCCL / NPU-IPC trainer classes), else "cuda";
    `dist_backend`: the collectives of vLLM's own platform (`current_platform.dist_backend`): "gloo" on
    its CPU build, where no weight-transfer engine can run (NCCL and CUDA IPC need a GPU); "" where vLLM
    found no platform (a CUDA build on a machine without a GPU: the API's names are all it says).
    """

    version: str
    backends: frozenset[str] = frozenset()
    generation: str | None = None
    platform: str = "cuda"
    dist_backend: str = ""


@dataclass(frozen=True)
class WeightTransferChoice:
    """How weights reach one engine, and why (logged once per engine by the driver)."""

    path: str
    backend: str
    reason: str
    generation: str | None = None  # PATH_VLLM_NATIVE: which trainer side (GEN_*)
    platform: str = "cuda"

    @property
    def fallback(self) -> bool:
        """A path vLLM documents for something else (collective_rpc is for control messages)."""
        return self.path in (PATH_COLLECTIVE_RPC, PATH_OBJECT_STORE)


def choose_weight_transfer(
    *,
    engine_kind: str,
    colocated: bool,
    weight_sync: str,
    device_type: str,
    ray: bool,
    vllm: VLLMWeightTransferAPI | None,
    engine_lora: bool = False,
) -> WeightTransferChoice:
    """The weight path of one engine. vLLM engines serving LoRA (rollout.engineLora): the adapter
    path, whatever vLLM offers. Other vLLM engines: vLLM's own API where the installed vLLM has the
    backend (nccl for a dedicated engine, ipc for a colocated one) and rljob speaks its trainer side,
    else the collective_rpc path, a named fallback (the driver logs it as a warning). Transformers
    engines: our collective (rollout.weightSync collective, Ray runtime), else the object store (with
    LoRA or without: they load adapter tensors from either)."""
    if engine_kind == "vllm" and engine_lora:
        return WeightTransferChoice(
            PATH_VLLM_LORA,
            "object-store",
            "rollout.engineLora: only the LoRA adapter, added to vLLM as a new adapter per version "
            "(vLLM's weight-transfer API moves full weights)",
        )
    if engine_kind == "vllm":
        wanted = "ipc" if colocated else "nccl"
        if vllm is None:
            return WeightTransferChoice(PATH_COLLECTIVE_RPC, "object-store", "vLLM is not installed")
        if not vllm.backends:
            why = f"vLLM {vllm.version} has no WeightTransferConfig"
        elif vllm.dist_backend == "gloo":
            why = (
                f"vLLM {vllm.version}'s platform runs its collectives on gloo (its CPU build): its "
                f"weight-transfer engines ({', '.join(sorted(vllm.backends))}) need NCCL or CUDA IPC"
            )
        elif wanted not in vllm.backends:
            have = sorted(vllm.backends)
            why = f"vLLM {vllm.version}'s WeightTransferConfig has no {wanted!r} backend ({have})"
        elif vllm.generation is None:
            why = f"vLLM {vllm.version}'s trainer-side weight-transfer API is not one rljob speaks"
        elif weight_sync != "collective":
            why = "rollout.weightSync is object-store"
        elif not ray:
            why = "local mode (one process)"
        else:
            kind = "colocated" if colocated else "dedicated"
            return WeightTransferChoice(
                PATH_VLLM_NATIVE,
                wanted,
                f"vLLM {vllm.version} WeightTransferConfig ({vllm.generation}, {vllm.platform}), "
                f"{kind} engine",
                vllm.generation,
                vllm.platform,
            )
        return WeightTransferChoice(PATH_COLLECTIVE_RPC, "object-store", why)
    if weight_sync == "collective" and ray:
        backend = backend_for_device(device_type)
        return WeightTransferChoice(PATH_COLLECTIVE, backend, f"a {backend} group per engine")
    why = "rollout.weightSync is object-store" if weight_sync != "collective" else "local mode (one process)"
    return WeightTransferChoice(PATH_OBJECT_STORE, "object-store", why)


def detect_vllm_weight_transfer() -> VLLMWeightTransferAPI | None:
    """Probe the installed vLLM (None when it is not installed); nothing is started."""
    import importlib
    import importlib.util
    import typing

    try:
        import vllm
    except ImportError:
        return None
    if getattr(vllm, "__version__", None) is None:
        return None  # a namespace package of that name, not an installed vLLM
    version = str(vllm.__version__)
    platform = "ascend" if importlib.util.find_spec("vllm_ascend") else "cuda"
    from vllm.platforms import current_platform  # asked, not inferred from a device name

    dist_backend = str(getattr(current_platform, "dist_backend", "") or "")
    try:
        from vllm.config import WeightTransferConfig
    except ImportError:
        return VLLMWeightTransferAPI(version, platform=platform, dist_backend=dist_backend)
    modules = {"nccl": "nccl_engine", "ipc": "ipc_engine"}
    present = {
        b for b, m in modules.items() if importlib.util.find_spec(f"vllm.distributed.weight_transfer.{m}")
    }
    try:  # the accepted backends: a Literal (early releases), or a Literal | str (a registry) later
        hint = typing.get_type_hints(WeightTransferConfig).get("backend")
        literal = {a for arg in typing.get_args(hint) for a in (typing.get_args(arg) or (arg,))}
        literal = {a for a in literal if isinstance(a, str)}
    except Exception:
        literal = set()
    backends = frozenset(present & literal) if literal else frozenset(present)
    generation = None
    if "nccl" in backends:
        factory = importlib.import_module("vllm.distributed.weight_transfer.factory")
        nccl = importlib.import_module("vllm.distributed.weight_transfer.nccl_engine")
        if hasattr(factory, "WeightTransferTrainerFactory") and hasattr(nccl, "NCCLTrainerInitInfo"):
            generation = GEN_TRAINER_ENGINES
        elif hasattr(getattr(nccl, "NCCLWeightTransferEngine", None), "trainer_send_weights") and hasattr(
            nccl, "NCCLTrainerSendWeightsArgs"
        ):
            generation = GEN_STATIC_SENDER
    return VLLMWeightTransferAPI(version, backends, generation, platform, dist_backend)


# ---- groups ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupAddress:
    """Where one engine's group meets: the trainer's TCPStore for it, and the group's shape.

    Rank 0 is trainer rank 0; ranks 1..world_size-1 are the engine's workers (one per tensor-parallel
    shard; each receives full tensors and shards them itself, as vLLM's `load_weights` does).
    """

    name: str
    host: str
    port: int
    world_size: int
    backend: str = "gloo"
    timeout_s: float = 300.0


class WeightGroup:
    """One engine's stateless process group (outside torch.distributed's global world)."""

    def __init__(self, address: GroupAddress, rank: int, backend: Any, store: Any, device: torch.device):
        self.address = address
        self.rank = rank
        self.device = device
        self._backend = backend
        self._store = store  # keep the store (and, on rank 0, its server) alive with the group

    @property
    def name(self) -> str:
        return self.address.name

    def broadcast(self, tensor: torch.Tensor, *, src: int = 0) -> Any:
        """Start a broadcast of `tensor` from rank `src`; returns the Work (call `.wait()`)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = timedelta(seconds=self.address.timeout_s)
        return self._backend.broadcast([tensor], opts)

    def close(self) -> None:
        """Drop this group only; other engines' groups are separate objects over separate stores."""
        backend, self._backend = self._backend, None
        if backend is not None and self.address.backend != "gloo":
            with contextlib.suppress(Exception):  # a group whose peer died may refuse a clean shutdown
                backend.shutdown()
        self._store = None


def create_group_store(host: str, world_size: int, *, timeout_s: float = 300.0) -> Any:
    """Start the TCPStore server for one engine's group on trainer rank 0 (an OS-picked port).

    Its `.port` goes into that engine's `GroupAddress`; pass the store to `open_group(rank=0)`.
    """
    return dist.TCPStore(
        host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def open_group(address: GroupAddress, rank: int, *, store: Any | None = None) -> WeightGroup:
    """Join the group at `address` as `rank` (blocks until every rank has joined, or times out).

    Rank 0 passes the store from `create_group_store`; engine workers connect to it as clients.
    """
    if not 0 <= rank < address.world_size:
        raise ValueError(f"rank {rank} is outside group {address.name!r} of size {address.world_size}")
    timeout = timedelta(seconds=address.timeout_s)
    if store is None:
        store = dist.TCPStore(
            address.host, address.port, address.world_size, is_master=False, timeout=timeout
        )
    prefixed = dist.PrefixStore(f"rljob-weights/{address.name}", store)
    if address.backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        # Bind to the address the store is on, so gloo does not guess an interface from the hostname.
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address.host)]
        backend = dist.ProcessGroupGloo(prefixed, rank, address.world_size, opts)
        device = torch.device("cpu")
    elif address.backend == "nccl":
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        backend = dist.ProcessGroupNCCL(prefixed, rank, address.world_size, nccl_opts)
        device = torch.device("cuda", torch.cuda.current_device())
    elif address.backend == "hccl":
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # Ascend images only

        hccl_opts = ProcessGroupHCCL.Options()
        hccl_opts._timeout = timeout
        backend = ProcessGroupHCCL(prefixed, rank, address.world_size, hccl_opts)
        device = torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    else:
        raise ValueError(f"unknown weight-sync backend {address.backend!r}; expected gloo, nccl or hccl")
    return WeightGroup(address, rank, backend, store, device)


# ---- what to send ----------------------------------------------------------------------------------
def model_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) references to a plain model's parameters and persistent buffers, no copies.

    Tied tensors (lm_head.weight = embed_tokens.weight) are sent once, under their first name; the
    receiver's `module_loader` fills every alias. FSDP2 parameters stay DTensors here: `send_weights`
    gathers them bucket by bucket.
    """
    seen: set[int] = set()
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out.append((name, tensor))
    return out


@contextlib.contextmanager
def merged_lora_tensors(peft_model: torch.nn.Module) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Base-model tensors with the LoRA adapter merged in, in the base model's naming (for engines
    without LoRA).

    Merged out of place: each adapted weight is W + the adapter's delta, summed in float32 and
    rounded once to W's dtype, into a new tensor; the trainer's own weights are never written.
    (PEFT's merge_adapter() / unmerge_adapter() add and then subtract the delta in W's dtype: in
    bf16 each sync would move the frozen base by a rounding error, and training would go on from
    weights that are no longer the model's.) Costs a copy of the adapted weights while it is open.
    """
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()  # type: ignore[operator]
    adapted = {
        f"{name}.base_layer.weight": module
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer) and not module.merged and not module.disable_adapters
    }
    out: list[tuple[str, torch.Tensor]] = []
    with torch.no_grad():
        for name, tensor in model_tensors(base):
            if "lora_" in name:
                continue
            module = adapted.get(name)
            if module is not None:
                merged = tensor.float()
                for adapter in module.active_adapters:
                    if adapter in module.lora_A or adapter in module.lora_embedding_A:
                        merged = merged + module.get_delta_weight(adapter).float()
                tensor = merged.to(tensor.dtype)
            out.append((name.replace(".base_layer.", "."), tensor))
    yield out


def lora_adapter_tensors(peft_model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Only the LoRA adapter, in PEFT's saved-adapter naming (what vLLM's LoRA loader reads)."""
    from peft import get_peft_model_state_dict

    return list(get_peft_model_state_dict(peft_model).items())


def lora_base_and_adapter_tensors(peft_model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The unmerged base model (base-model naming) and then the adapter: what a LoRA engine whose
    weights were discarded (sleep level 2) needs to serve the policy again."""
    base = peft_model.get_base_model()  # type: ignore[operator]
    return [
        (name.replace(".base_layer.", "."), tensor)
        for name, tensor in model_tensors(base)
        if "lora_" not in name
    ] + lora_adapter_tensors(peft_model)


# What a sync sends an engine: the merged model (engines without LoRA), only the adapter (an engine
# serving LoRA whose base is intact), or base and adapter (such an engine after a level-2 sleep).
SEND_MERGED, SEND_ADAPTER, SEND_BASE_AND_ADAPTER = "merged", "adapter", "base+adapter"


@contextlib.contextmanager
def engine_tensors(
    model: torch.nn.Module, what: str = SEND_MERGED
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The tensors of one sync (`SEND_*`), as references into the model (no copies)."""
    from rljob_trainer.model import modeling

    if not modeling.is_lora(model):
        if what != SEND_MERGED:
            raise ValueError(f"send {what!r} needs a LoRA model (model.finetune lora)")
        yield model_tensors(model)
    elif what == SEND_ADAPTER:
        yield lora_adapter_tensors(model)
    elif what == SEND_BASE_AND_ADAPTER:
        yield lora_base_and_adapter_tensors(model)
    else:
        with merged_lora_tensors(model) as tensors:
            yield tensors


# ---- send and receive ------------------------------------------------------------------------------
@dataclass
class SendReport:
    """What one `send_weights` call moved: per weights version, buckets and bytes; failed groups."""

    version: int
    buckets: int = 0
    tensors: int = 0
    nbytes: int = 0
    failed: dict[str, str] = field(default_factory=dict)


def _wire_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    # Floating tensors travel in the engine's dtype; integer buffers keep theirs.
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def _materialize(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)  # FSDP2 DTensor: all-gather on every trainer rank
    t = full() if callable(full) else tensor
    return t.detach().to(_wire_dtype(t, dtype))


def send_weights(
    groups: Mapping[str, WeightGroup],
    named_tensors: Sequence[tuple[str, torch.Tensor]],
    *,
    version: int,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    device: torch.device | None = None,
) -> SendReport:
    """Broadcast `named_tensors` to every group's receivers, one bucket at a time.

    Every trainer rank calls this with the same tensors (FSDP2 gathers are collectives over the
    trainer's own group); only rank 0 passes `groups`. `dtype` is the engine's model dtype (floating
    tensors are cast on the fly). A group whose broadcast raises is closed, left out of later buckets
    and named in `failed`; the sync goes on for the others. At most one bucket is materialized at a
    time: peak extra memory is about `bucket_bytes` (or the largest tensor, which is never split)
    plus that bucket's gathered tensors. A root's broadcast completes once its bytes are handed to
    the transport, so an engine that hangs without closing its connection may go unnoticed here when
    the payload fits in socket buffers: the caller also waits (with a timeout) on each engine's
    `receive_weights` call, which is where a hung engine shows.
    """
    live = dict(groups)
    report = SendReport(version)
    metas = [TensorMeta(n, _dtype_name(_wire_dtype(t, dtype)), tuple(t.shape)) for n, t in named_tensors]
    buckets = plan_buckets(metas, bucket_bytes)
    manifest = encode_manifest(version, buckets)
    if device is None:
        device = next(iter(live.values())).device if live else torch.device("cpu")

    def broadcast_all(buffer: torch.Tensor) -> None:
        works = {}
        for name, group in list(live.items()):
            try:
                works[name] = group.broadcast(buffer)
            except Exception as exc:  # any transport error drops this engine only
                _drop(name, exc)
        for name, work in works.items():
            try:
                work.wait()
            except Exception as exc:
                _drop(name, exc)

    def _drop(name: str, exc: Exception) -> None:
        report.failed[name] = f"{type(exc).__name__}: {exc}"
        live.pop(name).close()

    if live:
        broadcast_all(torch.tensor([PROTOCOL, len(manifest)], dtype=torch.int64, device=device))
        broadcast_all(torch.frombuffer(bytearray(manifest), dtype=torch.uint8).to(device))
    position = 0
    for bucket in buckets:
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device) if live else None
        for entry in bucket.entries:
            _, tensor = named_tensors[position]
            position += 1
            value = _materialize(tensor, dtype)
            if buffer is not None:
                view = buffer[entry.offset : entry.offset + entry.meta.nbytes]
                view.view(value.dtype).view(value.shape).copy_(value)
            del value
        if buffer is not None:
            broadcast_all(buffer)
        report.buckets += 1
        report.tensors += len(bucket.entries)
        report.nbytes += bucket.nbytes
    return report


@dataclass(frozen=True)
class ReceiveReport:
    version: int
    buckets: int
    tensors: int
    nbytes: int


def receive_weights(group: WeightGroup, load: Loader) -> ReceiveReport:
    """Receive one sync from rank 0 and hand each bucket's (name, tensor view) pairs to `load`.

    The views alias a bucket buffer that is reused for nothing else but is freed after `load`
    returns, so a loader must copy (as `module_loader` does), not keep references.
    """
    header = torch.empty(2, dtype=torch.int64, device=group.device)
    group.broadcast(header).wait()
    protocol, manifest_bytes = (int(x) for x in header.tolist())
    if protocol != PROTOCOL:
        raise RuntimeError(
            f"weight-sync protocol {protocol} from the trainer, this engine speaks {PROTOCOL}; "
            "run the same trainer image on both sides"
        )
    raw = torch.empty(manifest_bytes, dtype=torch.uint8, device=group.device)
    group.broadcast(raw).wait()
    version, buckets = decode_manifest(raw.cpu().numpy().tobytes())
    total = tensors = 0
    for bucket in buckets:
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=group.device)
        group.broadcast(buffer).wait()
        items = [
            (
                e.meta.name,
                buffer[e.offset : e.offset + e.meta.nbytes].view(_dtype(e.meta.dtype)).view(e.meta.shape),
            )
            for e in bucket.entries
        ]
        load(items)
        total += bucket.nbytes
        tensors += len(items)
        del items, buffer
    return ReceiveReport(version, len(buckets), tensors, total)


def module_loader(module: torch.nn.Module) -> Loader:
    """A loader that copies tensors into `module`'s parameters and buffers in place, by name.

    Every alias of a tied tensor resolves to the same storage, so sending it once fills all of them.
    """
    return tensor_loader(module.state_dict(keep_vars=True))


def peft_adapter_loader(peft_model: torch.nn.Module, adapter_name: str = "default") -> Loader:
    """A loader for `lora_adapter_tensors` into a PEFT model's adapter, in place."""
    from peft import get_peft_model_state_dict

    # PEFT's saved-adapter dict holds the live adapter tensors (state_dict shares their storage).
    return tensor_loader(get_peft_model_state_dict(peft_model, adapter_name=adapter_name))


def tensor_loader(targets: Mapping[str, torch.Tensor]) -> Loader:
    """A loader that copies into the tensors of a name -> tensor mapping in place.

    Raises ValueError naming unknown tensors or a shape mismatch (sender and engine models differ).
    """

    def load(items: list[tuple[str, torch.Tensor]]) -> None:
        unknown = [name for name, _ in items if name not in targets]
        if unknown:
            raise ValueError(f"weights for tensors this engine's model does not have: {unknown[:5]}")
        with torch.no_grad():
            for name, value in items:
                target = targets[name]
                if tuple(target.shape) != tuple(value.shape):
                    raise ValueError(
                        f"weight {name!r} has shape {tuple(value.shape)}, "
                        f"the engine's is {tuple(target.shape)}"
                    )
                target.copy_(value)

    return load


# ---- the fallback ----------------------------------------------------------------------------------
def send_weights_via_object_store(
    named_tensors: Sequence[tuple[str, torch.Tensor]],
    engines: Sequence[Any],
    *,
    dtype: torch.dtype | None = None,
    method: str = "update_weights",
) -> int:
    """Fallback: one whole-model CPU dict put once in Ray's object store, loaded by each engine actor.

    Peak extra host memory is the dict plus the object store's copy plus each engine's deserialised
    copy; `bench/weight_sync.py` measures it against `send_weights`. Returns the tensors sent.
    """
    import ray

    payload = {name: _materialize(t, dtype).to("cpu").clone() for name, t in named_tensors}
    ref = ray.put(payload)
    del payload
    ray.get([getattr(engine, method).remote(ref) for engine in engines])
    return len(named_tensors)

"""Runtimes: where the driver's training ranks and rollout engines live, behind one small interface.

Role: `RayRuntime` creates them as Ray actors on the job's Ray cluster following the placement plan
(`rljob_trainer.placement`): one placement group per trainer pod (a bundle per accelerator, pinned
to the pod by `rljob_trainer_<i>`), ranks and shared engines on fractional shares of the same
bundle, dedicated engine j pinned to rollout pod j by `rljob_rollout_<j>`; accelerators are Ray
`GPU` or `NPU`. `LocalRuntime` calls the same objects in-process (one rank; fast tests, debugging).
Both speak `submit(handle, method, *args) -> future`, `get`, `wait_any`, `kill`.
Callers: `rljob_trainer.driver.GRPODriver`, `rljob_trainer.__main__`, tests.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from rljob_trainer import config as config_mod
from rljob_trainer import placement

log = logging.getLogger("rljob_trainer.runtimes")

# How long the driver waits for the trainer pods to join the Ray cluster with their accelerators.
PLACEMENT_TIMEOUT_S = 600.0
# The Ray concurrency group of `Host.control`: interrupt/resume reach an engine while it generates.
CONTROL_GROUP = "control"


class Host:
    """A training rank or an engine behind one `call(method, *args)` door (a Ray actor class too)."""

    def __init__(self, kind: str, cfg: config_mod.TrainerConfig, **kwargs: Any) -> None:
        # torch and the engines are imported here, in the actor, not where this class is unpickled.
        import torch

        from rljob_trainer import engines
        from rljob_trainer.train import trainer

        threads = cfg.distributed.torch_threads_per_rank
        if threads:
            torch.set_num_threads(threads)
        if kind == "rank":
            self.obj: Any = trainer.TrainingRank(cfg, kwargs["rank"], kwargs["world_size"])
        elif kind == "engine":
            self.obj = engines.build_engine(
                cfg, name=kwargs["name"], colocated=kwargs["colocated"], **kwargs.get("engine_kwargs", {})
            )
        elif kind == "reward_model":
            self.obj = engines.build_reward_model(cfg, name=kwargs["name"])
        else:
            raise ValueError(f"unknown host kind {kind!r}; valid: rank, engine, reward_model")

        self._cfg = cfg
        self._stores: dict[str, Any] = {}
        self._groups: dict[str, Any] = {}
        self._vllm: dict[str, Any] = {}  # vLLM transfer sessions: engine name (nccl) or "ipc"
        self._vllm_source: Any = None

    # Methods of the host itself (the weight groups it keeps beside its rank or engine).
    OWN_METHODS = frozenset(
        {
            "weight_group_create",
            "weight_group_open",
            "weight_group_close",
            "send_engine_weights",
            "receive_engine_weights",
            "vllm_transfer_address",
            "vllm_transfer_open",
            "vllm_transfer_send",
            "vllm_transfer_close",
        }
    )

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        target = self if method in self.OWN_METHODS else self.obj
        return getattr(target, method)(*args, **kwargs)

    # The engine calls that must reach it while a `call` (generate) runs: the Ray actor runs them in
    # its own concurrency group (`CONTROL_GROUP`), beside the one-at-a-time `call`s.
    CONTROL_METHODS = frozenset({"interrupt", "resume"})

    def control(self, method: str) -> Any:
        if method not in self.CONTROL_METHODS:
            raise ValueError(
                f"{method!r} is not a control call; valid: {', '.join(sorted(self.CONTROL_METHODS))}"
            )
        return getattr(self.obj, method)()

    # ---- weight sync over a collective (rljob_trainer.weights.weight_sync), one group per engine ----------
    # Trainer rank 0 is rank 0 of every engine's group; the engine is rank 1. Each group has its own
    # TCPStore, so adding or dropping an engine never touches another engine's group.
    def weight_group_create(self, name: str, backend: str, timeout_s: float) -> dict[str, Any]:
        """Rank 0: start the store of engine `name`'s group; returns its `GroupAddress` fields."""
        from rljob_trainer.weights import weight_sync

        host, _ = self.obj.node_address()
        store = weight_sync.create_group_store(host, 2, timeout_s=timeout_s)
        self._stores[name] = store
        address = weight_sync.GroupAddress(name, host, int(store.port), 2, backend, timeout_s)
        return dict(address.__dict__)

    def weight_group_open(self, address: dict[str, Any], rank: int) -> None:
        """Join engine `address['name']`'s group: rank 0 on the trainer (with its store), 1 on the engine."""
        from rljob_trainer.weights import weight_sync

        addr = weight_sync.GroupAddress(**address)
        self._groups[addr.name] = weight_sync.open_group(addr, rank, store=self._stores.get(addr.name))

    def weight_group_close(self, name: str) -> None:
        group = self._groups.pop(name, None)
        close = getattr(group, "close", None)  # vLLM's nccl communicator may have none
        if close is not None:
            close()
        self._stores.pop(name, None)

    def send_engine_weights(self, version: int, names: Sequence[str], what: str = "merged") -> dict[str, str]:
        """Every trainer rank: stream the policy's engine weights (`weight_sync.SEND_*`: LoRA merged,
        only the adapter, or base and adapter) bucket by bucket; rank 0 broadcasts them to the groups
        of `names`. Returns {engine: error} of failed groups."""
        from rljob_trainer.weights import weight_sync

        groups = {n: self._groups[n] for n in names if n in self._groups}
        with self._engine_tensors(what) as (tensors, dtype):
            report = weight_sync.send_weights(groups, tensors, version=version, dtype=dtype)
        for name in report.failed:
            self.weight_group_close(name)
        missing = {n: "no weight group on trainer rank 0" for n in names if n not in groups}
        return {**missing, **report.failed} if self.obj.rank == 0 else {}

    @contextlib.contextmanager
    def _engine_tensors(self, what: str = "merged") -> Iterator[tuple[list[tuple[str, Any]], Any]]:
        """The policy's tensors of one sync (`weight_sync.engine_tensors`) and the model dtype."""
        import torch

        from rljob_trainer.weights import weight_sync

        with weight_sync.engine_tensors(self.obj._parts()[0], what) as tensors:
            yield tensors, getattr(torch, self._cfg.model.dtype)

    # ---- vLLM's weight-transfer API, trainer side (weight_sync.PATH_VLLM_NATIVE) -----------------
    # NOT RUN here (no GPU): weights.vllm_transfer drives vLLM's own trainer engines (0.33) or static
    # senders (0.23 / vllm-ascend) from every trainer rank; `make test-vllm` checks the calls.
    def vllm_transfer_address(self) -> tuple[str, int]:
        """Rank 0: an address and a free port for one engine's nccl weight-transfer group."""
        import socket

        host, _ = self.obj.node_address()
        with socket.socket() as sock:
            sock.bind((host, 0))
            return host, int(sock.getsockname()[1])

    def _vllm_weights(self) -> Any:
        """This rank's vLLM `WeightSource` over the merged engine tensors (one per rank, reused)."""
        if self._vllm_source is None:
            from rljob_trainer.weights import vllm_transfer

            def tensors() -> Any:
                return self._engine_tensors_only()

            import torch

            self._vllm_source = vllm_transfer.source(tensors, getattr(torch, self._cfg.model.dtype))
        return self._vllm_source

    @contextlib.contextmanager
    def _engine_tensors_only(self) -> Iterator[list[tuple[str, Any]]]:
        with self._engine_tensors() as (tensors, _):
            yield tensors

    def vllm_transfer_open(
        self,
        name: str,
        backend: str,
        handle: Any,
        address: tuple[str, int] | None,
        world_size: int,
        generation: str,
        platform: str,
    ) -> str | None:
        """Every trainer rank: open engine `name`'s channel (nccl: its own group, rank 0 the sender;
        ipc: the one shared session, rank 0 does the handshake). Returns the error on rank 0."""
        from rljob_trainer.weights import vllm_transfer

        timeout = self._cfg.rollout.engine_timeout_s
        rank = self.obj.rank
        try:
            if backend == "nccl":
                host, port = address or ("", 0)
                self._vllm[name] = vllm_transfer.NCCLSession.open(
                    name,
                    handle,
                    rank=rank,
                    generation=generation,
                    platform=platform,
                    src=self._vllm_weights(),
                    host=host,
                    port=port,
                    world_size=world_size,
                    timeout_s=timeout,
                )
                return None
            session = self._vllm.get("ipc")
            if session is None:
                session = self._vllm["ipc"] = vllm_transfer.IPCSession.open(
                    rank=rank,
                    generation=generation,
                    platform=platform,
                    src=self._vllm_weights(),
                    timeout_s=timeout,
                )
            return session.add(name, handle) if rank == 0 else None
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}" if rank == 0 else None

    def vllm_transfer_send(self, version: int, names: dict[str, list[str]]) -> dict[str, str]:
        """Every trainer rank, the same `names` ({"nccl": [...], "ipc": [...]}): one round of the current
        weights. An engine without a session here is still iterated over (the FSDP gathers of every
        rank line up). Returns {engine: error} of the engines that failed (rank 0)."""
        failed: dict[str, str] = {}
        for name in sorted(names.get("nccl", ())):
            session = self._vllm.get(name)
            error = session.send(version) if session is not None else self._drain_vllm_weights(name)
            if error is not None:
                failed[name] = error
        ipc = sorted(names.get("ipc", ()))
        if ipc:
            session = self._vllm.get("ipc")
            if session is None:
                failed.update({n: self._drain_vllm_weights(n) or "no ipc session" for n in ipc})
            else:
                failed.update(session.send(version, ipc))
        return failed if self.obj.rank == 0 else {}

    def _drain_vllm_weights(self, name: str) -> str:
        for _ in self._vllm_weights().iter_full():
            pass
        return f"no weight-transfer channel to {name} on this rank"

    def vllm_transfer_close(self, name: str) -> None:
        """Every trainer rank: forget engine `name` (its nccl group closed, or out of the ipc session)."""
        session = self._vllm.pop(name, None)
        if session is not None:
            session.close()
        ipc = self._vllm.get("ipc")
        if ipc is not None:
            ipc.remove(name)

    def receive_engine_weights(self) -> int:
        """Engine: receive one sync into the engine in place (under its sleep rules); returns the version."""
        from rljob_trainer.weights import weight_sync

        (group,) = self._groups.values()
        engine = self.obj
        if hasattr(engine, "sleep_state"):  # refuse before the broadcast starts, not halfway through it
            engine.sleep_state.check_update()
        keep = engine.weights_version
        report = weight_sync.receive_weights(group, lambda items: engine.update_weights(items, keep))
        engine.update_weights([], report.version)
        return report.version

    @staticmethod
    def where() -> dict[str, Any]:
        """Ray's own record of this actor's placement: node id, accelerator ids, placement group."""
        import ray

        ctx = ray.get_runtime_context()
        pg = ray.util.get_current_placement_group()
        return {
            "node_id": ctx.get_node_id(),
            "accelerator_ids": {k: list(v) for k, v in ctx.get_accelerator_ids().items() if v},
            "placement_group": pg.id.hex() if pg is not None else None,
            "pid": os.getpid(),  # the actor's process (an engine's vLLM processes are its children)
        }


@dataclass(eq=False)
class _Done:
    """A finished local call (hashable by identity, like a Ray ObjectRef)."""

    value: Any


class LocalRuntime:
    """Everything in this process: one training rank, engines as plain objects (fast tests, debugging)."""

    kind = "local"

    def __init__(self, cfg: config_mod.TrainerConfig) -> None:
        if cfg.distributed.num_trainer_ranks != 1:
            raise ValueError(
                "local mode runs one training rank; set distributed.numTrainerRanks to 1 or use "
                "distributed.launcher 'ray'"
            )
        self.cfg = cfg

    def create_ranks(self, world_size: int) -> list[Any]:
        return [Host("rank", self.cfg, rank=0, world_size=world_size)]

    def where(self, handle: Any) -> Any:
        del handle
        return _Done({"node_id": "local", "accelerator_ids": {}, "placement_group": None, "pid": os.getpid()})

    def create_engine(self, name: str, *, colocated: bool, pod_index: int | None) -> Any:
        del pod_index
        return Host("engine", self.cfg, name=name, colocated=colocated)

    def create_judge(self, index: int, cfg: config_mod.TrainerConfig, kind: str = "engine") -> Any:
        """Judge engine `index` (`kind` engine: an LLM's, or reward_model), built from the judge's config
        (`data.judge.judge_engine_config`)."""
        return Host(kind, cfg, name=f"judge-{index}", colocated=False)

    def submit(self, handle: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Done(handle.call(method, *args, **kwargs))

    def submit_control(self, handle: Any, method: str) -> Any:
        return _Done(handle.control(method))

    def wait_any(self, futures: Sequence[Any], timeout_s: float | None = None) -> list[Any]:
        del timeout_s  # every local call finished when it was submitted
        return list(futures)

    def lost_errors(self) -> tuple[type[BaseException], ...]:
        """Errors that mean an engine is gone: in-process only an engine whose own processes died
        (vLLM's engine core); any other engine error is a bug."""
        from rljob_trainer.engines import base

        return (base.EngineDiedError,)

    def get(self, futures: Any) -> Any:
        if isinstance(futures, list):
            return [f.value for f in futures]
        return futures.value

    def rollout_pods(self) -> list[int]:
        return list(range(self.cfg.rollout.max_dedicated_engines))

    def kill(self, handle: Any) -> None:
        del handle

    def shutdown(self) -> None:
        pass


def pods_of_node(resources: dict[str, float]) -> tuple[str, ...]:
    """The pods (`trainer-<i>`, `rollout-<j>`) a Ray node stands for, from the marker resources it
    advertises: one in a cluster (a pod is a node), several on a private local instance."""
    pods = []
    for key in sorted(resources):
        for prefix, role in (
            (config_mod.TRAINER_RESOURCE_PREFIX, "trainer"),
            (config_mod.ROLLOUT_RESOURCE_PREFIX, "rollout"),
        ):
            if key.startswith(prefix) and key[len(prefix) :].isdigit():
                pods.append(f"{role}-{key[len(prefix) :]}")
    return tuple(pods)


class RayRuntime:
    """Ranks and engines as Ray actors on the cluster trainer pod 0 heads, placed by `placement`."""

    kind = "ray"

    def __init__(
        self,
        cfg: config_mod.TrainerConfig,
        *,
        timeout_s: float = PLACEMENT_TIMEOUT_S,
        host_cls: type | None = None,
    ) -> None:
        """`host_cls` replaces `Host` (same constructor and `call`/`where`), e.g. a light probe that
        lets a test check placement without building models."""
        import ray

        self.cfg = cfg
        self._ray = ray
        self._host_cls = ray.remote(concurrency_groups={CONTROL_GROUP: 1})(host_cls or Host)
        self.plan = placement.plan_from_config(cfg)
        self._timeout_s = timeout_s
        self._groups: list[Any] = []

    # ---- placement groups ------------------------------------------------------------------------
    def _placement_groups(self) -> list[Any]:
        """One STRICT_PACK placement group per trainer pod, created once, ready before use."""
        if self._groups:
            return self._groups
        from ray.util import placement_group

        groups = [
            placement_group(list(bundles), strategy="STRICT_PACK", name=f"rljob-trainer-{i}")
            for i, bundles in enumerate(self.plan.pod_bundles)
        ]
        deadline = time.monotonic() + self._timeout_s
        for i, pg in enumerate(groups):
            ready, _ = self._ray.wait([pg.ready()], timeout=max(1.0, deadline - time.monotonic()))
            if not ready:
                raise RuntimeError(
                    f"trainer pod {i}'s placement group {list(self.plan.pod_bundles[i])} was not placed "
                    f"within {self._timeout_s:.0f}s; the Ray cluster has {self._ray.cluster_resources()} "
                    "(did trainer pod {i} join with its accelerators?)"
                )
        self._groups = groups
        return groups

    def _options(self, slot: placement.Slot) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts: dict[str, Any] = {
            "num_cpus": slot.num_cpus,
            "num_gpus": self.plan.num_gpus(slot.accelerators),
            "resources": self.plan.resources(slot.accelerators),
        }
        if slot.trainer_pod is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self._placement_groups()[slot.trainer_pod],
                placement_group_bundle_index=slot.bundles[0],
            )
        else:
            opts["resources"] = {
                **opts["resources"],
                config_mod.rollout_resource_name(int(slot.rollout_pod or 0)): 1,
            }
        if slot.worker_share:
            # vLLM's Ray executor puts one TP worker on each of these bundles of the current group.
            opts["runtime_env"] = {
                "env_vars": {
                    "VLLM_RAY_BUNDLE_INDICES": ",".join(str(b) for b in slot.bundles),
                    "VLLM_RAY_PER_WORKER_GPUS": str(slot.worker_share),
                }
            }
        return opts

    def rank_slots(self) -> tuple[placement.Slot, ...]:
        return self.plan.ranks

    def engine_slot(self, name: str, *, colocated: bool, pod_index: int | None) -> placement.Slot:
        if not colocated:
            if pod_index is None:
                raise ValueError(f"dedicated engine {name} needs a rollout pod index")
            return self.plan.dedicated_engine(pod_index)
        for slot in self.plan.shared_engines:
            if slot.name == name:
                return slot
        raise ValueError(
            f"no placement for shared engine {name}; the plan has "
            f"{[s.name for s in self.plan.shared_engines]}"
        )

    # ---- actors ----------------------------------------------------------------------------------
    def create_ranks(self, world_size: int) -> list[Any]:
        if world_size != len(self.plan.ranks):
            raise ValueError(f"world size {world_size} != {len(self.plan.ranks)} ranks in the placement plan")
        return [
            self._host_cls.options(**self._options(slot)).remote(
                "rank", self.cfg, rank=r, world_size=world_size
            )
            for r, slot in enumerate(self.plan.ranks)
        ]

    def create_engine(self, name: str, *, colocated: bool, pod_index: int | None) -> Any:
        slot = self.engine_slot(name, colocated=colocated, pod_index=pod_index)
        engine_kwargs = {"tp_workers_in_placement_group": bool(slot.worker_share)}
        return self._host_cls.options(**self._options(slot)).remote(
            "engine", self.cfg, name=name, colocated=colocated, engine_kwargs=engine_kwargs
        )

    def create_judge(self, index: int, cfg: config_mod.TrainerConfig, kind: str = "engine") -> Any:
        """Judge engine `index` (`kind` engine: an LLM's, or reward_model) on judge pod `index`
        (`rljob_judge_<k>`), with the accelerators of its tensor parallelism, built from the judge's
        config (`data.judge.judge_engine_config`)."""
        tp = cfg.rollout.tensor_parallel
        accelerator = self.cfg.distributed.accelerator
        resources: dict[str, float] = {config_mod.judge_resource_name(index): 1}
        if accelerator == "NPU":
            resources["NPU"] = tp
        return self._host_cls.options(
            num_cpus=self.cfg.rollout.engine_num_cpus,
            num_gpus=tp if accelerator == "GPU" else 0,
            resources=resources,
        ).remote(kind, cfg, name=f"judge-{index}", colocated=False, engine_kwargs={})

    def submit(self, handle: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        return handle.call.remote(method, *args, **kwargs)

    def submit_control(self, handle: Any, method: str) -> Any:
        """A control call (`Host.CONTROL_METHODS`) that runs beside the engine's `call` in flight."""
        return handle.control.options(concurrency_group=CONTROL_GROUP).remote(method)

    def where(self, handle: Any) -> Any:
        """A future of Ray's record of where `handle` runs (`Host.where`)."""
        return handle.where.remote()

    def node_pods(self) -> dict[str, tuple[str, ...]]:
        """Ray node id -> the pods it stands for (`trainer-<i>`, `rollout-<j>`), from its resources."""
        return {
            n["NodeID"]: pods_of_node(n.get("Resources", {})) for n in self._ray.nodes() if n.get("Alive")
        }

    def wait_any(self, futures: Sequence[Any], timeout_s: float | None = None) -> list[Any]:
        """The futures that are done: at least one, or none after `timeout_s`."""
        done, _ = self._ray.wait(list(futures), num_returns=1, timeout=timeout_s)
        if done:  # take every other finished one too, so a busy loop drains them in one pass
            more, _ = self._ray.wait(list(futures), num_returns=len(futures), timeout=0)
            done = more or done
        return done

    def lost_errors(self) -> tuple[type[BaseException], ...]:
        """Errors that mean an actor (an engine) or its node is gone, not that its code failed."""
        from ray import exceptions

        from rljob_trainer.engines import base

        # An actor method's exception arrives as a RayTaskError subclass of its own type, so an
        # engine whose vLLM processes died (`EngineDiedError`) is caught here like a dead actor.
        return (
            exceptions.RayActorError,
            exceptions.NodeDiedError,
            exceptions.ActorUnavailableError,
            base.EngineDiedError,
        )

    def get(self, futures: Any) -> Any:
        return self._ray.get(futures)

    def rollout_pods(self) -> list[int]:
        """Rollout pods whose Ray node is alive (they advertise `rljob_rollout_<j>`); a dead node's
        pod is not one, even while Ray still lists its resources."""
        pods = {
            int(pod.removeprefix("rollout-"))
            for names in self.node_pods().values()
            for pod in names
            if pod.startswith("rollout-")
        }
        return sorted(pods)

    def kill(self, handle: Any) -> None:
        self._ray.kill(handle)

    def shutdown(self) -> None:
        from ray.util import remove_placement_group

        for pg in self._groups:
            try:
                remove_placement_group(pg)
            except Exception as e:  # the cluster may already be going down
                log.warning("removing a placement group failed: %s", e)
        self._groups = []


Runtime = LocalRuntime | RayRuntime

"""Where every training rank and rollout engine goes: the placement plan (pure).

Role: turn the trainer's layout (ranks per trainer pod, tensor parallelism, shared engines, the Ray
accelerator name) into Ray placement: one placement group per trainer pod with one bundle per
trainer accelerator, pinned to that pod by its custom resource `rljob_trainer_<i>`; each bundle holds
one training rank and, when the plan has shared engines, a share of the same accelerator for a
shared engine (fractional shares, as verl's colocated worker groups do). A shared engine of TP t
spans t bundles of one pod. A dedicated engine j is pinned to rollout pod j by `rljob_rollout_<j>`
and holds all t accelerators of that pod. Ascend accelerators are Ray's `NPU`, GPUs `GPU`.
Callers: `rljob_trainer.runtimes.RayRuntime` (turns slots into Ray options), tests.

Pure: plain values in, frozen dataclasses out; no Ray import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rljob_trainer import config as config_mod

# A training rank and a colocated engine split one accelerator evenly (vLLM's engine sleeps while
# the rank trains, so the share is a scheduling fact, not a memory split).
COLOCATED_SHARE = 0.5


@dataclass(frozen=True)
class Slot:
    """Where one actor goes.

    `trainer_pod`/`bundles`: the trainer pod whose placement group holds it and the bundle indices it
    occupies (the first hosts the actor itself); `rollout_pod` for a dedicated engine instead.
    `accelerators`: Ray accelerator units the actor itself holds (its Ray `num_gpus`, or `NPU`).
    `worker_share`: with TP > 1 on a shared engine, the share each TP worker takes of each bundle
    (vLLM's VLLM_RAY_PER_WORKER_GPUS); 0 otherwise.
    """

    name: str
    trainer_pod: int | None
    bundles: tuple[int, ...]
    rollout_pod: int | None
    accelerators: float
    num_cpus: float
    worker_share: float = 0.0

    @property
    def pod(self) -> str:
        """`trainer-<i>` or `rollout-<j>`: the pod this actor must run in."""
        if self.trainer_pod is not None:
            return f"trainer-{self.trainer_pod}"
        return f"rollout-{self.rollout_pod}"


@dataclass(frozen=True)
class PlacementPlan:
    """Bundles of every trainer pod's placement group, and the slot of every rank and shared engine."""

    accelerator: str | None  # Ray resource name: GPU, NPU, or None on CPU
    pod_bundles: tuple[tuple[dict[str, float], ...], ...]
    ranks: tuple[Slot, ...]
    shared_engines: tuple[Slot, ...]
    tensor_parallel: int
    engine_num_cpus: float

    def dedicated_engine(self, pod_index: int) -> Slot:
        """Dedicated engine `pod_index`: on rollout pod `pod_index`, holding its TP accelerators."""
        return Slot(
            name=f"dedicated-{pod_index}",
            trainer_pod=None,
            bundles=(),
            rollout_pod=pod_index,
            accelerators=float(self.tensor_parallel) if self.accelerator else 0.0,
            num_cpus=self.engine_num_cpus,
        )

    def resources(self, accelerators: float) -> dict[str, float]:
        """Ray `resources` of an actor holding `accelerators` units (NPU is a custom resource name)."""
        if self.accelerator == "NPU" and accelerators > 0:
            return {"NPU": accelerators}
        return {}

    def num_gpus(self, accelerators: float) -> float:
        """Ray `num_gpus` of an actor holding `accelerators` units (0 unless the accelerator is GPU)."""
        return accelerators if self.accelerator == "GPU" else 0.0


def plan_placement(
    pod_ranks: Sequence[int],
    *,
    accelerator: str | None,
    shared_engines: int,
    tensor_parallel: int = 1,
    rank_num_cpus: float = 1.0,
    engine_num_cpus: float = 1.0,
) -> PlacementPlan:
    """The placement of `sum(pod_ranks)` ranks (pod i holds `pod_ranks[i]`) and `shared_engines`
    engines of TP `tensor_parallel` on the trainer accelerators.

    Shared engine k goes to the k-th group of `tensor_parallel` consecutive bundles, pod by pod; a pod
    of a ranks has room for a // tensor_parallel of them. Raises ValueError when there is no room
    (the operator's plan never asks for more; a hand-written config might).
    """
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
    if any(n < 1 for n in pod_ranks) or not pod_ranks:
        raise ValueError(f"every trainer pod needs at least one rank, got {list(pod_ranks)}")
    if accelerator not in (None, "GPU", "NPU"):
        raise ValueError(f"unknown Ray accelerator {accelerator!r}; valid: GPU, NPU or none (CPU)")
    engine_groups = [
        (pod, b)
        for pod, n in enumerate(pod_ranks)
        for b in range(0, n - n % tensor_parallel, tensor_parallel)
    ]
    if shared_engines > len(engine_groups):
        raise ValueError(
            f"{shared_engines} shared engines of TP {tensor_parallel} do not fit on trainer pods with "
            f"{list(pod_ranks)} accelerators (room for {len(engine_groups)}); lower rollout.sharedEngines"
        )
    colocated = {(pod, b + t) for pod, b in engine_groups[:shared_engines] for t in range(tensor_parallel)}
    unit = 1.0 if accelerator else 0.0
    pod_bundles: list[tuple[dict[str, float], ...]] = []
    ranks: list[Slot] = []
    rank = 0
    for pod, n in enumerate(pod_ranks):
        bundles = []
        for b in range(n):
            shared_here = (pod, b) in colocated
            cpus = rank_num_cpus + (engine_num_cpus if shared_here else 0.0)
            bundle = {"CPU": cpus} if cpus > 0 else {}  # Ray refuses zero amounts in a bundle
            bundle[config_mod.trainer_resource_name(pod)] = 1.0
            if accelerator:
                bundle[accelerator] = 1.0
            bundles.append(bundle)
            share = unit * (COLOCATED_SHARE if shared_here else 1.0)
            ranks.append(Slot(f"rank-{rank}", pod, (b,), None, share, rank_num_cpus))
            rank += 1
        pod_bundles.append(tuple(bundles))
    engines: list[Slot] = []
    for k, (pod, first) in enumerate(engine_groups[:shared_engines]):
        bundles = tuple(range(first, first + tensor_parallel))
        if tensor_parallel == 1:
            # The engine process itself runs the model on its share of the accelerator.
            engines.append(Slot(f"shared-{k}", pod, bundles, None, unit * COLOCATED_SHARE, engine_num_cpus))
        else:
            # vLLM's TP workers take the shares (VLLM_RAY_BUNDLE_INDICES / VLLM_RAY_PER_WORKER_GPUS);
            # the engine's own process only drives them.
            engines.append(
                Slot(
                    f"shared-{k}",
                    pod,
                    bundles,
                    None,
                    0.0,
                    engine_num_cpus,
                    worker_share=unit * COLOCATED_SHARE,
                )
            )
    return PlacementPlan(
        accelerator=accelerator,
        pod_bundles=tuple(pod_bundles),
        ranks=tuple(ranks),
        shared_engines=tuple(engines),
        tensor_parallel=tensor_parallel,
        engine_num_cpus=engine_num_cpus,
    )


def plan_from_config(cfg: config_mod.TrainerConfig) -> PlacementPlan:
    """The placement `cfg` asks for (the trainer.json the operator rendered)."""
    d, r = cfg.distributed, cfg.rollout
    return plan_placement(
        d.pod_ranks,
        accelerator=d.accelerator,
        shared_engines=r.shared_engines,
        tensor_parallel=r.tensor_parallel,
        rank_num_cpus=d.rank_num_cpus,
        engine_num_cpus=r.engine_num_cpus,
    )

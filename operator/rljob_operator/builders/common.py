"""Shared pieces of the builders: the job reference, the layout of pods, and the template hash.

Role: `JobRef` names one RLJob; `JobLayout` turns a plan (`api.PlanStatus`, written by the
estimator adapter or the static placeholder) into pod counts and per-pod accelerator requests,
which every pod builder and the handlers' diff use. Pure: no clock, env or API.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from typing import Any

from rljob_operator import api, names


@dataclasses.dataclass(frozen=True)
class JobRef:
    """One RLJob: its name, namespace and uid (None offline: `rljob render`). Owner references are
    added by the shell; the uid only names what must never be mistaken for an earlier RLJob's."""

    name: str
    namespace: str
    uid: str | None = None

    @property
    def key(self) -> str:
        return names.job_key(self.namespace, self.name)


@dataclasses.dataclass(frozen=True)
class JobLayout:
    """How many pods of each role a job has and what each requests.

    `trainer_accelerators[i]` is what trainer pod i requests (one pod per node, at most
    `acceleratorsPerNode` each); every dedicated rollout pod requests `rollout_accelerators_per_pod`
    (one engine of `tensorParallel` accelerators per pod, docs/contracts.md §3); every judge pod
    `judge_accelerators_per_pod` (one judge engine, status.plan.judge), on top of the job's total.
    """

    trainer_accelerators: tuple[int, ...]
    rollout_pods: int
    rollout_accelerators_per_pod: int
    shared_engines: int
    total_accelerators: int
    judge_pods: int = 0  # one per judge engine (spec.reward.judge), outside total_accelerators
    judge_accelerators_per_pod: int = 0

    @property
    def trainer_pods(self) -> int:
        return len(self.trainer_accelerators)

    @property
    def used_accelerators(self) -> int:
        return sum(self.trainer_accelerators) + self.rollout_pods * self.rollout_accelerators_per_pod

    @property
    def idle_accelerators(self) -> int:
        """Accelerators of the job's budget running nothing (room for more dedicated engines)."""
        return max(0, self.total_accelerators - self.used_accelerators)


def compute_layout(
    spec: api.RLJobSpec, plan: api.PlanStatus, dedicated_engines: int | None = None
) -> JobLayout:
    """Pods and requests for `plan`; `dedicated_engines` (adaptive targets) overrides the plan's count.

    Raises ValueError when the plan has no trainer accelerators (a plan bug, never user input).
    """
    per_node = spec.resources.accelerators_per_node
    trainer_total = plan.trainer_accelerators or 0
    if trainer_total < 1:
        raise ValueError(f"plan.trainerAccelerators must be at least 1, got {plan.trainer_accelerators}")
    full, rest = divmod(trainer_total, per_node)
    trainer = tuple([per_node] * full + ([rest] if rest else []))
    tp = plan.tensor_parallel or 1
    engines = (
        plan.rollout_engines if plan.rollout_engines is not None else (plan.rollout_accelerators or 0) // tp
    )
    if dedicated_engines is not None:
        engines = dedicated_engines
    judge = plan.judge
    judge_tp = (judge.tensor_parallel or 1) if judge is not None else 0
    return JobLayout(
        trainer_accelerators=trainer,
        rollout_pods=max(0, engines),
        rollout_accelerators_per_pod=tp,
        shared_engines=plan.shared_engines or 0,
        total_accelerators=spec.resources.total_accelerators,
        judge_pods=(judge.engines or 0) if judge is not None else 0,
        judge_accelerators_per_pod=judge_tp,
    )


def resource_name(spec: api.RLJobSpec) -> str | None:
    """The extended resource pods request (None for cpu jobs)."""
    acc = spec.resources.accelerator
    if acc.resource_name:
        return acc.resource_name
    return api.DEFAULT_RESOURCE_NAMES[acc.kind]


def content_hash(obj: Any) -> str:
    """A short, stable hash of a JSON-able object (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def deep_copy(obj: Any) -> Any:
    """Deep-copy user-supplied structures so builders never alias or mutate their input."""
    return copy.deepcopy(obj)

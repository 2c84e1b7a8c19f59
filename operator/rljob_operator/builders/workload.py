"""Kueue Workloads (`kueue.x-k8s.io/v1beta2`) for RLJobs admitted through a LocalQueue.

Role: pure builder of the Workload the shell creates for an RLJob labelled
`kueue.x-k8s.io/queue-name` (names.kueue_queue_name), before any pod exists. Kueue reserves quota
for the whole Workload at once, so the podSets are the job's core, everything it needs to make
progress: the trainer pods, the minimum dedicated rollout pods, the judge's pods and each
environment's servers (one podSet `environment-<name>` each). Engines added in adaptive mode
beyond the minimum are not in it (each is its own lower-priority Workload, so Kueue preempts them
before the core). Called by the shell with the pods `builders.pods` built, so the requests Kueue
counts are exactly the ones the pods will carry.

A podSet is a set of identical pods. Pods of one role fall into one podSet unless their scheduling
differs (a trainer pod on a partly used last node requests fewer accelerators): then the role gets
one podSet per distinct request, `trainer`, `trainer-1`, ... in pod order. Pure: the owner reference
(controller: true, to the RLJob) is added by the shell, and the priority value is read by the shell
from the class it names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

from rljob_operator import names
from rljob_operator.builders.common import JobRef, content_hash, deep_copy

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "Workload"
# Kueue's limit on podSets per Workload (WorkloadSpec.podSets MaxItems).
MAX_POD_SETS = 8
# Pod fields that differ between pods of one set and do not change where or how they schedule.
_PER_POD_SPEC_FIELDS = ("hostname",)
# Pod spec fields Kueue's flavor assignment and quota read (requests, placement, priority).
_SCHEDULING_FIELDS = (
    "nodeSelector",
    "tolerations",
    "affinity",
    "priorityClassName",
    "overhead",
    "topologySpreadConstraints",
)


@dataclasses.dataclass(frozen=True)
class WorkloadPriority:
    """The class a Workload's priority comes from and its value (the shell reads the value).

    A `WorkloadPriorityClass` (label `kueue.x-k8s.io/priority-class` on the RLJob) orders the
    Workload in its queue without touching pod priority; a `PriorityClass` is the pods' own
    (spec.trainerPool.priorityClassName), which Kueue also uses when no WorkloadPriorityClass is set.
    """

    kind: Literal["WorkloadPriorityClass", "PriorityClass"]
    name: str
    value: int

    @property
    def group(self) -> str:
        return GROUP if self.kind == "WorkloadPriorityClass" else "scheduling.k8s.io"


def _scheduling_signature(pod: dict[str, Any]) -> str:
    spec = pod["spec"]
    requests = [
        (c.get("name"), c.get("resources", {}))
        for key in ("initContainers", "containers")
        for c in spec.get(key, [])
    ]
    return content_hash({"requests": requests, **{f: spec.get(f) for f in _SCHEDULING_FIELDS}})


def _template(pod: dict[str, Any]) -> dict[str, Any]:
    spec = {k: v for k, v in deep_copy(pod["spec"]).items() if k not in _PER_POD_SPEC_FIELDS}
    labels = {k: v for k, v in pod["metadata"].get("labels", {}).items() if k != names.LABEL_INDEX}
    return {"metadata": {"labels": labels}, "spec": spec}


def group_pod_sets(
    role_pods: Sequence[tuple[str, Sequence[dict[str, Any]]]],
) -> list[tuple[str, list[dict[str, Any]]]]:
    """`(podSet name, its pods)` for `(role, pods)` pairs, in order: one per run of identically
    scheduled pods. The shell maps an admission's podSetAssignments back to pods with it."""
    out: list[tuple[str, list[dict[str, Any]]]] = []
    for role, pods in role_pods:
        groups: list[tuple[str, list[dict[str, Any]]]] = []
        for pod in pods:
            signature = _scheduling_signature(pod)
            if groups and groups[-1][0] == signature:
                groups[-1][1].append(pod)
            else:
                groups.append((signature, [pod]))
        out += [(role if k == 0 else f"{role}-{k}", members) for k, (_, members) in enumerate(groups)]
    return out


def pod_sets_quota_hash(role_pods: Sequence[tuple[str, Sequence[dict[str, Any]]]]) -> str:
    """The hash of what Kueue's quota and flavor assignment read of the podSets these pods make:
    each podSet's name, count, requests and placement fields (not images, env or commands)."""
    return content_hash(
        [
            (name, len(members), _scheduling_signature(members[0]))
            for name, members in group_pod_sets(role_pods)
        ]
    )


def build_pod_sets(role_pods: Sequence[tuple[str, Sequence[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Kueue podSets for `(role, pods)` pairs, in order: one per run of identically scheduled pods.

    Raises ValueError when that takes more than Kueue's 8 podSets."""
    pod_sets = [
        {"name": name, "count": len(members), "template": _template(members[0])}
        for name, members in group_pod_sets(role_pods)
    ]
    if len(pod_sets) > MAX_POD_SETS:
        raise ValueError(
            f"the job's pods need {len(pod_sets)} Kueue podSets ({', '.join(p['name'] for p in pod_sets)}); "
            f"Kueue allows at most {MAX_POD_SETS}"
        )
    return pod_sets


def build_workload(
    job: JobRef,
    trainer_pods: Sequence[dict[str, Any]],
    rollout_pods: Sequence[dict[str, Any]],
    *,
    queue_name: str,
    priority: WorkloadPriority | None = None,
    extra: Sequence[tuple[str, Sequence[dict[str, Any]]]] = (),
) -> dict[str, Any]:
    """The Workload `rljob-<job>` asking LocalQueue `queue_name` to admit the trainer pods, the
    minimum dedicated rollout pods (`rollout_pods`; empty when rollout shares the trainer's
    accelerators) and `extra` (podSet name, pods): the judge's pods and each environment's."""
    if not trainer_pods:
        raise ValueError("a Workload needs the job's trainer pods; got none")
    spec: dict[str, Any] = {
        "queueName": queue_name,
        "podSets": build_pod_sets(
            [(names.ROLE_TRAINER, trainer_pods), (names.ROLE_ROLLOUT, rollout_pods), *extra]
        ),
    }
    if priority is not None:
        # Kueue's CEL rule: a priorityClassRef needs the priority value next to it.
        spec["priorityClassRef"] = {"group": priority.group, "kind": priority.kind, "name": priority.name}
        spec["priority"] = priority.value
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": names.workload_name(job.name),
            "namespace": job.namespace,
            "labels": {names.LABEL_JOB: job.name, names.LABEL_MANAGED_BY: names.MANAGED_BY},
        },
        "spec": spec,
    }


def build_engine_workload(
    job: JobRef, rollout_pod: dict[str, Any], index: int, *, queue_name: str, core_priority: int | None
) -> dict[str, Any]:
    """The Workload `rljob-<job>-rollout-<index>` of one dedicated engine that adaptive mode added
    beyond the minimum: one podSet `rollout` of one pod, one below the core Workload's priority, so
    quota bounds scale-up and Kueue preempts extra engines before the job's core (its
    `LowerPriority` rule). No priorityClassRef: the value is all Kueue orders by."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": names.engine_workload_name(job.name, index),
            "namespace": job.namespace,
            "labels": {
                names.LABEL_JOB: job.name,
                names.LABEL_MANAGED_BY: names.MANAGED_BY,
                names.LABEL_ROLE: names.ROLE_ROLLOUT,
                names.LABEL_INDEX: str(index),
            },
        },
        "spec": {
            "queueName": queue_name,
            "podSets": build_pod_sets([(names.ROLE_ROLLOUT, [rollout_pod])]),
            "priority": (core_priority or 0) - 1,
        },
    }

"""Native gang scheduling: the `scheduling.k8s.io/v1beta1` PodGroup of an RLJob (Kubernetes 1.37).

Role: pure builders for clusters whose apiserver serves PodGroups (feature gate GenericWorkload,
API scheduling.k8s.io/v1beta1). The gang is the job's core, the trainer pods plus the minimum
dedicated rollout pods: the scheduler binds all `minCount` of them together or none, so a job that
does not fit never holds part of the accelerators. Each core pod names the group in
`spec.schedulingGroup.podGroupName`. Engines added later in adaptive mode stay outside the gang.
The shell checks that the API is served (and says so in status when not) and adds the owner
reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rljob_operator import api, names
from rljob_operator.builders.common import JobLayout, JobRef, compute_layout, deep_copy

API_VERSION = "scheduling.k8s.io/v1beta1"
KIND = "PodGroup"


def build_pod_group(job: JobRef, *, min_count: int, priority_class_name: str | None = None) -> dict[str, Any]:
    """The PodGroup `<job>` whose `min_count` pods schedule all together or not at all.

    Disruption mode `all`: a training gang that lost one rank cannot step, so the group is
    disrupted (preempted) as a whole, never pod by pod."""
    if min_count < 1:
        raise ValueError(f"a PodGroup's gang minCount must be at least 1, got {min_count}")
    spec: dict[str, Any] = {
        "schedulingPolicy": {"gang": {"minCount": min_count}},
        "disruptionMode": {"all": {}},
    }
    if priority_class_name:
        spec["priorityClassName"] = priority_class_name
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": names.pod_group_name(job.name),
            "namespace": job.namespace,
            "labels": {names.LABEL_JOB: job.name, names.LABEL_MANAGED_BY: names.MANAGED_BY},
        },
        "spec": spec,
    }


@dataclasses.dataclass(frozen=True)
class Gang:
    """A job's gang: the PodGroup's name, its `min_count` and the pods that belong to it."""

    group: str
    min_count: int
    members: frozenset[str]


def job_gang(job: JobRef, spec: api.RLJobSpec, plan: api.PlanStatus, layout: JobLayout) -> Gang:
    """The job's core as one gang: every trainer pod plus the plan's dedicated rollout pods (the
    minimum; fewer when the adaptive policy lowered the target below it) and the judge's pods.
    Rollout pods the policy adds beyond the plan schedule on their own: the job runs without them."""
    core = compute_layout(spec, plan)
    rollouts = min(core.rollout_pods, layout.rollout_pods)
    members = [names.trainer_pod_name(job.name, i) for i in range(layout.trainer_pods)]
    members += [names.rollout_pod_name(job.name, j) for j in range(rollouts)]
    # The judge's engines hold accelerators the job cannot step without: in the gang. Environment
    # servers (CPU, restarted by their kubelet, recreated alone) schedule on their own.
    members += [names.judge_pod_name(job.name, k) for k in range(layout.judge_pods)]
    return Gang(names.pod_group_name(job.name), len(members), frozenset(members))


def with_gang(pods: Sequence[dict[str, Any]], gang: Gang) -> list[dict[str, Any]]:
    """`pods` with the gang's members in its PodGroup (copies; the others unchanged)."""
    return [
        with_scheduling_group(p, gang.group) if p["metadata"]["name"] in gang.members else p for p in pods
    ]


def min_count_of(group: dict[str, Any] | None) -> int | None:
    """The `minCount` of a stored PodGroup (None when absent or not a gang)."""
    policy = ((group or {}).get("spec") or {}).get("schedulingPolicy") or {}
    value = (policy.get("gang") or {}).get("minCount")
    return value if isinstance(value, int) else None


def with_scheduling_group(pod: dict[str, Any], pod_group_name: str) -> dict[str, Any]:
    """A copy of `pod` that belongs to PodGroup `pod_group_name` (the input is not changed)."""
    out = deep_copy(pod)
    out["spec"]["schedulingGroup"] = {"podGroupName": pod_group_name}
    return out

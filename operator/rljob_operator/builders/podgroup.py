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

from typing import Any

from rljob_operator import names
from rljob_operator.builders.common import JobRef, deep_copy

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


def with_scheduling_group(pod: dict[str, Any], pod_group_name: str) -> dict[str, Any]:
    """A copy of `pod` that belongs to PodGroup `pod_group_name` (the input is not changed)."""
    out = deep_copy(pod)
    out["spec"]["schedulingGroup"] = {"podGroupName": pod_group_name}
    return out

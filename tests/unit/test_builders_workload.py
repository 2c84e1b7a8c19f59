"""Unit tests for rljob_operator.builders.workload: the Kueue Workload of a queued RLJob.

What Kueue will count and check: podSets `trainer` and `rollout` carrying exactly the pods'
requests and placement, identical pods folded into one podSet with a count, the LocalQueue, a
priority class reference with its value (Kueue's CEL rule wants both), and nothing left to the
caller's dicts (the builder never aliases or mutates its input)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rljob_operator import api, builders, names
from rljob_operator.builders import workload

JOB = builders.JobRef("demo", "team-a")


def make_spec(total: int, trainer: int, rollout: int, tp: int = 8) -> api.RLJobSpec:
    return api.RLJobSpec.model_validate(
        {
            "model": {"name": "tiny", "source": {"tiny": {}}, "config": {"inline": {"model_type": "llama"}}},
            "data": {"source": {"builtin": {"name": "toy-arithmetic"}}},
            "resources": {
                "accelerator": {"kind": "nvidia", "model": "H100-80GB"},
                "totalAccelerators": total,
                "acceleratorsPerNode": 8,
                "mode": "static",
                "static": {"trainerAccelerators": trainer, "rolloutAccelerators": rollout},
                "rollout": {"tensorParallel": tp},
            },
            "trainerPool": {
                "nodeSelector": {"pool": "h100"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            },
        }
    )


def job_pods(spec: api.RLJobSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    static = spec.resources.static
    assert static is not None
    tp = spec.resources.rollout.tensor_parallel or 1
    plan = api.PlanStatus(
        trainer_accelerators=static.trainer_accelerators,
        rollout_accelerators=static.rollout_accelerators,
        rollout_engines=static.rollout_accelerators // tp,
        shared_engines=0 if static.rollout_accelerators else 1,
        tensor_parallel=tp,
    )
    layout = builders.compute_layout(spec, plan)
    pods = builders.build_pods(JOB, spec, layout)
    return pods[: layout.trainer_pods], pods[layout.trainer_pods :]


def gpus(pod_set: dict[str, Any]) -> str:
    return pod_set["template"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"]


def test_trainer_and_rollout_pod_sets_carry_the_pods_requests_and_placement() -> None:
    spec = make_spec(total=32, trainer=16, rollout=16)
    trainers, rollouts = job_pods(spec)
    wl = workload.build_workload(JOB, trainers, rollouts, queue_name="team-a-queue")
    assert wl["apiVersion"] == "kueue.x-k8s.io/v1beta2" and wl["kind"] == "Workload"
    assert wl["metadata"]["name"] == names.workload_name("demo") == "rljob-demo"
    assert wl["metadata"]["namespace"] == "team-a"
    assert wl["metadata"]["labels"][names.LABEL_JOB] == "demo"
    assert wl["spec"]["queueName"] == "team-a-queue"
    assert "priorityClassRef" not in wl["spec"] and "priority" not in wl["spec"]
    sets = wl["spec"]["podSets"]
    assert [(s["name"], s["count"], gpus(s)) for s in sets] == [("trainer", 2, "8"), ("rollout", 2, "8")]
    trainer_spec = sets[0]["template"]["spec"]
    assert trainer_spec["nodeSelector"] == {"pool": "h100"}
    assert trainer_spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert trainer_spec["containers"][0]["resources"] == trainers[0]["spec"]["containers"][0]["resources"]
    # One template stands for every pod of the set: nothing pod-specific in it.
    assert "hostname" not in trainer_spec
    assert names.LABEL_INDEX not in sets[0]["template"]["metadata"]["labels"]


def test_a_partly_used_last_trainer_node_gets_its_own_pod_set() -> None:
    spec = make_spec(total=24, trainer=20, rollout=0, tp=4)
    trainers, rollouts = job_pods(spec)
    assert rollouts == []
    sets = workload.build_workload(JOB, trainers, rollouts, queue_name="q")["spec"]["podSets"]
    # 20 trainer accelerators on 8-GPU nodes: two full pods and one with 4. No rollout podSet.
    assert [(s["name"], s["count"], gpus(s)) for s in sets] == [("trainer", 2, "8"), ("trainer-1", 1, "4")]


@pytest.mark.parametrize(
    ("kind", "group"),
    [("WorkloadPriorityClass", "kueue.x-k8s.io"), ("PriorityClass", "scheduling.k8s.io")],
)
def test_priority_class_reference_comes_with_its_value(kind: str, group: str) -> None:
    trainers, rollouts = job_pods(make_spec(total=16, trainer=8, rollout=8))
    priority = workload.WorkloadPriority(kind, "research-high", 1000)  # type: ignore[arg-type]
    spec = workload.build_workload(JOB, trainers, rollouts, queue_name="q", priority=priority)["spec"]
    assert spec["priorityClassRef"] == {"group": group, "kind": kind, "name": "research-high"}
    assert spec["priority"] == 1000


def test_the_builder_neither_aliases_nor_mutates_the_pods() -> None:
    trainers, rollouts = job_pods(make_spec(total=16, trainer=8, rollout=8))
    before = copy.deepcopy((trainers, rollouts))
    wl = workload.build_workload(JOB, trainers, rollouts, queue_name="q")
    assert (trainers, rollouts) == before
    wl["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["env"].clear()
    assert trainers[0]["spec"]["containers"][0]["env"], "the template aliases the pod's env"


def test_no_trainer_pods_is_a_builder_bug() -> None:
    with pytest.raises(ValueError, match="trainer pods"):
        workload.build_workload(JOB, [], [], queue_name="q")


def test_more_than_eight_pod_sets_is_refused_with_the_names() -> None:
    trainers, _ = job_pods(make_spec(total=16, trainer=8, rollout=8))
    varied = []
    for i in range(9):
        pod = copy.deepcopy(trainers[0])
        pod["spec"]["nodeSelector"] = {"pool": f"p{i}"}
        varied.append(pod)
    with pytest.raises(ValueError, match=r"9 Kueue podSets \(trainer, trainer-1.*at most 8"):
        workload.build_workload(JOB, varied, [], queue_name="q")

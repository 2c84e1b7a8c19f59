"""The real Kueue manager on the local control plane (`testenv.kueue`), with its own webhooks.

Kueue (built from sigs.k8s.io/kueue at the version in tests/testenv/kueue/go.mod) runs as its
ServiceAccount under its own ClusterRole, with its webhooks served on loopback. The Workloads here
are what `builders.workload` makes of a cpu RLJob's pods, so Kueue's CRD schema, its mutating and
validating webhooks and its scheduler all judge the builder's output: the first Workload fits the
ClusterQueue's quota and is admitted with a flavor per podSet; a second identical one does not fit
and waits, and is admitted once the first is gone.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from test_operator import TINY_CONFIG

from rljob_operator import api, builders
from rljob_operator.builders import workload
from testenv import kueue as kueue_env
from testenv.waiting import wait_for

pytestmark = pytest.mark.cluster


def cpu_rljob(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """Two trainer pods and one dedicated rollout pod, 1 cpu and 2Gi each (3 cpu, 6Gi)."""
    return {
        "apiVersion": "rljob.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "model": {"name": "tiny", "source": {"tiny": {}}, "config": {"inline": TINY_CONFIG}},
            "data": {"source": {"builtin": {"name": "toy-arithmetic"}}},
            "resources": {
                "accelerator": {"kind": "cpu"},
                "totalAccelerators": 3,
                "acceleratorsPerNode": 1,
                "mode": "static",
                "static": {"trainerAccelerators": 2, "rolloutAccelerators": 1},
                # The transformers engine: TINY_CONFIG's head size (8) is one vLLM's CPU attention
                # refuses (UnsupportedHeadSize), and these jobs are about quota, not engines.
                "rollout": {"tensorParallel": 1, "kind": "transformers"},
                "memory": "2Gi",  # the quota arithmetic below (a vLLM cpu job's default is 6Gi)
            },
        },
    }


def cpu_job_pods(namespace: str, name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Two trainer pods and one dedicated rollout pod of a cpu RLJob: 1 cpu and 2Gi each."""
    spec = api.RLJobSpec.model_validate(cpu_rljob(name)["spec"])
    plan = api.PlanStatus(
        trainer_accelerators=2, rollout_accelerators=1, rollout_engines=1, shared_engines=0, tensor_parallel=1
    )
    layout = builders.compute_layout(spec, plan)
    pods = builders.build_pods(builders.JobRef(name, namespace), spec, layout)
    return pods[:2], pods[2:]


def condition(wl: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((wl or {}).get("status") or {}).get("conditions", []):
        if c["type"] == type_:
            return dict(c)
    return {}


def test_kueue_admits_a_workload_within_quota_and_queues_the_next(
    cluster: Any, kueue: kueue_env.Kueue, namespace: str
) -> None:
    assert kueue.ready()
    cq = f"cq-{namespace}"[:63]
    # Room for one job (3 cpu, 6Gi), not two.
    queues = kueue_env.queue_manifests(
        namespace=namespace,
        flavor=f"flavor-{namespace}"[:63],  # cluster-scoped: one per test
        cluster_queue=cq,
        local_queue="team-queue",
        quota={"cpu": "4", "memory": "8Gi"},
    )
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(queues))
    try:
        # The mutating webhook defaulted the ClusterQueue (its queueing strategy): webhooks answer.
        cq_obj = cluster.get_json("clusterqueue", cq, check=True)
        assert cq_obj["spec"]["queueingStrategy"] == "BestEffortFIFO"
        wait_for(
            "the ClusterQueue to be Active",
            lambda: condition(cluster.get_json("clusterqueue", cq), "Active").get("status") == "True",
        )

        first = workload.build_workload(
            builders.JobRef("first", namespace), *cpu_job_pods(namespace, "first"), queue_name="team-queue"
        )
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(first))
        name = first["metadata"]["name"]
        admitted = wait_for(
            f"Workload {name} to be admitted",
            lambda: (
                (wl := cluster.get_json("workload", name, namespace=namespace))
                and condition(wl, "Admitted").get("status") == "True"
                and wl
            ),
        )
        assert condition(admitted, "QuotaReserved")["status"] == "True"
        admission = admitted["status"]["admission"]
        assert admission["clusterQueue"] == cq
        assignments = {a["name"]: a for a in admission["podSetAssignments"]}
        assert sorted(assignments) == ["rollout", "trainer"]
        assert assignments["trainer"]["count"] == 2 and assignments["rollout"]["count"] == 1
        flavor = f"flavor-{namespace}"[:63]
        assert assignments["trainer"]["flavors"] == {"cpu": flavor, "memory": flavor}
        assert assignments["trainer"]["resourceUsage"] == {"cpu": "2", "memory": "4Gi"}

        second = workload.build_workload(
            builders.JobRef("second", namespace), *cpu_job_pods(namespace, "second"), queue_name="team-queue"
        )
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(second))
        second_name = second["metadata"]["name"]
        pending = wait_for(
            f"Workload {second_name} to be refused quota",
            lambda: (
                (wl := cluster.get_json("workload", second_name, namespace=namespace))
                and condition(wl, "QuotaReserved").get("status") == "False"
                and wl
            ),
        )
        assert condition(pending, "QuotaReserved")["reason"] == "Pending"
        assert "insufficient unused quota for cpu" in condition(pending, "QuotaReserved")["message"]

        cluster.kubectl("delete", "workload", name, "-n", namespace)
        wait_for(
            f"Workload {second_name} to be admitted once {name} is gone",
            lambda: (
                condition(cluster.get_json("workload", second_name, namespace=namespace), "Admitted").get(
                    "status"
                )
                == "True"
            ),
        )
        # Kueue ran under the RBAC of its own kustomization, and lacked nothing.
        forbidden = [line for line in kueue.log().splitlines() if "forbidden" in line]
        assert forbidden == [], forbidden[:3]
    finally:
        cluster.kubectl("delete", "workloads", "--all", "-n", namespace, "--wait=true", check=False)
        cluster.kubectl("delete", "-f", "-", "--wait=false", input=yaml.safe_dump_all(queues), check=False)


def test_kueue_validating_webhook_answers_on_loopback(
    cluster: Any, kueue: kueue_env.Kueue, namespace: str
) -> None:
    """A rule only Kueue's webhook knows (the CRD schema allows it): a podSet container may not
    request the resource `pods`, which Kueue reserves for itself."""
    wl = workload.build_workload(
        builders.JobRef("bad", namespace), *cpu_job_pods(namespace, "bad"), queue_name="team-queue"
    )
    wl["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"]["requests"]["pods"] = "1"
    result = cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(wl), check=False)
    assert result.returncode != 0
    assert 'admission webhook "vworkload.kb.io" denied the request' in result.stderr, result.stderr
    assert "reserved for internal kueue use" in result.stderr

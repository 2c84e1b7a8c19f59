"""Native gang scheduling on a 1.37 control plane with the GenericWorkload gate on.

A control plane of its own (module scope): kube-apiserver, controller-manager and scheduler with
`--feature-gates=GenericWorkload=true`, the apiserver also serving `scheduling.k8s.io/v1beta1`
(a beta API, off by default). What the operator will rely on once the shell creates PodGroups:
the API is served; the PodGroup `builders.podgroup` makes is valid; pods naming it keep
`spec.schedulingGroup`; and the real scheduler binds a gang all together or not at all: three
8-GPU pods on two 8-GPU nodes stay unbound, every one of them, while the same pods without the
gang get two of three bound (the control), and a third node lets the whole gang bind.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from rljob_operator import builders
from rljob_operator.builders import podgroup
from testenv.cluster import LocalCluster
from testenv.waiting import wait_for

pytestmark = pytest.mark.cluster

GATES = ("GenericWorkload=true",)
RUNTIME_CONFIG = ("scheduling.k8s.io/v1beta1=true",)


@pytest.fixture(scope="module")
def gang_cluster() -> Iterator[LocalCluster]:
    local = LocalCluster.create(feature_gates=GATES, runtime_config=RUNTIME_CONFIG)
    with local:
        yield local


def gpu_pod(name: str, namespace: str, pool: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodeSelector": {"pool": pool},
            "containers": [
                {
                    "name": "c",
                    "image": "registry.local/none",
                    "resources": {"requests": {"nvidia.com/gpu": "8"}, "limits": {"nvidia.com/gpu": "8"}},
                }
            ],
        },
    }


def bound(cluster: LocalCluster, namespace: str) -> dict[str, str]:
    pods = cluster.get_json("pods", namespace=namespace) or {"items": []}
    return {p["metadata"]["name"]: p["spec"].get("nodeName", "") for p in pods["items"]}


def test_the_api_is_served_and_accepts_the_builders_pod_group(gang_cluster: LocalCluster) -> None:
    resources = gang_cluster.kubectl("api-resources", "--api-group=scheduling.k8s.io", "-o", "name").stdout
    assert "podgroups.scheduling.k8s.io" in resources.split()
    namespace = gang_cluster.create_namespace(f"gang-{uuid.uuid4().hex[:6]}")
    group = podgroup.build_pod_group(builders.JobRef("demo", namespace), min_count=2)
    gang_cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(group))
    stored = gang_cluster.get_json(
        "podgroup.v1beta1.scheduling.k8s.io", "demo", namespace=namespace, check=True
    )
    assert stored["spec"]["schedulingPolicy"] == {"gang": {"minCount": 2}}
    assert stored["spec"]["disruptionMode"] == {"all": {}}
    pod = podgroup.with_scheduling_group(gpu_pod("demo-trainer-0", namespace, "nowhere"), "demo")
    gang_cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(pod))
    stored_pod = gang_cluster.get_json("pod", "demo-trainer-0", namespace=namespace, check=True)
    assert stored_pod["spec"]["schedulingGroup"] == {"podGroupName": "demo"}


def test_a_gang_that_does_not_fit_leaves_every_pod_unbound(gang_cluster: LocalCluster) -> None:
    pool = f"p{uuid.uuid4().hex[:6]}"
    nodes = gang_cluster.add_nodes(
        2, name_prefix=pool, resource="nvidia.com/gpu", per_node=8, labels={"pool": pool}
    )
    try:
        # The control: without a gang the scheduler binds what fits, two pods of three.
        loose = gang_cluster.create_namespace(f"loose-{pool}")
        for i in range(3):
            gang_cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(gpu_pod(f"p-{i}", loose, pool)))
        wait_for(
            "two of three loose pods bound",
            lambda: sum(1 for n in bound(gang_cluster, loose).values() if n) == 2,
        )
        gang_cluster.kubectl("delete", "pods", "--all", "-n", loose, "--wait=true", "--timeout=60s")

        namespace = gang_cluster.create_namespace(f"gang-{pool}")
        group = podgroup.build_pod_group(builders.JobRef("job", namespace), min_count=3)
        gang_cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(group))
        for i in range(3):
            pod = podgroup.with_scheduling_group(gpu_pod(f"job-{i}", namespace, pool), "job")
            gang_cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(pod))
        # The scheduler bound the loose pods within seconds; watch the gang for longer than that,
        # failing the moment any one of its pods is bound.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            partial = {n: node for n, node in bound(gang_cluster, namespace).items() if node}
            assert partial == {}, f"part of the gang was bound: {partial}"
            time.sleep(0.5)
        assert bound(gang_cluster, namespace) == {"job-0": "", "job-1": "", "job-2": ""}

        nodes += gang_cluster.add_nodes(
            1, name_prefix=f"{pool}x", resource="nvidia.com/gpu", per_node=8, labels={"pool": pool}
        )
        placed = wait_for(
            "the whole gang to bind once it fits",
            lambda: (b := bound(gang_cluster, namespace)) and all(b.values()) and b,
            90,
        )
        assert len(set(placed.values())) == 3
    finally:
        gang_cluster.delete_nodes(nodes)

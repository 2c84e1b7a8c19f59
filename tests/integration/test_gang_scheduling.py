"""Native gang scheduling on a 1.37 control plane with the GenericWorkload gate on.

A control plane of its own (module scope): kube-apiserver, controller-manager and scheduler with
`--feature-gates=GenericWorkload=true`, the apiserver also serving `scheduling.k8s.io/v1beta1`
(a beta API, off by default). What the operator relies on: the API is served; the PodGroup
`builders.podgroup` makes is valid; pods naming it keep `spec.schedulingGroup`; and the real
scheduler binds a gang all together or not at all: three 8-GPU pods on two 8-GPU nodes stay
unbound, every one of them, while the same pods without the gang get two of three bound (the
control), and a third node lets the whole gang bind. Then the operator itself (in-process, as its
ServiceAccount with the operator ClusterRole): an RLJob that does not fit as a whole leaves every
pod unbound, never some of them, and binds all at once when a node arrives; one that fits gets all
its pods bound. (Without the API the operator says so in the GangScheduling condition:
tests/integration/test_operator.py.)
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from test_operator import CRD, condition, job_status, operator, pods, rljob

from rljob_operator import builders
from rljob_operator.builders import podgroup, rbac
from testenv.cluster import LocalCluster, restricted
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
        "spec": restricted(
            {
                "nodeSelector": {"pool": pool},
                "containers": [
                    {
                        "name": "c",
                        "image": "registry.local/none",
                        "resources": {"requests": {"nvidia.com/gpu": "8"}, "limits": {"nvidia.com/gpu": "8"}},
                    }
                ],
            }
        ),
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


# ---- the operator creates the gang ---------------------------------------------------------------
@pytest.fixture
def gang_operator_env(gang_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The CRD on the gang cluster, a namespace, and KUBECONFIG as the operator's ServiceAccount
    bound to the operator ClusterRole (so the chart's rules are what allows the PodGroup)."""
    gang_cluster.apply_crds(str(CRD))
    namespace = gang_cluster.create_namespace(f"gang-op-{uuid.uuid4().hex[:6]}")
    name = f"rljob-operator-{namespace}"
    gang_cluster.kubectl("create", "serviceaccount", "rljob-operator", "-n", namespace)
    role = rbac.build_operator_cluster_role(name)
    binding = rbac.build_operator_cluster_role_binding(name, "rljob-operator", namespace, role=name)
    gang_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([role, binding]))
    token = gang_cluster.kubectl(
        "create", "token", "rljob-operator", "-n", namespace, "--duration=1h"
    ).stdout.strip()
    monkeypatch.setenv("KUBECONFIG", str(gang_cluster.token_kubeconfig(token, name)))
    yield namespace
    gang_cluster.kubectl("delete", "clusterrolebinding,clusterrole", name, check=False)
    gang_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_operator_gang_that_does_not_fit_binds_no_pod_until_it_all_fits(
    gang_cluster: LocalCluster, gang_operator_env: str
) -> None:
    namespace = gang_operator_env
    pool = f"g{uuid.uuid4().hex[:6]}"
    # The job: two 8-GPU trainer pods and one 8-GPU rollout pod. The pool: three 8-GPU nodes, so
    # the capacity check lets the job go on, but another pod holds one of them: two fit now.
    nodes = gang_cluster.add_nodes(
        3, name_prefix=pool, resource="nvidia.com/gpu", per_node=8, labels={"pool": pool}
    )
    try:
        gang_cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(gpu_pod("blocker", namespace, pool)))
        wait_for("the blocker bound", lambda: bound(gang_cluster, namespace).get("blocker"))
        with operator(namespace):
            gang_cluster.kubectl(
                "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(rljob("big", pool))
            )
            created = wait_for(
                "the operator's 3 pods",
                lambda: len(items := pods(gang_cluster, namespace, "big")) == 3 and items,
            )
            for pod in created:
                assert pod["spec"]["schedulingGroup"] == {"podGroupName": "big"}, pod["metadata"]["name"]
            group = gang_cluster.get_json(
                "podgroup.v1beta1.scheduling.k8s.io", "big", namespace=namespace, check=True
            )
            assert group["spec"]["schedulingPolicy"] == {"gang": {"minCount": 3}}
            job = gang_cluster.get_json("rljob", "big", namespace=namespace, check=True)
            (ref,) = group["metadata"]["ownerReferences"]
            assert ref["uid"] == job["metadata"]["uid"] and ref["controller"] is True
            st = wait_for(
                "GangScheduling=True",
                lambda: (
                    condition(s := job_status(gang_cluster, namespace, "big"), "GangScheduling").get("status")
                    == "True"
                    and s
                ),
            )
            assert condition(st, "GangScheduling")["reason"] == "PodGroupCreated"
            # Without the gang the scheduler would bind two of the three within seconds.
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                partial = {
                    n: node for n, node in bound(gang_cluster, namespace).items() if node and n != "blocker"
                }
                assert partial == {}, f"part of the job's gang was bound: {partial}"
                time.sleep(0.5)
            assert job_status(gang_cluster, namespace, "big")["phase"] == "Pending"

            gang_cluster.kubectl("delete", "pod", "blocker", "-n", namespace, "--wait=true", "--timeout=60s")
            placed = wait_for(
                "the whole job to bind once it fits",
                lambda: (b := bound(gang_cluster, namespace)) and len(b) == 3 and all(b.values()) and b,
                90,
            )
            assert sorted(placed) == ["big-rollout-0", "big-trainer-0", "big-trainer-1"]
            assert len(set(placed.values())) == 3
            wait_for(
                "phase Running", lambda: job_status(gang_cluster, namespace, "big").get("phase") == "Running"
            )
    finally:
        gang_cluster.delete_nodes(nodes)


def test_operator_gang_that_fits_gets_every_pod_bound(
    gang_cluster: LocalCluster, gang_operator_env: str
) -> None:
    namespace = gang_operator_env
    pool = f"f{uuid.uuid4().hex[:6]}"
    nodes = gang_cluster.add_nodes(
        3, name_prefix=pool, resource="nvidia.com/gpu", per_node=8, labels={"pool": pool}
    )
    try:
        with operator(namespace):
            gang_cluster.kubectl(
                "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(rljob("fits", pool))
            )
            placed = wait_for(
                "all 3 pods bound",
                lambda: len(b := bound(gang_cluster, namespace)) == 3 and all(b.values()) and b,
                90,
            )
            assert all(node.startswith(pool) for node in placed.values())
            for pod in pods(gang_cluster, namespace, "fits"):
                assert pod["spec"]["schedulingGroup"] == {"podGroupName": "fits"}
            wait_for(
                "phase Running", lambda: job_status(gang_cluster, namespace, "fits").get("phase") == "Running"
            )
    finally:
        gang_cluster.delete_nodes(nodes)

"""The local control plane is the real thing: apiserver, controllers, scheduler, GC and RBAC.

Every other integration test in rljob relies on these behaviours, so they are checked here first.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from testenv.cluster import LocalCluster, restricted
from testenv.waiting import wait_for

pytestmark = pytest.mark.cluster


WIDGET_CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: widgets.testenv.rljob.io}
spec:
  group: testenv.rljob.io
  names: {kind: Widget, plural: widgets, singular: widget}
  scope: Namespaced
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              size: {type: integer, minimum: 1}
"""


def test_crd_and_custom_objects_round_trip_through_kubectl(cluster: LocalCluster, namespace: str) -> None:
    cluster.kubectl("apply", "-f", "-", input=WIDGET_CRD)
    cluster.kubectl("wait", "--for=condition=Established", "crd/widgets.testenv.rljob.io", "--timeout=30s")
    widget = "apiVersion: testenv.rljob.io/v1\nkind: Widget\nmetadata: {name: w1}\nspec: {size: 3}\n"
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=widget)
    assert cluster.get_json("widget", "w1", "-n", namespace, check=True)["spec"]["size"] == 3

    cluster.kubectl("patch", "widget", "w1", "-n", namespace, "--type=merge", "-p", '{"spec":{"size":5}}')
    assert cluster.get_json("widget", "w1", "-n", namespace, check=True)["spec"]["size"] == 5

    rejected = cluster.kubectl(
        "patch", "widget", "w1", "-n", namespace, "--type=merge", "-p", '{"spec":{"size":0}}', check=False
    )
    assert rejected.returncode != 0 and "spec.size" in rejected.stderr

    cluster.kubectl("delete", "widget", "w1", "-n", namespace)
    assert cluster.kubectl("get", "widget", "w1", "-n", namespace, check=False).returncode != 0


def test_deployment_gets_replicaset_and_running_pods(cluster: LocalCluster, namespace: str) -> None:
    pool = f"pool-{uuid.uuid4().hex[:6]}"
    cluster.add_nodes(1, name_prefix=pool, resource=None, labels={"pool": pool})
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": restricted(
                    {"nodeSelector": {"pool": pool}, "containers": [{"name": "web", "image": "nginx"}]}
                ),
            },
        },
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(deployment))
    replicasets = wait_for(
        "a ReplicaSet", lambda: cluster.get_json("replicasets", "-n", namespace, check=True)["items"]
    )
    assert replicasets[0]["metadata"]["ownerReferences"][0]["kind"] == "Deployment"

    def running_pods() -> list[dict[str, Any]]:
        pods = cluster.get_json("pods", "-n", namespace, "-l", "app=web", check=True)["items"]
        return [p for p in pods if p["status"].get("phase") == "Running"] if len(pods) == 2 else []

    pods = wait_for("two running pods", lambda: len(running_pods()) == 2 and running_pods())
    assert {p["spec"]["nodeName"] for p in pods} == {f"{pool}-0"}
    cluster.kubectl("rollout", "status", "deployment/web", "-n", namespace, "--timeout=60s")


def _gpu_pod(name: str, pool: str, gpus: int) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": restricted(
                {
                    "nodeSelector": {"pool": pool},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [
                        {
                            "name": "main",
                            "image": "trainer",
                            "resources": {
                                "limits": {"nvidia.com/gpu": str(gpus)},
                                "requests": {"nvidia.com/gpu": str(gpus)},
                            },
                        }
                    ],
                }
            ),
        }
    )


def test_scheduler_binds_gpu_pod_to_node_with_room_and_leaves_the_rest_pending(
    cluster: LocalCluster, namespace: str
) -> None:
    pool = f"gpu-{uuid.uuid4().hex[:6]}"
    taint = [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
    small, big = (f"{pool}-small", f"{pool}-big")
    cluster.add_nodes(1, name_prefix=small, per_node=2, labels={"pool": pool}, taints=taint)
    cluster.add_nodes(1, name_prefix=big, per_node=8, labels={"pool": pool}, taints=taint)

    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=_gpu_pod("fits", pool, 4))
    bound = wait_for(
        "binding",
        lambda: cluster.get_json("pod", "fits", "-n", namespace, check=True)["spec"].get("nodeName"),
    )
    assert bound == f"{big}-0", "only the 8-GPU node has room for 4 GPUs"
    wait_for(
        "",
        lambda: (
            cluster.get_json("pod", "fits", "-n", namespace, check=True)["status"].get("phase") == "Running"
        ),
    )

    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=_gpu_pod("too-big", pool, 6))

    def unschedulable() -> bool:
        pod = cluster.get_json("pod", "too-big", "-n", namespace, check=True)
        conditions = {c["type"]: c for c in pod["status"].get("conditions", [])}
        scheduled = conditions.get("PodScheduled", {})
        return scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable"

    wait_for("the scheduler to report Unschedulable", unschedulable)
    pod = cluster.get_json("pod", "too-big", "-n", namespace, check=True)
    assert not pod["spec"].get("nodeName") and pod["status"]["phase"] == "Pending"
    assert "nvidia.com/gpu" in pod["status"]["conditions"][0]["message"]


def test_deleting_an_owner_garbage_collects_its_children(cluster: LocalCluster, namespace: str) -> None:
    cluster.kubectl("create", "configmap", "owner", "-n", namespace)
    owner_uid = cluster.get_json("configmap", "owner", "-n", namespace, check=True)["metadata"]["uid"]
    child = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "child",
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}],
        },
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(child))
    cluster.kubectl("delete", "configmap", "owner", "-n", namespace)
    wait_for(
        "the garbage collector to delete the child",
        lambda: cluster.kubectl("get", "configmap", "child", "-n", namespace, check=False).returncode != 0,
    )


def test_service_account_token_is_refused_what_its_role_does_not_grant(
    cluster: LocalCluster, namespace: str
) -> None:
    cluster.kubectl("create", "serviceaccount", "narrow", "-n", namespace)
    cluster.kubectl("create", "configmap", "allowed", "-n", namespace)
    cluster.kubectl("create", "configmap", "secret-ish", "-n", namespace)
    cluster.kubectl(
        "create",
        "role",
        "read-one",
        "-n",
        namespace,
        "--verb=get",
        "--resource=configmaps",
        "--resource-name=allowed",
    )
    cluster.kubectl(
        "create",
        "rolebinding",
        "read-one",
        "-n",
        namespace,
        "--role=read-one",
        f"--serviceaccount={namespace}:narrow",
    )
    token = cluster.kubectl("create", "token", "narrow", "-n", namespace).stdout.strip()
    as_sa = ("--kubeconfig", str(cluster.token_kubeconfig(token, f"{namespace}-narrow")), "-n", namespace)

    def get(*args: str) -> Any:
        return cluster.kubectl("get", *args, *as_sa, check=False)

    assert wait_for("RBAC to allow the granted get", lambda: get("configmap", "allowed").returncode == 0)
    refused = get("configmap", "secret-ish")
    assert refused.returncode != 0 and "forbidden" in refused.stderr.lower()
    assert get("configmaps").returncode != 0, "list is not granted"
    assert get("pods").returncode != 0
    deleted = cluster.kubectl("delete", "configmap", "allowed", *as_sa, check=False)
    assert deleted.returncode != 0 and "forbidden" in deleted.stderr.lower()


def test_fake_accelerator_nodes_are_ready_with_capacity_labels_taints_and_a_fresh_lease(
    cluster: LocalCluster,
) -> None:
    prefix = f"npu-{uuid.uuid4().hex[:6]}"
    taint = [{"key": "huawei.com/Ascend910", "value": "present", "effect": "NoSchedule"}]
    (name,) = cluster.add_nodes(
        1,
        name_prefix=prefix,
        resource="huawei.com/Ascend910",
        per_node=8,
        labels={"accelerator": "ascend-910b"},
        taints=taint,
    )
    node = cluster.get_json("node", name, check=True)
    assert node["status"]["allocatable"]["huawei.com/Ascend910"] == "8"
    assert node["metadata"]["labels"]["accelerator"] == "ascend-910b"
    assert node["spec"]["taints"][0]["key"] == "huawei.com/Ascend910"
    ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
    assert ready == "True"
    lease = cluster.get_json("lease", name, "-n", "kube-node-lease", check=True)
    assert lease["spec"]["holderIdentity"] == name

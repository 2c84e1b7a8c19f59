"""The chart's node-pool presets, dashboard and PodMonitor, with real helm on the local cluster.

`values-ascend.yaml` installs a pools ConfigMap the operator reads; an Ascend RLJob with no
tolerations or nodeSelector of its own then gets the preset's, and the real scheduler binds its
pods to the (tainted, labelled) NPU node. The operator runs as a process with the installed
Deployment's arguments and environment and the ServiceAccount's token (no container runs here).
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_helm_chart import CHART, env_of, free_port, helm_ok, one, operator_process, render

from rljob_operator.decide import pools
from testenv.waiting import wait_for

pytestmark = [pytest.mark.cluster]

ASCEND_VALUES = CHART / "values-ascend.yaml"
NVIDIA_VALUES = CHART / "values-nvidia.yaml"


def _config_map_roles(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chart's Roles that grant ConfigMaps (the leader-election Role grants only its Lease)."""
    return [
        d
        for d in docs
        if d["kind"] == "Role" and any("configmaps" in r.get("resources", []) for r in d.get("rules", []))
    ]


def test_presets_render_a_pools_configmap_the_operator_accepts(cluster: Any) -> None:
    for values, kind in ((ASCEND_VALUES, "ascend"), (NVIDIA_VALUES, "nvidia")):
        docs = render(cluster, "-f", str(values))
        cm = one(docs, "ConfigMap")
        catalog = pools.parse_pool_catalog(cm["data"][pools.POOLS_KEY])
        assert list(catalog.pools) == [kind] and catalog.pools[kind].accelerator_kinds == [kind]
        assert catalog.default_pool is None
        env = env_of(one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0])
        assert env["RLJOB_POOLS_CONFIGMAP"] == f"rljob-system/{cm['metadata']['name']}"
        assert not _config_map_roles(docs)  # all namespaces: the ClusterRole reads it
    ascend = pools.parse_pool_catalog(
        one(render(cluster, "-f", str(ASCEND_VALUES)), "ConfigMap")["data"]["pools.json"]
    )
    assert ascend.pools["ascend"].trainer_image.endswith("-ascend")
    assert "Ascend910C" in ascend.pools["ascend"].devices
    # One namespace: a Role in the release namespace reads exactly that ConfigMap.
    docs = render(cluster, "-f", str(ASCEND_VALUES), "--set", "watchNamespaces={team-a}")
    roles = {d["metadata"]["namespace"]: d for d in _config_map_roles(docs)}
    assert roles["rljob-system"]["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": ["rel-rljob-pools"],
            "verbs": ["get"],
        }
    ]
    # Nothing pool-related without pools.
    docs = render(cluster)
    assert not [d for d in docs if d["kind"] == "ConfigMap"]
    assert "RLJOB_POOLS_CONFIGMAP" not in env_of(
        one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    )


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["--set", "pools.x.acceleratorKinds={tpu}"], "acceleratorKinds"),
        (["--set", "pools.x.tolerence=1"], "tolerence"),
        (["--set", "pools.x.devices.D.memoryGiB=8"], "hbmBandwidthGBps"),
        (["--set", "pools.Bad_Name.trainerImage=x"], "Bad_Name"),
    ],
)
def test_schema_rejects_bad_pools(cluster: Any, values: list[str], message: str) -> None:
    result = cluster.helm("template", "rel", str(CHART), *values, check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_dashboard_configmap_and_pod_monitor(cluster: Any) -> None:
    docs = render(cluster, "--set", "dashboards.enabled=true", "--set", "metrics.podMonitor.enabled=true")
    cm = one(docs, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "dashboards" / "rljob.json").read_text())
    assert json.loads(cm["data"]["rljob.json"]) == shipped
    monitor = one(docs, "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/managed-by": "rljob-operator",
        "rljob.io/role": "trainer",
        "rljob.io/index": "0",
    }
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert not [d for d in render(cluster) if d["kind"] in ("PodMonitor", "ConfigMap")]  # both off by default
    lint = cluster.helm(
        "lint", "--strict", str(CHART), "-f", str(ASCEND_VALUES), "--set", "dashboards.enabled=true"
    )
    assert "0 chart(s) failed" in lint.stdout, lint.stdout


ASCEND_JOB = """
apiVersion: rljob.io/v1alpha1
kind: RLJob
metadata: {name: npu-job}
spec:
  model:
    name: Qwen3-8B
    source: {hub: {id: Qwen/Qwen3-8B}}
    config: {preset: Qwen/Qwen3-8B}
    finetune: {mode: lora}
  grpo: {groupSize: 8, promptsPerStep: 32, maxSteps: 10}
  lengths: {maxPromptTokens: 1024, maxCompletionTokens: 2048}
  data: {source: {builtin: {name: gsm8k-sample}}}
  resources:
    accelerator: {kind: ascend, model: Ascend910B3}
    totalAccelerators: 8
    acceleratorsPerNode: 8
    mode: estimate
"""


def test_ascend_preset_puts_a_plain_ascend_job_on_the_npu_node(
    cluster: Any, namespace: str, tmp_path: Path
) -> None:
    release = f"rljob-{uuid.uuid4().hex[:6]}"
    system_ns = cluster.create_namespace(f"{release}-system")
    preset = yaml.safe_load(ASCEND_VALUES.read_text())["pools"]["ascend"]
    selector, taint_key = preset["nodeSelector"], preset["tolerations"][0]["key"]
    # The NPU node as an Ascend cluster has it: labelled, tainted, with hugepages reserved; and a
    # GPU node the job could land on if the preset's selector were not applied.
    npu = cluster.add_nodes(
        1, name_prefix=f"{release}-npu", resource="huawei.com/Ascend910", labels=dict(selector),
        taints=[{"key": taint_key, "value": "present", "effect": "NoSchedule"}],
    )  # fmt: skip
    gpu = cluster.add_nodes(1, name_prefix=f"{release}-gpu", resource="huawei.com/Ascend910")
    api = cluster.api_client()
    from kubernetes import client

    core = client.CoreV1Api(api)
    for node in npu + gpu:
        status = core.read_node_status(node).status
        capacity = {**status.capacity, "hugepages-2Mi": "8Gi"} if node in npu else status.capacity
        core.patch_node_status(node, {"status": {"capacity": capacity, "allocatable": capacity}})
    installed = False
    try:
        helm_ok(cluster, "install", release, str(CHART), "--namespace", system_ns, "-f", str(ASCEND_VALUES))
        installed = True
        deployment = json.loads(
            cluster.kubectl("get", f"deployment/{release}", "-n", system_ns, "-o", "json").stdout
        )
        ctr = deployment["spec"]["template"]["spec"]["containers"][0]
        token = cluster.kubectl("create", "token", release, "-n", system_ns, "--duration=1h").stdout.strip()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "RLJOB_"))}
        env.update(env_of(ctr))
        env.update(
            KUBECONFIG=str(cluster.token_kubeconfig(token, f"{release}-operator")),
            RLJOB_METRICS_PORT="0",
            RLJOB_RECONCILE_INTERVAL_S="1",
        )
        args = [a for a in ctr["args"] if not a.startswith("--liveness=")]
        argv = [
            str(Path(sys.executable).parent / "rljob"),
            *args,
            f"--liveness=http://127.0.0.1:{free_port()}/healthz",
        ]
        log = tmp_path / "operator.log"
        with operator_process(argv, env, log) as proc:
            cluster.kubectl("apply", "-n", namespace, "-f", "-", input=ASCEND_JOB)

            def bound() -> list[dict[str, Any]]:
                if proc.poll() is not None:
                    raise AssertionError(f"the operator exited:\n{log.read_text()[-4000:]}")
                data = cluster.get_json("pods", "-l", "rljob.io/job=npu-job", namespace=namespace) or {}
                items = data.get("items", [])
                return items if items and all(p["spec"].get("nodeName") for p in items) else []

            try:
                items = wait_for("the NPU job's pods to be scheduled", bound, 60, interval_s=0.5)
            except AssertionError:
                status = (cluster.get_json("rljob", "npu-job", namespace=namespace) or {}).get("status")
                events = cluster.kubectl("get", "events", "-n", namespace, check=False).stdout
                raise AssertionError(
                    f"{json.dumps(status, indent=1)}\n{events}\n{log.read_text()[-3000:]}"
                ) from None
            for pod in items:
                spec = pod["spec"]
                assert spec["nodeName"] == npu[0], (pod["metadata"]["name"], spec["nodeName"])
                assert spec["nodeSelector"] == selector
                assert [t["key"] for t in spec["tolerations"] if t["key"].startswith("huawei")] == [taint_key]
                c = spec["containers"][0]
                assert c["image"] == preset["trainerImage"]
                assert c["resources"]["limits"]["hugepages-2Mi"] == preset["extraResources"]["hugepages-2Mi"]
                assert c["resources"]["requests"]["memory"] == preset["memory"]
            cluster.kubectl("delete", "rljob/npu-job", "-n", namespace, "--wait=true", "--timeout=30s")
    finally:
        api.close()
        if installed:
            cluster.helm("uninstall", release, "--namespace", system_ns, check=False)
        cluster.delete_nodes(npu + gpu)
        cluster.kubectl("delete", "namespace", system_ns, "--wait=false", check=False)

"""The operator's side of a shared cluster, against the real control plane.

- Each job gets its Ray token Secret (random, immutable, owned, never in the status, readable
  by no one the operator gave a Role) and its NetworkPolicy, under the operator's own ClusterRole.
- An RLJob asking for ten billion layers is refused at `kubectl apply`; one whose config comes
  from a ConfigMap (no schema sees it) fails by its own status, and the operator stays up for
  the next job.
- Deletes name the uid they decided on: an RLJob or pod recreated under the same name survives
  a delete meant for its predecessor (the TTL's, a leftover's).
- A status computed from a stale RLJob is not written blind: the apiserver refuses it (409), and
  the operator re-reads and writes it once more on the fresh one.
- The watches' label selectors select on the server exactly the operator's pods and telemetry
  ConfigMaps.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from test_operator import TINY_CONFIG, apply, condition, job_status, operator, pods, rljob, running_pods

from rljob_operator import api, handlers
from rljob_operator.kube import adapter, metrics
from rljob_operator.reconcile import guards
from testenv.cluster import restricted
from testenv.waiting import wait_for

pytestmark = pytest.mark.cluster


def idle_pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    """A pod no node takes (its pool has none): an object on the apiserver, never run."""
    spec = restricted({"nodeSelector": {"pool": "nowhere"}, "containers": [{"name": "c", "image": "x"}]})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": spec}


def test_a_job_gets_its_token_secret_and_its_fence(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str], operator_identity: str
) -> None:
    pool_name = pool(3)
    with operator(namespace):
        apply(cluster, namespace, rljob("demo", pool_name))
        items = wait_for("3 running pods", running_pods(cluster, namespace, "demo", 3))
        job = cluster.get_json("rljob", "demo", namespace=namespace)
        uid = job["metadata"]["uid"]
        secret = cluster.get_json("secret", f"demo-ray-auth-{uid[:8]}", namespace=namespace)
        assert secret is not None and secret["immutable"] is True
        assert secret["metadata"]["ownerReferences"][0]["uid"] == uid
        token = base64.b64decode(secret["data"]["auth_token"]).decode()
        assert re.fullmatch(r"[0-9a-f]{64}", token)  # 32 random bytes
        for pod in items:  # every pod, trainer and rollout, from the Secret: never the value
            env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
            assert env["RAY_AUTH_MODE"]["value"] == "token"
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
            assert token not in json.dumps(pod)
        fence = cluster.get_json("networkpolicy", "demo", namespace=namespace)
        assert fence["metadata"]["ownerReferences"][0]["uid"] == uid
        assert fence["spec"]["podSelector"]["matchLabels"]["rljob.io/job"] == "demo"
        st = wait_for(
            "phase Running",
            lambda: (s := job_status(cluster, namespace, "demo")).get("phase") == "Running" and s,
        )
        assert token not in json.dumps(cluster.get_json("rljob", "demo", namespace=namespace))
        # The job's own ServiceAccount (its pods) cannot read the Secret: the kubelet hands it over.
        sa = f"system:serviceaccount:{namespace}:demo"
        can = cluster.kubectl("auth", "can-i", "get", "secrets", "-n", namespace, "--as", sa, check=False)
        assert can.stdout.strip() == "no"
        assert condition(st, "Ready")["status"] == "True"


def test_an_unbounded_model_config_is_refused_and_the_operator_stays_up(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str], kubeconfig_env: None
) -> None:
    pool_name = pool(3)
    huge = rljob("huge", pool_name)
    huge["spec"]["model"]["config"]["inline"] = {**TINY_CONFIG, "num_hidden_layers": 10_000_000_000}
    refused = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(huge), check=False)
    assert refused.returncode != 0
    assert "spec.model.config.inline.num_hidden_layers" in refused.stderr
    assert "less than or equal to 1024" in refused.stderr, refused.stderr

    # No schema sees a config in a ConfigMap: the estimator's bound refuses it, fast, in the status.
    config = {**TINY_CONFIG, "num_hidden_layers": 10_000_000_000}
    cluster.kubectl(
        "create",
        "configmap",
        "huge-config",
        "-n",
        namespace,
        f"--from-literal=config.json={json.dumps(config)}",
    )
    via_map = rljob("via-map", pool_name)
    via_map["spec"]["model"]["config"] = {"configMapRef": {"name": "huge-config"}}
    with operator(namespace) as runner:
        apply(cluster, namespace, via_map)
        st = wait_for(
            "via-map Failed",
            lambda: (s := job_status(cluster, namespace, "via-map")).get("phase") == "Failed" and s,
            60,
        )
        planned = condition(st, "Planned")
        assert planned["reason"] == "InvalidModelConfig"
        assert "num_hidden_layers: 10000000000 is above the limit of 1024" in planned["message"]
        # The operator is still there for everyone else.
        apply(cluster, namespace, rljob("after", pool_name))
        wait_for("the next job's pods", running_pods(cluster, namespace, "after", 3), 60)
    assert runner.exit_code == 0, runner.output[-3000:]


def test_deletes_carry_the_uid_they_decided_on(
    cluster: Any, crd: None, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    apply(cluster, namespace, rljob("ttl", "nowhere"))
    old_job = cluster.get_json("rljob", "ttl", namespace=namespace)["metadata"]["uid"]
    cluster.kubectl("delete", "rljob", "ttl", "-n", namespace)
    apply(cluster, namespace, rljob("ttl", "nowhere"))
    new_job = cluster.get_json("rljob", "ttl", namespace=namespace)["metadata"]["uid"]
    pod = idle_pod("p", {})
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))
    old_pod = cluster.get_json("pod", "p", namespace=namespace)["metadata"]["uid"]
    cluster.kubectl("delete", "pod", "p", "-n", namespace, "--grace-period=0", "--force")
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))

    async def deletes() -> tuple[bool, bool]:
        kube = adapter.Kube.from_environment()
        try:
            await kube.delete_rljob(namespace, "ttl", old_job)  # the TTL of the job that was
            stale = await kube.delete_pod(namespace, "p", old_pod)  # a pod decided on, since replaced
            assert cluster.get_json("rljob", "ttl", namespace=namespace)["metadata"]["uid"] == new_job
            assert cluster.get_json("pod", "p", namespace=namespace) is not None
            await kube.delete_rljob(namespace, "ttl", new_job)
            fresh = cluster.get_json("pod", "p", namespace=namespace)["metadata"]["uid"]
            return stale, await kube.delete_pod(namespace, "p", fresh)
        finally:
            kube.close()

    stale, deleted = asyncio.run(deletes())
    assert stale is False and deleted is True
    wait_for("the RLJob deleted", lambda: cluster.get_json("rljob", "ttl", namespace=namespace) is None, 30)


def test_a_status_from_a_stale_rljob_is_refused_then_written_on_the_fresh_one(
    cluster: Any, crd: None, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    apply(cluster, namespace, rljob("stale", "nowhere"))
    stale = cluster.get_json("rljob", "stale", namespace=namespace)
    cluster.kubectl("label", "rljob", "stale", "-n", namespace, "touched=yes")  # a newer version
    new = api.RLJobStatus(phase="Pending", observed_generation=1)
    patch = {"phase": "Pending", "observedGeneration": 1}
    conflicts = metrics.API_ERRORS.labels("patch", "RLJob", "409")

    async def write() -> dict[str, Any] | None:
        kube = adapter.Kube.from_environment()
        try:
            rv = stale["metadata"]["resourceVersion"]
            with pytest.raises(Exception) as refused:  # written blind on the stale version: refused
                await kube.patch_status(namespace, "stale", {"phase": "Failed"}, rv)
            assert adapter.is_conflict(refused.value)
            return await guards.write_status(kube, stale, new, patch)
        finally:
            kube.close()

    before = conflicts._value.get()
    written = asyncio.run(write())
    assert conflicts._value.get() - before == 2  # the blind write above, then the first try
    assert written is not None and written["status"]["phase"] == "Pending"
    assert written["metadata"]["labels"]["touched"] == "yes"  # the fresh one's
    assert job_status(cluster, namespace, "stale")["phase"] == "Pending"


def test_the_watch_selectors_select_only_the_operators_objects_on_the_server(
    cluster: Any, namespace: str
) -> None:
    ours = {"rljob.io/job": "j", "rljob.io/role": "trainer", "app.kubernetes.io/managed-by": "rljob-operator"}
    lookalike = {"rljob.io/job": "j"}  # another tenant's pod borrowing the job label
    for name, labels in (("ours", ours), ("lookalike", lookalike), ("other", {"app": "web"})):
        pod = idle_pod(name, labels)
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))
    for name, labels in (
        ("j-telemetry", {**ours, "rljob.io/role": "telemetry"}),
        ("cm", {"rljob.io/role": "telemetry"}),
    ):
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels}}
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(cm))
    selected = {
        plural: [
            o["metadata"]["name"]
            for o in cluster.get_json(plural, "-l", selector, namespace=namespace)["items"]
        ]
        for (_, plural), selector in handlers.WATCH_SELECTORS.items()
    }
    assert selected == {"pods": ["ours"], "configmaps": ["j-telemetry"]}
    assert pods(cluster, namespace, "j")  # (a plain label query would also see the lookalike)

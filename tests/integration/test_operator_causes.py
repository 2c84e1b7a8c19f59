"""Every RLJob the API accepts either runs or says exactly why not: the causes a user meets.

Against the real control plane (etcd, kube-apiserver, controller-manager, scheduler) with the
test kubelet, each test makes one cause happen the way it happens on a cluster and checks what
`kubectl get/describe rljob` would show: the condition's reason, a message naming the object and
the fix, and the Event. Each of these failed on the operator before issue 11 (a silent kopf retry
loop, "0/5 pods running", a relabelled error, a counted disruption or a pod recreated alone).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import test_operator as base
import yaml
from test_operator import TINY_CONFIG, apply, condition, job_status, operator, pods, rljob, running_pods

from testenv.cluster import restricted
from testenv.waiting import wait_for

pytestmark = pytest.mark.cluster

ONE_NODE = {
    "accelerator": {"kind": "nvidia", "model": "H100-80GB"},
    "totalAccelerators": 8,
    "acceleratorsPerNode": 8,
    "mode": "static",
    "static": {"trainerAccelerators": 8, "rolloutAccelerators": 0},
}
TWO_NODES = {
    **ONE_NODE,
    "totalAccelerators": 16,
    "static": {"trainerAccelerators": 16, "rolloutAccelerators": 0},
}


def until_reason(
    cluster: Any, namespace: str, job: str, type_: str, reason: str, timeout: float = 30
) -> dict[str, Any]:
    last: dict[str, Any] = {}

    def check() -> dict[str, Any] | None:
        nonlocal last
        last = job_status(cluster, namespace, job)
        return last if condition(last, type_).get("reason") == reason else None

    try:
        return wait_for(f"{job}: {type_} reason {reason}", check, timeout)
    except AssertionError as exc:
        pods_now = [
            (p["metadata"]["name"], p.get("status", {}).get("phase")) for p in pods(cluster, namespace, job)
        ]
        raise AssertionError(f"{exc}\nstatus: {json.dumps(last, indent=1)}\npods: {pods_now}") from None


def events_of(cluster: Any, namespace: str, job: str) -> str:
    return cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={job}"
    ).stdout


# ---- 3. no exception escapes a reconcile silently ----------------------------------------------
def test_a_spec_error_fails_the_job_and_a_new_generation_recovers_it(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str], kubeconfig_env: None
) -> None:
    pool_name = pool(1)
    broken = {k: v for k, v in TINY_CONFIG.items() if k != "num_attention_heads"}
    spec = rljob(
        "fixme",
        pool_name,
        model={"name": "tiny", "source": {"tiny": {}}, "config": {"inline": broken}},
        resources=ONE_NODE,
    )
    with operator(namespace) as runner:
        apply(cluster, namespace, spec)
        st = until_reason(cluster, namespace, "fixme", "Planned", "InvalidModelConfig")
        assert st["phase"] == "Failed"
        message = condition(st, "Failed")["message"]
        assert "num_attention_heads" in message and "apply it again" in message
        assert not pods(cluster, namespace, "fixme")
        spec["spec"]["model"]["config"]["inline"] = TINY_CONFIG
        apply(cluster, namespace, spec)  # a new metadata.generation
        wait_for("pod after the fixed spec", running_pods(cluster, namespace, "fixme", 1), 60)
        st = wait_for(
            "Running", lambda: (s := job_status(cluster, namespace, "fixme")).get("phase") == "Running" and s
        )
        assert (
            condition(st, "Failed")["status"] == "False" and condition(st, "Failed")["reason"] == "SpecFixed"
        )
    assert runner.exception is None


def test_an_unexpected_exception_becomes_internal_error_quoting_it(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str], kubeconfig_env: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from rljob_operator import builders

    def broken_build_pods(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("the builder's bug")

    monkeypatch.setattr(builders, "build_pods", broken_build_pods)
    pool_name = pool(1)
    with operator(namespace) as runner:
        apply(cluster, namespace, rljob("oops", pool_name, resources=ONE_NODE))
        st = until_reason(cluster, namespace, "oops", "Ready", "InternalError")
        message = condition(st, "Ready")["message"]
        assert "KeyError" in message and "the builder's bug" in message and "reconcile step pods" in message
        assert st["phase"] == "Pending" and condition(st, "Planned")["status"] == "True"
        assert "ModelDoesNotFit" not in json.dumps(st)
        monkeypatch.undo()  # the bug is fixed (an operator upgrade): the job goes on by itself
        wait_for("pod after the fix", running_pods(cluster, namespace, "oops", 1), 60)
    assert runner.exception is None


# ---- 4. pod-level causes in status and Events ----------------------------------------------------
def test_the_schedulers_message_reaches_the_rljob(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str], kubeconfig_env: None
) -> None:
    pool_name = pool(1)
    # Another workload holds the pool's only node: the job can fit the pool, just not now.
    blocker = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "blocker"},
        "spec": restricted(
            {
                "nodeSelector": {"pool": pool_name},
                "containers": [{"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "8"}}}],
            }
        ),
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(blocker))
    wait_for("blocker running", lambda: (cluster.get_json("pod", "blocker", namespace=namespace) or {})
             .get("status", {}).get("phase") == "Running")  # fmt: skip
    with operator(namespace):
        apply(cluster, namespace, rljob("wait", pool_name, resources=ONE_NODE))
        st = until_reason(cluster, namespace, "wait", "Ready", "Unschedulable")
        message = condition(st, "Ready")["message"]
        assert "wait-trainer-0" in message and "Insufficient nvidia.com/gpu" in message
        assert st["phase"] == "Pending"
        assert "Unschedulable" in events_of(cluster, namespace, "wait")
        cluster.kubectl("delete", "pod", "blocker", "-n", namespace, "--wait=false")
        wait_for("scheduled once the node is free", running_pods(cluster, namespace, "wait", 1), 60)


def test_missing_secret_and_unpullable_image_are_named(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str], kubeconfig_env: None
) -> None:
    pool_name = pool(2)
    hub_model = {
        "name": "tiny",
        "source": {"hub": {"id": "Qwen/Qwen3-0.6B", "tokenSecretRef": {"name": "hf", "key": "token"}}},
        "config": {"inline": TINY_CONFIG},
    }
    with operator(namespace):
        apply(cluster, namespace, rljob("sec", pool_name, model=hub_model, resources=ONE_NODE))
        st = until_reason(cluster, namespace, "sec", "Ready", "CreateContainerConfigError")
        message = condition(st, "Ready")["message"]
        assert "sec-trainer-0" in message and 'secret "hf" not found' in message
        cluster.kubectl("create", "secret", "generic", "hf", "-n", namespace, "--from-literal=other=x")
        wanted = "couldn't find key token in Secret"
        wait_for("the missing key named", lambda: wanted in condition(
            job_status(cluster, namespace, "sec"), "Ready").get("message", ""))  # fmt: skip
        cluster.kubectl("delete", "secret", "hf", "-n", namespace)
        cluster.kubectl("create", "secret", "generic", "hf", "-n", namespace, "--from-literal=token=t")
        wait_for("running once the Secret is right", running_pods(cluster, namespace, "sec", 1), 60)

        image = {"trainer": "registry.invalid/rljob/trainer:missing"}
        apply(cluster, namespace, rljob("img", pool_name, image=image, resources=ONE_NODE))
        until_reason(cluster, namespace, "img", "Ready", "ErrImagePull")
        st = until_reason(cluster, namespace, "img", "Ready", "ImagePullBackOff")
        assert "registry.invalid/rljob/trainer:missing" in condition(st, "Ready")["message"]
        assert "ImagePullBackOff" in events_of(cluster, namespace, "img")


def test_termination_messages_are_quoted_and_the_same_cause_twice_ends_the_job(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str], kubeconfig_env: None
) -> None:
    pool_name = pool(1)
    spec = rljob("det", pool_name, resources=ONE_NODE)  # backoffLimit 3
    cause = "file not found: FileNotFoundError: /data/train.jsonl (dataset not found)"
    with operator(namespace):
        apply(cluster, namespace, spec)
        wait_for("running", running_pods(cluster, namespace, "det", 1))
        pod = cluster.get_json("pod", "det-trainer-0", namespace=namespace)
        assert pod["spec"]["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"
        cluster.kubelet.fail_pod(namespace, "det-trainer-0", 1, message=cause)
        st = until_reason(cluster, namespace, "det", "Restarting", "PodFailed")
        message = condition(st, "Restarting")["message"]
        assert cause in message and "checkpoints are not kept" in message
        wait_for("restarted", lambda: (p := cluster.get_json("pod", "det-trainer-0", namespace=namespace))
                 and p["metadata"]["annotations"]["rljob.io/attempt"] == "1"
                 and p.get("status", {}).get("phase") == "Running")  # fmt: skip
        cluster.kubelet.fail_pod(namespace, "det-trainer-0", 1, message=cause)
        st = until_reason(cluster, namespace, "det", "Failed", "RepeatedFailure")
        assert st["phase"] == "Failed" and st["failures"] == 2 and st["restarts"] == 1
        assert cause in condition(st, "Failed")["message"]
        assert "RepeatedFailure" in events_of(cluster, namespace, "det")


# ---- 5. disruptions are not failures -----------------------------------------------------------
def _evict(cluster: Any, namespace: str, pod: str) -> None:
    from kubernetes import client

    core = client.CoreV1Api(cluster.api_client())
    body = client.V1Eviction(metadata=client.V1ObjectMeta(name=pod, namespace=namespace))
    core.create_namespaced_pod_eviction(pod, namespace, body)


def _attempt_running(cluster: Any, namespace: str, job: str, count: int, attempt: str) -> Callable[[], Any]:
    check = running_pods(cluster, namespace, job, count)

    def ok() -> Any:
        items = check()
        return (
            items
            if items and all(p["metadata"]["annotations"]["rljob.io/attempt"] == attempt for p in items)
            else None
        )

    return ok


def test_an_evicted_pod_restarts_the_gang_without_counting_a_failure(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str], kubeconfig_env: None
) -> None:
    pool_name = pool(2)
    spec = rljob(
        "evict", pool_name, resources=TWO_NODES, restartPolicy={"policy": "OnFailure", "backoffLimit": 0}
    )
    with operator(namespace):
        apply(cluster, namespace, spec)
        first = wait_for("2 running", running_pods(cluster, namespace, "evict", 2))
        _evict(cluster, namespace, "evict-trainer-1")
        # The Restarting=Disrupted condition lasts only until the new gang runs (a second or two):
        # its Event is what stays, with the condition's message.
        said = wait_for(
            "the Disrupted Event",
            lambda: next(
                (
                    line
                    for line in events_of(cluster, namespace, "evict").splitlines()
                    if " Disrupted " in line
                ),
                None,
            ),
            30,
        )
        assert "evict-trainer-1" in said and "EvictionByEvictionAPI" in said, said
        second = wait_for("a new gang", _attempt_running(cluster, namespace, "evict", 2, "1"), 60)
        assert not {p["metadata"]["uid"] for p in first} & {p["metadata"]["uid"] for p in second}
        st = wait_for(
            "Running", lambda: (s := job_status(cluster, namespace, "evict")).get("phase") == "Running" and s
        )
        # backoffLimit 0: a counted failure would have failed the job
        assert st["restarts"] == 1 and st["disruptions"] == 1 and not st.get("failures")


def test_a_deleted_node_restarts_the_gang_and_never_the_lost_pod_alone(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str], kubeconfig_env: None
) -> None:
    pool_name = pool(3)
    spec = rljob(
        "lost", pool_name, resources=TWO_NODES, restartPolicy={"policy": "OnFailure", "backoffLimit": 0}
    )
    with operator(namespace):
        apply(cluster, namespace, spec)
        first = wait_for("2 running", running_pods(cluster, namespace, "lost", 2))
        node = next(p["spec"]["nodeName"] for p in first if p["metadata"]["name"] == "lost-trainer-1")
        cluster.delete_nodes([node])
        st = until_reason(cluster, namespace, "lost", "Restarting", "Disrupted")
        assert node in condition(st, "Restarting")["message"]
        second = wait_for(
            "a new gang on the nodes left", _attempt_running(cluster, namespace, "lost", 2, "1"), 90
        )
        assert node not in {p["spec"]["nodeName"] for p in second}
        trainer0 = {p["metadata"]["name"]: p["metadata"]["uid"] for p in first}["lost-trainer-0"]
        assert trainer0 not in {p["metadata"]["uid"] for p in second}  # trainer 0 restarted too
        st = job_status(cluster, namespace, "lost")
        assert st["disruptions"] == 1 and not st.get("failures") and st["phase"] in ("Pending", "Running")


# ---- 6. volumes tell the truth -----------------------------------------------------------------
def _pvc(name: str, mode: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name},
        "spec": {"accessModes": [mode], "resources": {"requests": {"storage": "1Gi"}}},
    }


def test_missing_and_unshareable_claims_are_reported_before_pods(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str], kubeconfig_env: None
) -> None:
    pool_name = pool(2)
    checkpoint = {"path": "/ckpt", "volume": {"claimName": "ckpt"}}
    with operator(namespace):
        apply(cluster, namespace, rljob("vol", pool_name, resources=TWO_NODES, checkpoint=checkpoint))
        st = until_reason(cluster, namespace, "vol", "Ready", "ClaimNotFound")
        assert (
            "'ckpt'" in condition(st, "Ready")["message"]
            and "not found" in condition(st, "Ready")["message"]
            and st["phase"] == "Pending"
        )
        assert not pods(cluster, namespace, "vol")
        cluster.kubectl(
            "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(_pvc("ckpt", "ReadWriteOnce"))
        )
        st = until_reason(cluster, namespace, "vol", "Ready", "ClaimAccessMode", 45)
        message = condition(st, "Ready")["message"]
        assert "ReadWriteOnce" in message and "ReadWriteMany" in message and "2 pods" in message
        assert not pods(cluster, namespace, "vol")
        cluster.kubectl("delete", "pvc", "ckpt", "-n", namespace, "--wait=false")
        wait_for("claim gone", lambda: cluster.get_json("pvc", "ckpt", namespace=namespace) is None)
        cluster.kubectl(
            "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(_pvc("ckpt", "ReadWriteMany"))
        )
        wait_for("pods once the claim is shareable", lambda: len(pods(cluster, namespace, "vol")) == 2, 60)
        # The claim is unbound (no provisioner here): the scheduler refuses the pods, and the RLJob
        # names the claim and the fix rather than quoting "unbound immediate PersistentVolumeClaims".
        st = until_reason(cluster, namespace, "vol", "Ready", "ClaimNotBound", 45)
        claim = "PersistentVolumeClaim 'ckpt' (spec.checkpoint.volume.claimName)"
        assert claim in condition(st, "Ready")["message"]


# ---- every shipped example ----------------------------------------------------------------------
def test_every_example_shows_a_phase_and_its_cause_within_30s(
    cluster: Any, crd: None, namespace: str, kubeconfig_env: None
) -> None:
    """The local demo's fleet (2 x 8 H100 and 1 x 8 Ascend 910B, tainted; a CPU node): each example
    gets a phase and a condition naming its real cause, never a bare "0/N pods running"."""
    from testenv.__main__ import DEFAULT_POOLS

    added: list[str] = []
    for spec in DEFAULT_POOLS:
        pool_spec = {k: v for k, v in spec.items() if k not in ("count", "name_prefix", "exec_local")}
        prefix = f"{spec['name_prefix']}-{namespace[-6:]}"
        added += cluster.add_nodes(spec["count"], name_prefix=prefix, **pool_spec)
    seen: dict[str, dict[str, Any]] = {}
    try:
        with operator(namespace) as runner:
            for path in sorted(base.REPO.glob("examples/*.yaml")):
                # As each example's header says: its claims (examples/claims/) with it, one command.
                claims = base.REPO / "examples" / "claims" / path.name
                with_claims = ["-f", str(claims)] if claims.exists() else []
                cluster.kubectl("apply", "-n", namespace, *with_claims, "-f", str(path))
            names_ = [d["metadata"]["name"] for p in sorted(base.REPO.glob("examples/*.yaml"))
                      for d in yaml.safe_load_all(p.read_text()) if d]  # fmt: skip

            untold: dict[str, Any] = {}

            def explained() -> bool:
                untold.clear()
                for name in names_:
                    st = job_status(cluster, namespace, name)
                    ready, planned = condition(st, "Ready"), condition(st, "Planned")
                    told = ready.get("status") == "True" or any(
                        c.get("status") == "False" and c.get("reason") not in (None, "PodsPending")
                        for c in (ready, planned)
                    )
                    if not (st.get("phase") and told):
                        untold[name] = {"phase": st.get("phase"), "Ready": ready, "Planned": planned}
                    else:
                        seen[name] = st
                return not untold

            try:
                wait_for("every example explained", explained, 30)
            except AssertionError as error:
                stuck = {
                    p["metadata"]["name"]: p.get("status")
                    for name in untold
                    for p in pods(cluster, namespace, name)
                    if p.get("status", {}).get("phase") != "Running"
                }
                raise AssertionError(f"{error}\nnot explained: {untold}\ntheir pods: {stuck}") from None
            # The scheduler refuses pods whose claims are unbound; the next reconcile names them.
            for job in ("qwen3-8b-ascend", "qwen35-4b-gsm8k"):
                seen[job] = until_reason(cluster, namespace, job, "Ready", "ClaimNotBound", 30)
        assert runner.exception is None
    finally:
        cluster.delete_nodes(added)
    tiny = seen["tiny-cpu"]
    assert tiny["phase"] == "Running" and condition(tiny, "Ready")["reason"] == "AllPodsRunning"
    # The flagship and Ascend examples' claims exist now, but nothing here provisions volumes: the
    # RLJob names the unbound claim, its storage class and the fix (not the scheduler's bare
    # "unbound immediate PersistentVolumeClaims").
    for job, claim, storage_class in (
        ("qwen3-8b-ascend", "models", "shared-rwx"),
        ("qwen35-4b-gsm8k", "qwen35-4b-checkpoints", "standard"),
    ):
        ready = condition(seen[job], "Ready")
        assert ready["reason"] == "ClaimNotBound", ready
        assert f"PersistentVolumeClaim {claim!r}" in ready["message"]
        assert f"storage class {storage_class!r}" in ready["message"]


# ---- vLLM's CPU build refuses some head sizes: at apply, or a named condition within seconds -------
CPU_TWO_RANKS = {
    "accelerator": {"kind": "cpu"},
    "totalAccelerators": 2,
    "acceleratorsPerNode": 1,
    "mode": "static",
    "static": {"trainerAccelerators": 2, "rolloutAccelerators": 0},
    "memory": "4Gi",
}


def test_a_cpu_vllm_job_with_a_head_size_vllm_cannot_run_is_refused_by_name_and_never_gets_pods(
    cluster: Any, crd: None, namespace: str, kubeconfig_env: None
) -> None:
    sizes = "32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512"
    head_16 = {**TINY_CONFIG, "num_attention_heads": 4, "num_key_value_heads": 2}  # 64 / 4: head_dim 16
    # 1. An explicit inline head_dim: the apiserver's CEL rule refuses it at kubectl apply.
    explicit = rljob(
        "hd-explicit",
        "cpu",
        model={"name": "tiny", "source": {"tiny": {}}, "config": {"inline": {**head_16, "head_dim": 16}}},
        resources=CPU_TWO_RANKS,
    )
    refused = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(explicit), check=False
    )
    assert refused.returncode != 0
    assert "spec.model.config.inline.head_dim" in refused.stderr and sizes in refused.stderr
    assert "set spec.resources.rollout.kind to transformers" in refused.stderr
    # 2. A head_dim the apiserver cannot see (derived from hidden_size / num_attention_heads): the
    #    planner refuses it with a named condition within seconds, and no pod is created.
    derived = rljob(
        "hd-derived",
        "cpu",
        model={"name": "tiny", "source": {"tiny": {}}, "config": {"inline": head_16}},
        resources=CPU_TWO_RANKS,
    )
    with operator(namespace) as runner:
        apply(cluster, namespace, derived)
        st = until_reason(cluster, namespace, "hd-derived", "Planned", "UnsupportedHeadSize", timeout=15)
        assert st["phase"] == "Failed"
        message = condition(st, "Planned")["message"]
        assert message.startswith("spec.model: head_dim 16 (hidden_size 64 / num_attention_heads 4 of ")
        assert sizes in message and "set spec.resources.rollout.kind to transformers" in message
        assert "UnsupportedHeadSize" in events_of(cluster, namespace, "hd-derived")
        time.sleep(2)  # later reconciles change nothing: still refused, still no pods
        assert not pods(cluster, namespace, "hd-derived")
        # 3. The fix the message names (the transformers engine) is a new generation: it plans.
        derived["spec"]["resources"]["rollout"] = {"kind": "transformers"}
        apply(cluster, namespace, derived)
        wait_for(
            "planned with the transformers engine",
            lambda: (
                condition(job_status(cluster, namespace, "hd-derived"), "Planned").get("status") == "True"
            ),
            30,
        )
        assert job_status(cluster, namespace, "hd-derived")["plan"]["cpuKvCacheBytes"] > 0
    assert runner.exception is None

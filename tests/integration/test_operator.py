"""The operator against the real control plane (etcd, kube-apiserver, controller-manager, scheduler).

Each test runs the kopf operator in-process (`kopf.testing.KopfRunner`) or as a subprocess (the
crash test), applies RLJobs with `kubectl`, and checks what a user would check: pods with the
right requests bound by the real scheduler to fake GPU nodes, owner references the garbage
collector follows, status and conditions, restarts with backoff, suspend/resume, semantic errors,
and adaptive decisions turned into rollout pods. Every test uses its own namespace and its own node
pool label, so tests never see each other's nodes or jobs.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

# Short intervals for tests; read once when rljob_operator.handlers is imported.
os.environ.setdefault("RLJOB_RECONCILE_INTERVAL_S", "1")
os.environ.setdefault("RLJOB_METRICS_PORT", "0")
os.environ.setdefault("RLJOB_EVENT_INTERVAL_S", "1")

from kopf.testing import KopfRunner

from testenv.waiting import wait_for

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "rljobs.rljob.io.yaml"
HANDLERS_MODULE = "rljob_operator.handlers"
TINY_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
}


# ---- helpers (fixtures: tests/integration/conftest.py) -------------------------------------------
@contextmanager
def operator(namespace: str) -> Iterator[KopfRunner]:
    args = ["run", "--standalone", "--namespace", namespace, "-m", HANDLERS_MODULE]
    # The stop waits for the handlers in flight; on two cores shared with the other test worker one
    # took over 60 s once (test_kueue_admission, 2026-12-07 CI), with the test's checks all passed.
    with KopfRunner(args, timeout=120) as runner:
        yield runner


def rljob(name: str, pool_name: str, **spec_overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "tiny", "source": {"tiny": {}}, "config": {"inline": TINY_CONFIG}},
        "data": {"source": {"builtin": {"name": "toy-arithmetic"}}},
        "resources": {
            "accelerator": {"kind": "nvidia", "model": "H100-80GB"},
            "totalAccelerators": 24,
            "acceleratorsPerNode": 8,
            "mode": "static",
            "static": {"trainerAccelerators": 16, "rolloutAccelerators": 8},
            "rollout": {"tensorParallel": 8},
        },
        "trainerPool": {"nodeSelector": {"pool": pool_name}},
        "rolloutPool": {"nodeSelector": {"pool": pool_name}},
        "restartPolicy": {
            "policy": "OnFailure",
            "backoffLimit": 3,
            "initialBackoffSeconds": 2,
            "maxBackoffSeconds": 8,
        },
    }
    spec.update(spec_overrides)
    return {"apiVersion": "rljob.io/v1alpha1", "kind": "RLJob", "metadata": {"name": name}, "spec": spec}


def apply(cluster: Any, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj))


def pods(cluster: Any, namespace: str, job: str) -> list[dict[str, Any]]:
    data = cluster.get_json("pods", "-l", f"rljob.io/job={job}", namespace=namespace)
    return sorted(data["items"], key=lambda p: p["metadata"]["name"]) if data else []


def job_status(cluster: Any, namespace: str, job: str) -> dict[str, Any]:
    data = cluster.get_json("rljob", job, namespace=namespace)
    return (data or {}).get("status") or {}


def condition(st: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions", []) if c["type"] == type_), {})


def running_pods(cluster: Any, namespace: str, job: str, count: int) -> Callable[[], list[dict[str, Any]]]:
    def check() -> list[dict[str, Any]]:
        items = [p for p in pods(cluster, namespace, job) if not p["metadata"].get("deletionTimestamp")]
        ok = len(items) == count and all(p.get("status", {}).get("phase") == "Running" for p in items)
        return items if ok else []

    return check


# ---- tests ---------------------------------------------------------------------------------------
def test_rljob_becomes_placed_pods_with_owner_refs_and_status(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str], operator_identity: str
) -> None:
    """Also proves the operator's ClusterRole suffices: the operator runs as its ServiceAccount."""
    pool_name = pool(3)
    with operator(namespace):
        apply(cluster, namespace, rljob("demo", pool_name))
        items = wait_for("3 running pods", running_pods(cluster, namespace, "demo", 3))
        job = cluster.get_json("rljob", "demo", namespace=namespace)
        assert [p["metadata"]["name"] for p in items] == [
            "demo-rollout-0",
            "demo-trainer-0",
            "demo-trainer-1",
        ]
        nodes = {p["spec"]["nodeName"] for p in items}
        assert len(nodes) == 3 and all(n.startswith(pool_name) for n in nodes)  # bound by the real scheduler
        for p in items:
            res = p["spec"]["containers"][0]["resources"]
            assert res["requests"]["nvidia.com/gpu"] == "8" == res["limits"]["nvidia.com/gpu"]
            (ref,) = p["metadata"]["ownerReferences"]
            assert ref["uid"] == job["metadata"]["uid"] and ref["controller"] is True
            assert p["metadata"]["labels"]["rljob.io/job"] == "demo"
        for kind, name in [
            ("service", "demo"),
            ("configmap", "demo-config"),
            ("configmap", "demo-telemetry"),
            ("serviceaccount", "demo"),
            ("role", "demo"),
            ("rolebinding", "demo"),
        ]:
            obj = cluster.get_json(kind, name, namespace=namespace)
            assert obj is not None, (kind, name)
            assert obj["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
        config = json.loads(
            cluster.get_json("configmap", "demo-config", namespace=namespace)["data"]["trainer.json"]
        )
        assert config["distributed"]["numTrainerRanks"] == 16
        st = wait_for(
            "phase Running",
            lambda: (s := job_status(cluster, namespace, "demo")).get("phase") == "Running" and s,
        )
        assert condition(st, "Ready")["status"] == "True"
        assert condition(st, "Planned")["status"] == "True"
        # This control plane serves no PodGroups (GenericWorkload is off): the status says so.
        gang = condition(st, "GangScheduling")
        assert (gang["status"], gang["reason"]) == ("False", "PodGroupAPIUnavailable")
        assert "scheduling.k8s.io/v1beta1" in gang["message"]
        assert st["observedGeneration"] == job["metadata"]["generation"]
        assert st["plan"]["trainerAccelerators"] == 16 and st["rollout"]["enginesAwakeTotal"] == "1/1"
        printed = cluster.kubectl("get", "rljobs", "-n", namespace).stdout
        assert "Running" in printed and "demo" in printed
        # Least privilege of the job's own ServiceAccount (docs/contracts.md §3).
        sa = f"system:serviceaccount:{namespace}:demo"

        def can(*args: str) -> str:
            return cluster.kubectl(
                "auth", "can-i", *args, "-n", namespace, "--as", sa, check=False
            ).stdout.strip()

        assert can("patch", "configmap/demo-telemetry") == "yes"
        assert can("patch", "configmap/demo-config") == "no"
        assert can("get", "rljobs.rljob.io/demo") == "yes"
        assert can("list", "pods") == "no"


def test_operator_killed_mid_reconcile_converges_without_duplicates(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str]
) -> None:
    pool_name = pool(6)
    spec = rljob(
        "crash",
        pool_name,
        resources={
            "accelerator": {"kind": "nvidia", "model": "H100-80GB"},
            "totalAccelerators": 48,
            "acceleratorsPerNode": 8,
            "mode": "static",
            "static": {"trainerAccelerators": 32, "rolloutAccelerators": 16},
            "rollout": {"tensorParallel": 8},
        },
    )
    seen: dict[str, set[str]] = {}
    stop = threading.Event()

    def watch() -> None:  # every pod uid ever observed, by name
        while not stop.is_set():
            for p in pods(cluster, namespace, "crash"):
                seen.setdefault(p["metadata"]["name"], set()).add(p["metadata"]["uid"])
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    env = dict(
        os.environ, KUBECONFIG=str(cluster.kubeconfig), RLJOB_RECONCILE_INTERVAL_S="1", RLJOB_METRICS_PORT="0"
    )
    argv = [
        sys.executable,
        "-m",
        "kopf",
        "run",
        "--standalone",
        "--namespace",
        namespace,
        "-m",
        HANDLERS_MODULE,
    ]
    rng = random.Random(7)
    apply(cluster, namespace, spec)
    kills = 0
    try:
        for _ in range(5):
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(rng.uniform(1.5, 5.0))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            kills += 1
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            items = wait_for(
                "6 running pods after the crashes", running_pods(cluster, namespace, "crash", 6), 90
            )
            wait_for(
                "phase Running", lambda: job_status(cluster, namespace, "crash").get("phase") == "Running"
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    finally:
        stop.set()
        watcher.join(timeout=5)
    assert kills == 5
    names_ = [p["metadata"]["name"] for p in items]
    assert names_ == sorted(["crash-trainer-0", "crash-trainer-1", "crash-trainer-2", "crash-trainer-3",
                             "crash-rollout-0", "crash-rollout-1"])  # fmt: skip
    # Each name was only ever held by one pod: nothing was created twice or needlessly replaced.
    assert {n: len(u) for n, u in seen.items()} == dict.fromkeys(names_, 1)


def test_suspend_resume_and_delete_through_the_garbage_collector(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str], kubeconfig_env: None
) -> None:
    pool_name = pool(3)
    with operator(namespace):
        apply(cluster, namespace, rljob("sus", pool_name))
        wait_for("3 running pods", running_pods(cluster, namespace, "sus", 3))
        cluster.kubectl(
            "patch", "rljob", "sus", "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}'
        )
        wait_for("pods gone", lambda: not pods(cluster, namespace, "sus"))
        st = wait_for(
            "Suspended",
            lambda: (s := job_status(cluster, namespace, "sus")).get("phase") == "Suspended" and s,
        )
        assert condition(st, "Suspended")["status"] == "True"
        assert cluster.get_json("configmap", "sus-config", namespace=namespace) is not None  # the job is kept
        cluster.kubectl(
            "patch", "rljob", "sus", "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":false}}'
        )
        wait_for("pods back", running_pods(cluster, namespace, "sus", 3))
        wait_for("Running", lambda: job_status(cluster, namespace, "sus").get("phase") == "Running")
        cluster.kubectl("delete", "rljob", "sus", "-n", namespace, "--wait=false")
        wait_for("RLJob gone", lambda: cluster.get_json("rljob", "sus", namespace=namespace) is None, 60)
    # The operator is stopped: only the garbage collector (owner references) can remove these now.
    wait_for("pods collected", lambda: not pods(cluster, namespace, "sus"), 90)
    wait_for(
        "config collected",
        lambda: cluster.get_json("configmap", "sus-config", namespace=namespace) is None,
        90,
    )


def test_pod_failure_restarts_with_backoff_then_fails_at_the_limit(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str], kubeconfig_env: None
) -> None:
    pool_name = pool(3)
    spec = rljob(
        "rst",
        pool_name,
        restartPolicy={
            "policy": "OnFailure",
            "backoffLimit": 1,
            "initialBackoffSeconds": 3,
            "maxBackoffSeconds": 8,
        },
    )
    with operator(namespace):
        apply(cluster, namespace, spec)
        first = wait_for("3 running pods", running_pods(cluster, namespace, "rst", 3))
        first_uids = {p["metadata"]["uid"] for p in first}
        failed_at = time.monotonic()
        cluster.fail_pod(namespace, "rst-trainer-1", exit_code=137)
        st = wait_for(
            "restart counted", lambda: (s := job_status(cluster, namespace, "rst")).get("restarts") == 1 and s
        )
        assert condition(st, "Restarting")["status"] == "True"
        assert "rst-trainer-1" in condition(st, "Restarting")["message"]
        second = wait_for("3 new running pods", running_pods(cluster, namespace, "rst", 3), 60)
        waited = time.monotonic() - failed_at
        assert not first_uids & {p["metadata"]["uid"] for p in second}  # the whole gang restarted
        assert all(p["metadata"]["annotations"]["rljob.io/attempt"] == "1" for p in second)
        assert waited >= 3.0, f"recreated after {waited:.1f}s, before the 3s backoff"
        wait_for("Running again", lambda: job_status(cluster, namespace, "rst").get("phase") == "Running")
        cluster.fail_pod(namespace, "rst-trainer-0", exit_code=1)
        st = wait_for(
            "Failed at the limit",
            lambda: (s := job_status(cluster, namespace, "rst")).get("phase") == "Failed" and s,
        )
        assert condition(st, "Failed")["reason"] == "BackoffLimitExceeded"
        assert "backoffLimit" in condition(st, "Failed")["message"]
        wait_for("running pods stopped", lambda: all(
            p.get("status", {}).get("phase") != "Running" or p["metadata"].get("deletionTimestamp")
            for p in pods(cluster, namespace, "rst")
        ))  # fmt: skip
        events = cluster.kubectl(
            "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=rst"
        ).stdout
        assert "BackoffLimitExceeded" in events


def _api_requests() -> float:
    from rljob_operator.kube import metrics

    return sum(
        sample.value
        for family in metrics.API_REQUESTS.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    )


def _reconciles() -> float:
    from rljob_operator.kube import metrics

    return sum(
        sample.value
        for family in metrics.RECONCILE_SECONDS.collect()
        for sample in family.samples
        if sample.name.endswith("_count")
    )


def test_reconciles_follow_events_not_the_timer_and_an_idle_one_calls_no_api(
    cluster: Any,
    crd: None,
    namespace: str,
    pool: Callable[..., str],
    kubeconfig_env: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the safety-net resync an hour away, pods running and a pod's failure still reach the
    status within seconds (watch events reconcile the job); and a reconcile with nothing to do
    (an RLJob label changed) makes no API call at all: no re-read, no status write, no Event."""
    from rljob_operator import handlers

    monkeypatch.setattr(handlers, "RECONCILE_INTERVAL_S", 3600.0)
    pool_name = pool(3)
    with operator(namespace):
        apply(cluster, namespace, rljob("quiet", pool_name))
        wait_for("3 running pods", running_pods(cluster, namespace, "quiet", 3))
        wait_for(
            "phase Running", lambda: job_status(cluster, namespace, "quiet").get("phase") == "Running", 30
        )
        time.sleep(2)  # the last status write's echo
        calls, reconciles = _api_requests(), _reconciles()
        cluster.kubectl("label", "rljob", "quiet", "-n", namespace, "touched=yes")
        wait_for("a reconcile of the relabelled job", lambda: _reconciles() > reconciles, 30)
        time.sleep(3)
        assert _api_requests() == calls, "an idle reconcile called the API"
        cluster.fail_pod(namespace, "quiet-trainer-1", exit_code=1)
        wait_for(
            "the failure in the status",
            lambda: (job_status(cluster, namespace, "quiet").get("failures") or 0) >= 1,
            30,
        )


def test_success_then_ttl_deletes_the_job(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str], kubeconfig_env: None
) -> None:
    pool_name = pool(3)
    with operator(namespace):
        apply(cluster, namespace, rljob("ttl", pool_name, ttlSecondsAfterFinished=2))
        wait_for("3 running pods", running_pods(cluster, namespace, "ttl", 3))
        cluster.succeed_pod(namespace, "ttl-trainer-0")
        st = wait_for(
            "Succeeded",
            lambda: (s := job_status(cluster, namespace, "ttl")).get("phase") == "Succeeded" and s,
        )
        assert condition(st, "Complete")["status"] == "True" and st.get("completionTime")
        wait_for(
            "deleted after its TTL", lambda: cluster.get_json("rljob", "ttl", namespace=namespace) is None, 30
        )


def test_a_job_recreated_under_the_same_name_never_takes_the_earlier_jobs_children(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str], kubeconfig_env: None
) -> None:
    """`kubectl delete rljob X; kubectl apply -f X.yaml` before the garbage collector is done (here:
    deleted with --cascade=orphan, so nothing collects the first job's children at all): the new job
    must not read the earlier one's Completed pods (it would be Succeeded at once) or keep its
    ConfigMaps and Service (the collector would delete them under the new job). It deletes the pods,
    names the other orphans with the command that deletes them, and then runs on children of its
    own."""
    pool_name = pool(3)
    with operator(namespace):
        apply(cluster, namespace, rljob("again", pool_name))
        wait_for("3 running pods", running_pods(cluster, namespace, "again", 3))
        cluster.succeed_pod(namespace, "again-trainer-0")
        wait_for("Succeeded", lambda: job_status(cluster, namespace, "again").get("phase") == "Succeeded")
        first = cluster.get_json("rljob", "again", namespace=namespace)["metadata"]["uid"]
        old_pods = {p["metadata"]["uid"] for p in pods(cluster, namespace, "again")}
        cluster.kubectl("delete", "rljob", "again", "-n", namespace, "--cascade=orphan")
        wait_for("RLJob gone", lambda: cluster.get_json("rljob", "again", namespace=namespace) is None, 60)
        assert pods(cluster, namespace, "again"), "the orphaned pods should still be there"

        apply(cluster, namespace, rljob("again", pool_name))
        second = wait_for(
            "the new RLJob",
            lambda: (cluster.get_json("rljob", "again", namespace=namespace) or {}).get("metadata"),
        )["uid"]
        assert second != first

        # Orphans have no owner, so no garbage collector ever deletes them: the job says so, naming
        # them and the command, and the user runs it (the operator deletes only the pods itself).
        def orphans_named() -> str:
            message = condition(job_status(cluster, namespace, "again"), "Ready").get("message", "")
            return message if "have no owner" in message else ""

        message = wait_for("the job naming the orphaned children", orphans_named, 60)
        command = message.split("(kubectl delete -n ")[1].split(")")[0].split()
        assert command[0] == namespace and "configmap/again-config" in command and "service/again" in command
        cluster.kubectl("delete", "-n", *command)
        fresh = wait_for("3 running pods of the new job", running_pods(cluster, namespace, "again", 3), 60)
        assert not {p["metadata"]["uid"] for p in fresh} & old_pods, "the new job kept an earlier job's pod"
        for p in fresh:
            assert [r["uid"] for r in p["metadata"]["ownerReferences"]] == [second]
        st = wait_for(
            "Running", lambda: (s := job_status(cluster, namespace, "again")).get("phase") == "Running" and s
        )
        assert st.get("failures", 0) == 0 and st.get("restarts", 0) == 0 and not st.get("completionTime")
        for kind, name in (
            ("configmap", "again-config"),
            ("configmap", "again-telemetry"),
            ("service", "again"),
            ("serviceaccount", "again"),
        ):
            obj = wait_for(
                f"{kind} {name} of the new job",
                lambda kind=kind, name=name: (
                    (o := cluster.get_json(kind, name, namespace=namespace))
                    and [r["uid"] for r in o["metadata"].get("ownerReferences") or []] == [second]
                    and o
                ),
                30,
            )
            assert obj
        events = cluster.get_json(
            "events", f"--field-selector=involvedObject.uid={second}", namespace=namespace
        )
        by_reason = {e["reason"]: e["message"] for e in events["items"]}
        assert "left by an earlier RLJob of this name" in by_reason.get("PodsDeleted", ""), by_reason
        assert "earlier RLJob named again" in by_reason.get("EarlierJobLeftovers", ""), by_reason
        # The earlier job's pods going away are not this job's pods lost: no restart.
        assert "Disrupted" not in by_reason and "InternalError" not in by_reason, by_reason


def test_semantic_errors_become_conditions_not_crash_loops(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str], kubeconfig_env: None
) -> None:
    pool_name = pool(1)
    with operator(namespace) as runner:
        # 1. The model config lives in a ConfigMap that does not exist yet.
        missing = rljob(
            "cfg",
            pool_name,
            model={
                "name": "tiny",
                "source": {"tiny": {}},
                "config": {"configMapRef": {"name": "tiny-config"}},
            },
            resources={
                "accelerator": {"kind": "nvidia", "model": "H100-80GB"},
                "totalAccelerators": 8,
                "acceleratorsPerNode": 8,
                "mode": "static",
                "static": {"trainerAccelerators": 8, "rolloutAccelerators": 0},
            },
        )
        apply(cluster, namespace, missing)
        st = wait_for("ModelConfigUnreadable", lambda: (s := job_status(cluster, namespace, "cfg")) and
                      condition(s, "Planned").get("reason") == "ModelConfigUnreadable" and s)  # fmt: skip
        assert st["phase"] == "Pending"
        message = condition(st, "Planned")["message"]
        assert "spec.model.config.configMapRef" in message and "kubectl create configmap" in message
        assert not pods(cluster, namespace, "cfg")
        # Fixing it (creating the ConfigMap) is picked up without touching the job.
        cluster.kubectl(
            "create",
            "configmap",
            "tiny-config",
            "-n",
            namespace,
            f"--from-literal=config.json={json.dumps(TINY_CONFIG)}",
        )
        wait_for("pod after the fix", running_pods(cluster, namespace, "cfg", 1), 60)

        # 2. The pool cannot hold the plan: 3 nodes of 8 needed, 1 in the pool.
        apply(cluster, namespace, rljob("big", pool_name))
        st = wait_for("InsufficientAccelerators", lambda: (s := job_status(cluster, namespace, "big")) and
                      condition(s, "Ready").get("reason") == "InsufficientAccelerators" and s)  # fmt: skip
        assert st["phase"] == "Pending"
        assert (
            "spec.trainerPool" in condition(st, "Ready")["message"]
            or "spec.rolloutPool" in condition(st, "Ready")["message"]
        )
        assert not pods(cluster, namespace, "big")
        events = cluster.kubectl(
            "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=big"
        ).stdout
        assert "InsufficientAccelerators" in events
        time.sleep(3)  # several timer ticks: still a condition, no crash, no pods
        assert not pods(cluster, namespace, "big")
    assert runner.exception is None


def _report(
    step: int, t: float, *, pressured: bool, shared_awake: int, dedicated: int, **extra: Any
) -> dict[str, Any]:
    wait, busy_s = (6.0, 80.0) if pressured else (0.0, 0.5)
    return {
        **extra,
        "step": step,
        "time": t,
        "intervalS": 10.0,
        "trainerWaitS": wait,
        "generationS": 8.0 if pressured else 0.2,
        "trainingS": 4.0,
        "inflightRequestSeconds": busy_s,
        "engineSeconds": 10.0,
        "snapshotInflight": 0,
        "sharedEnginesAwake": shared_awake,
        "dedicatedEngines": dedicated,
        "meanReward": 0.1,
        "loss": 0.5,
        "tokensPerS": 1000.0,
        "responseLenMean": 200.0,
    }


def test_adaptive_reports_wake_then_scale_up_then_back_down(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str], kubeconfig_env: None
) -> None:
    pool_name = pool(2)
    spec = rljob(
        "ada",
        pool_name,
        resources={
            "accelerator": {"kind": "nvidia", "model": "H100-80GB"},
            "totalAccelerators": 16,
            "acceleratorsPerNode": 8,
            "mode": "adaptive",
            "static": {"trainerAccelerators": 8, "rolloutAccelerators": 0},
            "rollout": {"tensorParallel": 8, "drainGraceSeconds": 6},
            "adaptive": {
                "wakeAfterPressuredSyncPoints": 2,
                "scaleUpAfterPressuredSyncPoints": 2,
                "calmSyncPointsBeforeScaleDown": 2,
                "cooldownSeconds": 0,
            },
        },
    )
    step = 0

    def feed(pressured: bool, shared_awake: int, dedicated: int, count: int = 2, **extra: Any) -> None:
        nonlocal step
        reports = []
        for _ in range(count):
            step += 1
            reports.append(_report(step, time.time() + 1.5, pressured=pressured, shared_awake=shared_awake,
                                   dedicated=dedicated, **extra))  # fmt: skip
        patch = {"data": {"reports.json": json.dumps(reports)}}
        cluster.kubectl(
            "patch", "configmap", "ada-telemetry", "-n", namespace, "--type=merge", "-p", json.dumps(patch)
        )

    def rollout(key: str) -> Any:
        return (job_status(cluster, namespace, "ada").get("rollout") or {}).get(key)

    with operator(namespace):
        apply(cluster, namespace, spec)
        wait_for("trainer running", running_pods(cluster, namespace, "ada", 1))
        assert rollout("desiredSharedAwake") == 0 and rollout("desiredDedicatedEngines") == 0
        time.sleep(2)
        feed(pressured=True, shared_awake=0, dedicated=0)
        wait_for("wake", lambda: rollout("desiredSharedAwake") == 1, 30)
        assert rollout("lastDecision") == "WakeShared" and rollout("desiredDedicatedEngines") == 0
        assert len(pods(cluster, namespace, "ada")) == 1  # waking costs no pod
        time.sleep(2)
        feed(pressured=True, shared_awake=1, dedicated=0)
        wait_for("scale-up target", lambda: rollout("desiredDedicatedEngines") == 1, 30)
        assert rollout("lastDecision") == "AddDedicated"
        items = wait_for("rollout pod bound and running", running_pods(cluster, namespace, "ada", 2), 30)
        new_pod = next(p for p in items if p["metadata"]["name"] == "ada-rollout-0")
        assert new_pod["spec"]["nodeName"].startswith(pool_name)  # placed by the scheduler on the idle node
        assert new_pod["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "8"
        time.sleep(2)
        feed(pressured=False, shared_awake=1, dedicated=1)
        wait_for("scale-down target", lambda: rollout("desiredDedicatedEngines") == 0, 30)
        assert rollout("lastDecision") == "RemoveDedicated"

        def live() -> list[str]:
            return [
                p["metadata"]["name"]
                for p in pods(cluster, namespace, "ada")
                if not p["metadata"].get("deletionTimestamp")
            ]

        # Two-phase scale-down: the pod drains until the driver releases it (no ack yet: it stays).
        draining = wait_for("drain recorded", lambda: rollout("drainingPods"), 30)
        assert [d["index"] for d in draining] == [0]
        time.sleep(2)
        assert live() == ["ada-rollout-0", "ada-trainer-0"], "deleted before the driver released it"
        feed(pressured=False, shared_awake=1, dedicated=0, count=1, releasedRolloutPods=[0])
        released_at = time.monotonic()
        wait_for("rollout pod removed on the ack", lambda: live() == ["ada-trainer-0"], 30)
        assert time.monotonic() - released_at < 6, "removed by the grace period, not by the ack"
        assert not rollout("drainingPods")

        # Again without an ack: the pod goes after drainGraceSeconds (6 s), and the job runs on.
        time.sleep(2)
        feed(pressured=True, shared_awake=1, dedicated=0)
        wait_for("scale-up again", lambda: rollout("desiredDedicatedEngines") == 1, 30)
        wait_for("rollout pod back", running_pods(cluster, namespace, "ada", 2), 30)
        time.sleep(2)
        feed(pressured=False, shared_awake=1, dedicated=1)
        wait_for("scale-down again", lambda: rollout("drainingPods"), 30)
        drained_at = time.monotonic()
        wait_for("rollout pod removed after the grace", lambda: live() == ["ada-trainer-0"], 30)
        assert time.monotonic() - drained_at >= 3, "deleted long before drainGraceSeconds"
        st = job_status(cluster, namespace, "ada")
        assert st["phase"] == "Running" and not st.get("restarts") and not st.get("failures"), st
        events = cluster.kubectl(
            "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=ada"
        ).stdout
        assert "AdaptiveWakeShared" in events and "AdaptiveAddDedicated" in events
        assert "RolloutPodDraining" in events and "RolloutPodReleased" in events
        assert "RolloutPodDrained" in events


def test_lost_rollout_pod_is_recreated_alone(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str], kubeconfig_env: None
) -> None:
    """A dedicated engine's pod that fails, is deleted, or is reported lost by the driver comes
    back alone: the trainer pods keep their UIDs, restarts and failures stay 0."""
    pool_name = pool(3)
    with operator(namespace):
        apply(cluster, namespace, rljob("eng", pool_name))
        first = wait_for("3 running pods", running_pods(cluster, namespace, "eng", 3))
        uid = {p["metadata"]["name"]: p["metadata"]["uid"] for p in first}

        def replaced(since: dict[str, str]) -> dict[str, str] | None:
            items = running_pods(cluster, namespace, "eng", 3)()
            now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in items}
            return now if items and now["eng-rollout-0"] != since["eng-rollout-0"] else None

        # 1. the pod fails (its ray worker exited)
        cluster.fail_pod(namespace, "eng-rollout-0", exit_code=1)
        second = wait_for("the rollout pod recreated", lambda: replaced(uid), 60)
        for name in ("eng-trainer-0", "eng-trainer-1"):
            assert second[name] == uid[name], "the trainer gang was restarted"
        # 2. the pod is deleted outside the operator
        cluster.kubectl("delete", "pod", "eng-rollout-0", "-n", namespace, "--wait=false")
        third = wait_for("the deleted rollout pod recreated", lambda: replaced(second), 60)
        # 3. the driver reports the engine lost (hung past engineTimeoutSeconds): the pod is
        # replaced once, not again on the next reconciles that read the same report
        # the report's interval must begin after the pod's creation (whole seconds): an engine lost
        # in that interval ran on this pod, not on one replaced since
        time.sleep(2.5)
        lost = _report(5, time.time(), pressured=False, shared_awake=0, dedicated=1, lostRolloutPods=[0])
        lost["intervalS"] = 1.0
        cluster.kubectl("patch", "configmap", "eng-telemetry", "-n", namespace, "--type=merge",
                        "-p", json.dumps({"data": {"reports.json": json.dumps([lost])}}))  # fmt: skip
        fourth = wait_for("the lost engine's pod replaced", lambda: replaced(third), 60)
        time.sleep(3)
        again = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(cluster, namespace, "eng")}
        assert again == fourth, "the same lost report replaced the pod twice"
        for name in ("eng-trainer-0", "eng-trainer-1"):
            assert fourth[name] == uid[name], "the trainer gang was restarted"
        st = job_status(cluster, namespace, "eng")
        assert st["phase"] == "Running" and not st.get("restarts") and not st.get("failures"), st
        assert not st.get("disruptions") and st["rollout"]["replacedPods"] == 2, st
        events = cluster.kubectl(
            "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=eng"
        ).stdout
        assert "RolloutPodReplaced" in events


def _refit_report(step: int, t: float, *, generation_s: float, training_s: float) -> dict[str, Any]:
    """What a driver of this round writes: the phases plus the batch's tokens and engines."""
    return {
        **_report(step, t, pressured=False, shared_awake=0, dedicated=1),
        "intervalS": max(generation_s, training_s) + 0.5,
        "generationS": generation_s,
        "trainingS": training_s,
        "promptTokens": 64 * 8 * 100,
        "generatedTokens": 64 * 8 * 300,
        "trainedTokens": 64 * 8 * 400,
        "generationEngines": 1,
        "prefillEngineS": 0.05 * generation_s,
        "decodeEngineS": 0.95 * generation_s,
    }


def test_the_plan_refitted_from_the_jobs_reports_in_status_and_plan_from_job(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str], kubeconfig_env: None
) -> None:
    """status.plan.refit compares the plan with the job's SyncReports, and `rljob plan --from-job`
    prints the same comparison from the cluster (the job's RLJob and telemetry ConfigMap)."""
    pool_name = pool(3)
    spec = rljob("fit", pool_name)
    spec["spec"]["model"]["config"] = {"preset": "qwen3-4b"}
    with operator(namespace):
        apply(cluster, namespace, spec)
        wait_for("pods running", running_pods(cluster, namespace, "fit", 3))
        assert "refit" not in (job_status(cluster, namespace, "fit").get("plan") or {})  # no report yet
        now = time.time()
        reports = [_refit_report(s, now + s, generation_s=40.0, training_s=20.0) for s in range(1, 6)]
        cluster.kubectl("patch", "configmap", "fit-telemetry", "-n", namespace, "--type=merge",
                        "-p", json.dumps({"data": {"reports.json": json.dumps(reports)}}))  # fmt: skip
        fit = wait_for(
            "status.plan.refit",
            lambda: (job_status(cluster, namespace, "fit").get("plan") or {}).get("refit"),
            30,
        )
    assert (fit["reports"], fit["fromStep"], fit["toStep"]) == (4, 2, 5)
    assert fit["measuredStepSeconds"] == 40.5
    assert fit["stepTimeRatio"] == round(fit["predictedStepSeconds"] / 40.5, 3)
    assert fit["decodeTokensPerSecondPerEngine"]["measured"] == round(64 * 8 * 300 / (0.95 * 40.0), 3)
    assert fit["trainingTokensPerSecond"]["measured"] == round(64 * 8 * 400 / 20.0, 3)
    assert "the job measured 40.5 s" in fit["message"]
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    rljob_bin = str(Path(sys.executable).with_name("rljob"))
    out = subprocess.run([rljob_bin, "plan", "--from-job", "fit", "-n", namespace, "-o", "json"],
                         env=env, capture_output=True, text=True, check=True)  # fmt: skip
    printed = json.loads(out.stdout)
    assert printed["refit"]["stepTimeRatio"] == pytest.approx(fit["stepTimeRatio"], abs=1e-3)
    assert printed["refit"]["decodeScale"] == pytest.approx(fit["decodeScale"], abs=1e-4)
    assert printed["refitPlan"]["rolloutEngines"] == fit["rolloutEngines"]
    table = subprocess.run([rljob_bin, "plan", "--from-job", "fit", "-n", namespace],
                           env=env, capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "decode tokens/s per engine" in table and "predicted/measured" in table
    missing = subprocess.run([rljob_bin, "plan", "--from-job", "nope", "-n", namespace],
                             env=env, capture_output=True, text=True)  # fmt: skip
    assert missing.returncode == 1 and "not found" in missing.stderr

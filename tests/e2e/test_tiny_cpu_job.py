"""End to end on the local cluster: `kubectl apply -f examples/tiny-cpu.yaml` really trains.

The real control plane (etcd, kube-apiserver with RBAC, controller-manager, scheduler), the real
operator (kopf, in-process), and a local-exec node: the test kubelet (`testenv.fakelet`) runs the
pods the scheduler binds there as processes on this machine. So `python -m rljob_trainer` runs in
two pods (Ray head + GRPO driver in trainer-0, a Ray worker in trainer-1; two DDP ranks over gloo),
writes SyncReports to the telemetry ConfigMap with nothing but the job's own ServiceAccount token,
the operator turns them into `status.progress`, and the job ends Succeeded at maxSteps.

The smoke test applies every manifest in `examples/` to the apiserver (CEL and schema included)
and plans it offline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

# Short intervals for tests; read once when rljob_operator.handlers is imported.
os.environ.setdefault("RLJOB_RECONCILE_INTERVAL_S", "1")
os.environ.setdefault("RLJOB_METRICS_PORT", "0")
os.environ.setdefault("RLJOB_EVENT_INTERVAL_S", "1")

from kopf.testing import KopfRunner

from testenv import fakelet
from testenv.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "rljobs.rljob.io.yaml"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
TINY = REPO / "examples" / "tiny-cpu.yaml"
# The example's own 20 steps by default (a step of the tiny model takes well under a second).
E2E_MAX_STEPS = int(os.environ.get("RLJOB_E2E_MAX_STEPS", "20"))

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]


# ---- helpers ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def crd(cluster: Any) -> None:
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/rljobs.rljob.io", "--timeout=60s")


@pytest.fixture
def cpu_node(cluster: Any) -> Iterator[str]:
    """A local-exec CPU node with the label examples/tiny-cpu.yaml selects (`rljob.io/pool: cpu`)."""
    (name,) = cluster.add_nodes(
        1,
        name_prefix=f"e2e-cpu-{uuid.uuid4().hex[:6]}",
        resource=None,
        per_node=0,
        labels={"rljob.io/pool": "cpu"},
        cpu="4",
        memory="16Gi",
        exec_local=True,
    )
    yield name
    cluster.delete_nodes([name])


def delete_job_and_wait(cluster: Any, namespace: str, job: str) -> None:
    """Delete the RLJob (while the operator runs: it holds a finalizer); the garbage collector deletes
    its pods and the local-exec kubelet stops their processes before it confirms each deletion."""
    cluster.kubectl("delete", "rljob", job, "-n", namespace, "--wait=false")

    def gone() -> bool:
        data = cluster.get_json("pods", "-l", f"rljob.io/job={job}", namespace=namespace)
        return data is not None and not data["items"]

    wait_for("the job's pods to be deleted", gone, 60, interval_s=1.0)
    for name in (f"{job}-trainer-0", f"{job}-trainer-1"):
        assert not cluster.kubelet.local_pids(namespace, name), name


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def pod_logs(cluster: Any, namespace: str, names: list[str]) -> str:
    return "\n".join(f"===== pod {n} =====\n{cluster.pod_log(namespace, n)[-6000:]}" for n in names)


# ---- tests -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tiny_cpu_job_trains_to_succeeded_on_local_pods(
    cluster: Any,
    crd: None,
    namespace: str,
    cpu_node: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    manifest = yaml.safe_load(TINY.read_text())
    manifest["spec"]["grpo"]["maxSteps"] = E2E_MAX_STEPS
    job = manifest["metadata"]["name"]
    pod_names = [f"{job}-trainer-0", f"{job}-trainer-1"]
    watch_file = tmp_path / "steps.txt"
    watcher: subprocess.Popen[bytes] | None = None
    started = time.monotonic()
    args = ["run", "--standalone", "--namespace", namespace, "-m", "rljob_operator.handlers"]
    try:
        with KopfRunner(args, timeout=60):
            # Every status write the apiserver sees, as `kubectl get rljobs -w` shows them.
            with open(watch_file, "w") as out:
                watcher = subprocess.Popen(
                    [
                        str(cluster.bins["kubectl"]),
                        "get",
                        "rljobs",
                        "-n",
                        namespace,
                        "-w",
                        "-o",
                        'jsonpath={.status.progress.step}{"\\n"}',
                    ],
                    stdout=out,
                    stderr=subprocess.DEVNULL,
                    env=dict(os.environ, KUBECONFIG=str(cluster.kubeconfig)),
                )
            cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))

            # 1. The operator's pods, bound by the real scheduler to the local-exec node, running.
            def running() -> list[dict[str, Any]]:
                data = cluster.get_json("pods", "-l", f"rljob.io/job={job}", namespace=namespace)
                items = sorted((data or {}).get("items", []), key=lambda p: p["metadata"]["name"])
                ok = [p["metadata"]["name"] for p in items] == pod_names and all(
                    p["spec"].get("nodeName") == cpu_node
                    and p.get("status", {}).get("podIP") == fakelet.LOCAL_POD_IP
                    for p in items
                )
                return items if ok else []

            items = wait_for("2 trainer pods on the local-exec node", running, 90, interval_s=1.0)
            for pod in items:
                assert pod["spec"]["containers"][0]["command"] == ["python", "-m", "rljob_trainer"]

            # 2. status.progress.step advances while it trains; the job ends Succeeded at maxSteps.
            def finished() -> dict[str, Any] | None:
                status = (cluster.get_json("rljob", job, namespace=namespace) or {}).get("status") or {}
                return status if status.get("phase") in ("Succeeded", "Failed") else None

            try:
                status = wait_for("the job to finish", finished, 240, interval_s=1.0)
            except AssertionError as error:
                raise AssertionError(f"{error}\n{pod_logs(cluster, namespace, pod_names)}") from None
            if status["phase"] != "Succeeded":
                pytest.fail(f"{json.dumps(status, indent=1)}\n{pod_logs(cluster, namespace, pod_names)}")
            progress = status["progress"]
            assert progress["step"] == E2E_MAX_STEPS and progress["maxSteps"] == E2E_MAX_STEPS
            assert isinstance(progress.get("meanReward"), float), progress
            watcher.terminate()
            watcher.wait(timeout=10)
            steps_seen = sorted({int(w) for w in watch_file.read_text().split() if w.isdigit()})
            cm = cluster.get_json("configmap", f"{job}-telemetry", namespace=namespace)
            times = [r["time"] for r in json.loads(cm["data"]["reports.json"])]
            # seen advancing, not only the end
            assert len(steps_seen) >= 2, (steps_seen, [round(t - times[0], 2) for t in times])
            printed = cluster.kubectl("get", "rljobs", "-n", namespace).stdout
            assert "Succeeded" in printed and f" {E2E_MAX_STEPS} " in printed, printed

            # 3. The driver wrote SyncReports itself, with the job's ServiceAccount (least privilege).
            from rljob_trainer import telemetry

            cm = cluster.get_json("configmap", f"{job}-telemetry", namespace=namespace)
            reports = telemetry.parse_reports(cm["data"][telemetry.REPORTS_KEY])
            assert [r.step for r in reports] == list(range(1, E2E_MAX_STEPS + 1))
            assert all(r.mean_reward is not None and r.engine_seconds > 0 for r in reports)
            driver_log = cluster.pod_log(namespace, pod_names[0])
            worker_log = cluster.pod_log(namespace, pod_names[1])
            assert "telemetry: patch configmap" not in driver_log, driver_log[-4000:]
            # The driver reads its engine targets back from the RLJob at every sync, under the same Role.
            assert "telemetry: get rljob" not in driver_log, driver_log[-4000:]
            assert "no Kubernetes API" not in driver_log, driver_log[-4000:]
            assert f"done at step {E2E_MAX_STEPS}" in driver_log, driver_log[-4000:]
            # 4. Two pods, one Ray cluster: trainer-1 joined trainer-0's head on the job's port.
            assert "joining the Ray cluster" in worker_log and "--address=127.0.0.1:" in worker_log, (
                worker_log[-4000:]
            )
            pod0 = cluster.get_json("pod", pod_names[0], namespace=namespace)
            assert pod0["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
            elapsed = time.monotonic() - started
            sys.stderr.write(
                f"e2e: Succeeded at step {E2E_MAX_STEPS} after {elapsed:.0f}s; steps {steps_seen}\n"
            )
            # 5. A container ends with its main process: no Ray daemon of either pod outlives it.
            # (trainer-1's `ray start --block` notices its head is gone and exits too.)
            wait_for(
                "no process of either pod left",
                lambda: not any(cluster.kubelet.local_pids(namespace, n) for n in pod_names),
                30,
                interval_s=1.0,
            )
            delete_job_and_wait(cluster, namespace, job)
    finally:
        if watcher is not None and watcher.poll() is None:
            watcher.kill()
        cluster.kubectl("delete", "rljob", job, "-n", namespace, "--wait=false", check=False)


@pytest.mark.slow
def test_deleting_a_training_job_stops_every_local_process(
    cluster: Any, crd: None, namespace: str, cpu_node: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pods deleted mid-run: the kubelet SIGTERMs (then SIGKILLs) each pod's processes, the Ray
    daemons `ray start` spawned included, before it confirms the deletion."""
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    manifest = yaml.safe_load(TINY.read_text())
    manifest["spec"]["grpo"]["maxSteps"] = 1000
    job = manifest["metadata"]["name"]
    pod_names = [f"{job}-trainer-0", f"{job}-trainer-1"]
    args = ["run", "--standalone", "--namespace", namespace, "-m", "rljob_operator.handlers"]
    try:
        with KopfRunner(args, timeout=60):
            cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))

            def training() -> Any:
                status = (cluster.get_json("rljob", job, namespace=namespace) or {}).get("status") or {}
                return ((status.get("progress") or {}).get("step") or 0) >= 1

            try:
                wait_for("the first step", training, 180, interval_s=1.0)
            except AssertionError as error:
                raise AssertionError(f"{error}\n{pod_logs(cluster, namespace, pod_names)}") from None
            pids = {n: cluster.kubelet.local_pids(namespace, n) for n in pod_names}
            assert all(len(p) >= 2 for p in pids.values()), pids  # the pod's process and Ray's
            delete_job_and_wait(cluster, namespace, job)
            alive = [pid for p in pids.values() for pid in p if _alive(pid)]
            assert not alive, alive
    finally:
        cluster.kubectl("delete", "rljob", job, "-n", namespace, "--wait=false", check=False)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_manifest_is_accepted_by_the_apiserver(
    cluster: Any, crd: None, namespace: str, path: Path
) -> None:
    """Every example passes the CRD's schema and CEL rules server-side and plans offline."""
    cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(path))
    plan = subprocess.run(
        [sys.executable, "-m", "rljob_operator.cli", "plan", "-f", str(path), "-o", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["trainerAccelerators"] >= 1

"""End to end on the local cluster: `kubectl apply -f examples/tiny-cpu.yaml` really trains.

The real control plane (etcd, kube-apiserver with RBAC, controller-manager, scheduler), the real
operator (kopf, in-process), and a local-exec node: the test kubelet (`testenv.fakelet`) runs the
pods the scheduler binds there as processes on this machine. So `python -m rljob_trainer` runs in
two pods (Ray head + GRPO driver in trainer-0, a Ray worker in trainer-1; two DDP ranks over gloo),
writes SyncReports to the telemetry ConfigMap with nothing but the job's own ServiceAccount token,
the operator turns them into `status.progress`, and the job ends Succeeded at maxSteps. While it
trains, the test watches it as a user does: `kubectl get rljobs -w`, `rljob status`, `rljob logs`
through the apiserver's pods/log (which the test kubelet serves from the local pod's output) and
the same through kubectl's plugin mechanism; then it reads what the run leaves behind (the final
Hugging Face export, `status.progress.exportPath`, TensorBoard event files). (One run for all of
it: each job's start-up, Ray included, is most of an e2e test's time.)

That pods deleted mid-run leave no local process behind (Ray's daemons included) is checked by
the preemption test (`tests/integration/test_kueue_preemption.py`), whose pods the operator
deletes while the driver trains.

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

from testenv import local_exec
from testenv.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "rljobs.rljob.io.yaml"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
TINY = REPO / "examples" / "tiny-cpu.yaml"
# The example's own 20 steps by default (a step of the tiny model takes well under a second).
# Long enough that the pods still run while status and logs are checked on a loaded machine.
E2E_MAX_STEPS = int(os.environ.get("RLJOB_E2E_MAX_STEPS", "120"))
BIN = Path(sys.executable).parent

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]


# ---- helpers ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def crd(cluster: Any) -> None:
    cluster.apply_crds(REPO / "crds")  # retries the wait: right after a create it can fail at once


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


def pod_logs(cluster: Any, namespace: str, names: list[str]) -> str:
    return "\n".join(f"===== pod {n} =====\n{cluster.pod_log(namespace, n)[-6000:]}" for n in names)


# ---- tests -----------------------------------------------------------------------------------------
def run(cmd: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def note(text: str) -> None:
    """What the run showed (status text, exported files, TensorBoard scalars), for a human: kopf's test
    runner captures this process's stdout/stderr, so it goes to $RLJOB_E2E_REPORT when set."""
    path = os.environ.get("RLJOB_E2E_REPORT")
    if path:
        with open(path, "a") as out:
            out.write(text)


def check_console_mid_run(cluster: Any, namespace: str, job: str, env: dict[str, str]) -> None:
    """While the job trains: `rljob status` (phase, plan, conditions, curves of ≥ 2 sync points),
    `rljob logs` through the apiserver (driver, a worker, --tail, a clear error for a typo), and the
    same through kubectl's plugin mechanism (kubectl finds the `kubectl-rljob` console script)."""
    pods = [f"{job}-trainer-0", f"{job}-trainer-1"]
    kubectl = str(cluster.bins["kubectl"])

    def mid_run() -> str | None:
        out = run([str(BIN / "rljob"), "status", job, "-n", namespace, "--width", "90"], env)
        assert out.returncode == 0, out.stderr
        view = json.loads(run([str(BIN / "rljob"), "status", job, "-n", namespace, "-o", "json"], env).stdout)
        phase = view["status"].get("phase")
        if phase in ("Succeeded", "Failed"):
            raise AssertionError(f"the job ended ({phase}) before status was seen mid-run")
        return out.stdout if phase == "Running" and len(view["history"]) >= 2 else None

    try:
        text = wait_for("rljob status to show a training job", mid_run, 420, interval_s=2.0)
    except AssertionError as error:
        raise AssertionError(f"{error}\n{pod_logs(cluster, namespace, pods)}") from None
    assert f"RLJob {namespace}/{job}   phase: Running" in text
    assert "trainer accelerators 2" in text and "Conditions:" in text and "Planned" in text
    for title in ("reward", "loss", "tokens/s", "engines awake"):
        assert title in text
    note(f"\n===== rljob status (mid-run) =====\n{text}")

    logs = run([str(BIN / "rljob"), "logs", job, "-n", namespace], env)
    assert logs.returncode == 0, logs.stderr
    assert "rljob_trainer" in logs.stdout and "training ranks ready" in logs.stdout
    worker = run([kubectl, "rljob", "logs", job, "-n", namespace, "--pod", "trainer-1"], env)
    assert worker.returncode == 0, worker.stderr
    assert "joining the Ray cluster" in worker.stdout, worker.stdout[-2000:]
    tail = run([str(BIN / "rljob"), "logs", job, "-n", namespace, "--tail", "3"], env)
    assert tail.returncode == 0 and len(tail.stdout.splitlines()) <= 3, tail.stdout
    missing = run([str(BIN / "rljob"), "logs", job, "-n", namespace, "--pod", "rollout-7"], env)
    # (trainer-1, a Ray worker, is deleted once the driver is done: it may be gone by now)
    assert missing.returncode == 1 and f"pods of {job}: {pods[0]}" in missing.stderr, missing.stderr

    plugin = run([kubectl, "rljob", "status", job, "-n", namespace, "--no-plots"], env)
    assert plugin.returncode == 0, plugin.stderr
    assert f"RLJob {namespace}/{job}" in plugin.stdout and "STEP  REWARD" in plugin.stdout
    listed = run([kubectl, "plugin", "list"], env)
    assert "kubectl-rljob" in listed.stdout, listed.stdout + listed.stderr


STRANGER = (
    "import ray\n"
    "ray.init(address='127.0.0.1:{port}', log_to_driver=False)\n"
    "print('JOINED', ray.cluster_resources())\n"
)


def start_stranger(cluster: Any, namespace: str, job: str, tmp_path: Path) -> subprocess.Popen[str]:
    """A Ray client without the job's token (another tenant's pod: no RAY_AUTH_TOKEN, no
    ~/.ray/auth_token) trying the job's head while it trains (started early: Ray's client takes
    its time to give up, and the job must still be running to refuse it)."""
    port = wait_for("the job's Ray head port", lambda: cluster.kubelet.ray_port(namespace, job), 60)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(tmp_path / "stranger")
    return subprocess.Popen(
        [sys.executable, "-c", STRANGER.format(port=port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def check_stranger_refused(stranger: subprocess.Popen[str], cluster: Any, namespace: str, job: str) -> None:
    """The stranger was refused by the head (Ray's AuthenticationError), while the job went on (the
    caller then sees it reach Succeeded); the token is in no pod spec and not in the status."""
    out, err = stranger.communicate(timeout=240)
    assert stranger.returncode != 0 and "JOINED" not in out, out
    assert "InvalidAuthToken" in err or "AuthenticationError" in err, err[-3000:]
    refusal = next(
        line for line in err.splitlines() if "AuthenticationError" in line or "InvalidAuthToken" in line
    )
    note(f"ray client without the token: refused ({refusal.strip()[:160]})\n")
    head = cluster.get_json("pod", f"{job}-trainer-0", namespace=namespace)
    env_of_head = {e["name"]: e for e in head["spec"]["containers"][0]["env"]}
    assert "secretKeyRef" in env_of_head["RAY_AUTH_TOKEN"]["valueFrom"]
    status = json.dumps((cluster.get_json("rljob", job, namespace=namespace) or {}).get("status"))
    assert "auth_token" not in status and "RAY_AUTH" not in status


def check_what_the_run_leaves(status: dict[str, Any], namespace: str, job: str, env: dict[str, str]) -> None:
    """The final Hugging Face export (`status.progress.exportPath`) and the TensorBoard event files."""
    export = Path(status["progress"]["exportPath"])
    assert export.name == "final" and export.parent.name == "hf"
    files = sorted(str(p.relative_to(export)) for p in export.rglob("*") if p.is_file())
    assert {"config.json", "model.safetensors", "tokenizer.json", "rljob-export.json"} <= set(files)
    assert json.loads((export / "rljob-export.json").read_text())["step"] == E2E_MAX_STEPS
    events = list((export.parent.parent / "tensorboard").glob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file next to the export"
    final = run([str(BIN / "rljob"), "status", job, "-n", namespace, "--width", "90"], env)
    assert "phase: Succeeded" in final.stdout and f"export {export}" in final.stdout
    note(f"\n===== rljob status (finished) =====\n{final.stdout}")
    note(f"===== exported files ({export}) =====\n" + "\n".join(files) + "\n")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    for tag in sorted(acc.Tags()["scalars"]):
        values = [round(e.value, 4) for e in acc.Scalars(tag)]
        note(f"tensorboard {tag}: {len(values)} steps, first {values[0]}, last {values[-1]}\n")
    assert len(acc.Scalars("mean_reward")) == E2E_MAX_STEPS


@pytest.mark.slow
def test_tiny_cpu_job_trains_to_succeeded_on_local_pods(
    cluster: Any,
    crd: None,
    namespace: str,
    cpu_node: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """The tiny job from apply to Succeeded, watched the ways a user watches it (`kubectl get -w`,
    `rljob status`/`logs`, the kubectl plugin), and what it leaves behind."""
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    # The job's namespace holds its pods to PodSecurity `restricted`, enforced by the apiserver.
    labels = cluster.get_json("namespace", namespace)["metadata"]["labels"]
    assert labels.get("pod-security.kubernetes.io/enforce") == "restricted", labels
    env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig))
    env["PATH"] = f"{BIN}{os.pathsep}{Path(cluster.bins['kubectl']).parent}{os.pathsep}{env.get('PATH', '')}"
    manifest = yaml.safe_load(TINY.read_text())
    manifest["spec"]["grpo"]["maxSteps"] = E2E_MAX_STEPS
    job = manifest["metadata"]["name"]
    pod_names = [f"{job}-trainer-0", f"{job}-trainer-1"]
    watch_file = tmp_path / "steps.txt"
    watcher: subprocess.Popen[bytes] | None = None
    stranger: subprocess.Popen[str] | None = None
    started = time.monotonic()
    args = ["run", "--standalone", "--namespace", namespace, "-m", "rljob_operator.handlers"]
    try:
        with KopfRunner(args, timeout=60):
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
                    env=env,
                )
            cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))

            def running() -> list[dict[str, Any]]:
                data = cluster.get_json("pods", "-l", f"rljob.io/job={job}", namespace=namespace)
                items = sorted((data or {}).get("items", []), key=lambda p: p["metadata"]["name"])
                ok = [p["metadata"]["name"] for p in items] == pod_names and all(
                    p["spec"].get("nodeName") == cpu_node
                    and p.get("status", {}).get("podIP") == local_exec.LOCAL_POD_IP
                    for p in items
                )
                return items if ok else []

            items = wait_for("2 trainer pods on the local-exec node", running, 90, interval_s=1.0)
            for pod in items:
                assert pod["spec"]["containers"][0]["command"] == ["python", "-m", "rljob_trainer"]
            stranger = start_stranger(cluster, namespace, job, tmp_path)
            check_console_mid_run(cluster, namespace, job, env)
            check_stranger_refused(stranger, cluster, namespace, job)

            # `rljob logs -f` follows until the driver exits (the job's last step), then returns.
            follow_from = time.monotonic()
            follow = run([str(BIN / "rljob"), "logs", job, "-n", namespace, "-f"], env, timeout=300)
            assert follow.returncode == 0, follow.stderr
            assert f"done at step {E2E_MAX_STEPS}" in follow.stdout, follow.stdout[-3000:]
            note(f"rljob logs -f returned {time.monotonic() - follow_from:.0f}s after it started\n")

            def finished() -> dict[str, Any] | None:
                status = (cluster.get_json("rljob", job, namespace=namespace) or {}).get("status") or {}
                return status if status.get("phase") in ("Succeeded", "Failed") else None

            try:
                status = wait_for("the job to finish", finished, 120, interval_s=1.0)
            except AssertionError as error:
                raise AssertionError(f"{error}\n{pod_logs(cluster, namespace, pod_names)}") from None
            if status["phase"] != "Succeeded":
                pytest.fail(f"{json.dumps(status, indent=1)}\n{pod_logs(cluster, namespace, pod_names)}")
            progress = status["progress"]
            assert progress["step"] == E2E_MAX_STEPS and progress["maxSteps"] == E2E_MAX_STEPS
            assert isinstance(progress.get("meanReward"), float), progress
            check_what_the_run_leaves(status, namespace, job, env)
            watcher.terminate()
            watcher.wait(timeout=10)
            steps_seen = sorted({int(w) for w in watch_file.read_text().split() if w.isdigit()})
            assert len(steps_seen) >= 2, steps_seen
            printed = cluster.kubectl("get", "rljobs", "-n", namespace).stdout
            assert "Succeeded" in printed and f" {E2E_MAX_STEPS} " in printed, printed

            from rljob_trainer.outputs import telemetry

            cm = cluster.get_json("configmap", f"{job}-telemetry", namespace=namespace)
            reports = telemetry.parse_reports(cm["data"][telemetry.REPORTS_KEY])
            kept = min(E2E_MAX_STEPS, telemetry.MAX_REPORTS)  # the bounded history: the newest steps
            assert [r.step for r in reports] == list(range(E2E_MAX_STEPS - kept + 1, E2E_MAX_STEPS + 1))
            assert all(r.mean_reward is not None and r.engine_seconds > 0 for r in reports)
            driver_log = cluster.pod_log(namespace, pod_names[0])
            worker_log = cluster.pod_log(namespace, pod_names[1])
            assert "telemetry: patch configmap" not in driver_log, driver_log[-4000:]
            assert "telemetry: get rljob" not in driver_log, driver_log[-4000:]
            assert "no Kubernetes API" not in driver_log, driver_log[-4000:]
            assert f"done at step {E2E_MAX_STEPS}" in driver_log, driver_log[-4000:]
            assert "joining the Ray cluster" in worker_log and "--address=127.0.0.1:" in worker_log, (
                worker_log[-4000:]
            )
            pod0 = cluster.get_json("pod", pod_names[0], namespace=namespace)
            assert pod0["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
            elapsed = time.monotonic() - started
            sys.stderr.write(
                f"e2e: Succeeded at step {E2E_MAX_STEPS} after {elapsed:.0f}s; steps {steps_seen}\n"
            )
            wait_for(
                "no process of either pod left",
                lambda: not any(cluster.kubelet.local_pids(namespace, n) for n in pod_names),
                30,
                interval_s=1.0,
            )
            delete_job_and_wait(cluster, namespace, job)
    finally:
        for proc in (watcher, stranger):
            if proc is not None and proc.poll() is None:
                proc.kill()
        cluster.kubectl("delete", "rljob", job, "-n", namespace, "--wait=false", check=False)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_manifest_is_accepted_by_the_apiserver(
    cluster: Any, crd: None, namespace: str, path: Path
) -> None:
    """Every example passes the CRD's schema and CEL rules server-side and plans offline."""
    cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(path))
    plan = subprocess.run(
        [sys.executable, "-m", "rljob_operator.cli.commands", "plan", "-f", str(path), "-o", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["trainerAccelerators"] >= 1

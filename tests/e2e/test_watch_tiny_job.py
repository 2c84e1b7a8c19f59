"""Watching a run: `rljob status`, `kubectl rljob status` and `rljob logs` against the tiny job on
the local cluster while it trains, then what it leaves behind (the final Hugging Face export,
`status.progress.exportPath`, TensorBoard event files).

kubectl finds the `kubectl-rljob` console script on PATH as a plugin; `rljob logs` goes through
the apiserver's pods/log, which the test kubelet serves from the local pod's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from kopf.testing import KopfRunner
from test_tiny_cpu_job import TINY, cpu_node, crd, pod_logs  # noqa: F401 (fixtures)

from testenv.waiting import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow]

BIN = Path(sys.executable).parent
# Long enough that the pods still run while status and logs are checked on a loaded machine.
STEPS = 120


def note(text: str) -> None:
    """What the run showed (status text, exported files, TensorBoard scalars), for a human: kopf's test
    runner captures this process's stdout/stderr, so it goes to $RLJOB_E2E_REPORT when set."""
    path = os.environ.get("RLJOB_E2E_REPORT")
    if path:
        with open(path, "a") as out:
            out.write(text)


def run(cmd: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.usefixtures("crd", "cpu_node")
def test_status_and_logs_while_the_tiny_job_trains(
    cluster: Any, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig))
    env["PATH"] = f"{BIN}{os.pathsep}{Path(cluster.bins['kubectl']).parent}{os.pathsep}{env.get('PATH', '')}"
    kubectl = str(cluster.bins["kubectl"])
    manifest = yaml.safe_load(TINY.read_text())
    manifest["spec"]["grpo"]["maxSteps"] = STEPS
    job = manifest["metadata"]["name"]
    pods = [f"{job}-trainer-0", f"{job}-trainer-1"]
    args = ["run", "--standalone", "--namespace", namespace, "-m", "rljob_operator.handlers"]
    try:
        with KopfRunner(args, timeout=60):
            cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))

            # 1. While it trains: phase, plan, conditions and curves of at least two sync points.
            def mid_run() -> str | None:
                out = run([str(BIN / "rljob"), "status", job, "-n", namespace, "--width", "90"], env)
                assert out.returncode == 0, out.stderr
                view = json.loads(
                    run([str(BIN / "rljob"), "status", job, "-n", namespace, "-o", "json"], env).stdout
                )
                phase = view["status"].get("phase")
                if phase in ("Succeeded", "Failed"):
                    raise AssertionError(f"the job ended ({phase}) before status was seen mid-run")
                running = phase == "Running" and len(view["history"]) >= 2
                return out.stdout if running else None

            try:
                text = wait_for("rljob status to show a training job", mid_run, 420, interval_s=2.0)
            except AssertionError as error:
                raise AssertionError(f"{error}\n{pod_logs(cluster, namespace, pods)}") from None
            assert f"RLJob {namespace}/{job}   phase: Running" in text
            assert "trainer accelerators 2" in text and "Conditions:" in text and "Planned" in text
            for title in ("reward", "loss", "tokens/s", "engines awake"):
                assert title in text
            note(f"\n===== rljob status (mid-run) =====\n{text}")

            # 2. Logs through the apiserver: the driver's, a worker's, and a clear error for a typo.
            logs = run([str(BIN / "rljob"), "logs", job, "-n", namespace], env)
            assert logs.returncode == 0, logs.stderr
            assert "rljob_trainer" in logs.stdout and "training ranks ready" in logs.stdout
            worker = run([kubectl, "rljob", "logs", job, "-n", namespace, "--pod", "trainer-1"], env)
            assert worker.returncode == 0, worker.stderr
            assert "joining the Ray cluster" in worker.stdout, worker.stdout[-2000:]
            tail = run([str(BIN / "rljob"), "logs", job, "-n", namespace, "--tail", "3"], env)
            assert tail.returncode == 0 and len(tail.stdout.splitlines()) <= 3, tail.stdout
            missing = run([str(BIN / "rljob"), "logs", job, "-n", namespace, "--pod", "rollout-7"], env)
            assert missing.returncode == 1 and f"pods of {job}: {', '.join(pods)}" in missing.stderr

            # 3. The same through kubectl's plugin mechanism.
            plugin = run([kubectl, "rljob", "status", job, "-n", namespace, "--no-plots"], env)
            assert plugin.returncode == 0, plugin.stderr
            assert f"RLJob {namespace}/{job}" in plugin.stdout and "STEP  REWARD" in plugin.stdout
            listed = run([kubectl, "plugin", "list"], env)
            assert "kubectl-rljob" in listed.stdout, listed.stdout + listed.stderr

            # -f follows until the driver exits (the job's last step), then returns.
            started = time.monotonic()
            follow = run([str(BIN / "rljob"), "logs", job, "-n", namespace, "-f"], env, timeout=240)
            assert follow.returncode == 0, follow.stderr
            assert f"done at step {STEPS}" in follow.stdout, follow.stdout[-3000:]
            note(f"rljob logs -f returned {time.monotonic() - started:.0f}s after it started\n")

            # 4. What the run leaves: the final export, reported in the status.
            def succeeded() -> dict[str, Any] | None:
                st = (cluster.get_json("rljob", job, namespace=namespace) or {}).get("status") or {}
                return st if st.get("phase") in ("Succeeded", "Failed") else None

            status = wait_for("the job to finish", succeeded, 120, interval_s=1.0)
            assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
            export = Path(status["progress"]["exportPath"])
            assert export.name == "final" and export.parent.name == "hf"
            files = sorted(str(p.relative_to(export)) for p in export.rglob("*") if p.is_file())
            assert {"config.json", "model.safetensors", "tokenizer.json", "rljob-export.json"} <= set(files)
            assert json.loads((export / "rljob-export.json").read_text())["step"] == STEPS
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
            assert len(acc.Scalars("mean_reward")) == STEPS
            cluster.kubectl("delete", "rljob", job, "-n", namespace, "--wait=true", "--timeout=60s")
    finally:
        cluster.kubectl("delete", "rljob", job, "-n", namespace, "--wait=false", check=False)

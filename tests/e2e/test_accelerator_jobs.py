"""End to end on the local accelerator pools: the flagship's shape placed and trained for real.

A tiny-model copy of `examples/qwen3.5-4b-gsm8k-adaptive.yaml` (same mode, adaptive; the estimator
chooses the trainer/shared/dedicated split) runs on gpu-local-0/1, and an Ascend-shaped copy of it
on npu-local-0. Their pods run as processes here (testenv.fakelet), and `ray start` in each
advertises exactly the pod's `nvidia.com/gpu` (Ray GPU) or `huawei.com/Ascend910` (Ray NPU)
request, so the driver's placement groups, fractional shares and pinned dedicated engines are
decided by Ray exactly as on an accelerator cluster; only torch runs on CPU and the rollout engine
is the transformers engine with vLLM's rules (the test kubelet's stand-in switch). Data come from a
local parquet file on the node's volume (a hostPath PersistentVolume). STEP and REWARD advance in
`kubectl get rljobs`, and the driver's Ray-recorded placement matches the plan.

Sized for 2 cores: 4 accelerators, a 2-layer model, 10 steps.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

os.environ.setdefault("RLJOB_RECONCILE_INTERVAL_S", "1")
os.environ.setdefault("RLJOB_METRICS_PORT", "0")
os.environ.setdefault("RLJOB_EVENT_INTERVAL_S", "1")

from kopf.testing import KopfRunner

from testenv.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
FLAGSHIP = REPO / "examples" / "qwen3.5-4b-gsm8k-adaptive.yaml"
TINY = REPO / "examples" / "tiny-cpu.yaml"
STEPS = int(os.environ.get("RLJOB_E2E_ACCELERATOR_STEPS", "10"))

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def crd(cluster: Any) -> None:
    cluster.apply_crds(str(REPO / "crds"))


def tiny_flagship(kind: str, pool: str, claim: str) -> dict[str, Any]:
    """The flagship manifest with a tiny model, 4 accelerators and data from a PVC's parquet file."""
    manifest = yaml.safe_load(FLAGSHIP.read_text())
    tiny = yaml.safe_load(TINY.read_text())["spec"]
    spec = manifest["spec"]
    manifest["metadata"]["name"] = f"flagship-{kind}"
    spec["model"] = {**tiny["model"], "finetune": {"mode": "lora", "lora": {"rank": 8, "alpha": 16}}}
    spec["grpo"].update(groupSize=8, promptsPerStep=8, maxSteps=STEPS, learningRate=3.0e-3, seed=1)
    spec["lengths"] = {"maxPromptTokens": 16, "maxCompletionTokens": 1}
    spec["data"] = {
        "source": {"pvc": {"claimName": claim, "path": "gsm8k/train.parquet"}},
        "promptField": "question",
        "answerField": "answer",
    }
    spec["batching"]["maxTokensPerMicroBatch"] = 256
    res = spec["resources"]
    res["totalAccelerators"] = 4
    if kind == "ascend":
        res["accelerator"] = {"kind": "ascend", "model": "Ascend910B3"}
        res["acceleratorsPerNode"] = 4
        toleration = {"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoSchedule"}
    else:
        res["acceleratorsPerNode"] = 2
        toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    for key in ("trainerPool", "rolloutPool"):
        spec[key] = {"nodeSelector": {"rljob.io/pool": pool}, "tolerations": [toleration]}
    spec["checkpoint"] = {"volume": {"emptyDir": {}}, "intervalSteps": 0}
    spec["restartPolicy"] = {"policy": "Never"}
    return manifest


def data_volume(cluster: Any, namespace: str, folder: Path) -> str:
    """A hostPath PV holding `gsm8k/train.parquet` (GSM8K-style fields, toy sums), pre-bound to a PVC."""
    datasets = pytest.importorskip("datasets")
    from rljob_trainer import config
    from rljob_trainer.data import sources

    rows = sources.load_examples(config.DataSettings(builtin="toy-arithmetic"))
    (folder / "gsm8k").mkdir(parents=True)
    datasets.Dataset.from_dict(
        {"question": [r.prompt for r in rows], "answer": [r.answer for r in rows]}
    ).to_parquet(str(folder / "gsm8k" / "train.parquet"))
    name = f"data-{uuid.uuid4().hex[:6]}"
    objects = [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": name},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "hostPath": {"path": str(folder)},
                "claimRef": {"namespace": namespace, "name": name},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": name,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    ]
    for obj in objects:
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj))
    return name


def pod_logs(cluster: Any, namespace: str, names: list[str]) -> str:
    return "\n".join(f"===== pod {n} =====\n{cluster.pod_log(namespace, n)[-5000:]}" for n in names)


@pytest.mark.parametrize(
    ("kind", "pool", "resource", "ray_name"),
    [
        ("nvidia", "gpu-local", "nvidia.com/gpu", "GPU"),
        ("ascend", "npu-local", "huawei.com/Ascend910", "NPU"),
    ],
)
def test_flagship_shape_trains_on_local_accelerator_pool(
    cluster: Any,
    crd: None,
    local_accelerator_nodes: list[str],
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    kind: str,
    pool: str,
    resource: str,
    ray_name: str,
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    claim = data_volume(cluster, namespace, tmp_path / "volume")
    manifest = tiny_flagship(kind, pool, claim)
    job = manifest["metadata"]["name"]
    watch_file = tmp_path / "watch.txt"
    watcher: subprocess.Popen[bytes] | None = None
    started = time.monotonic()
    args = ["run", "--standalone", "--namespace", namespace, "-m", "rljob_operator.handlers"]
    names: list[str] = []
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
                        'jsonpath={.status.progress.step} {.status.progress.meanReward}{"\\n"}',
                    ],
                    stdout=out,
                    stderr=subprocess.DEVNULL,
                    env=dict(os.environ, KUBECONFIG=str(cluster.kubeconfig)),
                )
            cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))

            # 1. The estimator's split (adaptive): shared engines on the trainer accelerators and
            # dedicated rollout pods; every pod on the pool, requesting its accelerators.
            def planned() -> dict[str, Any] | None:
                status = (cluster.get_json("rljob", job, namespace=namespace) or {}).get("status") or {}
                return status.get("plan")

            plan = wait_for("the plan", planned, 60, interval_s=1.0)
            assert plan["sharedEngines"] >= 1 and plan["rolloutEngines"] >= 1, plan
            assert plan["sharedEngines"] == plan["trainerAccelerators"], plan

            def running() -> list[dict[str, Any]]:
                items = (
                    cluster.get_json("pods", "-l", f"rljob.io/job={job}", namespace=namespace) or {}
                ).get("items", [])
                ok = items and all(p.get("status", {}).get("phase") == "Running" for p in items)
                return items if ok else []

            pods = wait_for("the job's pods running", running, 120, interval_s=1.0)
            names = sorted(p["metadata"]["name"] for p in pods)
            nodes = {p["spec"]["nodeName"] for p in pods}
            assert all(n.startswith(pool) for n in nodes), nodes
            requested = {
                p["metadata"]["name"]: int(p["spec"]["containers"][0]["resources"]["limits"][resource])
                for p in pods
            }
            assert sum(requested.values()) == plan["trainerAccelerators"] + plan["rolloutEngines"], requested

            # 2. STEP and REWARD advance; the job succeeds at maxSteps.
            def finished() -> dict[str, Any] | None:
                status = (cluster.get_json("rljob", job, namespace=namespace) or {}).get("status") or {}
                return status if status.get("phase") in ("Succeeded", "Failed") else None

            try:
                status = wait_for("the job to finish", finished, 900, interval_s=2.0)
            except AssertionError as error:
                raise AssertionError(f"{error}\n{pod_logs(cluster, namespace, names)}") from None
            if status["phase"] != "Succeeded":
                pytest.fail(f"{json.dumps(status, indent=1)}\n{pod_logs(cluster, namespace, names)}")
            watcher.terminate()
            watcher.wait(timeout=10)
            seen = [line.split() for line in watch_file.read_text().splitlines() if line.strip()]
            steps = sorted({int(s[0]) for s in seen if s and s[0].isdigit()})
            rewards = {s[1] for s in seen if len(s) > 1}
            assert len(steps) >= 2 and steps[-1] == STEPS, seen
            assert len(rewards) >= 2, seen  # REWARD moves, not only the final value

            # 3. Ray's own record: every rank and engine in the pod the plan says, on its accelerator.
            driver_log = cluster.pod_log(namespace, f"{job}-trainer-0")
            assert "RLJOB_TEST_CPU_STANDIN=1" in driver_log
            match = re.search(r"placement: (\[.*\])", driver_log)
            assert match, driver_log[-4000:]
            placement = json.loads(match.group(1))
            assert all(a["pod"] == a["planned"] for a in placement), placement
            ranks = [a for a in placement if a["actor"].startswith("rank-")]
            shared = [a for a in placement if a["actor"].startswith("shared-")]
            dedicated = [a for a in placement if a["actor"].startswith("dedicated-")]
            assert len(ranks) == plan["trainerAccelerators"] and len(shared) == plan["sharedEngines"]
            assert len(dedicated) == plan["rolloutEngines"]
            assert all(a["pod"].startswith("rollout-") for a in dedicated)
            assert all(list(a["accelerators"]) == [ray_name] for a in placement), placement
            # each shared engine sits on a rank's accelerator, in the rank's pod
            rank_slots = {(a["pod"], tuple(a["accelerators"][ray_name])) for a in ranks}
            assert {(a["pod"], tuple(a["accelerators"][ray_name])) for a in shared} <= rank_slots

            # 4. Step time and reward curve, for the report.
            from rljob_trainer.outputs import telemetry

            cm = cluster.get_json("configmap", f"{job}-telemetry", namespace=namespace)
            reports = telemetry.parse_reports(cm["data"][telemetry.REPORTS_KEY])
            assert [r.step for r in reports] == list(range(1, STEPS + 1))
            step_s = [b.time - a.time for a, b in itertools.pairwise(reports)]
            summary = {
                "job": kind,
                "wall_s": round(time.monotonic() - started, 1),
                "plan": {k: plan.get(k) for k in ("trainerAccelerators", "sharedEngines", "rolloutEngines")},
                "step_s_median": round(sorted(step_s)[len(step_s) // 2], 3),
                "generation_s": [round(r.generation_s, 3) for r in reports],
                "training_s": [round(r.training_s, 3) for r in reports],
                "reward_curve": [round(r.mean_reward or 0.0, 3) for r in reports],
                "placement": placement,
            }
            sys.stderr.write(f"e2e {json.dumps(summary)}\n")
            report = os.environ.get("RLJOB_E2E_REPORT")
            if report:
                with open(report, "a") as f:
                    f.write(json.dumps(summary) + "\n")
    finally:
        if watcher is not None and watcher.poll() is None:
            watcher.kill()
        cluster.kubectl("delete", "rljob", job, "-n", namespace, "--wait=false", check=False)

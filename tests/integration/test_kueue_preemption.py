"""Cooperative preemption end to end: the real Kueue preempts a training RLJob for a higher-priority
one, the real driver checkpoints on the operator's request, and the job resumes from that step.

Kueue (testenv.kueue, the real manager) has a ClusterQueue with room for one job and
`preemption.withinClusterQueue: LowerPriority`; the operator runs in-process (kopf); the pods run
as local processes on a local-exec cpu node (`python -m rljob_trainer`: Ray head, GRPO driver, a
tiny model), checkpoints on a hostPath PersistentVolume. A low-priority job trains; a
high-priority job arrives; Kueue evicts the low one's Workload. The operator writes
`status.checkpointRequest`, the driver saves a checkpoint at its next sync point and acknowledges
it in its SyncReport, the operator deletes the pods and clears the reservation as Kueue's own
integrations do; the low job is Queued (a disruption, not a failure). The high job runs to
Succeeded, Kueue readmits the low one, and its driver resumes at the acknowledged step: the run's
report history has every step once, none lost or repeated beyond the forced checkpoint. The
preempted pods' local processes (Ray's daemons included) are all gone once they are deleted.
"""

from __future__ import annotations

import json
import os
import re
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

from test_operator import apply, condition, job_status, operator

from rljob_trainer.outputs import telemetry
from testenv import kueue as kueue_env
from testenv.waiting import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny-cpu.yaml"
LOW_STEPS, HIGH_STEPS = 24, 3
GRACE_S = 120


@pytest.fixture
def cpu_pool(cluster: Any) -> Iterator[str]:
    """A local-exec CPU node under a fresh pool label (its pods really run here)."""
    pool = f"cpu-{uuid.uuid4().hex[:6]}"
    (name,) = cluster.add_nodes(
        1,
        name_prefix=f"preempt-{pool}",
        resource=None,
        per_node=0,
        labels={"rljob.io/pool": pool},
        cpu="4",
        memory="16Gi",
        exec_local=True,
    )
    yield pool
    cluster.delete_nodes([name])


def checkpoint_claim(cluster: Any, namespace: str, folder: Path) -> str:
    """A hostPath PV pre-bound to a PVC: the checkpoints outlive the preempted pod."""
    name = f"ckpt-{uuid.uuid4().hex[:6]}"
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "",
            "hostPath": {"path": str(folder)},
            "claimRef": {"namespace": namespace, "name": name},
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "",
            "volumeName": name,
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([pv, pvc]))
    wait_for(
        f"PVC {name} bound",
        lambda: (
            ((cluster.get_json("pvc", name, namespace=namespace) or {}).get("status") or {}).get("phase")
            == "Bound"
        ),
    )
    return name


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def tiny_job(name: str, pool: str, *, steps: int, priority_class: str, claim: str | None) -> dict[str, Any]:
    """examples/tiny-cpu.yaml on one pod (1 cpu, 4Gi): the Ray head, the driver, one rank and a
    colocated engine; admitted through LocalQueue `team-queue` with `priority_class`."""
    manifest = yaml.safe_load(TINY.read_text())
    manifest["metadata"] = {
        "name": name,
        "labels": {
            "kueue.x-k8s.io/queue-name": "team-queue",
            "kueue.x-k8s.io/priority-class": priority_class,
        },
    }
    spec = manifest["spec"]
    spec["grpo"]["maxSteps"] = steps
    spec["resources"]["totalAccelerators"] = 1
    spec["resources"]["static"] = {"trainerAccelerators": 1, "rolloutAccelerators": 0}
    spec["trainerPool"] = {"nodeSelector": {"rljob.io/pool": pool}}
    spec["checkpoint"] = {"intervalSteps": 0}  # only the forced checkpoint (and the last step's)
    if claim is not None:
        spec["checkpoint"]["volume"] = {"claimName": claim}
    spec["preemption"] = {"checkpointGraceSeconds": GRACE_S}
    spec["export"] = {"final": False, "everyCheckpoint": False}
    # A pod that fails on its own (Ray's head can time out starting on a loaded machine) restarts;
    # the test compares the failure count across the preemption, which must not add to it.
    spec["restartPolicy"] = {
        "policy": "OnFailure",
        "backoffLimit": 3,
        "initialBackoffSeconds": 1,
        "maxBackoffSeconds": 4,
    }
    return manifest


def workload_priority_class(name: str, value: int) -> dict[str, Any]:
    return {
        "apiVersion": f"{kueue_env.KUEUE_GROUP}/v1beta2",
        "kind": "WorkloadPriorityClass",
        "metadata": {"name": name},
        "value": value,
        "description": "rljob preemption test",
    }


def reports(cluster: Any, namespace: str, job: str) -> list[telemetry.SyncReport]:
    cm = cluster.get_json("configmap", f"{job}-telemetry", namespace=namespace) or {}
    return telemetry.parse_reports((cm.get("data") or {}).get(telemetry.REPORTS_KEY))


def logs(cluster: Any, namespace: str, *jobs: str) -> str:
    return "\n".join(
        f"===== {job}-trainer-0 =====\n{cluster.pod_log(namespace, f'{job}-trainer-0')[-5000:]}"
        for job in jobs
    )


@pytest.mark.timeout(1800)
def test_a_preempted_job_checkpoints_on_request_waits_queued_and_resumes_at_that_step(
    cluster: Any,
    crd: None,
    kueue: kueue_env.Kueue,
    namespace: str,
    cpu_pool: str,
    kubeconfig_env: None,
    tmp_path: Path,
) -> None:
    suffix = namespace[-6:]
    low_class, high_class = f"low-{suffix}", f"high-{suffix}"
    queues = kueue_env.queue_manifests(
        namespace=namespace,
        flavor=f"flavor-{namespace}"[:63],
        cluster_queue=f"cq-{namespace}"[:63],
        local_queue="team-queue",
        quota={"cpu": "1", "memory": "4Gi"},  # one tiny job at a time (the example asks 1 cpu, 4Gi)
    )
    queues[1]["spec"]["preemption"] = {"withinClusterQueue": "LowerPriority"}
    classes = [workload_priority_class(low_class, 100), workload_priority_class(high_class, 1000)]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([*classes, *queues]))
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    claim = checkpoint_claim(cluster, namespace, folder)
    low = tiny_job("low", cpu_pool, steps=LOW_STEPS, priority_class=low_class, claim=claim)
    high = tiny_job("high", cpu_pool, steps=HIGH_STEPS, priority_class=high_class, claim=None)
    try:
        with operator(namespace):
            apply(cluster, namespace, low)

            # 1. The low job is admitted and trains.
            def training() -> dict[str, Any] | None:
                st = job_status(cluster, namespace, "low")
                return st if ((st.get("progress") or {}).get("step") or 0) >= 3 else None

            try:
                before = wait_for("the low-priority job to train 3 steps", training, 480, interval_s=1.0)
            except AssertionError as error:
                raise AssertionError(f"{error}\n{logs(cluster, namespace, 'low')}") from None
            pids = cluster.kubelet.local_pids(namespace, "low-trainer-0")
            assert len(pids) >= 2, pids  # the pod's process and the Ray daemons `ray start` spawned

            # 2. The high-priority job arrives: Kueue preempts the low one, whose driver
            # checkpoints on request; the pods go and the low job waits, Queued.
            apply(cluster, namespace, high)
            seen_request: list[dict[str, Any]] = []

            def queued() -> dict[str, Any] | None:
                st = job_status(cluster, namespace, "low")
                if st.get("checkpointRequest"):
                    seen_request.append(st["checkpointRequest"])
                preempted = condition(st, "Preempted")
                return st if st.get("phase") == "Queued" and preempted.get("reason") == "Requeued" else None

            try:
                st = wait_for("the low job preempted and Queued", queued, 300, interval_s=0.5)
            except AssertionError as error:
                raise AssertionError(f"{error}\n{logs(cluster, namespace, 'low', 'high')}") from None
            # The pods deleted mid-run leave no process behind: the kubelet SIGTERMs (then SIGKILLs)
            # each pod's processes, Ray's daemons included, before it confirms the deletion.
            assert not [pid for pid in pids if _alive(pid)], pids
            history = reports(cluster, namespace, "low")
            acks = [r for r in history if r.checkpoint_ack]
            assert len(acks) == 1, [r.model_dump(by_alias=True) for r in history]
            ack = acks[0]
            ack_step = ack.checkpoint_ack_step
            assert ack_step is not None and ack_step >= 3 and ack.step == ack_step
            assert ack.checkpoint_ack.startswith("preempted-"), ack.checkpoint_ack
            preempted = condition(st, "Preempted")
            assert f"the driver checkpointed at step {ack_step}" in preempted["message"], preempted
            assert "checkpointRequest" not in st  # cleared once the pods were gone
            # One disruption and a new attempt, never a failure.
            assert st.get("failures") == before.get("failures"), (before, st)
            assert st["disruptions"] == (before.get("disruptions") or 0) + 1, (before, st)
            assert st["restarts"] == (before.get("restarts") or 0) + 1, (before, st)
            first_run = cluster.pod_log(namespace, "low-trainer-0")
            assert f"checkpoint request {ack.checkpoint_ack} honoured at step {ack_step}" in first_run
            assert (folder / f"step-{ack_step:08d}").is_dir()  # the forced checkpoint, on the volume
            wl = cluster.get_json("workload", "rljob-low", namespace=namespace, check=True)
            wl_conds = {c["type"]: c for c in wl["status"]["conditions"]}
            assert wl_conds["QuotaReserved"]["status"] == "False", wl_conds
            assert wl_conds["Requeued"]["status"] == "True", wl_conds
            assert "admission" not in wl["status"]

            # 3. The high job runs to Succeeded; then Kueue readmits the low one, which resumes at
            # the acknowledged step and finishes.
            def finished(job: str) -> Any:
                st = job_status(cluster, namespace, job)
                return st if st.get("phase") in ("Succeeded", "Failed") else None

            try:
                high_st = wait_for("the high job to finish", lambda: finished("high"), 480, interval_s=1.0)
                low_st = wait_for("the low job to finish", lambda: finished("low"), 600, interval_s=1.0)
            except AssertionError as error:
                raise AssertionError(f"{error}\n{logs(cluster, namespace, 'low', 'high')}") from None
            assert high_st["phase"] == "Succeeded", json.dumps(high_st, indent=1)
            assert low_st["phase"] == "Succeeded", (
                f"{json.dumps(low_st, indent=1)}\n{logs(cluster, namespace, 'low')}"
            )
            assert low_st["progress"]["step"] == LOW_STEPS
            assert low_st["disruptions"] == st["disruptions"]
            assert condition(low_st, "Preempted")["status"] in ("True", "False")
            log = cluster.pod_log(namespace, "low-trainer-0")
            resumed = re.findall(r"resumed from \S+ at step (\d+)", log)
            # The first resume is at the acknowledged step (a later restart after a failure of the
            # readmitted pod would resume from the same checkpoint).
            assert resumed and set(resumed) == {str(ack_step)}, (resumed, log[-4000:])
            # Every step once: 1..ack from the checkpoint's history, then ack+1.. after the resume.
            assert [r.step for r in reports(cluster, namespace, "low")] == list(range(1, LOW_STEPS + 1))
            assert seen_request == [] or all(r["id"] == ack.checkpoint_ack for r in seen_request)
            # What `kubectl describe rljob low` tells: asked, pods deleted as preempted, requeued.
            events = cluster.get_json(
                "events", "--field-selector", "involvedObject.name=low", namespace=namespace
            )
            said: dict[str, list[str]] = {}
            for event in (events or {}).get("items", []):
                said.setdefault(event["reason"], []).append(event["message"])
            assert "CheckpointRequested" in said and "Requeued" in said, sorted(said)
            assert "deleted low-trainer-0 (preempted)" in said.get("PodsDeleted", []), said
            forbidden = [line for line in kueue.log().splitlines() if "forbidden" in line]
            assert forbidden == [], forbidden[:3]
    finally:
        for job in ("low", "high"):
            cluster.kubectl("delete", "rljob", job, "-n", namespace, "--wait=false", check=False)
        cluster.kubectl("delete", "workloads", "--all", "-n", namespace, "--wait=false", check=False)
        cluster.kubectl(
            "delete", "-f", "-", "--wait=false", input=yaml.safe_dump_all([*queues, *classes]), check=False
        )

"""Operator high availability on the real control plane: `rljob operator` replicas and their Lease.

Two `rljob operator` processes (the chart runs two replicas) elect one holder of the Lease
`rljob-operator`; only that one reconciles, the other stands by and answers its liveness probe.
SIGKILL the holder: the standby takes the Lease over within 30 s (client-go timing: 15 s lease),
reconciles, and neither duplicates nor replaces a pod, nor loses the job's status. A clean stop
hands the Lease back at once; a holder whose Lease is taken stops itself before it could write.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob_operator import names
from rljob_operator.kube import leader
from testenv.cluster import free_port
from testenv.waiting import wait_for

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "rljobs.rljob.io.yaml"
RLJOB = Path(sys.executable).parent / "rljob"
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


@dataclass
class Replica:
    proc: subprocess.Popen[bytes]
    log: Path
    live_port: int

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    @property
    def identity(self) -> str:
        match = re.search(r"waiting to hold Lease \S+ as (\S+)", self.text())
        return match.group(1) if match else ""

    def healthz(self) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.live_port}/healthz", timeout=3) as rsp:
                return int(rsp.status)
        except OSError:
            return 0


@pytest.fixture(scope="module")
def crd(cluster: Any) -> None:
    cluster.kubectl("apply", "--server-side", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/rljobs.rljob.io", "--timeout=60s")


@pytest.fixture
def replicas(cluster: Any, namespace: str, tmp_path: Path) -> Iterator[Callable[..., Replica]]:
    """Start `rljob operator` processes watching `namespace`, with the Lease in `namespace` too."""
    started: list[Replica] = []

    def start(name: str, *extra: str) -> Replica:
        port = free_port()
        argv = [
            str(RLJOB),
            "operator",
            "--namespace",
            namespace,
            f"--leader-election-namespace={namespace}",
            f"--liveness=http://127.0.0.1:{port}/healthz",
            *extra,
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "RLJOB_"))}
        env.update(KUBECONFIG=str(cluster.kubeconfig), RLJOB_RECONCILE_INTERVAL_S="1", RLJOB_METRICS_PORT="0")
        log = tmp_path / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        replica = Replica(proc, log, port)
        started.append(replica)
        wait_for(f"{name} to log its identity", lambda: replica.identity or replica.proc.poll() is not None)
        assert replica.proc.poll() is None, replica.text()
        return replica

    yield start
    for replica in started:
        if replica.proc.poll() is None:
            os.killpg(replica.proc.pid, signal.SIGKILL)
            replica.proc.wait(timeout=10)


@pytest.fixture
def pool(cluster: Any) -> Iterator[str]:
    name = f"p{uuid.uuid4().hex[:6]}"
    # Room for two jobs of two 8-GPU pods each.
    added = cluster.add_nodes(
        4, name_prefix=name, resource="nvidia.com/gpu", per_node=8, labels={"pool": name}
    )
    yield name
    cluster.delete_nodes(added)


def rljob(name: str, pool_name: str) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "rljob.io/v1alpha1",
            "kind": "RLJob",
            "metadata": {"name": name},
            "spec": {
                "model": {"name": "tiny", "source": {"tiny": {}}, "config": {"inline": TINY_CONFIG}},
                "data": {"source": {"builtin": {"name": "toy-arithmetic"}}},
                "resources": {
                    "accelerator": {"kind": "nvidia", "model": "H100-80GB"},
                    "totalAccelerators": 16,
                    "acceleratorsPerNode": 8,
                    "mode": "static",
                    "static": {"trainerAccelerators": 8, "rolloutAccelerators": 8},
                    "rollout": {"tensorParallel": 8},
                },
                "trainerPool": {"nodeSelector": {"pool": pool_name}},
                "rolloutPool": {"nodeSelector": {"pool": pool_name}},
            },
        }
    )


def lease_holder(cluster: Any, namespace: str) -> str | None:
    lease = cluster.get_json("lease", names.LEADER_LEASE, namespace=namespace)
    return None if lease is None else lease["spec"].get("holderIdentity", "")


def job_pods(cluster: Any, namespace: str, job: str) -> list[dict[str, Any]]:
    data = cluster.get_json("pods", "-l", f"{names.LABEL_JOB}={job}", namespace=namespace)
    return [p for p in (data or {}).get("items", []) if not p["metadata"].get("deletionTimestamp")]


def running(cluster: Any, namespace: str, job: str, count: int) -> Callable[[], dict[str, str]]:
    """Name -> uid of the job's pods once `count` of them are Running."""

    def check() -> dict[str, str]:
        items = job_pods(cluster, namespace, job)
        ok = len(items) == count and all(p.get("status", {}).get("phase") == "Running" for p in items)
        return {p["metadata"]["name"]: p["metadata"]["uid"] for p in items} if ok else {}

    return check


def job_status(cluster: Any, namespace: str, job: str) -> dict[str, Any]:
    return (cluster.get_json("rljob", job, namespace=namespace) or {}).get("status") or {}


def reconciled(replica: Replica) -> bool:
    """The operator logs the pods a reconcile created ("reconciled <ns>/<job>: created pods ...");
    kopf logs its own handler runs ("Handler 'rljob_...' succeeded")."""
    return bool(re.search(r"reconciled \S+: created pods|(Handler|Timer) '\S+' succeeded", replica.text()))


def test_one_replica_reconciles_and_the_standby_takes_over_after_sigkill(
    cluster: Any, crd: None, namespace: str, pool: str, replicas: Callable[..., Replica]
) -> None:
    first, second = replicas("a"), replicas("b")
    holder = wait_for("a Lease holder", lambda: lease_holder(cluster, namespace))
    assert holder in (first.identity, second.identity) and first.identity != second.identity
    active, standby = (first, second) if holder == first.identity else (second, first)

    seen: dict[str, set[str]] = {}  # every pod uid ever observed, by name
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for p in job_pods(cluster, namespace, "ha"):
                seen.setdefault(p["metadata"]["name"], set()).add(p["metadata"]["uid"])
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=rljob("ha", pool))
        before = wait_for("2 running pods", running(cluster, namespace, "ha", 2))
        status = wait_for(
            "phase Running",
            lambda: (s := job_status(cluster, namespace, "ha")).get("phase") == "Running" and s,
        )
        assert reconciled(active)
        assert not reconciled(standby), standby.text()[-3000:]
        assert standby.healthz() == 200  # the standby answers its liveness probe itself

        os.killpg(active.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(
            "the standby to take the Lease over",
            lambda: lease_holder(cluster, namespace) == standby.identity,
            timeout_s=30,
            interval_s=0.2,
        )
        takeover_s = time.monotonic() - killed_at
        print(f"takeover after SIGKILL: {takeover_s:.1f} s")
        assert takeover_s < 30
        # The new leader reconciles: a job created now gets its pods from it.
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=rljob("after", pool))
        try:
            wait_for("the second job's pods", running(cluster, namespace, "after", 2), 60)
        except AssertionError as exc:
            seen_now = cluster.kubectl("get", "rljobs,pods", "-n", namespace, "-o", "wide").stdout
            status_now = job_status(cluster, namespace, "after")
            raise AssertionError(f"{exc}\n{seen_now}\n{status_now}\n{standby.text()[-2000:]}") from None
        wait_for("a timer run of the new leader", lambda: reconciled(standby))
        time.sleep(3)  # a few reconcile intervals of the new leader over the first job
        after = running(cluster, namespace, "ha", 2)()
    finally:
        stop.set()
        watcher.join(timeout=5)
    assert after == before, "the new leader replaced or duplicated a pod"
    assert {n: len(u) for n, u in seen.items()} == dict.fromkeys(before, 1)
    now = job_status(cluster, namespace, "ha")
    for key in ("phase", "restarts", "plan", "observedGeneration"):
        assert now.get(key) == status.get(key), key
    ready = [c for c in now["conditions"] if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True"

    # A clean stop hands the Lease back (empty holder) instead of leaving it to expire.
    standby.proc.send_signal(signal.SIGTERM)
    assert standby.proc.wait(timeout=30) == 0, standby.text()[-3000:]
    assert lease_holder(cluster, namespace) == ""


def test_a_holder_whose_lease_is_taken_stops_at_once(
    cluster: Any, crd: None, namespace: str, replicas: Callable[..., Replica]
) -> None:
    only = replicas("solo")
    wait_for("the Lease", lambda: lease_holder(cluster, namespace) == only.identity)
    wait_for("kopf to start", lambda: only.healthz() == 200)
    # Another candidate writes itself into the Lease (as after a partition that outlasted the lease).
    cluster.kubectl(
        "patch", "lease", names.LEADER_LEASE, "-n", namespace, "--type=merge",
        "-p", '{"spec": {"holderIdentity": "intruder"}}',
    )  # fmt: skip
    taken_at = time.monotonic()
    code = only.proc.wait(timeout=15)
    assert code == leader.EXIT_LEASE_LOST, only.text()[-3000:]
    # Within a renew period or two (2 s each), never as late as the 10 s renew deadline.
    assert time.monotonic() - taken_at < 6
    assert "leader election lost" in only.text()
    assert lease_holder(cluster, namespace) == "intruder"


def test_no_leader_election_reconciles_without_a_lease(
    cluster: Any, crd: None, namespace: str, pool: str, replicas: Callable[..., Replica]
) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "RLJOB_"))}
    env.update(KUBECONFIG=str(cluster.kubeconfig), RLJOB_RECONCILE_INTERVAL_S="1", RLJOB_METRICS_PORT="0")
    argv = [
        str(RLJOB),
        "operator",
        "-n",
        namespace,
        "--no-leader-election",
        f"--liveness=http://127.0.0.1:{port}/healthz",
    ]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=rljob("dev", pool))
        wait_for("2 running pods", running(cluster, namespace, "dev", 2))
        assert lease_holder(cluster, namespace) is None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)

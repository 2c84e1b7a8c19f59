"""Operator scale benchmark: N RLJobs on M fake GPU nodes against the real control plane.

Starts the local control plane (`tests/testenv`), registers M fake 8-GPU nodes, runs the operator
as a subprocess (`kopf run --standalone -m rljob_operator.handlers`), creates N RLJobs (each: one
8-GPU trainer pod and one 8-GPU rollout pod) as fast as one client can, and measures for every job
the time from its create call returning to the last of its pods appearing in a pod watch. API cost
is measured twice: the operator's own handler calls (its `rljob_operator_api_requests_total`
metric) and the apiserver's `apiserver_request_total` deltas on RLJobs and their child kinds
(events and the kubelet/scheduler's pod subresources excluded), minus this client's creates.

    .venv/bin/python bench/operator_scale.py --jobs 200 --nodes 400
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from testenv.cluster import LocalCluster  # noqa: E402

NAMESPACE = "bench"
LOG = Path(os.environ.get("RLJOB_BENCH_LOG", "/tmp/rljob-bench-operator.log"))
CHILD_RESOURCES = {"rljobs", "pods", "configmaps", "services", "serviceaccounts", "roles", "rolebindings"}
_METRIC_RE = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$")


TINY_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
}


def rljob(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "rljob.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": name, "namespace": NAMESPACE},
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
            "trainerPool": {"nodeSelector": {"pool": "bench"}},
            "rolloutPool": {"nodeSelector": {"pool": "bench"}},
        },
    }


def apiserver_requests(cluster: LocalCluster) -> dict[tuple[str, str], float]:
    """(verb, resource) → count, for the RLJob and child resources (no subresources, no events)."""
    text = cluster.kubectl("get", "--raw", "/metrics", timeout=60).stdout
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = _METRIC_RE.match(line)
        if not m:
            continue
        labels = dict(kv.split("=", 1) for kv in re.findall(r'\w+="[^"]*"', m.group("labels")))
        labels = {k: v.strip('"') for k, v in labels.items()}
        if labels.get("resource") not in CHILD_RESOURCES or labels.get("subresource", "") not in (
            "",
            "status",
        ):
            continue
        if labels.get("resource") == "pods" and labels.get("subresource") == "status":
            continue  # the fake kubelet's status updates
        key = (labels.get("verb", ""), labels["resource"] + ("/status" if labels.get("subresource") else ""))
        out[key] = out.get(key, 0.0) + float(m.group("value"))
    return out


def operator_requests(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("rljob_operator_api_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels] = float(value)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--metrics-port", type=int, default=18080)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()

    from kubernetes import client, watch

    with LocalCluster.create() as cluster:
        cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds" / "rljobs.rljob.io.yaml"))
        cluster.kubectl("wait", "--for=condition=Established", "crd/rljobs.rljob.io", "--timeout=60s")
        cluster.create_namespace(NAMESPACE)
        t = time.monotonic()
        cluster.add_nodes(args.nodes, name_prefix="bench", labels={"pool": "bench"})
        print(f"registered {args.nodes} fake 8-GPU nodes in {time.monotonic() - t:.1f}s", flush=True)

        env = dict(
            os.environ,
            KUBECONFIG=str(cluster.kubeconfig),
            RLJOB_RECONCILE_INTERVAL_S="60",
            RLJOB_METRICS_PORT=str(args.metrics_port),
        )
        argv = [sys.executable, "-m", "kopf", "run", "--standalone", "--quiet", "--namespace", NAMESPACE,
                "-m", "rljob_operator.handlers"]  # fmt: skip
        log = open(LOG, "w")  # noqa: SIM115 - lives as long as the process
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        api = cluster.api_client()
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)

        seen: dict[str, float] = {}
        stop = threading.Event()
        ready = threading.Event()

        def watch_pods() -> None:  # first-seen time of every pod; reconnects when a stream ends
            resource_version = None
            while not stop.is_set():
                try:
                    if resource_version is None:
                        listing = core.list_namespaced_pod(NAMESPACE)
                        for pod in listing.items:
                            seen.setdefault(pod.metadata.name, time.monotonic())
                        resource_version = listing.metadata.resource_version
                        ready.set()
                    w = watch.Watch()
                    for ev in w.stream(
                        core.list_namespaced_pod,
                        NAMESPACE,
                        resource_version=resource_version,
                        timeout_seconds=30,
                    ):
                        obj = ev["object"]
                        if ev["type"] == "ADDED":
                            seen.setdefault(obj.metadata.name, time.monotonic())
                        if ev["type"] != "ERROR":
                            resource_version = obj.metadata.resource_version
                        if stop.is_set():
                            w.stop()
                except Exception:  # expired or dropped watch: list again
                    resource_version = None
                    time.sleep(0.2)

        watcher = threading.Thread(target=watch_pods, daemon=True)
        watcher.start()
        ready.wait()
        try:
            # Warm-up: the operator is up when one job has its pods.
            custom.create_namespaced_custom_object(
                "rljob.io", "v1alpha1", NAMESPACE, "rljobs", rljob("warmup")
            )
            deadline = time.monotonic() + 120
            while not {"warmup-trainer-0", "warmup-rollout-0"} <= seen.keys():
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"operator did not start; see {LOG}")
                time.sleep(0.2)
            time.sleep(2)
            api_before = apiserver_requests(cluster)
            op_before = operator_requests(args.metrics_port)

            created: dict[str, float] = {}
            t0 = time.monotonic()
            for i in range(args.jobs):
                name = f"job-{i:04d}"
                custom.create_namespaced_custom_object(
                    "rljob.io", "v1alpha1", NAMESPACE, "rljobs", rljob(name)
                )
                created[name] = time.monotonic()
            submit_s = time.monotonic() - t0
            want = {f"{n}-{role}-0" for n in created for role in ("trainer", "rollout")}
            deadline = time.monotonic() + args.timeout
            while not want <= seen.keys() and time.monotonic() < deadline:
                time.sleep(0.2)
            missing = want - seen.keys()
            all_s = time.monotonic() - t0
            time.sleep(5)  # let status writes and kopf's annotations settle before counting
            api_after = apiserver_requests(cluster)
            op_after = operator_requests(args.metrics_port)
        finally:
            stop.set()
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

        latencies = [
            max(seen[f"{n}-trainer-0"], seen[f"{n}-rollout-0"]) - t
            for n, t in created.items()
            if f"{n}-trainer-0" in seen and f"{n}-rollout-0" in seen
        ]
        delta = {k: api_after.get(k, 0.0) - api_before.get(k, 0.0) for k in api_after}
        delta = {k: v for k, v in delta.items() if v > 0 and k[0] != "WATCH"}
        client_calls = args.jobs  # this script's own RLJob creates
        total = sum(delta.values()) - client_calls
        op_calls = sum(op_after.values()) - sum(op_before.values())

        print()
        print("| jobs | nodes | pods | submit s | all pods s | p50 s | p99 s | max s | missing |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        print(
            f"| {args.jobs} | {args.nodes} | {2 * args.jobs} | {submit_s:.2f} | {all_s:.2f} | "
            f"{statistics.median(latencies):.3f} | {percentile(latencies, 0.99):.3f} | "
            f"{max(latencies):.3f} | {len(missing)} |"
        )
        print()
        print(f"operator handler API calls per job: {op_calls / args.jobs:.2f}")
        print(
            "apiserver requests per job on rljobs+children (excl. this client's creates): "
            f"{total / args.jobs:.2f}"
        )
        print("| verb | resource | per job |")
        print("|---|---|---:|")
        for (verb, res), v in sorted(delta.items()):
            if verb == "POST" and res == "rljobs":
                v -= client_calls
            print(f"| {verb} | {res} | {v / args.jobs:.2f} |")
        print(json.dumps({"jobs": args.jobs, "nodes": args.nodes, "p50_s": statistics.median(latencies),
                          "p99_s": percentile(latencies, 0.99), "api_per_job": total / args.jobs,
                          "operator_calls_per_job": op_calls / args.jobs}))  # fmt: skip
        return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())

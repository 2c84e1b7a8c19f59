"""Operator scale benchmark: N RLJobs on M fake GPU nodes against the real control plane, at the
Helm chart's own settings.

For each side (this tree; this tree with Kueue admission; `--baseline REF`, another commit's
operator) it starts a fresh local control plane (`tests/testenv`), registers M fake 8-GPU nodes,
waits until none of them carries the not-ready taint (the controller-manager lifts it; the bench
gives it 200 requests/s), runs the operator the way the chart's Deployment does (`rljob operator
--namespace NS --leader-election-namespace NS`, with the chart's `values.yaml` environment:
RLJOB_RECONCILE_INTERVAL_S, RLJOB_EVENT_INTERVAL_S), creates N RLJobs (each one 8-GPU trainer pod
and one 8-GPU rollout pod) as fast as one client can, and measures:

- create -> all pods: from a job's create call returning to the last of its pods appearing in a
  pod watch (p50, p99, max);
- API requests per job, from the apiserver's `apiserver_request_total` on RLJobs and their child
  kinds (pods without the kubelet's status writes and the scheduler's bindings; events counted
  apart), from the first create until every job is Running and the status writes have settled,
  minus this client's own creates; and the operator's own handler calls (its
  `rljob_operator_api_requests_total`);
- idle: with every job Running, over `--idle-seconds`: the operator's CPU (% of one core, from
  /proc) and RSS, the apiserver's requests/s on those kinds, and the operator's own calls/s.
  (Leader election renews its Lease every 2 s besides: 0.5 requests/s, not counted above.)

Each side's per-job times (create returned, each pod first seen; monotonic seconds, comparable
with the operator's own clock) go to `$RLJOB_BENCH_LOG_DIR/rljob-bench-times-<side>.json`, next to
its operator's log, to tell where a slow job's time went.

Where create -> all pods goes: the operator writes a per-job trace (`RLJOB_TRACE_FILE`,
`rljob_operator.kube.trace`: when its watch first showed the job, when a reconcile was taken for it
and held its lock, when its children and its pods were sent and answered), and the bench's own
watch adds when the pods appeared and were bound. `latency_breakdown` splits each job's latency into
watch delivery (create returned -> the operator saw the job), queueing (-> a reconcile slot and the
job's lock), earlier reconciles (that did not create the pods), the reconcile before its pod
creates (plan, children: of which API round trips), the pod creates' API round trips, the watch
back to the bench; and after it the scheduler (pods seen -> all bound). It prints the mean and p99
of each part over all jobs and the mean over the slowest 1 %.

With Kueue (`--kueue`, default on when this tree has the admission step and the Kueue binary can
run here): the jobs carry `kueue.x-k8s.io/queue-name`, a ClusterQueue with room for all of them
admits their Workloads, and create -> all pods includes the admission.

    .venv/bin/python bench/operator_scale.py --quick
    .venv/bin/python bench/operator_scale.py --jobs 500 --nodes 1000 --baseline main
    .venv/bin/python bench/operator_scale.py --foreign-pods 5000 --jobs 20 --baseline main

`--foreign-pods N` measures something else: the idle operator (`--jobs` jobs Running) in a
namespace that also holds N pods that are not its own (gated, so nothing schedules or runs them),
against the same with none, each side on a fresh cluster: its server-side label selectors should
make the N pods cost it nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from operator_latency import (  # noqa: E402  (bench/, beside this script)
    api_pool_means,
    api_pool_timing,
    apiserver_write_latency,
    latency_breakdown,
    percentile,
    print_breakdown,
    read_trace,
    trace_path,
)

from testenv.cluster import LocalCluster  # noqa: E402

NAMESPACE = "bench"
CRD = Path("crds") / "rljobs.rljob.io.yaml"  # relative to a source tree
QUEUE = "bench-queue"
LOG_DIR = Path(os.environ.get("RLJOB_BENCH_LOG_DIR", "/tmp"))
CHILD_RESOURCES = {
    "rljobs",
    "pods",
    "configmaps",
    "services",
    "serviceaccounts",
    "roles",
    "rolebindings",
    "workloads",
    "podgroups",
}
_METRIC_RE = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$")
CLK_TCK = os.sysconf("SC_CLK_TCK")
NODE_GRACE_S = 900
# A node registers with the not-ready taint, and the node lifecycle controller lifts it through its
# client's rate limit: at the default 20 requests/s, 1000 new nodes took ~215 s, and jobs created
# meanwhile were refused by the scheduler ~8 times a pod (each refusal a pod status write and an
# Event on the two cores the operator shares). At 200/s they are schedulable in ~20 s, and the
# jobs are created only then: a cluster whose nodes joined minutes before, not together with them.
CONTROLLER_QPS = 200
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
GC_DISCOVERY_S = 35

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


def rljob(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "rljob.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels or {}},
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


# ---- the operator as the chart runs it -----------------------------------------------------------
@dataclass(frozen=True)
class Side:
    """One operator to measure: its source folder (`operator/`), its chart's values and its CRD
    (an older operator refuses the fields a newer CRD defaults: InvalidSpec)."""

    label: str
    source: Path
    chart_values: Path
    crd: Path
    kueue: bool = False

    def chart_env(self) -> dict[str, str]:
        """The environment the chart's Deployment gives the operator, from that side's values.yaml."""
        values = yaml.safe_load(self.chart_values.read_text())
        op = values.get("operator") or {}
        env = {
            "RLJOB_RECONCILE_INTERVAL_S": str(op.get("reconcileIntervalSeconds", "")),
            "RLJOB_EVENT_INTERVAL_S": str(op.get("eventIntervalSeconds", "")),
            "RLJOB_API_THREADS": str(op.get("apiThreads", "")),
            "RLJOB_MAX_RECONCILES": str(op.get("maxConcurrentReconciles", "")),
        }
        return {k: v for k, v in env.items() if v}

    def has_admission(self) -> bool:
        # The admission step moved into decide/ with the role folders; a baseline may predate either.
        pkg = self.source / "rljob_operator"
        return (pkg / "admission.py").exists() or (pkg / "decide" / "admission.py").exists()


def extract_baseline(ref: str) -> Path:
    """`operator/`, `helm/` and `crds/` of commit `ref`, extracted read-only from git (no worktree)."""
    out = Path(tempfile.mkdtemp(prefix="rljob-bench-baseline-"))
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", ref, "operator", "helm", "crds"],
        check=True,
        capture_output=True,
    ).stdout
    tar_path = out / "src.tar"
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(out, filter="data")
    return out


def start_operator(
    cluster: LocalCluster, side: Side, metrics_port: int, *, leader_election: bool
) -> subprocess.Popen[bytes]:
    env = dict(
        os.environ,
        **side.chart_env(),
        KUBECONFIG=str(cluster.kubeconfig),
        RLJOB_METRICS_PORT=str(metrics_port),
        PYTHONPATH=os.pathsep.join([str(side.source), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("RLJOB_POOLS_CONFIGMAP", None)  # the chart's default: no pools
    trace_path(LOG_DIR, side.label).unlink(missing_ok=True)
    env["RLJOB_TRACE_FILE"] = str(trace_path(LOG_DIR, side.label))  # an operator without the trace ignores it
    argv = [sys.executable, "-m", "rljob_operator.cli.commands", "operator", "--namespace", NAMESPACE,
            "--leader-election-namespace", NAMESPACE, "--log-level", "WARNING"]  # fmt: skip
    if not leader_election:
        argv.append("--no-leader-election")
    log = open(LOG_DIR / f"rljob-bench-operator-{side.label.replace(' ', '-')}.log", "w")  # noqa: SIM115
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


# ---- measurements --------------------------------------------------------------------------------
def apiserver_requests(cluster: LocalCluster) -> dict[tuple[str, str], float]:
    """(verb, resource[/status]) -> count, for RLJobs, their children and events (no bindings,
    no pod status writes: those are the scheduler's and the kubelet's)."""
    text = cluster.kubectl("get", "--raw", "/metrics", timeout=60).stdout
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = _METRIC_RE.match(line)
        if not m:
            continue
        labels = {
            k: v.strip('"')
            for k, v in (kv.split("=", 1) for kv in re.findall(r'\w+="[^"]*"', m.group("labels")))
        }
        resource, sub = labels.get("resource", ""), labels.get("subresource", "")
        if resource not in CHILD_RESOURCES | {"events"} or sub not in ("", "status"):
            continue
        if resource == "pods" and sub == "status":
            continue
        key = (labels.get("verb", ""), resource + ("/status" if sub else ""))
        out[key] = out.get(key, 0.0) + float(m.group("value"))
    return out


def operator_requests(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("rljob_operator_api_requests_total{")
    )


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def diff(after: dict[Any, float], before: dict[Any, float]) -> dict[Any, float]:
    out = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return {k: v for k, v in out.items() if v > 0 and k[0] != "WATCH"}


class Watcher:
    """First-seen times of pods and the phase of every RLJob, from watches (never counted: WATCH)."""

    def __init__(self, cluster: LocalCluster) -> None:
        from kubernetes import client

        api = cluster.api_client()
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self.pods: dict[str, float] = {}
        self.bound: dict[str, float] = {}  # pod -> first seen with a node (the scheduler's binding)
        self.phases: dict[str, str] = {}
        self.stop = threading.Event()
        self._ready = [threading.Event(), threading.Event()]

    def start(self) -> None:
        for target, ready in ((self._watch_pods, self._ready[0]), (self._watch_jobs, self._ready[1])):
            threading.Thread(target=target, args=(ready,), daemon=True).start()
        for ready in self._ready:
            ready.wait()

    def _loop(
        self, list_fn: Callable[..., Any], on_object: Callable[[str, Any], None], ready: threading.Event
    ) -> None:
        from kubernetes import watch

        version = None
        while not self.stop.is_set():
            try:
                if version is None:
                    listing = list_fn()
                    for obj in listing["items"] if isinstance(listing, dict) else listing.items:
                        on_object("ADDED", obj)
                    meta = listing["metadata"] if isinstance(listing, dict) else listing.metadata
                    version = meta["resourceVersion"] if isinstance(meta, dict) else meta.resource_version
                    ready.set()
                w = watch.Watch()
                for ev in w.stream(list_fn, resource_version=version, timeout_seconds=30):
                    obj = ev["object"]
                    if ev["type"] == "ERROR":
                        version = None
                        break
                    on_object(ev["type"], obj)
                    meta = obj["metadata"] if isinstance(obj, dict) else obj.metadata
                    version = meta["resourceVersion"] if isinstance(meta, dict) else meta.resource_version
                    if self.stop.is_set():
                        w.stop()
            except Exception:  # an expired or dropped watch: list again
                version = None
                time.sleep(0.2)

    def _watch_pods(self, ready: threading.Event) -> None:
        def on_pod(kind: str, pod: Any) -> None:  # a V1Pod from the list, a dict from the watch
            now = time.monotonic()
            name = pod["metadata"]["name"] if isinstance(pod, dict) else pod.metadata.name
            if kind == "ADDED":
                self.pods.setdefault(name, now)
            node = (pod.get("spec") or {}).get("nodeName") if isinstance(pod, dict) else pod.spec.node_name
            if node and kind != "DELETED":
                self.bound.setdefault(name, now)

        self._loop(lambda **kw: self.core.list_namespaced_pod(NAMESPACE, **kw), on_pod, ready)

    def _watch_jobs(self, ready: threading.Event) -> None:
        def on_job(kind: str, job: dict[str, Any]) -> None:
            name = job["metadata"]["name"]
            if kind == "DELETED":
                self.phases.pop(name, None)
            else:
                self.phases[name] = (job.get("status") or {}).get("phase", "")

        def list_jobs(**kw: Any) -> Any:
            return self.custom.list_namespaced_custom_object(
                "rljob.io", "v1alpha1", NAMESPACE, "rljobs", **kw
            )

        self._loop(list_jobs, on_job, ready)


def bench_cluster() -> LocalCluster:
    return LocalCluster.create(node_monitor_grace_period_s=NODE_GRACE_S, controller_api_qps=CONTROLLER_QPS)


def wait_schedulable(cluster: LocalCluster, count: int, timeout_s: float = 600) -> None:
    """Until `count` nodes are registered and none carries the not-ready taint."""
    from kubernetes import client

    core = client.CoreV1Api(cluster.api_client())

    def schedulable() -> bool:
        nodes = core.list_node().items
        tainted = [n for n in nodes if any(t.key == NOT_READY_TAINT for t in n.spec.taints or [])]
        return len(nodes) >= count and not tainted

    if not wait_until(f"{count} nodes without the {NOT_READY_TAINT} taint", schedulable, timeout_s):
        raise RuntimeError(f"the nodes kept the {NOT_READY_TAINT} taint for {timeout_s:.0f} s")


def wait_until(
    what: str, check: Callable[[], bool], timeout_s: float, proc: subprocess.Popen[bytes] | None = None
) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the operator exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@dataclass
class Result:
    label: str
    settings: dict[str, str]
    latencies: list[float] = field(default_factory=list)
    missing: int = 0
    not_running: int = 0
    submit_s: float = 0.0
    api_per_job: float = 0.0
    events_per_job: float = 0.0
    operator_calls_per_job: float = 0.0
    by_kind: dict[tuple[str, str], float] = field(default_factory=dict)
    idle_cpu_pct: float = 0.0
    idle_rss_mib: float = 0.0
    idle_api_per_s: float = 0.0
    idle_operator_calls_per_s: float = 0.0
    unavailable: str = ""
    breakdown: dict[str, Any] = field(default_factory=dict)


# ---- one side --------------------------------------------------------------------------------------
def run_side(side: Side, args: argparse.Namespace) -> Result:
    result = Result(side.label, side.chart_env())
    if side.kueue and not side.has_admission():
        result.unavailable = "this operator has no Kueue admission step (rljob_operator/decide/admission.py)"
        return result
    from kubernetes import client

    # The fake nodes' heartbeats are one thread's Lease renewals, a round of M every 10 s: on a
    # loaded machine a round of 1000 can outlast the default grace, and nodes tainted unreachable
    # would leave jobs unscheduled. The bench measures the operator, not the fake kubelet.
    with bench_cluster() as cluster:
        cluster.apply_crds(side.crd, timeout_s=120)
        crd_at = time.monotonic()
        cluster.create_namespace(NAMESPACE)
        labels: dict[str, str] = {}
        if side.kueue:
            from testenv import kueue as kueue_env

            try:
                kueue_env.check_mount_namespace()
                kueue_env.start_kueue(cluster)
            except kueue_env.KueueUnavailable as exc:
                result.unavailable = f"Kueue cannot run here: {exc}"
                return result
            n = args.jobs + 1
            queues = kueue_env.queue_manifests(
                namespace=NAMESPACE,
                local_queue=QUEUE,
                quota={"nvidia.com/gpu": str(16 * n), "cpu": str(4 * n), "memory": f"{8 * n}Gi"},
            )
            cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(queues))
            labels = {"kueue.x-k8s.io/queue-name": QUEUE}
        t = time.monotonic()
        # Two more for the warm-up job, so that all N jobs fit on the M nodes.
        cluster.add_nodes(args.nodes + 2, name_prefix="bench", labels={"pool": "bench"})
        wait_schedulable(cluster, args.nodes + 2)
        print(
            f"[{side.label}] registered {args.nodes} fake 8-GPU nodes, schedulable after "
            f"{time.monotonic() - t:.1f}s",
            flush=True,
        )

        proc = start_operator(cluster, side, args.metrics_port, leader_election=args.leader_election)
        custom = client.CustomObjectsApi(cluster.api_client())
        watcher = Watcher(cluster)
        watcher.start()
        try:
            # Warm-up: the operator leads and reconciles when one job has its pods.
            custom.create_namespaced_custom_object(
                "rljob.io", "v1alpha1", NAMESPACE, "rljobs", rljob("warmup", labels)
            )
            if not wait_until(
                "the warm-up job",
                lambda: {"warmup-trainer-0", "warmup-rollout-0"} <= watcher.pods.keys(),
                180,
                proc,
            ):
                raise RuntimeError("the operator did not create the warm-up job's pods in 180 s")
            wait_until("the warm-up job Running", lambda: watcher.phases.get("warmup") == "Running", 60, proc)
            # The garbage collector watches a new CRD's kind only after its next discovery (every
            # 30 s); until then it GETs the RLJob owning each new child, requests the apiserver
            # would count against the operator.
            time.sleep(max(2.0, crd_at + GC_DISCOVERY_S - time.monotonic()))
            api_before = apiserver_requests(cluster)
            op_before = operator_requests(args.metrics_port)
            pool_before = api_pool_timing(args.metrics_port)
            server_before = apiserver_write_latency(cluster, CHILD_RESOURCES)
            cpu_before = cpu_seconds(proc.pid)

            created: dict[str, float] = {}
            t0 = time.monotonic()
            for i in range(args.jobs):
                name = f"job-{i:04d}"
                custom.create_namespaced_custom_object(
                    "rljob.io", "v1alpha1", NAMESPACE, "rljobs", rljob(name, labels)
                )
                created[name] = time.monotonic()
            result.submit_s = time.monotonic() - t0
            want = {f"{n}-{role}-0" for n in created for role in ("trainer", "rollout")}
            wait_until("every pod", lambda: want <= watcher.pods.keys(), args.timeout, proc)
            result.missing = len(want - watcher.pods.keys())
            wait_until(
                "every job Running",
                lambda: all(watcher.phases.get(n) == "Running" for n in created),
                args.timeout,
                proc,
            )
            result.not_running = sum(1 for n in created if watcher.phases.get(n) != "Running")
            time.sleep(5)  # the last status writes and Events settle before counting
            api_after = apiserver_requests(cluster)
            op_after = operator_requests(args.metrics_port)
            pool_after = api_pool_timing(args.metrics_port)
            server_after = apiserver_write_latency(cluster, CHILD_RESOURCES)
            cpu_create_s = cpu_seconds(proc.pid) - cpu_before

            # Idle: every job Running, nothing changing.
            time.sleep(args.settle_seconds)
            idle_api0, idle_op0 = apiserver_requests(cluster), operator_requests(args.metrics_port)
            cpu0, w0 = cpu_seconds(proc.pid), time.monotonic()
            time.sleep(args.idle_seconds)
            cpu1, w1 = cpu_seconds(proc.pid), time.monotonic()
            idle_api1, idle_op1 = apiserver_requests(cluster), operator_requests(args.metrics_port)
            result.idle_rss_mib = rss_mib(proc.pid)
        finally:
            watcher.stop.set()
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    times = {"created": created, "pods": dict(watcher.pods), "bound": dict(watcher.bound)}
    result.breakdown = latency_breakdown(
        read_trace(trace_path(LOG_DIR, side.label)),
        created,
        watcher.pods,
        watcher.bound,
    )
    if result.breakdown:
        result.breakdown["api_pool"] = api_pool_means(pool_before, pool_after)
        result.breakdown["operator_cpu_s_per_job"] = cpu_create_s / args.jobs
        calls = server_after[1] - server_before[1]
        result.breakdown["api_pool"]["server_mean_s"] = (
            (server_after[0] - server_before[0]) / calls if calls > 0 else 0.0
        )
    (LOG_DIR / f"rljob-bench-times-{side.label.replace(' ', '-')}.json").write_text(json.dumps(times))
    result.latencies = [
        max(watcher.pods[f"{n}-trainer-0"], watcher.pods[f"{n}-rollout-0"]) - t
        for n, t in created.items()
        if f"{n}-trainer-0" in watcher.pods and f"{n}-rollout-0" in watcher.pods
    ]
    delta = diff(api_after, api_before)
    delta[("POST", "rljobs")] = delta.get(("POST", "rljobs"), 0.0) - args.jobs  # this client's creates
    result.by_kind = {k: v / args.jobs for k, v in delta.items() if v > 0}
    result.api_per_job = sum(v for k, v in delta.items() if k[1] != "events") / args.jobs
    result.events_per_job = sum(v for k, v in delta.items() if k[1] == "events") / args.jobs
    result.operator_calls_per_job = (op_after - op_before) / args.jobs
    idle = diff(idle_api1, idle_api0)
    result.idle_api_per_s = sum(idle.values()) / (w1 - w0)
    result.idle_operator_calls_per_s = (idle_op1 - idle_op0) / (w1 - w0)
    result.idle_cpu_pct = 100 * (cpu1 - cpu0) / (w1 - w0)
    return result


# ---- --foreign-pods: the idle operator in a cluster full of other pods ------------------------------
FOREIGN_LABELS = {"app": "foreign"}
FOREIGN_THREADS = 16


def foreign_pod(i: int) -> dict[str, Any]:
    """Another tenant's pod in the jobs' namespace: never scheduled (a scheduling gate), so the
    scheduler and the kubelet do nothing for it; only a watch that lists every pod sees it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"foreign-{i:05d}", "labels": dict(FOREIGN_LABELS)},
        "spec": {
            "schedulingGates": [{"name": "bench.rljob.io/never"}],
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 1000,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "c",
                    "image": "registry.local/foreign",
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                }
            ],
        },
    }


def create_foreign_pods(cluster: LocalCluster, count: int) -> float:
    """`count` foreign pods, created in parallel; returns the seconds it took."""
    from concurrent.futures import ThreadPoolExecutor

    from kubernetes import client

    core = client.CoreV1Api(cluster.api_client())
    t0 = time.monotonic()
    with ThreadPoolExecutor(FOREIGN_THREADS) as pool:
        list(pool.map(lambda i: core.create_namespaced_pod(NAMESPACE, foreign_pod(i)), range(count)))
    return time.monotonic() - t0


@dataclass
class IdleResult:
    label: str
    foreign_pods: int
    startup_s: float = 0.0
    idle_cpu_pct: float = 0.0
    idle_rss_mib: float = 0.0
    idle_operator_calls_per_s: float = 0.0
    not_running: int = 0

    def row(self) -> str:
        started = (
            f"{self.startup_s:.1f}" if math.isfinite(self.startup_s) else f"{self.not_running} not Running"
        )
        cells = [
            self.label,
            self.foreign_pods,
            started,
            f"{self.idle_cpu_pct:.2f}",
            f"{self.idle_rss_mib:.0f}",
        ]
        return "| " + " | ".join(map(str, [*cells, f"{self.idle_operator_calls_per_s:.2f}"])) + " |"


def run_idle_side(side: Side, args: argparse.Namespace, foreign: int) -> IdleResult:
    """A fresh cluster with `foreign` other pods in the namespace before the operator starts, then
    `args.jobs` RLJobs Running; the idle operator's CPU and RSS over `args.idle_seconds`."""
    from kubernetes import client

    result = IdleResult(side.label, foreign)
    with bench_cluster() as cluster:
        cluster.apply_crds(side.crd, timeout_s=120)
        cluster.create_namespace(NAMESPACE)
        cluster.add_nodes(2 * args.jobs, name_prefix="bench", labels={"pool": "bench"})  # 2 pods a job
        wait_schedulable(cluster, 2 * args.jobs)
        made_s = create_foreign_pods(cluster, foreign)
        print(f"[{side.label}, {foreign} foreign pods] created them in {made_s:.1f}s", flush=True)
        t0 = time.monotonic()
        proc = start_operator(cluster, side, args.metrics_port, leader_election=args.leader_election)
        custom = client.CustomObjectsApi(cluster.api_client())
        watcher = Watcher(cluster)
        watcher.start()
        try:
            names = [f"job-{i:04d}" for i in range(args.jobs)]
            for name in names:
                custom.create_namespaced_custom_object(
                    "rljob.io", "v1alpha1", NAMESPACE, "rljobs", rljob(name)
                )
            running = lambda: all(watcher.phases.get(n) == "Running" for n in names)  # noqa: E731
            if wait_until("every job Running", running, args.timeout, proc):
                result.startup_s = time.monotonic() - t0
            else:  # measured all the same: what the operator costs while it cannot keep up
                result.startup_s = math.inf
                result.not_running = sum(1 for n in names if watcher.phases.get(n) != "Running")
            time.sleep(args.settle_seconds)
            op0, cpu0, w0 = operator_requests(args.metrics_port), cpu_seconds(proc.pid), time.monotonic()
            time.sleep(args.idle_seconds)
            cpu1, w1, op1 = cpu_seconds(proc.pid), time.monotonic(), operator_requests(args.metrics_port)
            result.idle_rss_mib = rss_mib(proc.pid)
            result.idle_cpu_pct = 100 * (cpu1 - cpu0) / (w1 - w0)
            result.idle_operator_calls_per_s = (op1 - op0) / (w1 - w0)
        finally:
            watcher.stop.set()
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return result


def foreign_pods_main(args: argparse.Namespace, sides: list[Side]) -> int:
    """`--foreign-pods N`: per side, the idle operator with no other pod, then with N; the ratios."""
    results: list[IdleResult] = []
    for side in [s for s in sides if not s.kueue]:
        for foreign in (0, args.foreign_pods):
            results.append(run_idle_side(side, args, foreign))
            print(results[-1].row(), flush=True)  # partial results survive a later failure
    print()
    print(f"{args.jobs} RLJobs Running, idle {args.idle_seconds:.0f} s, the chart's settings")
    print()
    print("| operator | foreign pods | all Running after s | idle CPU % core | idle RSS MiB | idle calls/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(r.row())
    for none, many in zip(results[::2], results[1::2], strict=True):
        cpu = many.idle_cpu_pct / none.idle_cpu_pct if none.idle_cpu_pct else float("nan")
        print(f"{none.label}: {args.foreign_pods} foreign pods / none: idle CPU x{cpu:.2f}, "
              f"RSS x{many.idle_rss_mib / max(none.idle_rss_mib, 1e-9):.2f}")  # fmt: skip
    return 1 if any(r.not_running for r in results) else 0


# ---- report ----------------------------------------------------------------------------------------
def report(results: list[Result], args: argparse.Namespace) -> None:
    print()
    print(
        f"{args.jobs} RLJobs (2 pods of 8 GPUs each) on {args.nodes} fake 8-GPU nodes, the chart's settings"
    )
    print()
    print(
        "| operator | settings | p50 s | p99 s | max s | missing | API req/job | events/job | "
        "operator calls/job | idle CPU % core | idle RSS MiB | idle API req/s | idle operator calls/s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        settings = ", ".join(f"{k}={v}" for k, v in sorted(r.settings.items()))
        if r.unavailable:
            print(f"| {r.label} | {settings} | unavailable: {r.unavailable} |")
            continue
        lat = r.latencies or [float("nan")]
        print(
            f"| {r.label} | {settings} | {statistics.median(lat):.3f} | {percentile(lat, 0.99):.3f} | "
            f"{max(lat):.3f} | {r.missing} | {r.api_per_job:.2f} | {r.events_per_job:.2f} | "
            f"{r.operator_calls_per_job:.2f} | {r.idle_cpu_pct:.1f} | {r.idle_rss_mib:.0f} | "
            f"{r.idle_api_per_s:.2f} | {r.idle_operator_calls_per_s:.2f} |"
        )
    for r in results:
        if r.unavailable:
            continue
        print()
        print(f"{r.label}: API requests per job by verb and kind (submit {r.submit_s:.1f}s, "
              f"{r.not_running} not Running at the end)")  # fmt: skip
        print("| verb | resource | per job |")
        print("|---|---|---:|")
        for (verb, res), v in sorted(r.by_kind.items()):
            print(f"| {verb} | {res} | {v:.2f} |")
    for r in results:
        if r.breakdown:
            print_breakdown(r.label, r.breakdown)
    print()
    print(json.dumps([
        {"operator": r.label, "unavailable": r.unavailable or None, "jobs": args.jobs, "nodes": args.nodes,
         "p50_s": statistics.median(r.latencies) if r.latencies else None,
         "p99_s": percentile(r.latencies, 0.99) if r.latencies else None,
         "max_s": max(r.latencies) if r.latencies else None, "api_per_job": r.api_per_job,
         "idle_cpu_pct": r.idle_cpu_pct, "idle_rss_mib": r.idle_rss_mib, "idle_api_per_s": r.idle_api_per_s,
         "breakdown": r.breakdown or None}
        for r in results
    ]))  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--quick", action="store_true", help="a small run: 20 jobs on 40 nodes, 20 s idle")
    ap.add_argument("--baseline", metavar="REF", help="also measure the operator of git commit REF (first)")
    ap.add_argument(
        "--kueue",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure with Kueue admission",
    )
    ap.add_argument(
        "--leader-election",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="as the chart runs it (default); off where a loaded machine makes the Lease renewal miss "
        "its 10 s deadline, so the operator exits (3) mid-run",
    )
    ap.add_argument("--idle-seconds", type=float, default=60)
    ap.add_argument("--settle-seconds", type=float, default=10, help="wait after all Running before idling")
    ap.add_argument("--metrics-port", type=int, default=18080)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument(
        "--foreign-pods",
        type=int,
        default=0,
        metavar="N",
        help="instead: the idle operator (--jobs jobs) with no other pod, then with N other pods",
    )
    args = ap.parse_args()
    # SIGTERM (a timeout) unwinds like Ctrl-C: the control planes and the operator are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.jobs, args.nodes, args.idle_seconds = 20, 40, 20

    here = Side("this tree", REPO / "operator", REPO / "helm" / "rljob" / "values.yaml", REPO / CRD)
    sides = [here]
    if args.kueue:
        sides.append(dataclasses.replace(here, label="this tree + Kueue", kueue=True))
    if args.baseline:  # last: this tree's figures come first if the run is cut short
        base = extract_baseline(args.baseline)
        sides.append(
            Side(args.baseline, base / "operator", base / "helm" / "rljob" / "values.yaml", base / CRD)
        )
    if args.foreign_pods:
        return foreign_pods_main(args, sides)
    results = []
    for side in sides:
        results.append(run_side(side, args))
        report(results, args)  # partial results survive a later failure
    return 1 if any(r.missing or r.not_running for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())

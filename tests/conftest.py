"""Shared pytest fixtures: the real local control plane and namespaces on it.

`cluster` (session scope) starts etcd, kube-apiserver, kube-controller-manager and kube-scheduler
built from the Kubernetes Go modules (see `tests/testenv/`), on free loopback ports in a private
temporary folder, and always tears them down. Each xdist worker or parallel run gets its own.
`kueue` (session scope) adds the real Kueue manager to that cluster.
When a test that used the cluster fails, the components' log tails are attached to its report.
Each xdist worker starts on its share of the slowest modules (`pytest_collection_modifyitems`),
so that with xdist's work stealing (`scripts/test.sh`) no worker starts a five-minute job run while
the other has nothing left to do.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from testenv import kueue as kueue_env
from testenv.cluster import LocalCluster


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    if os.environ.get("RLJOB_SKIP_CLUSTER") == "1":
        pytest.skip("RLJOB_SKIP_CLUSTER=1")
    local = LocalCluster.create()
    with local:
        yield local


@pytest.fixture(scope="module")
def local_accelerator_nodes(cluster: LocalCluster) -> Iterator[list[str]]:
    """gpu-local-0/1 (4 nvidia.com/gpu each) and npu-local-0 (4 huawei.com/Ascend910): local-exec
    nodes whose pods run here with Ray seeing exactly their accelerators (testenv.cluster).
    Removed after the module, so other tests' GPU pods keep landing on nodes that run nothing."""
    names = cluster.add_local_accelerator_nodes()
    yield names
    cluster.delete_nodes(names)


@pytest.fixture(scope="session")
def kueue(cluster: LocalCluster) -> kueue_env.Kueue:
    """The real Kueue manager (built from sigs.k8s.io/kueue, see testenv.kueue) on the session's
    cluster: started on first use, stopped with the cluster."""
    try:
        kueue_env.check_mount_namespace()
    except kueue_env.KueueUnavailable as exc:
        pytest.skip(str(exc))
    return kueue_env.start_kueue(cluster)


@pytest.fixture
def namespace(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace (with its default ServiceAccount ready), deleted after the test."""
    base = "".join(ch if ch.isalnum() else "-" for ch in request.node.name.lower())[:40].strip("-")
    name = f"{base}-{uuid.uuid4().hex[:6]}"
    cluster.create_namespace(name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report: pytest.TestReport = yield
    if report.failed and "cluster" in getattr(item, "fixturenames", ()):
        local = item.funcargs.get("cluster") if hasattr(item, "funcargs") else None
        if isinstance(local, LocalCluster):
            report.sections.append(("control plane logs", local.logs()))
    return report


# Seconds each module took in `make test` on 2 cores shared with other runs (2026-12-02, load
# average about 8): only the order of the run depends on them (a module missing here is estimated
# from its markers), never a result.
MODULE_S: dict[str, float] = {
    "tests/e2e/test_accelerator_jobs.py": 505,
    "tests/e2e/test_adaptive_elastic.py": 500,
    "tests/integration/test_trainer_learning.py": 345,
    "tests/integration/test_trainer_pipeline.py": 230,
    "tests/integration/test_kueue_preemption.py": 230,
    "tests/e2e/test_tiny_cpu_job.py": 125,
    "tests/integration/test_weight_transfer_failure.py": 120,
    "tests/integration/test_operator.py": 110,
    "tests/integration/test_operator_causes.py": 100,
    "tests/integration/test_weight_sync_processes.py": 75,
    "tests/integration/test_kueue_admission.py": 75,
    "tests/integration/test_gang_scheduling.py": 75,
    "tests/integration/test_kueue.py": 65,
    "tests/integration/test_ray_placement.py": 60,
    "tests/integration/test_leader_election.py": 45,
    "tests/integration/test_ray_auth.py": 40,
    "tests/integration/test_helm_chart.py": 40,
    "tests/integration/test_trackers.py": 35,
    "tests/integration/test_trainer_export.py": 25,
    "tests/unit/test_api.py": 25,
}


def _estimate_s(item: pytest.Item) -> float:
    """A test's seconds, for a module not in MODULE_S: a job run, another slow test, a cluster test."""
    if item.get_closest_marker("slow") is not None:
        return 120.0 if item.get_closest_marker("e2e") is not None else 20.0
    return 3.0 if item.get_closest_marker("cluster") is not None else 0.2


def _worksteal_shares(count: int, workers: int) -> list[int]:
    """How many tests xdist's worksteal scheduler first sends each worker: the queue in contiguous
    runs, `len(pending) // workers_left` each (xdist/scheduler/worksteal.py, check_schedule)."""
    shares = []
    for left in range(workers, 0, -1):
        shares.append(count // left)
        count -= shares[-1]
    return shares


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the run so that every xdist worker starts on its share of the slow modules.

    Worksteal first hands worker i the i-th contiguous run of the queue and later lets an idle
    worker take the back half of another's queue. So the modules are dealt longest first to the
    worker with the least expected time (each module's tests kept together and in order, so its
    module-scoped fixtures are set up once); each run is that worker's slow modules, longest
    first, then fast tests up to its share (the modules that start Kueue count as one, so one
    worker starts it). A worker never sits idle while the other still starts
    a job run of minutes, and stealing evens out the tail. Every worker collects the same order.
    """
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    cost = {m: MODULE_S.get(m, sum(_estimate_s(i) for i in tests)) for m, tests in modules.items()}
    # The modules that start Kueue (half a minute on each worker's cluster) go to one worker.
    uses_kueue = [m for m, tests in modules.items() if any("kueue" in i.fixturenames for i in tests)]
    if len(uses_kueue) > 1:
        modules["kueue"] = [i for m in uses_kueue for i in modules.pop(m)]
        cost["kueue"] = sum(cost.pop(m) for m in uses_kueue)
    slow = sorted((m for m in modules if cost[m] >= 10.0), key=lambda m: -cost[m])
    fast = [i for m, tests in modules.items() if cost[m] < 10.0 for i in tests]
    shares = _worksteal_shares(len(items), workers)
    runs: list[list[pytest.Item]] = [[] for _ in shares]
    load = [0.0 for _ in shares]
    for m in slow:
        fits = [w for w in range(workers) if len(runs[w]) + len(modules[m]) <= shares[w]] or [0]
        w = min(fits, key=lambda w: load[w])
        runs[w].extend(modules[m])
        load[w] += cost[m]
    for run, share in zip(runs, shares, strict=True):
        take = max(0, share - len(run))
        run.extend(fast[:take])
        del fast[:take]
    items[:] = [i for run in runs for i in run] + fast

"""Shared pytest fixtures: the real local control plane and namespaces on it.

`cluster` (session scope) starts etcd, kube-apiserver, kube-controller-manager and kube-scheduler
built from the Kubernetes Go modules (see `tests/testenv/`), on free loopback ports in a private
temporary folder, and always tears them down. Each xdist worker or parallel run gets its own.
`kueue` (session scope) adds the real Kueue manager to that cluster.
When a test that used the cluster fails, the components' log tails are attached to its report.
The slowest modules run first (`pytest_collection_modifyitems`), so that with xdist's work
stealing (`scripts/test.sh`) no worker starts a five-minute job run while the other has nothing
left to do.
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


def _module_rank(item: pytest.Item) -> int:
    """0: end-to-end job runs (minutes each), 1: other slow tests, 2: the rest."""
    if item.get_closest_marker("e2e") is not None:
        return 0
    return 1 if item.get_closest_marker("slow") is not None else 2


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules whose tests are slowest first, each module's tests kept together and in order (so
    module-scoped fixtures are set up once per worker); a stable sort, so the rest keep theirs."""
    rank: dict[str, int] = {}
    for item in items:
        rank[item.nodeid.split("::")[0]] = min(rank.get(item.nodeid.split("::")[0], 2), _module_rank(item))
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])

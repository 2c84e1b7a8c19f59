"""Fixtures of the operator tests on the real control plane (test_operator*.py).

`crd` installs the generated CRD once per module; `pool` adds fake GPU nodes under a fresh pool
label (removed after the test); `kubeconfig_env` points the in-process operator at the cluster;
`operator_identity` runs it as a ServiceAccount bound to the operator ClusterRole instead of admin.
`ray_node` starts one private Ray node for a trainer module that runs the driver on real Ray.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "rljobs.rljob.io.yaml"


@pytest.fixture(scope="module")
def crd(cluster: Any) -> None:
    cluster.apply_crds(str(CRD))


@pytest.fixture
def kubeconfig_env(cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))


@pytest.fixture
def pool(cluster: Any) -> Callable[..., str]:
    """Add fake GPU nodes labelled with a fresh pool name; returns the label value."""
    added: list[str] = []

    def make(count: int, per_node: int = 8, resource: str = "nvidia.com/gpu") -> str:
        name = f"p{uuid.uuid4().hex[:6]}"
        added.extend(
            cluster.add_nodes(
                count, name_prefix=name, resource=resource, per_node=per_node, labels={"pool": name}
            )
        )
        return name

    yield make
    cluster.delete_nodes(added)


@pytest.fixture
def operator_identity(cluster: Any, namespace: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run the operator as a ServiceAccount bound to the operator ClusterRole (builders.rbac), not admin."""
    from rljob_operator.builders import rbac

    name = f"rljob-operator-{namespace}"[:63]
    cluster.kubectl("create", "serviceaccount", "rljob-operator", "-n", namespace)
    role = rbac.build_operator_cluster_role(name)
    binding = rbac.build_operator_cluster_role_binding(name, "rljob-operator", namespace, role=name)
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([role, binding]))
    token = cluster.kubectl(
        "create", "token", "rljob-operator", "-n", namespace, "--duration=1h"
    ).stdout.strip()
    monkeypatch.setenv("KUBECONFIG", str(cluster.token_kubeconfig(token, name)))
    yield name
    cluster.kubectl("delete", "clusterrolebinding,clusterrole", name, check=False)


@pytest.fixture(scope="module")
def ray_node(request: pytest.FixtureRequest) -> Iterator[None]:
    """One private Ray node for the module (starting one is the slow, load-sensitive part), started
    as `python -m rljob_trainer` starts it without a cluster, for the module's `ray_node_config()`
    (the markers of its rollout pods included). The module's host classes ship by value: the actor
    processes need not import the tests."""
    ray = pytest.importorskip("ray")
    from rljob_trainer import __main__ as entry

    ray.cloudpickle.register_pickle_by_value(request.module)
    cfg = request.module.ray_node_config()
    for attempt in range(3):  # a loaded 2-core machine can miss Ray's fixed 30 s raylet start wait
        try:
            entry._start_ray_driver(cfg, {}, cfg.rollout.max_dedicated_engines)
            break
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
    yield
    ray.shutdown()

"""Placement on a real multi-node Ray cluster: every rank and engine sits where the plan says.

Each Ray node stands for one pod and advertises exactly what `ray start` in that pod advertises
(`rljob_trainer.__main__.ray_resource_args`: the pod's GPUs or NPUs and its marker resource), as on
a GPU/NPU cluster. The driver's `RayRuntime` creates the flagship-shaped set of actors (trainer pods
with 4 and 1 accelerators, a shared engine on every trainer accelerator, 2 dedicated engines), and
the test reads Ray's own record of each actor's node and accelerator ids (`Host.where`). With the
old placement (ranks and engines each asking for whole GPUs with no placement group) the shared
engines cannot be placed at all.

The actors are light probes with `Host`'s constructor and `where` (`RayRuntime(host_cls=...)`):
placement is decided by the runtime's options and placement groups, not by what the actor builds,
and 12 actors that each import torch would not fit this test's budget on 2 cores. The end-to-end
tests (tests/e2e/test_accelerator_jobs.py) run the real ranks and engines placed the same way.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from trainer_configs import toy_config

from rljob_trainer import __main__ as entry
from rljob_trainer import runtimes

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.ray]


class Probe:
    """Stands in for `runtimes.Host` in an actor: same constructor, same `where`, builds nothing."""

    def __init__(self, kind: str, cfg: Any, **kwargs: Any) -> None:
        del cfg, kwargs
        self.kind = kind

    where = staticmethod(runtimes.Host.where)


def _node_args(role: str, index: int, accelerators: int, ray_accelerator: str) -> dict[str, Any]:
    """`ray.cluster_utils.Cluster.add_node` arguments equal to what the pod's `ray start` advertises."""
    env = {"RLJOB_NUM_ACCELERATORS": str(accelerators), "RLJOB_RAY_ACCELERATOR": ray_accelerator}
    args = dict(a.split("=", 1) for a in entry.ray_resource_args(env, role, index))
    return {
        "num_cpus": 1,
        "num_gpus": int(args["--num-gpus"]),
        "resources": json.loads(args["--resources"]),
    }


@pytest.fixture
def ray_cluster(request: pytest.FixtureRequest) -> Any:
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    ray_accelerator = request.param
    pods = [("trainer", 0, 4), ("trainer", 1, 1), ("rollout", 0, 1), ("rollout", 1, 1)]
    cluster = Cluster(initialize_head=True, head_node_args=_node_args(*pods[0], ray_accelerator))
    for role, index, n in pods[1:]:
        cluster.add_node(**_node_args(role, index, n, ray_accelerator))
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    # Ship the probe class by value: the workers need not import this test module.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield ray_accelerator
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.parametrize("ray_cluster", ["GPU", "NPU"], indirect=True)
def test_flagship_placement_from_rays_own_actor_records(ray_cluster: str):
    import ray

    accelerator = ray_cluster
    cfg = toy_config(
        rollout={"sharedEngines": 5, "dedicatedEngines": 2, "engineNumCpus": 0.1},
        distributed={
            "numTrainerRanks": 5,
            "trainerPodRanks": [4, 1],
            "accelerator": accelerator,
            "rankNumCpus": 0.1,
        },
    )
    rt = runtimes.RayRuntime(cfg, timeout_s=120, host_cls=Probe)
    ranks = rt.create_ranks(5)
    shared = [rt.create_engine(f"shared-{k}", colocated=True, pod_index=None) for k in range(5)]
    dedicated = [rt.create_engine(f"dedicated-{j}", colocated=False, pod_index=j) for j in range(2)]
    where = ray.get([rt.where(h) for h in [*ranks, *shared, *dedicated]], timeout=240)
    pods = rt.node_pods()
    ids = [w["accelerator_ids"].get(accelerator, []) for w in where]
    placed = [",".join(pods[w["node_id"]]) for w in where]
    assert placed == [
        "trainer-0",
        "trainer-0",
        "trainer-0",
        "trainer-0",
        "trainer-1",  # ranks
        "trainer-0",
        "trainer-0",
        "trainer-0",
        "trainer-0",
        "trainer-1",  # shared engines
        "rollout-0",
        "rollout-1",  # dedicated engines
    ], where
    rank_ids, shared_ids, dedicated_ids = ids[:5], ids[5:10], ids[10:]
    # Every rank holds one accelerator of its own; each shared engine sits on its rank's accelerator.
    assert all(len(i) == 1 for i in rank_ids) and len({tuple(i) for i in rank_ids[:4]}) == 4
    assert shared_ids == rank_ids
    assert all(len(i) == 1 for i in dedicated_ids)
    # Ascend: Ray's NPU resource, never GPU.
    other = "GPU" if accelerator == "NPU" else "NPU"
    assert not any(w["accelerator_ids"].get(other) for w in where)
    # Ranks and shared engines run inside their trainer pod's placement group.
    groups = [w["placement_group"] for w in where]
    assert len(set(groups[:4])) == 1 and groups[4] != groups[0] and groups[5:10] == groups[:5]
    assert groups[10:] == [None, None]
    rt.shutdown()

"""Unit tests for rljob_trainer.placement: placement groups per trainer pod, colocated shares, NPU."""

from __future__ import annotations

import pytest

from rljob_trainer import placement


def test_flagship_shape_places_every_shared_engine_on_a_rank_accelerator():
    # examples/qwen3.5-4b-gsm8k-adaptive.yaml's plan on 4-GPU nodes: trainer pods [4, 1], 5 shared.
    plan = placement.plan_placement(
        [4, 1], accelerator="GPU", shared_engines=5, rank_num_cpus=0.1, engine_num_cpus=0.1
    )
    assert [len(b) for b in plan.pod_bundles] == [4, 1]
    assert all(b["GPU"] == 1.0 and b["rljob_trainer_0"] == 1.0 for b in plan.pod_bundles[0])
    assert plan.pod_bundles[1][0]["rljob_trainer_1"] == 1.0
    assert [(s.pod, s.bundles) for s in plan.ranks] == [
        ("trainer-0", (0,)),
        ("trainer-0", (1,)),
        ("trainer-0", (2,)),
        ("trainer-0", (3,)),
        ("trainer-1", (0,)),
    ]
    assert [(s.pod, s.bundles) for s in plan.shared_engines] == [(r.pod, r.bundles) for r in plan.ranks]
    # A rank and its engine split the bundle's one GPU; together they never exceed it.
    for rank, engine in zip(plan.ranks, plan.shared_engines, strict=True):
        assert rank.accelerators + engine.accelerators == 1.0
        assert plan.num_gpus(rank.accelerators) == 0.5 and plan.resources(rank.accelerators) == {}
    dedicated = plan.dedicated_engine(1)
    assert dedicated.pod == "rollout-1" and plan.num_gpus(dedicated.accelerators) == 1.0


def test_ranks_alone_hold_whole_accelerators():
    plan = placement.plan_placement([2], accelerator="GPU", shared_engines=0)
    assert [plan.num_gpus(s.accelerators) for s in plan.ranks] == [1.0, 1.0]
    assert all(b["CPU"] == 1.0 for b in plan.pod_bundles[0])


def test_ascend_asks_ray_for_npus_not_gpus():
    plan = placement.plan_placement([4], accelerator="NPU", shared_engines=4, tensor_parallel=1)
    assert all("NPU" in b and "GPU" not in b for b in plan.pod_bundles[0])
    for slot in (*plan.ranks, *plan.shared_engines):
        assert plan.num_gpus(slot.accelerators) == 0.0
        assert plan.resources(slot.accelerators) == {"NPU": 0.5}
    assert plan.resources(plan.dedicated_engine(0).accelerators) == {"NPU": 1.0}


def test_tensor_parallel_shared_engine_spans_bundles_of_one_pod():
    plan = placement.plan_placement([4, 3], accelerator="GPU", shared_engines=3, tensor_parallel=2)
    assert [(s.pod, s.bundles) for s in plan.shared_engines] == [
        ("trainer-0", (0, 1)),
        ("trainer-0", (2, 3)),
        ("trainer-1", (0, 1)),
    ]
    # vLLM's TP workers hold the shares; the engine's driver process holds none.
    assert all(s.accelerators == 0.0 and s.worker_share == 0.5 for s in plan.shared_engines)
    # The third bundle of pod 1 has no engine: its rank holds the whole GPU.
    assert plan.ranks[-1].accelerators == 1.0
    with pytest.raises(ValueError, match="do not fit"):
        placement.plan_placement([4, 3], accelerator="GPU", shared_engines=4, tensor_parallel=2)


def test_cpu_jobs_pin_bundles_to_pods_without_accelerators():
    plan = placement.plan_placement([1, 1], accelerator=None, shared_engines=1)
    assert plan.pod_bundles == (
        ({"CPU": 2.0, "rljob_trainer_0": 1.0},),
        ({"CPU": 1.0, "rljob_trainer_1": 1.0},),
    )
    assert all(s.accelerators == 0.0 for s in (*plan.ranks, *plan.shared_engines))
    with pytest.raises(ValueError, match="GPU, NPU"):
        placement.plan_placement([1], accelerator="TPU", shared_engines=0)


def test_a_node_stands_for_the_pods_whose_markers_it_advertises():
    from rljob_trainer import runtimes

    assert runtimes.pods_of_node({"CPU": 8, "GPU": 4, "rljob_trainer_1": 4}) == ("trainer-1",)
    # a private local instance stands for every pod at once
    assert runtimes.pods_of_node({"rljob_trainer_0": 2, "rljob_rollout_0": 1, "rljob_rollout_x": 1}) == (
        "rollout-0",
        "trainer-0",
    )

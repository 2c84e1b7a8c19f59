"""Unit tests for the trainer's pure runtime helpers: pod commands, status targets, sharding, checkpoints."""

from __future__ import annotations

import json

import pytest

from rljob_trainer.__main__ import ray_head_command, ray_worker_command
from rljob_trainer.outputs import telemetry_sink


def test_ray_worker_commands_from_pod_env():
    env = {"RLJOB_RAY_HEAD": "job-trainer-0.job.ns.svc", "RLJOB_RAY_PORT": "6379"}
    assert ray_worker_command(env, "trainer", 1) == [
        "ray",
        "start",
        "--address=job-trainer-0.job.ns.svc:6379",
        "--num-gpus=0",
        '--resources={"rljob_trainer_1": 1}',
        "--block",
    ]
    cmd = ray_worker_command(env, "rollout", 3)
    assert json.loads(cmd[-2].split("=", 1)[1]) == {"rljob_rollout_3": 1}
    with pytest.raises(ValueError, match="RLJOB_RAY_HEAD"):
        ray_worker_command({}, "rollout", 0)


def test_ray_start_advertises_exactly_the_pods_accelerators():
    gpu = {"RLJOB_RAY_HEAD": "h", "RLJOB_NUM_ACCELERATORS": "4", "RLJOB_RAY_ACCELERATOR": "GPU"}
    cmd = ray_worker_command(gpu, "trainer", 1)
    # Explicit, never auto-detected: 4 GPUs, and one trainer-1 marker per bundle of its placement group.
    assert "--num-gpus=4" in cmd and json.loads(cmd[-2].split("=", 1)[1]) == {"rljob_trainer_1": 4}
    npu = {**gpu, "RLJOB_RAY_ACCELERATOR": "NPU", "RLJOB_NUM_ACCELERATORS": "2"}
    cmd = ray_worker_command(npu, "rollout", 0)
    assert "--num-gpus=0" in cmd  # Ascend devices are Ray's NPU resource, never GPUs
    assert json.loads(cmd[-2].split("=", 1)[1]) == {"NPU": 2, "rljob_rollout_0": 1}
    head = ray_head_command(gpu)
    assert head[:4] == ["python", "-m", "rljob_trainer.ray_head", "--head"]
    assert json.loads(head[-1].split("=", 1)[1]) == {"rljob_trainer_0": 4}
    # The dashboard (and its job-submission API) on loopback only; no Ray client server flag.
    assert "--dashboard-host=127.0.0.1" in head and not any("0.0.0.0" in a or "client" in a for a in head)
    with pytest.raises(ValueError, match="GPU, NPU"):
        ray_worker_command({**gpu, "RLJOB_RAY_ACCELERATOR": "TPU"}, "trainer", 1)


def test_parse_targets_from_rljob_status():
    obj = {"status": {"rollout": {"desiredSharedAwake": 1, "desiredDedicatedEngines": 3}}}
    assert telemetry_sink.parse_targets(obj) == telemetry_sink.EngineTargets(1, 3)
    assert telemetry_sink.parse_targets({}) == telemetry_sink.EngineTargets(None, None)


def test_a_draining_rollout_pod_lowers_the_dedicated_target_below_it():
    """Kueue evicted engine 1's Workload: the operator drains pod 1 (and keeps desired at 3 so the
    engine queues again); the driver must release engines 1 and 2 as for a lowered target."""
    since = "2026-12-01T10:00:00Z"
    rollout = {"desiredSharedAwake": 1, "desiredDedicatedEngines": 3}
    draining = {**rollout, "drainingPods": [{"index": 2, "since": since}, {"index": 1, "since": since}]}
    assert telemetry_sink.parse_targets({"status": {"rollout": draining}}).desired_dedicated_engines == 1
    assert telemetry_sink.parse_targets({"status": {"rollout": rollout}}).desired_dedicated_engines == 3
    # A drain above the desired count (an ordinary scale-down) changes nothing.
    lowered = {**rollout, "desiredDedicatedEngines": 1, "drainingPods": [{"index": 1, "since": since}]}
    assert telemetry_sink.parse_targets({"status": {"rollout": lowered}}).desired_dedicated_engines == 1
    assert telemetry_sink.prometheus_name("dp_balance/plan_ms") == "rljob_dp_balance_plan_ms"


@pytest.mark.torch
def test_sharding_and_seeds():
    from rljob_trainer import config, driver
    from rljob_trainer.train import trainer

    spec = trainer.micro_batch_spec(config.BatchingSettings(packed=True, dynamic=True))
    lengths = [100, 5, 90, 6, 80, 7, 70, 8]
    shards, metrics = driver.shard_for_ranks(lengths, 2, spec=spec, cost=None, enabled=True)
    assert sorted(i for s in shards for i in s) == list(range(8)) and [len(s) for s in shards] == [4, 4]
    assert "dp_balance/strategy_name" in metrics
    shards, metrics = driver.shard_for_ranks(lengths[:7], 2, spec=spec, cost=None, enabled=True)
    assert shards == [[0, 1, 2, 3], [4, 5, 6]] and metrics == {}
    assert driver.sample_seed(1, 2, 3) == driver.sample_seed(1, 2, 3) != driver.sample_seed(1, 3, 3)
    assert driver.split_mini_batches(6, 2) == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.torch
def test_checkpoints_are_atomic_and_pruned(tmp_path):
    from rljob_trainer.outputs import checkpoint

    (tmp_path / ".tmp-step-00000009-x").mkdir()  # a save killed before its rename
    for step in (3, 6, 9):
        checkpoint.save_checkpoint(tmp_path, step, {"w": step}, {"sampler": {}}, keep_last=2)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [6, 9]
    state, meta = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(tmp_path))
    assert state == {"w": 9} and meta["step"] == 9


def test_prometheus_endpoint_serves_the_step_metrics():
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sink = telemetry_sink.TelemetrySink(
        enabled=False, job_name=None, namespace=None, configmap_name=None, prometheus_port=port
    )
    sink.publish([], {"step": 3, "mean_reward": 0.25, "dp_balance/imbalance_after": 1.01, "note": "text"})
    sink.publish([], {"step": 4, "mean_reward": 0.5})
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {
        line.split()[0]: float(line.split()[1]) for line in body.splitlines() if line.startswith("rljob_")
    }
    assert values["rljob_step"] == 4.0 and values["rljob_mean_reward"] == 0.5
    assert values["rljob_dp_balance_imbalance_after"] == pytest.approx(1.01)
    assert not any("note" in name for name in values), "non-numeric metrics are not exported"


def test_rollout_pods_are_those_of_live_ray_nodes_only():
    from rljob_trainer import runtimes

    class Nodes:  # the shape of ray.nodes(): a dead node stays listed, with Alive false
        @staticmethod
        def nodes():
            return [
                {"NodeID": "a", "Alive": True, "Resources": {"rljob_trainer_0": 2, "CPU": 4}},
                {"NodeID": "b", "Alive": True, "Resources": {"rljob_rollout_0": 1}},
                {"NodeID": "c", "Alive": False, "Resources": {"rljob_rollout_1": 1}},
                {"NodeID": "d", "Alive": True, "Resources": {"rljob_rollout_2": 1, "rljob_rollout_x": 1}},
            ]

    rt = object.__new__(runtimes.RayRuntime)
    rt._ray = Nodes()
    assert rt.rollout_pods() == [0, 2]
    assert rt.node_pods() == {"a": ("trainer-0",), "b": ("rollout-0",), "d": ("rollout-2",)}

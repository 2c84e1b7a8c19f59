"""The driver follows the operator's engine targets (status.rollout) at sync points (in-process runtime)."""

from __future__ import annotations

import pytest
from trainer_configs import toy_config

from rljob_trainer import driver
from rljob_trainer.outputs import checkpoint, telemetry_sink

pytestmark = [pytest.mark.torch]


def test_driver_adds_drops_and_wakes_engines_to_match_targets():
    cfg = toy_config(
        grpo={"maxSteps": 3, "promptsPerStep": 4},
        rollout={"sharedEngines": 1, "dedicatedEngines": 1, "maxDedicatedEngines": 3},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
    )
    d = driver.GRPODriver(cfg, driver.LocalRuntime(cfg))
    d.setup()
    assert sorted(d.engines) == ["dedicated-0", "shared-0"]
    m = d.step()
    assert m["engine_seconds"] > 0 and d.state.history[-1].dedicated_engines == 1
    d.apply_targets(telemetry_sink.EngineTargets(desired_shared_awake=1, desired_dedicated_engines=5))
    assert sorted(d.engines) == ["dedicated-0", "dedicated-1", "dedicated-2", "shared-0"]  # capped at 3
    assert d.engines["dedicated-2"].handle.obj.weights_version == 1  # new engines get current weights
    d.step()
    assert d.state.history[-1].shared_engines_awake == 1
    assert d.engines["shared-0"].handle.obj.is_sleeping  # asleep again after generating
    d.apply_targets(telemetry_sink.EngineTargets(desired_shared_awake=0, desired_dedicated_engines=0))
    assert sorted(d.engines) == ["shared-0"]
    m = d.step()  # with no dedicated engine the shared one generates
    assert m["step"] == 3 and m["engine_seconds"] > 0


def test_driver_checkpoints_at_once_on_request_and_acknowledges_it_once(tmp_path):
    """Cooperative preemption: the request in the RLJob status makes the driver save a checkpoint at
    this sync point (no periodic one is due) and acknowledge it, step included, in its newest report;
    a resumed driver starts at that step."""
    cfg = toy_config(
        grpo={"maxSteps": 10, "promptsPerStep": 4},
        rollout={"sharedEngines": 1, "dedicatedEngines": 0},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
        checkpoint={"dir": str(tmp_path), "intervalSteps": 100},
    )
    d = driver.GRPODriver(cfg, driver.LocalRuntime(cfg))
    d.setup()
    d.step()
    d.step()
    assert checkpoint.list_checkpoints(tmp_path) == []
    request = telemetry_sink.CheckpointRequest(id="evict-1", reason="Preempted")
    d.apply_targets(telemetry_sink.EngineTargets(None, None, request))
    assert [step for step, _ in checkpoint.list_checkpoints(tmp_path)] == [2]
    last = d.state.history[-1]
    assert (last.step, last.checkpoint_ack, last.checkpoint_ack_step) == (2, "evict-1", 2)
    d.step()
    d.apply_targets(telemetry_sink.EngineTargets(None, None, request))  # the same request: no new save
    assert d.state.history[-1].checkpoint_ack is None
    assert [step for step, _ in checkpoint.list_checkpoints(tmp_path)] == [2]
    d.shutdown()

    resumed = driver.GRPODriver(cfg, driver.LocalRuntime(cfg))
    resumed.setup()
    assert resumed.state.step == 2
    resumed.shutdown()


def test_local_runtime_with_max_staleness_stays_correct_without_overlap():
    # In-process calls finish when submitted, so nothing overlaps; the pipeline must still train every
    # step on rollouts within the bound and report a trainer wait no longer than the interval.
    cfg = toy_config(
        grpo={
            "maxSteps": 4,
            "promptsPerStep": 4,
            "maxStaleness": 1,
            "policyLoss": "clipped-tis",
            "tisCap": 2.0,
        },
        rollout={"sharedEngines": 0, "dedicatedEngines": 1},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
    )
    d = driver.GRPODriver(cfg, driver.LocalRuntime(cfg))
    rows = d.run()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["rollout/staleness_max"] <= 1 and r["rollout/regenerated_stale"] == 0 for r in rows)
    assert d.lookahead == 1 and d.engines["dedicated-0"].version == 4
    for report in d.state.history:
        assert 0 < report.trainer_wait_s <= report.interval_s
        assert report.generation_s > 0

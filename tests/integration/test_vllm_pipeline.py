"""The driver with real vLLM engines (vLLM's CPU build) as Ray actors on a private local Ray node, as
`python -m rljob_trainer` runs without a cluster: two dedicated engines behind the dispatcher, a
shared engine that sleeps by stopping (this platform has no sleep mode) and is woken on demand, and
engines whose EngineCore process is killed mid-run.

- Both dedicated engines serve the step's requests, with the trainer's weights of each sync.
- A dedicated engine whose EngineCore dies mid-generate names the failure (`EngineDiedError`, a lost
  engine to the runtime): it is dropped, its requests requeued, its pod reported lost once, a new
  engine joins on the pod with the current weights, and training goes on.
- A shared engine woken by the operator's target is started again (a wake by restart), which the
  SyncReport measures (sharedWakeS, sharedWakeRestarted) beside what the platform said it can do.
- A shared engine whose EngineCore dies is started again on its trainer pod, asleep, and woken with
  the current weights when it serves next.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from trainer_configs import vllm_config

pytest.importorskip("vllm")

from rljob_trainer import driver, runtimes
from rljob_trainer.outputs import telemetry_sink

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]


def _cfg() -> Any:
    return vllm_config(
        grpo={
            "maxSteps": 30,
            "promptsPerStep": 4,
            "maxStaleness": 1,
            "policyLoss": "clipped-tis",
            "tisCap": 2.0,
        },
        lengths={"maxPromptTokens": 8, "maxResponseTokens": 1},
        rollout={
            "sharedEngines": 1,
            "dedicatedEngines": 2,
            "maxDedicatedEngines": 2,
            "enableSleepMode": True,
            "engineNumCpus": 0.25,
        },
        distributed={"numTrainerRanks": 1, "launcher": "ray", "rankNumCpus": 0.25},
    )


def ray_node_config() -> Any:
    """The private Ray node (`ray_node`, tests/integration/conftest.py): two rollout pods' markers."""
    return _cfg()


@pytest.fixture
def vllm_driver(ray_node: None) -> Iterator[driver.GRPODriver]:
    import ray

    cfg = _cfg()
    d = driver.GRPODriver(cfg, runtimes.RayRuntime(cfg))
    try:
        d.setup()
        yield d
    finally:
        d.shutdown()
        for eng in d.engines.values():
            ray.kill(eng.handle)
        for rank in d.ranks:
            ray.kill(rank)


def _kill_engine_core(d: driver.GRPODriver, name: str) -> int:
    """SIGKILL the EngineCore process of engine `name` (a child of its Ray actor), as vLLM's own
    process manager names it (not by its process title: a CI run found one still titled `python`);
    its pid."""
    pids = d.rt.get(d.rt.submit(d.engines[name].handle, "engine_core_pids"))
    lost = [r.lost_rollout_pods for r in d.state.history]
    assert len(pids) == 1, f"{name}: expected one EngineCore, vLLM has {pids}; lost pods per step: {lost}"
    core = psutil.Process(pids[0])
    assert core.status() != psutil.STATUS_ZOMBIE, f"{name}: its EngineCore {pids[0]} already exited"
    core.kill()
    return pids[0]


def _served(d: driver.GRPODriver, name: str) -> int:
    return d.rt.get(d.rt.submit(d.engines[name].handle, "load_report")).requests_served


def test_real_engines_serve_restart_and_survive_a_dead_engine_core(vllm_driver: driver.GRPODriver) -> None:
    d = vllm_driver
    assert sorted(d.engines) == ["dedicated-0", "dedicated-1", "shared-0"]
    assert "no sleep mode" in (d.engine_platform or "")
    # The shared engine sleeps by stopping, and a dedicated engine is up: it was never started.
    assert d.engines["shared-0"].asleep
    rows = [d.step() for _ in range(2)]
    assert _served(d, "dedicated-0") > 0 and _served(d, "dedicated-1") > 0, "both engines serve"
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert d.state.history[-1].engine_platform == d.engine_platform

    # A dedicated engine's EngineCore dies while the pipeline generates the next step ahead.
    old = d.engines["dedicated-1"].handle
    _kill_engine_core(d, "dedicated-1")
    reports_before = len(d.state.history)
    m = d.step()
    assert m["step"] == 3
    reported = [p for r in d.state.history[reports_before:] for p in r.lost_rollout_pods]
    if not reported:  # the death was seen only at the next call into the engine
        d.step()
        reported = [p for r in d.state.history[reports_before:] for p in r.lost_rollout_pods]
    assert reported == [1], "the pod is reported lost, once"
    assert d.engines["dedicated-1"].handle is not old, "a new engine joined on the pod"
    assert d.engines["dedicated-1"].version == d.weights_version

    # The operator asks for the shared engine too: it is started again (a wake by restart).
    d.apply_targets(telemetry_sink.EngineTargets(desired_shared_awake=1, desired_dedicated_engines=None))
    d.step()
    report = d.state.history[-1]
    assert report.shared_wake_restarted and report.shared_wake_s is not None and report.shared_wake_s > 1.0
    assert not d.engines["shared-0"].asleep and _served(d, "shared-0") > 0

    # Its EngineCore dies: it is started again on its trainer pod (asleep: it serves when woken).
    old = d.engines["shared-0"].handle
    _kill_engine_core(d, "shared-0")
    for _ in range(2):
        d.step()
    assert "shared-0" in d.engines and d.engines["shared-0"].handle is not old
    # With no dedicated engine left, the shared engine serves every step: woken with the weights.
    d.apply_targets(telemetry_sink.EngineTargets(desired_shared_awake=1, desired_dedicated_engines=0))
    for _ in range(3):
        d.step()
    assert _served(d, "shared-0") > 0 and d.engines["shared-0"].version == d.weights_version
    assert d.state.step >= 9

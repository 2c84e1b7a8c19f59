"""The asynchronous rollout pipeline with the real driver on a real (private, local) Ray node: the
rank and the dedicated engines are Ray actors in their own processes, weights move over each
engine's gloo group, and the node advertises `rljob_rollout_<j>` for every simulated rollout pod
(what `python -m rljob_trainer` does without a cluster).

- maxStaleness 1: dedicated engines generate step k+1 with the weights of step k-1 while the rank
  trains step k (the only way a sample can be one version old), and nothing older is trained on.
- A dedicated engine killed mid-run is dropped, its requests are requeued, training goes on, the
  SyncReport lists its pod as lost, and a new engine joins at the next sync with the weights first.
- A lowered dedicated target drains the engine above it and acknowledges it in releasedRolloutPods.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from trainer_configs import toy_config

from rljob_trainer import __main__ as entry
from rljob_trainer import driver, runtimes, telemetry_sink, trainer
from rljob_trainer.engines import base

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def _cfg(**rollout: Any) -> Any:
    return toy_config(
        grpo={
            "maxSteps": 40,
            "promptsPerStep": 4,
            "maxStaleness": 1,
            "policyLoss": "clipped-tis",
            "tisCap": 2.0,
        },
        rollout={"sharedEngines": 0, "dedicatedEngines": 1, "maxDedicatedEngines": 2, **rollout},
        distributed={"numTrainerRanks": 1, "launcher": "ray", "rankNumCpus": 0.25},
    )


@pytest.fixture(scope="module")
def ray_node() -> Iterator[None]:
    """One private Ray node for the module (starting one is the slow, load-sensitive part), with
    the markers of two rollout pods."""
    ray = pytest.importorskip("ray")
    cfg = _cfg(dedicatedEngines=2)
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


@pytest.fixture
def ray_driver(request: pytest.FixtureRequest, ray_node: None) -> Iterator[driver.GRPODriver]:
    import ray

    param = dict(getattr(request, "param", {}))
    host_cls = param.pop("host_cls", None)
    cfg = _cfg(**param)
    d = driver.GRPODriver(cfg, runtimes.RayRuntime(cfg, host_cls=host_cls))
    try:
        d.setup()
        yield d
    finally:
        d.shutdown()
        for eng in d.engines.values():  # the next test starts from an empty node
            ray.kill(eng.handle)
        for rank in d.ranks:
            ray.kill(rank)


def test_dedicated_engines_generate_ahead_within_the_staleness_bound(ray_driver: driver.GRPODriver) -> None:
    d = ray_driver
    assert d.lookahead == 1 and d._collective
    rows = [d.step() for _ in range(5)]
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    # Step 1 starts from the initial weights; from step 2 on, the rollouts were generated with the
    # weights of two steps back: their generation ran while the previous step trained.
    assert rows[0]["rollout/staleness_max"] == 0
    assert [r["rollout/staleness_max"] for r in rows[1:]] == [1, 1, 1, 1]
    assert all(r["rollout/regenerated_stale"] == 0 for r in rows)
    # The engine holds the trainer's weights of the last step (they came over its gloo group): its
    # sampling log-probs equal the rank's log-probs of the same tokens.
    assert d.engines["dedicated-0"].version == d.weights_version == 5
    prompt = d._encode_prompt(d.examples[0].prompt)
    (out,) = d.rt.get(
        d.rt.submit(
            d.engines["dedicated-0"].handle,
            "generate",
            [prompt],
            base.SamplingSettings(max_tokens=1, seeds=(7,)),
        )
    )
    assert out.meta["version"] == 5
    sample = trainer.sample_from_output(out, 0.0, eos_id=d.tokenizer.eos_token_id)
    (trainer_lp,) = d.rt.get(d.rt.submit(d.ranks[0], "compute_log_probs", [sample]))
    assert trainer_lp == pytest.approx(list(out.logprobs), abs=1e-4)
    # Truncated importance sampling saw the one-step lag.
    assert all(r["off_policy/is_weight_max"] > 0 for r in rows)
    report = d.state.history[-1]
    assert report.staleness_max == 1 and report.lost_rollout_pods == [] and report.released_rollout_pods == []
    assert report.trainer_wait_s <= report.interval_s


@pytest.mark.parametrize("ray_driver", [{"dedicatedEngines": 2}], indirect=True)
def test_a_killed_engine_is_dropped_and_rejoins_at_the_next_sync(ray_driver: driver.GRPODriver) -> None:
    import ray

    d = ray_driver
    assert sorted(d.engines) == ["dedicated-0", "dedicated-1"]
    d.step()
    d.step()
    old = d.engines["dedicated-1"].handle
    ray.kill(old)  # its pod's process dies mid-run: its next-step requests are in flight or queued
    m = d.step()
    assert m["step"] == 3
    assert d.state.history[-1].lost_rollout_pods == [1]
    # Pod 1 is still alive (its node advertises rljob_rollout_1): the new engine joined at the sync
    # point and got the weights before any request.
    assert "dedicated-1" in d.engines and d.engines["dedicated-1"].handle is not old
    assert d.engines["dedicated-1"].version == d.weights_version == 3
    rows = [d.step() for _ in range(2)]
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert d.state.history[-1].lost_rollout_pods == []  # reported once, for the interval it happened


@pytest.mark.parametrize("ray_driver", [{"dedicatedEngines": 2}], indirect=True)
def test_a_lowered_target_drains_the_engine_and_acknowledges_it(ray_driver: driver.GRPODriver) -> None:
    d = ray_driver
    d.step()
    d.apply_targets(telemetry_sink.EngineTargets(desired_shared_awake=None, desired_dedicated_engines=1))
    d.step()
    assert sorted(d.engines) == ["dedicated-0"]
    report = d.state.history[-1]
    assert report.released_rollout_pods == [1] and report.dedicated_engines == 1
    m = d.step()
    assert m["step"] == 3 and d.state.history[-1].released_rollout_pods == [1]
    # Raising the target again brings pod 1 back; it is no longer reported released.
    d.apply_targets(telemetry_sink.EngineTargets(desired_shared_awake=None, desired_dedicated_engines=2))
    assert sorted(d.engines) == ["dedicated-0", "dedicated-1"]
    d.step()
    assert d.state.history[-1].released_rollout_pods == []

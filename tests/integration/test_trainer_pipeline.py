"""The asynchronous rollout pipeline with the real driver on a real (private, local) Ray node: the
rank and the dedicated engines are Ray actors in their own processes, weights move over each
engine's gloo group, and the node advertises `rljob_rollout_<j>` for every simulated rollout pod
(what `python -m rljob_trainer` does without a cluster).

- maxStaleness 1: dedicated engines generate step k+1 with the weights of step k-1 while the rank
  trains step k (the only way a sample can be one version old), and nothing older is trained on.
- A dedicated engine killed mid-run is dropped, its requests are requeued, training goes on, the
  SyncReport lists its pod as lost, and a new engine joins at the next sync with the weights first.
- A dedicated engine whose generate call hangs past rollout.engineTimeoutS is dropped after about
  the timeout, reported lost once, its requests requeued: every step still trains a full batch.
- A lowered dedicated target drains the engine above it and acknowledges it in releasedRolloutPods.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from trainer_configs import toy_config

from rljob_trainer import driver, runtimes
from rljob_trainer.engines import base
from rljob_trainer.outputs import telemetry_sink
from rljob_trainer.train import trainer

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.ray]


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


class _HangingHost(runtimes.Host):
    """`Host` whose engine `dedicated-1` hangs inside its third generate call, as an engine stuck in
    a CUDA kernel or a dead NCCL peer would: the call never returns, the actor stays alive. Only the
    first actor of that name hangs (the marker file is shared by every process); its replacement
    generates normally. The marker holds the time the hang began."""

    marker: ClassVar[str] = ""

    def __init__(self, kind: str, cfg: Any, **kwargs: Any) -> None:
        super().__init__(kind, cfg, **kwargs)
        self._name = kwargs.get("name")
        self._generates = 0

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "generate" and self._name == "dedicated-1":
            self._generates += 1
            marker = Path(self.marker)
            if self._generates == 3 and not marker.exists():
                marker.write_text(repr(time.time()))
                while True:
                    time.sleep(3600)
        return super().call(method, *args, **kwargs)


def _hanging_host(marker: Path) -> type:
    return type("HangingHost", (_HangingHost,), {"marker": str(marker)})


def ray_node_config() -> Any:
    """The private Ray node (the `ray_node` fixture, tests/integration/conftest.py): the markers of
    two rollout pods."""
    return _cfg(dedicatedEngines=2)


@pytest.fixture
def hang_marker(tmp_path: Path) -> Path:
    return tmp_path / "hung"


@pytest.fixture
def ray_driver(request: pytest.FixtureRequest, ray_node: None) -> Iterator[driver.GRPODriver]:
    import ray

    param = dict(getattr(request, "param", {}))
    host_cls = param.pop("host_cls", None)
    if host_cls == "hanging":
        host_cls = _hanging_host(request.getfixturevalue("hang_marker"))
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


HANG_TIMEOUT_S = 5.0


@pytest.mark.timeout(150, func_only=True)  # a driver that waits for a hung engine forever fails
@pytest.mark.parametrize(
    "ray_driver",
    [{"dedicatedEngines": 2, "engineTimeoutS": HANG_TIMEOUT_S, "host_cls": "hanging"}],
    indirect=True,
)
def test_a_hung_engine_is_dropped_after_the_timeout_and_no_prompt_is_lost(
    ray_driver: driver.GRPODriver, hang_marker: Path
) -> None:
    d = ray_driver
    assert sorted(d.engines) == ["dedicated-0", "dedicated-1"]
    batch = d.cfg.samples_per_step
    trained: list[int] = []  # samples handed to the rank per train_step call (the real call's args)
    dropped: list[tuple[str, bool, float]] = []
    submit, drop = d.rt.submit, d.drop_engine

    def watch_submit(handle: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "train_step":
            trained.append(sum(len(mb.samples) for mb in args[0]))
        return submit(handle, method, *args, **kwargs)

    def watch_drop(name: str, *, lost: bool = False) -> None:
        dropped.append((name, lost, time.time()))
        drop(name, lost=lost)

    d.rt.submit, d.drop_engine = watch_submit, watch_drop  # type: ignore[method-assign]
    rows = [d.step() for _ in range(5)]

    assert hang_marker.exists(), "the engine never hung: the test did not exercise the timeout"
    hung_at = float(hang_marker.read_text())
    lost = [(name, at) for name, was_lost, at in dropped if was_lost]
    assert [name for name, _ in lost] == ["dedicated-1"]
    # Dropped after about the timeout: not before it, and within the pipeline's 1 s polling and load.
    assert HANG_TIMEOUT_S * 0.8 <= lost[0][1] - hung_at <= HANG_TIMEOUT_S + 10
    # Reported lost exactly once, in the SyncReport of the interval it happened.
    reported = [p for r in d.state.history for p in r.lost_rollout_pods]
    assert reported == [1]
    # Its requests went back to the queue: every step trained a full batch, the run went on.
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and d.state.step == 5
    assert trained == [batch] * 5
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    # Pod 1 is alive, so a new engine joined at the next sync point with the current weights.
    assert "dedicated-1" in d.engines and d.engines["dedicated-1"].version == d.weights_version


MAX_PARTIAL_STEPS = 16
LONG_TRAIN_S = 4.0


class _AlternatingTrainingHost(runtimes.Host):
    """`Host` whose training rank takes `LONG_TRAIN_S` longer on every odd step (a slow accelerator's
    step), so the pipeline's timing does not hang on this machine's load. During a long step the
    engine generates all it may (up to maxStaleness steps ahead) and idles; the next step is short,
    so its sync point comes while the engine generates the step after the next: a call that runs
    ahead of the next step, which a sync interrupts. (With steps of one length the engine is either
    idle at every sync or busy with the next step, which is never interrupted.)"""

    def __init__(self, kind: str, cfg: Any, **kwargs: Any) -> None:
        super().__init__(kind, cfg, **kwargs)
        self._steps = 0

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "train_step":
            self._steps += 1
            if self._steps % 2 == 1:
                time.sleep(LONG_TRAIN_S)
        return super().call(method, *args, **kwargs)


def _resumed_one(d: driver.GRPODriver, rows: list[dict[str, float]]) -> bool:
    """A call was interrupted and a sample whose tokens span weights versions was trained on."""
    return d.pipeline.interrupted > 0 and any(
        r["rollout/partial_fraction"] > 0 and r["rollout/staleness_tokens_mean"] < r["rollout/staleness_mean"]
        for r in rows
    )


def test_partial_rollouts_interrupt_the_engine_at_a_sync_and_resume_under_the_new_weights(
    ray_node: None,
) -> None:
    """maxStaleness 2 with partial rollouts: training alternates long and short steps
    (`_AlternatingTrainingHost`), and the engine takes one prompt group per call, so at the sync
    after a short step it is mid-call on the step after the next; that call is interrupted (Ray's
    control group reaches the actor while it generates), the weights go over the gloo group, and the
    unfinished requests go on under the new weights. A resumed sample's tokens span versions: its
    staleness (the oldest token's) is above its tokens' mean, and no token is beyond the bound."""
    import ray

    cfg = toy_config(
        lengths={"maxResponseTokens": 24},
        grpo={
            "maxSteps": 40,
            "promptsPerStep": 4,
            "maxStaleness": 2,
            "policyLoss": "clipped-tis",
            "tisCap": 2.0,
        },
        rollout={
            "sharedEngines": 0,
            "dedicatedEngines": 1,
            "maxDedicatedEngines": 2,
            "partialRollouts": True,
            "chunkPromptGroups": 1,
        },
        distributed={"numTrainerRanks": 1, "launcher": "ray", "rankNumCpus": 0.25},
    )
    d = driver.GRPODriver(cfg, runtimes.RayRuntime(cfg, host_cls=_AlternatingTrainingHost))
    try:
        d.setup()
        # Six steps at least, then on (up to MAX_PARTIAL_STEPS) until a resumed sample was trained on:
        # on a loaded machine one generation can outlast a long step.
        rows: list[dict[str, float]] = []
        while len(rows) < 6 or (not _resumed_one(d, rows) and len(rows) < MAX_PARTIAL_STEPS):
            rows.append(d.step())
    finally:
        d.shutdown()
        for eng in d.engines.values():
            ray.kill(eng.handle)
        for rank in d.ranks:
            ray.kill(rank)
    assert d.pipeline.interrupted > 0
    assert any(r["rollout/partial_fraction"] > 0 for r in rows)
    assert all(r["rollout/staleness_max"] <= 2 and r["rollout/staleness_tokens_max"] <= 2 for r in rows)
    assert any(r["rollout/staleness_tokens_mean"] < r["rollout/staleness_mean"] for r in rows)
    assert all(r["rollout/regenerated_stale"] == 0 for r in rows)
    assert all(0 < r["off_policy/is_weight_max"] < float("inf") for r in rows)  # TIS per token
    report = d.state.history[-1]
    assert report.generated_tokens > 0 and report.generation_engines == 1
    assert report.prefill_engine_s is not None and report.decode_engine_s is not None

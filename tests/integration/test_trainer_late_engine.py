"""A dedicated engine whose rollout pod is not up when the driver starts (the pod still waits for room
on a full node): the held-out evaluation before training waits for it, as generation does, instead
of failing the job; a pod that never comes fails it after engineTimeoutSeconds, naming the field.

Found by applying every example to the local cluster at once: smollm2-reasoning's rollout pod was
Unschedulable for lack of CPU, its driver started, and the evaluation of the initial weights raised
"no rollout engine is up" at once, so the job Failed instead of waiting for the pod.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from trainer_configs import toy_config

pytest.importorskip("torch")

from rljob_trainer import driver, runtimes

pytestmark = [pytest.mark.torch]


class LateRolloutPods(runtimes.LocalRuntime):
    """The local runtime, its rollout pods up only after `absent` looks (None: never)."""

    def __init__(self, cfg, absent: int | None) -> None:
        super().__init__(cfg)
        self.absent = absent
        self.looks = 0

    def rollout_pods(self) -> list[int]:
        self.looks += 1
        if self.absent is None or self.looks <= self.absent:
            return []
        return super().rollout_pods()


def _driver(tmp_path: Path, absent: int | None, timeout_s: float = 600.0) -> driver.GRPODriver:
    cfg = toy_config(
        distributed={"numTrainerRanks": 1, "launcher": "local"},
        rollout={"sharedEngines": 0, "dedicatedEngines": 1, "engineTimeoutS": timeout_s},
        grpo={"maxSteps": 1},
        evaluation={"data": {"builtin": "toy-arithmetic"}, "maxSamples": 8, "beforeTraining": True},
    )
    return driver.GRPODriver(cfg, LateRolloutPods(cfg, absent), metrics_path=tmp_path / "metrics.jsonl")


def test_the_evaluation_before_training_waits_for_a_rollout_pod_still_scheduling(tmp_path: Path) -> None:
    d = _driver(tmp_path, absent=3)
    try:
        d.setup()
        assert d.engines == {}  # the pod was not up when the driver started
        metrics = d._evaluate_before_training()
        assert metrics["eval/samples"] == 8 and "eval/mean_reward" in metrics
        assert list(d.engines) == ["dedicated-0"] and d.rt.looks > 3
        assert d.step()["step"] == 1  # and training goes on on it
    finally:
        d.shutdown()


def test_a_rollout_pod_that_never_comes_fails_the_evaluation_naming_the_timeout(tmp_path: Path) -> None:
    d = _driver(tmp_path, absent=None, timeout_s=2.0)
    try:
        d.setup()
        with pytest.raises(
            RuntimeError,
            match=r"joined or came back within 2 s \(spec\.resources\.rollout\.engineTimeoutSeconds\)",
        ):
            d._evaluate_before_training()
    finally:
        d.shutdown()

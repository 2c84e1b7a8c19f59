"""Memory order (issue 21, item 5): vLLM reserves gpu_memory_utilization x the device when it starts
and refuses to start with less free memory, so a shared engine must start (and then sleep) before the
training rank on its accelerator loads model, optimizer and reference. The real driver's calls, in
local mode, recorded in the order it makes them."""

from __future__ import annotations

from typing import Any

import pytest
from trainer_configs import toy_config

from rljob_trainer import driver

pytestmark = [pytest.mark.torch]


def test_shared_engines_start_and_sleep_before_the_ranks_load() -> None:
    cfg = toy_config(
        grpo={"maxSteps": 1, "promptsPerStep": 2},
        rollout={"sharedEngines": 1, "dedicatedEngines": 0},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
    )
    rt = driver.LocalRuntime(cfg)
    calls: list[tuple[str, str]] = []
    submit = rt.submit

    def record(handle: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        calls.append((type(handle.obj).__name__, method))
        return submit(handle, method, *args, **kwargs)

    rt.submit = record  # type: ignore[method-assign]
    d = driver.GRPODriver(cfg, rt)
    d.setup()
    order = [
        c
        for c in calls
        if c in {("TransformersEngine", "load"), ("TransformersEngine", "sleep"), ("TrainingRank", "setup")}
    ]
    assert order == [
        ("TransformersEngine", "load"),
        ("TransformersEngine", "sleep"),
        ("TrainingRank", "setup"),
    ]
    d.step()  # and the step runs from there: wake, weights, generate, sleep, train
    assert d.state.step == 1

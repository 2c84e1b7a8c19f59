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


def test_engines_of_one_kind_load_together_not_one_after_another() -> None:
    """Each engine sits on its own accelerators, so the driver asks them all to load before it waits
    on any: starting N engines takes one engine's start (vLLM: about a minute), not N."""
    cfg = toy_config(
        grpo={"maxSteps": 1, "promptsPerStep": 2},
        rollout={"sharedEngines": 0, "dedicatedEngines": 2, "maxDedicatedEngines": 2},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
    )
    rt = driver.LocalRuntime(cfg)
    events: list[str] = []
    submit, wait_any = rt.submit, rt.wait_any

    def record_submit(handle: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "load":
            events.append(f"load {handle.obj.name}")
        return submit(handle, method, *args, **kwargs)

    def record_wait(futures: Any, timeout_s: float | None = None) -> list[Any]:
        events.append("wait")
        return wait_any(futures, timeout_s)

    rt.submit = record_submit  # type: ignore[method-assign]
    rt.wait_any = record_wait  # type: ignore[method-assign]
    d = driver.GRPODriver(cfg, rt)
    d.setup()
    first = events.index("wait")
    assert sorted(events[:first]) == ["load dedicated-0", "load dedicated-1"], events
    assert sorted(d.engines) == ["dedicated-0", "dedicated-1"]
    d.step()
    assert d.state.step == 1

"""Short runs of bench/adaptive.py: the simulator is deterministic, the seed's snapshot rule stays
idle on a one-step-off job, and the integrated policy beats the static launch split when generation
length drifts, then gives the engines back when it shrinks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "adaptive.py"


@pytest.fixture(scope="module")
def adaptive() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_adaptive", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_deterministic(adaptive: ModuleType):
    assert adaptive.simulate("grow", "integrated", steps=40) == adaptive.simulate(
        "grow", "integrated", steps=40
    )
    assert adaptive.simulate("grow", "integrated", steps=40, seed=1) != adaptive.simulate(
        "grow", "integrated", steps=40
    )


def test_integrated_beats_static_where_seed_stays_idle(adaptive: ModuleType):
    static = adaptive.simulate("grow", "static", steps=80)
    seed = adaptive.simulate("grow", "seed-snapshot", steps=80)
    ours = adaptive.simulate("grow", "integrated", steps=80)
    assert seed.actions == {} and seed.steps_per_hour == static.steps_per_hour
    assert ours.actions.get("wake_shared", 0) >= 1 and ours.actions.get("add_dedicated", 0) >= 1
    assert ours.steps_per_hour > 1.15 * static.steps_per_hour


def test_integrated_scales_back_down(adaptive: ModuleType):
    ours = adaptive.simulate("grow-shrink", "integrated", steps=120)
    assert ours.actions.get("remove_dedicated", 0) >= 1 and ours.actions.get("sleep_shared", 0) >= 1
    static_max = adaptive.simulate("grow-shrink", "static-max", steps=120)
    assert ours.accelerator_hours < static_max.accelerator_hours


def test_unknown_policy(adaptive: ModuleType):
    with pytest.raises(ValueError, match="valid: static, static-max, seed-snapshot, integrated"):
        adaptive.policy_settings("bogus")


def test_cli_json(adaptive: ModuleType, capsys: pytest.CaptureFixture[str]):
    assert adaptive.main(["--steps", "10", "--trace", "flat-short", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"integrated/static"' in out and '"steps_per_hour"' in out

"""Mixed precision as a GPU run does it, on CPU: fp32 master weights and optimizer state, compute in
the job's dtype (bf16 by default).

The tiny job (`examples/tiny-cpu.yaml`, rendered by the operator's own planner and builders) in
local mode, full fine-tuning at a learning rate GRPO uses for full fine-tuning (1e-5), 30 steps:
with the update applied to bf16 parameters (no fp32 master), every update smaller than half a bf16
ulp of its weight is lost, and only ~15 % of the bf16 weights ever change; with fp32 masters the
updates accumulate until they cross a bf16 step, as in fp32 (~75 %)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rljob_operator import api, builders
from rljob_operator.decide import planning
from rljob_trainer import config, driver, runtimes

pytestmark = [pytest.mark.torch]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"


def tiny_job_config(**over: Any) -> config.TrainerConfig:
    """The tiny example's trainer config as the operator renders it, run in local mode (one rank)."""
    spec = api.RLJobSpec.model_validate(yaml.safe_load(EXAMPLE.read_text())["spec"])
    model_config = dict(spec.model.config.inline or {})
    plan = planning.plan_status(planning.plan_job(spec, model_config))
    data = builders.render_trainer_config(spec, plan, model_config).model_dump()
    data["distributed"].update(num_trainer_ranks=1, trainer_pod_ranks=None, launcher="local")
    data["telemetry"].update(enabled=False, prometheus_port=None)
    data["checkpoint"] = {"dir": None}
    data["export"]["final"] = False
    for section, values in over.items():
        data[section].update(values)
    return config.TrainerConfig.model_validate(data)


def _weights(d: driver.GRPODriver) -> dict[str, torch.Tensor]:
    rank = d.rt.get(d.rt.submit(d.ranks[0], "engine_weights"))
    return {k: v.clone() for k, v in rank.items()}


def _changed_fraction(dtype: str, steps: int = 30) -> float:
    cfg = tiny_job_config(model={"dtype": dtype}, grpo={"learning_rate": 1e-5, "max_steps": steps})
    d = driver.GRPODriver(cfg, runtimes.LocalRuntime(cfg))
    d.setup()
    before = _weights(d)
    for _ in range(steps):
        d.step()
    after = _weights(d)
    d.shutdown()
    assert all(t.dtype == getattr(torch, dtype) for t in after.values()), "engines get the job's dtype"
    changed = sum(int((before[k] != after[k]).sum()) for k in before)
    return changed / sum(t.numel() for t in before.values())


def test_full_fine_tuning_in_bf16_moves_most_weights_at_lr_1e_5() -> None:
    frac = _changed_fraction("bfloat16")
    print(f"bf16 full FT, lr 1e-5, 30 steps: {100 * frac:.1f} % of the bf16 weights changed")
    assert frac >= 0.60, f"only {100 * frac:.1f} % of the bf16 weights changed (no fp32 master weights?)"

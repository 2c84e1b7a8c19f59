"""Unit tests for bounded model configs: one table (`api.MODEL_CONFIG_LIMITS`) read by the CRD
schema, the API model (`rljob validate`) and the estimator; planning off the event loop within a
time limit (`reconcile.guards.plan_off_loop`). On the real apiserver: tests/integration/
test_operator_security.py (refused at apply, the operator stays up)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from rljob_operator import api, errors
from rljob_operator.api import crd
from rljob_operator.cli import commands
from rljob_operator.decide import planning
from rljob_operator.estimator import geometry, presets
from rljob_operator.reconcile import guards

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
TINY = REPO / "examples" / "tiny-cpu.yaml"


def tiny_job() -> dict[str, Any]:
    return yaml.safe_load(TINY.read_text())


def with_inline(job: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """`job` with `config` inline; a cpu job runs the transformers engine, since these tests are about
    the bounds and vLLM's CPU attention refuses most head sizes (its own rule: test_planning)."""
    out = copy.deepcopy(job)
    out["spec"]["model"]["config"] = {"inline": config}
    if out["spec"]["resources"]["accelerator"]["kind"] == "cpu":
        out["spec"]["resources"].setdefault("rollout", {})["kind"] = "transformers"
    return out


def test_ten_billion_layers_are_refused_by_the_api_model_and_rljob_validate(tmp_path: Path) -> None:
    job = tiny_job()
    job["spec"]["model"]["config"]["inline"]["num_hidden_layers"] = 10_000_000_000
    with pytest.raises(
        pydantic.ValidationError, match=r"inline\.num_hidden_layers: 10000000000 is above the limit of 1024"
    ):
        api.RLJobSpec.model_validate(job["spec"])
    path = tmp_path / "huge.yaml"
    path.write_text(yaml.safe_dump(job))
    with pytest.raises(
        SystemExit, match=r"inline\.num_hidden_layers: 10000000000 is above the limit of 1024"
    ):
        commands.main(["validate", "-f", str(path)])


@pytest.mark.parametrize("key", sorted(api.MODEL_CONFIG_LIMITS))
def test_every_bound_holds_at_its_limit_and_refuses_past_it(key: str) -> None:
    base = tiny_job()
    limit = api.MODEL_CONFIG_LIMITS[key]
    inline = base["spec"]["model"]["config"]["inline"]
    api.RLJobSpec.model_validate(with_inline(base, {**inline, key: limit})["spec"])
    for config in (
        {**inline, key: limit + 1},
        {"model_type": "qwen3_5", "text_config": {**inline, key: limit + 1}},
    ):
        with pytest.raises(pydantic.ValidationError, match=rf"{key}: {limit + 1} is above the limit"):
            api.RLJobSpec.model_validate(with_inline(base, config)["spec"])
    # A config the schema never saw (a ConfigMap, a preset) meets the same bound in the estimator.
    with pytest.raises(
        errors.InvalidModelConfigError, match=rf"^(text_config\.)?{key}: {limit + 1} is above"
    ):
        geometry.ModelGeometry.from_hf_config({**presets.load_preset("Qwen/Qwen3-8B"), key: limit + 1})


def test_the_crd_schema_carries_the_bounds() -> None:
    inline = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]["model"]["properties"]["config"]["properties"]["inline"]
    assert inline["x-kubernetes-preserve-unknown-fields"] is True  # any other field stays open
    for props in (inline["properties"], inline["properties"][api.model.TEXT_CONFIG_KEY]["properties"]):
        assert {k: v["maximum"] for k, v in props.items() if k != api.model.TEXT_CONFIG_KEY} == (
            api.MODEL_CONFIG_LIMITS
        )
        assert all(v["type"] == "integer" for k, v in props.items() if k != api.model.TEXT_CONFIG_KEY)


def test_every_shipped_preset_is_within_the_bounds() -> None:
    for name in presets.preset_names():
        assert api.model_config_bound_violations(presets.load_preset(name)) == [], name


def at_every_bound(kind: str) -> dict[str, Any]:
    config: dict[str, Any] = {"model_type": "qwen3_moe", **api.MODEL_CONFIG_LIMITS}
    if kind == "dense":
        for key in ("num_experts", "n_routed_experts", "num_local_experts", "num_experts_per_tok"):
            config.pop(key)
    if kind == "small-but-deep":  # fits a GPU: the planner goes all the way (engines, batches)
        config.update(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, vocab_size=32000,
                      num_attention_heads=8, num_key_value_heads=8, head_dim=8, num_experts=64,
                      num_experts_per_tok=8)  # fmt: skip
    return config


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
@pytest.mark.parametrize("kind", ["moe", "dense", "small-but-deep"])
def test_a_config_at_every_bound_plans_in_under_a_second(path: Path, kind: str) -> None:
    job = next(d for d in api.load_manifests(path.read_text()) if d.get("kind") == "RLJob")
    config = at_every_bound(kind)
    spec = api.RLJobSpec.model_validate(with_inline(job, config)["spec"])
    started = time.perf_counter()
    with contextlib.suppress(errors.EstimatorError):  # does not fit: an answer too, and as fast
        planning.plan_job(spec, config)
    assert time.perf_counter() - started < 1.0


def test_planning_runs_off_the_event_loop_within_its_time_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow_plan(spec: api.RLJobSpec, config: dict[str, Any]) -> api.PlanStatus:
        time.sleep(0.6)  # a plan past the limit (no bounded config takes this long)
        return api.PlanStatus(trainer_accelerators=1)

    monkeypatch.setattr(guards, "PLAN_TIMEOUT_S", 0.2)
    spec = api.RLJobSpec.model_validate(tiny_job()["spec"])
    ticks: list[float] = []

    async def main() -> None:
        async def tick() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        with pytest.raises(errors.PlanningTimeoutError, match=r"planning took longer than 0\.2s"):
            await guards.plan_off_loop(lambda: slow_plan(spec, {}))
        ticker.cancel()

    started = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - started < 0.5  # the reconcile did not wait for the runaway plan
    assert len(ticks) >= 10  # and the loop kept serving everyone else meanwhile
    assert errors.PlanningTimeoutError.retryable is False  # the job waits for a new generation

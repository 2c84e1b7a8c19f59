"""The spec → estimator adapter (`rljob_operator.decide.planning`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rljob_operator import api
from rljob_operator.decide import planning
from rljob_operator.estimator import EstimatorError

REPO = Path(__file__).resolve().parents[2]


def example_spec(name: str) -> api.RLJobSpec:
    (doc,) = api.load_manifests((REPO / "examples" / name).read_text())
    return api.RLJobSpec.model_validate(doc["spec"])


@pytest.mark.parametrize(
    ("quantity", "expected"),
    [("8Gi", 8 * 2**30), ("512Mi", 512 * 2**20), ("1G", 10**9), (1024, 1024), ("1.5Gi", 3 * 2**29)],
)
def test_quantity_bytes(quantity: int | str, expected: int) -> None:
    assert planning.quantity_bytes(quantity) == expected


def test_quantity_bytes_rejects_cpu_style_units() -> None:
    with pytest.raises(ValueError, match="memory quantity"):
        planning.quantity_bytes("500m")


def test_cpu_job_plans_on_its_pod_memory() -> None:
    spec = example_spec("tiny-cpu.yaml")
    request = planning.plan_request_from_spec(spec, dict(spec.model.config.inline or {}))
    (device,) = request.custom_devices
    assert request.accelerator == device.name == planning.CPU_DEVICE_NAME
    assert device.memory_bytes == planning.quantity_bytes(spec.resources.memory or 0)
    assert request.trainer_accelerators == spec.resources.static.trainer_accelerators  # type: ignore[union-attr]


def test_custom_accelerator_numbers_become_a_catalog_entry() -> None:
    spec = example_spec("qwen3.5-4b-gsm8k-adaptive.yaml")
    custom = spec.resources.accelerator.custom
    assert custom is not None
    request = planning.plan_request_from_spec(spec, {"model_type": "unused"})
    (device,) = request.custom_devices
    assert device.name == spec.resources.accelerator.model
    assert device.memory_bytes == int(custom.memory_gib * 2**30)
    assert device.resource_name == "nvidia.com/gpu"
    assert request.max_model_len == spec.lengths.max_model_len
    assert request.group_size == spec.grpo.group_size


def test_plan_status_carries_the_contract_numbers_and_bounds_the_reasons() -> None:
    spec = example_spec("tiny-cpu.yaml")
    plan = planning.plan_job(spec, dict(spec.model.config.inline or {}))
    many = plan.model_copy(update={"reasons": [f"r{i}" for i in range(500)]})
    status = planning.plan_status(many)
    assert status.kv_bytes_per_token == plan.kv_bytes_per_token
    assert status.max_num_seqs == plan.max_num_seqs and status.trainer_accelerators == 2
    assert len(status.reasons) == planning.MAX_PLAN_REASONS


def test_a_model_that_does_not_fit_raises_the_estimators_error() -> None:
    spec = example_spec("tiny-cpu.yaml")
    huge = {**(spec.model.config.inline or {}), "hidden_size": 16384, "intermediate_size": 65536,
            "num_hidden_layers": 80, "num_attention_heads": 128, "head_dim": 128}  # fmt: skip
    with pytest.raises(EstimatorError) as info:
        planning.plan_job(spec, huge)
    assert info.value.reason == "ModelDoesNotFit"

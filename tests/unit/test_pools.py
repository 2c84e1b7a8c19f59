"""Node-pool defaults (`rljob_operator.decide.pools`): which pool a job gets and what it fills in."""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_builders import JOB, make_spec, static_plan

from rljob_operator import api, builders, errors
from rljob_operator.decide import planning, pools

ASCEND_POOL: dict[str, Any] = {
    "acceleratorKinds": ["ascend"],
    "trainerImage": "registry.local/rljob-trainer:0.1.0-ascend",
    "nodeSelector": {"rljob.io/accelerator": "Ascend910B3"},
    "tolerations": [{"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoSchedule"}],
    "priorityClassName": "rl-training",
    "devices": {"Ascend910C": {"memoryGiB": 128, "hbmBandwidthGBps": 3200, "bf16TFLOPS": 750}},
    "extraResources": {"hugepages-2Mi": "1Gi"},
    "memory": "512Gi",
}
NVIDIA_POOL: dict[str, Any] = {
    "acceleratorKinds": ["nvidia"],
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
}


def catalog(**extra: Any) -> pools.PoolCatalog:
    return pools.parse_pool_catalog(
        json.dumps({"pools": {"ascend": ASCEND_POOL, "gpu": NVIDIA_POOL}, **extra})
    )


def ascend_spec(**overrides: Any) -> api.RLJobSpec:
    return make_spec(**{"resources.accelerator": {"kind": "ascend", "model": "Ascend910B3"}, **overrides})


def test_pool_is_chosen_by_spec_pool_then_accelerator_kind_then_default() -> None:
    cat = catalog(defaultPool="gpu")
    assert pools.select_pool(cat, ascend_spec())[0] == "ascend"
    assert pools.select_pool(cat, make_spec())[0] == "gpu"
    assert pools.select_pool(cat, ascend_spec(pool="gpu"))[0] == "gpu"
    cpu = make_spec(**{"resources.accelerator": {"kind": "cpu"}})
    assert pools.select_pool(cat, cpu)[0] == "gpu"  # defaultPool
    assert pools.select_pool(catalog(), cpu) is None
    assert pools.select_pool(pools.parse_pool_catalog(""), ascend_spec()) is None


def test_unknown_pool_names_the_field_and_the_known_pools() -> None:
    with pytest.raises(errors.InvalidSpecError) as info:
        pools.select_pool(catalog(), ascend_spec(pool="tpu"))
    assert info.value.field == "spec.pool"
    assert "'tpu'" in str(info.value) and "ascend, gpu" in str(info.value)


def test_bad_catalogs_are_rejected_with_the_reason() -> None:
    with pytest.raises(ValueError, match="defaultPool 'nope'"):
        catalog(defaultPool="nope")
    with pytest.raises(ValueError, match="acceleratorKinds"):
        pools.parse_pool_catalog(json.dumps({"pools": {"x": {"acceleratorKinds": ["tpu"]}}}))
    with pytest.raises(ValueError, match="invalid"):
        pools.parse_pool_catalog("{not json")


def test_defaults_fill_only_what_the_spec_left_unset() -> None:
    spec = pools.with_pool_defaults(ascend_spec(), catalog())
    assert spec.image.trainer == ASCEND_POOL["trainerImage"]
    for pool in (spec.trainer_pool, spec.rollout_pool):
        assert pool.node_selector == ASCEND_POOL["nodeSelector"]
        assert [t.to_k8s() for t in pool.tolerations] == ASCEND_POOL["tolerations"]
        assert pool.priority_class_name == "rl-training"
    assert spec.resources.extra_resources == {"hugepages-2Mi": "1Gi"}
    assert spec.resources.memory == "512Gi" and spec.resources.cpu is None

    own = ascend_spec(
        image={"trainer": "mine:1"},
        trainerPool={"nodeSelector": {"team": "a"}},
        **{
            "resources.extraResources": {"hugepages-2Mi": "2Gi", "example.com/rdma": 1},
            "resources.memory": "64Gi",
        },
    )
    merged = pools.with_pool_defaults(own, catalog())
    assert merged.image.trainer == "mine:1"
    assert merged.trainer_pool.node_selector == {"team": "a"}  # the job's own selector wins whole
    assert [t.key for t in merged.trainer_pool.tolerations] == ["huawei.com/Ascend910"]
    assert merged.resources.extra_resources == {"hugepages-2Mi": "2Gi", "example.com/rdma": 1}
    assert merged.resources.memory == "64Gi"
    assert own.image.trainer == "mine:1" and own.resources.extra_resources["hugepages-2Mi"] == "2Gi"


def test_pods_carry_the_pool_defaults() -> None:
    spec = pools.with_pool_defaults(ascend_spec(), catalog())
    layout = builders.compute_layout(spec, static_plan(spec))
    pod = builders.build_pods(JOB, spec, layout)[0]["spec"]
    assert pod["nodeSelector"] == ASCEND_POOL["nodeSelector"]
    assert pod["tolerations"] == ASCEND_POOL["tolerations"]
    ctr = pod["containers"][0]
    assert ctr["image"] == ASCEND_POOL["trainerImage"]
    assert ctr["resources"]["requests"]["hugepages-2Mi"] == "1Gi"
    assert ctr["resources"]["limits"]["hugepages-2Mi"] == "1Gi"
    assert ctr["resources"]["requests"]["memory"] == "512Gi"  # Kubernetes: hugepages need memory
    assert ctr["resources"]["limits"]["huawei.com/Ascend910"] == "8"


def test_device_catalog_addition_reaches_the_estimator() -> None:
    spec = ascend_spec(**{"resources.accelerator": {"kind": "ascend", "model": "Ascend910C"}})
    config = {
        "model_type": "qwen3", "hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151936,
        "max_position_embeddings": 40960, "torch_dtype": "bfloat16",
    }  # fmt: skip
    with pytest.raises(Exception, match="Ascend910C"):
        planning.plan_job(spec, config)  # not in the catalog: the estimator cannot size it
    filled = pools.with_pool_defaults(spec, catalog())
    assert filled.resources.accelerator.custom is not None
    assert filled.resources.accelerator.custom.memory_gib == 128
    plan = planning.plan_job(filled, config)
    assert plan.kv_cache_tokens > 0

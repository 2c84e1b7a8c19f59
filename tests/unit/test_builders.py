"""Unit tests for rljob_operator.builders: pure dicts with the right names, requests and security."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rljob_operator import api, builders, errors, names
from rljob_operator.builders import configmaps, pods
from rljob_trainer import config as tc
from rljob_trainer.outputs import termination

JOB = builders.JobRef("demo", "team-a")


def make_spec(**overrides: Any) -> api.RLJobSpec:
    raw: dict[str, Any] = {
        "model": {"name": "tiny", "source": {"tiny": {}}, "config": {"inline": {"model_type": "llama"}}},
        "data": {"source": {"builtin": {"name": "toy-arithmetic"}}},
        "resources": {
            "accelerator": {"kind": "nvidia", "model": "H100-80GB"},
            "totalAccelerators": 24,
            "acceleratorsPerNode": 8,
            "mode": "static",
            "static": {"trainerAccelerators": 16, "rolloutAccelerators": 8},
            "rollout": {"tensorParallel": 4},
        },
    }
    for path, value in overrides.items():
        node = raw
        keys = path.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return api.RLJobSpec.model_validate(raw)


def static_plan(spec: api.RLJobSpec) -> api.PlanStatus:
    """A plan without the estimator, for builder/reconcile/status tests: the spec's static split
    (or, without one, one node for the trainer and the rest for dedicated engines)."""
    res = spec.resources
    tp = res.rollout.tensor_parallel or 1
    if res.static is not None:
        trainer, rollout = res.static.trainer_accelerators, res.static.rollout_accelerators
    else:
        trainer = min(res.accelerators_per_node, res.total_accelerators)
        rollout = res.total_accelerators - trainer
    engines = rollout // tp
    return api.PlanStatus(
        trainer_accelerators=trainer,
        rollout_accelerators=engines * tp,
        rollout_engines=engines,
        shared_engines=1 if engines == 0 else 0,
        tensor_parallel=tp,
        max_num_seqs=res.rollout.max_num_seqs,
        max_num_batched_tokens=res.rollout.max_num_batched_tokens,
        reasons=["static split read from spec.resources (test plan, no estimator)"],
    )


def all_objects(spec: api.RLJobSpec) -> list[dict[str, Any]]:
    plan = static_plan(spec)
    layout = builders.compute_layout(spec, plan)
    return builders.build_pods(JOB, spec, layout)


def test_layout_from_static_split() -> None:
    spec = make_spec()
    plan = static_plan(spec)
    layout = builders.compute_layout(spec, plan)
    assert layout.trainer_accelerators == (8, 8)
    assert layout.rollout_pods == 2 and layout.rollout_accelerators_per_pod == 4
    assert layout.idle_accelerators == 0
    assert builders.compute_layout(spec, plan, dedicated_engines=0).idle_accelerators == 8


def test_layout_partial_last_trainer_node_and_no_static_split() -> None:
    spec = make_spec(**{"resources.mode": "estimate", "resources.static": None})
    spec = api.RLJobSpec.model_validate(
        {**spec.to_k8s(), "resources": {**spec.resources.to_k8s(), "mode": "estimate"}}
    )
    plan = static_plan(spec)
    assert plan.trainer_accelerators == 8 and plan.rollout_engines == 4
    odd = api.PlanStatus(trainer_accelerators=12, rollout_engines=0, tensor_parallel=1)
    assert builders.compute_layout(spec, odd).trainer_accelerators == (8, 4)
    with pytest.raises(ValueError, match="trainerAccelerators"):
        builders.compute_layout(spec, api.PlanStatus(trainer_accelerators=0))


def test_pods_have_contract_names_env_and_order() -> None:
    objs = all_objects(make_spec())
    assert [o["metadata"]["name"] for o in objs] == [
        "demo-trainer-0",
        "demo-trainer-1",
        "demo-rollout-0",
        "demo-rollout-1",
    ]
    head = objs[0]
    env = {e["name"]: e.get("value") for e in head["spec"]["containers"][0]["env"]}
    # Besides the trainer contract: Ray's token (from the job's Secret) and the caches' homes on a
    # volume (the root filesystem is read-only).
    runtime = {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "HOME", "XDG_CACHE_HOME", "HF_HOME"}
    assert set(env) == set(tc.ALL_ENV_VARS) | {termination.ENV_TERMINATION_LOG} | runtime
    assert env[tc.ENV_RAY_HEAD] == "demo-trainer-0.demo.team-a.svc"
    assert env[tc.ENV_NUM_TRAINER_PODS] == "2"
    assert env[tc.ENV_ROLE] == "trainer" and env[tc.ENV_POD_INDEX] == "0"
    assert env[tc.ENV_CONFIG_PATH] == "/etc/rljob/trainer.json"
    assert env[tc.ENV_TELEMETRY_CONFIGMAP] == "demo-telemetry"
    assert head["spec"]["hostname"] == "demo-trainer-0" and head["spec"]["subdomain"] == "demo"
    mounts = {m["mountPath"]: m for m in head["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["/etc/rljob"]["readOnly"] is True
    assert "/checkpoints" in mounts
    assert "/checkpoints" not in {m["mountPath"] for m in objs[-1]["spec"]["containers"][0]["volumeMounts"]}


@pytest.mark.parametrize(
    ("kind", "resource"),
    [("nvidia", "nvidia.com/gpu"), ("ascend", "huawei.com/Ascend910"), ("amd", "amd.com/gpu"), ("cpu", None)],
)
def test_accelerator_resource_names(kind: str, resource: str | None) -> None:
    model = None if kind == "cpu" else "H100-80GB"
    spec = make_spec(**{"resources.accelerator": {"kind": kind, **({"model": model} if model else {})}})
    trainer, rollout = all_objects(spec)[0], all_objects(spec)[-1]
    for pod, amount in ((trainer, "8"), (rollout, "4")):
        res = pod["spec"]["containers"][0]["resources"]
        if resource is None:  # a cpu job's defaults: vLLM's CPU engine needs more than 2Gi (api)
            assert not any("/" in k for k in res["requests"])
            assert res["requests"] == {"cpu": "1", "memory": "6Gi"} == res["limits"]
        else:
            assert res["requests"][resource] == amount == res["limits"][resource]
            assert "cpu" not in res["requests"]


def test_resource_name_override_and_cpu_memory() -> None:
    spec = make_spec(
        **{
            "resources.accelerator": {
                "kind": "nvidia",
                "model": "H100-80GB",
                "resourceName": "example.com/gpu",
            },
            "resources.cpu": "4",
            "resources.memory": "64Gi",
        }
    )
    res = all_objects(spec)[0]["spec"]["containers"][0]["resources"]
    assert res["requests"] == {"cpu": "4", "memory": "64Gi", "example.com/gpu": "8"}


def test_security_context_is_locked_down() -> None:
    for pod in all_objects(make_spec()):
        psc = pod["spec"]["securityContext"]
        csc = pod["spec"]["containers"][0]["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert csc["allowPrivilegeEscalation"] is False and csc["capabilities"] == {"drop": ["ALL"]}
        assert pod["spec"]["restartPolicy"] == "Never"
    trainer, rollout = all_objects(make_spec())[0], all_objects(make_spec())[-1]
    assert trainer["spec"]["automountServiceAccountToken"] is True
    assert rollout["spec"]["automountServiceAccountToken"] is False


def test_pools_map_to_placement() -> None:
    spec = make_spec(
        trainerPool={
            "nodeSelector": {"pool": "train"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": "high",
        },
        rolloutPool={"nodeSelector": {"pool": "serve"}},
    )
    trainer, rollout = all_objects(spec)[0], all_objects(spec)[-1]
    assert trainer["spec"]["nodeSelector"] == {"pool": "train"}
    assert trainer["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert trainer["spec"]["priorityClassName"] == "high"
    assert rollout["spec"]["nodeSelector"] == {"pool": "serve"}
    assert "tolerations" not in rollout["spec"] and "priorityClassName" not in rollout["spec"]


def test_labels_and_hash_are_deterministic_and_sensitive() -> None:
    spec = make_spec()
    a, b = all_objects(spec), all_objects(spec)
    assert a == b
    labels = a[2]["metadata"]["labels"]
    assert labels == names.pod_labels("demo", "rollout", 0)
    h = a[0]["metadata"]["annotations"][names.ANNOTATION_TEMPLATE_HASH]
    other = all_objects(make_spec(image={"trainer": "example.com/trainer:2"}))
    assert other[0]["metadata"]["annotations"][names.ANNOTATION_TEMPLATE_HASH] != h
    plan = static_plan(spec)
    layout = builders.compute_layout(spec, plan)
    changed = builders.build_trainer_pod(JOB, spec, layout, 0, config_hash="x")
    assert changed["metadata"]["annotations"][names.ANNOTATION_TEMPLATE_HASH] != h
    attempt = builders.build_trainer_pod(JOB, spec, layout, 0, attempt=3)
    assert attempt["metadata"]["annotations"][names.ANNOTATION_ATTEMPT] == "3"
    assert attempt["metadata"]["annotations"][names.ANNOTATION_TEMPLATE_HASH] == h


def test_builders_do_not_mutate_input() -> None:
    spec = make_spec(trainerPool={"nodeSelector": {"pool": "train"}})
    before = copy.deepcopy(spec.to_k8s())
    pod = all_objects(spec)[0]
    pod["spec"]["nodeSelector"]["pool"] = "changed"
    assert spec.to_k8s() == before


def test_pod_index_bounds() -> None:
    spec = make_spec()
    layout = builders.compute_layout(spec, static_plan(spec))
    with pytest.raises(ValueError, match="outside"):
        builders.build_trainer_pod(JOB, spec, layout, 2)
    with pytest.raises(ValueError, match=">= 0"):
        builders.build_rollout_pod(JOB, spec, layout, -1)


def test_volumes_for_pvc_sources_and_hub_token() -> None:
    spec = make_spec(
        model={
            "name": "m",
            "source": {"hub": {"id": "Qwen/Qwen3-4B", "tokenSecretRef": {"name": "hf", "key": "token"}}},
            "config": {"preset": "Qwen/Qwen3-4B"},
        },
        data={"source": {"pvc": {"claimName": "data", "path": "train.jsonl"}}},
        checkpoint={"volume": {"claimName": "ckpt"}, "path": "/ckpt"},
    )
    trainer = all_objects(spec)[0]
    vols = {v["name"]: v for v in trainer["spec"]["volumes"]}
    assert vols[pods.CHECKPOINT_VOLUME]["persistentVolumeClaim"] == {"claimName": "ckpt"}
    assert vols[pods.DATA_VOLUME]["persistentVolumeClaim"]["claimName"] == "data"
    env = {e["name"]: e for e in trainer["spec"]["containers"][0]["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    pvc_model = make_spec(
        model={"name": "m", "source": {"pvc": {"claimName": "w", "path": "/q"}}, "config": {"preset": "x"}}
    )
    vols = {v["name"]: v for v in all_objects(pvc_model)[-1]["spec"]["volumes"]}
    assert vols[pods.MODEL_VOLUME]["persistentVolumeClaim"] == {"claimName": "w", "readOnly": True}
    cm_data = make_spec(
        data={"source": {"configMapRef": {"name": "prompts"}}},
        checkpoint={"volume": {"emptyDir": {"sizeLimit": "1Gi"}}},
    )
    vols = {v["name"]: v for v in all_objects(cm_data)[0]["spec"]["volumes"]}
    assert vols[pods.DATA_VOLUME]["configMap"] == {"name": "prompts"}
    assert vols[pods.CHECKPOINT_VOLUME]["emptyDir"] == {"sizeLimit": "1Gi"}


def test_service_and_rbac() -> None:
    svc = builders.build_headless_service(JOB)
    assert svc["metadata"]["name"] == "demo" and svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {names.LABEL_JOB: "demo", names.LABEL_ROLE: "trainer"}
    role = builders.build_role("demo", "team-a")
    rules = {(r["resources"][0], tuple(r["resourceNames"])): r["verbs"] for r in role["rules"]}
    assert rules == {
        ("configmaps", ("demo-telemetry",)): ["get", "patch", "update"],
        ("configmaps", ("demo-config",)): ["get"],
        ("rljobs", ("demo",)): ["get"],
    }
    binding = builders.build_role_binding("demo", "team-a")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo", "namespace": "team-a"}]
    assert builders.build_service_account("demo", "team-a")["metadata"]["name"] == "demo"
    cr = builders.build_operator_cluster_role()
    assert any(r["resources"] == ["rljobs/status"] for r in cr["rules"])
    crb = builders.build_operator_cluster_role_binding("op", "op-sa", "ops")
    assert crb["subjects"][0] == {"kind": "ServiceAccount", "name": "op-sa", "namespace": "ops"}


def test_config_map_renders_trainer_config() -> None:
    spec = make_spec(**{"resources.mode": "adaptive", "resources.adaptive": {"maxRolloutEngines": 1}})
    plan = static_plan(spec)
    cm = builders.build_config_map(JOB, spec, plan, {"model_type": "llama"})
    assert cm["metadata"]["name"] == "demo-config"
    cfg = tc.parse_config(json.loads(cm["data"][tc.CONFIGMAP_KEY]))
    assert cfg.model.source == "tiny" and cfg.model.hf_config == {"model_type": "llama"}
    assert cfg.rollout.tensor_parallel == 4 and cfg.rollout.dedicated_engines == 2
    assert cfg.rollout.max_dedicated_engines == 2  # never below the plan
    assert cfg.distributed.num_trainer_ranks == 16 and cfg.distributed.device == "cuda"
    assert cfg.data.builtin == "toy-arithmetic"
    tele = builders.build_telemetry_config_map(JOB)
    assert tele["metadata"]["name"] == "demo-telemetry" and json.loads(tele["data"]["reports.json"]) == []


def test_config_rejects_what_the_trainer_cannot_run() -> None:
    cfg = builders.render_trainer_config(
        make_spec(grpo={"lossNormalization": "sequenceSumNorm"}),
        api.PlanStatus(trainer_accelerators=8),
        {"a": 1},
    )
    assert cfg.grpo.loss_agg == "seq-mean-token-sum-norm"
    with pytest.raises(errors.InvalidSpecError, match="config"):
        configmaps.render_trainer_config(make_spec(), api.PlanStatus(trainer_accelerators=8), None)


@settings(max_examples=40, deadline=None)
@given(
    trainer_nodes=st.integers(1, 4),
    rollout=st.integers(0, 16),
    tp=st.sampled_from([1, 2, 4, 8]),
    dedicated=st.one_of(st.none(), st.integers(0, 8)),
)
def test_layout_requests_never_exceed_plan(
    trainer_nodes: int, rollout: int, tp: int, dedicated: int | None
) -> None:
    spec = make_spec(**{"resources.totalAccelerators": 64, "resources.rollout": {"tensorParallel": tp}})
    plan = api.PlanStatus(
        trainer_accelerators=trainer_nodes * 8 - 1, rollout_engines=rollout // tp, tensor_parallel=tp
    )
    layout = builders.compute_layout(spec, plan, dedicated)
    objs = builders.build_pods(JOB, spec, layout)
    gpus = sum(int(o["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"]) for o in objs)
    assert gpus == layout.used_accelerators
    assert sum(layout.trainer_accelerators) == plan.trainer_accelerators
    assert all(0 < a <= 8 for a in layout.trainer_accelerators)
    assert len({o["metadata"]["name"] for o in objs}) == len(objs)


def _env_of(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize(
    ("kind", "model", "ray_name"), [("nvidia", "H100-80GB", "GPU"), ("ascend", "Ascend910B3", "NPU")]
)
def test_pods_tell_ray_start_their_exact_accelerators_and_the_config_places_ranks_per_pod(
    kind: str, model: str, ray_name: str
) -> None:
    spec = make_spec(
        **{
            "resources.accelerator": {"kind": kind, "model": model},
            "resources.acceleratorsPerNode": 4,
            "resources.static": {"trainerAccelerators": 5, "rolloutAccelerators": 8},
        }
    )
    plan = api.PlanStatus(trainer_accelerators=5, rollout_engines=2, shared_engines=5, tensor_parallel=4)
    layout = builders.compute_layout(spec, plan)
    objs = builders.build_pods(JOB, spec, layout)
    envs = {o["metadata"]["name"]: _env_of(o) for o in objs}
    assert envs["demo-trainer-0"][tc.ENV_NUM_ACCELERATORS] == "4"
    assert envs["demo-trainer-1"][tc.ENV_NUM_ACCELERATORS] == "1"
    assert envs["demo-rollout-0"][tc.ENV_NUM_ACCELERATORS] == "4"
    assert {e[tc.ENV_RAY_ACCELERATOR] for e in envs.values()} == {ray_name}
    assert not any(tc.ENV_TEST_CPU_STANDIN in e for e in envs.values())  # a test-kubelet switch only
    cfg = builders.render_trainer_config(spec, plan, {"model_type": "llama"})
    assert cfg.distributed.accelerator == ray_name and cfg.distributed.trainer_pod_ranks == [4, 1]
    assert cfg.rollout.kind == "vllm" and cfg.rollout.enable_sleep_mode
    assert cfg.rollout.engine_lora and cfg.rollout.sleep_level == 1  # LoRA (the default): adapter sync


def test_cpu_pods_advertise_no_accelerator() -> None:
    spec = make_spec(
        **{
            "resources.accelerator": {"kind": "cpu"},
            "resources.acceleratorsPerNode": 1,
            "resources.totalAccelerators": 2,
            "resources.static": {"trainerAccelerators": 2, "rolloutAccelerators": 0},
            "resources.rollout": {},
        }
    )
    plan = api.PlanStatus(trainer_accelerators=2, rollout_engines=0, shared_engines=1)
    env = _env_of(builders.build_pods(JOB, spec, builders.compute_layout(spec, plan))[0])
    assert env[tc.ENV_RAY_ACCELERATOR] == "" and env[tc.ENV_NUM_ACCELERATORS] == "1"
    cfg = builders.render_trainer_config(spec, plan, {"model_type": "llama"})
    assert cfg.distributed.accelerator is None and cfg.distributed.trainer_pod_ranks == [1, 1]


@pytest.mark.parametrize(
    ("cpu", "per_node", "threads"), [(None, 1, 1), ("2", 1, 2), ("500m", 1, 1), ("4", 2, 2), ("3", 2, 1)]
)
def test_cpu_ranks_train_on_their_share_of_the_pods_cpus(
    cpu: str | None, per_node: int, threads: int
) -> None:
    # Ray reserves one CPU per rank actor and sets OMP_NUM_THREADS from it: the rank's torch threads
    # come from the pod's CPUs (default 1 on cpu jobs), split among the pod's ranks.
    spec = make_spec(
        **{
            "resources.accelerator": {"kind": "cpu"},
            "resources.acceleratorsPerNode": per_node,
            "resources.totalAccelerators": 2,
            "resources.static": {"trainerAccelerators": 2, "rolloutAccelerators": 0},
            "resources.rollout": {},
            **({"resources.cpu": cpu} if cpu else {}),
        }
    )
    plan = api.PlanStatus(trainer_accelerators=2, rollout_engines=0, shared_engines=1)
    cfg = builders.render_trainer_config(spec, plan, {"model_type": "llama"})
    assert cfg.distributed.torch_threads_per_rank == threads


def test_accelerator_ranks_keep_torchs_own_thread_count() -> None:
    spec = make_spec(**{"resources.cpu": "8"})
    plan = api.PlanStatus(trainer_accelerators=4, rollout_engines=1, shared_engines=0)
    cfg = builders.render_trainer_config(spec, plan, {"model_type": "llama"})
    assert cfg.distributed.accelerator is not None and cfg.distributed.torch_threads_per_rank is None


def test_grpo_updates_data_formats_hub_and_chat_template_reach_the_trainer() -> None:
    spec = make_spec(
        grpo={"miniBatchesPerStep": 4, "ppoEpochs": 2},
        data={
            "source": {
                "hub": {
                    "id": "openai/gsm8k",
                    "subset": "main",
                    "split": "test",
                    "endpoint": "https://hf-mirror.example",
                    "tokenSecretRef": {"name": "hf", "key": "token"},
                }
            },
            "promptField": "question",
            "chatTemplate": True,
        },
        **{"resources.rollout": {"tensorParallel": 4, "enableSleepMode": False}},
    )
    plan = static_plan(spec)
    cfg = builders.render_trainer_config(spec, plan, {"model_type": "llama"})
    assert (cfg.grpo.mini_batches_per_step, cfg.grpo.ppo_epochs) == (4, 2)
    d = cfg.data
    assert (d.hub_id, d.hub_subset, d.hub_split, d.chat_template) == ("openai/gsm8k", "main", "test", True)
    assert d.hub_token_env == configmaps.HF_DATA_TOKEN_ENV and d.builtin is None
    assert cfg.rollout.enable_sleep_mode is False
    env = _env_of(builders.build_trainer_pod(JOB, spec, builders.compute_layout(spec, plan), 0))
    assert env[configmaps.HF_ENDPOINT_ENV] == "https://hf-mirror.example"
    assert env[configmaps.HF_DATA_TOKEN_ENV] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    pvc = make_spec(data={"source": {"pvc": {"claimName": "data", "path": "gsm8k/"}}})
    assert (
        builders.render_trainer_config(pvc, static_plan(pvc), {"model_type": "llama"}).data.path
        == "/data/gsm8k/"
    )


def test_reward_modules_by_import_path_file_configmap_and_pvc() -> None:
    spec = make_spec(
        reward={
            "functions": [
                {"name": "module", "module": {"importPath": "my.rewards", "function": "score"}},
                {"name": "module", "module": {"path": "/app/r.py"}},
                {
                    "name": "module",
                    "module": {"configMapRef": {"name": "rw", "key": "reward.py"}, "function": "f"},
                },
                {"name": "module", "module": {"pvc": {"claimName": "code", "path": "/rewards/r.py"}}},
            ]
        }
    )
    plan = static_plan(spec)
    cfg = builders.render_trainer_config(spec, plan, {"model_type": "llama"})
    assert [(r.import_path, r.path, r.function) for r in cfg.rewards] == [
        ("my.rewards", None, "score"),
        (None, "/app/r.py", "reward"),
        (None, f"{configmaps.REWARD_MOUNT_DIR}/2/reward.py", "f"),
        (None, f"{configmaps.REWARD_MOUNT_DIR}/3/rewards/r.py", "reward"),
    ]
    pod = builders.build_trainer_pod(JOB, spec, builders.compute_layout(spec, plan), 0)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert volumes["reward-2"]["configMap"] == {"name": "rw"}
    assert volumes["reward-3"]["persistentVolumeClaim"] == {"claimName": "code", "readOnly": True}
    assert mounts["reward-2"] == f"{configmaps.REWARD_MOUNT_DIR}/2"
    assert "reward-0" not in volumes and "reward-1" not in volumes


@pytest.mark.parametrize(("kind", "engine"), [("nvidia", "vllm"), ("cpu", "vllm"), ("cpu", "transformers")])
def test_lora_jobs_sync_only_the_adapter_unless_told_merged(kind: str, engine: str) -> None:
    """LoRA (the default mode): engines serve the adapter, and vLLM engines (CPU ones too) sleep at
    level 1 (level 2 would discard the base they cannot reload); loraSync merged or full fine-tuning:
    all weights."""
    accel = {"kind": "cpu"} if kind == "cpu" else {"kind": "nvidia", "model": "H100-80GB"}
    lora = make_spec(**{"resources.accelerator": accel, "resources.rollout": {"kind": engine}})
    cfg = configmaps.render_trainer_config(lora, static_plan(lora), {"model_type": "llama"})
    assert cfg.model.finetune == "lora" and cfg.rollout.engine_lora and cfg.rollout.kind == engine
    assert cfg.rollout.sleep_level == (1 if engine == "vllm" else 2)
    merged = make_spec(
        **{"resources.accelerator": accel, "resources.rollout": {"kind": engine, "loraSync": "merged"}}
    )
    cfg = configmaps.render_trainer_config(merged, static_plan(merged), {"model_type": "llama"})
    assert not cfg.rollout.engine_lora and cfg.rollout.sleep_level == 2
    full = make_spec(
        **{
            "resources.accelerator": accel,
            "resources.rollout": {"kind": engine},
            "model.finetune": {"mode": "full"},
        }
    )
    cfg = configmaps.render_trainer_config(full, static_plan(full), {"model_type": "llama"})
    assert not cfg.rollout.engine_lora and cfg.rollout.sleep_level == 2


def test_max_staleness_defaults_to_one_with_dedicated_engines_and_turns_on_tis() -> None:
    spec = make_spec()
    cfg = configmaps.render_trainer_config(spec, static_plan(spec), {"model_type": "llama"})
    assert cfg.rollout.dedicated_engines == 2 and cfg.grpo.max_staleness == 1
    assert cfg.grpo.policy_loss == "clipped-tis" and cfg.grpo.tis_cap == 2.0
    assert cfg.rollout.weight_sync == "collective" and cfg.rollout.engine_timeout_s == 600.0

    colocated = make_spec(**{"resources.static": {"trainerAccelerators": 24, "rolloutAccelerators": 0}})
    cfg = configmaps.render_trainer_config(colocated, static_plan(colocated), {"model_type": "llama"})
    assert cfg.rollout.max_dedicated_engines == 0
    assert cfg.grpo.max_staleness == 0 and cfg.grpo.policy_loss == "clipped"  # no TIS: nothing truncated

    chosen = make_spec(
        **{
            "grpo": {"maxStaleness": 3, "tisCap": 0},
            "resources.rollout": {
                "tensorParallel": 4,
                "engineTimeoutSeconds": 30,
                "weightSync": "objectStore",
            },
        }
    )
    cfg = configmaps.render_trainer_config(chosen, static_plan(chosen), {"model_type": "llama"})
    assert cfg.grpo.max_staleness == 3 and cfg.grpo.policy_loss == "clipped"  # tisCap 0: no TIS
    assert cfg.rollout.weight_sync == "object-store" and cfg.rollout.engine_timeout_s == 30


def test_evaluation_gspo_and_the_numerics_settings_reach_the_trainer() -> None:
    spec = make_spec(
        grpo={"policyLoss": "gspo", "clipRatioC": 4.0, "maxSkippedSteps": 2, "maxStaleness": 0,
              "dynamicSampling": {"enabled": True, "maxGenerationRounds": 2}},
        evaluation={"data": {"source": {"builtin": {"name": "gsm8k-sample"}}}, "everySteps": 5,
                    "maxSamples": 9},
    )  # fmt: skip
    cfg = configmaps.render_trainer_config(spec, static_plan(spec), {"model_type": "llama"})
    g = cfg.grpo
    assert (g.policy_loss, g.clip_ratio_c, g.max_skipped_steps) == ("gspo", 4.0, 2)
    assert g.dynamic_sampling.enabled and g.dynamic_sampling.max_generation_rounds == 2
    ev = cfg.evaluation
    assert (
        ev is not None and ev.every_steps == 5 and ev.max_samples == 9 and ev.data.builtin == "gsm8k-sample"
    )
    assert ev.temperature == 0.0 and ev.samples_per_prompt == 1  # greedy, one sample per prompt
    tis = make_spec(grpo={"policyLoss": "gspo", "maxStaleness": 1})
    assert configmaps.render_trainer_config(
        tis, static_plan(tis), {"model_type": "llama"}
    ).grpo.policy_loss == ("gspo-tis")


def test_rollout_correction_reaches_the_trainer_and_replaces_tis_cap_at_every_staleness() -> None:
    legacy = make_spec(grpo={"maxStaleness": 1, "tisCap": 3.0})
    g = configmaps.render_trainer_config(legacy, static_plan(legacy), {"model_type": "llama"}).grpo
    # a job written for tisCap: the same token TIS the '-tis' loss applied before rolloutCorrection
    assert g.policy_loss == "clipped-tis" and g.rollout_correction is None
    eff = g.effective_rollout_correction()
    assert eff is not None and (eff.is_level, eff.is_mode, eff.is_upper) == ("token", "truncate", 3.0)

    spec = make_spec(
        grpo={
            "maxStaleness": 0,
            "tisCap": 7.0,
            "rolloutCorrection": {
                "importanceSampling": {"level": "token", "mode": "mask", "lower": 0.5, "upper": 5.0},
                "rejection": {"level": "geometric", "lower": 0.99, "upper": 1.01},
            },
        }
    )
    g = configmaps.render_trainer_config(spec, static_plan(spec), {"model_type": "llama"}).grpo
    rc = g.rollout_correction
    assert g.policy_loss == "clipped" and rc is not None  # plain loss: the correction weighs
    assert (rc.is_level, rc.is_mode, rc.is_lower, rc.is_upper) == ("token", "mask", 0.5, 5.0)
    assert (rc.reject_level, rc.reject_lower, rc.reject_upper) == ("geometric", 0.99, 1.01)
    assert g.effective_rollout_correction() is rc  # at staleness 0 too; tisCap 7 unused

    none = make_spec(grpo={"rolloutCorrection": {"importanceSampling": {"level": "none"}}})
    rc = configmaps.render_trainer_config(
        none, static_plan(none), {"model_type": "llama"}
    ).grpo.rollout_correction
    assert rc is not None and rc.is_level is None and rc.reject_level is None  # metrics only


def test_held_out_data_on_another_claim_is_refused_naming_the_field() -> None:
    spec = make_spec(
        data={"source": {"pvc": {"claimName": "train", "path": "a.jsonl"}}},
        evaluation={"data": {"source": {"pvc": {"claimName": "other", "path": "b.jsonl"}}}},
    )
    with pytest.raises(errors.InvalidSpecError) as info:
        configmaps.render_trainer_config(spec, static_plan(spec), {"model_type": "llama"})
    assert "spec.evaluation.data.source.pvc" in str(info.value)


# ---- spec.resources.rollout.kind and the KV bytes of vLLM's CPU backend ---------------------------
@pytest.mark.parametrize("accelerator", [{"kind": "nvidia", "model": "H100-80GB"}, {"kind": "cpu"}])
@pytest.mark.parametrize("engine", [None, "vllm", "transformers"])
def test_the_rollout_engine_is_the_specs_on_every_pool(
    accelerator: dict[str, str], engine: str | None
) -> None:
    """vLLM by default on every pool, CPU pools included (vLLM's CPU build); transformers when asked."""
    rollout = {} if engine is None else {"kind": engine}
    spec = make_spec(**{"resources.accelerator": accelerator, "resources.rollout": rollout})
    cfg = configmaps.render_trainer_config(spec, static_plan(spec), {"model_type": "llama"})
    assert cfg.rollout.kind == (engine or "vllm")


@pytest.mark.parametrize("accelerator", [{"kind": "nvidia", "model": "H100-80GB"}, {"kind": "cpu"}])
def test_the_plans_cpu_kv_cache_bytes_reach_the_trainer(accelerator: dict[str, str]) -> None:
    spec = make_spec(**{"resources.accelerator": accelerator, "resources.rollout": {}})
    plan = static_plan(spec).model_copy(update={"kv_cache_bytes": 7 << 30, "cpu_kv_cache_bytes": 12_345_678})
    cfg = configmaps.render_trainer_config(spec, plan, {"model_type": "llama"})
    assert cfg.rollout.cpu_kv_cache_bytes == 12_345_678
    data = json.loads(
        configmaps.build_config_map(JOB, spec, plan, {"model_type": "llama"})["data"][tc.CONFIGMAP_KEY]
    )
    assert data["rollout"]["cpuKvCacheBytes"] == 12_345_678
    # A plan without the number (made before it existed): vLLM's own default, never 0 bytes.
    cfg = configmaps.render_trainer_config(spec, static_plan(spec), {"model_type": "llama"})
    assert cfg.rollout.cpu_kv_cache_bytes is None


@pytest.mark.parametrize(("engine", "memory"), [("vllm", "6Gi"), ("transformers", "2Gi")])
def test_cpu_pods_memory_default_follows_the_engine_and_the_spec_wins(engine: str, memory: str) -> None:
    cpu = {"resources.accelerator": {"kind": "cpu"}, "resources.rollout": {"kind": engine}}
    requests = all_objects(make_spec(**cpu))[0]["spec"]["containers"][0]["resources"]["requests"]
    assert requests == {"cpu": "1", "memory": memory} and memory == api.CPU_POD_MEMORY_DEFAULTS[engine]
    own = make_spec(**cpu, **{"resources.memory": "3Gi"})
    assert all_objects(own)[0]["spec"]["containers"][0]["resources"]["requests"]["memory"] == "3Gi"

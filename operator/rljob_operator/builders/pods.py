"""The job's Ray pods: `<job>-trainer-<i>` (pod 0: Ray head + GRPO driver), `<job>-rollout-<j>` and
`<job>-judge-<k>` (spec.reward.judge's engines; Ray workers like rollout pods).

Role: pure builders of the pod dicts the handlers create. Everything a pod needs comes in as
arguments: the job, the spec, the layout (counts and accelerator requests), the run attempt (the
restart count, so pods of an older attempt are recognisable) and the config hash (so a changed
trainer.json replaces the pods). The operator's labels are applied last, so user labels never
override them; the template hash annotation lets the shell detect an out-of-date pod.

Security (docs/security.md): what PodSecurity `restricted` admits (non-root, no privilege
escalation, all capabilities dropped, seccomp RuntimeDefault), plus a read-only root filesystem
whose writable paths are emptyDirs with sizeLimits (`scratch`), and Ray's token authentication
(`ray_auth`: every pod reads the job's token from its Secret). Rollout pods get no API token (they
never call the API); trainer pods use the job's least-privilege ServiceAccount for telemetry
(docs/contracts.md §3).
"""

from __future__ import annotations

from typing import Any

from rljob_operator import api, names
from rljob_operator.builders import configmaps, endpoint, ray_auth, scratch
from rljob_operator.builders.common import JobLayout, JobRef, content_hash, deep_copy, resource_name
from rljob_trainer import config as tc
from rljob_trainer.outputs import termination

RUN_AS_USER = 1000
CONFIG_VOLUME = "config"
CHECKPOINT_VOLUME = "checkpoints"
MODEL_VOLUME = "model"
JUDGE_MODEL_VOLUME = "judge-model"
DATA_VOLUME = "data"
REWARD_VOLUME_PREFIX = "reward-"
TMP_VOLUME = "tmp"
CACHE_VOLUME = "cache"
SHM_VOLUME = "dshm"
METRICS_PORT_NAME = "metrics"
TRAINER_METRICS_PORT = int(tc.TelemetrySettings().prometheus_port or 9400)


def _env(job: JobRef, spec: api.RLJobSpec, role: str, index: int, layout: JobLayout) -> list[dict[str, Any]]:
    # What `ray start` advertises: exactly this container's accelerators, under Ray's name for them.
    slots = {
        names.ROLE_TRAINER: layout.trainer_accelerators[index] if role == names.ROLE_TRAINER else 0,
        names.ROLE_ROLLOUT: layout.rollout_accelerators_per_pod,
        names.ROLE_JUDGE: layout.judge_accelerators_per_pod,
    }[role]
    ray_accelerator = tc.RAY_ACCELERATORS[spec.resources.accelerator.kind] or ""
    return [
        {"name": tc.ENV_CONFIG_PATH, "value": f"{names.CONFIG_MOUNT_DIR}/{tc.CONFIGMAP_KEY}"},
        {"name": tc.ENV_ROLE, "value": role},
        {"name": termination.ENV_TERMINATION_LOG, "value": termination.DEFAULT_PATH},
        {"name": tc.ENV_POD_INDEX, "value": str(index)},
        {"name": tc.ENV_JOB_NAME, "value": job.name},
        {"name": tc.ENV_NAMESPACE, "value": job.namespace},
        {"name": tc.ENV_RAY_HEAD, "value": names.ray_head_host(job.name, job.namespace)},
        {"name": tc.ENV_RAY_PORT, "value": str(tc.DEFAULT_RAY_PORT)},
        {"name": tc.ENV_NUM_TRAINER_PODS, "value": str(layout.trainer_pods)},
        {"name": tc.ENV_TELEMETRY_CONFIGMAP, "value": names.telemetry_config_map_name(job.name)},
        {"name": tc.ENV_NUM_ACCELERATORS, "value": str(slots)},
        {"name": tc.ENV_RAY_ACCELERATOR, "value": ray_accelerator},
        # The root filesystem is read-only: HOME and every cache live on the cache emptyDir.
        {"name": "HOME", "value": f"{scratch.CACHE_MOUNT}/home"},
        {"name": "XDG_CACHE_HOME", "value": scratch.CACHE_MOUNT},
        {"name": "HF_HOME", "value": scratch.HF_HOME},
        *ray_auth.env_vars(job),
    ]


def _resources(spec: api.RLJobSpec, accelerators: int) -> dict[str, Any]:
    res = spec.resources
    amounts: dict[str, Any] = {}
    cpu, memory = res.pod_cpu, res.pod_memory  # cpu jobs' defaults: api.ResourcesSpec, as the planner's
    if cpu is not None:
        amounts["cpu"] = str(cpu)
    if memory is not None:
        amounts["memory"] = str(memory)
    for extra, amount in res.extra_resources.items():  # hugepages, RDMA: requests == limits too
        amounts[extra] = str(amount)
    name = resource_name(spec)
    if name is not None and accelerators > 0:
        # Extended resources must have requests == limits; GPUs are never overcommitted.
        amounts[name] = str(accelerators)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _volumes(
    job: JobRef, spec: api.RLJobSpec, role: str, limits: scratch.ScratchLimits
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": CONFIG_VOLUME, "configMap": {"name": names.config_map_name(job.name)}},
        {"name": TMP_VOLUME, "emptyDir": {"sizeLimit": limits.tmp}},
        {"name": CACHE_VOLUME, "emptyDir": {"sizeLimit": limits.cache}},
        {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": limits.shm}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": CONFIG_VOLUME, "mountPath": names.CONFIG_MOUNT_DIR, "readOnly": True},
        {"name": TMP_VOLUME, "mountPath": scratch.TMP_MOUNT},
        {"name": CACHE_VOLUME, "mountPath": scratch.CACHE_MOUNT},
        {"name": SHM_VOLUME, "mountPath": scratch.SHM_MOUNT},
    ]
    if role == names.ROLE_TRAINER:
        ckpt = spec.checkpoint.volume
        if ckpt.claim_name is not None:
            volumes.append(
                {"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": ckpt.claim_name}}
            )
        else:
            size = ckpt.empty_dir.size_limit if ckpt.empty_dir is not None else None
            empty = {"sizeLimit": str(size) if size is not None else limits.checkpoints}
            volumes.append({"name": CHECKPOINT_VOLUME, "emptyDir": empty})
        mounts.append({"name": CHECKPOINT_VOLUME, "mountPath": spec.checkpoint.path})
    judge = spec.reward.judge
    judge_pvc = judge.model.source.pvc if judge is not None else None
    if judge_pvc is not None and role in (names.ROLE_TRAINER, names.ROLE_JUDGE):
        # The judge's engines load it (judge pods); the driver may read its tokenizer (trainer pods).
        volumes.append(
            {
                "name": JUDGE_MODEL_VOLUME,
                "persistentVolumeClaim": {"claimName": judge_pvc.claim_name, "readOnly": True},
            }
        )
        mounts.append(
            {"name": JUDGE_MODEL_VOLUME, "mountPath": configmaps.JUDGE_MODEL_MOUNT_DIR, "readOnly": True}
        )
    model_pvc = spec.model.source.pvc
    if model_pvc is not None and role != names.ROLE_JUDGE:
        volumes.append(
            {
                "name": MODEL_VOLUME,
                "persistentVolumeClaim": {"claimName": model_pvc.claim_name, "readOnly": True},
            }
        )
        mounts.append({"name": MODEL_VOLUME, "mountPath": configmaps.MODEL_MOUNT_DIR, "readOnly": True})
    data_src = spec.data.source
    if role == names.ROLE_TRAINER and data_src.pvc is not None:
        volumes.append(
            {
                "name": DATA_VOLUME,
                "persistentVolumeClaim": {"claimName": data_src.pvc.claim_name, "readOnly": True},
            }
        )
        mounts.append({"name": DATA_VOLUME, "mountPath": configmaps.DATA_MOUNT_DIR, "readOnly": True})
    elif role == names.ROLE_TRAINER and data_src.config_map_ref is not None:
        volumes.append({"name": DATA_VOLUME, "configMap": {"name": data_src.config_map_ref.name}})
        mounts.append(
            {"name": DATA_VOLUME, "mountPath": configmaps.DATA_CONFIGMAP_MOUNT_DIR, "readOnly": True}
        )
    if role == names.ROLE_TRAINER:
        for i, fn in enumerate(spec.reward.functions):
            module = fn.module
            if module is None or (module.config_map_ref is None and module.pvc is None):
                continue
            vol = f"{REWARD_VOLUME_PREFIX}{i}"
            if module.config_map_ref is not None:
                volumes.append({"name": vol, "configMap": {"name": module.config_map_ref.name}})
            elif module.pvc is not None:
                volumes.append(
                    {
                        "name": vol,
                        "persistentVolumeClaim": {"claimName": module.pvc.claim_name, "readOnly": True},
                    }
                )
            mounts.append({"name": vol, "mountPath": f"{configmaps.REWARD_MOUNT_DIR}/{i}", "readOnly": True})
    return volumes, mounts


def _pool(spec: api.RLJobSpec, role: str) -> api.NodePoolSpec:
    """Judge pods hold engines, as rollout pods do: they schedule like them."""
    return spec.trainer_pool if role == names.ROLE_TRAINER else spec.rollout_pool


def _build_pod(
    job: JobRef,
    spec: api.RLJobSpec,
    layout: JobLayout,
    role: str,
    index: int,
    accelerators: int,
    attempt: int,
    config_hash: str,
    limits: scratch.ScratchLimits,
) -> dict[str, Any]:
    pool = _pool(spec, role)
    name = names.pod_name(job.name, role, index)
    volumes, mounts = _volumes(job, spec, role, limits)
    env = _env(job, spec, role, index, layout)
    data_hub = spec.data.source.hub
    if role == names.ROLE_TRAINER and data_hub is not None:
        if data_hub.endpoint:
            env.append({"name": configmaps.HF_ENDPOINT_ENV, "value": data_hub.endpoint})
        if data_hub.token_secret_ref is not None:
            ref = data_hub.token_secret_ref
            env.append(
                {
                    "name": configmaps.HF_DATA_TOKEN_ENV,
                    "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
                }
            )
    hub = spec.model.source.hub
    secrets = []
    if role != names.ROLE_JUDGE:
        secrets.append((configmaps.HF_TOKEN_ENV, hub.token_secret_ref if hub is not None else None))
    judge = spec.reward.judge
    judge_hub = judge.model.source.hub if judge is not None else None
    if judge_hub is not None and role in (names.ROLE_TRAINER, names.ROLE_JUDGE):
        secrets.append((configmaps.JUDGE_HF_TOKEN_ENV, judge_hub.token_secret_ref))
    if role == names.ROLE_TRAINER:  # trackers run in the driver on trainer pod 0
        w, m = spec.tracking.wandb, spec.tracking.mlflow
        secrets.append((configmaps.WANDB_API_KEY_ENV, w.api_key_secret_ref if w is not None else None))
        secrets.append((configmaps.MLFLOW_TOKEN_ENV, m.token_secret_ref if m is not None else None))
    for env_name, ref in secrets:
        if ref is not None:
            env.append({"name": env_name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    ports = [{"name": "ray-gcs", "containerPort": tc.DEFAULT_RAY_PORT, "protocol": "TCP"}]
    if role == names.ROLE_TRAINER and index == 0:
        # (Ray's dashboard listens on 127.0.0.1 only: `kubectl port-forward` reaches it, no pod does.)
        # The driver's Prometheus endpoint (telemetry.prometheusPort): what the chart's PodMonitor scrapes.
        ports.append({"name": METRICS_PORT_NAME, "containerPort": TRAINER_METRICS_PORT, "protocol": "TCP"})
        if endpoint.enabled(spec):  # the driver serves the job's OpenAI-compatible endpoint here
            ports.append(endpoint.container_port())
            env += endpoint.trainer_env_vars(job)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",  # the operator restarts the whole job from its checkpoint
        "hostname": name,
        "subdomain": names.service_name(job.name),
        "serviceAccountName": names.service_account_name(job.name),
        "automountServiceAccountToken": role == names.ROLE_TRAINER,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": role,
                "image": spec.image.trainer,
                "imagePullPolicy": spec.image.pull_policy,
                "command": ["python", "-m", "rljob_trainer"],
                "workingDir": scratch.TMP_MOUNT,  # relative writes land on a volume, not the image
                "env": env,
                "ports": ports,
                "resources": _resources(spec, accelerators),
                "volumeMounts": mounts,
                # The trainer writes its fatal cause there (rljob_trainer.outputs.termination); a crash
                # that writes nothing still shows the log's tail in the pod's status.
                "terminationMessagePath": termination.DEFAULT_PATH,
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "privileged": False,
                    "capabilities": {"drop": ["ALL"]},
                    "readOnlyRootFilesystem": True,
                    "runAsNonRoot": True,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
            }
        ],
        "volumes": volumes,
    }
    if pool.node_selector:
        pod_spec["nodeSelector"] = deep_copy(dict(pool.node_selector))
    if pool.tolerations:
        pod_spec["tolerations"] = [t.to_k8s() for t in pool.tolerations]
    if pool.priority_class_name:
        pod_spec["priorityClassName"] = pool.priority_class_name
    if spec.image.pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in spec.image.pull_secrets]
    template_hash = content_hash({"spec": pod_spec, "config": config_hash})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": job.namespace,
            "labels": names.pod_labels(job.name, role, index),
            "annotations": {
                names.ANNOTATION_ATTEMPT: str(attempt),
                names.ANNOTATION_TEMPLATE_HASH: template_hash,
            },
        },
        "spec": pod_spec,
    }


def build_trainer_pod(
    job: JobRef,
    spec: api.RLJobSpec,
    layout: JobLayout,
    index: int,
    *,
    attempt: int = 0,
    config_hash: str = "",
    model_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Trainer pod `index` (0 hosts the Ray head and the GRPO driver), requesting
    `layout.trainer_accelerators[index]` accelerators; `model_config` sizes its scratch volumes."""
    if not 0 <= index < layout.trainer_pods:
        raise ValueError(f"trainer pod index {index} is outside 0..{layout.trainer_pods - 1}")
    return _build_pod(
        job,
        spec,
        layout,
        names.ROLE_TRAINER,
        index,
        layout.trainer_accelerators[index],
        attempt,
        config_hash,
        scratch.scratch_limits(spec, model_config),
    )


def build_rollout_pod(
    job: JobRef,
    spec: api.RLJobSpec,
    layout: JobLayout,
    index: int,
    *,
    attempt: int = 0,
    config_hash: str = "",
    model_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Dedicated rollout pod `index`: a Ray worker hosting dedicated engine `index`
    (`layout.rollout_accelerators_per_pod` accelerators, one engine of tensorParallel)."""
    if index < 0:
        raise ValueError(f"rollout pod index must be >= 0, got {index}")
    return _build_pod(
        job,
        spec,
        layout,
        names.ROLE_ROLLOUT,
        index,
        layout.rollout_accelerators_per_pod,
        attempt,
        config_hash,
        scratch.scratch_limits(spec, model_config),
    )


def build_judge_pod(
    job: JobRef,
    spec: api.RLJobSpec,
    layout: JobLayout,
    index: int,
    *,
    attempt: int = 0,
    config_hash: str = "",
    judge_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Judge pod `index`: a Ray worker hosting judge engine `index` (`layout.judge_accelerators_per_pod`
    accelerators), advertising `rljob_judge_<index>` (docs/contracts.md §2); `judge_config` (the judge
    model's config.json) sizes its scratch volumes."""
    if not 0 <= index < layout.judge_pods:
        raise ValueError(f"judge pod index {index} is outside 0..{layout.judge_pods - 1}")
    return _build_pod(
        job,
        spec,
        layout,
        names.ROLE_JUDGE,
        index,
        layout.judge_accelerators_per_pod,
        attempt,
        config_hash,
        scratch.judge_scratch_limits(spec, judge_config),
    )


def build_pods(
    job: JobRef,
    spec: api.RLJobSpec,
    layout: JobLayout,
    *,
    attempt: int = 0,
    config_hash: str = "",
    model_config: dict[str, Any] | None = None,
    judge_config: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Every desired Ray pod in creation order: trainer 0..n-1 (head first), rollout 0..m-1, then
    judge 0..k-1 (the environment servers are `environments.build_environment_pods`)."""
    common = {"attempt": attempt, "config_hash": config_hash, "model_config": model_config}
    trainers = [build_trainer_pod(job, spec, layout, i, **common) for i in range(layout.trainer_pods)]
    rollouts = [build_rollout_pod(job, spec, layout, j, **common) for j in range(layout.rollout_pods)]
    judges = [
        build_judge_pod(
            job, spec, layout, k, attempt=attempt, config_hash=config_hash, judge_config=judge_config
        )
        for k in range(layout.judge_pods)
    ]
    return trainers + rollouts + judges

"""The job's ConfigMaps: `<job>-config` (trainer.json, docs/contracts.md §1) and `<job>-telemetry` (§3).

Role: `render_trainer_config` maps an `RLJobSpec` + plan onto `rljob_trainer.config.TrainerConfig`
(the trainer's own contract), `build_config_map` wraps it; `build_telemetry_config_map` makes the
empty report history the driver later patches. Pure; called by `rljob_operator.handlers`.
Spec choices this trainer image cannot run raise `errors.InvalidSpecError` naming the field.
"""

from __future__ import annotations

import json
from typing import Any

import pydantic

from rljob_operator import api, errors, names, quantity
from rljob_operator.builders import endpoint
from rljob_operator.builders.common import JobRef, compute_layout
from rljob_trainer import config as tc
from rljob_trainer.outputs import telemetry

# Mount points inside the pods of the volumes the trainer config refers to.
MODEL_MOUNT_DIR = "/models"
JUDGE_MODEL_MOUNT_DIR = "/judge-model"  # spec.reward.judge.model.source.pvc, in trainer and judge pods
DATA_MOUNT_DIR = "/data"
DATA_CONFIGMAP_MOUNT_DIR = "/etc/rljob-data"
REWARD_MOUNT_DIR = "/etc/rljob-rewards"  # reward module i's volume at <dir>/<i>
HF_TOKEN_ENV = "HF_TOKEN"
JUDGE_HF_TOKEN_ENV = "JUDGE_HF_TOKEN"  # spec.reward.judge.model.source.hub.tokenSecretRef
HF_DATA_TOKEN_ENV = "HF_DATASETS_TOKEN"
HF_ENDPOINT_ENV = "HF_ENDPOINT"
# Ray CPUs each actor of an accelerator job reserves: the accelerators carry the placement (a GPU pod
# has CPUs to spare), so a CPU reservation must never be what keeps an engine off its accelerator.
ACCELERATOR_ACTOR_CPUS = 0.1

_LOSS_AGG = {
    "sequenceMean": "seq-mean-token-mean",
    "tokenMean": "token-mean",
    "sequenceSumNorm": "seq-mean-token-sum-norm",
}
_DEVICE = {"cpu": "cpu", "nvidia": "cuda", "amd": "cuda", "ascend": "npu"}


def _model_settings(spec: api.RLJobSpec, model_config: dict[str, Any] | None) -> dict[str, Any]:
    m = spec.model
    src = m.source
    out: dict[str, Any] = {"name": m.name, "dtype": m.dtype, "finetune": m.finetune.mode}
    if src.pvc is not None:
        out.update(source="pvc", path=f"{MODEL_MOUNT_DIR}/{src.pvc.path.lstrip('/')}")
    elif src.hub is not None:
        out.update(
            source="hub",
            hub_id=src.hub.id,
            hub_token_env=HF_TOKEN_ENV if src.hub.token_secret_ref else None,
            hub_revision=src.hub.revision,
        )
    else:
        if not model_config:
            raise errors.InvalidSpecError(
                "spec.model.config", "a tiny model is built from its config.json: set spec.model.config"
            )
        tokenizer = src.tiny.tokenizer if src.tiny is not None else "builtin-char"
        out.update(source="tiny", tokenizer=tokenizer)
    if model_config:
        out["hf_config"] = dict(model_config)
    lora = m.finetune.lora  # its bounds are the API's (api.LoRASpec), the same as the trainer's
    targets: list[str] | str = (
        "all-linear" if lora.target_modules == ["all-linear"] else list(lora.target_modules)
    )
    out["lora"] = {
        "rank": lora.rank,
        "alpha": float(lora.alpha),
        "dropout": lora.dropout,
        "target_modules": targets,
    }
    return out


def _data_settings(spec: api.RLJobSpec) -> dict[str, Any]:
    return _data_settings_of(spec.data)


def _data_settings_of(d: api.DataSpec) -> dict[str, Any]:
    src = d.source
    out: dict[str, Any] = {
        "prompt_field": d.prompt_field,
        "answer_field": d.answer_field,
        "chat_template": d.chat_template,
        "system_prompt": d.system_prompt,
    }
    if src.reasoning_gym is not None:
        rg = src.reasoning_gym  # generated in the trainer pod: nothing to mount or download
        out.update(
            builtin=None,
            reasoning_gym={
                "task": rg.task,
                "config": dict(rg.config),
                "size": rg.size,
                "seed": rg.seed,
                "answer_format": rg.answer_format,
            },
        )
    elif src.builtin is not None:
        out["builtin"] = src.builtin.name
    elif src.pvc is not None:
        out.update(builtin=None, path=f"{DATA_MOUNT_DIR}/{src.pvc.path.lstrip('/')}")
    elif src.config_map_ref is not None:
        out.update(builtin=None, path=f"{DATA_CONFIGMAP_MOUNT_DIR}/{src.config_map_ref.key}")
    elif src.hub is not None:
        # Read in the trainer pod at start-up (HF_ENDPOINT and the token come in as env vars).
        out.update(
            builtin=None,
            hub_id=src.hub.id,
            hub_subset=src.hub.subset,
            hub_split=src.hub.split,
            hub_token_env=HF_DATA_TOKEN_ENV if src.hub.token_secret_ref else None,
        )
    return out


def reward_module_file(fn: api.RewardModuleSpec, index: int) -> str | None:
    """Where reward module `index`'s .py file is inside the trainer pods (None for an importPath)."""
    if fn.config_map_ref is not None:
        return f"{REWARD_MOUNT_DIR}/{index}/{fn.config_map_ref.key}"
    if fn.pvc is not None:
        return f"{REWARD_MOUNT_DIR}/{index}/{fn.pvc.path.lstrip('/')}"
    return fn.path


def _rollout_settings(spec: api.RLJobSpec, plan: api.PlanStatus) -> dict[str, Any]:
    res = spec.resources
    tp = plan.tensor_parallel or 1
    dedicated = plan.rollout_engines or 0
    shared = plan.shared_engines or 0
    if shared + dedicated < 1:
        shared = 1  # rollout on the trainer accelerators: one colocated engine that sleeps in training
    budget = max(0, res.total_accelerators - (plan.trainer_accelerators or 0)) // tp
    max_dedicated = dedicated
    if res.mode == "adaptive":
        limit = res.adaptive.max_rollout_engines
        max_dedicated = max(dedicated, budget if limit is None else min(limit, budget))
    max_num_seqs = plan.max_num_seqs or res.rollout.max_num_seqs or 256
    mnbt = plan.max_num_batched_tokens or res.rollout.max_num_batched_tokens or 8192
    gpu = res.accelerator.kind != "cpu"
    kind = res.rollout.kind
    engine_lora = spec.model.finetune.mode == "lora" and res.rollout.lora_sync == "adapter"
    return {
        "kind": kind,
        "enable_sleep_mode": res.rollout.enable_sleep_mode,
        # vLLM's level 2 discards the base, which a LoRA-serving vLLM engine cannot reload
        # (engines.vllm_engine); level 1 keeps it in host memory, as verl does for LoRA.
        "sleep_level": 1 if engine_lora and kind == "vllm" else 2,
        # vLLM's CPU backend sizes its KV cache from these bytes, else from a fraction of the host's
        # memory (which fails once several engines share a machine): the plan's on cpu pools, and on
        # accelerator pools what maxNumSeqs sequences need (what a CPU stand-in of the node runs).
        "cpu_kv_cache_bytes": plan.cpu_kv_cache_bytes or None,
        "engine_lora": engine_lora,
        "engine_num_cpus": ACCELERATOR_ACTOR_CPUS if gpu else 1.0,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max(mnbt, max_num_seqs),
        "gpu_memory_utilization": res.rollout.gpu_memory_utilization,
        "tensor_parallel": tp,
        "shared_engines": shared,
        "dedicated_engines": dedicated,
        "max_dedicated_engines": max_dedicated,
        "engine_timeout_s": res.rollout.engine_timeout_seconds,
        "weight_sync": "object-store" if res.rollout.weight_sync == "objectStore" else "collective",
        "chunk_prompt_groups": res.rollout.chunk_prompt_groups,
        "partial_rollouts": res.rollout.partial_rollouts,
    }


# spec.grpo.policyLoss -> the trainer's registered loss (rljob_trainer.train.algos); "-tis" with TIS.
_POLICY_LOSS = {"ppo": "clipped", "gspo": "gspo"}


def _pipeline_settings(spec: api.RLJobSpec, rollout: dict[str, Any]) -> dict[str, Any]:
    """maxStaleness (default 1 when the job can have dedicated engines, else 0), the policy loss (its
    TIS variant when the pipeline runs ahead, unless spec.grpo.rolloutCorrection says what to do),
    the rollout correction and DAPO's dynamic sampling."""
    g = spec.grpo
    staleness = g.max_staleness
    if staleness is None:
        staleness = 1 if rollout["max_dedicated_engines"] > 0 else 0
    loss = _POLICY_LOSS[g.policy_loss]
    out: dict[str, Any] = {
        "max_staleness": staleness,
        "policy_loss": loss,
        "clip_ratio_c": g.clip_ratio_c,
        "max_skipped_steps": g.max_skipped_steps,
        "dynamic_sampling": {
            "enabled": g.dynamic_sampling.enabled,
            "max_generation_rounds": g.dynamic_sampling.max_generation_rounds,
        },
    }
    if g.rollout_correction is not None:
        # Replaces tisCap, at every staleness: the trainer weighs by these (plain loss names).
        out["rollout_correction"] = _rollout_correction_settings(g.rollout_correction)
    elif staleness > 0 and g.tis_cap > 0:
        out.update(policy_loss=f"{loss}-tis", tis_cap=g.tis_cap)
    return out


def _rollout_correction_settings(rc: api.RolloutCorrectionSpec) -> dict[str, Any]:
    """spec.grpo.rolloutCorrection as the trainer's grpo.rollout_correction."""
    imp, rej = rc.importance_sampling, rc.rejection
    return {
        "is_level": None if imp.level == "none" else imp.level,
        "is_mode": imp.mode,
        "is_lower": imp.lower,
        "is_upper": imp.upper,
        "reject_level": rej.level if rej is not None else None,
        "reject_lower": rej.lower if rej is not None else None,
        "reject_upper": rej.upper if rej is not None else 2.0,
    }


def _evaluation_settings(spec: api.RLJobSpec) -> dict[str, Any] | None:
    """spec.evaluation for the trainer; its data is read where spec.data's volumes are mounted."""
    ev = spec.evaluation
    if ev is None:
        return None
    src, train = ev.data.source, spec.data.source
    if src.pvc is not None and (train.pvc is None or train.pvc.claim_name != src.pvc.claim_name):
        raise errors.InvalidSpecError(
            "spec.evaluation.data.source.pvc",
            "held-out data on a claim must be on spec.data's own claim (the one the trainer pods mount); "
            "put the file there or use a builtin or hub source",
        )
    if src.config_map_ref is not None and (
        train.config_map_ref is None or train.config_map_ref.name != src.config_map_ref.name
    ):
        raise errors.InvalidSpecError(
            "spec.evaluation.data.source.configMapRef",
            "held-out data in a ConfigMap must be in spec.data's own ConfigMap (the one the trainer pods "
            "mount), under another key",
        )
    data = _data_settings_of(ev.data)
    if (
        src.hub is not None
        and src.hub.token_secret_ref is not None
        and src.hub.token_secret_ref != (train.hub.token_secret_ref if train.hub is not None else None)
    ):
        raise errors.InvalidSpecError(
            "spec.evaluation.data.source.hub.tokenSecretRef",
            "the trainer pods carry only spec.data's hub token: use the same tokenSecretRef or none",
        )
    return {
        "data": data,
        "every_steps": ev.every_steps,
        "max_samples": ev.max_samples,
        "temperature": ev.sampling.temperature,
        "top_p": ev.sampling.top_p,
        "samples_per_prompt": ev.sampling.samples_per_prompt,
        "before_training": ev.before_training,
    }


def _agent_settings(spec: api.RLJobSpec) -> dict[str, Any] | None:
    """spec.rollout.agent as the trainer's `agent`: tools and turns as written."""
    agent = spec.rollout.agent
    if agent is None:
        return None
    tools = [
        {
            "name": t.name,
            "kind": t.kind,
            "description": t.description,
            "url": t.url,
            "parameters": dict(t.parameters) if t.parameters is not None else None,
            "timeout_s": t.timeout_seconds,
            "cpu_seconds": t.cpu_seconds,
            "memory_bytes": quantity.to_bytes(t.memory),
            "max_result_chars": t.max_result_chars,
        }
        for t in agent.tools
    ]
    return {
        "max_turns": agent.max_turns,
        "max_total_tokens": agent.max_total_tokens,
        "tools": tools,
        "environment": agent.environment,
        "demonstrations": [
            {"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
            for m in agent.demonstrations
        ],
    }


def _environment_settings(job: JobRef | None, spec: api.RLJobSpec) -> list[dict[str, Any]]:
    """Each spec.environments[] entry as the trainer reaches it: its headless Service's URL and each
    replica's (offline, without a job, those a job named `<job>` in namespace `<namespace>` would get)."""
    name, namespace = (job.name, job.namespace) if job is not None else ("<job>", "<namespace>")
    return [
        {
            "name": e.name,
            "url": names.environment_url(name, namespace, e.name, e.port),
            "replica_urls": [
                names.environment_replica_url(name, namespace, e.name, i, e.port) for i in range(e.replicas)
            ],
            "timeout_s": e.timeout_seconds,
            "task": dict(e.task_config) if e.task_config is not None else e.task,
            "mode": e.mode,
        }
        for e in spec.environments
    ]


def _judge_settings(
    spec: api.RLJobSpec, plan: api.PlanStatus, judge_config: dict[str, Any] | None
) -> dict[str, Any] | None:
    """spec.reward.judge with the estimator's engine plan (status.plan.judge)."""
    judge = spec.reward.judge
    if judge is None:
        return None
    sized = plan.judge
    if sized is None:
        raise errors.InvalidSpecError(
            "spec.reward.judge",
            "the plan has no judge engines (an operator error: the judge was not planned)",
        )
    m = judge.model
    model: dict[str, Any] = {"name": m.name, "dtype": m.dtype, "finetune": "full"}
    if m.source.pvc is not None:
        model.update(source="pvc", path=f"{JUDGE_MODEL_MOUNT_DIR}/{m.source.pvc.path.lstrip('/')}")
    elif m.source.hub is not None:
        model.update(
            source="hub",
            hub_id=m.source.hub.id,
            hub_token_env=JUDGE_HF_TOKEN_ENV if m.source.hub.token_secret_ref else None,
            hub_revision=m.source.hub.revision,
        )
    else:
        if not judge_config:
            raise errors.InvalidSpecError(
                "spec.reward.judge.model.config", "a tiny judge is built from its config.json: set it"
            )
        tokenizer = m.source.tiny.tokenizer if m.source.tiny is not None else "builtin-char"
        model.update(source="tiny", tokenizer=tokenizer)
    if judge_config:
        model["hf_config"] = dict(judge_config)
    return {
        "kind": judge.kind,
        "model": model,
        "prompt_template": judge.prompt_template,
        "max_score": judge.max_score,
        "max_tokens": judge.max_tokens,
        "weight": judge.weight,
        "engines": sized.engines or judge.engines,
        "tensor_parallel": sized.tensor_parallel or 1,
        "gpu_memory_utilization": judge.gpu_memory_utilization,
        "max_model_len": sized.max_model_len,
        "max_num_seqs": sized.max_num_seqs or 1,
        "max_num_batched_tokens": max(sized.max_num_batched_tokens or 1, sized.max_num_seqs or 1),
        "cpu_kv_cache_bytes": sized.cpu_kv_cache_bytes or None,
        "batch_size": judge.batch_size,
        "timeout_s": judge.timeout_seconds,
    }


# Env vars the trainer pods get from the tracking Secrets (spec.tracking.*SecretRef).
WANDB_API_KEY_ENV = "WANDB_API_KEY"
MLFLOW_TOKEN_ENV = "MLFLOW_TRACKING_TOKEN"


def _tracking_settings(spec: api.RLJobSpec) -> dict[str, Any]:
    t = spec.tracking
    out: dict[str, Any] = {}
    if t.wandb is not None:
        w = t.wandb
        out["wandb"] = {
            "project": w.project,
            "entity": w.entity,
            "run_name": w.run_name,
            "mode": w.mode,
            "api_key_env": WANDB_API_KEY_ENV,
        }
    if t.mlflow is not None:
        m = t.mlflow
        out["mlflow"] = {"tracking_uri": m.tracking_uri, "experiment": m.experiment, "run_name": m.run_name}
    return out


def render_trainer_config(
    spec: api.RLJobSpec,
    plan: api.PlanStatus,
    model_config: dict[str, Any] | None = None,
    *,
    job: JobRef | None = None,
    judge_config: dict[str, Any] | None = None,
) -> tc.TrainerConfig:
    """The trainer's configuration for `spec` under `plan` (`model_config`: the config.json used to plan;
    `job`: whose Services the environments' URLs name; `judge_config`: the judge model's config.json).

    Raises `errors.InvalidSpecError` for a spec this trainer image cannot run.
    """
    g = spec.grpo  # api.LossNormalization names exactly the keys of _LOSS_AGG (a unit test checks)
    b = spec.batching
    gpu = spec.resources.accelerator.kind != "cpu"
    rewards = []
    for i, fn in enumerate(spec.reward.functions):
        item: dict[str, Any] = {"name": fn.name, "weight": fn.weight}
        if fn.module is not None:
            item.update(
                import_path=fn.module.import_path,
                path=reward_module_file(fn.module, i),
                function=fn.module.function,
            )
        rewards.append(item)
    # Ranks per trainer pod, as the pods are laid out (a plan without trainer accelerators: one rank).
    rollout = _rollout_settings(spec, plan)
    pod_ranks = list(compute_layout(spec, plan).trainer_accelerators) if plan.trainer_accelerators else [1]
    data = {
        "model": _model_settings(spec, model_config),
        "lengths": {
            "max_prompt_tokens": spec.lengths.max_prompt_tokens,
            "max_response_tokens": spec.lengths.max_completion_tokens,
        },
        "grpo": {
            "group_size": g.group_size,
            "prompts_per_step": g.prompts_per_step,
            "max_steps": g.max_steps,
            "mini_batches_per_step": g.mini_batches_per_step,
            "ppo_epochs": g.ppo_epochs,
            "learning_rate": g.learning_rate,
            "clip_low": g.clip_ratio_low,
            "clip_high": g.clip_ratio_high,
            "kl_coef": g.kl_coef,
            "loss_agg": _LOSS_AGG[g.loss_normalization],
            "temperature": g.temperature,
            "top_p": g.top_p,
            "grad_clip": g.grad_clip if g.grad_clip > 0 else 1.0e12,
            "seed": g.seed,
            **_pipeline_settings(spec, rollout),
        },
        "batching": {
            "packed": b.packing == "packed",
            "dynamic": b.micro_batching == "dynamic",
            "micro_batch_size": b.micro_batch_size,
            "max_tokens_per_micro_batch": b.max_tokens_per_micro_batch or 8192,
            "dp_balance": b.dp_balance,
        },
        "rollout": rollout,
        "data": _data_settings(spec),
        "rewards": rewards,
        "checkpoint": {
            "dir": spec.checkpoint.path,
            "interval_steps": spec.checkpoint.interval_steps or g.max_steps,
        },
        "export": {
            "every_checkpoint": spec.export.every_checkpoint,
            "final": spec.export.final,
            "merge_lora": spec.export.merge_lora,
        },
        "tracking": _tracking_settings(spec),
        "evaluation": _evaluation_settings(spec),
        "agent": _agent_settings(spec),
        "environments": _environment_settings(job, spec),
        "endpoint": endpoint.trainer_settings(job, spec),
        "judge": _judge_settings(spec, plan, judge_config),
        "telemetry": {"enabled": True},
        "distributed": {
            "num_trainer_ranks": plan.trainer_accelerators or 1,
            "device": _DEVICE[spec.resources.accelerator.kind],
            "launcher": "ray",
            "accelerator": tc.RAY_ACCELERATORS[spec.resources.accelerator.kind],
            "trainer_pod_ranks": pod_ranks,
            "rank_num_cpus": ACCELERATOR_ACTOR_CPUS if gpu else 1.0,
            "torch_threads_per_rank": cpu_rank_threads(spec, max(pod_ranks)),
        },
    }
    try:
        return tc.TrainerConfig.model_validate(data)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise errors.InvalidSpecError(
            "spec", f"the rendered trainer config is invalid at {where}: {first['msg']}"
        ) from exc


def cpu_rank_threads(spec: api.RLJobSpec, ranks_per_pod: int) -> int | None:
    """On cpu pools, each training rank's torch threads: its share of the trainer pod's CPUs (at least
    one); None elsewhere (an accelerator does the work). Ray reserves one CPU for a rank actor and sets
    its OMP_NUM_THREADS to that, so without this a rank of a 2-CPU pod trained on one core (SmolLM2
    on the local cluster: a step 50-54 s on one core, 45-51 s on two)."""
    cpu = spec.resources.pod_cpu
    if spec.resources.accelerator.kind != "cpu" or cpu is None:
        return None
    return max(1, int(quantity.parse(cpu) // max(ranks_per_pod, 1)))


def build_config_map(
    job: JobRef,
    spec: api.RLJobSpec,
    plan: api.PlanStatus,
    model_config: dict[str, Any] | None = None,
    *,
    judge_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`<job>-config` with key `trainer.json` (camelCase JSON, exactly `rljob_trainer.config.dump_config`)."""
    cfg = render_trainer_config(spec, plan, model_config, job=job, judge_config=judge_config)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": names.config_map_name(job.name),
            "namespace": job.namespace,
            "labels": names.object_labels(job.name, names.ROLE_CONFIG),
        },
        "data": {tc.CONFIGMAP_KEY: tc.dump_config(cfg)},
    }


def build_telemetry_config_map(job: JobRef) -> dict[str, Any]:
    """`<job>-telemetry` with an empty report history; the driver is its only writer afterwards,
    so the operator creates it once and never overwrites it."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": names.telemetry_config_map_name(job.name),
            "namespace": job.namespace,
            "labels": names.object_labels(job.name, names.ROLE_TELEMETRY),
        },
        "data": {telemetry.REPORTS_KEY: json.dumps([])},
    }

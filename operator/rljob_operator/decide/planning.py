"""From an RLJob spec to the estimator's plan: the one adapter between `api` and `estimator`.

Called by the operator's reconcile (`steps._compute_plan`) and by `rljob plan`, so both see the
same numbers; `plan_status` is the plan as `status.plan` and the builders see it; `refit_job` and
`refit_status` are the plan refitted from the job's SyncReports (`status.plan.refit`, `rljob plan
--from-job`). Pure: the model config and the reports are passed in, already read by the caller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rljob_operator import api, errors
from rljob_operator import estimator as est
from rljob_operator import quantity as quantity_mod
from rljob_operator.estimator import refit as refit_mod
from rljob_trainer.outputs import telemetry

# CPU jobs (kind cpu) have no accelerator: plan them on a nominal "device" so the KV arithmetic
# still explains the engine settings, and sizes the KV cache vLLM's CPU engine is given. Its memory
# is one worker's share of the pod's memory (spec.resources.memory, else the API's default for the
# rollout engine; a pod holds acceleratorsPerNode workers); bandwidth and peak are those of a few
# server cores, which only matter for the (unused) estimate/adaptive split of a CPU job.
CPU_DEVICE_NAME = "cpu"
CPU_BANDWIDTH_BYTES_PER_S = 20e9
CPU_FLOPS_PER_S = 0.5e12


def quantity_bytes(quantity: int | str) -> int:
    """A Kubernetes memory quantity (8Gi, 500M, 1073741824) in bytes."""
    return quantity_mod.to_bytes(quantity)


def cpu_device_memory_bytes(spec: api.RLJobSpec) -> int:
    """The nominal CPU device's memory: the pod's memory over its acceleratorsPerNode workers."""
    res = spec.resources
    memory = res.pod_memory or api.CPU_POD_MEMORY_DEFAULTS[res.rollout.kind]  # never unset on a cpu job
    return quantity_bytes(memory) // res.accelerators_per_node


def _cpu_device_reason(spec: api.RLJobSpec) -> str:
    res = spec.resources
    source = (
        f"spec.resources.memory {res.memory}"
        if res.memory is not None
        else f"spec.resources.memory unset: {res.pod_memory}, the default of a cpu job with rollout.kind "
        f"{res.rollout.kind}"
    )
    per = f" / acceleratorsPerNode {res.accelerators_per_node}" if res.accelerators_per_node > 1 else ""
    gib = cpu_device_memory_bytes(spec) / 2**30
    return (
        f"cpu pool: the engine is planned on a nominal CPU device of {gib:.2f} GiB = {source}{per}; "
        "its KV cache is rendered as vLLM's kv_cache_memory_bytes "
        "(trainer.json rollout.cpuKvCacheBytes)"
    )


def _head_dim_source(config: dict[str, Any]) -> str:
    """Where `ModelGeometry.head_dim` came from, in the config's own words (for the refusal)."""
    text = config.get("text_config")
    part, prefix = (text, "text_config.") if isinstance(text, dict) else (config, "")
    explicit = part.get("head_dim")
    if isinstance(explicit, int) and not isinstance(explicit, bool) and explicit > 0:
        return f"{prefix}head_dim"
    return (
        f"{prefix}hidden_size {part.get('hidden_size')} / {prefix}num_attention_heads "
        f"{part.get('num_attention_heads')}"
    )


def _model_config_source(spec: api.RLJobSpec) -> str:
    source = spec.model.config
    if source.preset is not None:
        return f"spec.model.config.preset {source.preset}"
    if source.config_map_ref is not None:
        ref = source.config_map_ref
        return f"spec.model.config.configMapRef {ref.name}/{ref.key}"
    return "spec.model.config.inline"


def check_rollout_engine(spec: api.RLJobSpec, model_config: dict[str, Any]) -> None:
    """Refuse a model the job's rollout engine cannot run on its pool: vLLM's CPU attention takes the
    head sizes `api.VLLM_CPU_ATTENTION_HEAD_SIZES` only (MLA models use its CPU MLA backends instead).
    Raises `errors.UnsupportedHeadSizeError` naming spec.model, the head size and both fixes; the CEL
    rule refuses the same at `kubectl apply` where the config is inline with an explicit head_dim."""
    _check_cpu_head_size(
        spec,
        model_config,
        field="spec.model",
        what=f"{_head_dim_source(model_config)} of {_model_config_source(spec)}",
        serves="runs vLLM's CPU build",
    )


def _check_cpu_head_size(
    spec: api.RLJobSpec, model_config: dict[str, Any], *, field: str, what: str, serves: str
) -> None:
    """A model served by vLLM's CPU build (a cpu pool with rollout.kind vllm) needs a head size its
    attention runs: `field` names the model in the error, `what` where its head_dim came from."""
    res = spec.resources
    if res.accelerator.kind != "cpu" or res.rollout.kind != "vllm":
        return
    model = est.ModelGeometry.from_hf_config(model_config)
    if model.mla is not None or model.head_dim in api.VLLM_CPU_ATTENTION_HEAD_SIZES:
        return
    sizes = ", ".join(map(str, api.VLLM_CPU_ATTENTION_HEAD_SIZES))
    raise errors.UnsupportedHeadSizeError(
        field,
        f"head_dim {model.head_dim} ({what}) is not a head size vLLM's CPU attention runs ({sizes}), and "
        f"accelerator.kind cpu with spec.resources.rollout.kind vllm {serves}: use a model with one of "
        "those head sizes, or set spec.resources.rollout.kind to transformers",
    )


def _devices(spec: api.RLJobSpec) -> tuple[str, tuple[est.DeviceSpec, ...]]:
    accelerator = spec.resources.accelerator
    if accelerator.kind == "cpu":
        device = est.DeviceSpec(
            name=CPU_DEVICE_NAME,
            memory_bytes=cpu_device_memory_bytes(spec),
            hbm_bandwidth_bytes_per_s=CPU_BANDWIDTH_BYTES_PER_S,
            bf16_flops_per_s=CPU_FLOPS_PER_S,
            resource_name="cpu",
            vendor="other",
        )
        return CPU_DEVICE_NAME, (device,)
    name = accelerator.model or ""
    if accelerator.custom is None:
        return name, ()
    custom = accelerator.custom
    device = est.DeviceSpec(
        name=name,
        memory_bytes=int(custom.memory_gib * 1024**3),
        hbm_bandwidth_bytes_per_s=custom.hbm_bandwidth_gbps * 1e9,
        bf16_flops_per_s=custom.bf16_tflops * 1e12,
        resource_name=accelerator.resource_name or api.DEFAULT_RESOURCE_NAMES[accelerator.kind],
        vendor={"nvidia": "nvidia", "amd": "amd", "ascend": "huawei"}.get(accelerator.kind, "other"),
    )
    return name, (device,)


def plan_request_from_spec(spec: api.RLJobSpec, model_config: dict[str, Any]) -> est.PlanRequest:
    """The estimator's inputs, read from the spec; `model_config` is the model's config.json.

    Raises `errors.UnsupportedHeadSizeError` for a model the job's rollout engine cannot run there."""
    check_rollout_engine(spec, model_config)
    resources, lengths, batching = spec.resources, spec.lengths, spec.batching
    accelerator, custom_devices = _devices(spec)
    static = resources.static
    rollout = resources.rollout
    micro_batch_tokens = batching.max_tokens_per_micro_batch or (
        batching.micro_batch_size * (lengths.max_prompt_tokens + lengths.max_completion_tokens)
    )
    return est.PlanRequest(
        hf_config=model_config,
        dtype=spec.model.dtype,
        lora=spec.model.finetune.mode == "lora",
        lora_rank=spec.model.finetune.lora.rank,
        kl_reference=spec.model.finetune.mode == "full" and spec.grpo.kl_coef > 0,
        accelerator=accelerator,
        custom_devices=custom_devices,
        total_accelerators=resources.total_accelerators,
        accelerators_per_node=resources.accelerators_per_node,
        mode=resources.mode,
        trainer_accelerators=static.trainer_accelerators if static else None,
        rollout_accelerators=static.rollout_accelerators if static else None,
        tensor_parallel=rollout.tensor_parallel,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        max_num_seqs=rollout.max_num_seqs,
        max_num_batched_tokens=rollout.max_num_batched_tokens,
        max_prompt_tokens=lengths.max_prompt_tokens,
        max_completion_tokens=lengths.max_completion_tokens,
        max_model_len=lengths.max_model_len,
        prompts_per_step=spec.grpo.prompts_per_step,
        group_size=spec.grpo.group_size,
        micro_batch_tokens=micro_batch_tokens,
        kv_cache_dtype=rollout.kv_cache_dtype,
        engine_kind=rollout.kind,
    )


def judge_config_source(spec: api.RLJobSpec) -> api.ModelConfigSource | None:
    """Where the judge model's config.json comes from (None: the job has no judge)."""
    return spec.reward.judge.model.config if spec.reward.judge is not None else None


def _check_judge_engine(spec: api.RLJobSpec, judge: api.JudgeSpec, judge_config: dict[str, Any]) -> None:
    """vLLM's CPU attention takes a fixed list of head sizes: a judge outside it cannot run on a cpu
    pool's vLLM engine (as `check_rollout_engine` says of the policy)."""
    _check_cpu_head_size(
        spec,
        judge_config,
        field="spec.reward.judge.model",
        what=f"{_head_dim_source(judge_config)} of the judge {judge.model.name}",
        serves="serves the judge with vLLM's CPU build",
    )


#: What a reward model's config.json names as its architecture: a score head on a decoder.
REWARD_MODEL_ARCHITECTURE_SUFFIX = "ForSequenceClassification"


def _check_reward_model(judge: api.JudgeSpec, judge_config: dict[str, Any]) -> None:
    """A judge of kind rewardModel is a sequence-classification model of one label (what the trainer
    image scores with: its raw logit). Weights it loads must say so in their config.json; a tiny one is
    built so, with one label unless id2label says otherwise."""
    architectures = [str(a) for a in judge_config.get("architectures") or []]
    loaded = judge.model.source.tiny is None
    if loaded and not any(a.endswith(REWARD_MODEL_ARCHITECTURE_SUFFIX) for a in architectures):
        raise errors.InvalidSpecError(
            "spec.reward.judge.model",
            f"kind rewardModel scores with a sequence-classification head, and {judge.model.name}'s "
            f"config.json names {architectures or 'no architectures'}: use a reward model "
            f"(...{REWARD_MODEL_ARCHITECTURE_SUFFIX}), or kind llm with a promptTemplate for a generative "
            "judge",
        )
    if "id2label" in judge_config:
        labels = len(judge_config["id2label"] or {})
    else:  # transformers' default where config.json says nothing: two labels
        labels = int(judge_config.get("num_labels", 2 if loaded else 1))
    if labels != 1:
        raise errors.InvalidSpecError(
            "spec.reward.judge.model",
            f"{judge.model.name}'s classification head has {labels} labels (config.json id2label); a reward "
            "model scores with one: use a reward model of one label, or kind llm",
        )


def plan_judge(spec: api.RLJobSpec, judge_config: dict[str, Any] | None) -> est.JudgePlan | None:
    """The judge's engines on the job's accelerator (None without spec.reward.judge). Raises
    `EstimatorError`, and `InvalidSpecError` when the judge's config.json is missing."""
    judge = spec.reward.judge
    if judge is None:
        return None
    if not judge_config:
        raise errors.InvalidSpecError(
            "spec.reward.judge.model.config", "the judge's config.json is needed to size its engines"
        )
    if judge.kind == "rewardModel":
        _check_reward_model(judge, judge_config)
    _check_judge_engine(spec, judge, judge_config)
    name, custom = _devices(spec)
    device = est.get_device(name, custom)
    agent = spec.rollout.agent
    response_tokens = spec.lengths.max_completion_tokens
    if agent is not None and agent.max_total_tokens is not None:
        response_tokens = agent.max_total_tokens
    request = est.JudgeRequest(
        hf_config=judge_config,
        dtype=judge.model.dtype,
        device=device,
        accelerators_per_node=spec.resources.accelerators_per_node,
        engines=judge.engines,
        tensor_parallel=judge.tensor_parallel,
        gpu_memory_utilization=judge.gpu_memory_utilization,
        kind=judge.kind,
        prompt_template=judge.prompt_template,
        max_prompt_tokens=spec.lengths.max_prompt_tokens,
        max_response_tokens=response_tokens,
        max_answer_tokens=judge.max_tokens,
        responses_per_step=spec.grpo.prompts_per_step * spec.grpo.group_size,
        engine_kind=spec.resources.rollout.kind,
    )
    return est.plan_judge(request)


def plan_job(spec: api.RLJobSpec, model_config: dict[str, Any]) -> est.ResourcePlan:
    """The plan the operator applies and `rljob plan` prints. Raises `EstimatorError`."""
    plan = est.plan_resources(plan_request_from_spec(spec, model_config))
    if spec.resources.accelerator.kind != "cpu":
        return plan
    return plan.model_copy(update={"reasons": (_cpu_device_reason(spec), *plan.reasons)})


# status.plan keeps the reasons readable in `kubectl get -o yaml` without growing the object unbounded.
MAX_PLAN_REASONS = 64


def judge_status(judge: est.JudgePlan) -> api.JudgePlanStatus:
    """The judge's plan as `status.plan.judge`."""
    return api.JudgePlanStatus(
        engines=judge.engines,
        tensor_parallel=judge.tensor_parallel,
        accelerators=judge.accelerators,
        max_model_len=judge.max_model_len,
        kv_cache_bytes=judge.kv_cache_bytes,
        cpu_kv_cache_bytes=judge.cpu_kv_cache_bytes,
        kv_cache_tokens=judge.kv_cache_tokens,
        max_num_seqs=judge.max_num_seqs,
        max_num_batched_tokens=judge.max_num_batched_tokens,
        reasons=list(judge.reasons)[:32],
    )


def plan_status(plan: est.ResourcePlan, judge: est.JudgePlan | None = None) -> api.PlanStatus:
    """The estimator's plan (and the judge's, if any) as the RLJob status and the builders see it."""
    return api.PlanStatus(
        judge=judge_status(judge) if judge is not None else None,
        trainer_accelerators=plan.trainer_accelerators,
        rollout_accelerators=plan.rollout_accelerators,
        rollout_engines=plan.rollout_engines,
        shared_engines=plan.shared_engines,
        tensor_parallel=plan.tensor_parallel,
        kv_bytes_per_token=plan.kv_bytes_per_token,
        kv_cache_bytes=plan.kv_cache_bytes,
        cpu_kv_cache_bytes=plan.cpu_kv_cache_bytes,
        kv_cache_tokens=plan.kv_cache_tokens,
        max_num_seqs=plan.max_num_seqs,
        max_num_batched_tokens=plan.max_num_batched_tokens,
        reasons=list(plan.reasons)[:MAX_PLAN_REASONS],
    )


@dataclasses.dataclass(frozen=True)
class JobRefit:
    """A job's plan refitted from its reports: the request and plan it was made from, and the fit."""

    request: est.PlanRequest
    plan: est.ResourcePlan
    fit: refit_mod.Refit

    def engine_curve(self, max_engines: int) -> refit_mod.EngineCurve:
        """The refitted step model at 1..max_engines engines (what the adaptive policy reads)."""
        return refit_mod.engine_curve(self.request, self.plan, self.fit, max_engines=max_engines)


def refit_job(
    spec: api.RLJobSpec, model_config: dict[str, Any], reports: Sequence[telemetry.SyncReport]
) -> JobRefit | None:
    """The job's plan against its SyncReports (None while none is usable). Raises `EstimatorError`
    like `plan_job`."""
    request = plan_request_from_spec(spec, model_config)
    plan = est.plan_resources(request)
    fit = refit_mod.refit(request, plan, reports)
    return None if fit is None else JobRefit(request, plan, fit)


def refit_message(fit: refit_mod.Refit) -> str:
    """The comparison in one sentence (status.plan.refit.message, the CLI's summary)."""
    d = fit.decode_tokens_per_s_per_engine
    t = fit.training_tokens_per_s
    parts = [
        f"steps {fit.from_step}-{fit.to_step}: the plan predicted a {fit.predicted_step_s:.3g} s step, "
        f"the job measured {fit.measured_step_s:.3g} s (predicted/measured {fit.step_time_ratio:.3g})",
        f"decode ran at x{1 / fit.decode_scale:.3g} the planned rate",
        f"training at x{1 / fit.training_scale:.3g}",
    ]
    if d.measured is not None:
        parts[1] += f" ({d.measured:.0f} vs {d.planned:.0f} tokens/s per engine)"
    if t.measured is not None:
        parts[2] += f" ({t.measured:.0f} vs {t.planned:.0f} tokens/s)"
    p = fit.plan
    parts.append(
        f"with the measured rates the estimator plans {p.trainer_accelerators} trainer accelerator(s) and "
        f"{p.rollout_engines} dedicated engine(s), a {p.step_time_s:.3g} s step"
    )
    return "; ".join(parts)


def _rate(rate: refit_mod.Rate) -> api.RefitRate:
    return api.RefitRate(
        planned=round(rate.planned, 3), measured=None if rate.measured is None else round(rate.measured, 3)
    )


def refit_status(fit: refit_mod.Refit) -> api.PlanRefit:
    """The refit as `status.plan.refit` holds it."""
    return api.PlanRefit(
        reports=fit.reports,
        from_step=fit.from_step,
        to_step=fit.to_step,
        predicted_step_seconds=round(fit.predicted_step_s, 3),
        measured_step_seconds=round(fit.measured_step_s, 3),
        step_time_ratio=round(fit.step_time_ratio, 3),
        decode_tokens_per_second_per_engine=_rate(fit.decode_tokens_per_s_per_engine),
        prefill_tokens_per_second_per_engine=_rate(fit.prefill_tokens_per_s_per_engine),
        training_tokens_per_second=_rate(fit.training_tokens_per_s),
        decode_scale=round(fit.decode_scale, 4),
        prefill_scale=round(fit.prefill_scale, 4),
        training_scale=round(fit.training_scale, 4),
        trainer_accelerators=fit.plan.trainer_accelerators,
        rollout_engines=fit.plan.rollout_engines,
        step_seconds=round(fit.plan.step_time_s, 3),
        message=refit_message(fit)[:1024],
    )

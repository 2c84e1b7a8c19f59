"""The judge's engines (spec.reward.judge): sized with the rollout engine's vLLM rules.

Role: `plan_judge(JudgeRequest) -> JudgePlan`. A judge engine serves a model of its own (an LLM
judge asked with a prompt template, or a reward model), on the job's accelerator (or the nominal
CPU device of a cpu pool), one engine per pod. Its requests are the judge prompt (the template, the
episode's prompt and response, the reference answer) plus the judge's answer, so the engine's
max_model_len is that, not the model's whole context: the KV cache then holds many more judge
requests at once. Tensor parallel is the request's, or the smallest that holds the weights and a
useful batch (`rollout.choose_tensor_parallel`, as for rollout engines). Callers: `decide.planning`
(the operator's reconcile and `rljob plan`). Pure; every choice appends a reason.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from rljob_operator import errors
from rljob_operator.estimator import devices, geometry, rollout

#: Tokens a chat template wraps one message in (role markers, BOS, the generation prompt), at most.
CHAT_TEMPLATE_TOKENS = 64
#: Tokens reserved for the reference answer where the template asks for {answer}.
ANSWER_TOKENS = 256
#: What a template placeholder stands for (its own characters are replaced, not sent).
PLACEHOLDERS = ("{prompt}", "{response}", "{answer}")


class JudgeRequest(BaseModel):
    """Plain inputs of the judge's plan (from spec.reward.judge and the job's lengths)."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    hf_config: dict[str, Any] = Field(description="The judge model's config.json.")
    dtype: str | None = Field(None, description="Serving dtype (default: the config's).")
    device: devices.DeviceSpec
    accelerators_per_node: int = Field(gt=0)
    engines: int = Field(gt=0)
    tensor_parallel: int | None = Field(None, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    kind: Literal["llm", "rewardModel"] = "llm"
    prompt_template: str | None = None
    max_prompt_tokens: int = Field(gt=0, description="The episode's prompt, at most.")
    max_response_tokens: int = Field(gt=0, description="The episode's response (all turns), at most.")
    max_answer_tokens: int = Field(1, gt=0, description="The judge's own answer (llm), at most.")
    responses_per_step: int = Field(gt=0, description="Responses the judge scores each step.")
    engine_kind: Literal["vllm", "transformers"] = "vllm"


class JudgePlan(BaseModel):
    """The judge's engines; JSON in camelCase (`rljob plan -o json`'s `judge`)."""

    model_config = ConfigDict(
        frozen=True, alias_generator=to_camel, populate_by_name=True, protected_namespaces=()
    )

    engines: int
    tensor_parallel: int
    accelerators: int = Field(description="engines x tensor_parallel, on top of the job's total.")
    max_model_len: int = Field(description="The longest judge request (prompt + the judge's answer).")
    kv_bytes_per_token: int
    kv_cache_bytes: int
    cpu_kv_cache_bytes: int
    kv_cache_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    weight_bytes_per_rank: int
    reasons: tuple[str, ...]


def template_tokens(template: str | None) -> int:
    """An upper bound on the tokens of `template` without its placeholders: one per UTF-8 byte (a
    byte-level BPE token covers at least one byte)."""
    if not template:
        return 0
    text = template
    for placeholder in PLACEHOLDERS:
        text = text.replace(placeholder, "")
    return len(text.encode("utf-8"))


def request_tokens(request: JudgeRequest) -> tuple[int, str]:
    """The longest judge request in tokens, and how it adds up."""
    template = template_tokens(request.prompt_template)
    answer_slot = ANSWER_TOKENS if request.prompt_template and "{answer}" in request.prompt_template else 0
    answer = request.max_answer_tokens if request.kind == "llm" else 1
    total = (
        CHAT_TEMPLATE_TOKENS
        + template
        + request.max_prompt_tokens
        + request.max_response_tokens
        + answer_slot
        + answer
    )
    parts = [f"chat template {CHAT_TEMPLATE_TOKENS}"]
    if request.kind == "llm":
        parts.append(f"promptTemplate {template} (its UTF-8 bytes)")
    parts += [f"prompt {request.max_prompt_tokens}", f"response {request.max_response_tokens}"]
    if answer_slot:
        parts.append(f"{{answer}} {answer_slot}")
    parts.append(f"judge's answer {answer}" if request.kind == "llm" else "score 1")
    return total, " + ".join(parts)


def plan_judge(request: JudgeRequest) -> JudgePlan:
    """Size the judge's engines. Raises `EstimatorError` when the judge cannot run on the device."""
    model = geometry.ModelGeometry.from_hf_config(request.hf_config)
    if request.dtype is not None:
        geometry.dtype_bytes(request.dtype, "dtype")
        model = model.model_copy(update={"dtype": request.dtype.removeprefix("torch.").lower()})
    device = request.device
    sequence_tokens, how = request_tokens(request)
    if sequence_tokens > model.max_position_embeddings:
        raise errors.InvalidPlanRequestError(
            "spec.reward.judge",
            f"a judge request reaches {sequence_tokens} tokens ({how}), but the judge model takes "
            f"{model.max_position_embeddings} (max_position_embeddings): shorten spec.lengths or the "
            "promptTemplate, or use a judge with a longer context",
        )
    reasons = [
        f"judge {model.model_type}: {model.total_params / 1e9:.2f}B params, head_dim {model.head_dim}; "
        f"{request.engines} engine(s), one pod each, on {device.name} beside the job's accelerators",
        f"judge max_model_len={sequence_tokens}: {how}",
    ]
    engine_kwargs: dict[str, Any] = {
        "sequence_tokens": sequence_tokens,
        "max_model_len": sequence_tokens,
        "gpu_memory_utilization": request.gpu_memory_utilization,
        "block_size_tokens": rollout.block_size_tokens_on(model, device),
        "sequences_per_step": request.responses_per_step,
        "engine_kind": request.engine_kind,
    }
    if request.tensor_parallel is not None:
        engine = rollout.size_engine(model, device, request.tensor_parallel, **engine_kwargs)
        reasons.append(f"judge tensor_parallel={request.tensor_parallel}: from spec.reward.judge")
    else:
        engine, tp_reason = rollout.choose_tensor_parallel(
            model,
            device,
            max_tensor_parallel=request.accelerators_per_node,
            useful_batch_sequences=min(rollout.USEFUL_BATCH_SEQUENCES, request.responses_per_step),
            **engine_kwargs,
        )
        reasons.append(f"judge {tp_reason}")
    reasons.extend(f"judge {r}" for r in engine.reasons)
    tp = engine.tensor_parallel
    if device.is_cpu:
        cpu_kv_cache_bytes = engine.kv_cache_bytes
    else:
        layout = rollout.compute_kv_cache_layout(
            model, tp, block_size_tokens=rollout.cpu_block_size_tokens(model)
        )
        blocks = rollout.kv_blocks_for_sequences(
            layout, engine.max_num_seqs, sequence_tokens, sequence_tokens, engine.max_num_batched_tokens
        )
        cpu_kv_cache_bytes = blocks * layout.bytes_per_block
    return JudgePlan(
        engines=request.engines,
        tensor_parallel=tp,
        accelerators=request.engines * tp,
        max_model_len=sequence_tokens,
        kv_bytes_per_token=engine.kv_bytes_per_token,
        kv_cache_bytes=engine.kv_cache_bytes,
        cpu_kv_cache_bytes=cpu_kv_cache_bytes,
        kv_cache_tokens=engine.kv_cache_tokens,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        weight_bytes_per_rank=engine.weight_bytes_per_rank,
        reasons=tuple(reasons),
    )


def format_judge(plan: JudgePlan) -> str:
    """The judge's lines of `rljob plan`'s table: `judge: ...`, then its reasons."""
    head = (
        f"judge: {plan.engines} engine(s) x TP {plan.tensor_parallel} = {plan.accelerators} accelerator(s), "
        f"maxNumSeqs {plan.max_num_seqs}, maxNumBatchedTokens {plan.max_num_batched_tokens}, "
        f"maxModelLen {plan.max_model_len}, KV {plan.kv_cache_bytes / 2**30:.2f} GiB/rank "
        f"({plan.kv_cache_tokens} tokens), CPU KV {plan.cpu_kv_cache_bytes / 2**30:.2f} GiB"
    )
    return "\n".join([head, *(f"  - {r}" for r in plan.reasons)])

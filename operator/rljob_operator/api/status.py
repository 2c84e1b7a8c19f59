"""`status`: conditions, the plan, rollout and queue state, progress; the models an operator writes."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import (
    Field,
    model_validator,
)

from rljob_operator.api.base import ConditionStatus, Phase, Timestamp, _Status


# --------------------------------------------------------------------------------------------
# Status
# --------------------------------------------------------------------------------------------
class Condition(_Status):
    """A condition in the Kubernetes API conventions (metav1.Condition)."""

    type: str = Field(
        min_length=1,
        max_length=316,
        pattern=r"^([a-z0-9.-]+/)?[A-Za-z][A-Za-z0-9]*$",
        description="Condition type in CamelCase, for example Planned, Ready, Progressing.",
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        min_length=1,
        max_length=1024,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        description="CamelCase reason for the last transition, for example EstimateFailed.",
    )
    message: str = Field(
        "", max_length=32768, description="Human-readable detail naming the field and the fix."
    )
    last_transition_time: Timestamp = Field(description="When status last changed.")
    observed_generation: int | None = Field(
        None, ge=0, description="metadata.generation the condition was computed from."
    )


class RefitRate(_Status):
    """One rate (tokens per second) as the plan modelled it and as the job measured it."""

    planned: float | None = Field(None, ge=0, description="The estimator's roofline at the measured lengths.")
    measured: float | None = Field(
        None, ge=0, description="From the job's SyncReports (absent: not measured)."
    )


class PlanRefit(_Status):
    """The plan checked against the job: the rates and step time it measured, and the plan the
    estimator makes with them (`rljob plan --from-job` prints the same)."""

    reports: int | None = Field(None, ge=0, description="SyncReports the refit read.")
    from_step: int | None = Field(None, ge=0, description="First step of those reports.")
    to_step: int | None = Field(None, ge=0, description="Last step of those reports.")
    predicted_step_seconds: float | None = Field(None, ge=0, description="The plan's step time.")
    measured_step_seconds: float | None = Field(
        None, ge=0, description="Median interval between the job's sync points."
    )
    step_time_ratio: float | None = Field(
        None, ge=0, description="Predicted / measured step time (1: the plan was right)."
    )
    decode_tokens_per_second_per_engine: RefitRate | None = Field(None, description="Decode, one engine.")
    prefill_tokens_per_second_per_engine: RefitRate | None = Field(None, description="Prefill, one engine.")
    training_tokens_per_second: RefitRate | None = Field(None, description="The trainer's update.")
    decode_scale: float | None = Field(None, ge=0, description="Measured / modelled decode time.")
    prefill_scale: float | None = Field(None, ge=0, description="Measured / modelled prefill time.")
    training_scale: float | None = Field(None, ge=0, description="Measured / modelled training time.")
    trainer_accelerators: int | None = Field(
        None, ge=0, description="The refitted plan's trainer accelerators."
    )
    rollout_engines: int | None = Field(None, ge=0, description="The refitted plan's dedicated engines.")
    step_seconds: float | None = Field(None, ge=0, description="The refitted plan's step time.")
    message: str | None = Field(None, max_length=1024, description="The comparison in one sentence.")


class JudgePlanStatus(_Status):
    """The judge's engines as the estimator sized them (spec.reward.judge), on the job's accelerator."""

    engines: int | None = Field(None, ge=0, description="Judge engines (pods <job>-judge-<k>).")
    tensor_parallel: int | None = Field(None, ge=1, description="Accelerators per judge engine.")
    accelerators: int | None = Field(
        None,
        ge=0,
        description="Accelerators of all judge engines, on top of spec.resources.totalAccelerators.",
    )
    max_model_len: int | None = Field(
        None, ge=0, description="The longest judge request: template + prompt + response + maxTokens."
    )
    kv_cache_bytes: int | None = Field(
        None, ge=0, description="KV-cache bytes on one accelerator of an engine."
    )
    cpu_kv_cache_bytes: int | None = Field(
        None, ge=0, description="KV-cache bytes per rank a vLLM judge engine is given where it runs on CPU."
    )
    kv_cache_tokens: int | None = Field(None, ge=0, description="Tokens the KV cache of one engine holds.")
    max_num_seqs: int | None = Field(None, ge=0, description="vLLM max_num_seqs per judge engine.")
    max_num_batched_tokens: int | None = Field(
        None, ge=0, description="vLLM max_num_batched_tokens per judge engine."
    )
    reasons: list[str] = Field(
        default_factory=list, max_length=32, description="Why the estimator chose these numbers."
    )


class PlanStatus(_Status):
    """The trainer/rollout plan the estimator (or the static split) chose."""

    trainer_accelerators: int | None = Field(None, ge=0, description="Accelerators of the trainer ranks.")
    rollout_accelerators: int | None = Field(
        None, ge=0, description="Accelerators of dedicated rollout engines."
    )
    rollout_engines: int | None = Field(None, ge=0, description="Dedicated rollout engines.")
    shared_engines: int | None = Field(
        None, ge=0, description="Rollout engines colocated (sleeping) on trainer accelerators."
    )
    tensor_parallel: int | None = Field(None, ge=1, description="Accelerators per rollout engine.")
    kv_bytes_per_token: int | None = Field(
        None, ge=0, description="KV cache bytes per token on one accelerator of an engine."
    )
    kv_cache_bytes: int | None = Field(
        None,
        ge=0,
        description="KV-cache bytes on one accelerator of an engine (on cpu pools at most what maxNumSeqs "
        "sequences need).",
    )
    cpu_kv_cache_bytes: int | None = Field(
        None,
        ge=0,
        description="KV-cache bytes per rank a vLLM engine is given where it runs on CPU (vLLM "
        "kv_cache_memory_bytes): on cpu pools kvCacheBytes; on accelerator pools what maxNumSeqs sequences "
        "need in the blocks of vLLM's CPU backend (what a CPU stand-in of the accelerator node gives its "
        "engine).",
    )
    kv_cache_tokens: int | None = Field(None, ge=0, description="Tokens the KV cache of one engine holds.")
    max_num_seqs: int | None = Field(None, ge=0, description="vLLM max_num_seqs per engine.")
    max_num_batched_tokens: int | None = Field(
        None, ge=0, description="vLLM max_num_batched_tokens per engine."
    )
    reasons: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Why the estimator chose these numbers, one line each.",
    )
    refit: PlanRefit | None = Field(
        None,
        description="The plan refitted from the job's SyncReports: measured rates beside the planned ones, "
        "and the plan the estimator makes with them.",
    )
    judge: JudgePlanStatus | None = Field(None, description="The judge's engines (spec.reward.judge).")


class DrainingPod(_Status):
    """A rollout pod the operator waits on before deleting it (two-phase scale-down)."""

    index: int = Field(..., ge=0, description="Rollout pod index (pod <job>-rollout-<index>).")
    since: Timestamp = Field(..., description="When the target dropped below it: the drain's start.")


class ReplacementBackoff(_Status):
    """A rollout pod recreated alone after its engine was lost: how often in a row, and when its
    replacement pod may be created."""

    index: int = Field(..., ge=0, description="Rollout pod index (pod <job>-rollout-<index>).")
    attempt: int = Field(..., ge=0, description="The run attempt the losses were counted in.")
    replacements: int = Field(
        ..., ge=1, description="Times in a row its engine was lost and the pod recreated alone."
    )
    not_before: Timestamp = Field(
        ...,
        description="The replacement pod is not created before this time: at once after the first loss, "
        "then spec.restartPolicy's backoff (initialBackoffSeconds doubling up to maxBackoffSeconds).",
    )


class RolloutStatus(_Status):
    """Rollout engines now and what adaptive mode last decided."""

    shared_engines: int | None = Field(None, ge=0, description="Colocated engines on trainer accelerators.")
    shared_engines_awake: int | None = Field(None, ge=0, description="Colocated engines awake (serving) now.")
    dedicated_engines: int | None = Field(None, ge=0, description="Dedicated engines running now.")
    desired_shared_awake: int | None = Field(
        None, ge=0, description="Colocated engines the policy wants awake."
    )
    desired_dedicated_engines: int | None = Field(
        None, ge=0, description="Dedicated engines the policy wants."
    )
    idle_accelerators: int | None = Field(None, ge=0, description="Accelerators of the job running nothing.")
    engines_awake_total: str | None = Field(
        None,
        description="Engines serving / all engines, for example 3/4 (filled from the counts above).",
    )
    last_decision: str | None = Field(
        None, description="Last adaptive decision, for example Wake, ScaleUp, Hold."
    )
    last_decision_reason: str | None = Field(
        None, description="Why, with the measured signal and thresholds."
    )
    last_decision_time: Timestamp | None = Field(None, description="When the last decision was made.")
    draining_pods: list[DrainingPod] | None = Field(
        None,
        description="Rollout pods above the dedicated target, kept until the driver releases them "
        "(two-phase scale-down) or resources.rollout.drainGraceSeconds pass.",
    )
    replaced_pods: int | None = Field(
        None,
        ge=0,
        description="Rollout pods recreated alone after their engine was lost (failed, evicted, deleted or "
        "reported lost by the driver); never a gang restart, never counted in failures.",
    )
    replacement_backoff: list[ReplacementBackoff] | None = Field(
        None,
        max_length=1024,
        description="Rollout pods recreated alone, each with its own backoff (a crash-looping engine waits, "
        "the gang does not); an entry goes once its pod has run for 2 × restartPolicy.maxBackoffSeconds.",
    )

    @model_validator(mode="after")
    def _fill_engines_awake_total(self) -> RolloutStatus:
        if self.shared_engines is not None or self.dedicated_engines is not None:
            awake = (self.shared_engines_awake or 0) + (self.dedicated_engines or 0)
            total = (self.shared_engines or 0) + (self.dedicated_engines or 0)
            self.engines_awake_total = f"{awake}/{total}"
        return self


class EnvironmentStatus(_Status):
    """One environment server of the job (spec.environments[]): its pods' readiness and its URL."""

    name: str = Field(description="The spec.environments[] entry.")
    replicas: int = Field(0, ge=0, description="Pods it should have.")
    ready_replicas: int = Field(0, ge=0, description="Pods whose readiness probe passes (the Service's).")
    ready: str | None = Field(None, description="Ready pods / pods, for example 2/2.")
    url: str | None = Field(None, description="Where the trainer reaches it: its Service.")
    message: str | None = Field(
        None, max_length=1024, description="Why a pod is not ready, naming it (absent when all are)."
    )


class QueueStatus(_Status):
    """Where Kueue has the job's Workload (jobs labelled kueue.x-k8s.io/queue-name)."""

    name: str = Field(description="The LocalQueue (label kueue.x-k8s.io/queue-name).")
    workload: str = Field(description="The job's core Workload (trainer + minimum rollout pods).")
    admitted: bool = Field(False, description="Kueue admitted the Workload: the pods may run.")
    cluster_queue: str | None = Field(None, description="The ClusterQueue that admitted it.")
    flavors: list[str] = Field(
        default_factory=list, max_length=64, description="ResourceFlavors the pods were admitted to."
    )
    extra_engines_admitted: int | None = Field(
        None, ge=0, description="Extra dedicated engines (adaptive mode) whose own Workloads are admitted."
    )
    message: str | None = Field(
        None, max_length=1024, description="Kueue's word on the Workload while it waits (quota, eviction)."
    )


class CheckpointRequest(_Status):
    """The operator asks the driver to checkpoint now (cooperative preemption): Kueue evicted or
    preempted the job's Workload. The driver reads it at every sync point, saves a checkpoint and
    acknowledges the id (SyncReport checkpointAck/checkpointAckStep); the pods go once it has, or
    after spec.preemption.checkpointGraceSeconds."""

    id: str = Field(description="Unique per eviction; the driver acknowledges this id.")
    reason: str = Field(description="Why, for example Preempted (Kueue's Evicted reason).")
    request_time: Timestamp = Field(description="When the operator asked; the grace period runs from here.")


class ProgressStatus(_Status):
    """Training progress, reported by the driver at each sync point."""

    step: int | None = Field(None, ge=0, description="Optimizer steps done.")
    max_steps: int | None = Field(None, ge=0, description="Steps the job runs (spec.grpo.maxSteps).")
    mean_reward: float | None = Field(None, description="Mean reward of the last step's completions.")
    loss: float | None = Field(None, description="Policy loss of the last step (mean over its updates).")
    eval_reward: float | None = Field(
        None, description="Mean reward of the latest held-out evaluation (spec.evaluation)."
    )
    tokens_per_second: float | None = Field(
        None, ge=0.0, description="Generated tokens per second over the last step."
    )
    last_sync_time: Timestamp | None = Field(
        None, description="When weights were last synced to the rollout engines."
    )
    export_path: str | None = Field(
        None, description="Newest Hugging Face export in the trainer pod, for example /checkpoints/hf/final."
    )


class RLJobStatus(_Status):
    """Observed state of an RLJob, written only by the operator."""

    phase: Phase | None = Field(
        None,
        description="Pending, Planning, Queued (waiting for Kueue to admit its Workload), Running, "
        "Suspended, Succeeded or Failed.",
    )
    observed_generation: int | None = Field(
        None, ge=0, description="metadata.generation this status reflects."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=32,
        description="Latest observations of the job's state, one per type.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    plan: PlanStatus | None = Field(None, description="The accelerator and engine plan in force.")
    rollout: RolloutStatus | None = Field(None, description="Rollout engines and the last adaptive decision.")
    progress: ProgressStatus | None = Field(None, description="Training progress.")
    environments: list[EnvironmentStatus] | None = Field(
        None, max_length=16, description="Environment servers (spec.environments): ready pods and URLs."
    )
    queue: QueueStatus | None = Field(
        None, description="Kueue admission (only for jobs labelled kueue.x-k8s.io/queue-name)."
    )
    checkpoint_request: CheckpointRequest | None = Field(
        None, description="A pending request to the driver to checkpoint now (Kueue is preempting the job)."
    )
    restarts: int | None = Field(
        None,
        ge=0,
        description="Times the job's pods were restarted, after a failure or a disruption (the run "
        "attempt stamped on pods).",
    )
    failures: int | None = Field(
        None,
        ge=0,
        description="Pod failures counted against spec.restartPolicy.backoffLimit; evictions, "
        "preemptions and lost nodes are disruptions and are not counted.",
    )
    disruptions: int | None = Field(
        None, ge=0, description="Gang restarts after an eviction, a preemption or a lost node."
    )
    last_failure: str | None = Field(
        None,
        max_length=1024,
        description="The cause of the last counted failure; the same deterministic cause twice in a "
        "row ends the job.",
    )
    start_time: Timestamp | None = Field(None, description="When the job's pods were first created.")
    completion_time: Timestamp | None = Field(None, description="When the job succeeded or failed.")
    last_checkpoint_step: int | None = Field(
        None, ge=0, description="Step of the newest complete checkpoint."
    )


def set_condition(conditions: Sequence[Condition], condition: Condition) -> list[Condition]:
    """Return `conditions` with `condition` in place of the one of the same type.

    Keeps the old `lastTransitionTime` when the status did not change (the API convention), so a
    caller can pass `now` on every reconcile without making the status churn.
    """
    out: list[Condition] = []
    replaced = False
    for old in conditions:
        if old.type != condition.type:
            out.append(old)
            continue
        new = condition
        if old.status == condition.status:
            new = condition.model_copy(update={"last_transition_time": old.last_transition_time})
        out.append(new)
        replaced = True
    if not replaced:
        out.append(condition)
    return out


def find_condition(conditions: Sequence[Condition], type_: str) -> Condition | None:
    """The condition of `type_`, or None."""
    return next((c for c in conditions if c.type == type_), None)

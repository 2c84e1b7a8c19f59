"""The one error hierarchy: every error a user sees names the field, the rule and the fix.

Role: raised by the pure core (estimator, planning, builders, capacity and volume checks) and by
the shell's readers; `rljob_operator.reconcile.status` turns any exception into a condition through
`reason_of`/`retryable`, which read the class attributes here: `reason` (the CamelCase condition
reason) and `retryable` (whether waiting or a change outside the spec can fix it: the job stays
Pending and the operator retries; otherwise the job waits for a new spec generation). Anything
that is not an `RLJobError` is a bug or an outage and becomes `InternalError`, quoting the
exception, never a relabelled user error.
"""

from __future__ import annotations

from typing import ClassVar


class RLJobError(Exception):
    """Base class: `field` is the path to change, `message` says the rule, the limit and the fix."""

    reason: ClassVar[str] = "ReconcileError"
    retryable: ClassVar[bool] = False

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


# ---- the spec -------------------------------------------------------------------------------------
class InvalidSpecError(RLJobError):
    """The spec does not validate (rules the CRD schema could not express)."""

    reason = "InvalidSpec"


class ModelConfigUnreadableError(RLJobError):
    """The model's config.json could not be read or parsed; the ConfigMap may appear later."""

    reason = "ModelConfigUnreadable"
    retryable = True


# ---- the estimator (pure: a model config and a plan request in, a plan out) -----------------------
class EstimatorError(RLJobError, ValueError):
    """The estimator's input is invalid or the model cannot be placed: no retry can fix it."""

    reason = "InvalidModelConfig"


class InvalidModelConfigError(EstimatorError):
    """config.json lacks a field the KV/memory arithmetic needs, or holds a wrong value."""

    reason = "InvalidModelConfig"


class PlanningTimeoutError(EstimatorError):
    """Planning ran past its time limit (`reconcile.guards.PLAN_TIMEOUT_S`): the config is beyond what the
    estimator can size in time; a new spec generation is planned afresh."""

    reason = "PlanningTimeout"


class InvalidPlanRequestError(EstimatorError):
    """The plan request (accelerators, lengths, batch) is inconsistent."""

    reason = "InvalidPlanRequest"


class UnknownAcceleratorError(EstimatorError):
    """The accelerator model is neither in the catalog nor described in the spec."""

    reason = "UnknownAccelerator"


class UnknownPresetError(EstimatorError):
    """spec.model.config.preset names no shipped preset."""

    reason = "UnknownPreset"


class ModelDoesNotFitError(EstimatorError):
    """No split of the accelerators holds the model, its optimizer state and its KV cache."""

    reason = "ModelDoesNotFit"


class UnsupportedHeadSizeError(EstimatorError):
    """The rollout engine cannot run the model's attention head size on this pool (vLLM's CPU attention
    takes a fixed list): a model with a supported head size, or another engine, fixes it."""

    reason = "UnsupportedHeadSize"


class KVCacheTooSmallError(EstimatorError):
    """The weights fit but leave less KV cache than one sequence of max_model_len needs."""

    reason = "KVCacheTooSmall"


# ---- the cluster ----------------------------------------------------------------------------------
class InsufficientCapacityError(RLJobError):
    """The node pool has too few nodes or accelerators for the plan; nodes may join later."""

    reason = "InsufficientAccelerators"
    retryable = True


class ClaimNotFoundError(RLJobError):
    """A PersistentVolumeClaim the spec mounts does not exist (yet) in the job's namespace."""

    reason = "ClaimNotFound"
    retryable = True


class ClaimAccessModeError(RLJobError):
    """A claim mounted by pods that may land on different nodes cannot be mounted by all of them."""

    reason = "ClaimAccessMode"
    retryable = True  # fixed by changing the claim, not the spec


class EarlierJobLeftoversError(RLJobError):
    """Pods (or other children) of an earlier RLJob of the same name still exist: nothing is created
    until they are gone (the operator deletes the pods; the garbage collector the rest)."""

    reason = "EarlierJobLeftovers"
    retryable = True


class InternalError(RLJobError):
    """Anything unexpected: a bug or an outage. The message quotes the exception; kopf retries."""

    reason = "InternalError"
    retryable = True

    @classmethod
    def wrap(cls, step: str, exc: BaseException) -> InternalError:
        error = cls(step, f"{type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error

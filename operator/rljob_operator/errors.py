"""Semantic errors only the operator can detect, each naming the spec field and the fix.

Role: raised by the pure core (planning, capacity checks) and by the shell's readers; mapped to
condition reasons in exactly one table, `rljob_operator.status.REASONS`. Each error says whether
waiting can fix it (`retryable`): a ConfigMap that may still appear or nodes that may still join
leave the job Pending, a model that cannot fit fails it.
"""

from __future__ import annotations


class RLJobError(Exception):
    """Base class: `field` is the spec path to change, `message` says the rule, the limit and the fix."""

    retryable: bool = False

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class InvalidSpecError(RLJobError):
    """The spec does not validate (schema rules the CRD could not express)."""


class ModelConfigUnreadableError(RLJobError):
    """The model's config.json could not be read or parsed; it may appear later."""

    retryable = True


class ModelDoesNotFitError(RLJobError):
    """The estimator found no placement: the model or its KV cache does not fit the accelerators."""


class InsufficientCapacityError(RLJobError):
    """The node pool has too few nodes or accelerators for the plan; nodes may join later."""

    retryable = True

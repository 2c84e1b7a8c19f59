"""Estimator errors: one exception type the operator maps to a status condition.

Raised by every module of :mod:`rljob_operator.estimator` when a model config is
invalid or a model cannot fit the accelerators. ``handlers.py`` turns an
:class:`EstimatorError` into a condition with ``reason`` (CamelCase) and a message
that names the offending field; ``rljob plan`` prints it and exits non-zero.
"""

from __future__ import annotations

#: Condition reasons an :class:`EstimatorError` may carry.
REASONS: tuple[str, ...] = (
    "InvalidModelConfig",
    "InvalidPlanRequest",
    "UnknownAccelerator",
    "UnknownPreset",
    "ModelDoesNotFit",
    "KVCacheTooSmall",
)


class EstimatorError(ValueError):
    """Input no retry can fix: ``field`` names the input, ``reason`` is a CamelCase code."""

    def __init__(self, field: str, message: str, reason: str = "InvalidModelConfig") -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown EstimatorError reason {reason!r}; valid: {', '.join(REASONS)}")
        self.field = field
        self.message = message
        self.reason = reason
        super().__init__(f"{field}: {message}")

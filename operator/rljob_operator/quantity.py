"""Kubernetes resource quantities (8Gi, 500m, 1e3): the one parser, `kubernetes.utils.parse_quantity`.

Role: `api` checks quantity fields with it (the CRD carries the apiserver's own pattern) and
`planning` turns memory quantities into bytes with it. Wrapped here so that the pure core reaches
the `kubernetes` package through this one pure function and nothing else (import-linter allows
exactly this import).
"""

from __future__ import annotations

from decimal import Decimal

from kubernetes.utils.quantity import parse_quantity


def parse(value: int | str) -> Decimal:
    """The quantity's value; ValueError naming the value when it is not a Kubernetes quantity."""
    try:
        return Decimal(parse_quantity(value))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{value!r} is not a Kubernetes quantity (for example 2, 500m, 8Gi)") from exc


def to_bytes(value: int | str) -> int:
    """A memory quantity in bytes; a fraction of a byte (500m) is a unit mistake, so ValueError."""
    amount = parse(value)
    if amount != amount.to_integral_value():
        raise ValueError(
            f"{value!r} is {amount} bytes, not a memory quantity such as 8Gi or 512Mi (m means 1/1000)"
        )
    return int(amount)

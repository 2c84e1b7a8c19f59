"""Polling for tests and benchmarks that watch the local cluster converge.

Called by the integration and end-to-end tests (and the operator benchmark): one `wait_for` so
every wait fails the same way, naming what it waited for and the last value it saw.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(what: str, predicate: Callable[[], T], timeout_s: float = 60, interval_s: float = 0.3) -> T:
    """Call `predicate` until it returns something truthy and return that; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last value: {last!r}")

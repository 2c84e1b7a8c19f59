"""Per-job timestamps of the reconcile, for `bench/operator_scale.py`'s latency breakdown.

Role: `mark(key, event)` appends one JSON line `{"job", "event", "t"}` (`t`: this process's
`time.monotonic()`, comparable with the bench's own clock on the same machine) to the file named by
`RLJOB_TRACE_FILE`; without it (always, in a cluster) `mark` does nothing. The events, in a job's
order: `seen` (the watch showed the job first), `lock` (a reconcile was taken for it), `start`
(it holds the job's lock), `children` / `children-done` (its Service, ConfigMaps and RBAC created),
`pods` / `pods-done` (its pod creates sent / answered), `end`. Called by `reconcile.state` and
`reconcile.steps`; the bench reads the file.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import IO, Any

ENV_TRACE_FILE = "RLJOB_TRACE_FILE"

_lock = threading.Lock()
_out: IO[str] | None = None


def enabled() -> bool:
    return bool(os.environ.get(ENV_TRACE_FILE))


def mark(key: str, event: str, **extra: Any) -> None:
    """Record that `event` happened to job `key` now (nothing without RLJOB_TRACE_FILE)."""
    global _out
    path = os.environ.get(ENV_TRACE_FILE)
    if not path:
        return
    line = json.dumps({"job": key, "event": event, "t": time.monotonic(), **extra})
    with _lock:
        if _out is None:
            _out = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the process's life
        _out.write(line + "\n")

"""The trainer's last word: a short fatal cause written to the container's termination-message file.

Role: `python -m rljob_trainer` calls `record_fatal(exc)` from its top-level exception path. The
kubelet copies the file into the pod's `containerStatuses[].state.terminated.message`, and the
operator quotes it in the RLJob's Failed/Restarting condition, so a user reads "dataset not found"
instead of "exit code 1". The pods set `terminationMessagePolicy: FallbackToLogsOnError`, so a
crash that writes nothing still shows the log's tail. Kubernetes keeps at most 4096 bytes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping

ENV_TERMINATION_LOG = "RLJOB_TERMINATION_LOG"
DEFAULT_PATH = "/dev/termination-log"
MAX_BYTES = 4096


def describe_fatal(exc: BaseException) -> str:
    """One line naming what failed: a hint for the classes users meet, then the exception's text."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ").strip()
    name = type(exc).__name__
    if isinstance(exc, MemoryError) or "OutOfMemory" in name or "out of memory" in str(exc).lower():
        return f"out of memory: {text}"
    if isinstance(exc, FileNotFoundError):
        return f"file not found: {text}"
    return text


def record_fatal(exc: BaseException, env: Mapping[str, str] | None = None) -> str:
    """Write `describe_fatal(exc)` to $RLJOB_TERMINATION_LOG (default /dev/termination-log).

    Never raises: a missing or read-only file (running outside a pod) must not hide the real error.
    Returns the cause written.
    """
    cause = describe_fatal(exc)
    path = (env if env is not None else os.environ).get(ENV_TERMINATION_LOG, DEFAULT_PATH)
    with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as out:
        out.write(cause.encode()[:MAX_BYTES].decode(errors="ignore"))
    return cause

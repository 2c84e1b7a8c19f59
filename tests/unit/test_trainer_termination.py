"""rljob_trainer.outputs.termination: the fatal cause a pod's termination message carries."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from rljob_trainer.outputs import termination
from testenv.local_exec import catches_signal


def test_record_fatal_writes_one_line_the_kubelet_can_keep(tmp_path: Path) -> None:
    path = tmp_path / "termination-log"
    env = {termination.ENV_TERMINATION_LOG: str(path)}
    cause = termination.record_fatal(FileNotFoundError("/data/train.jsonl\nmissing"), env)
    assert path.read_text() == cause
    assert cause.startswith("file not found: FileNotFoundError") and "\n" not in cause
    huge = termination.record_fatal(RuntimeError("x" * 10_000), env)
    assert len(path.read_bytes()) <= termination.MAX_BYTES and huge.startswith("RuntimeError")


def test_out_of_memory_is_named_and_an_unwritable_path_is_not_fatal(tmp_path: Path) -> None:
    assert termination.describe_fatal(RuntimeError("CUDA out of memory. Tried to allocate")).startswith(
        "out of memory:"
    )
    env = {termination.ENV_TERMINATION_LOG: str(tmp_path / "missing-dir" / "log")}
    assert termination.record_fatal(ValueError("bad reward"), env) == "ValueError: bad reward"


def test_the_entrypoint_exits_on_sigterm_as_a_containers_pid_1() -> None:
    """PID 1 ignores a signal it has no handler for, so the driver must handle SIGTERM itself: a
    deleted trainer pod 0 ends at once, not after its grace period."""
    script = (
        "import time; from rljob_trainer.__main__ import exit_on_sigterm; exit_on_sigterm(); "
        "print('ready', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    assert catches_signal(proc.pid, signal.SIGTERM)  # so a container runtime's SIGTERM reaches it
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM

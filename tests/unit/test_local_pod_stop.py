"""The test kubelet stops a local pod as a container runtime does (testenv.local_exec): SIGTERM to
the main process only, and only if it handles SIGTERM (a container's PID 1 is spared any signal it
has no handler for), then SIGKILL for everything left once it exited or the grace period ran out."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

from testenv.local_exec import LocalPod, kill_pod_processes, pod_pids

# a daemon left in the pod's session (as `ray start` leaves raylet and gcs_server), then the main
# process, with or without a SIGTERM handler
MAIN = """
import signal, subprocess, sys, time
DAEMON = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
subprocess.Popen([sys.executable, "-c", DAEMON])
if sys.argv[1] == "handles":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("ready", flush=True)
time.sleep(60)
"""


def _start(tmp_path: Path, mode: str) -> LocalPod:
    local = LocalPod("ns", "p", uuid.uuid4().hex, tmp_path, tmp_path / "log")
    local.process = subprocess.Popen(
        [sys.executable, "-c", MAIN, mode], stdout=subprocess.PIPE, start_new_session=True
    )
    assert local.process.stdout is not None and local.process.stdout.readline() == b"ready\n"
    assert len(pod_pids(local.uid, local.process.pid)) == 2
    return local


def test_a_main_process_handling_sigterm_ends_itself_and_the_rest_is_killed(tmp_path: Path) -> None:
    local = _start(tmp_path, "handles")
    kill_pod_processes(local, grace_s=30.0)
    assert local.process is not None and local.process.returncode == 0  # its own exit, not SIGKILL
    assert not pod_pids(local.uid, local.process.pid)  # the daemon ignoring SIGTERM went with it


def test_a_main_process_without_a_handler_ignores_sigterm_for_the_grace_period(tmp_path: Path) -> None:
    local = _start(tmp_path, "ignores")
    started = time.monotonic()
    kill_pod_processes(local, grace_s=1.5)
    assert time.monotonic() - started >= 1.5  # SIGTERM never reached it: the grace period ran out
    assert local.process is not None and local.process.returncode == -9
    assert not pod_pids(local.uid, local.process.pid)

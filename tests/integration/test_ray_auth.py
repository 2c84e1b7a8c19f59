"""Ray's token authentication and the head's surface, against the installed Ray (no cluster).

Trainer pod 0 starts its head with `__main__.ray_head_command` (`rljob_trainer.ray_head`) and the
pod's RAY_AUTH_MODE=token / RAY_AUTH_TOKEN (builders/ray_auth.py). Here that exact command runs on
this machine: a client with the token joins; a client without it (a pod of another tenant) is
refused by the GCS; a client with a wrong token too; the head runs no Ray client server; its
dashboard listens on 127.0.0.1 only. The same on the local cluster, while a job trains:
tests/e2e/test_tiny_cpu_job.py.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rljob_trainer.__main__ import ray_head_command
from testenv import local_exec

pytestmark = [pytest.mark.slow, pytest.mark.ray]

CLIENT = (
    "import ray\n"
    "ray.init(address='127.0.0.1:{port}', log_to_driver=False)\n"
    "print('JOINED', int(ray.cluster_resources()['CPU']))\n"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def base_env(home: Path) -> dict[str, str]:
    """This machine's environment without any Ray token or address, as another pod's would be."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(home)  # no ~/.ray/auth_token of this machine's user
    return env


@pytest.fixture
def head(tmp_path: Path) -> Iterator[tuple[int, int, str, Path]]:
    """A Ray head started as trainer pod 0 starts it: (GCS port, dashboard port, token, temp dir)."""
    token = secrets.token_hex(32)
    port, dashboard = free_port(), free_port()
    marker = uuid.uuid4().hex
    temp = Path(f"/tmp/rjauth-{marker[:8]}")  # Ray's socket paths must stay short
    env = base_env(tmp_path / "head-home")
    env.update(
        {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": token,
            "RLJOB_RAY_PORT": str(port),
            local_exec.POD_MARKER_ENV: marker,  # every process it spawns, to stop only those
        }
    )
    cmd = [
        *ray_head_command(env, sys.executable),
        f"--dashboard-port={dashboard}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--temp-dir={temp}",
        "--num-cpus=1",
    ]
    try:
        started = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
        yield port, dashboard, token, temp
    finally:
        local = local_exec.LocalPod("test", "ray-head", marker, tmp_path, tmp_path / "log")
        local_exec.kill_pod_processes(local, grace_s=10)
        subprocess.run(["rm", "-rf", str(temp)], check=False)


def clients(port: int, *envs: dict[str, str]) -> list[subprocess.CompletedProcess[str]]:
    """One Ray client per environment, all at once (a refused client takes its time to give up)."""
    cmd = [sys.executable, "-c", CLIENT.format(port=port)]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for env in envs
    ]
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            done.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return done


def test_the_head_admits_only_clients_with_the_jobs_token(
    head: tuple[int, int, str, Path], tmp_path: Path
) -> None:
    port, dashboard, token, temp = head
    env = base_env(tmp_path / "client-home")

    # With the job's token; another tenant's pod, without one (Ray's default for an explicit
    # address: auth disabled); and one with a wrong token.
    joined, refused, wrong = clients(
        port,
        {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token},
        env,
        {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)},
    )
    assert joined.returncode == 0 and "JOINED 1" in joined.stdout, joined.stdout + joined.stderr[-3000:]
    assert refused.returncode != 0 and "JOINED" not in refused.stdout
    assert "authenticat" in (refused.stdout + refused.stderr).lower(), refused.stderr[-3000:]
    assert wrong.returncode != 0 and "JOINED" not in wrong.stdout, wrong.stderr[-3000:]

    # No Ray client server: `ray start --head` would have started one and logged it here.
    logs = sorted(p.name for p in (temp / "session_latest" / "logs").iterdir())
    assert any(name.startswith("dashboard") for name in logs), logs
    assert not any(name.startswith("ray_client_server") for name in logs), logs

    # The dashboard (and its job-submission API) answers on loopback, and nowhere else.
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", dashboard), timeout=2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "the dashboard never listened on 127.0.0.1"
            time.sleep(0.5)
    for address in _other_addresses():
        with pytest.raises(OSError):
            socket.create_connection((address, dashboard), timeout=2).close()


def _other_addresses() -> list[str]:
    """This machine's non-loopback IPv4 addresses (where another pod would connect from)."""
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=False).stdout.split()
    found = [a for a in out if "." in a and not a.startswith("127.")]
    if not found:
        pytest.skip("this machine has no non-loopback IPv4 address to try the dashboard on")
    return found

"""The shipped environment server over real HTTP: `python -m rljob_env.arithmetic` as its own
process, as an environment pod runs it (the port from $RLJOB_ENV_PORT, as the operator sets it),
reset and stepped with the standard library's HTTP client (docs/contracts.md §4).

No cluster: this is the server itself; tests/integration/test_operator_environments.py runs it as a
pod of the local cluster."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from rljob_env import arithmetic


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    port = _free_port()
    env = {**os.environ, "RLJOB_ENV_PORT": str(port)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rljob_env.arithmetic"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if _call(port, "GET", "/healthz")[0] == 200:
                break
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("the environment server did not answer /healthz within 20 s")
    yield port, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _call(
    port: int, method: str, path: str, body: Any = None, conn: http.client.HTTPConnection | None = None
) -> tuple[int, dict[str, Any]]:
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = json.loads(response.read() or b"{}")
    if own:
        conn.close()
    return response.status, payload


def test_health_reset_and_steps_to_the_end_over_one_keep_alive_connection(
    served: tuple[int, subprocess.Popen[bytes]],
) -> None:
    port, _ = served
    status, health = _call(port, "GET", "/healthz")
    assert status == 200 and health["status"] == "ok" and health["environment"] == "arithmetic"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    status, opened = _call(port, "POST", "/reset", {"seed": 42, "task": {"steps": 3}}, conn)
    assert status == 200 and set(opened) == {"episode_id", "observation", "info"}
    # The same seed in-process gives the answers: the server's episodes are the seed's.
    episode, observation, _ = arithmetic.Arithmetic().reset(42, {"steps": 3})
    assert opened["observation"] == observation
    value, total, done = episode.start, 0.0, False
    for op, n in episode.ops:
        value = {"+": value + n, "-": value - n, "*": value * n}[op]
        status, result = _call(
            port, "POST", "/step", {"episode_id": opened["episode_id"], "action": f"= {value}"}, conn
        )
        assert status == 200
        total += result["reward"]
        done = result["done"]
    conn.close()
    assert done and total == 1.0
    status, error = _call(port, "POST", "/step", {"episode_id": opened["episode_id"], "action": "1"})
    assert status == 404 and "no episode" in error["error"]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "phrase"),
    [
        ("POST", "/reset", b"{not json", 400, "not JSON"),
        ("POST", "/reset", {"seed": "x"}, 400, "seed must be an integer"),
        ("POST", "/reset", {"seed": 1, "task": {"steps": 99}}, 400, "task.steps"),
        ("POST", "/step", {"episode_id": "nope", "action": "1"}, 404, "no episode"),
        ("GET", "/reset", None, 405, "takes POST"),
        ("POST", "/other", {}, 404, "no path"),
    ],
)
def test_protocol_errors_are_json_with_their_status(
    served: tuple[int, subprocess.Popen[bytes]], method: str, path: str, body: Any, status: int, phrase: str
) -> None:
    port, _ = served
    got, payload = _call(port, method, path, body)
    assert got == status and phrase in payload["error"]


def test_a_body_over_the_limit_is_refused_unread() -> None:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rljob_env.arithmetic", "--port", str(port)])
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError):
                if _call(port, "GET", "/healthz")[0] == 200:
                    break
            assert time.monotonic() < deadline
            time.sleep(0.1)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.putrequest("POST", "/reset")
        conn.putheader("Content-Length", str(2 << 20))
        conn.endheaders()
        response = conn.getresponse()
        assert response.status == 413 and "at most" in json.loads(response.read())["error"]
        conn.close()
        # SIGTERM (the kubelet's stop) ends it at once, cleanly.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()

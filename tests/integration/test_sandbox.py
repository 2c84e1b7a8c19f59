"""The Python tool's sandbox (rljob_trainer.rollout.sandbox): each limit holds, against real programs.

Every attack runs under each set of layers a host may grant: all of them (this machine), a
PodSecurity `restricted` pod (a runtime's default seccomp profile refuses user namespaces: no netns),
a kernel without Landlock (or a runtime that refuses it), and the kernel layers without the audit
hook. A limit that held only with every layer would not hold in a pod.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from rljob_trainer.rollout import sandbox

GRANTED = sandbox.available_layers()[0]
CONFIGS = {
    "all": sandbox.LAYERS,
    "restricted-pod": ("rlimits", "landlock", "seccomp", "audit"),
    "no-landlock": ("rlimits", "seccomp", "audit"),
    "kernel-only": ("rlimits", "landlock", "seccomp"),
}


@pytest.fixture(
    # Every host-like set of layers in `make test`; the full set alone in `make test-fast`.
    params=[pytest.param(name, marks=() if name == "all" else pytest.mark.slow) for name in sorted(CONFIGS)]
)
def layers(request: pytest.FixtureRequest) -> tuple[str, ...]:
    wanted = CONFIGS[request.param]
    missing = [name for name in wanted if name not in GRANTED]
    if missing:
        pytest.skip(f"this host does not grant {missing}: {dict(sandbox.available_layers()[1])}")
    return wanted


def run(code: str, layers: tuple[str, ...], **kw: object) -> sandbox.SandboxResult:
    opts = {"cpu_seconds": 2.0, "memory_bytes": 256 << 20, "timeout_s": 10.0, "max_output_chars": 4000}
    return sandbox.run_python(code, layers=layers, **{**opts, **kw})  # type: ignore[arg-type]


def test_this_machine_grants_every_layer() -> None:
    """The development machine (and the local cluster's pods, processes on it) runs all five."""
    assert set(GRANTED) == set(sandbox.LAYERS), sandbox.available_layers()


def test_a_program_computes_and_prints(layers) -> None:
    res = run(
        "import math, json, fractions\nprint(json.dumps([math.comb(10, 3), str(fractions.Fraction(3, 9))]))",
        layers,
    )
    assert (res.reason, res.stdout.strip()) == ("ok", '[120, "1/3"]')
    assert res.as_tool_text() == '[120, "1/3"]'
    assert set(layers) <= set(res.layers) or res.layers == GRANTED


def test_an_infinite_loop_is_stopped_by_the_cpu_limit(layers) -> None:
    t0 = time.monotonic()
    res = run("while True:\n    pass", layers, cpu_seconds=1.0)
    assert res.reason == "cpu_limit" and "CPU-time limit" in res.as_tool_text()
    assert time.monotonic() - t0 < 8


def test_a_program_that_sleeps_is_stopped_by_the_wall_clock(layers) -> None:
    t0 = time.monotonic()
    res = run("import time\nprint('started', flush=True)\ntime.sleep(60)", layers, timeout_s=1.0)
    assert res.reason == "timeout" and res.stdout.startswith("started")
    assert time.monotonic() - t0 < 4


def test_a_memory_bomb_meets_the_address_space_limit(layers) -> None:
    res = run(
        "blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))", layers, memory_bytes=128 << 20
    )
    assert res.reason == "memory" and "MemoryError" in res.stdout
    res = run("x = bytearray(1 << 30)", layers, memory_bytes=128 << 20)
    assert res.reason == "memory"


def test_no_socket_reaches_a_listening_server(layers) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list[object] = []
    stop = threading.Event()

    def accept() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not stop.is_set():
            try:
                accepted.append(server.accept())
            except TimeoutError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    code = f"""
import socket
for what, fn in [
    ("tcp", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2)),
    ("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", {port}))),
    ("dns", lambda: socket.getaddrinfo("kubernetes.default.svc", 443)),
    ("unix", lambda: socket.socket(socket.AF_UNIX).connect("/tmp/x.sock")),
]:
    try:
        fn()
        print(what, "CONNECTED")
    except Exception as e:
        print(what, "refused:", type(e).__name__)
"""
    res = run(code, layers)
    time.sleep(0.3)  # a connection the sandbox made would be accepted by now
    stop.set()
    t.join()
    server.close()
    assert "CONNECTED" not in res.stdout and res.stdout.count("refused") == 4, res.stdout
    assert not accepted


def test_nothing_of_the_trainer_is_readable(layers, tmp_path, monkeypatch) -> None:
    secret = "rljob-secret-7f3a91"
    token = tmp_path / "serviceaccount" / "token"
    token.parent.mkdir()
    token.write_text(secret)
    model = tmp_path / "model" / "model.safetensors"
    model.parent.mkdir()
    model.write_text(secret)
    monkeypatch.setenv("RAY_AUTH_TOKEN", secret)  # what the trainer's environment holds
    monkeypatch.setenv("WANDB_API_KEY", secret)
    code = f"""
import os, json
out = {{"env": dict(os.environ)}}
for path in [{str(token)!r}, {str(model)!r}, "/proc/%d/environ" % os.getppid(), "/proc/self/environ",
             "/var/run/secrets/kubernetes.io/serviceaccount/token", "/etc/passwd"]:
    try:
        with open(path, "rb") as f:
            out[path] = f.read().decode(errors="replace")
    except Exception as e:
        out[path] = "refused: " + type(e).__name__
try:
    out["listing"] = os.listdir({str(tmp_path)!r})
except Exception as e:
    out["listing"] = "refused: " + type(e).__name__
print(json.dumps(out))
"""
    res = run(code, layers, max_output_chars=100_000)
    assert res.reason == "ok", res.stdout
    assert secret not in res.stdout
    data = json.loads(res.stdout)
    assert set(data["env"]) <= {"PATH", "LANG", "HOME", "TMPDIR", "LC_CTYPE"}
    for path in (str(token), str(model), f"/proc/{os.getpid()}/environ"):
        assert data[path].startswith("refused"), (path, data[path])


def test_a_fork_bomb_and_subprocesses_are_refused(layers) -> None:
    res = run("import os\nwhile True:\n    os.fork()", layers)
    assert res.reason == "error" and "PermissionError" in res.stdout
    res = run("import subprocess\nprint(subprocess.run(['id'], capture_output=True).stdout)", layers)
    assert res.reason == "error" and "uid=" not in res.stdout
    res = run("import os\nos.execv('/bin/sh', ['sh', '-c', 'echo es' + 'caped'])", layers)
    assert res.reason == "error" and "escaped" not in res.stdout


def test_no_signal_reaches_another_process(layers) -> None:
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        res = run(f"import os, signal\nos.kill({victim.pid}, signal.SIGKILL)\nprint('sent')", layers)
        time.sleep(0.2)
        assert victim.poll() is None, "the sandbox killed another process"
        assert res.reason == "error" and "sent" not in res.stdout
    finally:
        victim.kill()
        victim.wait()


def test_output_is_cut_and_a_flood_is_stopped(layers) -> None:
    res = run("print('x' * 10000)", layers, max_output_chars=100)
    assert res.reason == "ok" and len(res.stdout) == 100 and "[cut: " in res.stdout
    res = run("while True:\n    print('y' * 100000)", layers, max_output_chars=100)
    assert res.reason == "output_limit" and len(res.stdout) == 100


def test_files_stay_in_the_working_directory(layers, tmp_path) -> None:
    outside = tmp_path / "planted"
    code = f"""
open("notes.txt", "w").write("kept")
print(open("notes.txt").read())
try:
    open({str(outside)!r}, "w").write("escaped")
except Exception as e:
    print("refused", type(e).__name__)
"""
    res = run(code, layers)
    assert res.reason == "ok" and res.stdout.split() == ["kept", "refused", "PermissionError"]
    assert not outside.exists()


def test_the_python_tool_runs_through_the_sandbox_with_its_settings() -> None:
    from rljob_trainer import config
    from rljob_trainer.rollout import tools

    box = tools.ToolBox(
        [config.ToolSettings(name="py", kind="python", timeoutS=20, cpuSeconds=1, maxResultChars=40)]
    )
    ok = box.run(tools.ToolCall("py", {"code": "print(sum(i * i for i in range(10)))"}))
    assert (ok.content, ok.ok) == ("285", True)
    loop = box.run(tools.ToolCall("py", {"code": "while True: pass"}))
    assert not loop.ok and loop.content.endswith("[stopped: CPU-time limit]")
    long = box.run(tools.ToolCall("py", {"code": "print('z' * 1000)"}))
    assert len(long.content) <= 40

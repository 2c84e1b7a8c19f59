"""The Python tool's sandbox: one fenced process per call, nothing of the trainer reachable from it.

Role: `run_python(code, ...)` runs a model's program in a new `python -I -S` process and returns what
it printed (`SandboxResult`). The process starts with no inherited environment (no Ray token, no
tracker keys: only PATH, LANG, HOME and TMPDIR pointing at its own temporary directory), no
inherited file descriptors but its stdio, in its own session (a timeout kills its whole group), in
a fresh temporary working directory that is removed afterwards. Before the program runs, a bootstrap
inside the process fences it, each layer on its own so that one missing (a kernel or a container
runtime that refuses it) leaves the others:
- `rlimits`: CPU seconds (`cpuSeconds`, SIGXCPU past it), address space (`memoryBytes`: a
  MemoryError), file size, open files, no core dumps, no new processes for a non-root user;
- `netns`: a new user and network namespace (`unshare`), where no network interface is up. Needs
  unprivileged user namespaces: refused under a container runtime's default seccomp profile
  (PodSecurity `restricted` pods), where the other layers hold;
- `landlock`: the Linux Landlock LSM (unprivileged): reads only of the Python standard library and
  the system's shared libraries, reads and writes only in its working directory, no TCP bind or
  connect (ABI >= 4), no signals or abstract sockets out of its domain (ABI >= 6). So no
  ServiceAccount token, no model files, no /proc/<pid>/environ of the trainer;
- `seccomp`: a BPF filter (no_new_privs): no socket, no fork (a clone without CLONE_THREAD), no
  exec, no ptrace or another process's memory, no signal to another process, no namespaces,
  mounts, BPF, io_uring, keys or modules;
- `audit`: a CPython audit hook (PEP 578): refuses opening files outside the allowed trees, sockets,
  subprocesses, exec, fork, kill, and loading native code through ctypes (the hook alone is not a
  sandbox: the layers below it are the fence; it names what was refused in the traceback).
The parent enforces the wall clock (`timeoutS`: the process group is killed) and the output (cut at
`maxResultChars`; a flood past `OUTPUT_HARD_LIMIT_BYTES` is killed). `available_layers()` asks the
kernel which layers this host grants (logged once, and reported in every result's `layers`).

Callers: `rljob_trainer.rollout.tools.ToolBox` (tool kind python), tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache

LAYERS: tuple[str, ...] = ("rlimits", "netns", "landlock", "seccomp", "audit")
OUTPUT_HARD_LIMIT_BYTES = 1 << 20  # a program printing more than this is killed
FILE_SIZE_LIMIT_BYTES = 16 << 20
OPEN_FILES_LIMIT = 64


@dataclass(frozen=True)
class SandboxResult:
    """What one run printed (stdout and stderr, interleaved as written) and how it ended: `reason`
    ok, error (a non-zero exit), timeout (the wall clock), cpu_limit, memory (MemoryError),
    output_limit (printed past the hard limit), killed (another signal), sandbox_error."""

    stdout: str
    exit_code: int | None
    reason: str
    seconds: float = 0.0
    layers: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return self.reason == "ok"

    def as_tool_text(self) -> str:
        """The tool message: its output, and why it stopped when it did not end well."""
        notes = {
            "ok": "",
            "error": f"[exit code {self.exit_code}]",
            "timeout": "[stopped: wall-clock limit]",
            "cpu_limit": "[stopped: CPU-time limit]",
            "memory": "[stopped: memory limit]",
            "output_limit": "[stopped: too much output]",
            "killed": f"[stopped: signal {-(self.exit_code or 0)}]",
            "sandbox_error": "[the sandbox could not start]",
        }
        note = notes.get(self.reason, f"[{self.reason}]")
        return (
            self.stdout + ("\n" if self.stdout and note and not self.stdout.endswith("\n") else "") + note
        ).strip("\n") or "(no output)"


# ---- the bootstrap: runs inside the sandboxed process, before the program ------------------------
# Written as source (it runs in `python -I -S -c`), with the syscall tables of the two architectures
# the images are built for.
BOOTSTRAP = r"""
import ctypes, json, os, resource, struct, sys
cfg = json.loads(sys.argv[1])
workdir, layers = cfg["workdir"], set(cfg["layers"])
active, refused = [], {}

def note(name, fn):
    if name not in layers:
        return
    try:
        fn()
        active.append(name)
    except Exception as e:
        refused[name] = f"{type(e).__name__}: {e}"

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

def check(rc, what):
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return rc

def rlimits():
    cpu = max(1, int(cfg["cpu_seconds"] + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_bytes"], cfg["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["file_size_bytes"], cfg["file_size_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["open_files"], cfg["open_files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.getuid() != 0:  # counts every process of the user: none new
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))

def netns():
    CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
    check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNET), "unshare(CLONE_NEWUSER|CLONE_NEWNET)")

NR = {
    "x86_64": dict(socket=41, connect=42, accept=43, bind=49, listen=50, socketpair=53, clone=56,
        fork=57, vfork=58, execve=59, kill=62, ptrace=101, tkill=200, tgkill=234, accept4=288,
        execveat=322, clone3=435, unshare=272, setns=308, mount=165, umount2=166, pivot_root=155,
        chroot=161, bpf=321, perf_event_open=298, userfaultfd=323, process_vm_readv=310,
        process_vm_writev=311, keyctl=250, add_key=248, request_key=249, io_uring_setup=425,
        io_uring_enter=426, io_uring_register=427, pidfd_open=434, pidfd_send_signal=424,
        pidfd_getfd=438, rt_sigqueueinfo=129, rt_tgsigqueueinfo=297, kexec_load=246,
        init_module=175, finit_module=313, delete_module=176, open_by_handle_at=304, mknod=133,
        mknodat=259, personality=135),
    "aarch64": dict(socket=198, connect=203, accept=202, bind=200, listen=201, socketpair=199,
        clone=220, execve=221, kill=129, ptrace=117, tkill=130, tgkill=131, accept4=242,
        execveat=281, clone3=435, unshare=97, setns=268, mount=40, umount2=39, pivot_root=41,
        chroot=51, bpf=280, perf_event_open=241, userfaultfd=282, process_vm_readv=270,
        process_vm_writev=271, keyctl=219, add_key=217, request_key=218, io_uring_setup=425,
        io_uring_enter=426, io_uring_register=427, pidfd_open=434, pidfd_send_signal=424,
        pidfd_getfd=438, rt_sigqueueinfo=138, rt_tgsigqueueinfo=240, kexec_load=104,
        init_module=105, finit_module=273, delete_module=106, open_by_handle_at=265, mknodat=33,
        personality=92),
}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
LANDLOCK_CREATE, LANDLOCK_ADD, LANDLOCK_RESTRICT = 444, 445, 446
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
machine = os.uname().machine

def no_new_privs():
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")

def landlock():
    abi = libc.syscall(LANDLOCK_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    check(abi, "landlock_create_ruleset(version)")
    fs_bits = {1: 13, 2: 14, 3: 15, 4: 15, 5: 16}.get(abi, 16)
    handled_fs = (1 << fs_bits) - 1
    handled_net = 0b11 if abi >= 4 else 0  # TCP bind, TCP connect: none allowed
    scoped = 0b11 if abi >= 6 else 0  # abstract unix sockets, signals: only within the domain
    attr = struct.pack("QQQ", handled_fs, handled_net, scoped)
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    buf = ctypes.create_string_buffer(attr[:size], size)
    rs = libc.syscall(LANDLOCK_CREATE, buf, ctypes.c_size_t(size), ctypes.c_uint32(0))
    check(rs, "landlock_create_ruleset")
    EXEC, WRITE, READ, READDIR = 1, 2, 4, 8
    TRUNCATE = (1 << 14) if abi >= 3 else 0
    file_rights = EXEC | WRITE | READ | TRUNCATE
    read_tree = EXEC | READ | READDIR
    def allow(path, rights):
        if not os.path.exists(path):
            return
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            if not os.path.isdir(path):
                rights &= file_rights
            rule = ctypes.create_string_buffer(struct.pack("=Qi", rights & handled_fs, fd), 12)
            check(libc.syscall(LANDLOCK_ADD, rs, 1, rule, 0), f"landlock_add_rule({path})")
        finally:
            os.close(fd)
    for path in cfg["read_paths"]:
        allow(path, read_tree)
    allow(workdir, handled_fs)
    for dev in ("/dev/null", "/dev/zero", "/dev/urandom"):
        allow(dev, READ | WRITE)
    no_new_privs()
    check(libc.syscall(LANDLOCK_RESTRICT, rs, 0), "landlock_restrict_self")
    os.close(rs)

def seccomp():
    nr = NR[machine]
    arch = AUDIT_ARCH[machine]
    ALLOW, KILL = 0x7FFF0000, 0x80000000
    EPERM = 0x00050000 | 1
    ENOSYS = 0x00050000 | 38
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, arch), (RET, 0, 0, KILL), (LD, 0, 0, 0)]
    if machine == "x86_64":
        prog += [(JGE, 0, 1, 0x40000000), (RET, 0, 0, EPERM)]  # the x32 ABI: another table
    pid = os.getpid()
    # clone: threads (CLONE_THREAD) only; kill and tgkill: this process only; clone3: ENOSYS, so the
    # C library falls back to clone, which the filter can read.
    CLONE_THREAD, ARG0 = 0x00010000, 16
    prog += [(JEQ, 0, 4, nr["clone"]), (LD, 0, 0, ARG0), (JSET, 0, 1, CLONE_THREAD)]
    prog += [(RET, 0, 0, ALLOW), (RET, 0, 0, EPERM)]
    for name in ("kill", "tgkill"):
        prog += [(JEQ, 0, 4, nr[name]), (LD, 0, 0, ARG0), (JEQ, 0, 1, pid)]
        prog += [(RET, 0, 0, ALLOW), (RET, 0, 0, EPERM)]
    prog += [(JEQ, 0, 1, nr["clone3"]), (RET, 0, 0, ENOSYS)]
    for name, number in sorted(nr.items()):
        if name in ("clone", "kill", "tgkill", "clone3"):
            continue
        prog += [(JEQ, 0, 1, number), (RET, 0, 0, EPERM)]
    prog.append((RET, 0, 0, ALLOW))
    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    filt = ctypes.create_string_buffer(raw, len(raw))
    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    fprog = Fprog(len(prog), ctypes.cast(filt, ctypes.c_void_p))
    no_new_privs()
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    rc = libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0)
    check(rc, "prctl(PR_SET_SECCOMP)")

def audit():
    roots = tuple(os.path.realpath(p) + os.sep for p in cfg["read_paths"])
    work = os.path.realpath(workdir) + os.sep
    refused_events = {
        "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
        "os.forkpty", "os.kill", "os.killpg", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
        "ctypes.call_function", "socket.socket", "socket.__new__", "socket.connect", "socket.bind",
        "socket.getaddrinfo", "socket.sendto", "sys.setprofile", "sys.settrace", "os.putenv",
        "os.unsetenv", "_posixsubprocess.fork_exec", "os.ptrace", "pty.spawn", "mmap.__new__",
    }
    native = ("ctypes", "_ctypes", "_posixsubprocess")

    def hook(event, args):
        if event in refused_events:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args and str(args[0]).split(".")[0] in native:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open" and args and isinstance(args[0], (str, bytes)):
            path = os.path.realpath(os.fsdecode(args[0]))
            mode = args[1] if len(args) > 1 and isinstance(args[1], str) else "r"
            flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            writes = any(c in mode for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            inside = (path + os.sep).startswith(work) or path in ("/dev/null", "/dev/urandom", "/dev/zero")
            if writes and not inside:
                raise PermissionError(f"sandbox: writing {path} is not allowed (only the working directory)")
            if not writes and not inside and not (path + os.sep).startswith(roots):
                raise PermissionError(f"sandbox: reading {path} is not allowed")
    sys.addaudithook(hook)

note("rlimits", rlimits)
note("netns", netns)
note("landlock", landlock)
note("seccomp", seccomp)
if cfg.get("report"):
    print(json.dumps({"active": active + (["audit"] if "audit" in layers else []), "refused": refused}))
    sys.exit(0)
del libc, check, ctypes
for name in [m for m in sys.modules if m.split(".")[0] in ("ctypes", "_ctypes")]:
    del sys.modules[name]
note("audit", audit)
os.chdir(workdir)
with open(os.path.join(workdir, "main.py")) as f:
    source = f.read()
del cfg, note, active, refused, f
exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


def read_paths() -> list[str]:
    """What the sandboxed process may read: the standard library and the shared libraries (never
    site-packages, the trainer's code, its model or its secrets)."""
    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}
    paths.add(os.path.dirname(os.path.realpath(sys.executable)))
    paths.update(["/lib", "/lib64", "/usr/lib", "/usr/lib64", "/etc/ld.so.cache", "/etc/localtime"])
    return sorted(p for p in paths if os.path.exists(p))


def _env(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}


def _command(config: dict[str, object]) -> list[str]:
    # -I: no PYTHON* variables, no user site, no script directory on the path; -S: no site-packages.
    return [sys.executable, "-I", "-S", "-c", BOOTSTRAP, json.dumps(config)]


def _config(
    workdir: str, *, cpu_seconds: float, memory_bytes: int, layers: tuple[str, ...]
) -> dict[str, object]:
    return {
        "workdir": workdir,
        "layers": list(layers),
        "cpu_seconds": cpu_seconds,
        "memory_bytes": memory_bytes,
        "file_size_bytes": FILE_SIZE_LIMIT_BYTES,
        "open_files": OPEN_FILES_LIMIT,
        "read_paths": read_paths(),
    }


@lru_cache(maxsize=8)
def available_layers(layers: tuple[str, ...] = LAYERS) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(the layers this host grants, (layer, why refused) for the others): asked of the kernel once,
    by a sandboxed process that fences itself and reports."""
    with tempfile.TemporaryDirectory(prefix="rljob-sandbox-") as workdir:
        cfg = {**_config(workdir, cpu_seconds=5, memory_bytes=512 << 20, layers=layers), "report": True}
        try:
            out = subprocess.run(
                _command(cfg), env=_env(workdir), cwd=workdir, capture_output=True, timeout=30, check=False
            )
            data = json.loads(out.stdout.decode().strip().splitlines()[-1])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
            return (), tuple((name, f"{type(e).__name__}: {e}") for name in layers)
    return tuple(data["active"]), tuple(sorted(data["refused"].items()))


def run_python(
    code: str,
    *,
    cpu_seconds: float = 5.0,
    memory_bytes: int = 256 << 20,
    timeout_s: float = 10.0,
    max_output_chars: int = 2000,
    layers: tuple[str, ...] = LAYERS,
) -> SandboxResult:
    """Run `code` in a fenced process (module docstring); never raises for what the program does."""
    t0 = time.monotonic()
    granted = available_layers(layers)[0]
    workdir = tempfile.mkdtemp(prefix="rljob-sandbox-")
    try:
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(code)
        cfg = _config(workdir, cpu_seconds=cpu_seconds, memory_bytes=memory_bytes, layers=layers)
        try:
            proc = subprocess.Popen(
                _command(cfg),
                env=_env(workdir),
                cwd=workdir,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                close_fds=True,
                start_new_session=True,
            )
        except OSError as e:
            return SandboxResult(
                f"{type(e).__name__}: {e}", None, "sandbox_error", time.monotonic() - t0, granted
            )
        output, reason = _drain(proc, deadline=t0 + timeout_s)
        try:  # it may close its output and go on running
            code_ = proc.wait(timeout=max(0.0, t0 + timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill(proc)
            code_, reason = proc.wait(), "timeout"
        text = output.decode("utf-8", errors="replace")
        if reason is None:
            if code_ == 0:
                reason = "ok"
            elif code_ == -signal.SIGXCPU:
                reason = "cpu_limit"
            elif code_ < 0:
                reason = "killed"
            elif "MemoryError" in text:
                reason = "memory"
            else:
                reason = "error"
        return SandboxResult(_cut(text, max_output_chars), code_, reason, time.monotonic() - t0, granted)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _drain(proc: subprocess.Popen[bytes], *, deadline: float) -> tuple[bytes, str | None]:
    """Read the process's output until it closes it, the deadline (the group is killed: timeout) or
    the hard output limit (killed: output_limit)."""
    assert proc.stdout is not None
    chunks: list[bytes] = []
    size = 0
    fd = proc.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            _kill(proc)
            return b"".join(chunks), "timeout"
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if not ready:
            continue
        data = os.read(fd, 65536)
        if not data:
            return b"".join(chunks), None
        chunks.append(data)
        size += len(data)
        if size > OUTPUT_HARD_LIMIT_BYTES:
            _kill(proc)
            return b"".join(chunks), "output_limit"


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: everything it left behind too


def _cut(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    note = f"\n[cut: {len(text) - max_chars} more characters]"
    keep = max(0, max_chars - len(note))
    return text[:keep] + note[: max_chars - keep]

"""Local-exec nodes of the fake kubelet: pods as processes on this machine (`LocalExecPods`, mixed
into `testenv.fakelet.FakeKubelet`).

Nodes labelled `rljob.io/local-exec: "true"` (`LocalCluster.add_nodes(exec_local=True)`) go one
step further, for end-to-end runs: a pod bound there really runs, as a process group on this
machine (`_start_local`). Its first container's command runs with `python` mapped to this
interpreter; env values (`value`, `valueFrom` field/ConfigMap/Secret refs) as a kubelet resolves
them; ConfigMap, Secret and emptyDir volumes as per-pod folders, with env values, args and paths
in materialised JSON/YAML under a volume's `mountPath` rewritten to the folder; the pod's
PVCs bound to a hostPath or local PV as that folder of this machine; the pod's
ServiceAccount as a kubeconfig holding a token bound to the pod from the TokenRequest API (so
the job's least-privilege Role is all the process gets, never the admin's credentials).
What it can of a container's sandbox it honours, never more permissive than a kubelet: with
`readOnlyRootFilesystem` the image's filesystem (HOME, the working directory, TMPDIR without a
/tmp volume) is a path nothing can be written under, so only volumes are writable; a
disk-backed emptyDir that outgrows its `sizeLimit` gets the pod evicted as the kubelet's eviction
manager does (killed, Failed, reason Evicted, "Usage of EmptyDir volume ... exceeds the limit").
What it cannot: absolute paths outside the volumes (a literal /tmp) reach this machine's files,
runAsUser is not applied (the processes run as this user), and memory-backed emptyDirs, the pod's
memory and CPU limits and its network (see below) are not fenced.

All local pods share the host network: `RLJOB_RAY_HEAD` becomes 127.0.0.1, each job (label
`rljob.io/job`) gets one free `RLJOB_RAY_PORT` shared by its pods, and `RAY_ADDRESS` and a
per-pod `TMPDIR` keep parallel jobs from finding each other's Ray clusters. Ray's fixed default
ports (dashboard 8265, client server 10001, dashboard agent 52365) would collide between two jobs
on one host, so a `sitecustomize` hook on the pod's PYTHONPATH gives every `ray start` free ones (and socket
files in the pod's own folder), and `RAY_USE_RANDOM_PORTS` lets the OS pick worker ports.

The pod is Running (pod IP 127.0.0.1) once started, and Succeeded or Failed with the exit code when
its main process ends (the container's termination-message file, mounted at its
`terminationMessagePath`, becomes `state.terminated.message`; with `FallbackToLogsOnError` an empty
file on failure gives the log's last 80 lines / 2048 bytes, as the kubelet does), after which
nothing of it survives (as in a container). Deleting it SIGTERMs its main process only, and only if
that process handles SIGTERM (a container's PID 1 ignores a signal it has no handler for), then,
once it exited or after the grace period (at most 10 s), SIGKILLs every process of the pod: its
session, which holds the daemons `ray start` spawns even after they rewrite their environ, plus
anything carrying the pod's marker in its environment; then the deletion is confirmed. Output goes
to `<cluster workdir>/pod-logs/<namespace>_<pod>.log` (`LocalCluster.pod_log`). Fake GPU/NPU nodes
run nothing, unless they are local-exec too (gpu-local, npu-local): then their pods run here with
the trainer's CPU stand-in switch (`CPU_STANDIN_ENV`), and Ray sees the pod's accelerators.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.utils import parse_quantity

from testenv import local_services

log = logging.getLogger(__name__)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _rfc3339(moment: datetime.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- local-exec nodes: pods as processes on this machine ---------------------------------------

LOCAL_EXEC_LABEL = "rljob.io/local-exec"
JOB_LABEL = "rljob.io/job"
POD_MARKER_ENV = "RLJOB_FAKELET_POD_UID"
LOCAL_POD_IP = "127.0.0.1"
STOP_GRACE_CAP_S = 10.0
# The kubelet's container restart back-off (restartPolicy Always): 10 s doubling, at most 5 min.
RESTART_BACK_OFF_S = 10.0
MAX_RESTART_BACK_OFF_S = 300.0
START_RETRY_S = 60.0
# What a kubelet does before it starts a container, and how it reports a pod it cannot start.
DEFAULT_TERMINATION_MESSAGE_PATH = "/dev/termination-log"
FALLBACK_LOG_LINES = 80  # FallbackToLogsOnError: the kubelet keeps the log's last 80 lines / 2048 bytes
FALLBACK_LOG_BYTES = 2048
HOST_ENV_KEEP = ("PATH", "LANG", "LC_ALL", "USER", "LOGNAME", "SHELL", "TZ")
STORAGE_CHECK_S = 2.0  # the kubelet's eviction manager looks every 10 s; a test cannot wait that long
# With readOnlyRootFilesystem the image's filesystem is read-only: a path that exists on no volume
# stands for it here (HOME, the working directory, TMPDIR without a /tmp volume). Nothing can be
# created under /proc, not even by root, so a write there fails as it would in the container.
READ_ONLY_ROOT = "/proc/rljob-read-only-root"
READ_ONLY_CWD = "/proc"
PYTHON_NAMES = ("python", "python3")


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_JSON_PATH = re.compile(r'"/(?:[^"\\]|\\.)*"')


def rewrite_path(value: str, mounts: list[tuple[str, str]]) -> str:
    """`value` with a leading container mount path (longest first) replaced by its host folder."""
    for mount_path, host in mounts:
        base = mount_path.rstrip("/")
        if base and (value == base or value.startswith(base + "/")):
            return host + value[len(base) :]
    return value


def rewrite_json_paths(text: str, mounts: list[tuple[str, str]]) -> str:
    """JSON string values that are paths under a mount (e.g. trainer.json's checkpoint dir), rewritten
    once each (the longest mount path wins, as for env values)."""
    return _JSON_PATH.sub(lambda m: json.dumps(rewrite_path(json.loads(m.group(0)), mounts)), text)


# Local-exec nodes with accelerator capacity (gpu-local, npu-local): this machine has no GPU/NPU,
# so their pods get the trainer's test-only CPU stand-in switch (torch on CPU, the transformers
# engine); `ray start` still advertises the pod's accelerator request, so Ray places as on a GPU node.
CPU_STANDIN_ENV = "RLJOB_TEST_CPU_STANDIN"  # rljob_trainer.config.ENV_TEST_CPU_STANDIN
NODE_BASE_RESOURCES = frozenset({"cpu", "memory", "pods", "ephemeral-storage"})


def accelerator_resources(manifest: dict[str, Any]) -> list[str]:
    """The extended (accelerator) resources of a node manifest's capacity."""
    capacity = manifest.get("status", {}).get("capacity", {})
    return sorted(k for k in capacity if k not in NODE_BASE_RESOURCES and not k.startswith("hugepages-"))


RAY_START_ARGS_ENV = "RLJOB_FAKELET_RAY_START_ARGS"
RAY_HEAD_MODULE = "rljob_trainer.ray_head"
# Ray's `ray start` binds a few fixed ports (dashboard 8265, client server 10001, dashboard agent
# 52365): right in a pod of its own, a collision between two jobs on one host. The pod's command
# is the trainer's, so this hook (on PYTHONPATH) adds free ports to any `ray start` it runs.
RAY_START_HOOK = f"""# written by testenv.fakelet for pods of local-exec nodes
import os, sys
_cli = len(sys.argv) > 1 and os.path.basename(sys.argv[0]) == "ray" and sys.argv[1] == "start"
# the trainer's head: `python -m {RAY_HEAD_MODULE} --head ...` (Ray's `start`, no client server)
_head = getattr(sys, "orig_argv", [])[1:3] == ["-m", "{RAY_HEAD_MODULE}"]
if _cli or _head:
    for arg in os.environ.get("{RAY_START_ARGS_ENV}", "").split():
        name = arg.split("=", 1)[0]
        head_only = name == "--dashboard-port"
        if (not head_only or "--head" in sys.argv) and not any(a.startswith(name) for a in sys.argv):
            sys.argv.append(arg)
"""
# No --ray-client-server-port: a head given one would start the client server the trainer's
# head leaves out (rljob_trainer.ray_head).
RAY_PORT_FLAGS = ("dashboard-port", "dashboard-agent-listen-port")
ENV_RAY_HEAD = "RLJOB_RAY_HEAD"  # docs/contracts.md §2
ENV_RAY_PORT = "RLJOB_RAY_PORT"
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` references to earlier variables; unknown ones stay as written."""
    return _VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), value)


def _write_items(files: dict[str, bytes], items: Any, into: Path) -> None:
    """A ConfigMap/Secret volume's files: every key, or only `items` (key -> relative path)."""
    targets = {i.key: i.path for i in items} if items else {k: k for k in files}
    for key, relative in targets.items():
        if key not in files:
            raise KeyError(f"key {key} is not in the volume's source")
        path = into / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(files[key])


def _used_bytes(folder: Path) -> int:
    """What a volume holds on disk (allocated blocks, as `du` and the kubelet's volume stats count)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def _session_of(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[3]) if len(fields) > 3 else None  # state ppid pgrp session ...


def pod_pids(uid: str, session: int | None = None) -> list[int]:
    """Every live process of a local pod: those in its session (`session`: the main process's pid,
    which leads it) and those whose environment carries the pod's marker. The session catches the
    daemons `ray start` leaves behind even after they rewrite their environ with a process title;
    the marker catches anything that left the session. Zombies (already dead) are not listed."""
    needle = f"{POD_MARKER_ENV}={uid}".encode()
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        if session is not None and _session_of(entry) == session:
            try:
                with open(f"/proc/{entry}/stat", "rb") as handle:
                    zombie = handle.read().rsplit(b")", 1)[1].split()[0] == b"Z"
            except (OSError, IndexError):
                continue
            if not zombie:
                found.append(int(entry))
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


@dataclass
class LocalPod:
    """A pod of a local-exec node: its folder, log and (once started) process group."""

    namespace: str
    name: str
    uid: str
    folder: Path
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    started_at: str = ""
    stopping: bool = False
    termination_log: Path | None = None
    # (volume name, folder, sizeLimit as written) of its disk-backed emptyDirs with a sizeLimit
    limited: list[tuple[str, Path, str]] = field(default_factory=list)
    evicted: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    # container port -> the port of this machine it listens on instead (`local_services`)
    port_map: dict[int, int] = field(default_factory=dict)
    named_ports: dict[str, int] = field(default_factory=dict)
    ready: bool | None = None  # None: no readiness probe (ready while it runs)
    launch: tuple[list[str], dict[str, str], str] | None = None  # argv, env, cwd: for restarts
    restarts: int = 0


def _session(local: LocalPod) -> int | None:
    return local.process.pid if local.process is not None else None


def _signal_all(local: LocalPod, sig: int) -> None:
    for pid in pod_pids(local.uid, _session(local)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def catches_signal(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (/proc's SigCgt mask)."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def kill_pod_processes(local: LocalPod, grace_s: float) -> None:
    """Stop a pod as a container runtime does: SIGTERM its main process only (the container's PID
    1, which the kernel spares any signal it has no handler for: one without a handler ignores it),
    wait up to `grace_s` for it to exit, then SIGKILL everything left (a PID namespace ends with its
    init). So a main process that never handles SIGTERM takes the whole grace period, as on a node."""
    main = local.process
    if main is not None and main.poll() is None:
        if catches_signal(main.pid, signal.SIGTERM):
            with contextlib.suppress(ProcessLookupError):
                os.kill(main.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            main.wait(timeout=grace_s)
    _signal_all(local, signal.SIGKILL)
    if main is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            main.wait(timeout=5)
    deadline = time.monotonic() + 5
    while pod_pids(local.uid, _session(local)) and time.monotonic() < deadline:
        time.sleep(0.1)


def _has_started(pod: Any) -> bool:
    """Whether a container of `pod` ever ran or ended (a waiting container has not started)."""
    for cs in (pod.status.container_statuses if pod.status else None) or []:
        if cs.state is not None and (cs.state.running is not None or cs.state.terminated is not None):
            return True
    return False


class LocalExecPods:
    """The FakeKubelet's local-exec half: start, watch, stop and delete the pods that run here."""

    def pod_log(self, namespace: str, name: str) -> str:
        """stdout+stderr of the latest local-exec pod `namespace/name` ("" when it never ran here)."""
        with self._lock:
            local = self._by_name.get((namespace, name))
        if local is None:
            return ""
        try:
            return local.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def _log_of(self, namespace: str, name: str) -> tuple[Path, Callable[[], bool]] | None:
        """The latest local-exec pod's log file and whether its process still runs."""
        with self._lock:
            local = self._by_name.get((namespace, name))
        if local is None:
            return None
        return local.log_path, lambda: local.process is not None and local.process.poll() is None

    def local_pids(self, namespace: str, name: str) -> list[int]:
        """Live processes of the latest local-exec pod `namespace/name` (empty once it is gone)."""
        with self._lock:
            local = self._by_name.get((namespace, name))
        return pod_pids(local.uid, _session(local)) if local is not None else []

    def _handle_local(self, pod: Any, *, resume: bool = False) -> None:
        uid = pod.metadata.uid
        with self._lock:
            local = self._local.get(uid)
            if pod.metadata.deletion_timestamp is not None:
                if local is not None:
                    if local.stopping:
                        return
                    local.stopping = True
                self._spawn_thread(self._delete_local, pod, local, name=f"fakelet-stop-{pod.metadata.name}")
                return
            if local is not None:
                return  # starting or running already
            started_before = pod.status and (_has_started(pod) or pod.status.phase not in (None, "Pending"))
            if started_before and not resume:
                return  # run by an earlier kubelet: nothing to restart (restartPolicy is the operator's)
            if self._root is None:
                # Short: Ray's AF_UNIX socket paths live under the pod's TMPDIR (107 bytes at most).
                self._root = Path(tempfile.mkdtemp(prefix="rljp-", dir="/tmp"))
            self._seq += 1
            folder = self._root / str(self._seq)
            folder.mkdir()
            namespace, name = pod.metadata.namespace, pod.metadata.name
            log_path = folder / "pod.log"
            if self._log_dir is not None:
                self._log_dir.mkdir(parents=True, exist_ok=True)
                log_path = self._log_dir / f"{namespace}_{name}.log"
            local = LocalPod(namespace, name, uid, folder, log_path)
            self._local[uid] = local
            self._by_name[(local.namespace, local.name)] = local
        self._spawn_thread(self._start_local, pod, local, name=f"fakelet-start-{pod.metadata.name}")

    def _spawn_thread(self, target: Any, *args: Any, name: str) -> None:
        threading.Thread(target=target, args=args, name=name, daemon=True).start()

    def _start_local(self, pod: Any, local: LocalPod) -> None:
        deadline = time.monotonic() + START_RETRY_S
        while True:
            try:
                argv, env, cwd = self._prepare_local(pod, local)
                break
            except Exception as error:  # e.g. its ConfigMap not there yet: a kubelet retries
                if self._stop.is_set() or local.stopping:
                    return
                if time.monotonic() > deadline:
                    log.warning("local pod %s/%s could not start: %s", local.namespace, local.name, error)
                    local.log_path.write_text(f"fakelet: could not start the container: {error}\n")
                    with contextlib.suppress(ApiException):
                        self._set_terminated(pod, 128, message=f"could not start: {error}")
                    return
                self._stop.wait(1.0)
        with self._lock:
            if local.stopping or self._stop.is_set():
                return
            with open(local.log_path, "ab") as out:
                try:
                    local.process = subprocess.Popen(
                        argv,
                        env=env,
                        cwd=cwd,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                except OSError as error:
                    out.write(f"fakelet: exec {argv!r} failed: {error}\n".encode())
                    local.process = None
        if local.process is None:
            with contextlib.suppress(ApiException):
                self._set_terminated(pod, 127, message=f"exec {argv[0]} failed")
            return
        local.launch = (argv, env, cwd)
        self._running(pod, local)
        if local.limited:
            self._spawn_thread(self._watch_storage, pod, local, name=f"fakelet-storage-{pod.metadata.name}")
        self._watch_exit(pod, local)

    def _running(self, pod: Any, local: LocalPod, last_state: dict[str, Any] | None = None) -> None:
        """Report the (re)started container Running, and start its readiness probe if it has one."""
        assert local.process is not None
        local.started_at = _rfc3339(_now())
        log.info("local pod %s/%s started as pid %s", local.namespace, local.name, local.process.pid)
        probe = pod.spec.containers[0].readiness_probe
        http = probe.http_get if probe is not None else None
        local.ready = False if http is not None else None
        with contextlib.suppress(ApiException):
            self._set_running(
                pod,
                ip=LOCAL_POD_IP,
                container_id="local",
                ready=http is None,
                restart_count=local.restarts,
                last_state=last_state,
                started_at=local.started_at,
            )
        if http is not None:
            process = local.process
            self._spawn_thread(
                self._probe_readiness,
                pod,
                local,
                process,
                last_state,
                name=f"fakelet-probe-{pod.metadata.name}",
            )

    def _probe_readiness(
        self, pod: Any, local: LocalPod, process: Any, last_state: dict[str, Any] | None
    ) -> None:
        """The kubelet's prober for an httpGet readiness probe: every periodSeconds against the pod's
        own port; Ready at the first success, not ready after failureThreshold failures in a row."""
        probe = pod.spec.containers[0].readiness_probe
        http = probe.http_get
        target = local_services.container_port(pod.spec.containers[0], http.port)
        port = local.port_map.get(target, target) if target is not None else None
        period = float(probe.period_seconds or 10)
        timeout = float(probe.timeout_seconds or 1)
        threshold = int(probe.failure_threshold or 3)
        self._stop.wait(float(probe.initial_delay_seconds or 0))
        failures = 0
        while not self._stop.is_set() and not local.stopping and process.poll() is None:
            ok = port is not None and local_services.http_probe(port, http.path or "/", timeout)
            failures = 0 if ok else failures + 1
            now_ready = True if ok else (False if failures >= threshold else local.ready)
            if now_ready != local.ready and process.poll() is None and not local.stopping:
                local.ready = bool(now_ready)
                with contextlib.suppress(ApiException):
                    self._set_running(
                        pod,
                        ip=LOCAL_POD_IP,
                        container_id="local",
                        ready=local.ready,
                        restart_count=local.restarts,
                        last_state=last_state,
                        started_at=local.started_at,
                    )
            self._stop.wait(period)

    def _watch_storage(self, pod: Any, local: LocalPod) -> None:
        """The kubelet's eviction manager for emptyDir sizeLimits: a pod whose disk-backed emptyDir
        holds more than its limit is killed at once and ends Failed, reason Evicted, with the
        kubelet's message (pkg/kubelet/eviction: emptyDirLimitEviction, evictPod)."""
        limits = [(name, folder, spec, parse_quantity(spec)) for name, folder, spec in local.limited]
        while local.process is not None and local.process.poll() is None and not self._stop.is_set():
            for name, folder, spec, limit in limits:
                if _used_bytes(folder) > limit:
                    # Go's %q quoting, as in the kubelet's emptyDirMessageFmt
                    quoted = json.dumps(name), json.dumps(spec)
                    message = "Usage of EmptyDir volume {} exceeds the limit {}. ".format(*quoted)
                    log.info("local pod %s/%s evicted: %s", local.namespace, local.name, message)
                    local.evicted = True
                    kill_pod_processes(local, grace_s=1.0)
                    with contextlib.suppress(ApiException):
                        self._set_terminated(
                            pod, 137, started_at=local.started_at, container_id="local", evicted=message
                        )
                    return
            self._stop.wait(STORAGE_CHECK_S)

    def _watch_exit(self, pod: Any, local: LocalPod) -> None:
        assert local.process is not None
        code = local.process.wait()
        exit_code = code if code >= 0 else 128 - code  # killed by signal N: 128+N, as runtimes report
        log.info("local pod %s/%s exited with %s", local.namespace, local.name, exit_code)
        policy = pod.spec.restart_policy or "Always"
        restarts = policy == "Always" or (policy == "OnFailure" and exit_code != 0)
        if restarts and not (local.stopping or local.evicted or self._stop.is_set()):
            self._restart(pod, local, exit_code)
            return
        if not (local.stopping or local.evicted or self._stop.is_set()):
            message = self._termination_message(pod, local, exit_code)
            with contextlib.suppress(ApiException):
                self._set_terminated(
                    pod, exit_code, started_at=local.started_at, container_id="local", message=message
                )
        # A container ends with its main process: nothing it left behind (Ray daemons) survives it.
        # Reported first, as in a container where everything dies at once: the daemons' end must not
        # make the job's other pods fail before this one's exit is known.
        if not local.stopping:
            kill_pod_processes(local, grace_s=5.0)

    def _restart(self, pod: Any, local: LocalPod, exit_code: int) -> None:
        """restartPolicy Always (or OnFailure after a failure): the kubelet brings the container back
        after a back-off of 10 s doubling to 300 s (CrashLoopBackOff meanwhile, the last run in
        lastState). Unlike a kubelet, the back-off never resets after a long run: stricter, not looser."""
        kill_pod_processes(local, grace_s=5.0)  # what the container left (its PID namespace ends)
        last_state = {
            "terminated": {
                "exitCode": exit_code,
                "reason": "Completed" if exit_code == 0 else "Error",
                "startedAt": local.started_at,
                "finishedAt": _rfc3339(_now()),
                **(
                    {"message": message}
                    if (message := self._termination_message(pod, local, exit_code))
                    else {}
                ),
            }
        }
        local.restarts += 1
        local.ready = False if local.ready is not None else None
        back_off_s = min(RESTART_BACK_OFF_S * 2 ** (local.restarts - 1), MAX_RESTART_BACK_OFF_S)
        self._set_back_off(pod, restart_count=local.restarts, last_state=last_state, back_off_s=back_off_s)
        deadline = time.monotonic() + back_off_s
        while time.monotonic() < deadline:
            if self._stop.wait(0.5) or local.stopping:
                return
        assert local.launch is not None
        argv, env, cwd = local.launch
        with self._lock:
            if local.stopping or self._stop.is_set():
                return
            with open(local.log_path, "ab") as out:
                local.process = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        if local.termination_log is not None:
            local.termination_log.write_text("")  # a new run writes its own termination message
        self._running(pod, local, last_state)
        self._watch_exit(pod, local)

    def _termination_message(self, pod: Any, local: LocalPod, exit_code: int) -> str | None:
        """The file the container wrote, else (FallbackToLogsOnError, on failure) the log's tail."""
        text = ""
        if local.termination_log is not None:
            with contextlib.suppress(OSError):
                text = local.termination_log.read_text(errors="replace")[:4096]
        policy = pod.spec.containers[0].termination_message_policy or "File"
        if not text.strip() and exit_code != 0 and policy == "FallbackToLogsOnError":
            with contextlib.suppress(OSError):
                lines = local.log_path.read_text(errors="replace").splitlines()[-FALLBACK_LOG_LINES:]
                text = "\n".join(lines).encode()[-FALLBACK_LOG_BYTES:].decode(errors="replace")
        return text.strip() or None

    def _delete_local(self, pod: Any, local: LocalPod | None) -> None:
        if local is not None:
            grace = pod.metadata.deletion_grace_period_seconds
            grace_s = STOP_GRACE_CAP_S if grace is None else min(float(grace), STOP_GRACE_CAP_S)
            kill_pod_processes(local, grace_s)
            with self._lock:
                self._local.pop(local.uid, None)
        try:
            self._core.delete_namespaced_pod(
                pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0
            )
        except ApiException:
            pass  # already gone
        except Exception:  # the apiserver stopped under us (teardown) or a transient error
            if not self._stop.is_set():
                log.exception("confirming the deletion of pod %s", pod.metadata.name)

    def ray_port(self, namespace: str, job: str) -> int | None:
        """The loopback port of job `namespace/job`'s Ray head here (None before its first pod)."""
        with self._lock:
            return self._job_ports.get((namespace, job))

    def _job_port(self, namespace: str, job: str) -> int:
        with self._lock:
            port = self._job_ports.get((namespace, job))
            if port is None:
                port = self._job_ports[(namespace, job)] = _free_port()
            return port

    def _prepare_local(self, pod: Any, local: LocalPod) -> tuple[list[str], dict[str, str], str]:
        """argv, environment and working directory of the pod's first container on this machine."""
        container = pod.spec.containers[0]
        namespace = local.namespace
        mounts = self._materialise_volumes(pod, container, local)
        # The container's termination-message file, as the kubelet bind-mounts it.
        message_path = container.termination_message_path or DEFAULT_TERMINATION_MESSAGE_PATH
        local.termination_log = local.folder / "termination-log"
        local.termination_log.touch()
        mounts.append((message_path, str(local.termination_log)))
        mounts.sort(key=lambda m: len(m[0]), reverse=True)
        context = container.security_context
        read_only = bool(context is not None and context.read_only_root_filesystem)
        image_root = READ_ONLY_ROOT if read_only else str(local.folder)
        env = {k: os.environ[k] for k in HOST_ENV_KEEP if k in os.environ}
        env["PATH"] = os.pathsep.join([os.path.dirname(self._python), env.get("PATH", "/usr/bin:/bin")])
        env["HOME"] = image_root  # the image's home, read-only with readOnlyRootFilesystem
        env["HOSTNAME"] = pod.spec.hostname or local.name
        env["PYTHONUNBUFFERED"] = "1"
        tmp = rewrite_path("/tmp", mounts)
        env["TMPDIR"] = tmp if tmp != "/tmp" else image_root
        for var in container.env or []:
            value = self._env_value(pod, var)
            if value is not None:
                env[var.name] = rewrite_path(_expand(value, env), mounts)
        # One host network: the job's Ray head is on loopback, on a port of its own.
        job = (pod.metadata.labels or {}).get(JOB_LABEL)
        if ENV_RAY_HEAD in env:
            env[ENV_RAY_HEAD] = LOCAL_POD_IP
        if job and ENV_RAY_PORT in env:
            port = self._job_port(namespace, job)
            env[ENV_RAY_PORT] = str(port)
            env["RAY_ADDRESS"] = f"{LOCAL_POD_IP}:{port}"  # `ray.init("auto")` finds this job's head
            env["RAY_USE_RANDOM_PORTS"] = "1"  # worker processes: OS-assigned ports, not 10002-19999
            env[RAY_START_ARGS_ENV] = " ".join(
                [
                    *(f"--{flag}={_free_port()}" for flag in RAY_PORT_FLAGS),
                    # Worker nodes take the head's temp dir from the GCS, so on one host every pod's
                    # raylet would race for the same socket files (`bind: Address already in use`);
                    # in a real pod the filesystem is its own. Give each pod its own temp dir.
                    f"--temp-dir={env['TMPDIR']}/ray",
                ]
            )
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(self._ray_start_hook()), env.get("PYTHONPATH")) if p
            )
        # A server's port (spec.environments[], trainer pod 0's endpoint): a free port of this machine
        # instead of its container port, which every replica and job would otherwise share here
        # (local_services).
        local.labels = dict(pod.metadata.labels or {})
        local.named_ports = {p.name: int(p.container_port) for p in container.ports or [] if p.name}
        for port_env in local_services.PORT_ENVS:
            if port_env in env and env[port_env].isdigit():
                declared = int(env[port_env])
                local.port_map[declared] = self._pod_port(namespace, local.name, declared)
                env[port_env] = str(local.port_map[declared])
        if self._automount_token(pod):
            env["KUBECONFIG"] = str(self._service_account_kubeconfig(pod, local))
        env[POD_MARKER_ENV] = local.uid
        with self._lock:
            if pod.spec.node_name in self._accelerator_exec_nodes:
                env[CPU_STANDIN_ENV] = "1"
        argv = [*(container.command or []), *(container.args or [])]
        if not argv:
            raise ValueError("the container has no command: a local-exec node has no image entrypoint")
        argv = [rewrite_path(_expand(a, env), mounts) for a in argv]
        if argv[0] in PYTHON_NAMES:
            argv[0] = self._python
        cwd = rewrite_path(container.working_dir, mounts) if container.working_dir else None
        if cwd is None or cwd == container.working_dir:  # the image's directory, not a volume
            cwd = READ_ONLY_CWD if read_only else str(local.folder)
        return argv, env, cwd

    def _ray_start_hook(self) -> Path:
        """The folder holding the `sitecustomize` that gives `ray start` free ports."""
        assert self._root is not None
        folder = self._root / "site"
        if not folder.exists():
            staging = self._root / ".site.staging"
            staging.mkdir(exist_ok=True)
            (staging / "sitecustomize.py").write_text(RAY_START_HOOK)
            staging.rename(folder)
        return folder

    def _materialise_volumes(self, pod: Any, container: Any, local: LocalPod) -> list[tuple[str, str]]:
        """Per-pod folders for the container's volumes: (mountPath, folder), longest mountPath first."""
        volumes = {v.name: v for v in pod.spec.volumes or []}
        mounts: list[tuple[str, str]] = []
        configmap_dirs: list[Path] = []
        for mount in container.volume_mounts or []:
            volume = volumes.get(mount.name)
            folder = local.folder / mount.name
            host_path = self._claim_host_path(local.namespace, volume) if volume is not None else None
            if host_path is not None:
                # A PVC bound to a hostPath/local PV: the pod sees that folder of this machine.
                folder = Path(host_path)
            elif not folder.exists() and volume is not None:
                staging = local.folder / f".{mount.name}.staging"
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir()
                if volume.config_map is not None:
                    self._write_config_map(namespace=local.namespace, source=volume.config_map, into=staging)
                    configmap_dirs.append(folder)
                elif volume.secret is not None:
                    self._write_secret(namespace=local.namespace, source=volume.secret, into=staging)
                elif volume.empty_dir is None and volume.projected is None:
                    log.warning(
                        "local pod %s: volume %s is served as an empty folder", local.name, mount.name
                    )
                staging.rename(folder)
            host = folder / mount.sub_path if mount.sub_path else folder
            mounts.append((mount.mount_path, str(host)))
            empty = volume.empty_dir if volume is not None else None
            if empty is not None and empty.size_limit and empty.medium != "Memory":
                local.limited.append((mount.name, folder, str(empty.size_limit)))
        mounts.sort(key=lambda m: len(m[0]), reverse=True)
        for folder in configmap_dirs:
            for path in folder.rglob("*"):
                if path.is_file() and path.suffix in (".json", ".yaml", ".yml"):
                    text = rewrite_json_paths(path.read_text(), mounts)
                    path.write_text(local_services.rewrite_service_urls(text, self._resolve_url))
        return mounts

    def _claim_host_path(self, namespace: str, volume: Any) -> str | None:
        """The folder of the hostPath (or local) PV a PVC volume is bound to; None for other volumes.
        Raises while the claim is unbound (the start loop retries, as a kubelet waits)."""
        claim = volume.persistent_volume_claim
        if claim is None:
            return None
        pvc = self._core.read_namespaced_persistent_volume_claim(claim.claim_name, namespace)
        if not pvc.spec.volume_name:
            raise ValueError(f"PersistentVolumeClaim {claim.claim_name} is not bound yet")
        pv = self._core.read_persistent_volume(pvc.spec.volume_name)
        source = pv.spec.host_path or pv.spec.local
        return source.path if source is not None else None

    def _write_config_map(self, *, namespace: str, source: Any, into: Path) -> None:
        try:
            cm = self._core.read_namespaced_config_map(source.name, namespace)
        except ApiException as error:
            if error.status == 404 and source.optional:
                return
            raise
        files: dict[str, bytes] = {k: v.encode() for k, v in (cm.data or {}).items()}
        files.update({k: base64.b64decode(v) for k, v in (cm.binary_data or {}).items()})
        _write_items(files, source.items, into)

    def _write_secret(self, *, namespace: str, source: Any, into: Path) -> None:
        try:
            secret = self._core.read_namespaced_secret(source.secret_name, namespace)
        except ApiException as error:
            if error.status == 404 and source.optional:
                return
            raise
        files = {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}
        _write_items(files, source.items, into)

    def _env_value(self, pod: Any, var: Any) -> str | None:
        if var.value_from is None:
            return var.value if var.value is not None else ""
        source = var.value_from
        if source.field_ref is not None:
            path = source.field_ref.field_path
            fields = {
                "metadata.name": pod.metadata.name,
                "metadata.namespace": pod.metadata.namespace,
                "metadata.uid": pod.metadata.uid,
                "spec.nodeName": pod.spec.node_name,
                "spec.serviceAccountName": pod.spec.service_account_name,
                "status.podIP": LOCAL_POD_IP,
                "status.hostIP": LOCAL_POD_IP,
            }
            if path not in fields:
                raise ValueError(f"env {var.name}: fieldRef {path} is not supported on a local-exec node")
            return fields[path]
        if source.config_map_key_ref is not None:
            value = self._key_ref(self._core.read_namespaced_config_map, source.config_map_key_ref, pod)
            return None if value is None else str(value)
        if source.secret_key_ref is not None:
            value = self._key_ref(self._core.read_namespaced_secret, source.secret_key_ref, pod)
            return None if value is None else base64.b64decode(value).decode()
        raise ValueError(f"env {var.name}: resourceFieldRef is not supported on a local-exec node")

    @staticmethod
    def _key_ref(read: Callable[[str, str], Any], ref: Any, pod: Any) -> str | None:
        """A configMapKeyRef or secretKeyRef value (secrets stay base64); None when optional and absent."""
        try:
            data = read(ref.name, pod.metadata.namespace).data or {}
        except ApiException as error:
            if error.status == 404 and ref.optional:
                return None
            raise
        if ref.key not in data and ref.optional:
            return None
        return data[ref.key]

    def _automount_token(self, pod: Any) -> bool:
        if pod.spec.automount_service_account_token is not None:
            return bool(pod.spec.automount_service_account_token)
        account = pod.spec.service_account_name or "default"
        sa = self._core.read_namespaced_service_account(account, pod.metadata.namespace)
        return sa.automount_service_account_token is not False

    def _service_account_kubeconfig(self, pod: Any, local: LocalPod) -> Path:
        """A kubeconfig with a token bound to this pod (TokenRequest), as a kubelet projects one."""
        account = pod.spec.service_account_name or "default"
        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(
                audiences=[],
                expiration_seconds=3600,
                bound_object_ref=client.V1BoundObjectReference(
                    kind="Pod", api_version="v1", name=pod.metadata.name, uid=pod.metadata.uid
                ),
            )
        )
        token = self._core.create_namespaced_service_account_token(
            account, pod.metadata.namespace, request
        ).status.token
        configuration = self._api_client.configuration
        cluster: dict[str, Any] = {"server": configuration.host}
        if configuration.ssl_ca_cert:
            ca = local.folder / "ca.crt"
            shutil.copyfile(configuration.ssl_ca_cert, ca)
            cluster["certificate-authority"] = str(ca)
        user = f"system:serviceaccount:{pod.metadata.namespace}:{account}"
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "local", "cluster": cluster}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [
                {
                    "name": "pod",
                    "context": {"cluster": "local", "user": user, "namespace": pod.metadata.namespace},
                }
            ],
            "current-context": "pod",
        }
        path = local.folder / "sa.kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig))
        path.chmod(0o600)
        return path

    # ---- Services of local pods (local_services: the kube-proxy of this machine) -------------------

    def _pod_port(self, namespace: str, pod: str, port: int) -> int:
        """The port of this machine standing for container port `port` of pod `namespace/pod`: one per
        pod name (a recreated pod keeps it, as its DNS name), allocated by whichever asks first, the pod
        or a URL naming it."""
        with self._lock:
            key = (namespace, pod, port)
            if key not in self._pod_ports:
                self._pod_ports[key] = _free_port()
            return self._pod_ports[key]

    def _resolve_url(self, namespace: str, service: str, pod: str | None, port: int) -> int | None:
        """The local port an in-cluster URL reaches (`local_services.rewrite_service_urls`): a pod's own
        name under its headless Service, or a Service."""
        if pod is not None:
            try:
                svc = self._core.read_namespaced_service(service, namespace)
            except ApiException:
                return None
            if svc.spec.cluster_ip not in (None, "None") and svc.spec.cluster_ip != "":
                return None  # pod names resolve under headless Services only
            return self._pod_port(namespace, pod, port)
        return self._service_port(namespace, service, port)

    def _service_port(self, namespace: str, service: str, port: int) -> int | None:
        """The local port of Service `namespace/service`'s `port` (its proxy, started on first use), or
        None when no such Service port exists. A headless Service has no port of its own: a URL's port
        is the pods' port, as DNS gives their addresses."""
        key = (namespace, service, port)
        with self._lock:
            if key in self._service_proxies:
                proxy = self._service_proxies[key]
                return proxy.port if proxy is not None else None
        try:
            svc = self._core.read_namespaced_service(service, namespace)
        except ApiException:
            return None
        target: int | str | None = port if svc.spec.cluster_ip == "None" else None
        for declared in svc.spec.ports or []:
            if int(declared.port) == port:
                target = declared.target_port if declared.target_port is not None else declared.port
        if target is None:
            return None
        selector = dict(svc.spec.selector or {})
        proxy = local_services.ServiceProxy(
            f"{namespace}/{service}:{port}", lambda: self._ready_endpoints(namespace, selector, target)
        )
        with self._lock:
            if key in self._service_proxies:  # another thread was first
                proxy.close()
                existing = self._service_proxies[key]
                return existing.port if existing is not None else None
            self._service_proxies[key] = proxy
        return proxy.port

    def _ready_endpoints(self, namespace: str, selector: dict[str, str], target: int | str) -> list[int]:
        """Local ports of the ready, running local pods the Service selects, at its target port."""
        ports = []
        with self._lock:
            pods = [p for p in self._by_name.values() if p.namespace == namespace]
        for p in pods:
            alive = p.process is not None and p.process.poll() is None and not p.stopping
            if not (alive and p.ready is not False and local_services.selects(selector, p.labels)):
                continue
            number = (
                p.named_ports.get(target) if isinstance(target, str) and not target.isdigit() else int(target)
            )
            if number is not None:
                ports.append(p.port_map.get(number, number))
        return sorted(ports)

    def _close_service_proxies(self) -> None:
        with self._lock:
            proxies = [p for p in self._service_proxies.values() if p is not None]
            self._service_proxies.clear()
        for proxy in proxies:
            proxy.close()

    def _stop_local_pods(self) -> None:
        with self._lock:
            pods = list(self._local.values())
            for local in pods:
                local.stopping = True
        threads = [
            threading.Thread(target=kill_pod_processes, args=(local, 3.0), daemon=True) for local in pods
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)

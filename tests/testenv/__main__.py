"""`python -m testenv up|down|status|build`: the local cluster, by hand.

`up` starts the control plane in a background process (`serve`) whose state lives in
`.rljob/cluster/` at the repository root, registers a few fake accelerator nodes (h100, ascend: they
run nothing), the local-exec accelerator nodes gpu-local-0/1 and npu-local-0 and a local-exec cpu
node (their pods really run, as processes here), and prints the
`export KUBECONFIG=...` line to paste. `down` stops it. `build` only builds the binaries.
`--kueue` (with `up` or `build`) adds the real Kueue manager (`testenv.kueue`): its CRDs, RBAC and
webhooks, configured for RLJobs (`externalFrameworks: [RLJob.v1alpha1.rljob.io]`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from testenv import binaries, kueue
from testenv.cluster import LOCAL_ACCELERATOR_POOLS, LocalCluster

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_STATE = REPO_ROOT / ".rljob" / "cluster"

# A small heterogeneous fleet like the pools the examples target.
DEFAULT_POOLS = [
    {
        "count": 2,
        "name_prefix": "h100",
        "resource": "nvidia.com/gpu",
        "per_node": 8,
        "labels": {"rljob.io/accelerator": "H100-80GB", "node.kubernetes.io/instance-type": "p5.48xlarge"},
        "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
    },
    {
        "count": 1,
        "name_prefix": "ascend",
        "resource": "huawei.com/Ascend910",
        "per_node": 8,
        "labels": {"rljob.io/accelerator": "Ascend910B3"},
        "taints": [{"key": "huawei.com/Ascend910", "value": "present", "effect": "NoSchedule"}],
    },
    *LOCAL_ACCELERATOR_POOLS,
    {
        "count": 1,
        "name_prefix": "cpu",
        "resource": None,
        "per_node": 0,
        "labels": {"rljob.io/pool": "cpu"},
        "taints": [],
        "cpu": "8",
        "memory": "32Gi",
        # Pods bound here really run, as processes on this machine (examples/tiny-cpu.yaml trains).
        "exec_local": True,
    },
]


def serve(state: Path, with_kueue: bool = False) -> int:
    state.mkdir(parents=True, exist_ok=True)
    (state / "ready").unlink(missing_ok=True)
    cluster = LocalCluster.create(state / "run")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with cluster:
        for pool in DEFAULT_POOLS:
            cluster.add_nodes(**pool)  # type: ignore[arg-type]
        if with_kueue:
            kueue.start_kueue(cluster)
        (state / "ready").write_text(
            json.dumps({"kubeconfig": str(cluster.kubeconfig), "server": cluster.server})
        )
        stop.wait()
    (state / "ready").unlink(missing_ok=True)
    return 0


def up(state: Path, timeout_s: float, with_kueue: bool = False) -> int:
    pid_file = state / "pid"
    if pid_file.exists() and _alive(int(pid_file.read_text())) and (state / "ready").exists():
        print(_export_line(state))
        return 0
    binaries.ensure_all()
    if with_kueue:
        binaries.ensure_kueue()
    state.mkdir(parents=True, exist_ok=True)
    (state / "ready").unlink(missing_ok=True)
    kueue_flag = ["--kueue"] if with_kueue else []
    with open(state / "serve.log", "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "testenv", "serve", "--state", str(state), *kueue_flag],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT / "tests")),
        )
    pid_file.write_text(str(process.pid))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (state / "ready").exists():
            extra = ", Kueue " + binaries.kueue_version() if with_kueue else ""
            print(f"local cluster is up (nodes: {', '.join(_pool_summary())}{extra})", file=sys.stderr)
            print(_export_line(state))
            return 0
        if process.poll() is not None:
            print((state / "serve.log").read_text(errors="replace")[-4000:], file=sys.stderr)
            return 1
        time.sleep(0.3)
    print(f"the local cluster was not ready after {timeout_s}s; see {state / 'serve.log'}", file=sys.stderr)
    return 1


def down(state: Path) -> int:
    pid_file = state / "pid"
    if not pid_file.exists():
        print("no local cluster is running", file=sys.stderr)
        return 0
    pid = int(pid_file.read_text())
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            if not _alive(pid):
                break
            time.sleep(0.2)
    pid_file.unlink(missing_ok=True)
    print("local cluster stopped", file=sys.stderr)
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _export_line(state: Path) -> str:
    info = json.loads((state / "ready").read_text())
    return f"export KUBECONFIG={info['kubeconfig']}"


def _pool_summary() -> list[str]:
    return [f"{p['count']}x {p['name_prefix']}" for p in DEFAULT_POOLS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testenv", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status", "build", "serve"])
    parser.add_argument(
        "--state", type=Path, default=DEFAULT_STATE, help="folder holding the cluster's state"
    )
    parser.add_argument(
        "--timeout", type=float, default=600, help="seconds to wait for readiness (first run builds)"
    )
    parser.add_argument(
        "--kueue", action="store_true", help="also run the Kueue manager (up), or build it (build)"
    )
    args = parser.parse_args(argv)
    if args.command == "build":
        for name, path in binaries.ensure_all().items():
            print(f"{name}: {path}")
        if args.kueue:
            print(f"kueue: {binaries.ensure_kueue() / 'kueue'}")
        return 0
    if args.command == "serve":
        return serve(args.state, args.kueue)
    if args.command == "up":
        return up(args.state, args.timeout, args.kueue)
    if args.command == "down":
        return down(args.state)
    running = (args.state / "ready").exists() and (args.state / "pid").exists()
    print(_export_line(args.state) if running else "no local cluster is running")
    return 0


if __name__ == "__main__":
    sys.exit(main())

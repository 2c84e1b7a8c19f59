"""The test kubelet reports a local process's end as a kubelet does: the termination-message file
becomes `state.terminated.message`, and FallbackToLogsOnError falls back to the log's tail; and it
holds a container to its sandbox as far as it can (a read-only root filesystem, emptyDir
sizeLimits), never more permissive than a kubelet."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import yaml

from testenv.cluster import restricted
from testenv.waiting import wait_for

pytestmark = pytest.mark.cluster


def _pod(name: str, node_label: str, script: str, policy: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": restricted(
            {
                "restartPolicy": "Never",
                "nodeSelector": {"pool": node_label},
                "containers": [
                    {
                        "name": "main",
                        "image": "local",
                        "command": ["python", "-c", script],
                        "env": [{"name": "RLJOB_TERMINATION_LOG", "value": "/dev/termination-log"}],
                        "terminationMessagePolicy": policy,
                    }
                ],
            }
        ),
    }


def _terminated(cluster: Any, namespace: str, name: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        pod = cluster.get_json("pod", name, namespace=namespace) or {}
        if pod.get("status", {}).get("phase") not in ("Failed", "Succeeded"):
            return None
        return pod["status"]["containerStatuses"][0]["state"]["terminated"]

    return wait_for(f"{name} terminated", done, 60)


def test_termination_message_file_and_log_fallback(cluster: Any, namespace: str) -> None:
    label = f"t{uuid.uuid4().hex[:6]}"
    nodes = cluster.add_nodes(1, name_prefix=label, resource=None, labels={"pool": label}, exec_local=True)
    try:
        wrote = (
            "import os, sys; open(os.environ['RLJOB_TERMINATION_LOG'], 'w').write('dataset not found'); "
            "sys.exit(3)"
        )
        silent = "import sys; print('last words before the crash', flush=True); sys.exit(1)"
        pods = [
            _pod("wrote", label, wrote, "FallbackToLogsOnError"),
            _pod("silent", label, silent, "FallbackToLogsOnError"),
            _pod("silent-file", label, silent, "File"),
        ]
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(pods))
        term = _terminated(cluster, namespace, "wrote")
        assert term["exitCode"] == 3 and term["message"] == "dataset not found"
        assert "last words before the crash" in _terminated(cluster, namespace, "silent")["message"]
        assert not _terminated(cluster, namespace, "silent-file").get("message")  # File: no fallback
    finally:
        cluster.delete_nodes(nodes)


def _sandboxed(name: str, label: str, script: str, *, size_limit: str | None = None) -> dict[str, Any]:
    """A pod on a read-only root filesystem with two emptyDirs: /scratch (`size_limit`) and /tmp."""
    pod = _pod(name, label, script, "FallbackToLogsOnError")
    container = pod["spec"]["containers"][0]
    container["securityContext"]["readOnlyRootFilesystem"] = True
    container["volumeMounts"] = [
        {"name": "scratch", "mountPath": "/scratch"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    container["env"].append({"name": "SCRATCH", "value": "/scratch"})
    scratch: dict[str, Any] = {"sizeLimit": size_limit} if size_limit else {}
    pod["spec"]["volumes"] = [{"name": "scratch", "emptyDir": scratch}, {"name": "tmp", "emptyDir": {}}]
    return pod


def test_a_read_only_root_and_an_emptydir_limit_hold_as_under_a_kubelet(cluster: Any, namespace: str) -> None:
    """readOnlyRootFilesystem: the image's HOME and working directory take no write, the volumes
    do (TMPDIR is the /tmp volume); an emptyDir past its sizeLimit gets the pod evicted, with the
    kubelet's reason and message."""
    label = f"t{uuid.uuid4().hex[:6]}"
    nodes = cluster.add_nodes(1, name_prefix=label, resource=None, labels={"pool": label}, exec_local=True)
    writes = (
        "import os, sys, tempfile\n"
        "for where in (os.path.expanduser('~/x'), 'relative.txt'):\n"
        "    try:\n"
        "        open(where, 'w').write('x'); print('WROTE', where, flush=True); sys.exit(9)\n"
        "    except OSError as e:\n"
        "        print('REFUSED', type(e).__name__, flush=True)\n"
        "open(os.path.join(os.environ['SCRATCH'], 'ok'), 'w').write('x')\n"
        "tempfile.NamedTemporaryFile(delete=False).write(b'x')\n"
    )
    fills = (
        "import os, time\n"
        "with open(os.path.join(os.environ['SCRATCH'], 'big'), 'wb') as f:\n"
        "    f.write(os.urandom(3 * 1024 * 1024)); f.flush(); os.fsync(f.fileno())\n"
        "time.sleep(120)\n"
    )
    try:
        pods = [_sandboxed("writes", label, writes), _sandboxed("fills", label, fills, size_limit="1Mi")]
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(pods))
        term = _terminated(cluster, namespace, "writes")
        assert term["exitCode"] == 0, cluster.pod_log(namespace, "writes")
        assert cluster.pod_log(namespace, "writes").count("REFUSED") == 2
        _terminated(cluster, namespace, "fills")
        status = cluster.get_json("pod", "fills", namespace=namespace)["status"]
        assert status["phase"] == "Failed" and status["reason"] == "Evicted"
        assert status["message"] == 'Usage of EmptyDir volume "scratch" exceeds the limit "1Mi". '
    finally:
        cluster.delete_nodes(nodes)

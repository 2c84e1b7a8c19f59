"""The test kubelet reports a local process's end as a kubelet does: the termination-message file
becomes `state.terminated.message`, and FallbackToLogsOnError falls back to the log's tail."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import yaml

from testenv.waiting import wait_for

pytestmark = pytest.mark.cluster


def _pod(name: str, node_label: str, script: str, policy: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
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
        },
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

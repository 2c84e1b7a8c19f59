"""A crash-looping rollout pod waits its own backoff, on the real control plane with the test kubelet.

A dedicated engine's pod that fails is recreated alone (issue 14 item 5); one that keeps failing
must not be recreated in a tight loop. The operator counts each rollout pod's losses in a row in
`status.rollout.replacementBackoff`: the first replacement comes at once, the next waits
spec.restartPolicy's backoff (initialBackoffSeconds, doubling). The trainer gang keeps its pods,
and its restart count and backoff stay untouched.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
from test_operator import apply, job_status, operator, pods, rljob, running_pods

from testenv.waiting import wait_for

pytestmark = pytest.mark.cluster

BACKOFF_S = 6  # spec.restartPolicy.initialBackoffSeconds: the wait before the second replacement


def _unix(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_a_crash_looping_rollout_pod_waits_its_backoff_while_the_trainers_stay(
    cluster: Any, crd: None, namespace: str, pool: Callable[..., str], kubeconfig_env: None
) -> None:
    pool_name = pool(3)
    restart = {
        "policy": "OnFailure",
        "backoffLimit": 3,
        "initialBackoffSeconds": BACKOFF_S,
        "maxBackoffSeconds": 60,
    }
    job = rljob("loop", pool_name, restartPolicy=restart)
    rollout_pod = "loop-rollout-0"

    def uids() -> dict[str, str]:
        return {
            p["metadata"]["name"]: p["metadata"]["uid"] for p in running_pods(cluster, namespace, "loop", 3)()
        }

    def replaced(before: dict[str, str]) -> dict[str, str] | None:
        now = uids()
        return now if now and now[rollout_pod] != before[rollout_pod] else None

    def created(name: str) -> float:
        (pod,) = [p for p in pods(cluster, namespace, "loop") if p["metadata"]["name"] == name]
        return _unix(pod["metadata"]["creationTimestamp"])

    with operator(namespace):
        apply(cluster, namespace, job)
        first = wait_for("3 running pods", lambda: uids(), 60)

        # First loss: the pod is recreated alone, at once.
        cluster.fail_pod(namespace, rollout_pod, exit_code=1)
        second = wait_for("the rollout pod recreated", lambda: replaced(first), 60)
        backoff = job_status(cluster, namespace, "loop")["rollout"]["replacementBackoff"]
        assert [(b["index"], b["replacements"]) for b in backoff] == [(0, 1)], backoff

        # Second loss in a row: the replacement waits initialBackoffSeconds.
        failed_at = time.time()
        cluster.fail_pod(namespace, rollout_pod, exit_code=1)

        def waiting() -> dict[str, Any] | None:
            entries = (job_status(cluster, namespace, "loop").get("rollout") or {}).get("replacementBackoff")
            return next((b for b in entries or [] if b["replacements"] == 2), None)

        entry = wait_for("the second replacement's backoff recorded", waiting, 30, interval_s=0.2)
        not_before = _unix(entry["notBefore"])
        assert not_before >= failed_at + BACKOFF_S, entry  # never shorter than the spec (whole-second times)
        live = [
            p["metadata"]["name"]
            for p in pods(cluster, namespace, "loop")
            if not p["metadata"].get("deletionTimestamp")
        ]
        assert rollout_pod not in live, "the failed pod's replacement exists before its backoff ended"
        third = wait_for("the rollout pod recreated after its backoff", lambda: replaced(second), 60)
        assert created(rollout_pod) >= not_before, "recreated before status.rollout's notBefore"
        assert created(rollout_pod) - failed_at >= BACKOFF_S, "the replacement did not wait its backoff"

        # The trainer gang never restarted: same pods, no failure, restart or backoff of its own.
        for name in ("loop-trainer-0", "loop-trainer-1"):
            assert third[name] == first[name], "the trainer gang was restarted"
        # (the status follows the pods a reconcile later)
        st = wait_for(
            "the job Running",
            lambda: (s := job_status(cluster, namespace, "loop"))["phase"] == "Running" and s,
        )
        assert not st.get("restarts") and not st.get("failures") and not st.get("lastFailure"), st
        assert st["rollout"]["replacedPods"] == 2, st
        events = cluster.kubectl(
            "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=loop"
        ).stdout
        assert "RolloutPodBackoff" in events and f"{rollout_pod} lost its engine 2 times in a row" in events
        assert "until" in events

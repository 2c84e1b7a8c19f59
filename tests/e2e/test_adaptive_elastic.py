"""Adaptive end to end with the real driver: wake, add, lose and regain, then drain an engine.

`examples/adaptive-gpu-local.yaml` runs on the local-exec GPU pool (gpu-local-0/1: pods are
processes here, Ray sees exactly their nvidia.com/gpu, torch on CPU, the transformers engine
with vLLM's rules). Nothing writes telemetry but the driver. The job's reward
(`examples/rewards/length_phases.py`, from a ConfigMap) first asks for long completions, so
generation is the bottleneck; from step `SHORT_FROM_STEP` on it asks for short ones, so the
policy learns to stop early and the load on the engines really falls. The test checks, in order:

1. the operator wakes the shared engine, then adds a dedicated engine; rollout pod 0 is created,
   bound by the scheduler to a gpu-local node, joins Ray, gets the weights (the driver's reports
   count it), and steps per hour rise against the shared-engine-only stretch before it;
2. deleting the rollout pod mid-run leaves training going (no restart, same trainer pods, STEP
   advances while it is gone) and the pod comes back and serves again;
3. after the reward turns to short answers, the job calms and the operator lowers the target;
   the pod drains (status.rollout.drainingPods) and is deleted after the driver's release (or
   drainGraceSeconds); the job goes on to Succeeded without a restart.

The decisions, with their timestamps (status.rollout.lastDecision* and the RLJob's Events), are
printed to stderr (`e2e-adaptive ...` lines) and appended to $RLJOB_E2E_REPORT when set.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

os.environ.setdefault("RLJOB_RECONCILE_INTERVAL_S", "1")
os.environ.setdefault("RLJOB_METRICS_PORT", "0")
os.environ.setdefault("RLJOB_EVENT_INTERVAL_S", "1")

from kopf.testing import KopfRunner

from testenv.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "adaptive-gpu-local.yaml"
REWARD = REPO / "examples" / "rewards" / "length_phases.py"
SHORT_FROM_STEP = int(os.environ.get("RLJOB_E2E_SHORT_FROM_STEP", "60"))
MAX_STEPS = SHORT_FROM_STEP + 50

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def crd(cluster: Any) -> None:
    cluster.apply_crds(str(REPO / "crds"))


class Recorder(threading.Thread):
    """Polls the RLJob and its telemetry: every decision once (with its time) and every report once."""

    def __init__(self, cluster: Any, namespace: str, job: str) -> None:
        super().__init__(daemon=True)
        self.cluster, self.namespace, self.job = cluster, namespace, job
        self.decisions: list[dict[str, Any]] = []
        self.reports: dict[int, Any] = {}
        self.status: dict[str, Any] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        from rljob_trainer.outputs import telemetry

        while not self.stop.is_set():
            obj = self.cluster.get_json("rljob", self.job, namespace=self.namespace) or {}
            st = obj.get("status") or {}
            self.status = st
            ro = st.get("rollout") or {}
            stamp = ro.get("lastDecisionTime")
            if stamp and (not self.decisions or self.decisions[-1]["time"] != stamp):
                self.decisions.append({
                    "time": stamp,
                    "decision": ro.get("lastDecision"),
                    "sharedAwake": ro.get("desiredSharedAwake"),
                    "dedicated": ro.get("desiredDedicatedEngines"),
                    "step": (st.get("progress") or {}).get("step"),
                    "reason": ro.get("lastDecisionReason"),
                })  # fmt: skip
            cm = self.cluster.get_json("configmap", f"{self.job}-telemetry", namespace=self.namespace)
            try:
                for r in telemetry.parse_reports(((cm or {}).get("data") or {}).get(telemetry.REPORTS_KEY)):
                    self.reports.setdefault(r.step, r)
            except ValueError:
                pass
            self.stop.wait(0.5)

    def decided(self, name: str) -> dict[str, Any] | None:
        return next((d for d in self.decisions if d["decision"] == name), None)

    def latest(self) -> Any:
        return self.reports[max(self.reports)] if self.reports else None


def step_s(reports: list[Any]) -> float | None:
    """Median seconds per step over consecutive reports of one configuration."""
    gaps = [b.time - a.time for a, b in itertools.pairwise(reports) if b.step == a.step + 1]
    return statistics.median(gaps) if len(gaps) >= 3 else None


def live_pods(cluster: Any, namespace: str, job: str) -> dict[str, dict[str, Any]]:
    items = (cluster.get_json("pods", "-l", f"rljob.io/job={job}", namespace=namespace) or {}).get(
        "items", []
    )
    return {p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")}


def test_adaptive_job_wakes_adds_survives_loss_and_drains(
    cluster: Any,
    crd: None,
    local_accelerator_nodes: list[str],
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    manifest = yaml.safe_load(EXAMPLE.read_text())
    job = manifest["metadata"]["name"]
    manifest["spec"]["grpo"]["maxSteps"] = MAX_STEPS
    reward = tmp_path / "reward.py"
    reward.write_text(
        REWARD.read_text().replace("SHORT_FROM_STEP = 50", f"SHORT_FROM_STEP = {SHORT_FROM_STEP}")
    )
    cluster.kubectl(
        "create", "configmap", "adaptive-gpu-local-reward", "-n", namespace, f"--from-file=reward.py={reward}"
    )
    rec = Recorder(cluster, namespace, job)
    started = time.monotonic()
    args = ["run", "--standalone", "--namespace", namespace, "-m", "rljob_operator.handlers"]
    rollout_pod = f"{job}-rollout-0"

    def logs() -> str:
        names = sorted(live_pods(cluster, namespace, job)) or [f"{job}-trainer-0"]
        return "\n".join(f"===== {n} =====\n{cluster.pod_log(namespace, n)[-4000:]}" for n in names)

    def waiting(what: str, check: Any, timeout_s: float) -> Any:
        try:
            return wait_for(what, check, timeout_s, interval_s=0.5)
        except AssertionError as error:
            table = json.dumps(rec.decisions, indent=1)
            raise AssertionError(f"{error}\ndecisions: {table}\nstatus: {rec.status}\n{logs()}") from None

    try:
        with KopfRunner(args, timeout=60):
            cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))
            rec.start()
            trainers = waiting(
                "the trainer pod running",
                lambda: (p := live_pods(cluster, namespace, job)).get(f"{job}-trainer-0", {})
                .get("status", {}).get("phase") == "Running" and p,
                180,
            )  # fmt: skip
            trainer_uid = trainers[f"{job}-trainer-0"]["metadata"]["uid"]

            # 1. wake, then add: the rollout pod is created, bound, joins Ray and gets weights.
            waiting("the shared engine woken", lambda: rec.decided("WakeShared"), 300)
            waiting("a dedicated engine added", lambda: rec.decided("AddDedicated"), 300)
            pod = waiting(
                "rollout pod 0 running",
                lambda: (p := live_pods(cluster, namespace, job).get(rollout_pod))
                and p.get("status", {}).get("phase") == "Running" and p,
                180,
            )  # fmt: skip
            assert pod["spec"]["nodeName"].startswith("gpu-local-"), pod["spec"]["nodeName"]
            assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
            joined = waiting(
                "the driver serving from the dedicated engine",
                lambda: (r := rec.latest()) is not None and r.dedicated_engines == 1 and r.step,
                240,
            )
            driver_log = cluster.pod_log(namespace, f"{job}-trainer-0")
            assert "engine dedicated-0 up" in driver_log, driver_log[-3000:]
            # Ten steps, the first two left out (the new engine's first requests pay its warm-up):
            # on two cores shared with another test, five steps' median moved with the other load.
            waiting("10 steps with the dedicated engine", lambda: rec.latest().step >= joined + 10, 300)
            reports = [rec.reports[s] for s in sorted(rec.reports)]
            shared_only = [r for r in reports if r.shared_engines_awake == 1 and r.dedicated_engines == 0]
            with_dedicated = [r for r in reports if r.step >= joined + 2 and r.dedicated_engines == 1]
            before_s, after_s = step_s(shared_only), step_s(with_dedicated)
            assert before_s is not None and after_s is not None, (shared_only, with_dedicated)
            table = "\n".join(
                f"step {r.step} t={r.time:.2f} shared={r.shared_engines_awake} "
                f"dedicated={r.dedicated_engines} gen={r.generation_s:.3f} train={r.training_s:.3f} "
                f"wait={r.trainer_wait_s:.3f}"
                for r in reports
            )
            rise = f"steps/h did not rise: {before_s:.3f} -> {after_s:.3f} s/step\n{table}"
            assert after_s < before_s, rise
            assert rec.latest().step < SHORT_FROM_STEP, "the short-answer phase began before the checks"

            # 2. lose the rollout pod mid-run: training goes on, the pod comes back and serves.
            old_uid = pod["metadata"]["uid"]
            lost_at = rec.latest().step
            cluster.kubectl("delete", "pod", rollout_pod, "-n", namespace, "--wait=false")
            waiting("training going on without it", lambda: rec.latest().step >= lost_at + 3, 180)
            back = waiting(
                "the rollout pod recreated",
                lambda: (p := live_pods(cluster, namespace, job).get(rollout_pod))
                and p["metadata"]["uid"] != old_uid and p.get("status", {}).get("phase") == "Running" and p,
                180,
            )  # fmt: skip
            assert back["metadata"]["uid"] != old_uid
            waiting(
                "the new engine serving",
                lambda: any(r.step > lost_at + 3 and r.dedicated_engines == 1 for r in rec.reports.values()),
                240,
            )
            st = rec.status
            assert not st.get("restarts") and not st.get("failures"), st
            assert live_pods(cluster, namespace, job)[f"{job}-trainer-0"]["metadata"]["uid"] == trainer_uid

            # 3. short answers: calm, then the two-phase scale-down.
            waiting("the dedicated engine removed", lambda: rec.decided("RemoveDedicated"), 600)
            gone = waiting("rollout pod 0 drained away", lambda: rollout_pod not in live_pods(cluster, namespace, job), 180)  # fmt: skip  # noqa: E501
            assert gone
            final = waiting(
                "the job to finish",
                lambda: rec.status.get("phase") in ("Succeeded", "Failed") and rec.status,
                600,
            )
            assert final["phase"] == "Succeeded", f"{json.dumps(final, indent=1)}\n{logs()}"
            assert not final.get("restarts") and not final.get("failures"), final
    finally:
        rec.stop.set()
        events = cluster.get_json(
            "events", "--field-selector", f"involvedObject.name={job}", namespace=namespace
        )
        cluster.kubectl("delete", "rljob", job, "-n", namespace, "--wait=false", check=False)

    shown = sorted(
        (
            e.get("lastTimestamp") or e.get("eventTime") or "",
            e.get("reason", ""),
            (e.get("message") or "")[:160],
        )
        for e in (events or {}).get("items", [])
        if e.get("reason", "").startswith(("Adaptive", "RolloutPod", "PodsCreated", "PodsDeleted"))
    )
    drain = [e for e in shown if e[1] in ("RolloutPodReleased", "RolloutPodDrained")]
    assert drain, shown
    reports = [rec.reports[s] for s in sorted(rec.reports)]
    summary = {
        "wall_s": round(time.monotonic() - started, 1),
        "decisions": [
            {k: d[k] for k in ("time", "decision", "step", "sharedAwake", "dedicated")} for d in rec.decisions
        ],
        "step_s_shared_only": round(before_s, 3),
        "step_s_with_dedicated": round(after_s, 3),
        "steps_per_hour": [round(3600 / before_s), round(3600 / after_s)],
        "drained_by": drain[0][1],
        "response_len": [round(r.response_len_mean, 1) for r in reports[:: max(1, len(reports) // 20)]],
    }
    for stamp, reason, message in shown:
        sys.stderr.write(f"e2e-adaptive event {stamp} {reason}: {message}\n")
    for d in rec.decisions:
        sys.stderr.write(
            f"e2e-adaptive decision {d['time']} step {d['step']} {d['decision']}: {d['reason']}\n"
        )
    sys.stderr.write(f"e2e-adaptive {json.dumps(summary)}\n")
    if os.environ.get("RLJOB_E2E_REPORT"):
        with open(os.environ["RLJOB_E2E_REPORT"], "a") as f:
            f.write(json.dumps({"job": "adaptive-elastic", **summary, "events": shown}) + "\n")

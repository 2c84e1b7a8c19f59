"""End to end on the local cluster: a multi-turn agent job with a real environment pod and a real
judge engine on a judge pod, and an agent job of mode agent trained through the job's endpoint.

`examples/tiny-agent-cpu.yaml` (the tiny model playing `rljob_env.arithmetic`, the calculator
offered), with a judge added (the same tiny model, random weights: its scores are noise, its path
is the real one), applied to the real control plane with the real operator: the operator creates the
trainer pod, the environment's pods behind their headless Service and fence, and the judge's pod;
the test kubelet runs them all as processes on this machine. The driver (trainer pod 0, the Ray head)
places the judge engine on the judge pod's Ray worker (`rljob_judge_0`), resets and steps episodes on
the environment's replicas by their own names, trains, and the job ends Succeeded; the driver's
telemetry lines show the episodes ended by the environment and every response judged.

`examples/tiny-agent-endpoint-cpu.yaml` (an environment of mode agent: `rljob_env.arithmetic_agent`,
the default command of that mode, its agent streaming): the operator adds the token Secret, trainer
pod 0's port `endpoint` and the fence's one opening; the driver serves the OpenAI-compatible
endpoint in front of vLLM's CPU engine, each episode is one `POST /episode` to the environment's
pod, whose agent calls the endpoint with the token from its environment; the calls are the samples
trained, and the job ends Succeeded. Its judge, as the example has it, is a reward model (kind
rewardModel, a tiny random one) on vLLM's pooling runner on the judge pod, scoring every episode.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterator
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
EXAMPLE = REPO / "examples" / "tiny-agent-cpu.yaml"
ENDPOINT_EXAMPLE = REPO / "examples" / "tiny-agent-endpoint-cpu.yaml"
STEPS = 3

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]


@pytest.fixture(scope="module")
def crd(cluster: Any) -> None:
    cluster.apply_crds(REPO / "crds")


# The node's own pool: other tests on this worker's cluster add `rljob.io/pool: cpu` nodes too, and an
# environment replica placed on one of theirs (gone with its test) never became ready.
POOL = f"cpu-agent-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def cpu_node(cluster: Any) -> Iterator[str]:
    (name,) = cluster.add_nodes(
        1,
        name_prefix=f"e2e-agent-{uuid.uuid4().hex[:6]}",
        resource=None,
        per_node=0,
        labels={"rljob.io/pool": POOL},
        cpu="8",
        memory="32Gi",
        exec_local=True,
    )
    yield name
    cluster.delete_nodes([name])


def _on_pool(manifest: dict[str, Any]) -> dict[str, Any]:
    """Every pod on this test's node: the trainer, the judge (rollout pool) and the environments."""
    spec = manifest["spec"]
    for pool in ("trainerPool", "rolloutPool"):
        spec[pool] = {"nodeSelector": {"rljob.io/pool": POOL}}
    for env in spec["environments"]:
        env["nodeSelector"] = {"rljob.io/pool": POOL}
    return manifest


def _manifest() -> dict[str, Any]:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    spec = manifest["spec"]
    spec["grpo"]["maxSteps"] = STEPS
    spec["lengths"]["maxCompletionTokens"] = 96
    spec["rollout"]["agent"]["maxTotalTokens"] = 96
    spec["reward"]["judge"] = {
        "kind": "llm",
        "model": {
            "name": "tiny-judge",
            "source": spec["model"]["source"],
            "config": spec["model"]["config"],
            "dtype": "float32",
        },
        "promptTemplate": "Task: {prompt}\nReply: {response}\nScore 0-10:",
        "maxTokens": 4,
        "weight": 0.5,
    }
    return _on_pool(manifest)


def _run_to_the_end(
    cluster: Any, namespace: str, manifest: dict[str, Any], cpu_node: str, pods: list[str], finish_s: float
) -> tuple[dict[str, Any], str]:
    """Apply `manifest` under the real operator, wait for `pods` on the node, then for the job to end:
    (its status, trainer pod 0's log). The pods' logs in the error when it does not end in time."""
    job = manifest["metadata"]["name"]
    args = ["run", "--standalone", "--namespace", namespace, "-m", "rljob_operator.handlers"]
    driver_pod = f"{job}-trainer-0"
    with KopfRunner(args, timeout=60):
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))

        def pods_up() -> dict[str, Any] | None:
            data = cluster.get_json("pods", "-l", f"rljob.io/job={job}", namespace=namespace) or {}
            names = {p["metadata"]["name"]: p for p in data.get("items", [])}
            ok = all(n in names and names[n].get("spec", {}).get("nodeName") == cpu_node for n in pods)
            return names if ok else None

        try:
            wait_for("the job's pods on the node", pods_up, 120, interval_s=1.0)
        except AssertionError as error:
            status = (cluster.get_json("rljob", job, namespace=namespace) or {}).get("status")
            raise AssertionError(f"{error}\n{json.dumps(status, indent=1)}") from None

        def finished() -> dict[str, Any] | None:
            status = (cluster.get_json("rljob", job, namespace=namespace) or {}).get("status") or {}
            return status if status.get("phase") in ("Succeeded", "Failed") else None

        try:
            status = wait_for(f"the job {job} to finish", finished, finish_s, interval_s=2.0)
        except AssertionError as error:
            logs = {n: cluster.pod_log(namespace, n)[-5000:] for n in pods}
            raise AssertionError(f"{error}\n{json.dumps(logs, indent=1)}") from None
        driver_log = cluster.pod_log(namespace, driver_pod)
        assert status["phase"] == "Succeeded", f"{json.dumps(status, indent=1)}\n{driver_log[-6000:]}"
        return status, driver_log


def _step_metrics(driver_log: str) -> list[dict[str, Any]]:
    """The driver's telemetry, one dict of metrics per step."""
    return [json.loads(m) for m in re.findall(r"telemetry: step \d+ (\{.*\})", driver_log)]


def test_an_agent_job_trains_with_its_environment_pods_and_judge_pod(
    cluster: Any, crd: None, namespace: str, cpu_node: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))  # the operator's client
    manifest = _manifest()
    job = manifest["metadata"]["name"]
    driver_pod, judge_pod = f"{job}-trainer-0", f"{job}-judge-0"
    env_pods = [f"{job}-env-arith-0", f"{job}-env-arith-1"]
    try:
        status, driver_log = _run_to_the_end(
            cluster, namespace, manifest, cpu_node, [driver_pod, judge_pod, *env_pods], 900
        )
        assert status["progress"]["step"] == STEPS
        assert [e["name"] for e in status.get("environments", [])] == ["arith"]
        # The judge engine ran on the judge pod's Ray worker, placed by its marker resource.
        assert "judge engines up: judge-0" in driver_log, driver_log[-6000:]
        judge_log = cluster.pod_log(namespace, judge_pod)
        assert "joining the Ray cluster" in judge_log and "rljob_judge_0" in judge_log, judge_log[-3000:]
        # Every step: episodes driven by the environment (reset, steps, done), every response judged.
        steps = _step_metrics(driver_log)
        assert len(steps) == STEPS, driver_log[-6000:]
        for metrics in steps:
            assert metrics["agent/episodes"] == 16 and metrics["agent/env_failures"] == 0
            assert metrics["agent/finish/failed"] == 0
            assert metrics["judge/scored"] == 16 and metrics["judge/failed"] == 0
            # Each episode was reset and stepped by the environment (a random model's reply mostly
            # runs to the token budget, which ends the episode after that step) and rewarded by it.
            ended = sum(metrics[f"agent/finish/{r}"] for r in ("env_done", "length", "max_turns"))
            assert ended == pytest.approx(1.0) and "reward/environment" in metrics
    finally:
        cluster.kubectl("delete", "rljob", job, "-n", namespace, "--wait=false", check=False)


ENDPOINT_STEPS = 2


def test_an_agent_job_of_mode_agent_trains_on_its_environments_calls_to_the_endpoint(
    cluster: Any, crd: None, namespace: str, cpu_node: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    manifest = _on_pool(yaml.safe_load(ENDPOINT_EXAMPLE.read_text()))
    spec = manifest["spec"]
    # Small: 2 steps of 2 groups of 4 episodes, short answers, one environment replica.
    spec["grpo"].update(maxSteps=ENDPOINT_STEPS, promptsPerStep=2, groupSize=4)
    spec["lengths"]["maxCompletionTokens"] = 48
    spec["rollout"]["agent"]["maxTotalTokens"] = 48
    (env,) = spec["environments"]
    assert env["mode"] == "agent" and "command" not in env  # the shipped one, its mode's default
    assert env["args"] == ["--stream"]
    env["replicas"] = 1
    # Its judge: a reward model (a tiny one, random weights: the path, not the scores), on vLLM's
    # pooling runner on a judge pod of its own.
    assert spec["reward"]["judge"]["kind"] == "rewardModel"
    job = manifest["metadata"]["name"]
    driver_pod, env_pod, judge_pod = f"{job}-trainer-0", f"{job}-env-arith-0", f"{job}-judge-0"
    try:
        status, driver_log = _run_to_the_end(
            cluster, namespace, manifest, cpu_node, [driver_pod, env_pod, judge_pod], 600
        )
        assert status["progress"]["step"] == ENDPOINT_STEPS
        assert [e["name"] for e in status.get("environments", [])] == ["arith"]
        # The endpoint served on trainer pod 0 from the driver's setup, in front of vLLM's CPU engine
        # (the example's rollout.kind), the engine a GPU job's endpoint serves from.
        assert "OpenAI-compatible endpoint on" in driver_log, driver_log[-6000:]
        assert re.search(r"rollout engine platform: vLLM \S+ on cpu", driver_log), driver_log[-6000:]
        steps = _step_metrics(driver_log)
        assert len(steps) == ENDPOINT_STEPS, driver_log[-6000:]
        for metrics in steps:
            # Every episode answered by the environment's pod, none failed: an episode whose agent
            # never reached the endpoint (no token, no route, no call served) fails and is counted.
            assert metrics["agent/episodes"] == 8 and metrics["agent/env_failures"] == 0
            assert metrics["agent/finish/failed"] == 0 and metrics["agent/failed_fraction"] == 0
            # What was trained is the endpoint's calls: at least one per episode, tokens generated.
            assert metrics["agent/turns_mean"] >= 1 and metrics["agent/generated_tokens_mean"] > 0
            assert "reward/environment" in metrics
            # Every episode scored by the reward model: its raw logit, not a parsed answer.
            assert metrics["judge/scored"] == 8 and metrics["judge/failed"] == 0
            assert metrics["judge/unparsed"] == 0 and "reward/judge" in metrics
        assert "judge engines up: judge-0" in driver_log, driver_log[-6000:]
        assert "rljob_judge_0" in cluster.pod_log(namespace, judge_pod)
        # The environment's pod ran the shipped agent, on its port, with the token from the Secret.
        env_log = cluster.pod_log(namespace, env_pod)
        assert "environment arithmetic_agent serving" in env_log, env_log[-3000:]
    finally:
        cluster.kubectl("delete", "rljob", job, "-n", namespace, "--wait=false", check=False)

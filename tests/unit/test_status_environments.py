"""Unit tests for environment servers and judge pods in the pure core: what a pod of theirs is
(decide.lifecycle.observe_pod), what it means for the attempt (decide_restart,
environment_pods_to_replace, check_capacity, claims_of) and for the job's status
(reconcile.status: status.environments, EnvironmentsReady, Ready, the Events' types)."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from test_builders import make_spec, static_plan

from rljob_operator import api, builders, errors
from rljob_operator.decide import lifecycle
from rljob_operator.reconcile import status

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
JOB = builders.JobRef("demo", "team-a", "uid")
SPEC = make_spec(
    environments=[{"name": "arith", "replicas": 2}, {"name": "web", "command": ["web"], "image": "x/y:1"}]
)
PLAN = static_plan(SPEC)
LAYOUT = builders.compute_layout(SPEC, PLAN)
RAY_PODS = [
    lifecycle.PodObservation("demo-trainer-0", "trainer", 0, "Running", 0, ""),
    lifecycle.PodObservation("demo-trainer-1", "trainer", 1, "Running", 0, ""),
    lifecycle.PodObservation("demo-rollout-0", "rollout", 0, "Running", 0, ""),
    lifecycle.PodObservation("demo-rollout-1", "rollout", 1, "Running", 0, ""),
]


def env_pod(env: str, index: int, *, ready: bool = True, **kw: Any) -> lifecycle.PodObservation:
    base = {"phase": "Running", "created": T0.timestamp()}
    base.update(kw)
    phase = base.pop("phase")
    return lifecycle.PodObservation(
        f"demo-env-{env}-{index}", "environment", index, phase, 0, "", ready=ready, environment=env, **base
    )


READY_ENVS = [env_pod("arith", 0), env_pod("arith", 1), env_pod("web", 0)]


def compute(pods: list[lifecycle.PodObservation], now: datetime = T0) -> api.RLJobStatus:
    observed = status.Observed(spec=SPEC, plan=PLAN, layout=LAYOUT, pods=pods, job=JOB)
    return status.compute_status(api.RLJobStatus(), observed, generation=1, now=now)


def cond(st: api.RLJobStatus, type_: str) -> api.Condition:
    found = status.find(st.conditions, type_)
    assert found is not None, type_
    return found


# ---- observe_pod -------------------------------------------------------------------------------------
def _pod_body(**status_: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "demo-env-arith-0",
            "labels": {
                "rljob.io/job": "demo",
                "rljob.io/role": "environment",
                "rljob.io/index": "0",
                "rljob.io/environment": "arith",
            },
            "annotations": {"rljob.io/attempt": "2"},
        },
        "spec": {},
        "status": status_,
    }


def test_a_crash_looping_server_is_observed_with_its_restarts_and_its_last_words() -> None:
    obs = lifecycle.observe_pod(
        _pod_body(
            phase="Running",
            conditions=[{"type": "Ready", "status": "False"}],
            containerStatuses=[
                {
                    "name": "environment",
                    "restartCount": 3,
                    "state": {
                        "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting"}
                    },
                    "lastState": {"terminated": {"exitCode": 3, "message": "boom: no task file\n"}},
                }
            ],
        )
    )
    assert obs is not None and obs.role == "environment" and obs.environment == "arith"
    assert (obs.attempt, obs.restarts, obs.ready) == (2, 3, False)
    assert obs.waiting_reason == "CrashLoopBackOff"
    assert obs.waiting_message == (
        "container environment: back-off 40s restarting; its last run exited with code 3: boom: no task file"
    )


def test_a_ready_server_is_observed_ready_and_a_judge_pod_is_a_pod_of_the_job() -> None:
    obs = lifecycle.observe_pod(_pod_body(phase="Running", conditions=[{"type": "Ready", "status": "True"}]))
    assert obs is not None and obs.ready
    judge = _pod_body(phase="Running")
    judge["metadata"]["labels"]["rljob.io/role"] = "judge"
    observed = lifecycle.observe_pod(judge)
    assert observed is not None and observed.role == "judge" and observed.environment == ""


# ---- what a pod means for the attempt --------------------------------------------------------------
def _decide(pods: list[lifecycle.PodObservation]) -> lifecycle.RestartDecision:
    return lifecycle.decide_restart(
        pods, attempt=0, failures=0, disruptions=0, last_failure=None, policy=SPEC.restart_policy
    )


def test_a_failed_environment_pod_never_restarts_the_gang_and_is_replaced_alone() -> None:
    ended = env_pod("arith", 1, ready=False, phase="Failed", message="Evicted: node pressure")
    assert _decide([*RAY_PODS, ended]).action == "run"
    assert [p.name for p in lifecycle.environment_pods_to_replace([*RAY_PODS, ended], 0)] == [
        "demo-env-arith-1"
    ]
    older = dataclasses.replace(ended, attempt=1)
    assert lifecycle.environment_pods_to_replace([older], 0) == []  # another attempt's: the diff deletes it


def test_a_failed_judge_pod_fails_the_attempt_like_a_trainer_pod() -> None:
    judge = lifecycle.PodObservation("demo-judge-0", "judge", 0, "Failed", 0, "", exit_code=1, message="oom")
    decision = _decide([*RAY_PODS, judge])
    assert decision.action == "restart" and decision.pod is judge and decision.failures == 1
    assert "pod demo-judge-0 failed with exit code 1: oom" in decision.cause


def test_capacity_counts_the_judge_pods_on_the_rollout_pool() -> None:
    spec = make_spec(rolloutPool={"nodeSelector": {"pool": "a"}}, trainerPool={"nodeSelector": {"pool": "a"}})
    plan = static_plan(spec).model_copy(update={"judge": api.JudgePlanStatus(engines=2, tensor_parallel=8)})
    layout = builders.compute_layout(spec, plan)
    node = lifecycle.NodeObservation("n", {"pool": "a"}, (), {"nvidia.com/gpu": "8"}, True)
    nodes = [dataclasses.replace(node, name=f"n{i}") for i in range(4)]
    lifecycle.check_capacity(spec, builders.compute_layout(spec, static_plan(spec)), nodes)  # 4 nodes: fits
    with pytest.raises(errors.InsufficientCapacityError, match="and 2 judge pods \\(8 each\\)"):
        lifecycle.check_capacity(spec, layout, nodes)
    lifecycle.check_capacity(
        spec, layout, [*nodes, dataclasses.replace(node, name="n4"), dataclasses.replace(node, name="n5")]
    )


def test_a_judge_on_a_claim_is_mounted_by_the_trainer_and_judge_pods() -> None:
    spec = make_spec(
        reward={
            "judge": {
                "model": {
                    "name": "j",
                    "source": {"pvc": {"claimName": "judges", "path": "m"}},
                    "config": {"inline": {"model_type": "llama"}},
                },
                "promptTemplate": "{response}",
            }
        }
    )
    plan = static_plan(spec).model_copy(update={"judge": api.JudgePlanStatus(engines=3, tensor_parallel=1)})
    (use,) = lifecycle.claims_of(spec, builders.compute_layout(spec, plan))
    assert (use.field, use.claim, use.pods, use.read_only) == (
        "spec.reward.judge.model.source.pvc.claimName",
        "judges",
        2 + 3,
        True,
    )


# ---- status ---------------------------------------------------------------------------------------------
def test_every_server_ready_makes_the_job_ready_with_each_environments_url() -> None:
    st = compute([*RAY_PODS, *READY_ENVS])
    assert st.phase == "Running" and cond(st, "Ready").reason == "AllPodsRunning"
    assert cond(st, "Ready").message == "7/7 pods running"
    env = cond(st, "EnvironmentsReady")
    assert (env.status, env.reason, env.message) == ("True", "EnvironmentsReady", "ready: arith 2/2, web 1/1")
    assert [e.model_dump(by_alias=True, exclude_none=True) for e in st.environments or []] == [
        {
            "name": "arith",
            "replicas": 2,
            "readyReplicas": 2,
            "ready": "2/2",
            "url": "http://demo-env-arith.team-a.svc:8080",
        },
        {
            "name": "web",
            "replicas": 1,
            "readyReplicas": 1,
            "ready": "1/1",
            "url": "http://demo-env-web.team-a.svc:8080",
        },
    ]


def test_a_crash_looping_server_is_named_with_its_last_exit_and_the_fix_in_both_conditions() -> None:
    crashing = env_pod(
        "web",
        0,
        ready=False,
        restarts=2,
        waiting_reason="CrashLoopBackOff",
        waiting_message="container environment: back-off 20s; its last run exited with code 3: boom",
    )
    st = compute([*RAY_PODS, env_pod("arith", 0), env_pod("arith", 1), crashing])
    env = cond(st, "EnvironmentsReady")
    assert (env.status, env.reason) == ("False", "CrashLoopBackOff")
    assert env.message.startswith("environment web: pod demo-env-web-0: container environment: back-off 20s")
    assert (
        "spec.environments[1].command, args or image" in env.message
        and "kubectl logs demo-env-web-0 --previous" in env.message
    )
    assert env.message.endswith("(ready: arith 2/2, web 0/1)")
    ready = cond(st, "Ready")
    assert (ready.status, ready.reason, st.phase) == ("False", "CrashLoopBackOff", "Pending")
    assert "6/7 pods running" in ready.message
    assert status.event_type(env) == status.event_type(ready) == "Warning"
    web = (st.environments or [])[1]
    assert web.ready == "0/1" and web.message is not None and "demo-env-web-0" in web.message


def test_a_missing_secret_names_the_env_field_to_fix() -> None:
    blocked = env_pod(
        "arith",
        1,
        ready=False,
        phase="Pending",
        waiting_reason="CreateContainerConfigError",
        waiting_message='container environment: secret "keys" not found',
    )
    st = compute([*RAY_PODS, env_pod("arith", 0), blocked, env_pod("web", 0)])
    env = cond(st, "EnvironmentsReady")
    assert env.reason == "CreateContainerConfigError" and "spec.environments[0].env" in env.message
    assert cond(st, "Ready").reason == "CreateContainerConfigError"


def test_a_server_still_starting_is_no_warning_until_its_grace_passes_then_it_is_named() -> None:
    starting = env_pod("arith", 0, ready=False)
    pods = [*RAY_PODS, starting, env_pod("arith", 1), env_pod("web", 0)]
    st = compute(pods, now=T0 + timedelta(seconds=10))
    env = cond(st, "EnvironmentsReady")
    assert (env.status, env.reason) == ("False", "EnvironmentsStarting")
    assert status.event_type(env) == "Normal"
    ready = cond(st, "Ready")  # the job waits for its server, and says so (a Normal event)
    assert ready.reason == "EnvironmentsStarting" and status.event_type(ready) == "Normal"
    assert "environment arith: pod " in ready.message and "readiness probe not passed yet" in ready.message
    later = compute(pods, now=T0 + timedelta(seconds=status.ENVIRONMENT_READINESS_GRACE_S + 5))
    env = cond(later, "EnvironmentsReady")
    assert env.reason == "EnvironmentNotReady" and status.event_type(env) == "Warning"
    assert "readiness probe (GET /healthz on port 8080)" in env.message and "readinessPath" in env.message
    assert cond(later, "Ready").reason == "EnvironmentNotReady"


def test_servers_not_created_yet_are_starting_and_a_job_without_environments_has_no_such_status() -> None:
    st = compute(RAY_PODS)
    env = cond(st, "EnvironmentsReady")
    assert env.reason == "EnvironmentsStarting" and "not created yet" in env.message
    assert [e.ready for e in st.environments or []] == ["0/2", "0/1"]
    plain_spec = make_spec()
    observed = status.Observed(
        spec=plain_spec,
        plan=static_plan(plain_spec),
        layout=builders.compute_layout(plain_spec, static_plan(plain_spec)),
        pods=RAY_PODS,
    )
    plain = status.compute_status(api.RLJobStatus(), observed, generation=1, now=T0)
    assert plain.environments is None and status.find(plain.conditions, "EnvironmentsReady") is None

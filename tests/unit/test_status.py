"""Unit tests for rljob_operator.reconcile.status: every situation's phase and conditions, the reason table,
transition times, change detection and the Event rate limit."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, timezone

import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_builders import make_spec, static_plan

from rljob_operator import api, builders, errors
from rljob_operator.decide import lifecycle
from rljob_operator.reconcile import status
from rljob_trainer.outputs.telemetry import SyncReport

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
T1 = T0 + timedelta(seconds=30)
SPEC = make_spec()
PLAN = static_plan(SPEC)
LAYOUT = builders.compute_layout(SPEC, PLAN)


def pod(name: str, phase: str = "Running", role: str = "trainer", index: int = 0) -> lifecycle.PodObservation:
    return lifecycle.PodObservation(name, role, index, phase, 0, "")


ALL_RUNNING = [
    pod("demo-trainer-0"),
    pod("demo-trainer-1", index=1),
    pod("demo-rollout-0", role="rollout"),
    pod("demo-rollout-1", role="rollout", index=1),
]


def compute(
    old: api.RLJobStatus | None = None, now: datetime = T0, generation: int = 3, **kw: object
) -> api.RLJobStatus:
    args = {"spec": SPEC, "plan": PLAN, "layout": LAYOUT, **kw}
    observed = status.Observed(**args)  # type: ignore[arg-type]
    return status.compute_status(old or api.RLJobStatus(), observed, generation=generation, now=now)


def cond(st_: api.RLJobStatus, type_: str) -> api.Condition:
    c = status.find(st_.conditions, type_)
    assert c is not None, type_
    return c


def decision(pods: list[lifecycle.PodObservation], **kw: object) -> lifecycle.RestartDecision:
    args: dict[str, object] = {
        "attempt": 0, "failures": 0, "disruptions": 0, "last_failure": None,
        "policy": SPEC.restart_policy, **kw,
    }  # fmt: skip
    return lifecycle.decide_restart(pods, **args)  # type: ignore[arg-type]


def test_progressing_pending_then_running_keeps_transition_times() -> None:
    pending = compute(pods=ALL_RUNNING[:2])
    assert pending.phase == "Pending" and pending.observed_generation == 3 and pending.start_time == T0
    assert cond(pending, "Ready").reason == "PodsPending" and cond(pending, "Planned").status == "True"
    running = compute(old=pending, now=T1, pods=ALL_RUNNING)
    assert running.phase == "Running" and cond(running, "Ready").status == "True"
    assert cond(running, "Ready").last_transition_time == T1
    assert cond(running, "Planned").last_transition_time == T0  # unchanged status keeps its time
    assert running.start_time == T0
    waiting = compute(waiting=("demo-trainer-0",), pods=ALL_RUNNING)
    assert waiting.phase == "Pending"
    assert running.rollout is not None and running.rollout.dedicated_engines == 2
    assert running.rollout.desired_dedicated_engines == 2 and running.rollout.engines_awake_total == "2/2"


def test_errors_map_to_reasons_and_phases() -> None:
    cases = [
        (
            errors.ModelConfigUnreadableError("spec.model.config.configMapRef", "missing"),
            "ModelConfigUnreadable",
            "Pending",
        ),
        (errors.InvalidSpecError("spec.grpo", "bad"), "InvalidSpec", "Failed"),
        (errors.ModelDoesNotFitError("spec.resources", "too big"), "ModelDoesNotFit", "Failed"),
        (errors.KVCacheTooSmallError("spec.lengths", "no room"), "KVCacheTooSmall", "Failed"),
        (
            errors.ClaimNotFoundError("spec.checkpoint.volume.claimName", "create it"),
            "ClaimNotFound",
            "Pending",
        ),
        (errors.InternalError.wrap("reconcile step plan", KeyError("x")), "InternalError", "Pending"),
        (RuntimeError("boom"), "InternalError", "Pending"),
    ]
    for exc, reason, phase in cases:
        st_ = compute(error=exc, plan=None, layout=None)
        assert st_.phase == phase, exc
        assert cond(st_, "Planned").reason == reason and cond(st_, "Planned").status == "False"
        assert (status.find(st_.conditions, "Failed") is not None) == (phase == "Failed")
        assert status.reason_for(exc) == reason


def test_internal_errors_quote_the_exception_and_are_never_relabelled() -> None:
    exc = errors.InternalError.wrap("reconcile step plan", KeyError("num_layers"))
    st_ = compute(error=exc, plan=None, layout=None)
    message = cond(st_, "Ready").message
    assert "KeyError" in message and "num_layers" in message and "ModelDoesNotFit" not in message


def test_spec_errors_say_a_new_generation_fixes_them_and_it_does() -> None:
    bad = compute(error=errors.InvalidSpecError("spec.grpo", "bad"), plan=None, layout=None, generation=1)
    assert bad.phase == "Failed" and "apply it again" in cond(bad, "Failed").message
    fixed = compute(old=bad, generation=2, pods=ALL_RUNNING)
    assert fixed.phase == "Running" and cond(fixed, "Failed").status == "False"
    assert cond(fixed, "Failed").reason == "SpecFixed" and fixed.completion_time is None


def test_insufficient_capacity_is_planned_but_not_ready() -> None:
    exc = errors.InsufficientCapacityError("spec.trainerPool", "add nodes")
    st_ = compute(error=exc)
    assert st_.phase == "Pending"
    assert cond(st_, "Planned").status == "True"
    assert cond(st_, "Ready").reason == "InsufficientAccelerators"
    assert "spec.trainerPool: add nodes" in cond(st_, "Ready").message


def test_validation_error_message_names_fields() -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        api.RLJobSpec.model_validate({"model": {}})
    message = status.message_for(info.value)
    assert message.startswith("spec.") and "fix the spec" in message
    assert status.reason_for(info.value) == "InvalidSpec" and not status.is_retryable(info.value)
    assert status.message_for(KeyError("x")) == "KeyError: 'x'"


def test_suspend_succeed_fail() -> None:
    sus = compute(suspended=True)
    assert sus.phase == "Suspended" and cond(sus, "Suspended").status == "True"
    resumed = compute(old=sus, now=T1, pods=ALL_RUNNING)
    assert (
        cond(resumed, "Suspended").status == "False" and cond(resumed, "Suspended").last_transition_time == T1
    )
    ok = compute(decision=decision([pod("demo-trainer-0", "Succeeded")]))
    assert ok.phase == "Succeeded" and cond(ok, "Complete").status == "True" and ok.completion_time == T0
    failed_pod = lifecycle.PodObservation("demo-trainer-1", "trainer", 1, "Failed", 0, "", exit_code=2)
    limit = SPEC.restart_policy.backoff_limit
    bad = compute(decision=decision([failed_pod], failures=limit))
    assert bad.phase == "Failed" and cond(bad, "Failed").reason == "BackoffLimitExceeded"
    assert "exit code 2" in cond(bad, "Failed").message and "backoffLimit" in cond(bad, "Failed").message
    never_spec = make_spec(restartPolicy={"policy": "Never"})
    never = compute(spec=never_spec, decision=decision([failed_pod], policy=never_spec.restart_policy))
    assert (
        cond(never, "Failed").reason == "RestartPolicyNever" and "OnFailure" in cond(never, "Failed").message
    )


def test_finished_keeps_everything_but_generation() -> None:
    done = compute(decision=decision([pod("demo-trainer-0", "Succeeded")]))
    again = status.compute_status(done, status.Observed(finished=True), generation=9, now=T1)
    assert (
        again.phase == "Succeeded" and again.observed_generation == 9 and again.conditions == done.conditions
    )


def test_restart_transition_time_marks_each_failure_and_the_message_tells_the_checkpoint_truth() -> None:
    failed_pod = lifecycle.PodObservation("demo-trainer-0", "trainer", 0, "Failed", 0, "", exit_code=1)
    first = compute(decision=decision([failed_pod]))
    assert first.phase == "Pending" and first.restarts == 1 and first.failures == 1
    assert status.pending_restart(first) == (T0, False)
    message = cond(first, "Restarting").message
    assert "checkpoints are not kept" in message and "resumes" not in message  # emptyDir checkpoints
    waiting = compute(old=first, now=T1, restart_wait_s=5.0)
    assert status.pending_restart(waiting) == (T0, False)  # the same restart keeps its start
    failed_again = dataclasses.replace(failed_pod, attempt=1)
    second = compute(old=waiting, now=T1, decision=decision([failed_again], attempt=1, failures=1))
    assert status.pending_restart(second) == (T1, False) and second.failures == 2
    recreated = compute(old=second, now=T1, pods=ALL_RUNNING)
    assert status.pending_restart(recreated) is None
    assert cond(recreated, "Restarting").reason == "PodsRecreated"
    kept = make_spec(checkpoint={"path": "/ckpt", "volume": {"claimName": "ckpts"}})
    resumes = compute(spec=kept, decision=decision([failed_pod]))
    assert "resumes from the last checkpoint in claim 'ckpts'" in cond(resumes, "Restarting").message


def test_an_unschedulable_pod_with_an_unbound_claim_names_the_claim() -> None:
    unsched = dataclasses.replace(
        pod("demo-trainer-0", "Pending"),
        unschedulable="0/7 nodes are available: pod has unbound immediate PersistentVolumeClaims.",
    )
    sentence = "PersistentVolumeClaim 'ckpt' (spec.checkpoint.volume.claimName) is Pending: ..."
    ready = cond(compute(pods=[unsched], unbound_claims=(sentence,)), "Ready")
    assert ready.reason == "ClaimNotBound" and sentence in ready.message and "demo-trainer-0" in ready.message
    assert cond(compute(pods=[unsched]), "Ready").reason == "Unschedulable"


def test_a_disruption_restarts_without_counting_a_failure() -> None:
    evicted = lifecycle.PodObservation(
        "demo-trainer-1", "trainer", 1, "Running", 0, "", disruption="EvictionByEvictionAPI: Eviction API"
    )
    st_ = compute(decision=decision([pod("demo-trainer-0"), evicted]))
    assert st_.restarts == 1 and not st_.failures and st_.disruptions == 1
    assert cond(st_, "Restarting").reason == "Disrupted" and "not counted" in cond(st_, "Restarting").message
    assert status.pending_restart(st_) == (T0, True)


def test_pod_level_causes_name_the_pod() -> None:
    unsched = dataclasses.replace(
        pod("demo-trainer-0", "Pending"),
        unschedulable='0/5 nodes are available: persistentvolumeclaim "ckpt" not found.',
    )
    st_ = compute(pods=[unsched])
    ready = cond(st_, "Ready")
    assert ready.reason == "Unschedulable" and "demo-trainer-0" in ready.message and '"ckpt"' in ready.message
    assert status.event_type(ready) == "Warning"
    pulling = dataclasses.replace(
        pod("demo-trainer-1", "Pending", index=1),
        waiting_reason="ImagePullBackOff",
        waiting_message='container trainer: Back-off pulling image "x"',
    )
    st_ = compute(pods=[pod("demo-trainer-0"), pulling])
    assert cond(st_, "Ready").reason == "ImagePullBackOff" and "demo-trainer-1" in cond(st_, "Ready").message


def test_progress_from_latest_report() -> None:
    report = SyncReport(
        step=7, time=T1.timestamp(), intervalS=10, trainerWaitS=1, generationS=5, trainingS=4,
        inflightRequestSeconds=20, engineSeconds=10, snapshotInflight=0, sharedEnginesAwake=1,
        dedicatedEngines=2, meanReward=0.5, loss=0.1, tokensPerS=100, responseLenMean=50,
    )  # fmt: skip
    st_ = compute(pods=ALL_RUNNING, report=report)
    assert (
        st_.progress is not None and st_.progress.step == 7 and st_.progress.max_steps == SPEC.grpo.max_steps
    )
    assert st_.progress.last_sync_time == T1 and st_.progress.mean_reward == 0.5
    assert st_.rollout is not None and st_.rollout.shared_engines_awake == 0  # plan has no shared engine

    noisy = report.model_copy(update={"loss": -6.984919309616089e-09, "tokens_per_s": 37818.83554199268})
    shown = compute(pods=ALL_RUNNING, report=noisy).progress
    assert shown is not None and shown.loss == -6.985e-09 and shown.tokens_per_second == 37818.8


def test_status_patch_only_when_changed() -> None:
    new = compute(pods=ALL_RUNNING)
    assert status.status_patch(None, new) is not None
    assert status.status_patch(new.to_k8s(), new) is None
    again = compute(
        old=api.RLJobStatus.model_validate(new.to_k8s()),
        now=T1,
        pods=ALL_RUNNING,
    )
    assert status.status_patch(new.to_k8s(), again) is None  # a quiet reconcile writes nothing
    patch = status.status_patch({**new.to_k8s(), "completionTime": "2026-01-01T00:00:00Z"}, new)
    assert patch is not None and patch["completionTime"] is None


def test_status_patch_nulls_keys_gone_from_nested_objects() -> None:
    """A merge patch keeps a nested key it does not mention: an ended drain must send null."""
    draining = {"index": 1, "since": "2026-01-01T00:00:00Z"}
    old = {"rollout": {"desiredDedicatedEngines": 1, "drainingPods": [draining]}, "restarts": 0}
    new = api.RLJobStatus.model_validate({"rollout": {"desiredDedicatedEngines": 1}, "restarts": 0})
    patch = status.status_patch(old, new)
    assert patch is not None and patch["rollout"]["drainingPods"] is None
    assert patch["rollout"]["desiredDedicatedEngines"] == 1


def test_transitions_and_event_types() -> None:
    a = compute(pods=ALL_RUNNING[:1])
    b = compute(old=a, now=T1, pods=ALL_RUNNING)
    changed = status.transitions(a.conditions, b.conditions)
    assert [c.type for c in changed] == ["Ready"]
    assert status.event_type(changed[0]) == "Normal"
    err = compute(error=errors.InvalidSpecError("spec", "x"))
    assert status.event_type(cond(err, "Failed")) == "Warning"
    assert status.event_type(cond(err, "Planned")) == "Warning"


@given(st.one_of(st.none(), st.floats(0, 1000)), st.floats(0, 2000), st.floats(0.1, 100))
def test_should_post(last: float | None, now: float, interval: float) -> None:
    assert status.should_post(last, now, interval) == (last is None or now - last >= interval)


def _report(**over: object) -> SyncReport:
    base = SyncReport(
        step=7, time=T1.timestamp(), intervalS=10, trainerWaitS=1, generationS=5, trainingS=4,
        inflightRequestSeconds=20, engineSeconds=10, snapshotInflight=0, sharedEnginesAwake=1,
        dedicatedEngines=2, meanReward=0.5, loss=0.1, tokensPerS=100, responseLenMean=50,
    )  # fmt: skip
    return base.model_copy(update=over)


def test_a_skipped_step_reports_no_loss_and_the_eval_reward_stays_until_the_next_evaluation() -> None:
    nan_report = SyncReport.model_validate(
        {**_report().model_dump(by_alias=True), "loss": float("nan"), "meanReward": float("inf")}
    )
    assert nan_report.loss is None and nan_report.mean_reward is None  # JSON has no NaN
    evaluated = compute(pods=ALL_RUNNING, report=_report(eval_mean_reward=0.25))
    assert evaluated.progress is not None and evaluated.progress.eval_reward == 0.25
    later = compute(old=evaluated, pods=ALL_RUNNING, report=nan_report.model_copy(update={"step": 8}))
    assert later.progress is not None and later.progress.loss is None and later.progress.eval_reward == 0.25


def test_a_tracker_that_could_not_start_is_a_warning_condition_and_dropped_prompts_are_told() -> None:
    spec = make_spec(tracking={"mlflow": {"trackingUri": "http://mlflow.example:5000"}})
    observed = status.Observed(
        spec=spec,
        plan=PLAN,
        layout=LAYOUT,
        pods=ALL_RUNNING,
        report=_report(
            tracker_errors=["mlflow could not start: ConnectionError: refused"], dropped_prompts=3
        ),
    )
    st_ = status.compute_status(api.RLJobStatus(), observed, generation=3, now=T0)
    tracking = cond(st_, status.TRACKING)
    assert tracking.status == "False" and tracking.reason == "TrackerFailed" and "refused" in tracking.message
    assert status.event_type(tracking) == "Warning"
    filtered = cond(st_, status.DATA_FILTERED)
    assert filtered.reason == "PromptsDropped" and filtered.message.startswith("3 prompts are longer")
    fine = status.compute_status(st_, dataclasses.replace(observed, report=_report()), generation=3, now=T1)
    assert cond(fine, status.TRACKING).status == "True"


def test_a_report_asks_for_events_of_a_checkpoint_fallback_and_of_a_shared_engines_wake() -> None:
    from rljob_operator.reconcile import status as status_mod

    assert status_mod.report_events(_report()) == []
    woken = _report(
        shared_wake_s=21.4,
        shared_wake_restarted=True,
        engine_platform="vLLM 0.32.0 on cpu, no sleep mode (sleep = stop, wake = restart)",
        checkpoint_fallback="resumed from step-4: step-6 is partial",
    )
    (fallback, wake) = status_mod.report_events(woken)
    assert fallback == ("Warning", "CheckpointFallback", "step 7: resumed from step-4: step-6 is partial")
    assert wake[:2] == ("Normal", "SharedEngineWoken")
    assert "woke in 21.4 s" in wake[2] and "started again: vLLM 0.32.0 on cpu, no sleep mode" in wake[2]
    slept = status_mod.report_events(_report(shared_wake_s=0.8, shared_wake_restarted=False))
    assert slept == [
        (
            "Normal",
            "SharedEngineWoken",
            "step 7: a shared engine woke in 0.8 s (woken from vLLM's sleep mode)",
        )
    ]

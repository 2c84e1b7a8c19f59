"""Unit tests for rljob_operator.estimator.refit and the adaptive policy sized by it.

A job is simulated from the estimator's own model with the phases scaled (a "real" job whose decode
runs at a third of the preset's modelled rate, or three times it): its SyncReports are what the
driver writes. The refit must recover the scales, predict the measured step, and let the adaptive
policy reach the job's steady engine count in at most two decisions (without it: one engine per
`scaleUpAfterPressuredSyncPoints` pressured sync points).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from rljob_operator import estimator as est
from rljob_operator.decide import policy
from rljob_operator.estimator import planner, refit
from rljob_trainer.outputs import telemetry

SYNC_OVERHEAD_S = 1.0


def _request(**over: object) -> est.PlanRequest:
    base: dict[str, object] = {
        "hf_config": est.load_preset("qwen3-4b"),
        "accelerator": "H100-80GB",
        "total_accelerators": 32,
        "mode": "adaptive",
        "max_prompt_tokens": 512,
        "max_completion_tokens": 2048,
        "prompts_per_step": 64,
        "group_size": 8,
    }
    return est.PlanRequest(**{**base, **over})


@dataclass
class Job:
    """A one-step-off job whose real phases are the model's times scaled."""

    request: est.PlanRequest
    plan: est.ResourcePlan
    decode_scale: float = 1.0
    prefill_scale: float = 1.0
    training_scale: float = 1.0
    split: bool = True
    t: float = 1000.0
    step: int = 0

    def report(self, engines: int, dedicated: int, shared_awake: int) -> telemetry.SyncReport:
        real = planner.step_times(
            self.request.model_copy(
                update={
                    "decode_scale": self.decode_scale,
                    "prefill_scale": self.prefill_scale,
                    "training_scale": self.training_scale,
                }
            ),
            self.plan,
        )
        prefill_s, decode_s = real.generation_parts_s(engines)
        prefill_s, decode_s = prefill_s * self.prefill_scale, decode_s * self.decode_scale
        gen_s, train_s = prefill_s + decode_s, real.training_s(self.plan.trainer_accelerators)
        interval = max(gen_s, train_s) + SYNC_OVERHEAD_S
        wl = real.workload
        self.t += interval
        self.step += 1
        return telemetry.SyncReport(
            step=self.step,
            time=self.t,
            interval_s=interval,
            trainer_wait_s=max(0.0, gen_s - train_s),
            generation_s=gen_s,
            training_s=train_s,
            inflight_request_seconds=wl.sequences * gen_s,
            engine_seconds=engines * interval,
            snapshot_inflight=0,
            shared_engines_awake=shared_awake,
            dedicated_engines=dedicated,
            mean_reward=0.0,
            loss=0.0,
            tokens_per_s=wl.train_tokens / train_s,
            response_len_mean=float(wl.mean_completion_tokens),
            prompt_tokens=wl.sequences * wl.mean_prompt_tokens,
            generated_tokens=wl.sequences * wl.mean_completion_tokens,
            trained_tokens=wl.train_tokens,
            generation_engines=engines,
            prefill_engine_s=prefill_s * engines if self.split else None,
            decode_engine_s=decode_s * engines if self.split else None,
        )


def test_refit_recovers_the_measured_scales_and_the_step_time() -> None:
    request = _request()
    plan = est.plan_resources(request)
    job = Job(request, plan, decode_scale=3.0, prefill_scale=2.0, training_scale=0.5)
    engines = plan.rollout_engines
    reports = [job.report(engines, engines, 0) for _ in range(6)]
    fit = refit.refit(request, plan, reports)
    assert fit is not None and fit.split_measured
    assert fit.reports == 5 and (fit.from_step, fit.to_step) == (2, 6)  # step 1 (start-up) left out
    assert fit.decode_scale == pytest.approx(3.0)
    assert fit.prefill_scale == pytest.approx(2.0)
    assert fit.training_scale == pytest.approx(0.5)
    assert fit.decode_tokens_per_s_per_engine.measured_over_planned == pytest.approx(1 / 3)
    assert fit.training_tokens_per_s.measured_over_planned == pytest.approx(2.0)
    assert fit.measured_step_s == pytest.approx(reports[-1].interval_s)
    assert fit.refit_step_s == pytest.approx(fit.measured_step_s - SYNC_OVERHEAD_S)
    assert fit.step_time_ratio == pytest.approx(plan.step_time_s / fit.measured_step_s)
    # Slower decode and faster training: the refitted plan gives rollout more of the accelerators.
    assert fit.plan.rollout_engines > plan.rollout_engines
    assert fit.plan.trainer_accelerators < plan.trainer_accelerators


def test_without_an_engine_split_one_generation_scale_fits_both_parts() -> None:
    request = _request()
    plan = est.plan_resources(request)
    job = Job(request, plan, decode_scale=3.0, prefill_scale=3.0, split=False)
    fit = refit.refit(
        request, plan, [job.report(plan.rollout_engines, plan.rollout_engines, 0) for _ in range(4)]
    )
    assert fit is not None and not fit.split_measured
    assert fit.decode_scale == pytest.approx(3.0) and fit.prefill_scale == pytest.approx(3.0)
    assert fit.decode_tokens_per_s_per_engine.measured is None  # not measured apart


def test_reports_without_token_counts_give_no_refit() -> None:
    request = _request()
    plan = est.plan_resources(request)
    old = Job(request, plan).report(2, 2, 0).model_copy(update={"generated_tokens": 0})
    assert refit.refit(request, plan, [old, old]) is None


def _run_adaptive(job: Job, *, use_refit: bool, syncs: int = 80) -> tuple[int, int, int]:
    """(decisions, final dedicated engines, final shared awake) over `syncs` sync points."""
    plan, request = job.plan, job.request
    settings = policy.PolicySettings(cooldown_s=0)
    dedicated, shared, idle = plan.rollout_engines, 0, plan.idle_accelerators
    last: float | None = None
    history: list[telemetry.SyncReport] = []
    decisions = 0
    for _ in range(syncs):
        history = telemetry.append_report(history, job.report(dedicated + shared, dedicated, shared))
        state = policy.RolloutState(
            shared_engines_total=plan.shared_engines,
            shared_engines_awake=shared,
            dedicated_engines=dedicated,
            planned_dedicated_engines=plan.rollout_engines,
            idle_accelerators=idle,
            accelerators_per_engine=plan.tensor_parallel,
            last_action_time_s=last,
        )
        curve = None
        fit = refit.refit(request, plan, history) if use_refit else None
        if fit is not None:
            most = plan.shared_engines + dedicated + idle // plan.tensor_parallel
            curve = refit.engine_curve(request, plan, fit, max_engines=most)
        d = policy.decide(state, history, settings, job.t, refit=curve)
        if d.action == "none":
            continue
        decisions += 1
        idle -= (d.desired_dedicated_engines - dedicated) * plan.tensor_parallel
        dedicated, shared, last = d.desired_dedicated_engines, d.desired_shared_awake, job.t
    return decisions, dedicated, shared


def _steady_dedicated(job: Job) -> int:
    """The dedicated engines the real job's step is shortest with (within 5 %), shared all awake."""
    p = job.plan
    real = planner.step_times(
        job.request.model_copy(update={"decode_scale": job.decode_scale, "prefill_scale": job.prefill_scale}),
        p,
    )
    most = p.shared_engines + p.rollout_engines + p.idle_accelerators // p.tensor_parallel
    curve = refit.EngineCurve(
        generation_s=tuple(real.generation_s(e) for e in range(1, most + 1)),
        training_s=real.training_s(p.trainer_accelerators),
    )
    return curve.steady_engines() - p.shared_engines


def test_generation_at_a_third_of_the_presets_rate_reaches_its_steady_engines_in_two_decisions() -> None:
    request = _request()
    plan = est.plan_resources(request)
    job = Job(request, plan, decode_scale=3.0, prefill_scale=3.0)
    steady = _steady_dedicated(job)
    assert steady > plan.rollout_engines + 1  # the scenario needs several engines added
    decisions, dedicated, shared = _run_adaptive(job, use_refit=True)
    assert (dedicated, shared) == (steady, plan.shared_engines)
    assert decisions <= 2  # wake the shared engines, add the dedicated ones the refit sizes
    # Today's rule (no refit) adds one engine per scaleUpAfterPressuredSyncPoints pressured points.
    slow_decisions, slow_dedicated, _ = _run_adaptive(
        Job(request, plan, decode_scale=3.0, prefill_scale=3.0), use_refit=False
    )
    assert slow_decisions > 2 + (steady - plan.rollout_engines) - 1
    assert slow_dedicated >= steady


def test_generation_at_three_times_the_presets_rate_removes_the_surplus_at_once() -> None:
    request = _request()
    plan = est.plan_resources(request)
    job = Job(request, plan, decode_scale=1 / 3, prefill_scale=1 / 3)
    room = plan.idle_accelerators // plan.tensor_parallel
    settings = policy.PolicySettings(cooldown_s=0)
    dedicated = plan.rollout_engines + room  # an earlier decision added engines (longer answers then)
    history = [job.report(dedicated + plan.shared_engines, dedicated, plan.shared_engines) for _ in range(4)]
    state = policy.RolloutState(
        shared_engines_total=plan.shared_engines,
        shared_engines_awake=plan.shared_engines,
        dedicated_engines=dedicated,
        planned_dedicated_engines=plan.rollout_engines,
        idle_accelerators=0,
        accelerators_per_engine=plan.tensor_parallel,
    )
    fit = refit.refit(request, plan, history)
    assert fit is not None
    curve = refit.engine_curve(request, plan, fit, max_engines=plan.shared_engines + dedicated)
    d = policy.decide(state, history, settings, job.t, refit=curve)
    assert d.action == "remove_dedicated"
    assert d.desired_dedicated_engines == plan.rollout_engines  # all the surplus, down to the plan
    assert "are enough" in d.reason
    plain = policy.decide(state, history, settings, job.t)
    assert plain.desired_dedicated_engines == dedicated - 1  # without a refit: one at a time

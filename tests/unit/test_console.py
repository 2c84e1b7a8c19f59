"""`rljob status` rendering (`rljob_operator.cli.console`): pure objects in, text out."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from rljob_operator.cli import commands, console
from rljob_trainer.outputs import telemetry

NOW = datetime(2026, 12, 1, 8, 0, 0, tzinfo=timezone.utc)


def _report(step: int, reward: float, dedicated: int = 0) -> telemetry.SyncReport:
    return telemetry.SyncReport(
        step=step, time=NOW.timestamp() - 60 + step, interval_s=1.0, trainer_wait_s=0.5, generation_s=0.5,
        training_s=0.4, inflight_request_seconds=2.0, engine_seconds=1.0, snapshot_inflight=0,
        shared_engines_awake=1, dedicated_engines=dedicated, mean_reward=reward, loss=0.1 * step,
        tokens_per_s=100.0 * step, response_len_mean=1.0,
    )  # fmt: skip


RLJOB = {
    "metadata": {"name": "tiny-cpu", "namespace": "team-a", "creationTimestamp": "2026-12-01T07:58:00Z"},
    "status": {
        "phase": "Running",
        "plan": {"trainerAccelerators": 2, "rolloutAccelerators": 0, "rolloutEngines": 0, "sharedEngines": 1},
        "progress": {"step": 3, "maxSteps": 20, "meanReward": 0.5, "exportPath": "/checkpoints/hf/step-2"},
        "rollout": {"sharedEngines": 1, "sharedEnginesAwake": 1, "dedicatedEngines": 0},
        "conditions": [
            {"type": "Planned", "status": "True", "reason": "PlanComputed", "message": "2 trainer",
             "lastTransitionTime": "2026-12-01T07:58:30Z"},
        ],
    },
}  # fmt: skip
EVENTS = [
    {"reason": "PodsCreated", "message": "created tiny-cpu-trainer-0",
     "lastTimestamp": "2026-12-01T07:58:01Z"},
    {"reason": "AdaptiveScaleUp", "message": "busy 3.1 > 2 for 4 sync points", "count": 1,
     "lastTimestamp": "2026-12-01T07:59:30Z"},
    {"reason": "AdaptiveWake", "message": "trainer waited 80%", "lastTimestamp": "2026-12-01T07:59:00Z"},
]  # fmt: skip


def test_view_keeps_history_series_and_only_adaptive_decisions_in_order() -> None:
    view = console.build_status_view(RLJOB, [_report(1, 0.1), _report(2, 0.3, 1)], EVENTS)
    assert view["series"]["step"] == [1.0, 2.0]
    assert view["series"]["mean_reward"] == [0.1, 0.3]
    assert view["series"]["engines_awake"] == [1.0, 2.0]
    assert [d["action"] for d in view["decisions"]] == ["Wake", "ScaleUp"]
    assert view["decisions"][1]["reason"] == "busy 3.1 > 2 for 4 sync points"


def test_decision_falls_back_to_the_status_when_events_expired() -> None:
    rollout = {"lastDecision": "Wake", "lastDecisionReason": "pressure"}
    rollout["lastDecisionTime"] = "2026-12-01T07:59:00Z"
    job = {**RLJOB, "status": {**RLJOB["status"], "rollout": rollout}}
    view = console.build_status_view(job, [], [])
    assert view["decisions"] == [
        {"time": "2026-12-01T07:59:00Z", "action": "Wake", "reason": "pressure", "count": "1"}
    ]


def test_text_shows_phase_plan_conditions_plots_and_decisions() -> None:
    reports = [_report(s, 0.1 * s) for s in range(1, 9)]
    text = console.render_status(console.build_status_view(RLJOB, reports, EVENTS), now=NOW, width=80)
    first = text.splitlines()[0]
    assert "team-a/tiny-cpu" in first and "Running" in first and "3/20" in first and "age: 2m" in first
    assert "trainer accelerators 2" in text and "export /checkpoints/hf/step-2" in text
    assert "Planned  True    PlanComputed" in text
    for title in ("reward", "loss", "tokens/s", "engines awake"):
        assert title in text
    assert "\x1b[" not in text  # no colour codes: pipes and files get plain text
    assert "busy 3.1 > 2 for 4 sync points" in text and "ScaleUp" in text
    table = console.render_status(console.build_status_view(RLJOB, reports, []), now=NOW, plots=False)
    assert "  8     0.8     0.8   800.0     1" in table
    assert "(none)" in table


def test_empty_history_says_so() -> None:
    text = console.render_status(console.build_status_view(RLJOB, [], []), now=NOW)
    assert "no sync points reported yet" in text


def test_cli_registers_status_and_logs() -> None:
    args = commands.build_parser().parse_args(["status", "tiny-cpu", "-n", "x", "-o", "json"])
    assert args.func is console.cmd_status and args.namespace == "x" and args.output == "json"
    args = commands.build_parser().parse_args(["logs", "tiny-cpu", "--pod", "trainer-1", "-f"])
    assert (
        args.func is console.cmd_logs
        and args.follow
        and console.pod_for("tiny-cpu", args.pod) == ("tiny-cpu-trainer-1")
    )
    assert console.pod_for("tiny-cpu", "tiny-cpu-rollout-0") == "tiny-cpu-rollout-0"


def test_status_shows_draining_and_replaced_rollout_pods() -> None:
    rollout = {
        **RLJOB["status"]["rollout"],
        "drainingPods": [{"index": 1, "since": "2026-12-01T07:59:30Z"}],
        "replacedPods": 2,
    }
    job = {**RLJOB, "status": {**RLJOB["status"], "rollout": rollout}}
    text = console.render_status(console.build_status_view(job, [], []), now=NOW, plots=False)
    assert "draining rollout-1 (since 2026-12-01T07:59:30Z)" in text
    assert "replaced after an engine loss: 2" in text
    plain = console.render_status(console.build_status_view(RLJOB, [], []), now=NOW, plots=False)
    assert "draining" not in plain and "replaced" not in plain


def test_the_eval_reward_is_plotted_at_the_steps_that_evaluated() -> None:
    reports = [
        _report(s, 0.1 * s).model_copy(update={"eval_mean_reward": 0.2 * s if s % 2 == 0 else None})
        for s in range(1, 9)
    ]
    reports[2] = reports[2].model_copy(update={"loss": None})  # a skipped step: no finite loss
    # step 1's report carries the evaluation before training: plotted at step 0, not 1
    reports[0] = reports[0].model_copy(update={"eval_mean_reward": 0.05, "eval_step": 0})
    view = console.build_status_view(RLJOB, reports, [])
    series = view["series"]["eval_mean_reward"]
    assert [x for x in series if x == x] == pytest.approx([0.05, 0.4, 0.8, 1.2, 1.6])
    evaluated_at = [s for s, x in zip(view["series"]["eval_step"], series, strict=True) if x == x]
    assert evaluated_at == [0, 2, 4, 6, 8]
    # (one render per process, as the CLI does: plotext 5.3 keeps subplot state across figures)
    text = console.render_status(view, now=NOW, width=80)
    assert "eval" in text and "train" in text  # both curves in the reward panel, with a legend


def test_text_shows_the_last_steps_numerics_by_verls_names_and_null_as_a_dash() -> None:
    numerics = {"entropy": 1.25, "pg_clipfrac": 0.03, "pg_clipfrac_lower": 0.004, "ppo_kl": float("nan")}
    numerics |= {
        "rollout/logprob_diff": 0.12,
        "rollout_corr/kl": 0.02,
        "rollout_corr/rollout_is_oob_ratio": 0.01,
    }
    last = _report(2, 0.3).model_copy(update={"numerics": numerics})
    last = telemetry.SyncReport.model_validate(last.model_dump(by_alias=True))  # through JSON's rules
    assert last.numerics["ppo_kl"] is None  # not finite: null, as the loss
    text = console.render_status(console.build_status_view(RLJOB, [_report(1, 0.1), last], []), now=NOW)
    assert "Numerics (step 2):" in text
    assert "entropy 1.25, ppo_kl -, pg_clipfrac 0.03, pg_clipfrac_lower (dual-clip) 0.004" in text
    assert "engine vs trainer: |log-prob gap| 0.12, KL(rollout||trainer) 0.02" in text
    assert "IS masked 0.01" in text
    old_driver = console.render_status(console.build_status_view(RLJOB, [_report(1, 0.1)], []), now=NOW)
    assert "Numerics" not in old_driver


def test_status_says_what_the_engines_platform_can_do_and_the_last_wake() -> None:
    reports = [_report(s, 0.1 * s) for s in range(1, 4)]
    reports[1] = reports[1].model_copy(
        update={
            "engine_platform": "vLLM 0.32.0 on cpu, no sleep mode (sleep = stop, wake = restart)",
            "shared_wake_s": 19.5,
            "shared_wake_restarted": True,
        }
    )
    text = console.render_status(console.build_status_view(RLJOB, reports, []), now=NOW, plots=False)
    assert "engines: vLLM 0.32.0 on cpu, no sleep mode (sleep = stop, wake = restart)" in text
    assert "last shared-engine wake: step 2, 19.5 s, started again (no sleep mode)" in text
    plain = console.render_status(console.build_status_view(RLJOB, reports[:1], []), now=NOW, plots=False)
    assert "engines:" not in plain and "shared-engine wake" not in plain

"""Unit tests for rljob_operator.decide.policy: every branch of decide(), its invariants, and the seed's
blind spot (generation that finished before the sync instant)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rljob_operator.decide import policy
from rljob_trainer.outputs import telemetry

INTERVAL_S = 100.0


def report(
    step: int,
    *,
    wait_s: float = 0.0,
    busy: float = 0.0,
    snapshot: int = 0,
    shared: int = 0,
    dedicated: int = 2,
    generation_s: float | None = None,
    interval_s: float = INTERVAL_S,
    time_s: float | None = None,
) -> telemetry.SyncReport:
    """A sync report: `busy` is the interval-mean requests in flight per awake engine."""
    engines = shared + dedicated
    engine_s = engines * interval_s
    return telemetry.SyncReport(
        step=step,
        time=1000.0 + step * interval_s if time_s is None else time_s,
        interval_s=interval_s,
        trainer_wait_s=wait_s,
        generation_s=interval_s if generation_s is None else generation_s,
        training_s=interval_s - wait_s,
        inflight_request_seconds=busy * engine_s,
        engine_seconds=engine_s,
        snapshot_inflight=snapshot,
        shared_engines_awake=shared,
        dedicated_engines=dedicated,
        mean_reward=0.0,
        loss=0.0,
        tokens_per_s=1.0,
        response_len_mean=300.0,
    )


def pressured_reports(n: int, first_step: int = 1, **kw: object) -> list[telemetry.SyncReport]:
    return [report(first_step + i, wait_s=40.0, busy=32.0, **kw) for i in range(n)]  # type: ignore[arg-type]


def calm_reports(n: int, first_step: int = 1, **kw: object) -> list[telemetry.SyncReport]:
    # No wait; generation took 8 s of 100 s, so even one of 2 engines fewer leaves a wait < 10%.
    return [report(first_step + i, generation_s=8.0, busy=32.0, **kw) for i in range(n)]  # type: ignore[arg-type]


STATE = policy.RolloutState(
    shared_engines_total=1,
    shared_engines_awake=0,
    dedicated_engines=2,
    planned_dedicated_engines=2,
    idle_accelerators=2,
    accelerators_per_engine=1,
)
SETTINGS = policy.PolicySettings(
    max_rollout_engines=6,
    busy_threshold=4.0,
    wait_threshold=0.1,
    wake_after_pressured_sync_points=2,
    scale_up_after_pressured_sync_points=3,
    calm_sync_points_before_scale_down=3,
    cooldown_s=60.0,
)
NOW = 10_000.0


def decide(
    state: policy.RolloutState = STATE,
    history: Sequence[telemetry.SyncReport] = (),
    s: policy.PolicySettings = SETTINGS,
    now: float = NOW,
) -> policy.Decision:
    return policy.decide(state, history, s, now)


# ---- registry and settings ---------------------------------------------------------------------


def test_registry_lists_names_on_unknown_signal():
    assert policy.busy_signal_names() == ["integrated", "snapshot"]
    with pytest.raises(ValueError, match="unknown adaptive signal 'bogus'; valid: integrated, snapshot"):
        policy.get_busy_signal("bogus")
    with pytest.raises(ValidationError, match="valid: integrated, snapshot"):
        policy.PolicySettings(signal="bogus")
    with pytest.raises(ValueError, match="already registered"):
        policy.register_busy_signal("snapshot")(policy.busy_snapshot)


def test_seed_rule_is_expressible():
    seed = policy.PolicySettings.seed_rule(max_rollout_engines=4)
    assert (seed.signal, seed.busy_threshold, seed.wake_after_pressured_sync_points) == ("snapshot", 0.0, 2)
    assert seed.max_rollout_engines == 4
    # One request in flight at the sync instant counts as busy for the seed (inflight_count > 0) ...
    hist = [report(i, wait_s=40.0, snapshot=1) for i in (1, 2)]
    assert decide(history=hist, s=seed).action == "wake_shared"
    # ... and none does not, however busy the interval was.
    hist = [report(i, wait_s=40.0, busy=64.0, snapshot=0) for i in (1, 2)]
    assert decide(history=hist, s=seed).action == "none"


class _Signal(enum.Enum):
    SNAPSHOT = "snapshot"


def test_from_adaptive_spec_duck_typed():
    spec = SimpleNamespace(
        max_rollout_engines=5,
        signal=_Signal.SNAPSHOT,
        busy_threshold=2.5,
        wait_threshold=0.2,
        wake_after_pressured_sync_points=3,
        scale_up_after_pressured_sync_points=4,
        calm_sync_points_before_scale_down=6,
        cooldown_seconds=30,
    )
    got = policy.PolicySettings.from_adaptive_spec(spec)
    assert got == policy.PolicySettings(
        max_rollout_engines=5,
        signal="snapshot",
        busy_threshold=2.5,
        wait_threshold=0.2,
        wake_after_pressured_sync_points=3,
        scale_up_after_pressured_sync_points=4,
        calm_sync_points_before_scale_down=6,
        cooldown_s=30.0,
    )
    camel = {"maxRolloutEngines": 5, "signal": "snapshot", "cooldownSeconds": 30, "waitThreshold": None}
    got = policy.PolicySettings.from_adaptive_spec(camel)
    assert (got.max_rollout_engines, got.signal, got.cooldown_s) == (5, "snapshot", 30.0)
    assert got.wait_threshold == policy.PolicySettings().wait_threshold  # None keeps the default


def test_state_rejects_more_awake_than_total():
    with pytest.raises(ValidationError, match="exceeds shared_engines_total"):
        policy.RolloutState(shared_engines_total=1, shared_engines_awake=2)


def test_models_are_frozen():
    with pytest.raises(ValidationError):
        SETTINGS.cooldown_s = 1.0  # type: ignore[misc]


# ---- reading one sync point ----------------------------------------------------------------------


def test_read_first_interval_is_neither():
    r = policy.read_sync_point(report(0, interval_s=0.0, wait_s=0.0), SETTINGS)
    assert not r.pressured and not r.calm


def test_read_waited_but_tail_bound_is_not_pressure():
    # The trainer waited on a long tail: engines held ~1 request each. Another engine would idle too,
    # and one engine fewer would still not be busy (2 < 4): calm, whatever the wait.
    r = policy.read_sync_point(report(1, wait_s=50.0, busy=1.0), SETTINGS)
    assert r.wait_fraction == pytest.approx(0.5) and not r.pressured
    assert r.predicted_busy_per_engine == pytest.approx(2.0) and r.calm
    r = policy.read_sync_point(report(1, wait_s=50.0, busy=3.0), SETTINGS)  # 6 >= 4 with one fewer
    assert not r.pressured and not r.calm


def test_read_busy_without_wait_is_not_pressure():
    r = policy.read_sync_point(report(1, wait_s=0.0, busy=64.0, generation_s=8.0), SETTINGS)
    assert not r.pressured and r.calm


def test_read_calm_predicts_one_engine_fewer():
    # No wait now, but generation nearly fills the interval: with one of 2 engines fewer it would
    # take 2x and the trainer would wait. Not calm: scaling down would undo the last scale-up.
    r = policy.read_sync_point(report(1, wait_s=0.0, generation_s=95.0, dedicated=2, busy=32.0), SETTINGS)
    assert r.predicted_wait_fraction == pytest.approx(90 / 190) and not r.calm
    # Generation overlapped training and ended 40 s early: a stretch of 60/(3-1) = 30 s hides in it.
    r = policy.read_sync_point(report(1, generation_s=60.0, dedicated=3, busy=32.0), SETTINGS)
    assert r.predicted_wait_fraction == 0.0 and r.calm
    # The same, but the trainer waited 1 s: generation ended with the wait, no slack, all 30 s add.
    r = policy.read_sync_point(report(1, wait_s=1.0, generation_s=60.0, dedicated=3, busy=32.0), SETTINGS)
    assert r.predicted_wait_fraction == pytest.approx(31 / 130) and not r.calm
    # A single engine can never be removed.
    r = policy.read_sync_point(report(1, generation_s=1.0, dedicated=1), SETTINGS)
    assert r.predicted_wait_fraction == r.predicted_busy_per_engine == float("inf") and not r.calm


def test_snapshot_with_no_awake_engine_reads_raw_count():
    r = policy.busy_snapshot(report(1, snapshot=3, shared=0, dedicated=0))
    assert r.per_engine == 3.0
    assert policy.busy_integrated(report(1, shared=0, dedicated=0)).per_engine == 0.0


# ---- decide: every branch -------------------------------------------------------------------------


def test_no_reports():
    d = decide()
    assert d.action == "none" and "no sync-point reports" in d.reason
    assert (d.desired_shared_awake, d.desired_dedicated_engines) == (0, 2)


def test_one_pressured_point_holds():
    d = decide(history=pressured_reports(1))
    assert d.action == "none" and d.pressured_streak == 1 and d.reason.startswith("hold:")


def test_wake_shared_after_two_pressured_points():
    d = decide(history=[*calm_reports(3), *pressured_reports(2, first_step=4)])
    assert d.action == "wake_shared"
    assert (d.desired_shared_awake, d.desired_dedicated_engines) == (1, 2)
    assert d.pressured_streak == 2 and d.calm_streak == 0
    assert "steps 4–5" in d.reason and "40–40%" in d.reason and "32.0–32.0" in d.reason
    assert "wakeAfterPressuredSyncPoints=2" in d.reason


def test_interrupted_streak_does_not_wake():
    hist = [*pressured_reports(1), report(2, wait_s=0.0, busy=32.0), *pressured_reports(1, first_step=3)]
    assert decide(history=hist).action == "none"


def test_wake_is_not_capped_by_the_dedicated_limit():
    # maxRolloutEngines caps dedicated engines (the API's meaning); a shared engine needs no accelerator.
    s = SETTINGS.model_copy(update={"max_rollout_engines": 2})
    assert decide(history=pressured_reports(2), s=s).action == "wake_shared"


def test_cooldown_blocks_action():
    state = STATE.model_copy(update={"last_action_time_s": NOW - 30.0})
    hist = pressured_reports(3, time_s=None)
    hist = [r.model_copy(update={"time": NOW - 20.0 + i}) for i, r in enumerate(hist)]
    d = decide(state=state, history=hist)
    assert d.action == "none" and "cooldown: 30 s" in d.reason and d.pressured_streak == 3


def test_reports_before_last_action_do_not_count():
    state = STATE.model_copy(update={"last_action_time_s": 1000.0 + 2 * INTERVAL_S})
    d = decide(state=state, history=pressured_reports(3))  # times 1100, 1200, 1300
    assert d.action == "none" and d.pressured_streak == 1


def test_unsettled_reports_wait_for_last_action():
    # Target: 1 shared awake, but the driver has not applied it yet.
    state = STATE.model_copy(update={"shared_engines_awake": 1})
    d = decide(state=state, history=pressured_reports(5, shared=0))
    assert d.action == "none" and "waiting for the last action" in d.reason
    assert "shows 0 shared awake + 2 dedicated, target 1 + 2" in d.reason


def test_add_dedicated_after_further_pressured_points():
    state = STATE.model_copy(update={"shared_engines_awake": 1})
    assert decide(state=state, history=pressured_reports(2, shared=1)).action == "none"
    d = decide(state=state, history=pressured_reports(3, shared=1))
    assert d.action == "add_dedicated"
    assert (d.desired_shared_awake, d.desired_dedicated_engines) == (1, 3)
    assert "scaleUpAfterPressuredSyncPoints=3" in d.reason and "1 of 2 idle accelerators" in d.reason


def test_add_dedicated_needs_all_shared_awake():
    state = STATE.model_copy(update={"shared_engines_total": 2, "shared_engines_awake": 1})
    d = decide(state=state, history=pressured_reports(3, shared=1))
    assert d.action == "wake_shared" and d.desired_shared_awake == 2


def test_no_shared_engines_goes_straight_to_dedicated():
    state = STATE.model_copy(update={"shared_engines_total": 0})
    assert decide(state=state, history=pressured_reports(2)).action == "none"
    assert decide(state=state, history=pressured_reports(3)).action == "add_dedicated"


def test_add_dedicated_blocked_by_idle_accelerators():
    state = STATE.model_copy(
        update={"shared_engines_awake": 1, "idle_accelerators": 1, "accelerators_per_engine": 2}
    )
    d = decide(state=state, history=pressured_reports(3, shared=1))
    assert d.action == "none" and "1 idle accelerators < 2 per engine" in d.reason


def test_add_dedicated_blocked_at_limit():
    state = STATE.model_copy(update={"shared_engines_awake": 1})
    s = SETTINGS.model_copy(update={"max_rollout_engines": 2})
    d = decide(state=state, history=pressured_reports(3, shared=1), s=s)
    assert d.action == "none" and "2 dedicated = maxRolloutEngines" in d.reason


def test_calm_removes_added_dedicated_first():
    state = STATE.model_copy(update={"shared_engines_awake": 1, "dedicated_engines": 3})
    assert decide(state=state, history=calm_reports(2, shared=1, dedicated=3)).action == "none"
    d = decide(state=state, history=calm_reports(3, shared=1, dedicated=3))
    assert d.action == "remove_dedicated"
    assert (d.desired_shared_awake, d.desired_dedicated_engines) == (1, 2)
    assert d.calm_streak == 3 and "calmSyncPointsBeforeScaleDown=3" in d.reason
    assert "plan has 2" in d.reason


def test_calm_then_sleeps_shared():
    state = STATE.model_copy(update={"shared_engines_awake": 1})
    d = decide(state=state, history=calm_reports(3, shared=1))
    assert d.action == "sleep_shared" and (d.desired_shared_awake, d.desired_dedicated_engines) == (0, 2)


def test_calm_at_plan_releases_nothing():
    d = decide(history=calm_reports(5))
    assert d.action == "none" and "nothing above the plan" in d.reason and d.calm_streak == 5


def test_over_limit_clamps_at_once():
    state = STATE.model_copy(update={"shared_engines_awake": 1, "dedicated_engines": 4})
    s = SETTINGS.model_copy(update={"max_rollout_engines": 2})
    d = decide(state=state, history=pressured_reports(5, shared=1, dedicated=4), s=s)
    assert d.action == "remove_dedicated" and "exceed maxRolloutEngines=2" in d.reason
    assert (d.desired_shared_awake, d.desired_dedicated_engines) == (1, 2)  # even below the plan:
    s = SETTINGS.model_copy(update={"max_rollout_engines": 1})
    assert decide(state=state, s=s).desired_dedicated_engines == 1


# ---- the seed's blind spot -------------------------------------------------------------------------


def one_step_off_report(step: int, shared: int, dedicated: int) -> telemetry.SyncReport:
    """One-step-off pipeline: generation of the next batch overlaps training and finishes before the
    sync, so nothing is in flight at the sync instant. The engines were saturated the whole time
    (48 requests each) and the trainer still waited 30 s of every 100 s."""
    return report(step, wait_s=30.0, busy=48.0, snapshot=0, shared=shared, dedicated=dedicated)


def run_policy(s: policy.PolicySettings, steps: int) -> list[tuple[int, str]]:
    """Feed `steps` sync points through decide(), applying each decision at once (the driver follows
    the targets by the next sync). Returns (step, action) for every action taken."""
    state = STATE.model_copy(update={"idle_accelerators": 4})
    history: list[telemetry.SyncReport] = []
    actions: list[tuple[int, str]] = []
    for step in range(1, steps + 1):
        history = telemetry.append_report(
            history, one_step_off_report(step, state.shared_engines_awake, state.dedicated_engines)
        )
        now = history[-1].time
        d = policy.decide(state, history, s, now)
        if d.action != "none":
            actions.append((step, d.action))
            added = d.desired_dedicated_engines - state.dedicated_engines
            state = state.model_copy(
                update={
                    "shared_engines_awake": d.desired_shared_awake,
                    "dedicated_engines": d.desired_dedicated_engines,
                    "idle_accelerators": state.idle_accelerators - added * state.accelerators_per_engine,
                    "last_action_time_s": now,
                }
            )
    return actions


def test_snapshot_stays_idle_where_integrated_wakes_then_scales_up():
    common = {
        "max_rollout_engines": 6,
        "cooldown_s": 0.0,
        "wake_after_pressured_sync_points": 2,
        "scale_up_after_pressured_sync_points": 3,
    }
    seed = policy.PolicySettings.seed_rule(**common)
    ours = policy.PolicySettings(signal="integrated", busy_threshold=4.0, **common)
    assert run_policy(seed, 12) == []
    got = run_policy(ours, 12)
    # wake after 2 pressured points, then a dedicated engine after every 3 further ones, until the
    # 4 idle accelerators are used.
    assert got == [
        (2, "wake_shared"),
        (5, "add_dedicated"),
        (8, "add_dedicated"),
        (11, "add_dedicated"),
    ]


# ---- invariants ------------------------------------------------------------------------------------


@st.composite
def states(draw: st.DrawFn) -> policy.RolloutState:
    total = draw(st.integers(0, 4))
    planned = draw(st.integers(0, 4))
    return policy.RolloutState(
        shared_engines_total=total,
        shared_engines_awake=draw(st.integers(0, total)),
        dedicated_engines=draw(st.integers(planned, planned + 4)),
        planned_dedicated_engines=planned,
        idle_accelerators=draw(st.integers(0, 8)),
        accelerators_per_engine=draw(st.sampled_from([1, 2, 4, 8])),
        last_action_time_s=draw(st.none() | st.floats(0, 3000)),
    )


@st.composite
def settings_(draw: st.DrawFn) -> policy.PolicySettings:
    return policy.PolicySettings(
        max_rollout_engines=draw(st.none() | st.integers(0, 10)),
        signal=draw(st.sampled_from(policy.busy_signal_names())),
        busy_threshold=draw(st.floats(0, 16)),
        wait_threshold=draw(st.floats(0.01, 1)),
        wake_after_pressured_sync_points=draw(st.integers(1, 4)),
        scale_up_after_pressured_sync_points=draw(st.integers(1, 4)),
        calm_sync_points_before_scale_down=draw(st.integers(1, 4)),
        cooldown_s=draw(st.floats(0, 500)),
    )


@st.composite
def histories(draw: st.DrawFn, state: policy.RolloutState, *, max_wait_fraction: float = 1.0):
    n = draw(st.integers(0, 8))
    out = []
    for i in range(n):
        interval = draw(st.floats(0, 300))
        # Mostly the state's own counts (so streaks count), sometimes others.
        settled = draw(st.booleans() | st.just(True))
        shared = state.shared_engines_awake if settled else draw(st.integers(0, 4))
        dedicated = state.dedicated_engines if settled else draw(st.integers(0, 8))
        engines = shared + dedicated
        out.append(
            report(
                i + 1,
                wait_s=interval * draw(st.floats(0, max_wait_fraction)),
                busy=draw(st.floats(0, 64)) if engines else 0.0,
                snapshot=draw(st.integers(0, 256)),
                shared=shared,
                dedicated=dedicated,
                generation_s=interval * draw(st.floats(0, 1)),
                interval_s=interval,
                time_s=1000.0 + i * 200.0,
            )
        )
    return out


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_invariants(data: st.DataObject):
    state = data.draw(states())
    s = data.draw(settings_())
    history = data.draw(histories(state))
    now = data.draw(st.floats(1000, 5000))
    d = policy.decide(state, history, s, now)
    assert d == policy.decide(state, list(history), s, now)  # deterministic
    assert d.desired_shared_awake >= 0 and d.desired_dedicated_engines >= 0
    assert d.desired_shared_awake <= state.shared_engines_total
    if s.max_rollout_engines is not None:
        assert d.desired_dedicated_engines <= s.max_rollout_engines
    added = d.desired_dedicated_engines - state.dedicated_engines
    assert max(0, added) * state.accelerators_per_engine <= state.idle_accelerators
    changes = abs(d.desired_shared_awake - state.shared_engines_awake) + abs(added)
    over_limit = s.max_rollout_engines is not None and state.dedicated_engines > s.max_rollout_engines
    if not over_limit:
        assert changes <= 1  # one step at a time
        assert d.desired_dedicated_engines >= min(state.dedicated_engines, state.planned_dedicated_engines)
        if changes and state.last_action_time_s is not None:
            assert now - state.last_action_time_s >= s.cooldown_s
    assert (changes == 0) == (d.action == "none")
    assert d.reason
    for r in history:  # hysteresis: no reading is both
        reading = policy.read_sync_point(r, s)
        assert not (reading.pressured and reading.calm)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_calm_history_never_scales_up(data: st.DataObject):
    state = data.draw(states())
    s = data.draw(settings_())
    # The trainer waited less than the threshold at every sync point.
    history = data.draw(histories(state, max_wait_fraction=s.wait_threshold * 0.99))
    d = policy.decide(state, history, s, data.draw(st.floats(1000, 5000)))
    assert d.action not in ("wake_shared", "add_dedicated")
    assert d.desired_shared_awake <= state.shared_engines_awake
    assert d.desired_dedicated_engines <= state.dedicated_engines


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_snapshot_zero_never_scales_up_under_seed_rule(data: st.DataObject):
    state = data.draw(states())
    s = policy.PolicySettings.seed_rule(cooldown_s=0.0)
    history = [r.model_copy(update={"snapshot_inflight": 0}) for r in data.draw(histories(state))]
    d = policy.decide(state, history, s, 5000.0)
    assert d.action not in ("wake_shared", "add_dedicated")


def test_from_the_real_adaptive_spec():
    from rljob_operator import api

    assert policy.PolicySettings.from_adaptive_spec(api.AdaptiveSpec()) == policy.PolicySettings()
    spec = api.AdaptiveSpec.model_validate(
        {"maxRolloutEngines": 3, "signal": "snapshot", "cooldownSeconds": 5}
    )
    got = policy.PolicySettings.from_adaptive_spec(spec)
    assert (got.max_rollout_engines, got.signal, got.cooldown_s) == (3, "snapshot", 5.0)

"""The pure parts of bench/pipeline.py: the efficiency from the asynchronous runs' own phases, the
calibration's power laws in the batch and the cap, and the refusal of degenerate regimes (the old
bench balanced at a 2-token cap: 0.1 s steps where Ray calls and weight syncs decided a ratio that
moved by 0.74 between runs)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "pipeline.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_pipeline", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _rows(gen: float, train: float, rest: float, n: int = 10, **extra: float) -> list[dict[str, float]]:
    row = {
        "step_s": gen + train + rest,
        "generation_s": gen,
        "training_s": train,
        "weight_sync_s": rest / 2,
        "trainer_wait_s": gen,
        "rollout/staleness_max": 0,
        **extra,
    }
    return [dict(row) for _ in range(n)]


def test_efficiency_comes_from_the_async_runs_own_phases(bench: ModuleType) -> None:
    """maxStaleness 1: a step's ideal is the slower of the trainer's own work (the step less its
    waits) and the engine's (the next batch's generation and the sync's own work)."""
    sync = bench.phases(_rows(1.0, 0.8, 0.1))
    assert sync.rest_s == pytest.approx(0.1)
    assert sync.serial_ideal == pytest.approx((1.0 + 0.8 + 0.1) / (1.0 + 0.1))
    async_rows = [
        {**r, "step_s": 1.25, "trainer_wait_s": 0.2, "rollout/staleness_max": 1} for r in _rows(1.0, 0.8, 0.1)
    ]
    fig = bench.figures("maxStaleness 1", sync, [async_rows], max_staleness=1, partial=False)
    trainer_own, engine_own = 1.25 - 0.2, 1.0 + max(0.0, 0.05 - 0.2)
    assert fig.overlap.steps == 8  # steps 1-8 of 10: the first warms up, the last trains alone
    assert fig.efficiency == pytest.approx(max(trainer_own, engine_own) / 1.25)
    assert fig.efficiency <= 1.0
    assert fig.ratio == pytest.approx(1.9 / 1.25)
    assert fig.ideal == pytest.approx(fig.ratio / fig.efficiency)
    line = f"pipeline: {fig.line()}"
    assert line == (
        f"pipeline: sync {3600 / 1.9:.0f} steps/h, async {3600 / 1.25:.0f} steps/h, ratio {1.9 / 1.25:.2f}, "
        f"ideal {fig.ideal:.2f}, efficiency {fig.efficiency:.2f}, staleness max 1"
    )


def test_deeper_staleness_judges_the_whole_run(bench: ModuleType) -> None:
    """maxStaleness 2: work may move between steps, so the ideal is the slower side's sum."""
    rows = [{**r, "step_s": 1.0, "trainer_wait_s": 0.0} for r in _rows(0.6, 0.9, 0.0)]
    rows[3]["generation_s"] = 1.5  # one slow batch, absorbed by the run's slack
    ov = bench.overlap([rows], 2)
    trainer = [1.0] * ov.steps
    engine = [float(rows[i + 2]["generation_s"]) for i in range(1, 1 + ov.steps)]
    assert ov.ideal_s == pytest.approx(max(sum(trainer), sum(engine)))


def test_runs_in_sync_async_async_sync_order_cancel_a_machine_that_drifts(bench: ModuleType) -> None:
    """The machine slows by 10 % a run: the sync run before and the one after the async pair pool
    to the same mean as the pair, so the ratio is the pipeline's (2.0 here), not the drift's."""
    slow = [1.0, 1.1, 1.2, 1.3]  # sync, async, async, sync
    sync = bench.phases(_rows(1.0 * slow[0], 1.0 * slow[0], 0.0), _rows(1.0 * slow[3], 1.0 * slow[3], 0.0))
    pair = [[{**r, "step_s": 1.0 * f} for r in _rows(1.0, 1.0, 0.0)] for f in slow[1:3]]
    fig = bench.figures("maxStaleness 1", sync, pair, max_staleness=1, partial=False)
    assert fig.ratio == pytest.approx(2.0)
    one = bench.figures(
        "maxStaleness 1", bench.phases(_rows(1.0, 1.0, 0.0)), pair[:1], max_staleness=1, partial=False
    )
    assert one.ratio == pytest.approx(2.0 / 1.1)  # one sync run before: the drift reads as a loss


def test_the_first_and_the_last_step_are_not_timed(bench: ModuleType) -> None:
    rows = _rows(1.0, 1.0, 0.1, n=6)
    rows[0]["step_s"] = rows[-1]["step_s"] = 99.0  # start-up; the last step trains alone
    assert bench.phases(rows).step_s == pytest.approx(2.1)


def test_the_old_benchs_regime_is_refused_with_its_reasons(bench: ModuleType) -> None:
    tiny = bench.phases(_rows(0.10, 0.25, 0.04))  # what the 2-token calibration measured
    why = bench.degenerate(tiny, [1.9, 1.9])
    assert any("< 0.5 s" in w for w in why)
    assert any("more than 1.6x apart" in w for w in why)
    loaded = bench.degenerate(bench.phases(_rows(0.9, 0.8, 0.1)), [1.95, 1.2])
    assert loaded == [next(w for w in loaded if "fewer than two free cores" in w)]
    assert bench.degenerate(bench.phases(_rows(0.9, 0.8, 0.1)), [1.95, 1.9]) == []
    scattered = _rows(0.9, 0.8, 0.1)
    for r in scattered[1:-1:2]:
        r["step_s"] *= 2
    assert any("scatter" in w for w in bench.degenerate(bench.phases(scattered), [1.9, 1.9]))


def _probe_grid(bench: ModuleType, gen: Any, train: Any) -> list[Any]:
    return [bench.Probe(p, c, gen(p, c), train(p, c)) for p in bench.GRID_PROMPTS for c in bench.GRID_TOKENS]


def gen_law(p: float, c: float) -> float:  # generation: the longest answer (~ the cap), weakly the batch
    return 0.004 * c**1.2 * p**0.33


def train_law(p: float, c: float) -> float:  # training: every answer's tokens
    return 0.001 * c**0.8 * p**1.5


def test_the_laws_fitted_through_the_probes_are_the_phases_power_laws(bench: ModuleType) -> None:
    laws = bench.PhaseLaws.fit(_probe_grid(bench, gen_law, train_law))
    assert (laws.generation.batch_exponent, laws.generation.cap_exponent) == pytest.approx((0.33, 1.2))
    assert (laws.training.batch_exponent, laws.training.cap_exponent) == pytest.approx((1.5, 0.8))
    assert laws.generation.seconds(20, 100) == pytest.approx(gen_law(20, 100))
    slow = laws.scaled(2.0, 0.5)
    assert slow.generation.seconds(20, 100) == pytest.approx(2 * gen_law(20, 100))
    assert slow.training.seconds(20, 100) == pytest.approx(0.5 * train_law(20, 100))


def test_a_balancing_step_moves_toward_balance_and_no_further_than_its_bound(bench: ModuleType) -> None:
    laws = bench.PhaseLaws.fit(_probe_grid(bench, gen_law, train_law))
    around = (12, 24)
    prompts, tokens = laws.balanced(0.8, around, within=2.0)
    assert 12 / 2 <= prompts <= 12 * 2 and 24 / 2 <= tokens <= 24 * 2
    assert laws.miss(prompts, tokens, 0.8) < laws.miss(*around, 0.8)
    assert (
        bench.MIN_PROMPTS <= prompts <= bench.MAX_PROMPTS and bench.MIN_TOKENS <= tokens <= bench.MAX_TOKENS
    )


def test_the_balance_never_steers_into_steps_the_degenerate_check_refuses(bench: ModuleType) -> None:
    laws = bench.PhaseLaws.fit(_probe_grid(bench, gen_law, train_law))
    prompts, tokens = laws.balanced(0.05, (24, 42), within=4.0)  # a target below MIN_STEP_S
    g, t = laws.generation.seconds(prompts, tokens), laws.training.seconds(prompts, tokens)
    assert max(g, t) >= 1.25 * bench.MIN_STEP_S


class _FakeTimer:
    """The calibration's generation timer (one vLLM engine in the bench), as the law above."""

    def time(self, prompts: int, tokens: int) -> float:
        return gen_law(prompts, tokens)


def test_the_calibration_balances_a_machine_whose_phases_grow_differently_with_the_cap(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Generation grows faster with the cap than training (answers stop at EOS) and training faster
    with the batch: the batch and the cap together balance it, in at most three probes past the grid."""

    def fake_run(cfg: Any, workdir: Any, name: str) -> list[dict[str, float]]:  # the bench's run()
        p, cap = cfg.grpo.prompts_per_step, cfg.lengths.max_response_tokens
        return _rows(gen_law(p, cap), train_law(p, cap), 0.02, n=bench.CALIBRATION_STEPS)

    monkeypatch.setattr(bench, "run", fake_run)
    prompts, tokens, probes, laws = bench.calibrate(tmp_path, _FakeTimer(), target_s=0.8, log=lambda _: None)
    gen, train = gen_law(prompts, tokens), train_law(prompts, tokens)
    assert max(gen, train) / min(gen, train) < 1.15, (prompts, tokens, gen, train)
    assert 0.8 * 0.75 <= max(gen, train) <= 0.8 * 1.25
    assert len(probes) <= len(bench.GRID_PROMPTS) * len(bench.GRID_TOKENS) + 3
    assert laws.training.batch_exponent == pytest.approx(1.5, abs=0.01)


def test_a_ray_run_whose_phases_are_apart_is_moved_along_the_scaled_laws(bench: ModuleType) -> None:
    """The probes (one process) balanced at (18, 144), but on Ray generation took 1.46 s and training
    0.78 s: each law is scaled by its phase's factor, and the point moves where the scaled laws meet."""
    laws = bench.PhaseLaws.fit(_probe_grid(bench, gen_law, train_law))
    sync = bench.phases(_rows(1.46, 0.78, 0.02))
    moved, prompts, tokens = bench.rebalanced(sync, 18, 144, laws, 0.8)
    assert moved.generation.seconds(18, 144) == pytest.approx(1.46)
    assert moved.training.seconds(18, 144) == pytest.approx(0.78)
    g, t = moved.generation.seconds(prompts, tokens), moved.training.seconds(prompts, tokens)
    assert max(g, t) / min(g, t) < 1.46 / 0.78
    assert (prompts, tokens) != (18, 144)


def test_contention_names_the_phases_slowdown_and_what_the_pipeline_hid(bench: ModuleType) -> None:
    alone = bench.Phases(6, 2.0, 1.0, 0.9, 0.05, 1.0, 0.02)  # 0.1 s serial rest
    together = bench.Phases(6, 1.6, 1.1, 1.5, 0.05, 0.0, 0.02)
    line = bench.contention(alone, together)
    assert "generation took x1.10 and training x1.67" in line
    assert line.endswith("would allow a ratio of 1.82")  # (1.0 + 0.9 + 0.1) / (max(1.0, 0.9) + 0.1)


def test_every_correction_of_the_corrections_table_is_a_valid_trainer_config(bench: ModuleType) -> None:
    seen = set()
    for label, grpo in bench.CORRECTIONS:
        g = bench.correction_config(grpo, steps=5, seed=1).grpo
        assert g.max_staleness == 2 and g.learning_rate == 3e-3, label
        eff = g.effective_rollout_correction()
        key = None if eff is None else eff.model_dump_json()
        assert key not in seen, f"{label}: the same correction twice"
        seen.add(key)
    assert None in seen  # the uncorrected baseline is in the table


def test_a_corrections_row_pools_seeds_and_counts_what_the_correction_did(bench: ModuleType) -> None:
    def rows(reward: float, masked: float) -> list[dict[str, float]]:
        return [
            {"mean_reward": reward * (i + 1), "rollout/logprob_diff": 0.1, "rollout_corr/kl": 0.02,
             "rollout/staleness_mean": 2.0, "rollout_corr/rollout_is_oob_ratio": masked}
            for i in range(12)
        ]  # fmt: skip

    row = bench.correction_row("IcePop [0.5, 5]", [rows(0.01, 0.1), rows(0.02, 0.3)])
    assert row["acted_fraction"] == pytest.approx(0.2) and row["kl"] == pytest.approx(0.02)
    assert row["reward_first10"] == pytest.approx(0.015 * 5.5)  # steps 1-10 of both seeds
    assert row["reward_last10"] == pytest.approx(0.015 * 7.5)  # steps 3-12
    table = bench.render_corrections([row], steps=12, seeds=[1, 2])
    assert table.splitlines()[0] == "maxStaleness 2, 12 steps, learning rate 0.003, seeds 1,2:"
    assert "| IcePop [0.5, 5] | 2.00 | 0.1000 | 0.0200 |" in table and "| 0.2000 |" in table

"""What a GPU run's numerics need, on the real trainer in local mode (one rank, the transformers
engine): updates that are finite or skipped, log-probs that match the sampler's top-p, forward-only
passes without dropout, held-out evaluation, and DAPO's dynamic sampling."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from trainer_configs import toy_config

from rljob_trainer import driver, runtimes
from rljob_trainer.train import train_metrics, trainer

pytestmark = [pytest.mark.torch]

# A reward that is finite (the reward check accepts it) but whose group mean overflows float64, so
# the step's advantages and loss are NaN: at the steps listed in BAD_CALLS (calls are steps here).
NAN_REWARD = """
CALLS = [0]
BAD_CALLS = {bad}

def reward(prompts, completions, answers, **kwargs):
    CALLS[0] += 1
    value = 1e308 if CALLS[0] in BAD_CALLS else 0.0
    return [value if i % 2 else 0.5 * value + (i % 3) for i in range(len(completions))]
"""


def _local(**over):
    base = {
        "lengths": {"maxResponseTokens": 3},
        "distributed": {"numTrainerRanks": 1, "launcher": "local"},
        "rollout": {"sharedEngines": 1, "dedicatedEngines": 0},
    }
    grpo = {"learningRate": 1e-2, "maxSteps": 4, "promptsPerStep": 4, "groupSize": 4, **over.pop("grpo", {})}
    return toy_config(**{**base, **over, "grpo": grpo})


def _weights(d: driver.GRPODriver) -> dict[str, torch.Tensor]:
    return d.rt.get(d.rt.submit(d.ranks[0], "engine_weights"))


def _reward_file(tmp_path: Path, bad: set[int]) -> str:
    path = tmp_path / f"nan_reward_{len(bad)}.py"
    path.write_text(NAN_REWARD.format(bad=sorted(bad) or "set()"))
    return str(path)


def test_a_reward_that_makes_the_loss_nan_skips_that_step_and_trains_on(tmp_path: Path) -> None:
    cfg = _local(rewards=[{"name": "module", "path": _reward_file(tmp_path, {2}), "function": "reward"}])
    d = driver.GRPODriver(cfg, runtimes.LocalRuntime(cfg))
    d.setup()
    rows, weights = [], [_weights(d)]
    for _ in range(4):
        rows.append(d.step())
        weights.append(_weights(d))
    d.shutdown()
    assert [r["train/skipped_steps"] for r in rows] == [0, 1, 0, 0]
    assert math.isnan(rows[1]["loss"]) and math.isnan(rows[1]["grad_norm"])  # logged as NaN, not dropped
    assert all(torch.equal(weights[1][k], weights[2][k]) for k in weights[1]), "the NaN step changed weights"
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(rows) if i != 1)
    assert all(torch.isfinite(t).all() for t in weights[-1].values()), "a NaN reached the weights"
    assert any(not torch.equal(weights[2][k], weights[4][k]) for k in weights[2]), "training did not go on"


def test_too_many_skipped_steps_in_a_row_fail_the_run_naming_step_and_metric(tmp_path: Path) -> None:
    cfg = _local(
        grpo={"maxSkippedSteps": 2},
        rewards=[{"name": "module", "path": _reward_file(tmp_path, {2, 3}), "function": "reward"}],
    )
    d = driver.GRPODriver(cfg, runtimes.LocalRuntime(cfg))
    with pytest.raises(train_metrics.TrainingDivergedError, match=r"diverged at step 3: 2 optimizer steps.*"):
        d.run(4)
    d.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_log_probs_apply_top_p_as_the_engine_sampled(dtype: str) -> None:
    cfg = _local(model={"dtype": dtype}, grpo={"topP": 0.8, "temperature": 0.7, "maxSteps": 1})
    d = driver.GRPODriver(cfg, runtimes.LocalRuntime(cfg))
    (m,) = d.run(1)
    d.shutdown()
    print(f"{dtype}: step-1 rollout/logprob_diff {m['rollout/logprob_diff']:.3g} at topP 0.8, T 0.7")
    # Before any update the trainer and the engine hold the same weights: their log-probs of the
    # sampled tokens agree to the dtype's noise (fp32: ~1e-7; bf16: one forward's rounding).
    assert m["rollout/logprob_diff"] < 1e-3, m["rollout/logprob_diff"]
    assert abs(m["off_policy/is_weight_mean"] - 1.0) < (1e-3 if dtype == "float32" else 2e-2)


def test_forward_only_log_probs_run_without_dropout() -> None:
    cfg = _local(model={"finetune": "lora", "lora": {"rank": 4, "alpha": 8, "dropout": 0.5}})
    d = driver.GRPODriver(cfg, runtimes.LocalRuntime(cfg))
    d.run(1)  # one update: the adapters' B is no longer 0, so dropout would change the forward
    rank = d.ranks[0].obj
    samples = [
        trainer.TrainSample((3, 4, 5, 6), (7, 8, 2), 1.0),
        trainer.TrainSample((3, 9, 5, 6), (7, 2), -1.0),
    ]
    first, second = rank.compute_log_probs(samples), rank.compute_log_probs(samples)
    d.shutdown()
    assert first == second, "old/reference log-probs vary from call to call: dropout is on"
    assert rank._parts()[1].training, "the policy goes back to train mode"


def test_held_out_evaluation_every_n_steps_greedy_by_default() -> None:
    cfg = _local(evaluation={"data": {"builtin": "toy-arithmetic"}, "everySteps": 2, "maxSamples": 6})
    d = driver.GRPODriver(cfg, runtimes.LocalRuntime(cfg))
    rows = d.run(4)
    d.shutdown()
    # beforeTraining (default, verl's val_before_train): the initial weights are scored first, as step 0
    assert [(r["step"], "eval/mean_reward" in r) for r in rows] == [
        (0, True),
        (1, False),
        (2, True),
        (3, False),
        (4, True),
    ]
    evals = [r for r in rows if "eval/mean_reward" in r]
    assert all(r["eval/samples"] == 6 and "eval/reward/mathAccuracy" in r for r in evals)
    assert all(0.0 <= r["eval/mean_reward"] <= 1.0 for r in evals)
    reports = {r.step: r for r in d.state.history}
    # the first report carries the evaluation before training (step 0 has no report of its own), so
    # the EVAL column shows from step 1; each later evaluation comes in its own step's report, once
    assert (reports[1].eval_mean_reward, reports[1].eval_step) == (evals[0]["eval/mean_reward"], 0)
    assert (reports[2].eval_mean_reward, reports[2].eval_step) == (evals[1]["eval/mean_reward"], 2)
    assert (reports[3].eval_mean_reward, reports[3].eval_step) == (None, None)


def test_held_out_evaluation_before_training_can_be_turned_off() -> None:
    cfg = _local(
        evaluation={
            "data": {"builtin": "toy-arithmetic"},
            "everySteps": 2,
            "maxSamples": 6,
            "beforeTraining": False,
        }
    )
    d = driver.GRPODriver(cfg, runtimes.LocalRuntime(cfg))
    rows = d.run(2)
    d.shutdown()
    assert [(r["step"], "eval/mean_reward" in r) for r in rows] == [(1, False), (2, True)]


def test_dynamic_sampling_drops_equal_reward_groups_and_refills() -> None:
    cfg = _local(grpo={"dynamicSampling": {"enabled": True, "maxGenerationRounds": 3}, "maxSteps": 2})
    d = driver.GRPODriver(cfg, runtimes.LocalRuntime(cfg))
    rows = d.run(2)
    d.shutdown()
    for r in rows:
        assert r["rollout/generation_rounds"] >= 1 and r["rollout/filtered_groups"] >= 0
        # the batch keeps its size: promptsPerStep groups, informative ones first
        assert len(r["prompt_indices"]) == cfg.grpo.prompts_per_step
    # the toy task starts at ~1/19 accuracy: most groups get all-zero rewards and are dropped
    assert sum(r["rollout/filtered_groups"] for r in rows) > 0
    assert any(r["rollout/generation_rounds"] > 1 for r in rows), "no refill happened"


def test_loss_metrics_are_means_over_the_steps_updates() -> None:
    cfg = _local(grpo={"miniBatchesPerStep": 2, "ppoEpochs": 2, "maxSteps": 1})
    d = driver.GRPODriver(cfg, runtimes.LocalRuntime(cfg))
    (m,) = d.run(1)
    d.shutdown()
    assert len(m["pg_loss_updates"]) == 4
    assert m["pg_loss"] == pytest.approx(sum(m["pg_loss_updates"]) / 4, abs=1e-7)  # not their sum
    for key in ("entropy", "ppo_kl", "pg_clipfrac_ratio_low", "pg_clipfrac_ratio_high", "pg_clipfrac_lower"):
        assert math.isfinite(m[key]), key
    assert m["entropy"] > 0
    assert m["pg_clipfrac"] == pytest.approx(m["pg_clipfrac_ratio_low"] + m["pg_clipfrac_ratio_high"])


def test_the_default_tis_cap_is_the_one_truncated_fraction_counts_against() -> None:
    cfg = _local(grpo={"policyLoss": "clipped-tis"})
    assert cfg.grpo.tis_cap == 2.0
    rank = trainer.TrainingRank(cfg, 0, 1)
    rank.setup("127.0.0.1", 0)
    prompt, response = (3, 4, 5, 6), (7, 8)
    (old,) = rank.compute_log_probs([trainer.TrainSample(prompt, response, 1.0)])
    # the engine sampled these tokens with log-probs 2 below the trainer's: IS weight e^2 > tisCap 2
    sample = trainer.TrainSample(prompt, response, 1.0, rollout_logprobs=tuple(x - 2.0 for x in old))
    stats = rank.train_step([trainer.RankMiniBatch((sample,), 1, len(response))])
    assert stats["is_truncated_tokens"] == len(response), stats["is_truncated_tokens"]


@pytest.mark.parametrize("policy_loss", ["clipped-tis", "gspo-tis"])
def test_a_token_outside_the_trainers_nucleus_trains_finite_in_one_fused_update(policy_loss: str) -> None:
    """The issue's case on the real rank: bf16, topP 0.7, one fused update (old = the training
    forward's own log-probs), a KL reference, and a sampled token outside the trainer's nucleus
    (log-prob -inf on the policy, the old policy and the reference). Before: NaN loss, pg_loss, ppo_kl
    and kl, an infinite logprob_diff. Now every metric is finite, the update steps (not skipped), and
    the token is counted as dropped."""
    cfg = _local(
        model={"dtype": "bfloat16"},
        grpo={"topP": 0.7, "policyLoss": policy_loss, "maxStaleness": 1, "klCoef": 0.1},
    )
    rank = trainer.TrainingRank(cfg, 0, 1)
    rank.setup("127.0.0.1", 0)
    prompt = (3, 4, 5, 6)
    candidates = list(range(2, 19))
    lps = rank.compute_log_probs([trainer.TrainSample(prompt, (t,), 0.0) for t in candidates])
    outside = [t for t, (lp,) in zip(candidates, lps, strict=True) if lp == float("-inf")]
    inside = [t for t, (lp,) in zip(candidates, lps, strict=True) if math.isfinite(lp)]
    assert outside and inside, lps
    samples = (
        trainer.TrainSample(prompt, (outside[0],), 1.0, rollout_logprobs=(-2.5,)),
        trainer.TrainSample(prompt, (inside[0],), -1.0, rollout_logprobs=(-1.0,)),
    )
    stats = rank.train_step([trainer.RankMiniBatch(samples, 2, 2)])
    m = train_metrics.step_training_metrics([stats])
    numbers = {k: v for k, v in m.items() if isinstance(v, float)}
    assert all(math.isfinite(v) for v in numbers.values()), {
        k: v for k, v in numbers.items() if not math.isfinite(v)
    }
    assert stats["skipped_updates"] == 0 and math.isfinite(stats["grad_norm"])
    assert m["out_of_nucleus_fraction"] == pytest.approx(0.5)  # one of the two tokens: dropped
    assert m["rollout/out_of_nucleus_fraction"] == pytest.approx(0.5)
    assert m["rollout/logprob_diff"] == pytest.approx(
        abs(lps[candidates.index(inside[0])][0] + 1.0), abs=2e-2
    )

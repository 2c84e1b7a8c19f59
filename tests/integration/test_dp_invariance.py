"""DP invariance of the real update: `TrainingRank.train_step` on two gloo ranks computes the same
gradient as one rank, with DP balance on or off and micro-batching on or off (<= 1e-6 relative),
through the real loss aggregation, the fp32 gradient all-reduce and the micro-batch planner."""

from __future__ import annotations

import os
import random
import socket
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from trainer_configs import toy_config

from rljob_trainer import driver
from rljob_trainer.train import trainer

pytestmark = [pytest.mark.torch, pytest.mark.slow]

WORLD = 2
# (dpBalance, dynamic micro-batches with a small token budget: several micro-batches per rank)
VARIANTS = [(False, False), (True, False), (False, True), (True, True)]


def _cfg(world: int, dp_balance: bool, micro: bool) -> Any:
    budget = 24 if micro else 4096
    return toy_config(
        model={"dtype": "float32"},
        grpo={"groupSize": 4, "promptsPerStep": 6, "gradClip": 1e12, "learningRate": 1e-3},
        batching={"packed": True, "dynamic": True, "maxTokensPerMicroBatch": budget, "dpBalance": dp_balance},
        distributed={"numTrainerRanks": world, "launcher": "ray", "torchThreadsPerRank": 1},
    )


def _samples() -> list[trainer.TrainSample]:
    rng = random.Random(5)
    out = []
    for i in range(24):  # skewed lengths, so DP balance reorders
        prompt = tuple(rng.randrange(3, 32) for _ in range(rng.choice([3, 4, 12, 15])))
        response = tuple(rng.randrange(3, 32) for _ in range(rng.choice([1, 2, 6])))
        out.append(trainer.TrainSample(prompt, response, rng.uniform(-1.5, 1.5) if i % 5 else 0.0))
    return out


def _gradient(rank: trainer.TrainingRank, mini_batch: trainer.RankMiniBatch) -> torch.Tensor:
    model, _, optimizer = rank._parts()
    params = [p for p in model.parameters() if p.requires_grad]
    seen: list[torch.Tensor] = []
    step = optimizer.step

    def capture(*args: Any, **kwargs: Any) -> Any:  # the reduced, clipped fp32 gradient the step uses
        seen.append(torch.cat([p.grad.reshape(-1) for p in params]).clone())
        return step(*args, **kwargs)

    optimizer.step = capture  # type: ignore[method-assign]
    stats = rank.train_step([mini_batch])
    assert stats["skipped_updates"] == 0 and len(seen) == 1
    return seen[0]


def _shards(cfg: Any, samples: list[trainer.TrainSample], world: int) -> list[trainer.RankMiniBatch]:
    import rljob_trainer.dp_balance as dp

    lengths = [s.length for s in samples]
    shards, _ = driver.shard_for_ranks(
        lengths,
        world,
        spec=trainer.micro_batch_spec(cfg.batching),
        cost=dp.CostModel.from_hf_config(cfg.model.hf_config),
        enabled=cfg.batching.dp_balance,
    )
    n_resp = sum(len(s.response_ids) for s in samples)
    return [trainer.RankMiniBatch(tuple(samples[i] for i in shard), len(samples), n_resp) for shard in shards]


def _worker(rank_id: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    results = {}
    for dp_balance, micro in VARIANTS:
        cfg = _cfg(WORLD, dp_balance, micro)
        rank = trainer.TrainingRank(cfg, rank_id, WORLD)
        rank.setup("127.0.0.1", port)
        shards = _shards(cfg, _samples(), WORLD)
        results[(dp_balance, micro)] = (
            _gradient(rank, shards[rank_id]),
            [s.length for s in shards[rank_id].samples],
        )
    torch.save(results, Path(out_dir) / f"rank{rank_id}.pt")
    rank.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_train_step_gradient_is_the_same_on_two_ranks_with_balance_and_micro_batching_on_or_off() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = _cfg(1, False, False)
    one = trainer.TrainingRank(cfg, 0, 1)
    one.setup("127.0.0.1", 0)
    samples = _samples()
    reference = _gradient(
        one, trainer.RankMiniBatch(tuple(samples), len(samples), sum(len(s.response_ids) for s in samples))
    )
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(_free_port(), out_dir), nprocs=WORLD, join=True)
        ranks = [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    assert reference.abs().max() > 0
    for variant in VARIANTS:
        grads = [r[variant][0] for r in ranks]
        torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)  # one all-reduced gradient
        rel = float((grads[0] - reference).norm() / reference.norm())
        print(f"dpBalance={variant[0]} microBatching={variant[1]}: relative difference {rel:.2e}")
        assert rel <= 1e-6, (variant, rel)
    # The variants are not vacuous: balance moved samples between ranks, the small budget split them.
    assert sorted(ranks[0][(True, False)][1]) != sorted(ranks[0][(False, False)][1])

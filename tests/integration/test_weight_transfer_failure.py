"""A weight transfer that fails half-way, on the real driver with real Ray (issue 21, item 4): rank 0
broadcasts each sync over every dedicated engine's own gloo group while the engines receive; one engine
fails in the middle of its receive (it has the header and manifest, then its loader raises, as a vLLM
engine whose `update_weights` no longer takes rljob's arguments raises TypeError; or it stops there, as
one stuck on a dead NCCL peer). That engine and its group are dropped and its pod reported in
`lostRolloutPods`, the other engine takes the weights, rank 0 returns (every transfer wait is bounded
by rollout.engineTimeoutS), and training goes on; the pod's engine rejoins at the next sync.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from trainer_configs import toy_config

from rljob_trainer import driver, runtimes
from rljob_trainer.weights import weight_sync

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.ray]

TIMEOUT_S = 5.0


def _cfg() -> Any:
    return toy_config(
        grpo={
            "maxSteps": 20,
            "promptsPerStep": 4,
            "maxStaleness": 1,
            "policyLoss": "clipped-tis",
            "tisCap": 2.0,
        },
        rollout={
            "sharedEngines": 0,
            "dedicatedEngines": 2,
            "maxDedicatedEngines": 2,
            "engineTimeoutS": TIMEOUT_S,
        },
        distributed={"numTrainerRanks": 1, "launcher": "ray", "rankNumCpus": 0.25},
    )


class _FailingHost(runtimes.Host):
    """`Host` whose engine `dedicated-1` fails inside its second weight receive (the first sync after
    it joined): the header and manifest arrive, then its loader raises or blocks. Only the first actor
    of that name fails (the marker file is shared by every process); its replacement is healthy."""

    marker: ClassVar[str] = ""
    mode: ClassVar[str] = "raise"

    def __init__(self, kind: str, cfg: Any, **kwargs: Any) -> None:
        super().__init__(kind, cfg, **kwargs)
        self._name = kwargs.get("name")
        self._receives = 0

    def receive_engine_weights(self) -> int:
        self._receives += 1
        marker = Path(self.marker)
        if self._name == "dedicated-1" and self._receives == 2 and not marker.exists():
            marker.write_text(repr(time.time()))
            (group,) = self._groups.values()

            def load(items: list[tuple[str, Any]]) -> None:
                if self.mode == "raise":
                    raise TypeError(
                        "update_weights() got an unexpected keyword argument 'is_checkpoint_format'"
                    )
                while True:
                    time.sleep(3600)

            weight_sync.receive_weights(group, load)
        return super().receive_engine_weights()


def ray_node_config() -> Any:
    """The private Ray node's size (the `ray_node` fixture, tests/integration/conftest.py)."""
    return _cfg()


@pytest.fixture
def failing_driver(
    request: pytest.FixtureRequest, ray_node: None, tmp_path: Path
) -> Iterator[driver.GRPODriver]:
    import ray

    host = type("FailingHost", (_FailingHost,), {"marker": str(tmp_path / "failed"), "mode": request.param})
    cfg = _cfg()
    d = driver.GRPODriver(cfg, runtimes.RayRuntime(cfg, host_cls=host))
    try:
        d.setup()
        yield d
    finally:
        d.shutdown()
        for eng in d.engines.values():
            ray.kill(eng.handle)
        for rank in d.ranks:
            ray.kill(rank)


@pytest.mark.timeout(240, func_only=True)  # a driver or rank 0 that waits forever fails the test
@pytest.mark.parametrize("failing_driver", ["raise", "hang"], indirect=True)
def test_an_engine_failing_mid_transfer_is_dropped_and_the_others_go_on(
    failing_driver: driver.GRPODriver,
) -> None:
    d = failing_driver
    assert sorted(d.engines) == ["dedicated-0", "dedicated-1"]
    dropped: list[tuple[str, bool, float]] = []
    drop = d.drop_engine

    def watch_drop(name: str, *, lost: bool = False) -> None:
        dropped.append((name, lost, time.time()))
        drop(name, lost=lost)

    d.drop_engine = watch_drop  # type: ignore[method-assign]
    t0 = time.time()
    first = d.step()  # its sync point is dedicated-1's second receive
    assert first["step"] == 1
    assert [name for name, lost, _ in dropped if lost] == ["dedicated-1"]
    # Dropped within the transfer's bound, not after an unbounded wait.
    assert dropped[0][2] - t0 <= 120
    assert d.state.history[-1].lost_rollout_pods == [1]
    # The other engine took the new weights in the same sync.
    assert d.engines["dedicated-0"].version == d.weights_version == 1
    assert d.step()["step"] == 2
    # Pod 1 is alive: a new engine joined with the current weights; the loss was reported once.
    assert "dedicated-1" in d.engines and d.engines["dedicated-1"].version == d.weights_version
    assert [p for r in d.state.history for p in r.lost_rollout_pods] == [1]

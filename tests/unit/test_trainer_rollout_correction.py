"""Unit tests for rljob_trainer.train.rollout_correction: every importance-sampling mode, level and
rejection agrees with its slow reference, the metrics with theirs, and each does what its source
says (TIS truncates, masked IS and IcePop zero out of bounds, rejection keeps 0/1, the sequence
level multiplies and the geometric level averages). verl's own code on the same tensors: tests/peer/."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rljob_trainer.train import rollout_correction as rc

pytestmark = pytest.mark.torch

logps = st.floats(-6.0, 0.0, allow_nan=False)
rows = st.lists(
    st.tuples(logps, logps, st.integers(0, 3), st.sampled_from([0.0, 1.0, 1.0])), min_size=1, max_size=30
)
corrections = st.builds(
    rc.Correction,
    is_level=st.sampled_from([None, "token", "sequence", "geometric"]),
    is_mode=st.sampled_from(["truncate", "mask"]),
    is_lower=st.sampled_from([None, 0.2, 0.5]),
    is_upper=st.sampled_from([1.5, 2.0, 5.0]),
    reject_level=st.sampled_from([None, "token", "sequence", "geometric"]),
    reject_lower=st.sampled_from([None, 0.3]),
    reject_upper=st.sampled_from([1.2, 3.0]),
)


def _seq_ids(raw: list[int]) -> list[int]:
    """Sequence ids numbered from 0 in order of appearance, as the trainer numbers them."""
    order: dict[int, int] = {}
    return [order.setdefault(s, len(order)) for s in raw]


@settings(max_examples=200, deadline=None)
@given(rows, corrections)
def test_weights_match_the_reference(data: list[tuple[float, float, int, float]], c: rc.Correction) -> None:
    old, roll, seq, mask = (list(col) for col in zip(*data, strict=True))
    seq = _seq_ids(seq)
    fast = rc.correction_weights(
        torch.tensor(old, dtype=torch.float64),
        torch.tensor(roll, dtype=torch.float64),
        torch.tensor(mask, dtype=torch.float64),
        torch.tensor(seq),
        c,
    )["weight"]
    slow = rc.correction_weights_reference(old, roll, mask, seq, c)
    assert fast.tolist() == pytest.approx(slow, rel=1e-9, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(logps, logps, st.integers(0, 3)), min_size=1, max_size=30))
def test_mismatch_metrics_match_the_reference(data: list[tuple[float, float, int]]) -> None:
    old, roll, seq = (list(col) for col in zip(*data, strict=True))
    seq = _seq_ids(seq)
    sums = rc.correction_sums(
        torch.tensor(old, dtype=torch.float64),
        torch.tensor(roll, dtype=torch.float64),
        torch.ones(len(old), dtype=torch.float64),
        torch.tensor(seq),
        None,
    )
    fast = rc.correction_metrics({k: float(v) for k, v in sums.items()})
    for name, value in rc.correction_metrics_reference(old, roll, seq).items():
        assert fast[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name


def test_each_mode_and_level_known_values() -> None:
    # ratios π_old/π_rollout per token: seq 0 = (3, 0.25), seq 1 = (1.5,)
    old = torch.tensor([math.log(3.0), math.log(0.25), math.log(1.5)], dtype=torch.float64)
    roll = torch.zeros(3, dtype=torch.float64)
    seq, mask = torch.tensor([0, 0, 1]), torch.ones(3, dtype=torch.float64)

    def weight(**kw: object) -> list[float]:
        return rc.correction_weights(old, roll, mask, seq, rc.Correction(**kw))["weight"].tolist()  # type: ignore[arg-type]

    assert weight() == pytest.approx([2.0, 0.25, 1.5])  # token TIS at 2
    assert weight(is_level="sequence") == pytest.approx([0.75, 0.75, 1.5])  # Π: 3 x 0.25
    assert weight(is_level="geometric") == pytest.approx([math.sqrt(0.75)] * 2 + [1.5])
    assert weight(is_mode="mask", is_lower=0.5, is_upper=2.0) == pytest.approx([0.0, 0.0, 1.5])  # IcePop
    assert weight(is_mode="mask", is_upper=5.0) == pytest.approx([3.0, 0.25, 1.5])  # lower 1/5
    assert weight(is_level=None, reject_level="token", reject_upper=2.0) == [0.0, 0.0, 1.0]
    assert weight(is_level=None, reject_level="sequence", reject_upper=2.0) == [1.0, 1.0, 1.0]
    assert weight(is_level=None, reject_level="geometric", reject_lower=0.9, reject_upper=1.1) == [
        0.0,
        0.0,
        0.0,
    ]
    assert weight(reject_level="sequence", reject_lower=0.8) == pytest.approx([0.0, 0.0, 1.5])


def test_weights_are_detached_and_metrics_count_what_each_drops() -> None:
    old = torch.tensor([math.log(3.0), 0.0, math.log(0.25)], requires_grad=True)
    roll = torch.zeros(3)
    c = rc.Correction(
        is_mode="mask", is_lower=0.5, is_upper=2.0, reject_level="token", reject_lower=0.2, reject_upper=2.5
    )
    w = rc.correction_weights(old, roll, torch.ones(3), torch.tensor([0, 0, 1]), c)["weight"]
    assert not w.requires_grad
    sums = rc.correction_sums(old, roll, torch.ones(3), torch.tensor([0, 0, 1]), c)
    m = rc.correction_metrics({k: float(v) for k, v in sums.items()})
    assert m["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(2 / 3)  # 3 and 0.25 out of [0.5, 2]
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 3)  # 3 above 2.5
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)


def test_bad_settings_are_refused_naming_what_to_fix() -> None:
    with pytest.raises(ValueError, match="0 < lower <= upper"):
        rc.Correction(is_mode="mask", is_lower=3.0, is_upper=2.0)
    with pytest.raises(ValueError, match="is_level must be one of"):
        rc.Correction(is_level="batch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown importance-sampling mode"):
        rc.get_is_mode("clip")

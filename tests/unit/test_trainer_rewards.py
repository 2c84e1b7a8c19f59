"""Unit tests for rljob_trainer.rewards (pure string functions)."""

from __future__ import annotations

import sys

import pytest

from rljob_trainer import config, rewards


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so 3 + 4 = 7\n#### 7", "7"),
        ("#### 1,234 dollars", "1,234"),
        ("first 2 then \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
        ("the answer is 12 or maybe 13", "13"),
        ("no digits here", None),
        ("-5 is it", "-5"),
    ],
)
def test_extract_final_answer(text, expected):
    assert rewards.extract_final_answer(text) == expected


def test_math_accuracy_compares_final_answers():
    assert rewards.math_accuracy("q", "7", "7") == 1.0
    assert rewards.math_accuracy("q", "it is 7.0", "3 + 4\n#### 7") == 1.0
    assert rewards.math_accuracy("q", "#### 1,000", "1000") == 1.0
    assert rewards.math_accuracy("q", "77", "7") == 0.0
    assert rewards.math_accuracy("q", "", "7") == 0.0
    assert rewards.math_accuracy("q", "\\boxed{x+1}", "\\boxed{x+1}") == 1.0


def test_format_reward():
    assert rewards.format_reward("q", " 42 ", "") == 1.0
    assert rewards.format_reward("q", "work... #### 42", "") == 1.0
    assert rewards.format_reward("q", "so \\boxed{42}", "") == 1.0
    assert rewards.format_reward("q", "4+2", "") == 0.0


def test_registry_lists_valid_names():
    with pytest.raises(ValueError, match="format, mathAccuracy"):
        rewards.get_reward_fn("nope")


def test_weighted_reward_with_user_module(tmp_path, monkeypatch):
    (tmp_path / "my_reward_mod.py").write_text(
        "def short(prompt, response, answer):\n    return 1.0 if len(response) <= 2 else 0.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    settings = [
        config.RewardFunctionSettings(name="mathAccuracy", weight=1.0),
        config.RewardFunctionSettings(name="format", weight=0.5),
        config.RewardFunctionSettings(name="module", module="my_reward_mod", function="short", weight=0.25),
    ]
    fn = rewards.build_reward_fn(settings)
    total, parts = fn.score("3+4=", "7", "7")
    assert parts == {"mathAccuracy": 1.0, "format": 1.0, "my_reward_mod:short": 1.0}
    assert total == pytest.approx(1.75)
    total, _ = fn.score("3+4=", "8 no", "7")
    assert total == 0.0
    with pytest.raises(ValueError, match="no callable"):
        rewards.load_user_reward("my_reward_mod", "missing")
    sys.modules.pop("my_reward_mod", None)

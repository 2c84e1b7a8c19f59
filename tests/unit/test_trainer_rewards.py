"""Unit tests for rljob_trainer.data.rewards (pure string functions)."""

from __future__ import annotations

import sys

import pytest

from rljob_trainer import config
from rljob_trainer.data import rewards


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


def test_weighted_reward_with_user_modules_by_import_path_and_by_file(tmp_path, monkeypatch):
    # One batch signature, as the CRD documents: fn(prompts, completions, answers, **kwargs).
    (tmp_path / "my_reward_mod.py").write_text(
        "CALLS = []\n"
        "def short(prompts, completions, answers, **kwargs):\n"
        "    CALLS.append(len(completions))\n"
        "    return [1.0 if len(c) <= 2 else 0.0 for c in completions]\n"
    )
    other = tmp_path / "mounted" / "reward.py"
    other.parent.mkdir()
    other.write_text(
        "def exact(prompts, completions, answers, **kwargs):\n"
        "    return [float(c == a) for c, a in zip(completions, answers)]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    settings = [
        config.RewardFunctionSettings(name="mathAccuracy", weight=1.0),
        config.RewardFunctionSettings(name="format", weight=0.5),
        config.RewardFunctionSettings(
            name="module", import_path="my_reward_mod", function="short", weight=0.25
        ),
        config.RewardFunctionSettings(name="module", path=str(other), function="exact", weight=2.0),
    ]
    fn = rewards.build_reward_fn(settings)
    totals, parts = fn.score_batch(["3+4=", "3+4="], ["7", "8 no"], ["7", "7"])
    assert parts == {
        "mathAccuracy": [1.0, 0.0],
        "format": [1.0, 0.0],
        "my_reward_mod:short": [1.0, 0.0],
        "reward:exact": [1.0, 0.0],  # the file's stem: a tracker refuses a path as a metric name
    }
    assert fn.names[3] == f"{other}:exact"  # errors still name the file
    assert totals == [pytest.approx(3.75), 0.0]
    assert sys.modules["my_reward_mod"].CALLS == [2]  # called once with the whole batch
    with pytest.raises(ValueError, match="no callable"):
        rewards.load_user_reward(import_path="my_reward_mod", function="missing")
    with pytest.raises(ValueError, match=r"not a \.py file"):
        rewards.load_user_reward(path=str(tmp_path / "absent.py"), function="exact")
    sys.modules.pop("my_reward_mod", None)


def test_a_failing_reward_names_its_module_and_the_exception(tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text(
        "def boom(prompts, completions, answers, **kwargs):\n    raise KeyError('no such field')\n"
        "def short_list(prompts, completions, answers, **kwargs):\n    return [1.0]\n"
    )
    fn = rewards.build_reward_fn(
        [config.RewardFunctionSettings(name="module", path=str(bad), function="boom")]
    )
    with pytest.raises(rewards.RewardError, match=r"bad_reward.py:boom raised KeyError: 'no such field'"):
        fn.score_batch(["p", "q"], ["a", "b"], ["x", "y"])
    fn = rewards.build_reward_fn(
        [config.RewardFunctionSettings(name="module", path=str(bad), function="short_list")]
    )
    with pytest.raises(rewards.RewardError, match="must return 2 finite floats"):
        fn.score_batch(["p", "q"], ["a", "b"], ["x", "y"])

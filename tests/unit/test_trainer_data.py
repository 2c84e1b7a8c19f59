"""Unit tests for rljob_trainer.data (datasets shipped with the package, resumable sampler)."""

from __future__ import annotations

import pytest

from rljob_trainer import config, data, rewards


def test_builtin_datasets_load_and_are_verifiable():
    assert {"toy-arithmetic", "gsm8k-sample"} <= set(data.builtin_datasets())
    toy = data.load_examples(config.DataSettings(builtin="toy-arithmetic"))
    assert len(toy) == 55 and toy[0] == data.Example("0+0=", "0")
    for ex in toy:
        a, b = ex.prompt.rstrip("=").split("+")
        assert int(a) + int(b) == int(ex.answer) <= 9
    gsm = data.load_examples(config.DataSettings(builtin="gsm8k-sample"))
    for ex in gsm:  # the reference solution is scored correct by our own reward
        assert rewards.math_accuracy(ex.prompt, ex.answer, ex.answer) == 1.0
    with pytest.raises(ValueError, match="toy-arithmetic"):
        data.load_examples(config.DataSettings(builtin="nope"))


def test_jsonl_path_with_custom_fields(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"q": "1+1=", "a": "2"}\n\n{"q": "2+2=", "a": "4"}\n')
    ex = data.load_examples(config.DataSettings(path=str(p), prompt_field="q", answer_field="a"))
    assert ex == [data.Example("1+1=", "2"), data.Example("2+2=", "4")]
    p.write_text('{"q": "1+1="}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:1: missing field 'a'"):
        data.load_examples(config.DataSettings(path=str(p), prompt_field="q", answer_field="a"))


def test_sampler_is_deterministic_and_resumable():
    kw = {"num_examples": 7, "seed": 3, "shuffle": True}
    all_idx, end = data.next_prompts(data.SamplerState(), 20, **kw)
    # Resuming from any saved state continues the same sequence.
    first, mid = data.next_prompts(data.SamplerState(), 9, **kw)
    rest, end2 = data.next_prompts(data.SamplerState.from_dict(mid.to_dict()), 11, **kw)
    assert first + rest == all_idx and end2 == end
    # Each epoch is a permutation; epochs differ.
    assert sorted(all_idx[:7]) == list(range(7)) and sorted(all_idx[7:14]) == list(range(7))
    assert all_idx[:7] != all_idx[7:14]
    assert data.next_prompts(data.SamplerState(), 3, num_examples=5, seed=0, shuffle=False)[0] == [0, 1, 2]

"""Unit tests for rljob_trainer.data.sources (datasets shipped with the package, resumable sampler)."""

from __future__ import annotations

import pytest

from rljob_trainer import config
from rljob_trainer.data import rewards, sources


def test_builtin_datasets_load_and_are_verifiable():
    assert {"toy-arithmetic", "gsm8k-sample"} <= set(sources.builtin_datasets())
    toy = sources.load_examples(config.DataSettings(builtin="toy-arithmetic"))
    assert len(toy) == 55 and toy[0] == sources.Example("0+0=", "0")
    for ex in toy:
        a, b = ex.prompt.rstrip("=").split("+")
        assert int(a) + int(b) == int(ex.answer) <= 9
    gsm = sources.load_examples(config.DataSettings(builtin="gsm8k-sample"))
    for ex in gsm:  # the reference solution is scored correct by our own reward
        assert rewards.math_accuracy(ex.prompt, ex.answer, ex.answer) == 1.0
    with pytest.raises(ValueError, match="toy-arithmetic"):
        sources.load_examples(config.DataSettings(builtin="nope"))


def test_jsonl_path_with_custom_fields(tmp_path):
    p = tmp_path / "d.jsonl"
    pytest.importorskip("datasets")
    p.write_text('{"q": "1+1=", "a": "2"}\n{"q": "2+2=", "a": "4"}\n')
    ex = sources.load_examples(config.DataSettings(path=str(p), prompt_field="q", answer_field="a"))
    assert ex == [sources.Example("1+1=", "2"), sources.Example("2+2=", "4")]
    p.write_text('{"q": "1+1="}\n')
    with pytest.raises(ValueError, match=r"d.jsonl: no field 'a'; the records have \['q'\]"):
        sources.load_examples(config.DataSettings(path=str(p), prompt_field="q", answer_field="a"))


ROWS = {"question": ["1+1=", "2+3=", "4+4="], "answer": ["#### 2", "#### 5", "#### 8"]}
WANT = [sources.Example(q, a) for q, a in zip(ROWS["question"], ROWS["answer"], strict=True)]


def _settings(**kw):
    return config.DataSettings(builtin=None, prompt_field="question", answer_field="answer", **kw)


@pytest.mark.parametrize("suffix", [".parquet", ".arrow", ".json", ".jsonl"])
def test_data_files_of_every_format_made_on_the_fly(tmp_path, suffix):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(ROWS)
    path = tmp_path / f"train{suffix}"
    if suffix == ".parquet":
        ds.to_parquet(str(path))
    elif suffix == ".arrow":
        import pyarrow as pa

        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, ds.data.table.schema) as writer:
            writer.write_table(ds.data.table)
    elif suffix == ".json":
        import json

        path.write_text(
            json.dumps([dict(zip(ROWS, r, strict=True)) for r in zip(*ROWS.values(), strict=True)])
        )
    else:
        ds.to_json(str(path), lines=True)
    assert sources.load_examples(_settings(path=str(path))) == WANT


def test_a_directory_of_files_and_a_save_to_disk_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(ROWS)
    folder = tmp_path / "shards"
    folder.mkdir()
    ds.select([0, 1]).to_parquet(str(folder / "part-0.parquet"))
    ds.select([2]).to_parquet(str(folder / "part-1.parquet"))
    assert sources.load_examples(_settings(path=str(folder))) == WANT
    ds.save_to_disk(str(tmp_path / "saved"))
    assert sources.load_examples(_settings(path=str(tmp_path / "saved"))) == WANT
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dict"))
    assert sources.load_examples(_settings(path=str(tmp_path / "dict"), hub_split="test")) == WANT[:1]
    (folder / "extra.jsonl").write_text('{"question": "x", "answer": "y"}\n')
    with pytest.raises(ValueError, match="mixes formats"):
        sources.load_examples(_settings(path=str(folder)))
    with pytest.raises(ValueError, match="does not exist"):
        sources.load_examples(_settings(path=str(tmp_path / "nope")))


def test_hub_path_reads_through_load_dataset_with_subset_and_split(tmp_path):
    """No network in tests: the hub loader (`datasets.load_dataset(id, subset, split=...)`) is
    exercised on a local dataset folder laid out as on the hub, with a subset and two splits."""
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(ROWS)
    repo = tmp_path / "gsm8k"
    (repo / "main").mkdir(parents=True)
    ds.to_parquet(str(repo / "main" / "train-00000-of-00001.parquet"))
    ds.select([1]).to_parquet(str(repo / "main" / "test-00000-of-00001.parquet"))
    (repo / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train-*\n"
        "  - split: test\n    path: main/test-*\n---\n"
    )
    got = sources.load_examples(_settings(hub_id=str(repo), hub_subset="main", hub_split="test"))
    assert got == WANT[1:2]
    assert sources.load_examples(_settings(hub_id=str(repo), hub_subset="main")) == WANT


def test_chat_template_wraps_prompts_as_a_user_message():
    from rljob_trainer.model import modeling

    settings = config.ModelSettings(
        name="t", source="tiny", hf_config={"model_type": "qwen2"}, tokenizer="builtin-char"
    )
    tok = modeling.load_tokenizer(settings)
    raw = sources.encode_prompt(tok, "1+1=", chat_template=False)
    chat = sources.encode_prompt(tok, "1+1=", chat_template=True)
    assert tok.decode(raw) == "1+1=" and tok.decode(chat) == "user: 1+1=\nassistant: "
    digits = modeling.load_tokenizer(settings.model_copy(update={"tokenizer": "builtin-digits"}))
    with pytest.raises(ValueError, match="chatTemplate"):
        sources.encode_prompt(digits, "1+1=", chat_template=True)


def test_sampler_is_deterministic_and_resumable():
    kw = {"num_examples": 7, "seed": 3, "shuffle": True}
    all_idx, end = sources.next_prompts(sources.SamplerState(), 20, **kw)
    # Resuming from any saved state continues the same sequence.
    first, mid = sources.next_prompts(sources.SamplerState(), 9, **kw)
    rest, end2 = sources.next_prompts(sources.SamplerState.from_dict(mid.to_dict()), 11, **kw)
    assert first + rest == all_idx and end2 == end
    # Each epoch is a permutation; epochs differ.
    assert sorted(all_idx[:7]) == list(range(7)) and sorted(all_idx[7:14]) == list(range(7))
    assert all_idx[:7] != all_idx[7:14]
    assert sources.next_prompts(sources.SamplerState(), 3, num_examples=5, seed=0, shuffle=False)[0] == [
        0,
        1,
        2,
    ]


def test_overlong_prompts_are_dropped_and_counted_never_cut() -> None:
    exs = [sources.Example("a", "1"), sources.Example("bb", "2"), sources.Example("c", "3")]
    kept, dropped = sources.drop_overlong_prompts(exs, [3, 9, 4], max_prompt_tokens=4, source="s")
    assert kept == [exs[0], exs[2]] and dropped == [1]
    with pytest.raises(
        ValueError, match=r"every prompt is longer than lengths.maxPromptTokens \(2\): row 0 has 3"
    ):
        sources.drop_overlong_prompts(exs, [3, 9, 4], max_prompt_tokens=2, source="s")

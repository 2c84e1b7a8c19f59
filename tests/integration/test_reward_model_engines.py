"""A judge of kind rewardModel on real engines: a sequence-classification model's score of each
sequence on vLLM's CPU build (its pooling runner) and on the transformers engine is Hugging Face's
own model's score on the same weights, at each sequence's last token, whatever the batch; a response
that ends with the tokenizer's pad token (the EOS of many tokenizers) is still scored at that token;
a head of two labels is refused naming the field; and the driver trains with it as its judge.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from rljob_trainer import config  # noqa: E402
from rljob_trainer.data import judge  # noqa: E402
from rljob_trainer.engines import reward_model  # noqa: E402
from rljob_trainer.model import modeling  # noqa: E402

pytestmark = [pytest.mark.torch]

TOK = modeling.build_char_tokenizer(modeling.CHARSETS["builtin-char"])
TOK.chat_template = modeling.CHAR_CHAT_TEMPLATE
# Heads of 32: a size vLLM's CPU attention takes.
HF = {**modeling.tiny_hf_config(len(TOK), model_type="llama"), "pad_token_id": TOK.eos_token_id}


def _model_settings(**over: Any) -> dict[str, Any]:
    return {
        "name": "tiny-rm",
        "source": "tiny",
        "hfConfig": HF,
        "tokenizer": "builtin-char",
        "dtype": "float32",
        **over,
    }


def _engine_cfg(kind: str, model: dict[str, Any]) -> config.TrainerConfig:
    """A judge engine's config (`judge.judge_engine_config`), as the trainer builds it."""
    cfg = config.parse_config(
        {
            "model": _model_settings(name="policy"),
            "lengths": {"maxPromptTokens": 16, "maxResponseTokens": 8},
            "rollout": {"kind": kind},
            "judge": {
                "kind": "rewardModel",
                "model": model,
                "maxModelLen": 128,
                "maxNumSeqs": 8,
                "maxNumBatchedTokens": 256,
                "cpuKvCacheBytes": 32 << 20,
            },
        }
    )
    return judge.judge_engine_config(cfg)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny reward model as a folder, as a `source: pvc` model is found (random weights)."""
    out = tmp_path_factory.mktemp("tiny-rm")
    model = modeling.build_reward_model(config.ModelSettings(**_model_settings()), init_seed=3)
    assert model.config.num_labels == 1 and type(model).__name__ == "LlamaForSequenceClassification"
    model.save_pretrained(out)
    TOK.save_pretrained(out)
    return out


def _sequences() -> list[list[int]]:
    convo = judge.conversation_ids(TOK, "What is 2+3?", "5")
    return [
        convo,
        judge.conversation_ids(TOK, "Name a colour.", "blue, or maybe a long green answer"),
        [*convo, TOK.eos_token_id],  # ends with the pad token (pad is EOS here)
        [5, 6, 7],
    ]


def _reference(model_dir: Path, sequences: list[list[int]]) -> list[float]:
    """Hugging Face's model, one sequence at a time and no pad token (so its last token is scored)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.config.pad_token_id = None
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([s])).logits[0, 0]) for s in sequences]


def test_the_transformers_reward_model_scores_as_hugging_face_at_the_last_token(model_dir: Path) -> None:
    cfg = _engine_cfg(
        "transformers", {"name": "rm", "source": "pvc", "path": str(model_dir), "dtype": "float32"}
    )
    engine = reward_model.TransformersRewardModel(cfg, name="judge-0")
    engine.load()
    seqs = _sequences()
    want = _reference(model_dir, seqs)
    got = engine.score(seqs)
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(v, 4) for v in got)) == len(
        got
    )  # a real head: different sequences, different scores
    # Padding in a batch changes nothing: each sequence alone scores the same.
    assert [engine.score([s])[0] for s in seqs] == pytest.approx(got, abs=1e-5)
    # Hugging Face's own batching scores the EOS-ended response at its last non-pad token instead.
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_eos = float(hf(input_ids=torch.tensor([seqs[2]])).logits[0, 0])
    assert hf_eos == pytest.approx(want[0], abs=1e-5) and hf_eos != pytest.approx(got[2], abs=1e-4)


def test_a_head_of_two_labels_is_refused_naming_the_field(tmp_path: Path) -> None:
    two = {**HF, "id2label": {"0": "bad", "1": "good"}}
    model = modeling.build_reward_model(config.ModelSettings(**_model_settings(hfConfig=two)), init_seed=0)
    model.save_pretrained(tmp_path)
    TOK.save_pretrained(tmp_path)
    cfg = _engine_cfg("transformers", {"name": "rm", "source": "pvc", "path": str(tmp_path)})
    with pytest.raises(ValueError, match=r"judge\.model has a classification head of 2 labels"):
        reward_model.TransformersRewardModel(cfg, name="judge-0").load()


@pytest.mark.vllm
@pytest.mark.slow
def test_vllms_pooling_runner_scores_as_hugging_face(model_dir: Path) -> None:
    pytest.importorskip("vllm")
    cfg = _engine_cfg("vllm", {"name": "rm", "source": "pvc", "path": str(model_dir), "dtype": "float32"})
    engine = reward_model.VLLMRewardModel(cfg, name="judge-0")
    report = engine.load()
    try:
        assert report["engine"] == "vllm" and report["device_type"] == "cpu"
        seqs = _sequences()
        got = engine.score(seqs)
        # The raw logit (no sigmoid), at the last token, EOS-ended sequence included.
        assert got == pytest.approx(_reference(model_dir, seqs), abs=1e-4)
        assert engine.score(seqs[::-1]) == pytest.approx(got[::-1], abs=1e-4)
    finally:
        engine.shutdown()


def test_the_driver_trains_with_a_reward_model_judge(tmp_path: Path) -> None:
    """The toy task with a tiny reward model as its judge on the transformers engine: every response
    of every step is scored, its reward part is the engine's score times the weight."""
    from trainer_configs import toy_config

    from rljob_trainer import driver, runtimes

    cfg = toy_config(
        distributed={"numTrainerRanks": 1, "launcher": "local"},
        rollout={"sharedEngines": 0},
        grpo={"groupSize": 4, "promptsPerStep": 2, "maxSteps": 2},
        judge={"kind": "rewardModel", "model": _model_settings(), "weight": 0.5, "batchSize": 3},
    )
    d = driver.GRPODriver(cfg, runtimes.LocalRuntime(cfg), metrics_path=tmp_path / "metrics.jsonl")
    batches: list[Any] = []
    with_judge = d._with_judge

    def record(batch: Any, *args: Any) -> Any:
        out = with_judge(batch, *args)
        batches.append((batch, out, args))
        return out

    d._with_judge = record  # type: ignore[method-assign]
    try:
        d.setup()
        rows = [d.step() for _ in range(2)]
        engine = d.judge.engines["judge-0"].obj
        assert isinstance(engine, reward_model.TransformersRewardModel)
        for row in rows:
            assert row["judge/scored"] == 8 and row["judge/failed"] == 0 and "reward/judge" in row
        before, after, (prompts, completions, _answers) = batches[0]
        want = engine.score(
            [d.judge.request_ids(p, c, "") for p, c in zip(prompts, completions, strict=True)]
        )
        assert after.parts["judge"] == pytest.approx(want, abs=1e-5)
        assert after.totals == pytest.approx([t + 0.5 * w for t, w in zip(before.totals, want, strict=True)])
    finally:
        d.shutdown()

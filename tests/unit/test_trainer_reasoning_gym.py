"""reasoning-gym tasks as a data source and a reward (`rljob_trainer.data.reasoning_gym`), on the real
reasoning-gym generators and their own `score_answer`."""

from __future__ import annotations

import json

import pytest

from rljob_trainer import config
from rljob_trainer.data import reasoning_gym, rewards, sources

pytest.importorskip("reasoning_gym")

CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def task(seed: int = 1, size: int = 50, fmt: str = "answerTag", **cfg: object) -> config.ReasoningGymSettings:
    return config.ReasoningGymSettings(
        task="chain_sum", config={**CHAIN_SUM, **cfg}, size=size, seed=seed, answer_format=fmt
    )


def data(rg: config.ReasoningGymSettings, **kw: object) -> config.DataSettings:
    return config.DataSettings(reasoning_gym=rg, chat_template=True, **kw)


def reference_answer(answer: str) -> str:
    return json.loads(answer)["answer"]


def test_the_same_settings_give_the_same_items_and_another_seed_other_items() -> None:
    a = sources.load_examples(data(task(seed=1)))
    b = sources.load_examples(data(task(seed=1)))
    c = sources.load_examples(data(task(seed=2)))
    assert a == b and len(a) == 50
    assert [e.prompt for e in a] != [e.prompt for e in c]
    assert all(e.prompt.startswith("State the final answer") for e in a)  # the task's own question


def test_the_answer_is_a_reference_the_scorer_rebuilds_the_entry_from() -> None:
    rg = task(seed=3)
    ex = sources.load_examples(data(rg))[7]
    settings, index = reasoning_gym.decode_reference(ex.answer)
    assert settings == rg and index == 7
    entry = reasoning_gym.dataset(rg)[7]
    assert entry["question"] == ex.prompt and reference_answer(ex.answer) == entry["answer"]


def test_the_reward_is_the_tasks_own_score_answer_on_the_tagged_answer() -> None:
    exs = sources.load_examples(data(task()))[:4]
    right = reference_answer(exs[0].answer)
    wrong = str(int(right) + 1)
    completions = [
        f"Let me add.\n<answer>{right}</answer>",  # reasoning-gym's format: 1
        f"<answer>{wrong}</answer>",  # wrong number: 0
        f"The answer is {right}.",  # no tag: answerTag reads no answer, 0
        f"<answer> +{right}.00 </answer>",  # chain_sum's score_answer tolerates sign and trailing zeros
    ]
    # every completion is scored against the first example's entry
    scores = reasoning_gym.score_batch([exs[0].prompt] * 4, completions, [exs[0].answer] * 4)
    assert scores == [1.0, 0.0, 0.0, 1.0]


def test_answer_tag_or_last_number_reads_the_last_number_when_there_is_no_tag() -> None:
    ex = sources.load_examples(data(task(fmt="answerTagOrLastNumber")))[0]
    right = reference_answer(ex.answer)
    fmt = "answerTagOrLastNumber"
    assert reasoning_gym.extract_answer(f"Adding them gives {right}.", fmt) == right
    assert reasoning_gym.extract_answer(f"3 + 4 = 7\n<answer>{right}</answer>\n9", fmt) == right
    assert reasoning_gym.extract_answer("-12 + 1,000 = 988.5 apples", fmt) == "988.5"
    assert reasoning_gym.extract_answer("I cannot say.", fmt) is None
    assert reasoning_gym.score_batch([ex.prompt], [f"The answer is {right}."], [ex.answer]) == [1.0]
    assert reasoning_gym.extract_answer(f"The answer is {right}.", "answerTag") is None


def test_the_reward_builds_from_the_config_and_refuses_other_answers() -> None:
    fn = rewards.build_reward_fn([config.RewardFunctionSettings(name="reasoningGym")])
    ex = sources.load_examples(data(task()))[0]
    totals, parts = fn.score_batch(
        [ex.prompt], [f"<answer>{reference_answer(ex.answer)}</answer>"], [ex.answer]
    )
    assert totals == [1.0] and parts == {"reasoningGym": [1.0]}
    with pytest.raises(rewards.RewardError, match="not a reasoning-gym reference"):
        fn.score_batch(["2+2"], ["4"], ["4"])


def test_unknown_tasks_and_config_fields_are_named_with_the_fix() -> None:
    with pytest.raises(
        ValueError, match=r"task 'chain_sums' is not a reasoning-gym task; valid names: .*chain_sum"
    ):
        reasoning_gym.load_pairs(config.ReasoningGymSettings(task="chain_sums"))
    with pytest.raises(
        ValueError, match=r"not a valid chain_sum config .* its fields: allow_negation, max_digits"
    ):
        reasoning_gym.load_pairs(config.ReasoningGymSettings(task="chain_sum", config={"max_termz": 3}))


def test_training_leaves_out_every_question_the_held_out_evaluation_asks() -> None:
    # 1-digit sums of two terms: few enough distinct questions that two seeds share many.
    small = {"min_digits": 1, "max_digits": 1}
    held = task(seed=2, size=40, **small)
    model = {"name": "m", "source": "tiny", "hf_config": {"model_type": "llama"}}
    cfg = config.TrainerConfig.model_validate(
        {
            "model": model,
            "data": data(task(seed=1, size=300, **small)).model_dump(),
            "rewards": [{"name": "reasoningGym"}],
            "evaluation": {"data": data(held).model_dump(), "max_samples": 30},
        }
    )
    hold = cfg.data.reasoning_gym.held_out
    assert (hold.task, hold.seed, hold.size) == ("chain_sum", 2, 30)  # the evaluated items only
    trained = sources.load_examples(cfg.data)
    asked = {e.prompt for e in sources.load_examples(data(held))[:30]}
    everything = sources.load_examples(data(task(seed=1, size=300, **small)))
    assert len(trained) < len(everything)  # the task does repeat questions across seeds
    assert trained and not {e.prompt for e in trained} & asked
    # what is left keeps its item index: the reward rebuilds the same entry
    kept = trained[0]
    _, index = reasoning_gym.decode_reference(kept.answer)
    assert everything[index].prompt == kept.prompt


def test_the_trainer_config_pairs_reasoning_gym_data_with_its_reward() -> None:
    model = {"name": "m", "source": "tiny", "hf_config": {"model_type": "llama"}}
    ok = {"model": model, "data": data(task()).model_dump(), "rewards": [{"name": "reasoningGym"}]}
    config.TrainerConfig.model_validate(ok)
    with pytest.raises(ValueError, match=r"mathAccuracy .* use the reward reasoningGym"):
        config.TrainerConfig.model_validate({**ok, "rewards": [{"name": "mathAccuracy"}]})
    with pytest.raises(ValueError, match=r"reasoningGym scores data\.reasoningGym prompts only"):
        config.TrainerConfig.model_validate({**ok, "data": {"builtin": "toy-arithmetic"}})
    same_seed = {"data": data(task()).model_dump()}
    with pytest.raises(ValueError, match="give the evaluation another seed"):
        config.TrainerConfig.model_validate({**ok, "evaluation": same_seed})
    config.TrainerConfig.model_validate({**ok, "evaluation": {"data": data(task(seed=9)).model_dump()}})
    with pytest.raises(ValueError, match=r"systemPrompt needs data\.chatTemplate"):
        config.DataSettings(reasoning_gym=task(), system_prompt="be brief")


def test_the_system_prompt_goes_before_the_question_in_the_chat_template() -> None:
    from rljob_trainer.model import modeling

    tok = modeling.load_tokenizer(
        config.ModelSettings(
            name="t", source="tiny", tokenizer="builtin-char", hf_config={"model_type": "llama"}
        )
    )
    with_system = sources.encode_data_prompt(tok, "1 + 2 =", data(task(), system_prompt="Be brief."))
    text = tok.decode(with_system)
    assert text == "system: Be brief.\nuser: 1 + 2 =\nassistant: "

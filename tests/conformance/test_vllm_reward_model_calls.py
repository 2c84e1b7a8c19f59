"""Every vLLM call `engines.reward_model.VLLMRewardModel` makes (a judge of kind rewardModel), checked
against the image's vLLM: its `LLM` keywords are ones `EngineArgs` takes and build a pooling model
config for a one-label sequence-classification model; `classify` is bound with the exact arguments
it passes, and `PoolingParams(use_activation=False)` (the raw logit) is one vLLM accepts. See
conftest.py."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from spy import SignatureSpy

from rljob_trainer import config as config_mod
from rljob_trainer.data import judge
from rljob_trainer.engines import reward_model
from rljob_trainer.model import modeling


def _cfg(tmp_path: Path) -> config_mod.TrainerConfig:
    tok = modeling.build_char_tokenizer(modeling.CHARSETS["builtin-char"])
    hf = {**modeling.tiny_hf_config(len(tok), model_type="llama"), "pad_token_id": tok.eos_token_id}
    tiny = {"name": "rm", "source": "tiny", "hfConfig": hf, "tokenizer": "builtin-char", "dtype": "float32"}
    model = modeling.build_reward_model(config_mod.ModelSettings(**tiny), init_seed=0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = config_mod.parse_config(
        {
            "model": {**tiny, "name": "policy"},
            "rollout": {"kind": "vllm"},
            "judge": {
                "kind": "rewardModel",
                "model": {"name": "rm", "source": "pvc", "path": str(tmp_path)},
                "maxModelLen": 128,
            },
        }
    )
    return judge.judge_engine_config(cfg)


def test_the_reward_models_arguments_build_a_pooling_model_config(tmp_path: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs

    cfg = _cfg(tmp_path)
    kwargs = reward_model.engine_args(cfg, model=str(tmp_path), capabilities=None)
    accepted = set(inspect.signature(EngineArgs).parameters)
    assert set(kwargs) <= accepted, sorted(set(kwargs) - accepted)
    model = EngineArgs(**kwargs).create_model_config()
    assert model.runner_type == "pooling" and model.hf_config.num_labels == 1
    assert model.max_model_len == cfg.lengths.max_model_len_tokens


def test_classify_is_called_with_arguments_vllm_takes_and_returns_the_raw_logit(tmp_path: Path) -> None:
    from vllm import LLM, PoolingParams

    def answer(arguments: dict[str, Any]) -> list[Any]:
        return [
            SimpleNamespace(outputs=SimpleNamespace(probs=[0.5 + i]))
            for i, _ in enumerate(arguments["prompts"])
        ]

    spy = SignatureSpy(LLM, results={"classify": answer})
    engine = reward_model.VLLMRewardModel(_cfg(tmp_path), name="judge-0")
    engine._llm = spy
    assert engine.score([[3, 4, 5], [6]]) == [0.5, 1.5]
    (call,) = spy.called("classify")
    assert call["prompts"] == [{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": [6]}]
    params = call["pooling_params"]
    assert isinstance(params, PoolingParams) and params.use_activation is False
    assert call["use_tqdm"] is False

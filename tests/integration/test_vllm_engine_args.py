"""The estimator's engine arguments, as the operator renders them for every example, taken by vLLM's
own configuration code (`EngineArgs.create_engine_config()` of the installed release: vLLM's CPU
build, what the local cluster's pods run). A plan vLLM refuses would otherwise surface only in a pod.

Models are given as a folder holding the example's `config.json` alone (no weights): vLLM builds its
whole configuration (scheduler, cache, model, attention checks) from that, without loading a tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("vllm")

from rljob_operator import api, builders
from rljob_operator import estimator as est
from rljob_operator.decide import planning
from rljob_trainer.engines import platform, vllm_engine

pytestmark = [pytest.mark.vllm]

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def _model_config(spec: api.RLJobSpec) -> dict[str, Any]:
    source = spec.model.config
    if source.inline is not None:
        return dict(source.inline)
    assert source.preset is not None, "examples carry their model config inline or as a preset"
    return est.load_preset(source.preset)


def _runs_on_vllms_cpu_build(spec: api.RLJobSpec, model_config: dict[str, Any]) -> bool:
    """Examples whose engines the CPU build serves: on CPU pools and the local-exec GPU/NPU pools."""
    head = est.ModelGeometry.from_hf_config(model_config).head_dim
    return spec.resources.rollout.kind == "vllm" and head in platform.CPU_ATTENTION_HEAD_SIZES


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_the_rendered_engine_arguments_are_ones_vllm_takes(path: Path, tmp_path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "RLJob"]
    spec = api.RLJobSpec.model_validate(docs[0]["spec"])
    model_config = _model_config(spec)
    if not _runs_on_vllms_cpu_build(spec, model_config):
        pytest.skip(f"{path.name}: not a model vLLM's CPU build serves (its engines run on accelerators)")
    judge_config = None
    if spec.reward.judge is not None:  # the judge's engines are planned from its own config
        js = spec.reward.judge.model.config
        judge_config = dict(js.inline) if js.inline is not None else est.load_preset(js.preset or "")
    plan = planning.plan_status(
        planning.plan_job(spec, model_config), planning.plan_judge(spec, judge_config)
    )
    cfg = builders.render_trainer_config(spec, plan, model_config, judge_config=judge_config)
    (tmp_path / "config.json").write_text(json.dumps(model_config))
    caps = platform.probe()
    args = vllm_engine.engine_args(cfg, model=str(tmp_path), sleep_enabled=False, capabilities=caps)
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(**args, skip_tokenizer_init=True).create_engine_config()
    assert config.scheduler_config.max_num_seqs == cfg.rollout.max_num_seqs == plan.max_num_seqs
    assert config.scheduler_config.max_num_batched_tokens == cfg.rollout.max_num_batched_tokens
    # This CPU build cannot rewind a seeded request's generator: no prompt is split over two steps.
    assert caps is not None and caps.seeded_chunked_prefill is False
    assert config.scheduler_config.enable_chunked_prefill is False
    # A hybrid model (Qwen3.5's linear attention) keeps vLLM's own rule: no prefix caching then.
    assert config.cache_config.enable_prefix_caching is not vllm_engine.has_state_space_layers(str(tmp_path))
    assert config.model_config.max_model_len == cfg.lengths.max_model_len_tokens
    assert config.cache_config.kv_cache_memory_bytes == cfg.rollout.cpu_kv_cache_bytes
    # The bytes hold the plan's maxNumSeqs sequences of the longest length vLLM will schedule.
    per_token = plan.kv_bytes_per_token or 0
    assert cfg.rollout.cpu_kv_cache_bytes >= per_token * config.model_config.max_model_len
    if cfg.judge is not None:  # the judge's engine, as the trainer builds it (data.judge), too
        from rljob_trainer.data import judge

        jcfg = judge.judge_engine_config(cfg)
        (tmp_path / "judge").mkdir()
        (tmp_path / "judge" / "config.json").write_text(json.dumps(judge_config))
        jargs = vllm_engine.engine_args(
            jcfg, model=str(tmp_path / "judge"), sleep_enabled=False, capabilities=caps
        )
        jconfig = EngineArgs(**jargs, skip_tokenizer_init=True).create_engine_config()
        assert jconfig.model_config.max_model_len == jcfg.lengths.max_model_len_tokens
        assert jconfig.cache_config.kv_cache_memory_bytes == jcfg.rollout.cpu_kv_cache_bytes

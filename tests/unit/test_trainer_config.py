"""Unit tests for rljob_trainer.config and rljob_trainer.outputs.telemetry (pure, no torch)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from rljob_trainer import config
from rljob_trainer.outputs import telemetry

TINY = {"model_type": "qwen2", "hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 64}


def _cfg(**over: object) -> config.TrainerConfig:
    data: dict[str, object] = {"model": {"name": "tiny", "source": "tiny", "hfConfig": TINY}}
    data.update(over)
    return config.parse_config(data)


def test_round_trip_camel_case(tmp_path):
    cfg = _cfg(grpo={"groupSize": 4, "promptsPerStep": 2, "klCoef": 0.01})
    text = config.dump_config(cfg)
    assert '"groupSize": 4' in text and '"maxNumBatchedTokens"' in text
    p = tmp_path / "trainer.json"
    p.write_text(text)
    assert config.load_config(p) == cfg


def test_snake_case_accepted_and_typos_rejected():
    cfg = _cfg(grpo={"group_size": 3})
    assert cfg.grpo.group_size == 3
    with pytest.raises(ValidationError, match="grupSize"):
        _cfg(grpo={"grupSize": 3})


@pytest.mark.parametrize(
    ("model", "msg"),
    [
        ({"name": "x", "source": "pvc"}, "model.path"),
        ({"name": "x", "source": "hub"}, "model.hubId"),
        ({"name": "x", "source": "tiny"}, "model.hfConfig"),
    ],
)
def test_model_source_requires_its_field(model, msg):
    with pytest.raises(ValidationError, match=msg):
        config.parse_config({"model": model})


def test_other_validation_rules():
    with pytest.raises(ValidationError, match="module"):
        _cfg(rewards=[{"name": "module"}])
    with pytest.raises(ValidationError, match="at least one engine"):
        _cfg(rollout={"sharedEngines": 0, "dedicatedEngines": 0})
    with pytest.raises(ValidationError, match="divisible"):
        _cfg(grpo={"groupSize": 3, "promptsPerStep": 1, "miniBatchesPerStep": 2})
    with pytest.raises(ValidationError, match="mathAccuracy"):
        _cfg(rewards=[{"name": "unknownReward"}])


def test_env_names_match_contract():
    assert config.ALL_ENV_VARS == (
        "RLJOB_CONFIG_PATH",
        "RLJOB_ROLE",
        "RLJOB_POD_INDEX",
        "RLJOB_JOB_NAME",
        "RLJOB_NAMESPACE",
        "RLJOB_RAY_HEAD",
        "RLJOB_RAY_PORT",
        "RLJOB_NUM_TRAINER_PODS",
        "RLJOB_TELEMETRY_CONFIGMAP",
        "RLJOB_NUM_ACCELERATORS",
        "RLJOB_RAY_ACCELERATOR",
    )
    # The test kubelet's CPU stand-in switch is not part of what the operator sets.
    assert config.ENV_TEST_CPU_STANDIN not in config.ALL_ENV_VARS
    assert config.trainer_resource_name(2) == "rljob_trainer_2"
    assert config.DEFAULT_CONFIG_PATH == "/etc/rljob/trainer.json"
    assert config.rollout_resource_name(3) == "rljob_rollout_3"


def test_config_and_telemetry_import_without_torch():
    code = (
        "import sys; import rljob_trainer.config, rljob_trainer.outputs.telemetry; "
        "bad = [m for m in ('torch', 'ray', 'kubernetes', 'kopf', 'transformers') if m in sys.modules]; "
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def _report(step: int) -> telemetry.SyncReport:
    return telemetry.SyncReport(
        step=step,
        time=1000.0 + step,
        interval_s=2.0,
        trainer_wait_s=0.5,
        generation_s=1.5,
        training_s=0.5,
        inflight_request_seconds=6.0,
        engine_seconds=4.0,
        snapshot_inflight=0,
        shared_engines_awake=1,
        dedicated_engines=1,
        mean_reward=0.25,
        loss=0.1,
        tokens_per_s=100.0,
        response_len_mean=12.0,
    )


def test_sync_report_json_is_camel_case():
    data = json.loads(telemetry.dump_reports([_report(1)]))[0]
    assert set(data) == {
        "step",
        "time",
        "intervalS",
        "trainerWaitS",
        "generationS",
        "trainingS",
        "inflightRequestSeconds",
        "engineSeconds",
        "snapshotInflight",
        "sharedEnginesAwake",
        "dedicatedEngines",
        "meanReward",
        "loss",
        "tokensPerS",
        "responseLenMean",
        "exportPath",
        "checkpointAck",
        "checkpointAckStep",
        "checkpointFallback",
        "releasedRolloutPods",
        "lostRolloutPods",
        "stalenessMax",
        "evalMeanReward",
        "evalStep",
        "droppedPrompts",
        "trackerErrors",
        "enginePlatform",
        "sharedWakeS",
        "sharedWakeRestarted",
        "promptTokens",
        "generatedTokens",
        "trainedTokens",
        "generationEngines",
        "prefillEngineS",
        "decodeEngineS",
        "numerics",
    }


def test_old_sync_reports_parse_with_empty_pod_lists():
    data = json.loads(telemetry.dump_reports([_report(1)]))[0]
    for key in ("releasedRolloutPods", "lostRolloutPods", "stalenessMax", "promptTokens", "decodeEngineS"):
        data.pop(key)
    report = telemetry.parse_reports(json.dumps([data]))[0]
    assert report.released_rollout_pods == [] and report.lost_rollout_pods == [] and report.staleness_max == 0
    again = json.loads(telemetry.dump_reports([report.model_copy(update={"lost_rollout_pods": [2]})]))[0]
    assert again["lostRolloutPods"] == [2] and again["releasedRolloutPods"] == []
    assert telemetry.parse_reports(json.dumps([data])) == [_report(1)]
    assert _report(1).mean_busy == 1.5
    assert telemetry.parse_reports(None) == []


def test_append_report_bounds_and_keeps_order():
    hist: list[telemetry.SyncReport] = []
    for s in range(40):
        new = telemetry.append_report(hist, _report(s))
        assert len(hist) == min(s, telemetry.MAX_REPORTS)  # input not mutated
        hist = new
    assert len(hist) == telemetry.MAX_REPORTS == 32
    assert [r.step for r in hist] == list(range(8, 40))
    assert telemetry.REPORTS_KEY == "reports.json"


def test_the_cpu_stand_in_keeps_the_jobs_dtype_and_engine_and_fp16_is_refused():
    cfg = config.parse_config(
        {"model": {"name": "m", "source": "tiny", "hfConfig": {"model_type": "qwen2"}, "dtype": "bfloat16"},
         "rollout": {"kind": "vllm", "sharedEngines": 1},
         "distributed": {"device": "cuda", "backend": "nccl"}}
    )  # fmt: skip
    cpu = config.cpu_standin(cfg)
    assert cpu.model.dtype == "bfloat16"  # a stand-in in fp32 would hide what bf16 does to a GPU run
    # The stand-in swaps torch's device and backend, never the engine: vLLM's CPU build serves it.
    assert (cpu.distributed.device, cpu.distributed.backend, cpu.rollout.kind) == ("cpu", "gloo", "vllm")
    with pytest.raises(ValidationError, match="float16 is not supported for training"):
        config.parse_config({"model": {**cfg.model.model_dump(), "dtype": "float16"}})
    with pytest.raises(ValidationError, match=r"trackingUri|tracking_uri"):
        config.parse_config(
            {"model": cfg.model.model_dump(), "tracking": {"mlflow": {"trackingUri": "file:///tmp/mlruns"}}}
        )

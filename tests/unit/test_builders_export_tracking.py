"""spec.export / spec.tracking reach the trainer config and the trainer pods' environment."""

from __future__ import annotations

import json

from test_builders import JOB, all_objects, make_spec, static_plan

from rljob_operator import builders
from rljob_trainer import config as tc


def test_export_and_tracking_render_into_trainer_json() -> None:
    spec = make_spec(
        export={"everyCheckpoint": False, "mergeLora": False},
        tracking={
            "wandb": {"project": "rl", "mode": "offline", "apiKeySecretRef": {"name": "wb", "key": "key"}},
            "mlflow": {"trackingUri": "http://mlflow:5000", "experiment": "grpo"},
        },
    )
    cm = builders.build_config_map(JOB, spec, static_plan(spec), {"model_type": "llama"})
    cfg = tc.parse_config(json.loads(cm["data"][tc.CONFIGMAP_KEY]))
    assert (cfg.export.every_checkpoint, cfg.export.final, cfg.export.merge_lora) == (False, True, False)
    assert cfg.tracking.wandb is not None and cfg.tracking.wandb.mode == "offline"
    assert cfg.tracking.wandb.api_key_env == "WANDB_API_KEY"
    assert cfg.tracking.mlflow is not None and cfg.tracking.mlflow.experiment == "grpo"
    default = make_spec()
    cm = builders.build_config_map(JOB, default, static_plan(default), {"model_type": "llama"})
    cfg = tc.parse_config(json.loads(cm["data"][tc.CONFIGMAP_KEY]))
    assert cfg.export.every_checkpoint and cfg.export.final and cfg.tracking.wandb is None


def test_tracker_secrets_go_to_trainer_pods_only() -> None:
    spec = make_spec(
        tracking={
            "wandb": {"project": "rl", "apiKeySecretRef": {"name": "wb", "key": "key"}},
            "mlflow": {"trackingUri": "http://mlflow:5000", "tokenSecretRef": {"name": "ml", "key": "t"}},
        }
    )
    pods = all_objects(spec)
    trainer = {e["name"]: e for e in pods[0]["spec"]["containers"][0]["env"]}
    assert trainer["WANDB_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "wb", "key": "key"}
    assert trainer["MLFLOW_TRACKING_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "ml", "key": "t"}
    rollout = pods[-1]
    assert rollout["metadata"]["labels"]["rljob.io/role"] == "rollout"
    assert not {"WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN"} & {
        e["name"] for e in rollout["spec"]["containers"][0]["env"]
    }

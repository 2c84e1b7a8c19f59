"""KV-cache, memory and throughput estimator for RLJobs (pure functions over pydantic models).

The operator calls :func:`plan_resources` in every reconcile to size trainer and rollout pods;
``rljob plan`` prints the same plan offline. See the submodules for the rules:
:mod:`.geometry` (config.json -> KV/state bytes), :mod:`.rollout` (vLLM engine sizing),
:mod:`.trainer` (FSDP2 memory), :mod:`.throughput` (step-time model), :mod:`.planner` (split),
:mod:`.devices` (accelerator catalog), :mod:`.report` (table / JSON), :mod:`.presets`,
:mod:`.refit` (the plan checked against a running job's SyncReports, and re-planned),
:mod:`.judge` (the judge's engines, sized with the rollout engine's rules).
"""

from rljob_operator.errors import EstimatorError
from rljob_operator.estimator.devices import DEFAULT_CATALOG, DeviceSpec, get_device, merge_catalog
from rljob_operator.estimator.geometry import ModelGeometry
from rljob_operator.estimator.judge import JudgePlan, JudgeRequest, format_judge, plan_judge
from rljob_operator.estimator.planner import PlanRequest, ResourcePlan, plan_resources
from rljob_operator.estimator.presets import load_preset, preset_names
from rljob_operator.estimator.report import format_plan_table, format_refit_table, plan_to_json, refit_to_json
from rljob_operator.estimator.rollout import EngineSizing, KVCacheLayout, compute_kv_cache_layout, size_engine

__all__ = [
    "DEFAULT_CATALOG",
    "DeviceSpec",
    "EngineSizing",
    "EstimatorError",
    "JudgePlan",
    "JudgeRequest",
    "KVCacheLayout",
    "ModelGeometry",
    "PlanRequest",
    "ResourcePlan",
    "compute_kv_cache_layout",
    "format_judge",
    "format_plan_table",
    "format_refit_table",
    "get_device",
    "load_preset",
    "merge_catalog",
    "plan_judge",
    "plan_resources",
    "plan_to_json",
    "preset_names",
    "refit_to_json",
    "size_engine",
]

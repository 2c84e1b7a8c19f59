"""Pure builders of every object an RLJob owns; `rljob_operator.handlers` applies what they return.

Builders take typed models (`api.RLJobSpec`, `api.PlanStatus`, `common.JobLayout`) and plain
values, return new dicts, and never read the clock, the environment or the API. Owner references
are added by the shell (`kopf.adopt`).
"""

from rljob_operator.builders.common import (
    JobLayout,
    JobRef,
    compute_layout,
    content_hash,
    resource_name,
)
from rljob_operator.builders.configmaps import (
    build_config_map,
    build_telemetry_config_map,
    render_trainer_config,
)
from rljob_operator.builders.events import build_event
from rljob_operator.builders.objects import JobObjects, build_job_objects
from rljob_operator.builders.pods import build_pods, build_rollout_pod, build_trainer_pod
from rljob_operator.builders.rbac import (
    build_operator_cluster_role,
    build_operator_cluster_role_binding,
    build_role,
    build_role_binding,
    build_service_account,
)
from rljob_operator.builders.service import build_headless_service

__all__ = [
    "JobLayout",
    "JobObjects",
    "JobRef",
    "build_config_map",
    "build_event",
    "build_headless_service",
    "build_job_objects",
    "build_operator_cluster_role",
    "build_operator_cluster_role_binding",
    "build_pods",
    "build_role",
    "build_role_binding",
    "build_rollout_pod",
    "build_service_account",
    "build_telemetry_config_map",
    "build_trainer_pod",
    "compute_layout",
    "content_hash",
    "render_trainer_config",
    "resource_name",
]

"""Every object one RLJob owns, in one place: what the operator applies and `rljob render` prints.

Role: `build_job_objects` calls the other builders for one job, plan and layout, so the shell
(`handlers`) and the offline renderer (`rljob render`) can never disagree on what a job creates.
Pure; owner references are added by the shell.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rljob_operator import api
from rljob_operator.builders import configmaps, pods, rbac, service
from rljob_operator.builders.common import JobLayout, JobRef, content_hash


@dataclasses.dataclass(frozen=True)
class JobObjects:
    """The objects of one job: `children` are created once (AlreadyExists is success when ours), the config
    ConfigMap is replaced when it changes, and `pods` are reconciled one by one."""

    rbac: tuple[dict[str, Any], ...]
    service: dict[str, Any]
    telemetry_config_map: dict[str, Any]
    config_map: dict[str, Any]
    config_hash: str
    pods: tuple[dict[str, Any], ...]

    @property
    def children(self) -> tuple[dict[str, Any], ...]:
        """Everything but the config ConfigMap and the pods (create-only)."""
        return (*self.rbac, self.service, self.telemetry_config_map)

    def all(self) -> list[dict[str, Any]]:
        return [*self.rbac, self.service, self.config_map, self.telemetry_config_map, *self.pods]


def build_job_objects(
    job: JobRef,
    spec: api.RLJobSpec,
    plan: api.PlanStatus,
    layout: JobLayout,
    model_config: dict[str, Any] | None,
    *,
    attempt: int = 0,
) -> JobObjects:
    config_map = configmaps.build_config_map(job, spec, plan, model_config)
    config_hash = content_hash(config_map["data"])
    return JobObjects(
        rbac=(
            rbac.build_service_account(job.name, job.namespace),
            rbac.build_role(job.name, job.namespace),
            rbac.build_role_binding(job.name, job.namespace),
        ),
        service=service.build_headless_service(job),
        telemetry_config_map=configmaps.build_telemetry_config_map(job),
        config_map=config_map,
        config_hash=config_hash,
        pods=tuple(pods.build_pods(job, spec, layout, attempt=attempt, config_hash=config_hash)),
    )

"""`rljob render`: every object the operator would create for an RLJob, offline (its `helm template`).

Role: called by `rljob_operator.cli`. Parses the manifest with the API models, plans with the
estimator (`planning.plan_job`) and builds with the same builders the operator applies
(`builders.build_job_objects`), for the first run attempt. Nothing talks to a cluster: a
`configMapRef` model config is given as a file instead. Owner references are the only thing the
operator adds when it applies these (they need the RLJob's uid).
"""

from __future__ import annotations

from typing import Any, Literal

from rljob_operator import api, builders, planning

Only = Literal["all", "trainer-config", "pods", "rbac"]
ONLY_CHOICES: tuple[str, ...] = ("all", "trainer-config", "pods", "rbac")


def render_job(
    name: str,
    namespace: str,
    spec: api.RLJobSpec,
    model_config: dict[str, Any],
    *,
    only: Only = "all",
) -> list[dict[str, Any]]:
    """The objects (plain dicts) for RLJob `namespace/name`; `only` narrows them.

    - all: ServiceAccount, Role, RoleBinding, headless Service, the config and telemetry
      ConfigMaps, and the pods of the plan's layout;
    - trainer-config: the trainer's configuration (`rljob_trainer.config.TrainerConfig`, as the
      pods read it from `<job>-config`);
    - pods / rbac: those objects only.
    Raises `errors.RLJobError` (estimator, builders) with the field and the fix.
    """
    plan = planning.plan_status(planning.plan_job(spec, model_config))
    layout = builders.compute_layout(spec, plan)
    job = builders.JobRef(name, namespace)
    if only == "trainer-config":
        cfg = builders.render_trainer_config(spec, plan, model_config)
        return [cfg.model_dump(mode="json", by_alias=True)]
    objects = builders.build_job_objects(job, spec, plan, layout, model_config)
    if only == "pods":
        return list(objects.pods)
    if only == "rbac":
        return list(objects.rbac)
    return objects.all()

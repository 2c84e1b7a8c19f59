"""`rljob render`: every object the operator would create for an RLJob, offline (its `helm template`).

Role: called by `rljob_operator.cli.commands`. Parses the manifest with the API models, plans with the
estimator (`planning.plan_job`) and builds with the same builders the operator applies
(`builders.build_job_objects`), for the first run attempt. Nothing talks to a cluster: a
`configMapRef` model config is given as a file instead. Owner references are the only thing the
operator adds when it applies these (they need the RLJob's uid).

Native gang scheduling depends on the cluster: the operator makes a `scheduling.k8s.io/v1beta1`
PodGroup (and sets the core pods' `spec.schedulingGroup`) only where the apiserver serves that
API (Kubernetes 1.37 with GenericWorkload). Offline, render cannot ask, so it renders the plain
pods by default, as on a cluster without the API; `gang=True` (`rljob render --gang`) renders
what a cluster with the API gets: the PodGroup before the pods, and the core pods in it
(`builders.podgroup`, the same builders the operator's gang step uses). Kueue's Workloads are
not rendered: they depend on the cluster's queues.
"""

from __future__ import annotations

from typing import Any, Literal

from rljob_operator import api, builders
from rljob_operator.builders import endpoint, podgroup, ray_auth
from rljob_operator.decide import planning

Only = Literal["all", "trainer-config", "pods", "rbac"]
ONLY_CHOICES: tuple[str, ...] = ("all", "trainer-config", "pods", "rbac")


def render_job(
    name: str,
    namespace: str,
    spec: api.RLJobSpec,
    model_config: dict[str, Any],
    *,
    only: Only = "all",
    gang: bool = False,
    judge_config: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The objects (plain dicts) for RLJob `namespace/name`; `only` narrows them.

    - all: ServiceAccount, Role, RoleBinding, the Ray token Secret (its token shown as a
      placeholder: the operator generates one per job), the NetworkPolicies (as the chart's defaults
      set them: the job's, and its environments'), headless Service, the environments' Services, the
      config and telemetry ConfigMaps, and the pods of the plan's layout (trainer, rollout, judge,
      then the environment servers);
    - trainer-config: the trainer's configuration (`rljob_trainer.config.TrainerConfig`, as the
      pods read it from `<job>-config`);
    - pods / rbac: those objects only.
    `gang`: as on a cluster that serves PodGroups: the job's PodGroup (before the pods, with
    `all`) and the core pods' `spec.schedulingGroup`. `judge_config`: the judge model's config.json
    (spec.reward.judge).
    Raises `errors.RLJobError` (estimator, builders) with the field and the fix.
    """
    plan = planning.plan_status(
        planning.plan_job(spec, model_config), planning.plan_judge(spec, judge_config)
    )
    layout = builders.compute_layout(spec, plan)
    job = builders.JobRef(name, namespace)
    if only == "trainer-config":
        cfg = builders.render_trainer_config(spec, plan, model_config, job=job, judge_config=judge_config)
        return [cfg.model_dump(mode="json", by_alias=True)]
    objects = builders.build_job_objects(
        job,
        spec,
        plan,
        layout,
        model_config,
        ray_token=ray_auth.RENDERED_TOKEN,
        judge_config=judge_config,
        endpoint_token=endpoint.RENDERED_TOKEN,
    )
    pods = [*objects.pods, *objects.environment_pods]
    groups: list[dict[str, Any]] = []
    if gang:
        members = podgroup.job_gang(job, spec, plan, layout)
        pods = podgroup.with_gang(pods, members)
        groups = [
            podgroup.build_pod_group(
                job, min_count=members.min_count, priority_class_name=spec.trainer_pool.priority_class_name
            )
        ]
    if only == "pods":
        return pods
    if only == "rbac":
        return list(objects.rbac)
    return [*(o for o in objects.all() if o["kind"] != "Pod"), *groups, *pods]

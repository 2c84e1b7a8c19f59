"""The shared-cluster steps of a reconcile: Kueue admission, cooperative preemption and native
gang scheduling. The decisions are pure (`admission`, `preemption`, `builders.podgroup`); these
steps observe, call them, and make the API calls they ask for.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import kopf

from rljob_operator import api, builders, errors, names
from rljob_operator.builders import environments, podgroup
from rljob_operator.decide import admission, lifecycle, preemption
from rljob_operator.kube import adapter
from rljob_operator.reconcile import status
from rljob_operator.reconcile.context import (
    WAIT_FOR_TERMINATION_S,
    Ctx,
    delete_pods,
    post,
    spec_of,
    sync_reports,
)
from rljob_operator.reconcile.state import State

POD_GROUP_API_REFRESH_S = 600.0  # how long the operator trusts its discovery of the PodGroup API


async def step_gang(ctx: Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """Where the apiserver serves PodGroups, the job's core (trainer pods plus the minimum rollout
    pods) is one PodGroup, so the scheduler binds all of it or none; elsewhere pods schedule one by
    one, and the GangScheduling condition says why."""
    if not await _pod_groups_served(ctx.state.kube, ctx.state):
        why = (
            f"the apiserver does not serve {podgroup.API_VERSION} PodGroups (Kubernetes 1.37 with "
            "the GenericWorkload feature gate and that API enabled): pods are scheduled one by one"
        )
        return dataclasses.replace(seen, gang=(False, "PodGroupAPIUnavailable", why)), False
    spec = spec_of(seen)
    assert seen.plan is not None and seen.layout is not None
    gang = podgroup.job_gang(ctx.job, spec, seen.plan, seen.layout)
    kube_ = ctx.state.kube
    if ctx.state.gangs.get(ctx.key) != gang.min_count:
        group = podgroup.build_pod_group(
            ctx.job, min_count=gang.min_count, priority_class_name=spec.trainer_pool.priority_class_name
        )
        kopf.adopt(group, owner=ctx.body)
        if not await kube_.create(group):  # it exists: from before a restart, or an older spec
            stored = podgroup.min_count_of(await kube_.read_pod_group(ctx.job.namespace, gang.group))
            if stored not in (None, gang.min_count):
                # A PodGroup's gang is fixed once made: replace it (bound pods stay where they are).
                await kube_.delete_pod_group(ctx.job.namespace, gang.group)
                ctx.retry(
                    WAIT_FOR_TERMINATION_S, f"PodGroup {gang.group} is replaced (minCount {gang.min_count})"
                )
                why = f"PodGroup {gang.group} is replaced: minCount {stored}, the job's is {gang.min_count}"
                return dataclasses.replace(seen, gang=(False, "PodGroupReplaced", why)), True
        ctx.state.gangs[ctx.key] = gang.min_count
    message = (
        f"PodGroup {gang.group}: {', '.join(sorted(gang.members))} are scheduled all together or "
        f"not at all (minCount {gang.min_count})"
    )
    return dataclasses.replace(seen, gang=(True, "PodGroupCreated", message)), False


async def _pod_groups_served(kube_: adapter.Kube, state: State) -> bool:
    """Discovery of the PodGroup API, cached for POD_GROUP_API_REFRESH_S (it changes with an upgrade)."""
    now = time.monotonic()
    if state.pod_group_api is None or now - state.pod_group_api[0] >= POD_GROUP_API_REFRESH_S:
        served = await kube_.serves(podgroup.API_VERSION, "podgroups")
        state.pod_group_api = (now, served)
    return state.pod_group_api[1]


# ---- Kueue admission (the pure part: rljob_operator.decide.admission) -----------------------------------
async def step_admission(ctx: Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """A job labelled kueue.x-k8s.io/queue-name: its Workloads exist before any pod, and no pod
    exists until Kueue admits them; admitted pods go onto their flavors' nodes, and Kueue hears
    PodsReady. Extra dedicated engines (adaptive mode) each wait for their own Workload."""
    spec = spec_of(seen)
    labels = (ctx.body.get("metadata") or {}).get("labels") or {}
    try:
        queue_name = names.kueue_queue_name(labels)
        priority_class = names.kueue_priority_class(labels)
    except ValueError as exc:
        raise admission.KueueLabelError("metadata.labels", str(exc)) from exc
    if queue_name is None:
        return seen, False
    assert seen.plan is not None and seen.layout is not None
    core_layout = builders.compute_layout(spec, seen.plan)  # the plan's engines: the job's minimum
    core_pods = builders.build_pods(ctx.job, spec, core_layout, judge_config=ctx.judge_config)

    def of_role(role: str) -> list[dict[str, Any]]:
        return [p for p in core_pods if p["metadata"]["labels"][names.LABEL_ROLE] == role]

    trainers, rollouts = of_role(names.ROLE_TRAINER), of_role(names.ROLE_ROLLOUT)
    # The judge's engines and the environment servers are part of what the job needs to progress.
    extra = admission.core_extra_pods(
        of_role(names.ROLE_JUDGE), environments.build_environment_pods(ctx.job, spec)
    )
    known = ctx.state.workloads.setdefault(ctx.key, {})
    earlier = sorted(n for n, w in known.items() if w.owner_uid != ctx.uid)
    if earlier:  # an earlier RLJob's of the same name: its admission is not this job's
        for wl in earlier:
            if not known[wl].deleting:
                await ctx.state.kube.delete_workload(ctx.job.namespace, wl)
        raise errors.EarlierJobLeftoversError(
            "metadata.name",
            f"Workloads {', '.join(earlier)} belong to an earlier RLJob named {ctx.job.name} (deleted, "
            "not yet garbage-collected): deleting them; this job queues once they are gone",
        )
    wl_name = names.workload_name(ctx.job.name)
    core = known.get(wl_name)
    if core is None or not core.quota_reserved:
        priority = await _workload_priority(ctx, spec, priority_class, core)
        desired = admission.core_workload(
            ctx.job, trainers, rollouts, queue_name=queue_name, priority=priority, extra=extra
        )
        if core is not None and not core.deleting and not admission.is_current(core, desired):
            await ctx.state.kube.delete_workload(ctx.job.namespace, wl_name)  # pending: rebuild it
            ctx.retry(WAIT_FOR_TERMINATION_S, f"Workload {wl_name} is rebuilt for the new spec")
            core = None
        elif core is None:
            kopf.adopt(desired, owner=ctx.body)
            if await ctx.state.kube.create(desired):
                post(
                    ctx, "Normal", "WorkloadCreated", f"created Workload {wl_name} in LocalQueue {queue_name}"
                )
            else:  # it exists, and the watch has not told us yet (an operator restart)
                core = admission.observe_workload(
                    await ctx.state.kube.read_workload(ctx.job.namespace, wl_name) or {}
                )
                if core is not None:
                    known[wl_name] = core
    reserved = core is not None and core.quota_reserved and not core.deleting
    if reserved and (why := admission.pod_sets_mismatch(core, trainers, rollouts, extra)):
        queue = api.QueueStatus(name=queue_name, workload=wl_name, message=why[:1024])
        await _rebuild_admitted(ctx, core, why)
        return dataclasses.replace(seen, queue=queue), True
    queue = admission.queue_status(core, queue_name, wl_name)
    if core is None or not core.admitted:
        return dataclasses.replace(seen, queue=queue), True  # no pod until Kueue admits the Workload
    # Extra engines beyond the minimum: one lower-priority Workload each, a pod once admitted.
    current = [p for p in ctx.pods if p.attempt == ctx.attempt and not p.deleting]
    core_n, target = core_layout.rollout_pods, seen.layout.rollout_pods
    engines = {s.engine: s for s in known.values() if s.engine is not None}
    running = [p.index for p in current if p.role == names.ROLE_ROLLOUT]
    for index in sorted(set(range(core_n, target)) - set(engines)):
        pod = builders.build_rollout_pod(ctx.job, spec, seen.layout, index)
        wl = admission.engine_workload(
            ctx.job, pod, index, queue_name=queue_name, core_priority=core.priority
        )
        kopf.adopt(wl, owner=ctx.body)
        await ctx.state.kube.create(wl)
    # An evicted engine falls outside `allowed` (the effective target, in the layout below): its
    # pod drains (`elastic.plan_rollout_pods`, the pods step); its Workload goes once the pod has.
    for name in admission.stale_engine_workloads(core_n, target, engines, running):
        await ctx.state.kube.delete_workload(ctx.job.namespace, name)
    allowed = admission.admitted_engines(core_n, target, engines)
    admitted = admission.admitted_pod_sets(
        ctx.job.name, core, admission.pod_set_pods(trainers, rollouts, extra), engines, range(core_n, allowed)
    )
    for wl, members in admitted:
        await _report_pods_ready(ctx, wl, {n for pods in members.values() for n in pods}, current)
    # The admitted flavors' placement, read only when a pod is to be created.
    placements: dict[str, admission.Placement] = {}
    present = {p.name for p in current}
    if any(n not in present for _, members in admitted for pods in members.values() for n in pods):
        flavor_names = admission.flavor_names(wl for wl, _ in admitted)
        flavors = {f: await ctx.state.kube.read_kueue_object("resourceflavors", f) for f in flavor_names}
        for wl, members in admitted:
            placements.update(admission.pod_placements(wl, members, flavors))
    queue = admission.queue_status(core, queue_name, wl_name, extra_engines_admitted=allowed - core_n)
    layout = builders.compute_layout(spec, seen.plan, allowed) if allowed != target else seen.layout
    return dataclasses.replace(seen, queue=queue, placements=placements, layout=layout), False


async def _rebuild_admitted(ctx: Ctx, core: admission.WorkloadState, why: str) -> None:
    """The admitted Workload no longer covers the job's pods (`admission.pod_sets_mismatch`): stop
    the job, then, once no pod is left, delete its Workloads (the quota goes back); the admission
    step then creates the Workload for the new spec and the job queues again (Kueue's
    jobframework: stop the job with no matching Workload, delete the old one, create a new one).
    The job resumes from its last checkpoint once readmitted, as after any gang restart."""
    live = lifecycle.pods_to_stop(ctx.pods, keep_finished=False)
    if live:
        post(ctx, "Normal", "WorkloadOutOfSync", why)
        await delete_pods(ctx, live, why="workload-rebuilt")
    if ctx.pods:  # terminating: the quota still counts until they are gone
        ctx.retry(WAIT_FOR_TERMINATION_S, f"the pods stop before Workload {core.name} is rebuilt")
        return
    for wl in list(ctx.state.workloads.get(ctx.key, {}).values()):
        if not wl.deleting:
            await ctx.state.kube.delete_workload(ctx.job.namespace, wl.name)
    post(ctx, "Normal", "WorkloadRebuilt", f"deleted Workload {core.name}: {why}")
    ctx.retry(WAIT_FOR_TERMINATION_S, f"Workload {core.name} is rebuilt for the new spec")


async def step_preemption(ctx: Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """Kueue evicted or preempted the job's Workload: cooperative preemption (`preemption.decide`).

    Ask the driver to checkpoint (status.checkpointRequest), wait for its acknowledgement in the
    SyncReports up to spec.preemption.checkpointGraceSeconds, delete the pods, and once none is
    left clear the reservation as Kueue's integrations do; the job is then Queued and resumes from
    that checkpoint when readmitted. The steps after this one run only when there is nothing to do."""
    labels = (ctx.body.get("metadata") or {}).get("labels") or {}
    try:
        queue_name = names.kueue_queue_name(labels)
    except ValueError:
        return seen, False  # the admission step names the bad label
    if queue_name is None:
        return seen, False
    wl_name = names.workload_name(ctx.job.name)
    core = ctx.state.workloads.get(ctx.key, {}).get(wl_name)
    grace = spec_of(seen).preemption.checkpoint_grace_seconds
    decision = preemption.decide(
        core,
        ctx.old.checkpoint_request,
        preemption.acks_of(sync_reports(ctx)),
        ctx.pods,
        attempt=ctx.attempt,
        grace_s=grace,
        now=ctx.now,
    )
    if decision.action == "none":
        return seen, False
    assert core is not None
    message = preemption.summary(decision, wl_name, grace)
    if decision.action == "request":
        post(ctx, "Normal", "CheckpointRequested", message)
        ctx.retry(0, "a checkpoint was requested")
    elif decision.action == "wait":
        ctx.retry(decision.wait_s, "waiting for the driver's checkpoint acknowledgement")
    elif decision.action == "stop":
        await delete_pods(ctx, lifecycle.pods_to_stop(ctx.pods, keep_finished=False), why="preempted")
        ctx.retry(WAIT_FOR_TERMINATION_S, "waiting for the preempted pods to terminate")
    elif decision.action == "release":
        body = await ctx.state.kube.read_workload(ctx.job.namespace, wl_name)
        if body is not None:
            await ctx.state.kube.apply_workload_status(
                preemption.release_apply(body, now=ctx.now), preemption.ADMISSION_FIELD_MANAGER
            )
        # Extra engines' Workloads hold quota for pods that are gone: the admission step queues
        # them again once the core is readmitted.
        for extra in list(ctx.state.workloads.get(ctx.key, {}).values()):
            if extra.engine is not None and not extra.deleting:
                await ctx.state.kube.delete_workload(ctx.job.namespace, extra.name)
        post(ctx, "Normal", "Requeued", message)
    # While the driver checkpoints the job still runs under its admission, as far as users see.
    running = decision.action in ("request", "wait")
    queue = ctx.old.queue if running else admission.queue_status(core, queue_name, wl_name)
    return dataclasses.replace(seen, queue=queue, preemption=(decision, message)), True


def kueue_managed(ctx: Ctx) -> bool:
    return names.KUEUE_QUEUE_LABEL in ((ctx.body.get("metadata") or {}).get("labels") or {})


async def _workload_priority(
    ctx: Ctx, spec: api.RLJobSpec, class_name: str | None, current: admission.WorkloadState | None
) -> admission.WorkloadPriority | None:
    """The Workload's priority: the label's WorkloadPriorityClass, else the trainer pool's
    PriorityClass; read from the class only when the Workload does not already name it."""
    kind, name = (
        ("WorkloadPriorityClass", class_name)
        if class_name
        else ("PriorityClass", spec.trainer_pool.priority_class_name)
    )
    if name is None:
        return None
    if current is not None and current.priority_class == (kind, name) and current.priority is not None:
        return admission.WorkloadPriority(kind=kind, name=name, value=current.priority)
    if kind == "WorkloadPriorityClass":
        obj = await ctx.state.kube.read_kueue_object("workloadpriorityclasses", name)
        field = f"metadata.labels[{names.KUEUE_PRIORITY_CLASS_LABEL}]"
    else:
        obj = await ctx.state.kube.read_priority_class(name)
        field = "spec.trainerPool.priorityClassName"
    if obj is None:
        raise admission.PriorityClassNotFoundError(
            field, f"{kind} {name!r} is not found: create it, or fix the name"
        )
    return admission.WorkloadPriority(kind=kind, name=name, value=int(obj.get("value") or 0))


async def _report_pods_ready(
    ctx: Ctx, wl: admission.WorkloadState, pod_names: set[str], current: list[lifecycle.PodObservation]
) -> None:
    """Tell Kueue whether the Workload's pods are up (its PodsReady condition, server-side applied)."""
    ready = pod_names <= {p.name for p in current if p.phase == "Running"}
    cond = admission.pods_ready_condition(wl, ready, now=ctx.now)
    if cond is not None:
        await ctx.state.kube.apply_workload_status(
            admission.condition_apply(wl, cond), admission.PODS_READY_FIELD_MANAGER
        )


async def release_workloads(ctx: Ctx) -> None:
    """A suspended job holds no quota: delete its Workloads (they are rebuilt when it resumes)."""
    for wl in list(ctx.state.workloads.get(ctx.key, {}).values()):
        if not wl.deleting:
            await ctx.state.kube.delete_workload(ctx.job.namespace, wl.name)


async def finish_workloads(ctx: Ctx) -> None:
    """A finished job gives its quota back: its Workloads get Finished=True, as Kueue's own jobs do."""
    outcome = "Succeeded" if ctx.old.phase == "Succeeded" else "Failed"
    for wl in ctx.state.workloads.get(ctx.key, {}).values():
        if wl.finished or wl.deleting:
            continue
        cond = admission.finished_condition(wl, outcome, now=ctx.now)
        await ctx.state.kube.apply_workload_status(
            admission.condition_apply(wl, cond), admission.FINISHED_FIELD_MANAGER
        )

"""The reconcile of one job: `reconcile_job` takes the newest RLJob under the job's lock, runs
`STEPS` in order and writes the status once.

The shape is KubeRay's: a fixed list of steps (finished?, plan, suspend, preemption, outcome,
backoff, children, volumes, capacity, adapt, admission, gang, pods); each returns what it observed
(`status.Observed`) and may stop the list; one pure `status.compute_status` runs at the tail and
the status is written once, only if it changed; Events follow condition transitions. Any exception
in a step becomes a condition: `errors.RLJobError` with its own reason, anything else as
`InternalError` quoting the exception, retried by the loop. The Kueue, preemption and gang steps
live in `queue_steps`.

Pod failures follow `lifecycle.decide_restart` (pure): a failure counts against
`spec.restartPolicy.backoffLimit` and restarts the gang after an exponential backoff; a
disruption (eviction, preemption, lost node) restarts it at once and is not counted. The new
attempt is written to the status first (it is what marks the old pods stale); the next reconcile
deletes them and creates the new ones. Adaptive mode calls `policy.decide()` on the telemetry
history and reconciles its targets into `<job>-rollout-<j>` pods and `status.rollout.desired*`;
rollout pods follow `elastic.plan_rollout_pods` (pure): above a lowered target they drain until
the driver releases them (or `drainGraceSeconds`), and one whose engine was lost is recreated
alone, never restarting the gang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import secrets
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import kopf
import pydantic

from rljob_operator import api, builders, errors, names
from rljob_operator.builders import environments, network_policy, podgroup
from rljob_operator.decide import admission, elastic, lifecycle, planning, policy, pools
from rljob_operator.estimator import presets
from rljob_operator.kube import adapter, metrics, resync, trace
from rljob_operator.reconcile import guards, status
from rljob_operator.reconcile.context import (
    RETRY_INTERNAL_ERROR_S,
    RETRY_WAITING_S,
    WAIT_FOR_TERMINATION_S,
    Ctx,
    Step,
    delete_pods,
    post,
    post_events,
    spec_of,
    sync_reports,
)
from rljob_operator.reconcile.queue_steps import (
    finish_workloads,
    kueue_managed,
    release_workloads,
    step_admission,
    step_gang,
    step_preemption,
)
from rljob_operator.reconcile.state import State
from rljob_trainer.outputs import telemetry


async def reconcile_job(
    *,
    cause: str,
    name: str,
    namespace: str,
    state: State,
    logger: Any,
    pods_index: kopf.Index,
    telemetry_index: kopf.Index,
    nodes_index: kopf.Index,
) -> float | None:
    """Reconcile one job under its lock; returns when to run again (seconds), or None for the interval."""
    key = names.job_key(namespace, name)
    lock = state.locks.setdefault(key, asyncio.Lock())
    started = time.monotonic()
    trace.mark(key, "lock", cause=cause)
    try:
        async with lock:
            trace.mark(key, "start")
            # The newest RLJob we know, taken inside the lock: the watch's copy or the response to
            # this job's last status write, whichever is newer (`State.remember`), so a lagging
            # watch event never undoes a status just written (restarts, adaptive targets). Only a
            # job never seen is read.
            body = state.latest.get(key)
            if body is None:
                body = await state.kube.read_rljob(namespace, name)
                state.remember(key, body)
            if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
                return None
            raw_status = dict(body.get("status") or {})
            ctx = Ctx(
                state=state,
                key=key,
                job=builders.JobRef(name, namespace, (body.get("metadata") or {}).get("uid")),
                body=body,
                raw_spec=dict(body.get("spec") or {}),
                generation=int(body["metadata"].get("generation") or 0),
                old=api.RLJobStatus.model_validate(raw_status),
                old_raw=raw_status,
                pods=list(pods_index.get((namespace, name), [])),
                telemetry_index=telemetry_index,
                nodes_index=nodes_index,
                logger=logger,
                now=datetime.now(timezone.utc).replace(microsecond=0),
            )
            observed = await run_steps(ctx)
            if observed.error is not None and status.is_retryable(observed.error):
                state.waiting.add(key)
            else:
                state.waiting.discard(key)
            try:
                await _write_status(ctx, observed)
            finally:
                _post_later(ctx)
            if not ctx.api_error:
                state.api_failures.pop(key, None)  # the API answered: the backoff starts afresh
            if ctx.retry_s is not None:
                logger.debug(f"reconcile {key} again in {ctx.retry_s:.1f}s: {ctx.retry_why}")
            return ctx.retry_s
    finally:
        trace.mark(key, "end")
        metrics.RECONCILE_SECONDS.labels(cause).observe(time.monotonic() - started)


def _post_later(ctx: Ctx) -> None:
    """Post the reconcile's Events after it: they never hold a reconcile slot or the job's lock,
    and the API pool serves them after pod creates and status writes (`adapter.PRIORITY_EVENT`)."""
    if not ctx.events:
        return
    task = asyncio.create_task(post_events(ctx), name=f"rljob-events-{ctx.key}")
    ctx.state.posting.add(task)
    task.add_done_callback(ctx.state.posting.discard)


async def run_steps(ctx: Ctx) -> status.Observed:
    """Run `STEPS` in order; any exception stops them and becomes the observed error.

    Known errors (`errors.RLJobError`, a pydantic ValidationError of the spec) carry their own
    reason; anything else is wrapped as `InternalError` naming the step and quoting the exception,
    and kopf retries it. Nothing escapes without the status saying why.
    """
    seen = status.Observed()
    for step in STEPS:
        try:
            seen, stop = await step(ctx, seen)
        except (errors.RLJobError, pydantic.ValidationError) as exc:
            # Retryable ones (a ConfigMap, a claim or nodes that may appear) are looked at again
            # soon (nodes also retry them when they change); the others wait for a new generation.
            if status.is_retryable(exc):
                ctx.retry(RETRY_WAITING_S, f"{_step_label(step)}: {status.reason_for(exc)}")
            return dataclasses.replace(seen, error=exc)
        except Exception as exc:
            if adapter.is_api_error(exc):  # the apiserver said no, or could not be reached
                ctx.logger.warning(f"reconcile step {step.__name__}: API error {type(exc).__name__}: {exc}")
                ctx.back_off(guards.api_backoff_s(ctx.state, ctx.key, exc), f"{step.__name__}: API error")
            else:
                ctx.logger.exception(f"reconcile step {step.__name__} failed")
                ctx.retry(RETRY_INTERNAL_ERROR_S, f"{step.__name__}: {exc}")
            return dataclasses.replace(seen, error=errors.InternalError.wrap(_step_label(step), exc))
        if stop:
            break
    return seen


def _step_label(step: Step) -> str:
    return f"reconcile step {step.__name__.removeprefix('_').removeprefix('step_')}"


# ---- steps ---------------------------------------------------------------------------------------
async def _step_earlier_job(ctx: Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """Pods an earlier RLJob of the same name left (deleted, not yet garbage-collected) are deleted,
    and nothing else happens until they are gone: their exits and steps are another run's."""
    leftovers = lifecycle.left_by_earlier_job(ctx.pods, ctx.uid)
    if not leftovers:
        return seen, False
    await delete_pods(
        ctx, [p.name for p in leftovers if not p.deleting], why="left by an earlier RLJob of this name"
    )
    raise errors.EarlierJobLeftoversError(
        "metadata.name",
        f"pods {', '.join(sorted(p.name for p in leftovers))} belong to an earlier RLJob named "
        f"{ctx.job.name} (deleted, not yet garbage-collected): deleting them; this job starts once "
        "they are gone",
    )


def _spec_failure_fixed(ctx: Ctx) -> bool:
    """A job failed by its spec (it never planned) goes on once a new generation arrives."""
    planned = status.find(ctx.old.conditions, status.PLANNED)
    return (
        ctx.old.phase == "Failed"
        and planned is not None
        and planned.status == "False"
        and (ctx.old.observed_generation or 0) < ctx.generation
    )


async def _step_finished(ctx: Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """A finished job: stop leftover pods, honour ttlSecondsAfterFinished, keep the status."""
    if ctx.old.phase not in api.FINISHED_PHASES or _spec_failure_fixed(ctx):
        return seen, False
    await delete_pods(ctx, lifecycle.pods_to_stop(ctx.pods, keep_finished=True), why="finished")
    await finish_workloads(ctx)
    ttl = ctx.raw_spec.get("ttlSecondsAfterFinished")
    done = ctx.old.completion_time
    if isinstance(ttl, int) and done is not None:
        left_s = done.timestamp() + ttl - ctx.now.timestamp()
        if left_s <= 0:
            post(ctx, "Normal", "TTLExpired", f"deleting the job {ttl}s after it finished")
            # Only this RLJob (its uid): one recreated under the name since has its own TTL.
            await ctx.state.kube.delete_rljob(ctx.job.namespace, ctx.job.name, ctx.uid)
        else:
            ctx.retry(left_s, f"ttlSecondsAfterFinished ends in {left_s:.0f}s")
    return dataclasses.replace(seen, finished=True), True


async def _step_plan(ctx: Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """Parse the spec, read the model config, plan, lay out the pods (cached per generation)."""
    cache = ctx.state.cache_for(ctx.key, ctx.uid)
    if cache.generation == ctx.generation and cache.error is not None:
        raise cache.error  # a spec error waits for a new generation: no API call until then
    try:
        spec = api.RLJobSpec.model_validate(ctx.raw_spec)
        spec = pools.with_pool_defaults(spec, await _pool_catalog(ctx.state.kube))
        bad_name = names.validate_job_name(ctx.job.name)
        if bad_name:
            raise errors.InvalidSpecError("metadata.name", bad_name)
        for i, env in enumerate(spec.environments):
            if why := names.validate_environment_name(ctx.job.name, env.name, env.replicas):
                raise errors.InvalidSpecError(f"spec.environments[{i}].name", why)
        plan, model_config = await _plan(ctx, spec)
    except (errors.RLJobError, pydantic.ValidationError) as exc:
        if not isinstance(exc, errors.RLJobError) or not exc.retryable:
            cache.generation, cache.error, cache.plan = ctx.generation, exc, None
        raise
    ctx.model_config = model_config
    ctx.judge_config = cache.judge_config
    adaptive = spec.resources.mode == "adaptive"
    desired_dedicated = ctx.old.rollout.desired_dedicated_engines if adaptive and ctx.old.rollout else None
    layout = builders.compute_layout(spec, plan, desired_dedicated)
    current = [p for p in ctx.pods if p.attempt == ctx.attempt]
    return dataclasses.replace(seen, spec=spec, plan=plan, layout=layout, pods=current, job=ctx.job), False


async def _step_suspend(ctx: Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """spec.suspend: delete every pod (and the Kueue Workloads, whose quota goes back; resuming
    queues the job again), keep everything else."""
    if not spec_of(seen).suspend:
        return seen, False
    await delete_pods(ctx, lifecycle.pods_to_stop(ctx.pods, keep_finished=False), why="suspend")
    await release_workloads(ctx)
    return dataclasses.replace(seen, suspended=True), True


async def _step_outcome(ctx: Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """Succeeded, failed, disrupted? The pure `lifecycle.decide_restart` says; this step obeys."""
    spec = spec_of(seen)
    nodes = {n.name for n in ctx.nodes_index.get("nodes", [])}
    decision = lifecycle.decide_restart(
        ctx.pods,
        attempt=ctx.attempt,
        failures=ctx.old.failures or 0,
        disruptions=ctx.old.disruptions or 0,
        last_failure=ctx.old.last_failure,
        policy=spec.restart_policy,
        node_names=frozenset(nodes),
        vanished=_vanished_pods(ctx),
    )
    if decision.action == "run":
        return seen, False
    seen = dataclasses.replace(seen, decision=decision)
    if decision.action in ("succeeded", "fail"):
        if decision.action == "succeeded":
            reports = sync_reports(ctx)
            seen = dataclasses.replace(seen, report=reports[-1] if reports else None)
        await delete_pods(ctx, lifecycle.pods_to_stop(ctx.pods, keep_finished=True), why="finished")
        return seen, True
    # restart: the status (written at the tail) carries the new attempt, which is what marks the
    # old pods stale even across a crash; the next reconcile deletes them and waits out the backoff.
    metrics.RESTARTS.inc()
    ctx.retry(WAIT_FOR_TERMINATION_S, f"restart {decision.attempt}: {decision.cause}")
    return seen, True


def _vanished_pods(ctx: Ctx) -> dict[str, str]:
    """Pods of the current attempt seen before and gone now, not deleted by the operator: why.

    A disrupted pod (any role) is named with its DisruptionTarget; a trainer pod that simply
    vanished broke its Ray cluster. A rollout pod that vanished is recreated alone by the pod diff.
    """
    known = ctx.state.known.setdefault(ctx.key, {})
    disrupted = ctx.state.disrupted.setdefault(ctx.key, {})
    ours = ctx.state.deleted.setdefault(ctx.key, set())
    ours.difference_update({(n, a) for n, a in ours if a != ctx.attempt})
    for table in (known, disrupted):  # another attempt's, or an earlier RLJob's of the same name
        for name in [n for n, v in table.items() if v[0] != ctx.attempt or v[-1] != ctx.uid]:
            del table[name]
    present = {p.name for p in ctx.pods if p.attempt == ctx.attempt}
    known.update(dict.fromkeys(present, (ctx.attempt, ctx.uid)))
    out = {}
    for name in sorted(set(known) - present - {n for n, _ in ours}):
        role = names.parse_pod_name(ctx.job.name, name)
        if role is not None and role[0] == names.ROLE_ROLLOUT:
            continue  # a rollout pod is recreated alone by the pod diff, whatever took it
        if name in disrupted:
            out[name] = f"pod {name} was disrupted ({disrupted[name][1]})"
        elif role is not None and role[0] in lifecycle.GANG_ROLES:
            out[name] = (
                f"{role[0]} pod {name} disappeared (deleted outside the operator, or lost with its node)"
            )
    return out


async def _step_backoff(ctx: Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """A pending restart: delete the old attempt's pods, and wait out the backoff after a failure."""
    pending = status.pending_restart(ctx.old)
    if pending is None:
        return seen, False
    since, disruption = pending
    stale = [p.name for p in ctx.pods if p.attempt != ctx.attempt and not p.deleting]
    await delete_pods(ctx, stale, why="restart")
    wait = lifecycle.restart_wait_s(
        since, disruption, ctx.old.failures or 0, spec_of(seen).restart_policy, ctx.now
    )
    if wait > 0:
        ctx.retry(wait, f"restart {ctx.attempt} waits for its backoff")
        return dataclasses.replace(seen, restart_wait_s=wait), True
    return seen, False


async def _step_children(ctx: Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """Everything but pods (once per generation/config; AlreadyExists is success)."""
    spec = spec_of(seen)
    assert seen.plan is not None and seen.layout is not None
    objects = builders.build_job_objects(
        ctx.job,
        spec,
        seen.plan,
        seen.layout,
        ctx.model_config,
        # Used only if the job's Secret does not exist yet (it is immutable; a create that finds it
        # keeps the token its running pods have). Never logged, never in the status.
        ray_token=secrets.token_hex(32),
        network=NETWORK_POLICY,
        endpoint_token=secrets.token_hex(32),  # the same for the endpoint's Secret (mode agent)
        judge_config=ctx.judge_config,
    )
    ctx.config_hash = objects.config_hash
    await _apply_children(ctx, objects)
    return seen, False


def _first_pods_of_attempt(ctx: Ctx) -> bool:
    return not any(p.attempt == ctx.attempt for p in ctx.pods)


async def _step_volumes(ctx: Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """Before an attempt's first pod: every claim exists and every pod that mounts it can. Once the
    scheduler refuses a pod of the attempt: which claims are not bound (the status names them)."""
    first = _first_pods_of_attempt(ctx)
    refused = any(p.attempt == ctx.attempt and p.unschedulable and not p.deleting for p in ctx.pods)
    if not (first or refused):
        return seen, False
    assert seen.layout is not None
    uses = lifecycle.claims_of(spec_of(seen), seen.layout)
    if not uses:
        return seen, False
    claims = {u.claim: await ctx.state.kube.read_pvc(ctx.job.namespace, u.claim) for u in uses}
    if first:
        lifecycle.check_claims(uses, claims, ctx.job.namespace)
        return seen, False
    return dataclasses.replace(seen, unbound_claims=lifecycle.unbound_claims(uses, claims)), False


async def _step_capacity(ctx: Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """Before an attempt's first pod: can the pools ever hold the layout? (Not for a job Kueue
    admits: its flavors add the nodeLabels and tolerations that say where the pods may go.)"""
    if _first_pods_of_attempt(ctx) and not kueue_managed(ctx):
        assert seen.layout is not None
        lifecycle.check_capacity(spec_of(seen), seen.layout, list(ctx.nodes_index.get("nodes", [])))
    return seen, False


async def _step_report_events(ctx: Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """What the driver's SyncReports say that a user should see among the RLJob's Events, once each
    (`status.report_events`): a resume past a corrupt or partial checkpoint (Warning
    CheckpointFallback), a shared engine's wake and what it cost (SharedEngineWoken)."""
    posted = ctx.state.report_events_posted.setdefault(ctx.key, set())
    for report in sync_reports(ctx):
        for type_, reason, message in status.report_events(report):
            if message in posted:
                continue
            queued = len(ctx.events)
            post(ctx, type_, reason, message)
            if len(ctx.events) > queued:  # not rate-limited: the next one goes at a later reconcile
                posted.add(message)
    return seen, False


async def _step_adapt(ctx: Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """The plan refitted from the telemetry (`status.plan.refit`, every mode), and in adaptive mode
    the engine targets it and the history call for (`policy.decide()`)."""
    spec = spec_of(seen)
    reports = sync_reports(ctx)
    seen = dataclasses.replace(seen, report=reports[-1] if reports else None)
    fitted = _refit(ctx, spec, reports)
    if fitted is not None:
        seen = dataclasses.replace(seen, refit=planning.refit_status(fitted.fit))
    if spec.resources.mode != "adaptive" or not reports:
        return seen, False
    assert seen.plan is not None and seen.layout is not None
    rollout = await _adapt(ctx, spec, seen.plan, seen.layout, reports, fitted)
    if rollout is None:
        return seen, False
    layout = builders.compute_layout(spec, seen.plan, rollout.desired_dedicated_engines)
    return dataclasses.replace(seen, rollout=rollout, layout=layout), False


async def _step_pods(ctx: Ctx, seen: status.Observed) -> tuple[status.Observed, bool]:
    """Delete the stale pods, create the missing ones (all at once; the Event lists them in order)."""
    spec = spec_of(seen)
    assert seen.layout is not None
    desired = builders.build_pods(
        ctx.job,
        spec,
        seen.layout,
        attempt=ctx.attempt,
        config_hash=ctx.config_hash,
        model_config=ctx.model_config,
        judge_config=ctx.judge_config,
    )
    desired += environments.build_environment_pods(ctx.job, spec, attempt=ctx.attempt)
    if seen.placements:  # Kueue admitted them: onto the admitted flavors' nodes
        desired = [
            admission.place_pod(d, seen.placements[d["metadata"]["name"]])
            if d["metadata"]["name"] in seen.placements
            else d
            for d in desired
        ]
    if seen.gang is not None and seen.gang[0]:  # members join the job's PodGroup (`step_gang`)
        assert seen.plan is not None
        desired = podgroup.with_gang(desired, podgroup.job_gang(ctx.job, spec, seen.plan, seen.layout))
    seen, elastic_plan = _plan_rollout_pods(ctx, seen)
    held = {names.rollout_pod_name(ctx.job.name, i) for i in elastic_plan.hold}  # backoff: not yet
    desired = [d for d in desired if d["metadata"]["name"] not in held]
    ended = lifecycle.environment_pods_to_replace(ctx.pods, ctx.attempt)
    if ended:
        why = "; ".join(f"{p.name} {p.phase}" + (f" ({p.message})" if p.message else "") for p in ended)
        post(ctx, "Warning", "EnvironmentPodReplaced", f"{why}: recreating it (the trainers keep running)")
    diff = lifecycle.diff_pods(
        desired,
        ctx.pods,
        ctx.attempt,
        keep=elastic_plan.keep,
        replace=[r.name for r in elastic_plan.replace] + [p.name for p in ended],
    )
    lost = {r.name for r in elastic_plan.replace}
    gone = {p.name for p in ended}
    await delete_pods(ctx, [n for n in diff.delete if n not in lost | gone], why="stale")
    await delete_pods(ctx, [n for n in diff.delete if n in lost], why="engine-lost")
    await delete_pods(ctx, [n for n in diff.delete if n in gone], why="environment-ended")
    # Pods this operator created that the watch has not shown yet exist: creating them again
    # would only earn a 409 (`resync.unseen_creates`; forgotten once the watch shows them).
    made_here = ctx.state.created.setdefault(ctx.key, {})
    now_s = time.monotonic()
    in_flight = resync.unseen_creates(
        made_here, attempt=ctx.attempt, seen={p.name for p in ctx.pods}, now=now_s
    )
    for stale in [n for n, (a, when) in made_here.items() if a != ctx.attempt or n not in in_flight]:
        del made_here[stale]
    to_create = [pod for pod in diff.create if pod["metadata"]["name"] not in in_flight]
    for pod in to_create:
        kopf.adopt(pod, owner=ctx.body)
    # Independent objects (each create idempotent): one round trip for all, not one per pod.
    if to_create:
        trace.mark(ctx.key, "pods", count=len(to_create))
    made = await asyncio.gather(*(ctx.state.kube.create(pod) for pod in to_create))
    if to_create:
        trace.mark(ctx.key, "pods-done")
    created = []
    for pod, new in zip(to_create, made, strict=True):
        pod_name = pod["metadata"]["name"]
        if new:
            metrics.PODS_CREATED.labels(pod["metadata"]["labels"][names.LABEL_ROLE]).inc()
            created.append(pod_name)
            made_here[pod_name] = (ctx.attempt, now_s)
    if created:
        ctx.logger.info(f"reconciled {ctx.key}: created pods {', '.join(created)}")
        post(ctx, "Normal", "PodsCreated", f"created {', '.join(created)}")
    if diff.waiting:
        ctx.retry(WAIT_FOR_TERMINATION_S, f"waiting for {', '.join(diff.waiting)} to terminate")
    if any(
        p.role == names.ROLE_ENVIRONMENT and p.phase == "Running" and not p.ready and p.attempt == ctx.attempt
        for p in ctx.pods
    ):
        # A readiness probe that keeps failing changes nothing a watch sees: look again, so the
        # status names a server that never becomes ready (`status.ENVIRONMENT_READINESS_GRACE_S`).
        ctx.retry(status.ENVIRONMENT_READINESS_GRACE_S / 4, "an environment pod is not ready yet")
    starting = tuple(created) + tuple(sorted(in_flight & {p["metadata"]["name"] for p in diff.create}))
    return dataclasses.replace(seen, waiting=diff.waiting + starting), False


def _plan_rollout_pods(ctx: Ctx, seen: status.Observed) -> tuple[status.Observed, elastic.RolloutPodsPlan]:
    """Drains and lone replacements of rollout pods (`elastic.plan_rollout_pods`, pure), their
    Events, and the open drains, replacement count and backoffs for `status.rollout`.

    Extra engines whose Kueue Workload was evicted are below the target already (the admission
    step lowered the layout); here they only get the drain's bounded grace and their Event."""
    spec = spec_of(seen)
    assert seen.layout is not None
    rollout = seen.rollout or ctx.old.rollout or api.RolloutStatus()
    extra = {s.engine: s for s in ctx.state.workloads.get(ctx.key, {}).values() if s.engine is not None}
    mine = [p for p in ctx.pods if p.role == names.ROLE_ROLLOUT and p.attempt == ctx.attempt]
    running = [p.index for p in mine if not p.deleting]
    preempted = admission.evicted_engines(extra, running) if kueue_managed(ctx) else {}
    plan = elastic.plan_rollout_pods(
        ctx.pods,
        attempt=ctx.attempt,
        target=seen.layout.rollout_pods,
        draining=rollout.draining_pods or [],
        reports=sync_reports(ctx),
        grace_s=spec.resources.rollout.drain_grace_seconds,
        now=ctx.now,
        node_names=frozenset(n.name for n in ctx.nodes_index.get("nodes", [])),
        preempted=preempted,
        preempted_grace=elastic.preempted_grace_s(spec),
        backoff=rollout.replacement_backoff or [],
        restart_policy=spec.restart_policy,
    )
    pod = functools.partial(names.pod_name, ctx.job.name, names.ROLE_ROLLOUT)
    started = sorted({d.index for d in plan.draining} - {d.index for d in rollout.draining_pods or []})
    # One Event for all drains begun now (Events are limited to one per reason and interval).
    drains = [
        f"{pod(i)}: {preempted[i]}: draining, deleted once the driver releases it or within "
        f"{elastic.preempted_grace_s(spec):.0f}s (min of drainGraceSeconds and checkpointGraceSeconds)"
        for i in started
        if i in preempted
    ]
    if plain := [i for i in started if i not in preempted]:
        drains.append(f"{', '.join(map(pod, plain))}: draining, deleted once the driver releases it")
    if drains:
        post(ctx, "Normal", "RolloutPodDraining", "; ".join(drains))
    if plan.released:
        what = ", ".join(map(pod, plan.released))
        post(ctx, "Normal", "RolloutPodReleased", f"the driver released {what}: deleting it")
    if plan.expired:
        what = ", ".join(map(pod, plan.expired))
        post(
            ctx,
            "Normal",
            "RolloutPodDrained",
            f"{what}: not running, or no release within its drain grace: deleting it",
        )
    if plan.replace:
        why = "; ".join(r.why for r in plan.replace)
        post(ctx, "Warning", "RolloutPodReplaced", f"{why}: recreating it alone (the trainers keep running)")
    for r in plan.replace:
        if r.not_before is not None and r.not_before > ctx.now:
            wait = (r.not_before - ctx.now).total_seconds()
            post(
                ctx,
                "Warning",
                "RolloutPodBackoff",
                f"{r.name} lost its engine {r.replacements} times in a row: its replacement waits "
                f"{wait:.0f}s, until {r.not_before.strftime('%Y-%m-%dT%H:%M:%SZ')} (spec.restartPolicy "
                "backoff; the trainers keep running)",
            )
    if plan.retry_s is not None:
        ctx.retry(plan.retry_s, "a rollout pod's drain grace or replacement backoff ends")
    update: dict[str, Any] = {
        "draining_pods": list(plan.draining) or None,
        "replacement_backoff": list(plan.backoff) or None,
    }
    if plan.replace:
        update["replaced_pods"] = (rollout.replaced_pods or 0) + len(plan.replace)
    before = (rollout.draining_pods or None, rollout.replacement_backoff or None)
    if before != (update["draining_pods"], update["replacement_backoff"]) or plan.replace:
        seen = dataclasses.replace(seen, rollout=rollout.model_copy(update=update))
    return seen, plan


#: The reconcile, in order. Each step returns what it observed; `compute_status` reads it all once.
STEPS: tuple[Step, ...] = (
    _step_earlier_job,
    _step_finished,
    _step_plan,
    _step_suspend,
    step_preemption,
    _step_outcome,
    _step_backoff,
    _step_children,
    _step_volumes,
    _step_capacity,
    _step_report_events,
    _step_adapt,
    step_admission,
    step_gang,
    _step_pods,
)


# ---- step helpers --------------------------------------------------------------------------------
async def _model_config(
    ctx: Ctx, src: api.ModelConfigSource, where: str = "spec.model.config"
) -> dict[str, Any]:
    """The config.json of `src` (spec.model.config, or spec.reward.judge.model.config: `where`)."""
    if src.inline is not None:
        return dict(src.inline)
    if src.preset is not None:
        return presets.load_preset(src.preset)
    ref = src.config_map_ref
    if ref is None:
        raise errors.InvalidSpecError(where, "set one of preset, inline or configMapRef")
    field = f"{where}.configMapRef"
    cm = await ctx.state.kube.read_config_map(ctx.job.namespace, ref.name)
    if cm is None:
        raise errors.ModelConfigUnreadableError(
            field,
            f"ConfigMap {ref.name!r} not found in namespace {ctx.job.namespace!r}: create it "
            f"(kubectl create configmap {ref.name} --from-file={ref.key}=config.json) or fix the name",
        )
    text = (cm.get("data") or {}).get(ref.key)
    if text is None:
        raise errors.ModelConfigUnreadableError(
            field,
            f"ConfigMap {ref.name!r} has no key {ref.key!r} (keys: {sorted(cm.get('data') or {})}): fix .key",
        )
    try:
        parsed = json.loads(text)
    except ValueError as exc:
        raise errors.ModelConfigUnreadableError(
            field,
            f"ConfigMap {ref.name!r} key {ref.key!r} is not JSON ({exc}): store config.json there",
        ) from exc
    if not isinstance(parsed, dict):
        raise errors.ModelConfigUnreadableError(
            field, f"key {ref.key!r} must hold a JSON object (config.json)"
        )
    return parsed


def _compute_plan(
    spec: api.RLJobSpec, model_config: dict[str, Any], judge_config: dict[str, Any] | None = None
) -> api.PlanStatus:
    """The estimator's plan (`planning.plan_job`: spec -> PlanRequest -> ResourcePlan), with the judge's
    engines (`planning.plan_judge`) when the job has one, as a PlanStatus.

    Estimator errors carry their own reason; anything else is a bug and surfaces as InternalError.
    """
    return planning.plan_status(
        planning.plan_job(spec, model_config), planning.plan_judge(spec, judge_config)
    )


async def _plan(ctx: Ctx, spec: api.RLJobSpec) -> tuple[api.PlanStatus, dict[str, Any]]:
    cache = ctx.state.cache_for(ctx.key, ctx.uid)
    if cache.generation == ctx.generation and cache.plan is not None and cache.model_config is not None:
        return cache.plan, cache.model_config
    model_config = await _model_config(ctx, spec.model.config)
    judge_source = planning.judge_config_source(spec)
    judge_config = (
        await _model_config(ctx, judge_source, "spec.reward.judge.model.config")
        if judge_source is not None
        else None
    )
    plan = await guards.plan_off_loop(functools.partial(_compute_plan, spec, model_config, judge_config))
    cache.generation, cache.plan, cache.model_config, cache.applied = ctx.generation, plan, model_config, None
    cache.judge_config = judge_config
    cache.error = None
    return plan, model_config


async def _apply_children(ctx: Ctx, objects: builders.JobObjects) -> None:
    cache = ctx.state.cache_for(ctx.key, ctx.uid)
    if cache.applied == objects.config_hash:
        return
    children = [dict(obj) for obj in objects.children]  # the telemetry ConfigMap: the driver owns its data
    config_map = dict(objects.config_map)
    for obj in [*children, config_map]:
        kopf.adopt(obj, owner=ctx.body)
    # Independent objects: create them concurrently (each is idempotent on its own).
    kube = ctx.state.kube
    trace.mark(ctx.key, "children")
    existed = await asyncio.gather(*(kube.create(obj) for obj in [*children, config_map]))
    trace.mark(ctx.key, "children-done")
    # A name already taken is ours (an operator restart) or an earlier RLJob's of the same name, not
    # yet collected: the garbage collector would delete that one under this job later, so this job
    # waits to create its own.
    taken = [obj for obj, created in zip([*children, config_map], existed, strict=True) if not created]
    owners = await asyncio.gather(*(kube.foreign_owner(o) for o in taken))
    foreign = [(o, owner) for o, owner in zip(taken, owners, strict=True) if owner is not None]
    if foreign:
        raise errors.EarlierJobLeftoversError("metadata.name", _leftovers_message(ctx, foreign))
    if any(obj is config_map for obj in taken):
        await kube.apply_config_map(config_map)  # ours from before: its data as this spec has it
    cache.applied = objects.config_hash


def _leftovers_message(ctx: Ctx, foreign: Sequence[tuple[dict[str, Any], str]]) -> str:
    owned = [o for o, owner in foreign if owner]
    orphans = [o for o, owner in foreign if not owner]
    parts = []
    if owned:
        what = ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in owned)
        parts.append(
            f"{what} belong to an earlier RLJob named {ctx.job.name} (deleted, not yet garbage-collected): "
            "this job creates its own once the garbage collector has deleted them"
        )
    if orphans:
        what = " ".join(f"{o['kind'].lower()}/{o['metadata']['name']}" for o in orphans)
        parts.append(
            f"{what} have no owner (left by kubectl delete --cascade=orphan of an earlier RLJob named "
            f"{ctx.job.name}), so nothing deletes them: delete them (kubectl delete -n {ctx.job.namespace} "
            f"{what}) and this job creates its own"
        )
    return "; ".join(parts)


def _refit(ctx: Ctx, spec: api.RLJobSpec, reports: list[telemetry.SyncReport]) -> planning.JobRefit | None:
    """The plan refitted from the reports, recomputed only when a new report arrived (cached)."""
    cache = ctx.state.cache_for(ctx.key, ctx.uid)
    if not reports or cache.model_config is None:
        return None
    key = (ctx.generation, reports[-1].step, reports[-1].time)
    if cache.refit is None or cache.refit[0] != key:
        try:
            cache.refit = (key, planning.refit_job(spec, cache.model_config, reports))
        except errors.EstimatorError as exc:  # the plan itself planned: a refit that cannot is no failure
            ctx.logger.warning(f"refitting the plan from the job's reports failed: {exc}")
            cache.refit = (key, None)
    return cache.refit[1]


async def _adapt(
    ctx: Ctx,
    spec: api.RLJobSpec,
    plan: api.PlanStatus,
    layout: builders.JobLayout,
    reports: list[telemetry.SyncReport],
    fitted: planning.JobRefit | None = None,
) -> api.RolloutStatus | None:
    """Call `policy.decide()`; the new targets (None: no change) are persisted with the status."""
    rollout = ctx.old.rollout or api.RolloutStatus()
    last = rollout.last_decision_time.timestamp() if rollout.last_decision_time else None
    shared_total = plan.shared_engines or 0
    state = policy.RolloutState(
        shared_engines_total=shared_total,
        shared_engines_awake=min(rollout.desired_shared_awake or 0, shared_total),
        dedicated_engines=layout.rollout_pods,
        planned_dedicated_engines=plan.rollout_engines or 0,
        idle_accelerators=layout.idle_accelerators,
        accelerators_per_engine=plan.tensor_parallel or 1,
        last_action_time_s=last,
    )
    settings = policy.PolicySettings.from_adaptive_spec(spec.resources.adaptive)
    most = shared_total + layout.rollout_pods + layout.idle_accelerators // state.accelerators_per_engine
    curve = fitted.engine_curve(most) if fitted is not None else None
    decision = policy.decide(state, reports, settings, ctx.now.timestamp(), refit=curve)
    if decision.action == "none":
        return None
    metrics.DECISIONS.labels(decision.action).inc()
    ctx.logger.info(f"adaptive decision {decision.action}: {decision.reason}")
    post(ctx, "Normal", f"Adaptive{_camel(decision.action)}", decision.reason)
    return rollout.model_copy(
        update={
            "desired_shared_awake": decision.desired_shared_awake,
            "desired_dedicated_engines": decision.desired_dedicated_engines,
            "last_decision": _camel(decision.action),
            "last_decision_reason": decision.reason[:1024],
            "last_decision_time": ctx.now,
        }
    )


def _camel(action: str) -> str:
    return "".join(part.capitalize() for part in action.split("_"))


async def _write_status(ctx: Ctx, observed: status.Observed) -> None:
    """The reconcile's one status write: compute, write only if changed, post Events on transitions.

    A starting job's change (its pods coming up, still Pending) may wait for the next pod event,
    at most `resync.STATUS_COALESCE_S` (`resync.defer_status`): not one write per pod event; a
    retry is scheduled for the deadline. The first status is written at once."""
    new = status.compute_status(ctx.old, observed, generation=ctx.generation, now=ctx.now)
    patch = status.status_patch(ctx.old_raw, new)
    if patch is not None and _defer_status(ctx, observed, new):
        return
    ctx.state.unwritten.pop(ctx.key, None)
    if patch is not None:
        written = await guards.write_status(ctx.state.kube, ctx.body, new, patch)
        if written is None:
            return  # the RLJob is gone
        ctx.state.remember(ctx.key, written)
        known = {c.type for c in ctx.old.conditions}
        for cond in status.transitions(ctx.old.conditions, new.conditions):
            kind = status.event_type(cond)
            if cond.type in known or kind == "Warning":  # a condition's first Normal value is no news
                post(ctx, kind, cond.reason, cond.message or f"{cond.type}={cond.status}")
    if new.phase:
        ctx.state.phases[ctx.key] = new.phase
        metrics.set_phase_counts(ctx.state.phases)


def _defer_status(ctx: Ctx, observed: status.Observed, new: api.RLJobStatus) -> bool:
    """Whether this changed status waits for the next reconcile (then a retry is asked for)."""
    ready = status.find(new.conditions, status.READY)
    starting = (
        observed.error is None
        and observed.decision is None
        and observed.rollout is None
        and ready is not None
        and ready.reason == "PodsPending"
        and (new.restarts or 0) == ctx.attempt
    )
    since = ctx.state.unwritten.get(ctx.key)
    now_s = time.monotonic()
    if not resync.defer_status(
        old_phase=ctx.old.phase, new_phase=new.phase, starting=starting, deferred_since=since, now=now_s
    ):
        return False
    since = ctx.state.unwritten.setdefault(ctx.key, now_s)
    ctx.retry(since + resync.STATUS_COALESCE_S - now_s, "a starting job's status is written")
    return True


# ---- every job's NetworkPolicy, as the chart sets it (values.yaml jobNetworkPolicy) ---------------
NETWORK_POLICY = network_policy.parse_settings(os.environ.get(network_policy.SETTINGS_ENV))


# ---- node-pool defaults (the chart's pools ConfigMap, rljob_operator.decide.pools) ----------------------
POOLS_CONFIGMAP = os.environ.get("RLJOB_POOLS_CONFIGMAP", "")  # "<namespace>/<name>"; empty: no pools
POOLS_REFRESH_S = 10.0
_pools_read: list[tuple[float, pools.PoolCatalog]] = []


async def _pool_catalog(kube_: adapter.Kube) -> pools.PoolCatalog:
    """The chart-rendered pool defaults, re-read at most every POOLS_REFRESH_S (helm upgrade applies)."""
    if not POOLS_CONFIGMAP:
        return pools.PoolCatalog()
    if _pools_read and time.monotonic() - _pools_read[0][0] < POOLS_REFRESH_S:
        return _pools_read[0][1]
    namespace, _, name = POOLS_CONFIGMAP.partition("/")
    cm = await kube_.read_config_map(namespace, name)
    catalog = pools.parse_pool_catalog(((cm or {}).get("data") or {}).get(pools.POOLS_KEY))
    _pools_read[:] = [(time.monotonic(), catalog)]
    return catalog

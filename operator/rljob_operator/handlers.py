"""kopf handlers: the operator's imperative shell and the only module that calls the Kubernetes API.

Role: one level-based reconcile (`_reconcile`) run on create, resume, spec update and on a timer,
serialized per job by an `asyncio.Lock` keyed by `names.job_key()`. Each run: parse the spec
(`api.RLJobSpec.model_validate`) → read the model config → plan → build (pure builders) → apply
idempotently (AlreadyExists is success; pods are created in index order under deterministic names,
so a crash between two steps never duplicates anything) → compute the status (pure `status`) and
write it through the status subresource only when it changed → post Events on transitions.

Observations come from kopf indexes (pods, telemetry ConfigMaps and nodes are watched, not
listed), so a reconcile that finds nothing to do makes no API call. Pod failures follow
`spec.restartPolicy`: the restart count is written first (it is the run attempt stamped on pods),
then the old attempt's pods are deleted, and the new ones are created after an exponential
backoff signalled with `kopf.TemporaryError(delay=...)`. Adaptive mode calls `policy.decide()` on
the telemetry history and reconciles its targets into `<job>-rollout-<j>` pods and
`status.rollout.desired*`. Semantic errors become conditions; nothing here crash-loops.

Entry point: `run_operator(namespace)` (used by `rljob operator`), or
`kopf run --standalone -m rljob_operator.handlers [--namespace NS | -A]`.
Environment (read once, here in the shell): `RLJOB_RECONCILE_INTERVAL_S` (timer, default 10),
`RLJOB_METRICS_PORT` (default 8080, 0 disables), `RLJOB_EVENT_INTERVAL_S` (Event rate limit, 30).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

import kopf
import kubernetes
from kubernetes.client.rest import ApiException

from rljob_operator import api, builders, errors, metrics, names, planning, policy, pools, reconcile, status
from rljob_operator.estimator import errors as estimator_errors
from rljob_operator.estimator import presets
from rljob_trainer import telemetry

RECONCILE_INTERVAL_S = float(os.environ.get("RLJOB_RECONCILE_INTERVAL_S", "10"))
METRICS_PORT = int(os.environ.get("RLJOB_METRICS_PORT", "8080"))
EVENT_MIN_INTERVAL_S = float(os.environ.get("RLJOB_EVENT_INTERVAL_S", "30"))
API_THREADS = 16
# A terminating pod still holds its name; check again soon rather than at the next timer tick.
WAIT_FOR_TERMINATION_S = 1.0
RETRY_SEMANTIC_ERROR_S = 30.0
CANCELLATION_POLLING_S = 1.0

RLJOBS = (api.GROUP, api.VERSION, api.PLURAL)


# ---- the API edge --------------------------------------------------------------------------------
class Kube:
    """Thin async wrapper over the synchronous `kubernetes` client (calls run in a thread pool).

    Counts every request in `metrics.API_REQUESTS` and every failure in `metrics.API_ERRORS`;
    `create` treats 409 AlreadyExists and `delete` treats 404 NotFound as success.
    """

    def __init__(self, client: kubernetes.client.ApiClient, executor: concurrent.futures.Executor) -> None:
        self.client = client
        self.executor = executor
        self.core = kubernetes.client.CoreV1Api(client)
        self.rbac = kubernetes.client.RbacAuthorizationV1Api(client)
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self._creators: dict[str, Callable[..., Any]] = {
            "Pod": self.core.create_namespaced_pod,
            "Service": self.core.create_namespaced_service,
            "ConfigMap": self.core.create_namespaced_config_map,
            "ServiceAccount": self.core.create_namespaced_service_account,
            "Role": self.rbac.create_namespaced_role,
            "RoleBinding": self.rbac.create_namespaced_role_binding,
        }

    @classmethod
    def from_environment(cls) -> Kube:
        """KUBECONFIG (or ~/.kube/config) when present, else the in-cluster ServiceAccount."""
        cfg = kubernetes.client.Configuration()
        # The kubernetes package reads $KUBECONFIG at import time; read it now instead.
        path = (os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")).split(os.pathsep)[0]
        if os.path.exists(path):
            kubernetes.config.load_kube_config(config_file=path, client_configuration=cfg)
        else:
            kubernetes.config.load_incluster_config(client_configuration=cfg)
        cfg.connection_pool_maxsize = API_THREADS * 2
        executor = concurrent.futures.ThreadPoolExecutor(API_THREADS, thread_name_prefix="rljob-api")
        return cls(kubernetes.client.ApiClient(cfg), executor)

    def close(self) -> None:
        self.executor.shutdown(wait=False)
        self.client.close()

    async def call(self, verb: str, kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn(*args, **kwargs)` without deserializing the response; returns the decoded JSON."""
        metrics.API_REQUESTS.labels(verb, kind).inc()

        def invoke() -> Any:
            resp = fn(*args, _preload_content=False, **kwargs)
            data = resp.data
            return json.loads(data) if data else None

        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, invoke)
        except ApiException as exc:
            if not ((verb == "create" and exc.status == 409) or (verb == "delete" and exc.status == 404)):
                metrics.API_ERRORS.labels(verb, kind, str(exc.status)).inc()
            raise

    async def create(self, obj: dict[str, Any]) -> bool:
        """Create `obj`; True when created, False when it already existed."""
        kind = obj["kind"]
        try:
            await self.call("create", kind, self._creators[kind], obj["metadata"]["namespace"], obj)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def delete_pod(self, namespace: str, name: str) -> bool:
        try:
            await self.call("delete", "Pod", self.core.delete_namespaced_pod, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def read_config_map(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.call("get", "ConfigMap", self.core.read_namespaced_config_map, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def apply_config_map(self, obj: dict[str, Any]) -> None:
        """Create the ConfigMap, or replace its data when it differs (spec change)."""
        if await self.create(obj):
            return
        meta = obj["metadata"]
        current = await self.read_config_map(meta["namespace"], meta["name"])
        if current is not None and current.get("data") == obj["data"]:
            return
        await self.call(
            "patch",
            "ConfigMap",
            self.core.patch_namespaced_config_map,
            meta["name"],
            meta["namespace"],
            {"data": obj["data"]},
        )

    async def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        await self.call(
            "patch",
            "RLJob",
            self.custom.patch_namespaced_custom_object_status,
            api.GROUP,
            api.VERSION,
            namespace,
            api.PLURAL,
            name,
            {"status": patch},
        )

    async def delete_rljob(self, namespace: str, name: str) -> None:
        try:
            await self.call(
                "delete",
                "RLJob",
                self.custom.delete_namespaced_custom_object,
                api.GROUP,
                api.VERSION,
                namespace,
                api.PLURAL,
                name,
                body={"propagationPolicy": "Background"},
            )
        except ApiException as exc:
            if exc.status != 404:
                raise


# ---- per-operator state (kopf memo: one per running operator, so one per event loop) -------------
@dataclasses.dataclass
class Cache:
    """What a reconcile may reuse: the plan per generation, the children applied per config."""

    generation: int | None = None
    model_config: dict[str, Any] | None = None
    plan: api.PlanStatus | None = None
    applied: str | None = None  # hash of the non-pod children last applied


@dataclasses.dataclass
class State:
    kube: Kube
    locks: dict[str, asyncio.Lock] = dataclasses.field(default_factory=dict)
    caches: dict[str, Cache] = dataclasses.field(default_factory=dict)
    events: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)
    phases: dict[str, str] = dataclasses.field(default_factory=dict)


def _state(memo: kopf.Memo) -> State:
    state = memo.get("rljob")
    if not isinstance(state, State):
        raise kopf.TemporaryError("the operator is still starting (no API client yet)", delay=1)
    return state


# ---- startup, indexes ----------------------------------------------------------------------------
@kopf.on.startup()
async def rljob_startup(
    settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """All kopf settings in one place, the API client, and the metrics endpoint."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.KOPF_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = names.FINALIZER
    # Our own Events are explicit (kopf.event); log lines become Events only from WARNING up.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = names.MANAGED_BY
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.execution.max_workers = API_THREADS
    # kopf releases the finalizer of a deleted RLJob only once its timer has exited, and re-checks an
    # exiting timer every `cancellation_polling` seconds (default 60). The timer is often still
    # running when the deletion arrives (it is what deletes a job whose TTL expired), so poll soon.
    settings.background.cancellation_polling = CANCELLATION_POLLING_S
    memo["rljob"] = State(kube=Kube.from_environment())
    if metrics.start_metrics_server(METRICS_PORT):
        logger.info(f"metrics on :{METRICS_PORT}/metrics")


@kopf.on.login()
def rljob_login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """Credentials from $KUBECONFIG read now (kopf's client-library login reads it at import time),
    else the in-cluster ServiceAccount."""
    if os.environ.get("KUBECONFIG") or os.path.exists(os.path.expanduser("~/.kube/config")):
        return kopf.login_with_kubeconfig(**kwargs)
    return kopf.login_with_service_account(**kwargs)


@kopf.on.cleanup()
async def rljob_cleanup(memo: kopf.Memo, **_: Any) -> None:
    state = memo.get("rljob")
    if isinstance(state, State):
        state.kube.close()


@kopf.index("pods", labels={names.LABEL_JOB: kopf.PRESENT, names.LABEL_MANAGED_BY: names.MANAGED_BY})
def rljob_pods(body: kopf.Body, namespace: str, labels: kopf.Labels, **_: Any) -> Any:
    """Pods of every job, by (namespace, job): the reconcile's view of its pods (no LIST calls)."""
    obs = reconcile.observe_pod(body)
    return {(namespace, labels[names.LABEL_JOB]): obs} if obs is not None else None


@kopf.index("configmaps", labels={names.LABEL_ROLE: names.ROLE_TELEMETRY})
def rljob_telemetry(body: kopf.Body, namespace: str, labels: kopf.Labels, **_: Any) -> Any:
    """The raw `reports.json` of every job's telemetry ConfigMap, by (namespace, job)."""
    job = labels.get(names.LABEL_JOB)
    if job is None:
        return None
    return {(namespace, job): (body.get("data") or {}).get(telemetry.REPORTS_KEY, "")}


@kopf.index("nodes")
def rljob_nodes(body: kopf.Body, **_: Any) -> Any:
    """Every node's labels, taints and allocatable resources, for the capacity check."""
    return {"nodes": reconcile.observe_node(body)}


# ---- the handlers --------------------------------------------------------------------------------
def _handler_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    keys = ("body", "spec", "meta", "name", "namespace", "memo", "logger")
    out = {k: kwargs[k] for k in keys}
    out["status_raw"] = kwargs["status"]
    out["pods_index"] = kwargs["rljob_pods"]
    out["telemetry_index"] = kwargs["rljob_telemetry"]
    out["nodes_index"] = kwargs["rljob_nodes"]
    return out


@kopf.on.create(*RLJOBS)
async def rljob_create(**kwargs: Any) -> None:
    await _reconcile(cause="create", **_handler_kwargs(kwargs))


@kopf.on.resume(*RLJOBS)
async def rljob_resume(**kwargs: Any) -> None:
    await _reconcile(cause="resume", **_handler_kwargs(kwargs))


@kopf.on.update(*RLJOBS, field="spec")
async def rljob_update(**kwargs: Any) -> None:
    await _reconcile(cause="update", **_handler_kwargs(kwargs))


@kopf.timer(*RLJOBS, interval=RECONCILE_INTERVAL_S, initial_delay=RECONCILE_INTERVAL_S)
async def rljob_timer(**kwargs: Any) -> None:
    """Level-based resync: pod phases, failures, backoff ends, telemetry → decide(), TTL."""
    await _reconcile(cause="timer", **_handler_kwargs(kwargs))


@kopf.on.delete(*RLJOBS, optional=True)
async def rljob_delete(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """Children go through their owner references and the garbage collector; forget our caches."""
    state = memo.get("rljob")
    if isinstance(state, State):
        key = names.job_key(namespace, name)
        state.caches.pop(key, None)
        state.locks.pop(key, None)
        state.phases.pop(key, None)
        metrics.set_phase_counts(state.phases)


# ---- reconcile -----------------------------------------------------------------------------------
async def _reconcile(*, cause: str, name: str, namespace: str, memo: kopf.Memo, **kwargs: Any) -> None:
    state = _state(memo)
    key = names.job_key(namespace, name)
    lock = state.locks.setdefault(key, asyncio.Lock())
    started = time.monotonic()
    try:
        async with lock:
            await _reconcile_locked(state=state, key=key, name=name, namespace=namespace, **kwargs)
    finally:
        metrics.RECONCILE_SECONDS.labels(cause).observe(time.monotonic() - started)


@dataclasses.dataclass
class _Ctx:
    """One reconcile's inputs, passed between its steps."""

    state: State
    key: str
    job: builders.JobRef
    body: kopf.Body
    generation: int
    old: api.RLJobStatus
    old_raw: dict[str, Any]
    pods: list[reconcile.PodObservation]
    logger: Any
    now: datetime


async def _reconcile_locked(
    *,
    state: State,
    key: str,
    name: str,
    namespace: str,
    body: kopf.Body,
    spec: kopf.Spec,
    meta: kopf.Meta,
    status_raw: kopf.Status,
    logger: Any,
    pods_index: kopf.Index,
    telemetry_index: kopf.Index,
    nodes_index: kopf.Index,
) -> None:
    if meta.get("deletionTimestamp"):
        return
    old_raw = dict(status_raw or {})
    ctx = _Ctx(
        state=state,
        key=key,
        job=builders.JobRef(name, namespace),
        body=body,
        generation=int(meta.get("generation") or 0),
        old=api.RLJobStatus.model_validate(old_raw),
        old_raw=old_raw,
        pods=list(pods_index.get((namespace, name), [])),
        logger=logger,
        now=datetime.now(timezone.utc).replace(microsecond=0),
    )
    if ctx.old.phase in api.FINISHED_PHASES:
        await _finished(ctx, dict(spec))
        return

    # 1. parse, read the model config, plan.
    try:
        job_spec = api.RLJobSpec.model_validate(dict(spec))
        job_spec = pools.with_pool_defaults(job_spec, await _pool_catalog(ctx.state.kube))
        bad_name = names.validate_job_name(name)
        if bad_name:
            raise errors.InvalidSpecError("metadata.name", bad_name)
        plan, model_config = await _plan(ctx, job_spec)
    except Exception as exc:  # every semantic error becomes a condition, never a crash loop
        await _write_status(ctx, status.Situation("error", error=exc))
        return

    adaptive = job_spec.resources.mode == "adaptive"
    desired_dedicated = ctx.old.rollout.desired_dedicated_engines if adaptive and ctx.old.rollout else None
    layout = builders.compute_layout(job_spec, plan, desired_dedicated)
    attempt = ctx.old.restarts or 0
    common = {"spec": job_spec, "plan": plan, "layout": layout}

    # 2. suspend: delete every pod, keep everything else.
    if job_spec.suspend:
        await _delete_pods(ctx, reconcile.pods_to_stop(ctx.pods, keep_finished=False), why="suspend")
        await _write_status(ctx, status.Situation("suspended", restarts=attempt), **common)
        return

    # 3. the run's outcome so far.
    outcome = reconcile.assess_pods(ctx.pods, attempt)
    if outcome.succeeded:
        # The final report too: a run shorter than the timer interval would end with no step/reward.
        reports = _reports(ctx, telemetry_index)
        await _write_status(
            ctx,
            status.Situation("succeeded", restarts=attempt),
            report=reports[-1] if reports else None,
            **common,
        )
        await _delete_pods(ctx, reconcile.pods_to_stop(ctx.pods, keep_finished=True), why="finished")
        return
    if outcome.failed_pod is not None:
        rp = job_spec.restart_policy
        if rp.policy == "Never" or attempt >= rp.backoff_limit:
            situation = status.Situation(
                "failed",
                failed_pod=outcome.failed_pod,
                restarts=attempt,
                backoff_limit_exceeded=rp.policy != "Never",
            )
            await _write_status(ctx, situation, **common)
            await _delete_pods(ctx, reconcile.pods_to_stop(ctx.pods, keep_finished=True), why="finished")
            return
        # Write the new attempt first: it is what marks the old pods stale, even after a crash.
        await _write_status(
            ctx, status.Situation("backoff", failed_pod=outcome.failed_pod, restarts=attempt + 1), **common
        )
        metrics.RESTARTS.inc()
        await _delete_pods(ctx, [p.name for p in ctx.pods if not p.deleting], why="restart")
        raise kopf.TemporaryError(
            f"pod {outcome.failed_pod.name} failed; restart {attempt + 1} after backoff",
            delay=reconcile.backoff_s(attempt + 1, rp),
        )

    # 4. backoff after a failure still running?
    failed_at = status.restart_due_at(ctx.old)
    if failed_at is not None:
        remaining = (
            failed_at.timestamp()
            + reconcile.backoff_s(attempt, job_spec.restart_policy)
            - ctx.now.timestamp()
        )
        stale = [p.name for p in ctx.pods if p.attempt != attempt and not p.deleting]
        await _delete_pods(ctx, stale, why="restart")
        if remaining > 0:
            raise kopf.TemporaryError(f"restart {attempt} waits for its backoff", delay=remaining)

    # 5. children other than pods (once per generation/config; AlreadyExists is success).
    config_map = builders.build_config_map(ctx.job, job_spec, plan, model_config)
    config_hash = builders.content_hash(config_map["data"])
    await _apply_children(ctx, config_map, config_hash)

    # 6. capacity: only before the first pod of an attempt exists ("can this ever fit?").
    if not any(p.attempt == attempt for p in ctx.pods):
        nodes = list(nodes_index.get("nodes", []))
        try:
            reconcile.check_capacity(job_spec, layout, nodes)
        except errors.InsufficientCapacityError as exc:
            await _write_status(ctx, status.Situation("error", error=exc, restarts=attempt), **common)
            return

    # 7. adaptive: turn the telemetry history into engine targets.
    reports = _reports(ctx, telemetry_index)
    if adaptive and reports:
        layout = await _adapt(ctx, job_spec, plan, layout, reports)
        common["layout"] = layout

    # 8. pods: delete the stale, create the missing in index order.
    desired = builders.build_pods(ctx.job, job_spec, layout, attempt=attempt, config_hash=config_hash)
    diff = reconcile.diff_pods(desired, ctx.pods, attempt)
    await _delete_pods(ctx, diff.delete, why="stale")
    created = []
    for pod in diff.create:
        kopf.adopt(pod, owner=ctx.body)
        if await ctx.state.kube.create(pod):
            metrics.PODS_CREATED.labels(pod["metadata"]["labels"][names.LABEL_ROLE]).inc()
            created.append(pod["metadata"]["name"])
    if created:
        _post(ctx, "Normal", "PodsCreated", f"created {', '.join(created)}")
    waiting = diff.waiting + tuple(created)
    await _write_status(
        ctx,
        status.Situation("progressing", restarts=attempt, waiting=waiting),
        report=reports[-1] if reports else None,
        **common,
    )
    if diff.waiting:
        raise kopf.TemporaryError(
            f"waiting for {', '.join(diff.waiting)} to terminate", delay=WAIT_FOR_TERMINATION_S
        )


# ---- steps ---------------------------------------------------------------------------------------
async def _model_config(ctx: _Ctx, spec: api.RLJobSpec) -> dict[str, Any]:
    src = spec.model.config
    if src.inline is not None:
        return dict(src.inline)
    if src.preset is not None:
        return presets.load_preset(src.preset)
    ref = src.config_map_ref
    if ref is None:
        raise errors.InvalidSpecError("spec.model.config", "set one of preset, inline or configMapRef")
    field = "spec.model.config.configMapRef"
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


def _compute_plan(spec: api.RLJobSpec, model_config: dict[str, Any]) -> api.PlanStatus:
    """The estimator's plan (`planning.plan_job`: spec → PlanRequest → ResourcePlan) as a PlanStatus."""
    try:
        return planning.plan_status(planning.plan_job(spec, model_config))
    except estimator_errors.EstimatorError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        message = f"the estimator could not plan this job: {exc}"
        raise errors.ModelDoesNotFitError("spec.resources", message) from exc


async def _plan(ctx: _Ctx, spec: api.RLJobSpec) -> tuple[api.PlanStatus, dict[str, Any]]:
    cache = ctx.state.caches.setdefault(ctx.key, Cache())
    if cache.generation == ctx.generation and cache.plan is not None and cache.model_config is not None:
        return cache.plan, cache.model_config
    model_config = await _model_config(ctx, spec)
    plan = _compute_plan(spec, model_config)
    cache.generation, cache.plan, cache.model_config, cache.applied = ctx.generation, plan, model_config, None
    return plan, model_config


async def _apply_children(ctx: _Ctx, config_map: dict[str, Any], config_hash: str) -> None:
    cache = ctx.state.caches.setdefault(ctx.key, Cache())
    if cache.applied == config_hash:
        return
    job, kube = ctx.job, ctx.state.kube
    children = [
        builders.build_service_account(job.name, job.namespace),
        builders.build_role(job.name, job.namespace),
        builders.build_role_binding(job.name, job.namespace),
        builders.build_headless_service(job),
        builders.build_telemetry_config_map(job),  # create-only: the driver owns its data
    ]
    for obj in [*children, config_map]:
        kopf.adopt(obj, owner=ctx.body)
    # Independent objects: create them concurrently (each is idempotent on its own).
    await asyncio.gather(*(kube.create(obj) for obj in children), kube.apply_config_map(config_map))
    cache.applied = config_hash


async def _delete_pods(ctx: _Ctx, pod_names: Sequence[str], *, why: str) -> None:
    deleted = []
    for pod_name in pod_names:
        if await ctx.state.kube.delete_pod(ctx.job.namespace, pod_name):
            metrics.PODS_DELETED.labels(why).inc()
            deleted.append(pod_name)
    if deleted:
        _post(ctx, "Normal", "PodsDeleted", f"deleted {', '.join(deleted)} ({why})")


def _reports(ctx: _Ctx, telemetry_index: kopf.Index) -> list[telemetry.SyncReport]:
    raw = next(iter(telemetry_index.get((ctx.job.namespace, ctx.job.name), [])), "")
    try:
        return telemetry.parse_reports(raw)
    except ValueError as exc:  # json and pydantic errors: a bad write must not stop the job
        ctx.logger.warning(f"ignoring unreadable {telemetry.REPORTS_KEY}: {exc}")
        return []


async def _adapt(
    ctx: _Ctx,
    spec: api.RLJobSpec,
    plan: api.PlanStatus,
    layout: builders.JobLayout,
    reports: list[telemetry.SyncReport],
) -> builders.JobLayout:
    """Call `policy.decide()`; persist changed targets in status first, then return the new layout."""
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
    decision = policy.decide(state, reports, settings, ctx.now.timestamp())
    if decision.action == "none":
        return layout
    metrics.DECISIONS.labels(decision.action).inc()
    ctx.logger.info(f"adaptive decision {decision.action}: {decision.reason}")
    _post(ctx, "Normal", f"Adaptive{_camel(decision.action)}", decision.reason)
    new_rollout = rollout.model_copy(
        update={
            "desired_shared_awake": decision.desired_shared_awake,
            "desired_dedicated_engines": decision.desired_dedicated_engines,
            "last_decision": _camel(decision.action),
            "last_decision_reason": decision.reason[:1024],
            "last_decision_time": ctx.now,
        }
    )
    await ctx.state.kube.patch_status(ctx.job.namespace, ctx.job.name, {"rollout": new_rollout.to_k8s()})
    ctx.old = ctx.old.model_copy(update={"rollout": new_rollout})
    ctx.old_raw = {**ctx.old_raw, "rollout": new_rollout.to_k8s()}
    return builders.compute_layout(spec, plan, decision.desired_dedicated_engines)


def _camel(action: str) -> str:
    return "".join(part.capitalize() for part in action.split("_"))


async def _finished(ctx: _Ctx, raw_spec: dict[str, Any]) -> None:
    """A finished job: stop leftover pods, honour ttlSecondsAfterFinished, keep the status."""
    await _delete_pods(ctx, reconcile.pods_to_stop(ctx.pods, keep_finished=True), why="finished")
    ttl = raw_spec.get("ttlSecondsAfterFinished")
    done = ctx.old.completion_time
    if isinstance(ttl, int) and done is not None and done.timestamp() + ttl <= ctx.now.timestamp():
        _post(ctx, "Normal", "TTLExpired", f"deleting the job {ttl}s after it finished")
        await ctx.state.kube.delete_rljob(ctx.job.namespace, ctx.job.name)
        return
    await _write_status(ctx, status.Situation("finished"))


async def _write_status(
    ctx: _Ctx,
    situation: status.Situation,
    *,
    spec: api.RLJobSpec | None = None,
    plan: api.PlanStatus | None = None,
    layout: builders.JobLayout | None = None,
    report: telemetry.SyncReport | None = None,
) -> None:
    """Compute the status, write it only if it changed, post Events for condition transitions."""
    current = [p for p in ctx.pods if p.attempt == (situation.restarts or ctx.old.restarts or 0)]
    new = status.compute_status(
        ctx.old,
        situation,
        generation=ctx.generation,
        now=ctx.now,
        spec=spec,
        plan=plan,
        layout=layout,
        pods=current,
        report=report,
    )
    patch = status.status_patch(ctx.old_raw, new)
    if patch is not None:
        await ctx.state.kube.patch_status(ctx.job.namespace, ctx.job.name, patch)
        known = {c.type for c in ctx.old.conditions}
        for cond in status.transitions(ctx.old.conditions, new.conditions):
            kind = status.event_type(cond)
            if cond.type in known or kind == "Warning":  # a condition's first Normal value is no news
                _post(ctx, kind, cond.reason, cond.message or f"{cond.type}={cond.status}")
        if situation.kind == "error" and situation.error is not None:
            kopf.warn(
                ctx.body,
                reason=status.reason_for(situation.error),
                message=status.message_for(situation.error),
            )
        ctx.old, ctx.old_raw = new, new.to_k8s()
    if new.phase:
        ctx.state.phases[ctx.key] = new.phase
        metrics.set_phase_counts(ctx.state.phases)


def _post(ctx: _Ctx, type_: str, reason: str, message: str) -> None:
    """A Kubernetes Event on the RLJob, at most one per (job, reason) every EVENT_MIN_INTERVAL_S."""
    now_s = time.monotonic()
    mark = (ctx.key, reason)
    if not status.should_post(ctx.state.events.get(mark), now_s, EVENT_MIN_INTERVAL_S):
        return
    ctx.state.events[mark] = now_s
    kopf.event(ctx.body, type=type_, reason=reason, message=message[:1024])


# ---- node-pool defaults (the chart's pools ConfigMap, rljob_operator.pools) ----------------------
POOLS_CONFIGMAP = os.environ.get("RLJOB_POOLS_CONFIGMAP", "")  # "<namespace>/<name>"; empty: no pools
POOLS_REFRESH_S = 10.0
_pools_read: list[tuple[float, pools.PoolCatalog]] = []


async def _pool_catalog(kube: Kube) -> pools.PoolCatalog:
    """The chart-rendered pool defaults, re-read at most every POOLS_REFRESH_S (helm upgrade applies)."""
    if not POOLS_CONFIGMAP:
        return pools.PoolCatalog()
    if _pools_read and time.monotonic() - _pools_read[0][0] < POOLS_REFRESH_S:
        return _pools_read[0][1]
    namespace, _, name = POOLS_CONFIGMAP.partition("/")
    cm = await kube.read_config_map(namespace, name)
    catalog = pools.parse_pool_catalog(((cm or {}).get("data") or {}).get(pools.POOLS_KEY))
    _pools_read[:] = [(time.monotonic(), catalog)]
    return catalog


# ---- entry point ---------------------------------------------------------------------------------
LOG_LEVELS = ("DEBUG", "INFO", "WARNING")


def run_operator(
    namespace: str | None = None,
    *,
    standalone: bool = True,
    liveness_endpoint: str | None = None,
    log_level: str = "INFO",
) -> None:
    """Run the operator until interrupted: one namespace, or all namespaces when `namespace` is None.

    `rljob operator` calls this. Standalone (the default) skips kopf's peering (one replica;
    the Helm chart runs one).
    """
    level = log_level.upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"log level {log_level!r}; valid: {', '.join(LOG_LEVELS)}")
    kopf.configure(debug=level == "DEBUG", verbose=False, quiet=level == "WARNING")
    asyncio.run(
        kopf.operator(
            clusterwide=namespace is None,
            namespaces=[namespace] if namespace else (),
            standalone=standalone,
            liveness_endpoint=liveness_endpoint,
        )
    )

"""Kueue admission of RLJobs: what the operator's `admission` reconcile step decides, purely.

Role: the functional core between Kueue's Workloads and the job's pods. The shell
(`queue_steps.step_admission`, API calls in `adapter.Kube`) reads Workloads through a kopf index and
ResourceFlavors by name; everything it decides comes from here:

- `observe_workload(body) -> WorkloadState`: what a Workload says (QuotaReserved, Admitted,
  Evicted, Preempted, Requeued, Finished, PodsReady, the admission's podSetAssignments and the
  LocalQueue/ClusterQueue). Eviction and preemption are only read here; acting on them for the
  job's core is cooperative preemption (a separate step builds on this observation).
- `core_workload(...)` / `engine_workload(...)`: the desired Workloads (builders.workload) with the
  hash of their spec, so a Workload built from an older spec is told apart and replaced while it
  is still pending, and the hash of what Kueue's quota reads of its podSets: `pod_sets_mismatch`
  says when an admitted one no longer covers the pods (stop the job, rebuild the Workload, as
  Kueue's jobframework does).
- `placements(assignments, flavors)`: for each podSet, the union of the nodeLabels and
  tolerations of the ResourceFlavors it was admitted to (Kueue's `podset.FromAssignment`);
  `place_pod(pod, placement)` merges one into a pod spec as Kueue's own integrations do
  (a nodeSelector key the pod already sets to another value is a conflict, an error naming both).
- `admitted_engines(...)`: how many dedicated rollout pods may exist: the minimum ones (in the core
  Workload) plus the admitted prefix of the extra engines, each its own lower-priority Workload:
  the effective dedicated target. An extra engine Kueue evicts falls outside it, so its pod goes
  through the two-phase drain (`elastic.plan_rollout_pods`, the one place that decides which
  rollout pods go); `evicted_engines(...)` names them, for the drain's bounded grace and its Event.
- `pods_ready_condition(...)`: the PodsReady condition Kueue's jobframework would write (Started,
  WaitForStart, WaitForRecovery, Recovered), or None when the Workload already says it.
- `queue_status(...)`: the RLJob's `status.queue` while it waits.

No clock, no API: `now` is an argument.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from rljob_operator import api, errors, names
from rljob_operator.builders import workload as workload_builder
from rljob_operator.builders.common import JobRef, content_hash, deep_copy

KUEUE_GROUP, KUEUE_VERSION = workload_builder.GROUP, workload_builder.VERSION
QUEUE_NAME_LABEL = names.KUEUE_QUEUE_LABEL
ANNOTATION_SPEC_HASH = "rljob.io/workload-spec-hash"
# What Kueue's quota reads of the podSets (names, counts, requests and placement fields): a change
# here while admitted means the admission no longer covers the pods (`pod_sets_mismatch`).
ANNOTATION_POD_SETS_HASH = "rljob.io/workload-pod-sets-hash"
# Workload condition types and PodsReady reasons (kueue.x-k8s.io/v1beta2 workload_types.go).
QUOTA_RESERVED = "QuotaReserved"
ADMITTED = "Admitted"
EVICTED = "Evicted"
PREEMPTED = "Preempted"
REQUEUED = "Requeued"
FINISHED = "Finished"
PODS_READY = "PodsReady"
STARTED = "Started"
WAIT_FOR_START = "WaitForStart"
WAIT_FOR_RECOVERY = "WaitForRecovery"
RECOVERED = "Recovered"
# Kueue writes each condition with its own field manager, `<controller>-<condition type>`
# (workload.SetConditionAndUpdate); ours follows the same rule.
PODS_READY_FIELD_MANAGER = f"{names.MANAGED_BY}-{PODS_READY}"
FINISHED_FIELD_MANAGER = f"{names.MANAGED_BY}-{FINISHED}"
WorkloadPriority = workload_builder.WorkloadPriority


@dataclasses.dataclass(frozen=True)
class WorkloadCondition:
    status: str
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class PodSetAssignment:
    name: str
    flavors: Mapping[str, str]  # resource name -> ResourceFlavor name
    count: int | None


@dataclasses.dataclass(frozen=True)
class WorkloadState:
    """One Workload of a job as last seen: the core one (`engine` None) or an extra engine's."""

    name: str
    namespace: str
    job: str
    engine: int | None
    uid: str
    generation: int
    spec_hash: str
    queue_name: str
    conditions: Mapping[str, WorkloadCondition]
    cluster_queue: str | None = None
    assignments: tuple[PodSetAssignment, ...] = ()
    priority: int | None = None
    priority_class: tuple[str, str] | None = None  # (kind, name) of spec.priorityClassRef
    deleting: bool = False
    pod_sets_hash: str = ""  # ANNOTATION_POD_SETS_HASH ("" on a Workload made before it existed)
    pod_sets: tuple[tuple[str, int], ...] = ()  # (name, count) of spec.podSets
    owner_uid: str | None = None  # the RLJob that made it (an earlier one's of the same name: stale)

    def _true(self, type_: str) -> bool:
        cond = self.conditions.get(type_)
        return cond is not None and cond.status == "True"

    @property
    def quota_reserved(self) -> bool:
        return self._true(QUOTA_RESERVED)

    @property
    def admitted(self) -> bool:
        """Admitted and not evicted: pods may run (Kueue keeps Admitted True until the job stops)."""
        return self._true(ADMITTED) and not self.evicted and not self.finished and not self.deleting

    @property
    def evicted(self) -> WorkloadCondition | None:
        """Kueue's Evicted condition when True (reason Preempted, InactiveWorkload, PodsReadyTimeout, ...)."""
        cond = self.conditions.get(EVICTED)
        return cond if cond is not None and cond.status == "True" else None

    @property
    def preempted(self) -> WorkloadCondition | None:
        cond = self.conditions.get(PREEMPTED)
        return cond if cond is not None and cond.status == "True" else None

    @property
    def finished(self) -> bool:
        return self._true(FINISHED)

    @property
    def pods_ready(self) -> WorkloadCondition | None:
        return self.conditions.get(PODS_READY)

    @property
    def pending_message(self) -> str:
        """Why Kueue has not admitted it yet (the QuotaReserved=False message), if it said."""
        cond = self.conditions.get(QUOTA_RESERVED)
        return cond.message if cond is not None and cond.status != "True" else ""


def observe_workload(body: Mapping[str, Any]) -> WorkloadState | None:
    """The state of a Workload the operator made (None for one without our job label)."""
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    job = labels.get(names.LABEL_JOB)
    if job is None:
        return None
    index = labels.get(names.LABEL_INDEX)
    st = body.get("status") or {}
    conditions = {
        c["type"]: WorkloadCondition(
            str(c.get("status", "")), str(c.get("reason", "")), str(c.get("message", ""))
        )
        for c in st.get("conditions") or []
        if "type" in c
    }
    adm = st.get("admission") or {}
    assignments = tuple(
        PodSetAssignment(str(a.get("name", "")), dict(a.get("flavors") or {}), a.get("count"))
        for a in adm.get("podSetAssignments") or []
    )
    return WorkloadState(
        name=str(meta.get("name", "")),
        namespace=str(meta.get("namespace", "")),
        job=job,
        engine=int(index) if index is not None and str(index).isdigit() else None,
        uid=str(meta.get("uid", "")),
        owner_uid=names.controller_uid(meta),
        generation=int(meta.get("generation") or 0),
        spec_hash=str((meta.get("annotations") or {}).get(ANNOTATION_SPEC_HASH, "")),
        queue_name=str((body.get("spec") or {}).get("queueName", "")),
        conditions=conditions,
        cluster_queue=adm.get("clusterQueue"),
        assignments=assignments,
        priority=(body.get("spec") or {}).get("priority"),
        priority_class=_class_ref((body.get("spec") or {}).get("priorityClassRef")),
        deleting=bool(meta.get("deletionTimestamp")),
        pod_sets_hash=str((meta.get("annotations") or {}).get(ANNOTATION_POD_SETS_HASH, "")),
        pod_sets=tuple(
            (str(p.get("name", "")), int(p.get("count") or 0))
            for p in (body.get("spec") or {}).get("podSets") or []
        ),
    )


def _class_ref(ref: Mapping[str, Any] | None) -> tuple[str, str] | None:
    return (str(ref.get("kind", "")), str(ref.get("name", ""))) if ref else None


# ---- desired Workloads ---------------------------------------------------------------------------
RolePods = Sequence[tuple[str, Sequence[dict[str, Any]]]]


def _role_pods(
    trainer_pods: Sequence[dict[str, Any]], rollout_pods: Sequence[dict[str, Any]], extra: RolePods = ()
) -> list[tuple[str, Sequence[dict[str, Any]]]]:
    return [(names.ROLE_TRAINER, trainer_pods), (names.ROLE_ROLLOUT, rollout_pods), *extra]


def core_extra_pods(
    judge_pods: Sequence[dict[str, Any]], environment_pods: Sequence[dict[str, Any]]
) -> list[tuple[str, list[dict[str, Any]]]]:
    """The core Workload's podSets beyond trainer and rollout: the judge's pods (`judge`), then one
    podSet per environment (`environment-<name>`), in spec order."""
    out: list[tuple[str, list[dict[str, Any]]]] = [(names.ROLE_JUDGE, list(judge_pods))]
    by_env: dict[str, list[dict[str, Any]]] = {}
    for pod in environment_pods:
        env = pod["metadata"]["labels"][names.LABEL_ENVIRONMENT]
        by_env.setdefault(env, []).append(pod)
    out += [(f"{names.ROLE_ENVIRONMENT}-{env}", pods) for env, pods in by_env.items()]
    return out


def _with_hash(
    wl: dict[str, Any], role_pods: Sequence[tuple[str, Sequence[dict[str, Any]]]]
) -> dict[str, Any]:
    annotations = wl["metadata"].setdefault("annotations", {})
    annotations[ANNOTATION_SPEC_HASH] = content_hash(wl["spec"])
    annotations[ANNOTATION_POD_SETS_HASH] = workload_builder.pod_sets_quota_hash(role_pods)
    return wl


def core_workload(
    job: JobRef,
    trainer_pods: Sequence[dict[str, Any]],
    rollout_pods: Sequence[dict[str, Any]],
    *,
    queue_name: str,
    priority: workload_builder.WorkloadPriority | None,
    extra: RolePods = (),
) -> dict[str, Any]:
    """The job's core Workload (trainer pods + the minimum dedicated rollout pods + `extra`: the judge's
    and the environments' pods, `core_extra_pods`), hash annotated."""
    return _with_hash(
        workload_builder.build_workload(
            job, trainer_pods, rollout_pods, queue_name=queue_name, priority=priority, extra=extra
        ),
        _role_pods(trainer_pods, rollout_pods, extra),
    )


def engine_workload(
    job: JobRef, rollout_pod: dict[str, Any], index: int, *, queue_name: str, core_priority: int | None
) -> dict[str, Any]:
    """The Workload of extra engine `index` (one pod, one below the core's priority), hash annotated."""
    return _with_hash(
        workload_builder.build_engine_workload(
            job, rollout_pod, index, queue_name=queue_name, core_priority=core_priority
        ),
        [(names.ROLE_ROLLOUT, [rollout_pod])],
    )


def is_current(state: WorkloadState, desired: Mapping[str, Any]) -> bool:
    """Whether the Workload was built from the same spec as `desired`."""
    return state.spec_hash == desired["metadata"]["annotations"][ANNOTATION_SPEC_HASH]


def pod_sets_mismatch(
    state: WorkloadState,
    trainer_pods: Sequence[dict[str, Any]],
    rollout_pods: Sequence[dict[str, Any]],
    extra: RolePods = (),
) -> str:
    """Why an admitted core Workload no longer covers the job's core pods ("" when it does): the
    podSets' names, counts, requests or placement changed (the user edited the trainer size or the
    rollout minimum). Kueue's jobframework then stops the job and replaces its Workload
    (ensureOneWorkload: a running job with no matching Workload is stopped, the other Workload
    deleted, a new one created once no pod is active); the shell does the same. A Workload without
    the annotation (made by an older operator) is taken as matching. Cheap enough for every
    reconcile (no Workload is built)."""
    role_pods = _role_pods(trainer_pods, rollout_pods, extra)
    if not state.pod_sets_hash or state.pod_sets_hash == workload_builder.pod_sets_quota_hash(role_pods):
        return ""

    def show(sets: Iterable[tuple[str, int]]) -> str:
        return ", ".join(f"{name}×{count}" for name, count in sets) or "none"

    asked = [(name, len(members)) for name, members in workload_builder.group_pod_sets(role_pods)]
    same = (
        "the same podSets with other requests or placement" if asked == list(state.pod_sets) else show(asked)
    )
    return (
        f"Workload {state.name} was admitted for podSets {show(state.pod_sets)}; the spec now asks for "
        f"{same}: the pods are stopped and the Workload is rebuilt, so Kueue admits the job again"
    )


def pod_set_pods(
    trainer_pods: Sequence[dict[str, Any]], rollout_pods: Sequence[dict[str, Any]], extra: RolePods = ()
) -> dict[str, list[str]]:
    """podSet name -> the names of its pods in the core Workload (as `core_workload` groups them)."""
    groups = workload_builder.group_pod_sets(_role_pods(trainer_pods, rollout_pods, extra))
    return {name: [p["metadata"]["name"] for p in members] for name, members in groups}


def pod_placements(
    state: WorkloadState,
    members: Mapping[str, Sequence[str]],
    flavors: Mapping[str, Mapping[str, Any] | None],
) -> dict[str, Placement]:
    """pod name -> its placement, for the pods of an admitted Workload (`members`: podSet -> pods)."""
    by_set = placements(state, flavors)
    return {pod: by_set[name] for name, pods in members.items() if name in by_set for pod in pods}


def admitted_pod_sets(
    job: str,
    core: WorkloadState,
    core_members: Mapping[str, Sequence[str]],
    extra: Mapping[int, WorkloadState],
    engines: Iterable[int],
) -> list[tuple[WorkloadState, dict[str, list[str]]]]:
    """Each admitted Workload with its podSets' pod names: the core's, then extra engine `i`'s
    one podSet `rollout` holding pod `<job>-rollout-<i>`, for each of `engines`."""
    out = [(core, {name: list(pods) for name, pods in core_members.items()})]
    out += [(extra[i], {names.ROLE_ROLLOUT: [names.rollout_pod_name(job, i)]}) for i in engines]
    return out


# ---- flavors -> pod placement --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Placement:
    """Where an admitted podSet's pods go: its flavors' nodeLabels and tolerations."""

    node_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    flavors: tuple[str, ...] = ()


class KueueLabelError(errors.RLJobError):
    """A Kueue label on the RLJob cannot name a queue or class (labels change without a new
    generation, so it is retried: fixing the label is enough)."""

    reason = "InvalidKueueLabel"
    retryable = True


class PriorityClassNotFoundError(errors.RLJobError):
    reason = "PriorityClassNotFound"
    retryable = True


class FlavorNotFoundError(errors.RLJobError):
    """A ResourceFlavor named in the Workload's admission does not exist (deleted since?)."""

    reason = "FlavorNotFound"
    retryable = True


class FlavorConflictError(errors.RLJobError):
    """An admitted flavor's nodeLabels contradict the pool's nodeSelector."""

    reason = "FlavorConflict"
    retryable = True


def flavor_names(states: Iterable[WorkloadState]) -> list[str]:
    """Every ResourceFlavor the admitted Workloads' podSets were assigned, sorted, once each."""
    return sorted({f for s in states for a in s.assignments for f in a.flavors.values()})


def placements(state: WorkloadState, flavors: Mapping[str, Mapping[str, Any] | None]) -> dict[str, Placement]:
    """podSet name -> the union of its assigned flavors' nodeLabels and tolerations.

    `flavors` maps a flavor name to its ResourceFlavor object (None: not found, an error naming it)."""
    out: dict[str, Placement] = {}
    for a in state.assignments:
        labels: dict[str, str] = {}
        tolerations: list[Mapping[str, Any]] = []
        used = sorted(set(a.flavors.values()))
        for name in used:
            flavor = flavors.get(name)
            if flavor is None:
                raise FlavorNotFoundError(
                    f"Workload {state.name}: status.admission.podSetAssignments[{a.name}]",
                    f"ResourceFlavor {name!r} is not found: recreate it, or delete the Workload so "
                    "Kueue admits the job again",
                )
            spec = flavor.get("spec") or {}
            labels.update(spec.get("nodeLabels") or {})
            for t in spec.get("tolerations") or []:
                if t not in tolerations:
                    tolerations.append(t)
        out[a.name] = Placement(labels, tuple(tolerations), tuple(used))
    return out


def place_pod(pod: Mapping[str, Any], placement: Placement) -> dict[str, Any]:
    """`pod` with the placement's nodeLabels in its nodeSelector and its tolerations added.

    A nodeSelector key the pod sets to another value is a conflict (Kueue refuses to start such a
    job too): FlavorConflictError naming the pool field and the flavor."""
    out = deep_copy(dict(pod))
    role = (out["metadata"].get("labels") or {}).get(names.LABEL_ROLE)
    field = {
        names.ROLE_TRAINER: "spec.trainerPool",
        names.ROLE_ENVIRONMENT: "spec.environments[]",
    }.get(role or "", "spec.rolloutPool")
    spec = out["spec"]
    selector = dict(spec.get("nodeSelector") or {})
    for key, value in placement.node_labels.items():
        if key in selector and selector[key] != value:
            raise FlavorConflictError(
                f"{field}.nodeSelector[{key}]",
                f"is {selector[key]!r}, but Kueue admitted the pod to flavor "
                f"{', '.join(placement.flavors)} whose nodeLabels say {value!r}: drop the key from the "
                "pool's nodeSelector (the flavor places the pods), or make the ClusterQueue offer a "
                "flavor with that label",
            )
        selector[key] = value
    if selector:
        spec["nodeSelector"] = selector
    tolerations = list(spec.get("tolerations") or [])
    tolerations += [dict(t) for t in placement.tolerations if t not in tolerations]
    if tolerations:
        spec["tolerations"] = tolerations
    return out


# ---- extra engines -------------------------------------------------------------------------------
def admitted_engines(core_engines: int, target_engines: int, extra: Mapping[int, WorkloadState]) -> int:
    """Dedicated rollout pods that may exist: the core ones plus the extra engines core..target-1
    whose Workloads are admitted, up to the first that is not (pod indices stay contiguous)."""
    count = core_engines
    for index in range(core_engines, target_engines):
        state = extra.get(index)
        if state is None or not state.admitted:
            break
        count += 1
    return count


def evicted_engines(extra: Mapping[int, WorkloadState], running: Iterable[int]) -> dict[int, str]:
    """Extra engines whose Workload Kueue evicted while their pod is up: index -> why (Kueue's
    Evicted reason and message).

    Which pods go is not decided here: `admitted_engines` lowers the effective target below an
    evicted engine, and `elastic.plan_rollout_pods` drains every rollout pod above it (the
    two-phase scale-down), the evicted ones within a bounded grace (`elastic.preempted_grace_s`);
    `stale_engine_workloads` then deletes the evicted Workload once its pod is gone."""
    up = set(running)
    out = {}
    for index, state in sorted(extra.items()):
        cond = state.evicted
        if index in up and cond is not None and not state.deleting:
            out[index] = f"Kueue evicted Workload {state.name} ({cond.reason}: {cond.message})"
    return out


def stale_engine_workloads(
    core_engines: int, target_engines: int, extra: Mapping[int, WorkloadState], running: Iterable[int]
) -> list[str]:
    """Extra-engine Workloads to delete: beyond the target, or evicted, once their pod is gone.

    Deleting an evicted Workload gives its quota back the way clearing the reservation would;
    while the target still wants the engine, a new Workload queues it again."""
    up = set(running)
    out = []
    for index, state in sorted(extra.items()):
        if index in up or state.deleting:
            continue
        if index < core_engines or index >= target_engines or state.evicted or state.finished:
            out.append(state.name)
    return out


# ---- PodsReady and the RLJob's queue status ------------------------------------------------------
def pods_ready_condition(
    state: WorkloadState, ready: bool, *, generation: int | None = None, now: datetime
) -> dict[str, Any] | None:
    """The PodsReady condition to write (Kueue's jobframework rules), or None if the Workload has it.

    Not admitted: False/WaitForStart. All pods ready: True/Started (Recovered after a recovery).
    Not ready: False/WaitForStart at first, False/WaitForRecovery once it had been True."""
    current = state.pods_ready
    if not state.admitted:
        status, reason, message = "False", WAIT_FOR_START, "Not all pods are ready or succeeded"
    elif ready:
        recovering = current is not None and current.reason in (WAIT_FOR_RECOVERY, RECOVERED)
        status, reason = "True", RECOVERED if recovering else STARTED
        message = "All pods reached readiness and the workload is running"
    elif current is not None and (current.status == "True" or current.reason == WAIT_FOR_RECOVERY):
        status, reason, message = (
            "False",
            WAIT_FOR_RECOVERY,
            "At least one pod has failed, waiting for recovery",
        )
    else:
        status, reason, message = "False", WAIT_FOR_START, "Not all pods are ready or succeeded"
    if current is not None and (current.status, current.reason) == (status, reason):
        return None
    return {
        "type": PODS_READY,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "observedGeneration": state.generation if generation is None else generation,
    }


def finished_condition(state: WorkloadState, outcome: str, *, now: datetime) -> dict[str, Any]:
    """Finished=True (reason Succeeded or Failed): Kueue releases the quota of a finished Workload."""
    return {
        "type": FINISHED,
        "status": "True",
        "reason": outcome,
        "message": f"the RLJob {state.job} {outcome.lower()}",
        "lastTransitionTime": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "observedGeneration": state.generation,
    }


def condition_apply(state: WorkloadState, condition: Mapping[str, Any]) -> dict[str, Any]:
    """The server-side apply body that owns only `condition` (Workload conditions are a map list
    keyed by type, so each field manager owns its own condition, as in Kueue).

    `metadata.uid` makes the apply fail on a Workload recreated under the same name."""
    return {
        "apiVersion": workload_builder.API_VERSION,
        "kind": workload_builder.KIND,
        "metadata": {"name": state.name, "namespace": state.namespace, "uid": state.uid},
        "status": {"conditions": [dict(condition)]},
    }


def queue_status(
    state: WorkloadState | None,
    queue_name: str,
    workload_name: str,
    *,
    extra_engines_admitted: int | None = None,
) -> api.QueueStatus:
    """`status.queue`: the LocalQueue, the Workload, and where Kueue has it."""
    if state is None:
        return api.QueueStatus(name=queue_name, workload=workload_name, message="Workload created")
    message = state.pending_message or (state.evicted.message if state.evicted else "")
    return api.QueueStatus(
        name=queue_name,
        workload=workload_name,
        admitted=state.admitted,
        cluster_queue=state.cluster_queue,
        flavors=flavor_names([state]) if state.admitted else [],
        extra_engines_admitted=extra_engines_admitted,
        message=message[:1024] or None,
    )

"""What to create and delete for one job, decided from observations: the pure half of a reconcile.

Role: the handlers observe (pods and nodes from kopf indexes, the RLJob body) and then ask this
module what to do: `observe_pod`/`observe_node` turn API objects into small frozen observations,
`assess_pods` finds a success or a failure of the current run attempt, `diff_pods` says which pods
to delete (stale attempt, out-of-date template, scaled down) and which to create (missing, in
index order, trainer 0 first), `backoff_s` is the restart delay, and `check_capacity` says whether
the node pool can hold the layout at all. No clock, env or API: `now` comes in as an argument.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rljob_operator import api, errors, names
from rljob_operator.builders.common import JobLayout, resource_name


@dataclasses.dataclass(frozen=True)
class PodObservation:
    """What the operator needs to know about one pod of a job."""

    name: str
    role: str
    index: int
    phase: str  # Pending | Running | Succeeded | Failed | Unknown
    attempt: int
    template_hash: str
    node_name: str | None = None
    deleting: bool = False
    exit_code: int | None = None
    message: str = ""


@dataclasses.dataclass(frozen=True)
class NodeObservation:
    """A node's labels, taints and allocatable accelerators, as the capacity check sees it."""

    name: str
    labels: Mapping[str, str]
    taints: tuple[tuple[str, str | None, str], ...]  # (key, value, effect)
    allocatable: Mapping[str, str]
    schedulable: bool


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return default


def observe_pod(pod: Mapping[str, Any]) -> PodObservation | None:
    """A pod of some RLJob (labelled by the operator), or None when it is not one."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    role = labels.get(names.LABEL_ROLE)
    if labels.get(names.LABEL_JOB) is None or role not in (names.ROLE_TRAINER, names.ROLE_ROLLOUT):
        return None
    status = pod.get("status") or {}
    exit_code: int | None = None
    message = status.get("message") or ""
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            exit_code = term.get("exitCode")
            message = message or term.get("reason") or term.get("message") or ""
    return PodObservation(
        name=meta.get("name", ""),
        role=role,
        index=_int(labels.get(names.LABEL_INDEX), -1),
        phase=status.get("phase") or "Pending",
        attempt=_int(annotations.get(names.ANNOTATION_ATTEMPT), -1),
        template_hash=annotations.get(names.ANNOTATION_TEMPLATE_HASH, ""),
        node_name=(pod.get("spec") or {}).get("nodeName"),
        deleting=meta.get("deletionTimestamp") is not None,
        exit_code=exit_code,
        message=message,
    )


def observe_node(node: Mapping[str, Any]) -> NodeObservation:
    meta = node.get("metadata") or {}
    spec = node.get("spec") or {}
    status = node.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    taints = tuple((t.get("key", ""), t.get("value"), t.get("effect", "")) for t in spec.get("taints") or [])
    return NodeObservation(
        name=meta.get("name", ""),
        labels=dict(meta.get("labels") or {}),
        taints=taints,
        allocatable=dict(status.get("allocatable") or {}),
        schedulable=ready and not spec.get("unschedulable", False),
    )


# ---- run outcome ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Outcome:
    """What the pods of the current attempt say about the run."""

    succeeded: bool = False
    failed_pod: PodObservation | None = None


def assess_pods(pods: Iterable[PodObservation], attempt: int) -> Outcome:
    """Trainer 0 (the driver) succeeding ends the run; any failed pod of this attempt fails it.

    Pods of older attempts are ignored: their failure was already counted.
    """
    current = [p for p in pods if p.attempt == attempt]
    for p in current:
        if p.role == names.ROLE_TRAINER and p.index == 0 and p.phase == "Succeeded":
            return Outcome(succeeded=True)
    failed = sorted((p for p in current if p.phase == "Failed"), key=lambda p: (p.role != "trainer", p.index))
    return Outcome(failed_pod=failed[0] if failed else None)


def backoff_s(restarts: int, policy: api.RestartPolicySpec) -> float:
    """Delay before restart number `restarts` (1-based): initial · 2^(restarts−1), capped at max."""
    if restarts < 1:
        return 0.0
    exponent = min(restarts - 1, 30)
    return float(min(policy.initial_backoff_seconds * (2**exponent), policy.max_backoff_seconds))


# ---- pod diff ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PodDiff:
    """Pods to delete (names) and to create (bodies, in order); `waiting` lists names still terminating."""

    delete: tuple[str, ...] = ()
    create: tuple[dict[str, Any], ...] = ()
    waiting: tuple[str, ...] = ()


def _desired_key(pod: Mapping[str, Any]) -> tuple[str, str]:
    meta = pod["metadata"]
    return meta["name"], meta["annotations"][names.ANNOTATION_TEMPLATE_HASH]


def diff_pods(
    desired: Sequence[Mapping[str, Any]], observed: Iterable[PodObservation], attempt: int
) -> PodDiff:
    """Make the observed pods match `desired` (built for `attempt`).

    - delete: pods of another attempt, pods not desired (scaled down), and pods whose template
      hash differs from the desired one; if any trainer pod is out of date, every trainer pod of
      the job goes (the Ray cluster and the torch.distributed group are all-or-nothing).
    - create: desired pods with no pod of that name, in the order given (trainer 0 first); a name
      still held by a terminating or to-be-deleted pod waits for the next reconcile.
    Deterministic names make creation idempotent: a retry after a crash gets AlreadyExists.
    """
    by_name = {p.name: p for p in observed}
    wanted = dict(_desired_key(d) for d in desired)
    doomed: set[str] = set()
    for p in by_name.values():
        if p.attempt != attempt or p.name not in wanted or p.template_hash != wanted[p.name]:
            doomed.add(p.name)
    if any(by_name[n].role == names.ROLE_TRAINER for n in doomed if n in wanted):
        doomed |= {p.name for p in by_name.values() if p.role == names.ROLE_TRAINER}
    delete = tuple(sorted(n for n in doomed if not by_name[n].deleting))
    create: list[dict[str, Any]] = []
    waiting: list[str] = []
    for d in desired:
        name = d["metadata"]["name"]
        if name not in by_name:
            create.append(dict(d))
        elif name in doomed or by_name[name].deleting:
            waiting.append(name)
    return PodDiff(delete=delete, create=tuple(create), waiting=tuple(waiting))


def pods_to_stop(observed: Iterable[PodObservation], *, keep_finished: bool) -> tuple[str, ...]:
    """Pods to delete when the job is suspended or finished; finished pods may stay for their logs."""
    out = []
    for p in observed:
        if p.deleting:
            continue
        if keep_finished and p.phase in ("Succeeded", "Failed"):
            continue
        out.append(p.name)
    return tuple(sorted(out))


# ---- capacity ------------------------------------------------------------------------------------
def _tolerates(taint: tuple[str, str | None, str], tolerations: Sequence[api.Toleration]) -> bool:
    key, value, effect = taint
    if effect == "PreferNoSchedule":
        return True
    for t in tolerations:
        if t.effect is not None and t.effect != effect:
            continue
        if t.operator == "Exists" and (t.key is None or t.key == key):
            return True
        if t.operator == "Equal" and t.key == key and (t.value or None) == (value or None):
            return True
    return False


def _fits(node: NodeObservation, pool: api.NodePoolSpec) -> bool:
    if not node.schedulable:
        return False
    if any(node.labels.get(k) != v for k, v in pool.node_selector.items()):
        return False
    return all(_tolerates(t, pool.tolerations) for t in node.taints)


def check_capacity(spec: api.RLJobSpec, layout: JobLayout, nodes: Iterable[NodeObservation]) -> None:
    """Raise `errors.InsufficientCapacityError` when the pools cannot hold the layout even when empty.

    Counts, per pool, how many pods of each size fit on the matching nodes' allocatable
    accelerators (trainer pods first, then rollout pods on what is left). Running pods of other
    jobs are the scheduler's business: this check only catches "can never fit".
    """
    res_name = resource_name(spec)
    node_list = list(nodes)
    demands = [("spec.trainerPool", spec.trainer_pool, a) for a in layout.trainer_accelerators]
    demands += [
        ("spec.rolloutPool", spec.rollout_pool, layout.rollout_accelerators_per_pod)
    ] * layout.rollout_pods
    free: dict[str, int] = {}
    for node in node_list:
        free[node.name] = _int(node.allocatable.get(res_name), 0) if res_name else 1_000_000
    for field, pool, need in demands:
        candidates = [n for n in node_list if _fits(n, pool) and free[n.name] >= need]
        if not candidates:
            matching = [n for n in node_list if _fits(n, pool)]
            total = sum(_int(n.allocatable.get(res_name), 0) for n in matching) if res_name else 0
            what = f"{res_name} {need} per pod" if res_name else "a schedulable node"
            selector = dict(pool.node_selector) or "any node"
            sizes = ", ".join(map(str, layout.trainer_accelerators))
            raise errors.InsufficientCapacityError(
                field,
                f"the pool ({selector}) has {len(matching)} schedulable matching nodes with "
                f"{total} {res_name or 'accelerators'} in all; the plan needs "
                f"{layout.trainer_pods} trainer pods ({sizes}) and "
                f"{layout.rollout_pods} rollout pods ({layout.rollout_accelerators_per_pod} each), {what}: "
                "add nodes to the pool, widen its nodeSelector/tolerations, or lower "
                "spec.resources.totalAccelerators",
            )
        # Best fit: the fullest node that still holds the pod keeps big nodes for big pods.
        best = min(candidates, key=lambda n: (free[n.name], n.name))
        free[best.name] -= need if res_name else 0

"""What to create and delete for one job, decided from observations: the pure half of a reconcile.

Role: the handlers observe (pods and nodes from kopf indexes, the RLJob body, claims) and then ask
this module what to do: `observe_pod`/`observe_node` turn API objects into small frozen
observations (with the pod-level causes: the scheduler's message, waiting reasons, termination
messages, DisruptionTarget), `decide_restart` says whether the current attempt succeeded, failed
(counted, with backoff `backoff_s`, or ending the job) or was disrupted (restart, not counted),
`diff_pods` says which pods to delete (stale attempt, out-of-date template, scaled down) and which
to create (missing, in index order, trainer 0 first), `check_capacity` whether the node pool can
hold the layout at all, and `check_claims` whether every claim exists and can be shared by the
pods that mount it. No clock, env or API: `now` comes in as an argument.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Literal

from rljob_operator import api, errors, names
from rljob_operator.builders.common import JobLayout, resource_name


@dataclasses.dataclass(frozen=True)
class PodObservation:
    """What the operator needs to know about one pod of a job.

    `exit_code`/`message` describe a terminated container (`message` is its termination message,
    else the runtime's reason); `unschedulable` is the scheduler's `PodScheduled=False` message;
    `waiting_reason`/`waiting_message` a container stuck before it runs (ImagePullBackOff,
    CreateContainerConfigError, ...); `disruption` says why the cluster took the pod away
    (eviction, preemption, taint manager, pod GC) when it did.
    """

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
    unschedulable: str = ""
    waiting_reason: str = ""
    waiting_message: str = ""
    disruption: str = ""
    termination_message: str = ""
    created: float | None = None  # metadata.creationTimestamp, unix s
    owner_uid: str | None = None  # the controller ownerReference's uid (the RLJob that made it)
    uid: str | None = None  # the pod's own uid: a delete names it (preconditions), never a namesake
    ready: bool = False  # its Ready condition (an environment server's readiness probe passed)
    environment: str = ""  # the spec.environments[] entry an environment pod serves
    restarts: int = 0  # container restarts by the kubelet (environment servers: restartPolicy Always)


PodChange = Literal["none", "reworded", "changed"]


def pod_change(before: PodObservation | None, after: PodObservation | None) -> PodChange:
    """What a pod event tells a reconcile (`None`: no pod, never seen or gone).

    - none: nothing it acts on, e.g. the binding alone (a pod's node matters only when the node
      goes, and the node's own event reconciles the jobs with pods on it);
    - reworded: the scheduler still refuses the pod, with a new message (its node counts move with
      every retry, or the cause changed), and nothing else changed;
    - changed: anything else, a pod created, refused for the first time, bound or deleted included.
    """
    if before is None or after is None:
        return "none" if before == after else "changed"
    if dataclasses.replace(after, node_name=before.node_name) == before:
        return "none"
    if not (before.unschedulable and after.unschedulable):
        return "changed"
    words_alone = dataclasses.replace(after, node_name=before.node_name, unschedulable=before.unschedulable)
    return "reworded" if words_alone == before else "changed"


def _unix(stamp: Any) -> float | None:
    """A Kubernetes timestamp (RFC 3339, `Z`) as unix seconds; None when absent or unreadable."""
    if not isinstance(stamp, str) or not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


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


#: The roles of a job's pods: its Ray cluster (trainer, rollout, judge) and its environment servers.
POD_ROLES = (names.ROLE_TRAINER, names.ROLE_ROLLOUT, names.ROLE_JUDGE, names.ROLE_ENVIRONMENT)
#: Roles whose pods make one gang: a failure or loss of any restarts the attempt (the Ray cluster, the
#: torch.distributed group and the judge's engines cannot take a replaced member).
GANG_ROLES = (names.ROLE_TRAINER, names.ROLE_JUDGE)

# Waiting reasons that are progress, not trouble.
_BENIGN_WAITING = frozenset({"", "ContainerCreating", "PodInitializing"})
# Pod-level `status.reason` values the kubelet sets when it evicts or preempts a pod.
_DISRUPTION_REASONS = frozenset({"Evicted", "Preempting", "Terminated", "Shutdown", "NodeLost"})
#: The kubelet's messages when it evicts a pod for exceeding its own storage limits
#: (pkg/kubelet/eviction/helpers.go: emptyDirMessageFmt, podEphemeralStorageMessageFmt,
#: containerEphemeralStorageMessageFmt).
_OWN_EVICTIONS = (
    "Usage of EmptyDir volume",
    "Pod ephemeral local storage usage exceeds",
    "exceeded its local ephemeral storage limit",
)


def observe_pod(pod: Mapping[str, Any]) -> PodObservation | None:
    """A pod of some RLJob (labelled by the operator), or None when it is not one."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    role = labels.get(names.LABEL_ROLE)
    if labels.get(names.LABEL_JOB) is None or role not in POD_ROLES:
        return None
    status = pod.get("status") or {}
    exit_code: int | None = None
    message = termination_message = ""
    waiting_reason = waiting_message = ""
    restarts = 0
    for cs in status.get("containerStatuses") or []:
        state = cs.get("state") or {}
        restarts += _int(cs.get("restartCount"), 0)
        term = state.get("terminated")
        if term and exit_code is None:
            exit_code = term.get("exitCode")
            termination_message = (term.get("message") or "").strip()
            message = termination_message or term.get("reason") or ""
        waiting = state.get("waiting") or {}
        if waiting.get("reason") not in _BENIGN_WAITING and not waiting_reason:
            waiting_reason = waiting.get("reason") or ""
            waiting_message = f"container {cs.get('name')}: {waiting.get('message') or waiting_reason}"
            # A container the kubelet restarts (CrashLoopBackOff): why its last run ended.
            last = (cs.get("lastState") or {}).get("terminated")
            if last:
                said = (last.get("message") or last.get("reason") or "").strip()
                waiting_message += f"; its last run exited with code {last.get('exitCode')}"
                waiting_message += f": {said[-512:]}" if said else ""
    unschedulable = disruption = ""
    for cond in status.get("conditions") or []:
        scheduled = cond.get("type") == "PodScheduled" and cond.get("status") == "False"
        if scheduled and cond.get("reason") == "Unschedulable":
            unschedulable = cond.get("message") or "the scheduler found no node"
        if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
            disruption = f"{cond.get('reason') or 'Disrupted'}: {cond.get('message') or ''}".rstrip(": ")
    if status.get("reason") == "Evicted" and any(m in str(status.get("message")) for m in _OWN_EVICTIONS):
        # The pod outgrew its own emptyDir sizeLimit or ephemeral-storage limit: its doing, and it
        # would do it again; a failure counted against backoffLimit, not a free restart.
        message = str(status["message"]).strip()
    elif not disruption and status.get("reason") in _DISRUPTION_REASONS:
        disruption = f"{status['reason']}: {status.get('message') or ''}".rstrip(": ")
    if not message:
        message = status.get("message") or ""
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
        unschedulable=unschedulable,
        waiting_reason=waiting_reason,
        waiting_message=waiting_message,
        disruption=disruption,
        termination_message=termination_message[-1024:],
        created=_unix(meta.get("creationTimestamp")),
        owner_uid=names.controller_uid(meta),
        uid=meta.get("uid"),
        ready=any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        ),
        environment=labels.get(names.LABEL_ENVIRONMENT, "") if role == names.ROLE_ENVIRONMENT else "",
        restarts=restarts,
    )


def left_by_earlier_job(pods: Iterable[PodObservation], job_uid: str | None) -> list[PodObservation]:
    """Pods labelled with the job's name that another RLJob made: an earlier RLJob of the same name,
    deleted, whose pods the garbage collector has not removed yet (or an orphan of `kubectl delete
    --cascade=orphan`). They are never this job's: their exit codes and steps are another run's."""
    if job_uid is None:
        return []
    return [p for p in pods if p.owner_uid != job_uid]


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


# ---- run outcome and the restart decision ------------------------------------------------------
Action = Literal["run", "succeeded", "restart", "fail"]


@dataclasses.dataclass(frozen=True)
class RestartDecision:
    """What the current attempt's pods mean for the run (pure; `decide_restart` makes it).

    - run: nothing ended; keep reconciling pods.
    - succeeded: trainer 0 exited 0.
    - restart: a new attempt (`attempt`) replaces every pod after `delay_s`; `disruption` says the
      cluster took a pod away (eviction, preemption, lost node), which is not counted in `failures`.
    - fail: the job ends; `reason` says why (RestartPolicyNever, BackoffLimitExceeded, RepeatedFailure).
    `cause` is the sentence a user reads: which pod, what happened, the termination message.
    """

    action: Action
    attempt: int
    failures: int
    disruptions: int
    reason: str = ""
    cause: str = ""
    pod: PodObservation | None = None
    disruption: bool = False
    delay_s: float = 0.0
    fingerprint: str | None = None  # the cause compared with the next failure's (status.lastFailure)


def backoff_s(failures: int, policy: api.RestartPolicySpec) -> float:
    """Delay before the restart after failure number `failures` (1-based): initial · 2^(n−1), capped."""
    if failures < 1:
        return 0.0
    exponent = min(failures - 1, 30)
    return float(min(policy.initial_backoff_seconds * (2**exponent), policy.max_backoff_seconds))


def _failure_cause(pod: PodObservation) -> str:
    code = f" with exit code {pod.exit_code}" if pod.exit_code is not None else ""
    return f"pod {pod.name} failed{code}" + (f": {pod.message}" if pod.message else "")


def _lost(pod: PodObservation, node_names: frozenset[str] | None) -> str:
    """Why the cluster took `pod` away, or "" when it did not."""
    if pod.disruption:
        return pod.disruption
    if node_names is not None and pod.node_name and pod.node_name not in node_names:
        return f"NodeLost: node {pod.node_name} no longer exists"
    return ""


def decide_restart(
    pods: Iterable[PodObservation],
    *,
    attempt: int,
    failures: int,
    disruptions: int,
    last_failure: str | None,
    policy: api.RestartPolicySpec,
    node_names: frozenset[str] | None = None,
    vanished: Mapping[str, str] | None = None,
) -> RestartDecision:
    """Succeeded, failed, disrupted or still running: the decision for the current attempt.

    Pods of older attempts are ignored (their end was already counted), and so are rollout pods: a
    dedicated engine's pod that fails or is taken away is replaced alone, never the gang, and counts
    neither as a failure nor as a disruption. A disruption of a trainer pod (a `DisruptionTarget`
    condition or evicted by its kubelet, its node gone, or vanished while the others still run)
    restarts the whole gang at once and does not count
    against `backoffLimit`, like Job's `podFailurePolicy` Ignore rule: the Ray cluster and the
    torch.distributed group cannot take a replaced member. `vanished` maps trainer pods of this
    attempt that are gone (not deleted by the operator) to why: seen with a DisruptionTarget, or
    lost from its Ray cluster. A failure counts; the same termination
    message twice in a row is deterministic and ends the job instead of burning the backoff.
    """
    current = [p for p in pods if p.attempt == attempt]
    same = {"attempt": attempt, "failures": failures, "disruptions": disruptions}
    for p in current:
        if p.role == names.ROLE_TRAINER and p.index == 0 and p.phase == "Succeeded":
            return RestartDecision(
                "succeeded", reason="TrainingSucceeded", cause="trainer pod 0 exited 0", **same
            )
    # Only trainer and judge pods decide the attempt: a rollout pod that fails, is evicted or loses its
    # node is recreated alone (`elastic.replace_lost_rollout_pods`), its engine dropped by the driver;
    # an environment server is restarted by its kubelet, or recreated alone (`environment_pods_to_replace`).
    order = sorted(
        (p for p in current if p.role in GANG_ROLES), key=lambda p: (p.role != names.ROLE_TRAINER, p.index)
    )
    lost: list[tuple[PodObservation | None, str]] = [
        (p, why) for p in order if p.phase != "Succeeded" and (why := _lost(p, node_names))
    ]
    # Pods of this attempt the operator saw and that are gone without it deleting them (an
    # eviction deletes its pod at once; `vanished` says why, from what was seen before).
    lost += [(None, why) for _, why in sorted((vanished or {}).items())]
    if lost:
        pod, why = lost[0]
        who = f"pod {pod.name} was disrupted ({why})" if pod is not None else why
        return RestartDecision(
            "restart",
            attempt=attempt + 1,
            failures=failures,
            disruptions=disruptions + 1,
            reason="Disrupted",
            cause=who,
            pod=pod,
            disruption=True,
        )
    failed = [p for p in order if p.phase == "Failed"]
    if not failed:
        return RestartDecision("run", **same)
    pod = failed[0]
    cause = _failure_cause(pod)
    fingerprint = pod.termination_message or None
    ended = {"attempt": attempt, "failures": failures + 1, "disruptions": disruptions, "pod": pod}
    if policy.policy == "Never":
        return RestartDecision(
            "fail", reason="RestartPolicyNever", cause=cause, fingerprint=fingerprint, **ended
        )
    if fingerprint is not None and fingerprint == last_failure:
        return RestartDecision(
            "fail", reason="RepeatedFailure", cause=cause, fingerprint=fingerprint, **ended
        )
    if failures >= policy.backoff_limit:
        return RestartDecision(
            "fail", reason="BackoffLimitExceeded", cause=cause, fingerprint=fingerprint, **ended
        )
    return RestartDecision(
        "restart",
        attempt=attempt + 1,
        failures=failures + 1,
        disruptions=disruptions,
        reason="PodFailed",
        cause=cause,
        pod=pod,
        delay_s=backoff_s(failures + 1, policy),
        fingerprint=fingerprint,
    )


#: The resolution of the times a reconcile writes and compares (`now` is truncated to the second,
#: as RFC 3339 times in the status are).
TIMESTAMP_RESOLUTION_S = 1.0


def backoff_ends(recorded: datetime, backoff: float) -> datetime:
    """When a backoff of `backoff` seconds from an event recorded at `recorded` ends.

    Status times are whole seconds (`now` is truncated too): an event recorded at second S happened
    within [S, S+1), so a backoff counts from S+1 and is never shorter than the spec says (at most a
    second longer). No backoff is no wait."""
    if backoff <= 0:
        return recorded
    return recorded + timedelta(seconds=TIMESTAMP_RESOLUTION_S + backoff)


def restart_wait_s(
    restarting_since: datetime | None,
    disruption: bool,
    failures: int,
    policy: api.RestartPolicySpec,
    now: datetime,
) -> float:
    """Seconds left of the backoff before the pods of a pending restart may be created (0: now);
    counted as `backoff_ends` says."""
    if restarting_since is None or disruption:
        return 0.0
    ends = backoff_ends(restarting_since, backoff_s(failures, policy))
    return max(0.0, ends.timestamp() - now.timestamp())


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
    desired: Sequence[Mapping[str, Any]],
    observed: Iterable[PodObservation],
    attempt: int,
    *,
    keep: Iterable[str] = (),
    replace: Iterable[str] = (),
) -> PodDiff:
    """Make the observed pods match `desired` (built for `attempt`).

    - delete: pods of another attempt, pods not desired (scaled down) unless named in `keep` (a
      rollout pod still draining), pods named in `replace` (a rollout pod whose engine was lost:
      recreated alone once gone), and pods whose template hash differs from the desired one; if
      any trainer pod is out of date, every trainer pod of
      the job goes (the Ray cluster and the torch.distributed group are all-or-nothing).
    - create: desired pods with no pod of that name, in the order given (trainer 0 first); a name
      still held by a terminating or to-be-deleted pod waits for the next reconcile.
    Deterministic names make creation idempotent: a retry after a crash gets AlreadyExists.
    """
    by_name = {p.name: p for p in observed}
    wanted = dict(_desired_key(d) for d in desired)
    kept, replaced = set(keep), set(replace) & set(by_name)
    doomed: set[str] = set(replaced)
    for p in by_name.values():
        stale = p.attempt != attempt or p.template_hash != wanted.get(p.name, p.template_hash)
        if stale or (p.name not in wanted and p.name not in kept):
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


def environment_pods_to_replace(observed: Iterable[PodObservation], attempt: int) -> list[PodObservation]:
    """Environment pods of `attempt` that ended (a server's pod runs with restartPolicy Always, so only
    the cluster ends one: evicted, its node lost): deleted, then recreated by the pod diff."""
    return [
        p
        for p in observed
        if p.role == names.ROLE_ENVIRONMENT
        and p.attempt == attempt
        and not p.deleting
        and p.phase in ("Failed", "Succeeded")
    ]


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
    # Judge pods schedule like rollout pods (builders.pods), on top of the job's total.
    demands += [
        ("spec.rolloutPool", spec.rollout_pool, layout.judge_accelerators_per_pod)
    ] * layout.judge_pods
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
                f"{layout.rollout_pods} rollout pods ({layout.rollout_accelerators_per_pod} each)"
                + (
                    f" and {layout.judge_pods} judge pods ({layout.judge_accelerators_per_pod} each)"
                    if layout.judge_pods
                    else ""
                )
                + f", {what}: "
                "add nodes to the pool, widen its nodeSelector/tolerations, or lower "
                "spec.resources.totalAccelerators",
            )
        # Best fit: the fullest node that still holds the pod keeps big nodes for big pods.
        best = min(candidates, key=lambda n: (free[n.name], n.name))
        free[best.name] -= need if res_name else 0


# ---- volumes ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ClaimUse:
    """A PersistentVolumeClaim the pods mount: the spec field, how many pods, read-only or not."""

    field: str
    claim: str
    pods: int
    read_only: bool


def claims_of(spec: api.RLJobSpec, layout: JobLayout) -> list[ClaimUse]:
    """Every claim the job's pods mount (builders.pods: the model in trainer and rollout pods, the judge's
    model in trainer and judge pods, the rest in trainer pods)."""
    out = []
    ckpt = spec.checkpoint.volume.claim_name
    if ckpt is not None:
        out.append(ClaimUse("spec.checkpoint.volume.claimName", ckpt, layout.trainer_pods, False))
    model = spec.model.source.pvc
    if model is not None:
        pods = layout.trainer_pods + layout.rollout_pods
        out.append(ClaimUse("spec.model.source.pvc.claimName", model.claim_name, pods, True))
    data = spec.data.source.pvc
    if data is not None:
        out.append(ClaimUse("spec.data.source.pvc.claimName", data.claim_name, layout.trainer_pods, True))
    judge = spec.reward.judge.model.source.pvc if spec.reward.judge is not None else None
    if judge is not None:
        pods = layout.trainer_pods + layout.judge_pods
        out.append(ClaimUse("spec.reward.judge.model.source.pvc.claimName", judge.claim_name, pods, True))
    return out


def check_claims(
    uses: Sequence[ClaimUse], claims: Mapping[str, Mapping[str, Any] | None], namespace: str
) -> None:
    """Raise when a claim is missing, or cannot be mounted by every pod that may mount it.

    `claims` maps a claim name to the PersistentVolumeClaim read from the API (None: not found).
    Pods of one job may land on different nodes, so a claim mounted by more than one pod needs
    ReadWriteMany (ReadOnlyMany is enough for a read-only mount); ReadWriteOnce would leave all
    but the first node's pods stuck in ContainerCreating with a Multi-Attach error.
    """
    missing = [u for u in uses if claims.get(u.claim) is None]
    if missing:
        listed = ", ".join(f"{u.claim!r} ({u.field})" for u in missing)
        raise errors.ClaimNotFoundError(
            missing[0].field,
            f"PersistentVolumeClaim{'s' if len(missing) > 1 else ''} {listed} not found in namespace "
            f"{namespace!r}: create "
            f"{'it' if len(missing) == 1 else 'them'} or fix the name (the pods would stay Pending until "
            "then)",
        )
    for use in uses:
        pvc = claims.get(use.claim) or {}
        if use.pods <= 1:
            continue
        modes = set((pvc.get("spec") or {}).get("accessModes") or [])
        enough = {"ReadWriteMany", "ReadOnlyMany"} if use.read_only else {"ReadWriteMany"}
        if not modes & enough:
            need = "ReadWriteMany or ReadOnlyMany" if use.read_only else "ReadWriteMany"
            raise errors.ClaimAccessModeError(
                use.field,
                f"PersistentVolumeClaim {use.claim!r} has access modes {sorted(modes) or 'none'}, but "
                f"{use.pods} pods that may land on different nodes mount it: use a claim with {need} "
                "(for example on a shared filesystem storage class)",
            )


def unbound_claims(
    uses: Sequence[ClaimUse], claims: Mapping[str, Mapping[str, Any] | None]
) -> tuple[str, ...]:
    """One sentence per claim the pods mount that exists but is not bound to a volume.

    The scheduler only says "pod has unbound immediate PersistentVolumeClaims"; this names the
    claim, the spec field that mounts it, its storage class and the fix. Claims of a
    WaitForFirstConsumer class stay Pending until a pod is scheduled, so the caller asks only once
    the scheduler has refused a pod.
    """
    out = []
    for use in uses:
        pvc = claims.get(use.claim)
        if pvc is None:
            continue
        phase = (pvc.get("status") or {}).get("phase") or "Pending"
        if phase == "Bound":
            continue
        spec = pvc.get("spec") or {}
        storage_class = spec.get("storageClassName")
        if spec.get("volumeName"):
            cause = f"its volume {spec['volumeName']!r} is not available"
        elif storage_class:
            cause = f"storage class {storage_class!r} has provisioned no volume for it"
        else:
            cause = "it names no storage class and the cluster has no default one"
        out.append(
            f"PersistentVolumeClaim {use.claim!r} ({use.field}) is {phase}: {cause} (`kubectl describe "
            f"pvc {use.claim}` says why); set a storage class the cluster has (`kubectl get "
            "storageclass`) or create a PersistentVolume for it"
        )
    return tuple(out)

"""Object names, label keys and lock keys: the one place that spells them.

Role: every name the operator gives a Kubernetes object and every label it relies on is built here,
so builders, handlers, tests and the trainer contract (docs/contracts.md §2, §3) agree. Pure: no
clock, no env, no API. Callers: `rljob_operator.builders`, `rljob_operator.handlers`,
`rljob_operator.reconcile.status`, tests.

Name rules: pod hostnames and the headless Service name must be RFC 1035 labels (at most 63
characters), because `<job>-trainer-0.<job>.<ns>.svc` is how the Ray workers find the head.
`validate_job_name` checks that before anything is created.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# ---- label and annotation keys (prefix rljob.io, like the API group) ----------------------------
LABEL_JOB = "rljob.io/job"
LABEL_ROLE = "rljob.io/role"
LABEL_INDEX = "rljob.io/index"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "rljob-operator"

# The run attempt a pod belongs to (status.restarts); pods of an older attempt are stale and deleted.
ANNOTATION_ATTEMPT = "rljob.io/attempt"
# Hash of the desired pod (spec + plan); a pod whose hash differs is out of date and replaced.
ANNOTATION_TEMPLATE_HASH = "rljob.io/template-hash"
# The spec.environments[] entry an environment pod serves (its Service selects it).
LABEL_ENVIRONMENT = "rljob.io/environment"
# The port an environment server listens on, set by the operator on its container
# (docs/contracts.md §4); the server reads it, and `$(RLJOB_ENV_PORT)` in args expands to it.
ENV_ENVIRONMENT_PORT = "RLJOB_ENV_PORT"
# The container port name of an environment server (its readiness probe and its NetworkPolicy use it).
ENVIRONMENT_PORT_NAME = "http"

ROLE_TRAINER = "trainer"
ROLE_ROLLOUT = "rollout"
ROLE_JUDGE = "judge"  # rljob_trainer.config.ROLE_JUDGE: Ray workers hosting the judge's engines
ROLE_ENVIRONMENT = "environment"  # spec.environments[]: servers the episodes reset and step
ROLE_CONFIG = "config"
ROLE_TELEMETRY = "telemetry"
ROLE_RAY_AUTH = "ray-auth"
ROLE_ENDPOINT = "endpoint"  # the job's OpenAI-compatible endpoint: its token Secret, its NetworkPolicy
ROLE_FENCE = "network"

# Mount point of the `<job>-config` ConfigMap (docs/contracts.md §2: RLJOB_CONFIG_PATH lives here).
CONFIG_MOUNT_DIR = "/etc/rljob"
CHECKPOINT_MOUNT_DIR = "/checkpoints"

# Persistence keys kopf writes on RLJobs (progress, diff base, finalizer) live under rljob.io.
KOPF_PREFIX = "rljob.io"
FINALIZER = "rljob.io/finalizer"

# Kueue's labels on a job (the same keys as on a batch/v1 Job): the LocalQueue that admits it and
# the WorkloadPriorityClass of its Workload.
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"

# The coordination.k8s.io Lease the operator replicas elect their one active leader on (leader.py).
LEADER_LEASE = "rljob-operator"

# The longest pod hostname suffix we add: "-trainer-" / "-rollout-" plus a 3-digit index.
_MAX_SUFFIX = len("-trainer-") + 3
MAX_JOB_NAME_LENGTH = 63 - _MAX_SUFFIX
_RFC1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _kueue_label(labels: Mapping[str, str] | None, key: str, what: str) -> str | None:
    value = (labels or {}).get(key)
    if value is None:
        return None
    if not value or len(value) > 253 or not _DNS_SUBDOMAIN.match(value):
        raise ValueError(
            f"metadata.labels[{key}]: {value!r} is not a {what} name (lowercase letters, digits, '-' "
            "and '.', starting and ending with a letter or digit); set it to the name of an existing "
            f"{what}, or remove the label"
        )
    return value


def kueue_queue_name(labels: Mapping[str, str] | None) -> str | None:
    """The Kueue LocalQueue an RLJob asks to be admitted through (its `kueue.x-k8s.io/queue-name`
    label, as on every Kueue-managed job), or None when the job is not queued.

    Raises ValueError naming the label and the fix when the value cannot name a LocalQueue. CEL rules
    cannot see metadata.labels, so the operator reports this as a status condition."""
    return _kueue_label(labels, KUEUE_QUEUE_LABEL, "LocalQueue")


def kueue_priority_class(labels: Mapping[str, str] | None) -> str | None:
    """The Kueue WorkloadPriorityClass named by the `kueue.x-k8s.io/priority-class` label, or None."""
    return _kueue_label(labels, KUEUE_PRIORITY_CLASS_LABEL, "WorkloadPriorityClass")


def workload_name(job: str) -> str:
    """The Kueue Workload that admits an RLJob's trainer and minimum rollout pods (`rljob-<job>`, the
    kind first as Kueue names the Workloads of its own integrations, so a Job of the same name never
    collides)."""
    return f"rljob-{job}"


def engine_workload_name(job: str, index: int) -> str:
    """The Kueue Workload of dedicated engine `index` added beyond the minimum (adaptive mode):
    `rljob-<job>-rollout-<index>`, the Workload of pod `<job>-rollout-<index>`."""
    return f"rljob-{job}-rollout-{index}"


def pod_group_name(job: str) -> str:
    """The scheduling.k8s.io PodGroup of an RLJob's gang (trainer pods plus the minimum rollout pods)."""
    return job


def job_key(namespace: str, name: str) -> str:
    """The key of one job for locks, caches and metrics: `<namespace>/<name>` (the only spelling)."""
    return f"{namespace}/{name}"


def validate_job_name(name: str) -> str | None:
    """Return why `name` cannot be an RLJob name, or None when it can.

    The name becomes the headless Service (an RFC 1035 label) and the prefix of pod hostnames
    (`<name>-trainer-<i>`, also a label of at most 63 characters).
    """
    if len(name) > MAX_JOB_NAME_LENGTH:
        return (
            f"metadata.name {name!r} is {len(name)} characters; at most {MAX_JOB_NAME_LENGTH} are allowed "
            f"so that pod hostnames like '{name}-trainer-0' stay within 63 characters: choose a shorter name"
        )
    if not _RFC1035.match(name):
        return (
            f"metadata.name {name!r} must be an RFC 1035 label (lowercase letters, digits and '-', "
            "starting with a letter) because it names the job's headless Service: rename the job"
        )
    return None


def trainer_pod_name(job: str, index: int) -> str:
    """`<job>-trainer-<i>`; pod 0 hosts the Ray head and the GRPO driver."""
    return f"{job}-trainer-{index}"


def rollout_pod_name(job: str, index: int) -> str:
    """`<job>-rollout-<j>`: the pod hosting dedicated rollout engine j."""
    return f"{job}-rollout-{index}"


def judge_pod_name(job: str, index: int) -> str:
    """`<job>-judge-<k>`: the pod hosting judge engine k (spec.reward.judge)."""
    return f"{job}-judge-{index}"


def pod_name(job: str, role: str, index: int) -> str:
    """The pod name for `role` (trainer, rollout or judge) and `index`."""
    if role == ROLE_TRAINER:
        return trainer_pod_name(job, index)
    if role == ROLE_ROLLOUT:
        return rollout_pod_name(job, index)
    if role == ROLE_JUDGE:
        return judge_pod_name(job, index)
    raise ValueError(f"pod role must be {ROLE_TRAINER!r}, {ROLE_ROLLOUT!r} or {ROLE_JUDGE!r}, got {role!r}")


# ---- environments (spec.environments[]) ------------------------------------------------------------
def environment_service_name(job: str, environment: str) -> str:
    """`<job>-env-<name>`: the headless Service of environment `name`'s pods (an RFC 1035 label), and
    their DNS subdomain."""
    return f"{job}-env-{environment}"


def environment_pod_name(job: str, environment: str, index: int) -> str:
    """`<job>-env-<name>-<i>`: replica i of environment `name`, also its hostname."""
    return f"{environment_service_name(job, environment)}-{index}"


def environment_network_policy_name(job: str) -> str:
    """`<job>-env`: the NetworkPolicy fencing the job's environment pods (docs/security.md)."""
    return f"{job}-env"


def environment_url(job: str, namespace: str, environment: str, port: int) -> str:
    """Environment `name`'s headless Service, `http://<job>-env-<name>.<ns>.svc:<port>`: any ready replica."""
    return f"http://{environment_service_name(job, environment)}.{namespace}.svc:{port}"


def environment_replica_url(job: str, namespace: str, environment: str, index: int, port: int) -> str:
    """Replica i's own address, its pod's DNS name through the headless Service:
    `http://<job>-env-<name>-<i>.<job>-env-<name>.<ns>.svc:<port>` (an episode stays on one replica)."""
    service = environment_service_name(job, environment)
    return f"http://{environment_pod_name(job, environment, index)}.{service}.{namespace}.svc:{port}"


def environment_pod_labels(job: str, environment: str, index: int) -> dict[str, str]:
    """Labels on environment pods: the pod labels plus the environment's name (its Service selects it)."""
    return {**pod_labels(job, ROLE_ENVIRONMENT, index), LABEL_ENVIRONMENT: environment}


def environment_selector(job: str, environment: str) -> dict[str, str]:
    """What environment `name`'s Service selects: the job, the role and the environment."""
    return {LABEL_JOB: job, LABEL_ROLE: ROLE_ENVIRONMENT, LABEL_ENVIRONMENT: environment}


def validate_environment_name(job: str, environment: str, replicas: int = 1) -> str | None:
    """Why environment `name` of job `job` cannot have its Service `<job>-env-<name>` and pod hostnames
    `<job>-env-<name>-<i>` (RFC 1035 labels of at most 63 characters), or None when it can."""
    longest = environment_pod_name(job, environment, max(0, replicas - 1))
    if len(longest) > 63:
        most = 63 - len(environment_pod_name(job, "", max(0, replicas - 1)))
        return (
            f"its pods' hostname {longest!r} would be {len(longest)} characters, at most 63 are allowed: "
            f"shorten the environment's name to at most {most} characters, or the job's name"
        )
    service = environment_service_name(job, environment)
    if not _RFC1035.match(service):
        return f"its Service {service!r} must be an RFC 1035 label (lowercase letters, digits and '-')"
    return None


def service_name(job: str) -> str:
    """The headless Service (and pod subdomain) of a job: the job's own name."""
    return job


def config_map_name(job: str) -> str:
    """`<job>-config`, key `trainer.json` (docs/contracts.md §1)."""
    return f"{job}-config"


def telemetry_config_map_name(job: str) -> str:
    """`<job>-telemetry`, key `reports.json` (docs/contracts.md §3)."""
    return f"{job}-telemetry"


def service_account_name(job: str) -> str:
    """The job's ServiceAccount; its Role and RoleBinding share the name."""
    return job


def role_name(job: str) -> str:
    return job


def role_binding_name(job: str) -> str:
    return job


def ray_auth_secret_name(job: str, uid: str | None) -> str:
    """`<job>-ray-auth-<uid[:8]>`: the Secret holding the job's Ray token. The RLJob's uid is in the
    name so that a Secret an earlier RLJob of the same name left (deleted, not yet collected) is
    never taken for this job's: the operator may create Secrets but never read them (the chart
    grants no `get` on Secrets), so a name taken is always this job's own. Offline (`rljob render`,
    no uid) the suffix is left out."""
    return f"{job}-ray-auth-{uid[:8]}" if uid else f"{job}-ray-auth"


def endpoint_secret_name(job: str, uid: str | None) -> str:
    """`<job>-endpoint-<uid[:8]>`: the Secret holding the token of the job's OpenAI-compatible endpoint
    (environments of mode agent). The uid is in the name for the reason `ray_auth_secret_name` gives."""
    return f"{job}-endpoint-{uid[:8]}" if uid else f"{job}-endpoint"


def endpoint_network_policy_name(job: str) -> str:
    """`<job>-env-endpoint`: lets the job's environment pods of mode agent reach the endpoint."""
    return f"{job}-env-endpoint"


def endpoint_url(job: str, namespace: str, port: int) -> str:
    """The endpoint's base URL as the environment pods reach it (trainer pod 0, no /v1):
    `http://<job>-trainer-0.<job>.<ns>.svc:<port>`."""
    return f"http://{ray_head_host(job, namespace)}:{port}"


def network_policy_name(job: str) -> str:
    """The job's NetworkPolicy: the job's own name."""
    return job


def ray_head_host(job: str, namespace: str) -> str:
    """DNS name of trainer pod 0 through the headless Service: `<job>-trainer-0.<job>.<ns>.svc`."""
    return f"{trainer_pod_name(job, 0)}.{service_name(job)}.{namespace}.svc"


def selector_labels(job: str) -> dict[str, str]:
    """Labels that select every object of one job (`kubectl get pods -l rljob.io/job=<job>`)."""
    return {LABEL_JOB: job}


def object_labels(job: str, role: str) -> dict[str, str]:
    """Labels on a non-pod object of a job (ConfigMaps, Service, RBAC)."""
    return {LABEL_JOB: job, LABEL_ROLE: role, LABEL_MANAGED_BY: MANAGED_BY}


def job_pod_selector(job: str) -> dict[str, str]:
    """The labels every pod of a job carries (whatever its role): what its NetworkPolicy selects."""
    return {LABEL_JOB: job, LABEL_MANAGED_BY: MANAGED_BY}


def pod_labels(job: str, role: str, index: int) -> dict[str, str]:
    """Labels on a pod; the operator relies on these, so user labels never override them."""
    return {**object_labels(job, role), LABEL_INDEX: str(index)}


def parse_pod_name(job: str, name: str) -> tuple[str, int] | None:
    """Inverse of `pod_name`: `(role, index)` for a pod of `job`, or None when `name` is not one."""
    for role in (ROLE_TRAINER, ROLE_ROLLOUT, ROLE_JUDGE):
        prefix = f"{job}-{role}-"
        if name.startswith(prefix) and name[len(prefix) :].isdigit():
            return role, int(name[len(prefix) :])
    return None


def controller_uid(meta: Mapping[str, Any]) -> str | None:
    """The uid of an object's controller (its ownerReference with controller: true), if any: the
    RLJob that made a child, which tells one RLJob's children from an earlier one's of the same name."""
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None

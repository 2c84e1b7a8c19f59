"""Environment servers (spec.environments[]): their pods, Services and NetworkPolicy.

Role: pure builders the reconcile's pods and children steps apply (`build_job_objects` gathers
them, so `rljob render` shows the same). Environment `name` is `replicas` pods
`<job>-env-<name>-<i>` under the headless Service `<job>-env-<name>` (their DNS subdomain): the
Service's name resolves to the ready replicas, and each replica has its own name
`<pod>.<service>.<ns>.svc`, because an episode lives in one replica and all its steps must reach that
one (a ClusterIP Service would spread them over the replicas). trainer.json's `environments[].url` is
the Service, `replicaUrls` the replicas (`names.environment_url`, `names.environment_replica_url`).
The Service lists no port: DNS is all it serves, so a new spec.environments[].port never needs a new
Service.

The pods are servers, not ranks: `restartPolicy: Always`, so the kubelet restarts a crashing server
(CrashLoopBackOff, which the status names) and the gang never restarts for an environment; a pod
the cluster takes away (evicted, its node lost) is recreated by the reconcile. They carry the run
attempt like every pod of the job, so a gang restart gives the new attempt fresh servers.

Security (docs/security.md): PodSecurity `restricted` (non-root, no privilege escalation, all
capabilities dropped, seccomp RuntimeDefault), a read-only root filesystem with `/tmp` an emptyDir
with a sizeLimit, no API token, no Ray token. The NetworkPolicy `<job>-env` admits connections
only from the job's trainer and rollout pods, to the `http` port, and lets the servers open no
connection at all (egress denied: an environment is untrusted code beside the job's unauthenticated
torch.distributed and NCCL ports); the job's own NetworkPolicy leaves them out (`names`).
"""

from __future__ import annotations

from typing import Any

from rljob_operator import api, names
from rljob_operator.builders import endpoint
from rljob_operator.builders.common import JobRef, content_hash, deep_copy

RUN_AS_USER = 1000
CONTAINER_NAME = "environment"
TMP_VOLUME = "tmp"
TMP_MOUNT = "/tmp"
# The readiness probe: how often, and how many misses before a ready pod leaves the Service.
READINESS_PERIOD_S = 5
READINESS_FAILURES = 3
READINESS_TIMEOUT_S = 2
TERMINATION_GRACE_S = 10
#: Roles whose pods run episodes (the driver on trainer pod 0, Ray actors on any trainer or rollout
#: pod): the only pods an environment admits.
CLIENT_ROLES = (names.ROLE_TRAINER, names.ROLE_ROLLOUT)


def default_command(mode: str) -> list[str]:
    """The command of an environment that sets none: the arithmetic environment of the trainer image,
    of the environment's mode (an environment of mode agent answers POST /episode, not reset/step)."""
    return ["python", "-m", api.DEFAULT_ENVIRONMENT_MODULES[mode]]


def _env(job: JobRef, env: api.EnvironmentSpec) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {"name": names.ENV_ENVIRONMENT_PORT, "value": str(env.port)},
        {"name": "RLJOB_ENV_NAME", "value": env.name},
        {"name": "RLJOB_JOB_NAME", "value": job.name},
        {"name": "RLJOB_NAMESPACE", "value": job.namespace},
        # The root filesystem is read-only: HOME and caches live on the /tmp emptyDir.
        {"name": "HOME", "value": TMP_MOUNT},
        {"name": "XDG_CACHE_HOME", "value": f"{TMP_MOUNT}/.cache"},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
    ]
    if env.mode == "agent":  # its agent calls the job's endpoint with the job's token
        out += endpoint.environment_env_vars(job)
    taken = {e["name"] for e in out}
    for var in env.env:
        if var.name in taken:  # the operator's contract wins (the port above is what the probe uses)
            continue
        if var.secret_key_ref is not None:
            ref = var.secret_key_ref
            out.append({"name": var.name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
        else:
            out.append({"name": var.name, "value": var.value or ""})
    return out


def build_environment_pod(
    job: JobRef, spec: api.RLJobSpec, env: api.EnvironmentSpec, index: int, *, attempt: int = 0
) -> dict[str, Any]:
    """Replica `index` of environment `env`: `<job>-env-<name>-<index>`."""
    if not 0 <= index < env.replicas:
        raise ValueError(f"environment {env.name} replica {index} is outside 0..{env.replicas - 1}")
    command = list(env.command) if env.command is not None else default_command(env.mode)
    args = list(env.args)
    if env.command is None and not args:
        args = ["--port", f"$({names.ENV_ENVIRONMENT_PORT})"]
    amounts = {"cpu": str(env.resources.cpu), "memory": str(env.resources.memory)}
    name = names.environment_pod_name(job.name, env.name, index)
    pod_spec: dict[str, Any] = {
        # A server: the kubelet restarts it (CrashLoopBackOff); the job's gang never restarts for it.
        "restartPolicy": "Always",
        # Its own DNS name, <pod>.<service>.<ns>.svc, where an episode's steps find their replica.
        "hostname": name,
        "subdomain": names.environment_service_name(job.name, env.name),
        "serviceAccountName": names.service_account_name(job.name),
        "automountServiceAccountToken": False,  # it never calls the API
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": CONTAINER_NAME,
                "image": env.image or spec.image.trainer,
                "imagePullPolicy": spec.image.pull_policy,
                "command": command,
                "args": args,
                "workingDir": TMP_MOUNT,
                "env": _env(job, env),
                "ports": [
                    {"name": names.ENVIRONMENT_PORT_NAME, "containerPort": env.port, "protocol": "TCP"}
                ],
                "readinessProbe": {
                    "httpGet": {"path": env.readiness_path, "port": names.ENVIRONMENT_PORT_NAME},
                    "periodSeconds": READINESS_PERIOD_S,
                    "timeoutSeconds": READINESS_TIMEOUT_S,
                    "failureThreshold": READINESS_FAILURES,
                },
                "resources": {"requests": dict(amounts), "limits": dict(amounts)},
                "volumeMounts": [{"name": TMP_VOLUME, "mountPath": TMP_MOUNT}],
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "privileged": False,
                    "capabilities": {"drop": ["ALL"]},
                    "readOnlyRootFilesystem": True,
                    "runAsNonRoot": True,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
            }
        ],
        "volumes": [{"name": TMP_VOLUME, "emptyDir": {"sizeLimit": str(env.resources.scratch)}}],
    }
    if env.node_selector:
        pod_spec["nodeSelector"] = deep_copy(dict(env.node_selector))
    if spec.image.pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in spec.image.pull_secrets]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": job.namespace,
            "labels": names.environment_pod_labels(job.name, env.name, index),
            "annotations": {
                names.ANNOTATION_ATTEMPT: str(attempt),
                names.ANNOTATION_TEMPLATE_HASH: content_hash({"spec": pod_spec}),
            },
        },
        "spec": pod_spec,
    }


def build_environment_pods(job: JobRef, spec: api.RLJobSpec, *, attempt: int = 0) -> list[dict[str, Any]]:
    """Every environment pod of the job, environment by environment, replica 0 first."""
    return [
        build_environment_pod(job, spec, env, i, attempt=attempt)
        for env in spec.environments
        for i in range(env.replicas)
    ]


def build_environment_service(job: JobRef, env: api.EnvironmentSpec) -> dict[str, Any]:
    """The headless Service `<job>-env-<name>`: DNS for its ready pods, the name for all of them and
    one per pod (their hostname and subdomain); no port, no virtual IP."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": names.environment_service_name(job.name, env.name),
            "namespace": job.namespace,
            "labels": {
                **names.object_labels(job.name, names.ROLE_ENVIRONMENT),
                names.LABEL_ENVIRONMENT: env.name,
            },
        },
        "spec": {
            "clusterIP": "None",
            "selector": names.environment_selector(job.name, env.name),
            # Only ready replicas resolve: a crashed or starting one takes no episode.
            "publishNotReadyAddresses": False,
        },
    }


def build_environment_network_policy(job: JobRef) -> dict[str, Any]:
    """The NetworkPolicy `<job>-env`: the job's environment pods take connections only from its
    trainer and rollout pods, on their `http` port, and open none (egress denied, DNS included)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": names.environment_network_policy_name(job.name),
            "namespace": job.namespace,
            "labels": names.object_labels(job.name, names.ROLE_FENCE),
        },
        "spec": {
            "podSelector": {
                "matchLabels": {**names.job_pod_selector(job.name), names.LABEL_ROLE: names.ROLE_ENVIRONMENT}
            },
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {
                    "from": [
                        {
                            "podSelector": {
                                "matchLabels": names.job_pod_selector(job.name),
                                "matchExpressions": [
                                    {"key": names.LABEL_ROLE, "operator": "In", "values": list(CLIENT_ROLES)}
                                ],
                            }
                        }
                    ],
                    "ports": [{"protocol": "TCP", "port": names.ENVIRONMENT_PORT_NAME}],
                }
            ],
            "egress": [],
        },
    }

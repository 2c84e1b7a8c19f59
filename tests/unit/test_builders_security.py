"""Unit tests for the job's fence (builders.ray_auth, builders.network_policy) and the pods'
hardening (read-only root filesystem, emptyDirs with sizeLimits: builders.scratch).

The local cluster has no CNI that enforces NetworkPolicy, so the selectors are checked here, with
the API's own semantics (matchLabels: every pair present; namespaceSelector by the namespace's
`kubernetes.io/metadata.name` label; an empty peer list in `from` and no rule at all differ)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
from test_builders import make_spec, static_plan

from rljob_operator import builders, names
from rljob_operator.builders import network_policy, pods, ray_auth, scratch
from rljob_operator.estimator import presets

JOB = builders.JobRef("demo", "team-a", "0123456789abcdef-uid")
TOKEN = "f" * 64


def job_objects(spec: Any, **kwargs: Any) -> builders.JobObjects:
    plan = static_plan(spec)
    layout = builders.compute_layout(spec, plan)
    config = dict(spec.model.config.inline or {})
    return builders.build_job_objects(JOB, spec, plan, layout, config, ray_token=TOKEN, **kwargs)


def matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions: In, NotIn, Exists, DoesNotExist), as the
    apiserver evaluates it: every requirement holds; NotIn holds for a pod without the key."""
    assert set(selector) <= {"matchLabels", "matchExpressions"}, selector
    if not all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for req in selector.get("matchExpressions") or []:
        key, op, values = req["key"], req["operator"], req.get("values") or []
        held = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not held:
            return False
    return True


def admits(
    policy: dict[str, Any], *, pod_labels: Mapping[str, str], namespace: str, port: str | None
) -> bool:
    """Whether `policy` (namespace team-a) lets a connection in from a pod with `pod_labels` in
    `namespace` to container port `port` (a name; None: some unnamed port)."""
    for rule in policy["spec"]["ingress"]:
        ports = rule.get("ports")
        if ports is not None and not any(p.get("port") == port for p in ports):
            continue
        for peer in rule["from"]:
            in_namespace = (
                matches(peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace})
                if "namespaceSelector" in peer
                else namespace == policy["metadata"]["namespace"]
            )
            if in_namespace and ("podSelector" not in peer or matches(peer["podSelector"], pod_labels)):
                return True
    return False


def test_the_token_secret_is_the_jobs_own_immutable_and_only_referenced_by_the_pods() -> None:
    objects = job_objects(make_spec())
    secret = objects.fence[0]
    assert secret["kind"] == "Secret" and secret["immutable"] is True
    # The uid in the name: an earlier RLJob's Secret of the same name is never taken for this one's.
    assert secret["metadata"]["name"] == "demo-ray-auth-01234567"
    assert secret["stringData"] == {ray_auth.TOKEN_KEY: TOKEN}
    assert objects.children.index(secret) < len(objects.children)  # created with the children, before pods
    for pod in objects.pods:
        text = json.dumps(pod)
        assert TOKEN not in text  # the pod spec (and its template hash) never holds the token
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": secret["metadata"]["name"], "key": ray_auth.TOKEN_KEY}
    assert names.ray_auth_secret_name("demo", None) == "demo-ray-auth"  # offline: `rljob render`


def test_the_network_policy_selects_every_pod_of_the_job_and_admits_only_them() -> None:
    objects = job_objects(make_spec())
    (policy,) = [o for o in objects.fence if o["kind"] == "NetworkPolicy"]
    assert policy["metadata"]["name"] == "demo" and policy["spec"]["policyTypes"] == ["Ingress"]
    selected = policy["spec"]["podSelector"]
    roles = {p["metadata"]["labels"][names.LABEL_ROLE] for p in objects.pods}
    assert roles == {"trainer", "rollout"}
    for pod in objects.pods:  # every pod of the job is fenced...
        labels = pod["metadata"]["labels"]
        assert matches(selected, labels)
        # ...and any of them may reach any other, on any port (Ray uses many, some random).
        assert admits(policy, pod_labels=labels, namespace="team-a", port=None)
    other_job = names.pod_labels("other", "trainer", 0)
    assert not matches(selected, other_job)
    assert not admits(policy, pod_labels=other_job, namespace="team-a", port=None)
    assert not admits(policy, pod_labels={}, namespace="team-a", port="metrics")
    # The same job name in another namespace is another tenant.
    head = objects.pods[0]["metadata"]["labels"]
    assert not admits(policy, pod_labels=head, namespace="team-b", port=None)


def test_the_metrics_port_is_open_to_the_charts_namespace_only() -> None:
    settings = network_policy.Settings(metrics_namespace="monitoring")
    (policy,) = [o for o in job_objects(make_spec(), network=settings).fence if o["kind"] == "NetworkPolicy"]
    prometheus = {"app": "prometheus"}
    assert admits(policy, pod_labels=prometheus, namespace="monitoring", port="metrics")
    assert not admits(policy, pod_labels=prometheus, namespace="monitoring", port=None)  # Ray's ports
    assert not admits(policy, pod_labels=prometheus, namespace="team-b", port="metrics")
    head = next(p for p in job_objects(make_spec()).pods if p["metadata"]["name"] == "demo-trainer-0")
    port_names = {p["name"] for p in head["spec"]["containers"][0]["ports"]}
    assert network_policy.METRICS_PORT_NAME in port_names and "ray-dashboard" not in port_names


def test_egress_is_open_unless_the_chart_lists_it() -> None:
    open_policy = next(o for o in job_objects(make_spec()).fence if o["kind"] == "NetworkPolicy")
    assert "egress" not in open_policy["spec"] and "Egress" not in open_policy["spec"]["policyTypes"]
    apiserver = {"to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}], "ports": [{"protocol": "TCP", "port": 6443}]}
    settings = network_policy.parse_settings(json.dumps({"egress": [apiserver]}))
    policy = next(o for o in job_objects(make_spec(), network=settings).fence if o["kind"] == "NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    own, dns, listed = policy["spec"]["egress"]
    assert matches(own["to"][0]["podSelector"], job_objects(make_spec()).pods[-1]["metadata"]["labels"])
    assert {p["port"] for p in dns["ports"]} == {53} and listed == apiserver
    assert not [o for o in job_objects(make_spec(), network=network_policy.Settings(enabled=False)).fence
                if o["kind"] == "NetworkPolicy"]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("{", "is not JSON"),
        ("[]", "must be a JSON object"),
        ('{"egres": []}', "unknown keys ['egres']"),
        ('{"egress": {"to": []}}', "egress must be null"),
        ('{"metricsNamespace": 3}', "metricsNamespace"),
    ],
)
def test_bad_chart_settings_name_the_value(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=rf"RLJOB_JOB_NETWORK_POLICY.*{__import__('re').escape(fragment)}"):
        network_policy.parse_settings(text)
    assert network_policy.parse_settings("") == network_policy.Settings()


def test_pods_write_only_to_bounded_volumes() -> None:
    spec = make_spec()
    for pod in job_objects(spec).pods:
        container = pod["spec"]["containers"][0]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        writable = {
            m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"] if not m.get("readOnly")
        }
        # Every writable mount is an emptyDir with a sizeLimit (or a claim: the user's storage).
        for path, volume in writable.items():
            assert "persistentVolumeClaim" in volume or volume["emptyDir"].get("sizeLimit"), path
        assert writable[scratch.SHM_MOUNT]["emptyDir"]["medium"] == "Memory"
        env = {e["name"]: e.get("value") for e in container["env"]}
        for where in (env["HOME"], env["HF_HOME"], env["XDG_CACHE_HOME"], container["workingDir"]):
            assert any(where == p or where.startswith(p.rstrip("/") + "/") for p in writable), where


def test_scratch_limits_follow_the_model_and_the_spec() -> None:
    qwen = presets.load_preset("Qwen/Qwen3-8B")
    tiny = scratch.scratch_limits(make_spec(), None)
    assert tiny == scratch.ScratchLimits(tmp="8Gi", cache="2Gi", shm="2Gi", checkpoints="2Gi")
    hub = make_spec(**{"model.source": {"hub": {"id": "Qwen/Qwen3-8B"}}, "model.finetune": {"mode": "full"}})
    limits = scratch.scratch_limits(hub, qwen)
    gib = {k: int(v.removesuffix("Gi")) for k, v in vars(limits).items()}
    # ~8.2e9 parameters, bf16: ~15 GiB of weights, downloaded once into the cache.
    assert 16 <= gib["cache"] <= 20 and 22 <= gib["tmp"] <= 26 and 31 <= gib["shm"] <= 36
    # Two checkpoints of 16 bytes a parameter and three exports of the weights: about 290 GiB.
    assert 270 <= gib["checkpoints"] <= 310
    memory = make_spec(**{"resources.memory": "64Gi"})
    assert scratch.scratch_limits(memory, qwen).shm == "64Gi"  # the pod's memory caps the tmpfs
    own = make_spec(**{"checkpoint": {"volume": {"emptyDir": {"sizeLimit": "7Gi"}}}})
    volumes = {v["name"]: v for v in job_objects(own).pods[0]["spec"]["volumes"]}
    assert volumes[pods.CHECKPOINT_VOLUME]["emptyDir"] == {"sizeLimit": "7Gi"}

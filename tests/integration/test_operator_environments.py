"""Environment servers and the judge's pods on the real control plane (docs/agents.md).

An RLJob with spec.environments gets, from the operator running in-process as its own
least-privilege ServiceAccount: the environment pods (admitted by the apiserver's PodSecurity
`restricted` admission of the test namespace), one headless Service per environment and the
NetworkPolicy that fences them; the servers really run (`python -m rljob_env.arithmetic` on a
local-exec node of the test kubelet), pass their readiness probe and answer reset/step through
their Service and each replica by its own name (the test kubelet's stand-ins for cluster DNS and
kube-proxy, which send traffic only to ready pods); the job's status counts them ready. A server
whose command exits is restarted by the kubelet (CrashLoopBackOff) and named in the status and an
Event with its exit code and last words, as is one whose Secret is missing
(CreateContainerConfigError); the trainer pods keep running. Deleting the job deletes them all.
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import pytest
import yaml

# Short intervals for tests; read once when rljob_operator.handlers is imported.
os.environ.setdefault("RLJOB_RECONCILE_INTERVAL_S", "1")
os.environ.setdefault("RLJOB_METRICS_PORT", "0")
os.environ.setdefault("RLJOB_EVENT_INTERVAL_S", "1")

from kopf.testing import KopfRunner

from testenv.waiting import wait_for

pytestmark = pytest.mark.cluster

TINY_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
}


@contextmanager
def operator(namespace: str) -> Iterator[KopfRunner]:
    args = ["run", "--standalone", "--namespace", namespace, "-m", "rljob_operator.handlers"]
    with KopfRunner(args, timeout=60) as runner:
        yield runner


@pytest.fixture
def local_cpu_node(cluster: Any) -> Iterator[str]:
    """One local-exec CPU node under a fresh pool label: its pods run as processes here."""
    label = f"envs{os.urandom(3).hex()}"
    nodes = cluster.add_nodes(1, name_prefix=label, resource=None, labels={"pool": label}, exec_local=True)
    yield label
    cluster.delete_nodes(nodes)


def rljob(name: str, gpu_pool: str, environments: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A job whose trainer pods go to fake GPU nodes (they run nothing) and whose environments go
    where their nodeSelector says."""
    spec: dict[str, Any] = {
        "model": {"name": "tiny", "source": {"tiny": {}}, "config": {"inline": TINY_CONFIG}},
        "data": {"source": {"builtin": {"name": "toy-arithmetic"}}},
        "resources": {
            "accelerator": {"kind": "nvidia", "model": "H100-80GB"},
            "totalAccelerators": 8,
            "acceleratorsPerNode": 8,
            "mode": "static",
            "static": {"trainerAccelerators": 8, "rolloutAccelerators": 0},
        },
        "trainerPool": {"nodeSelector": {"pool": gpu_pool}},
        "rolloutPool": {"nodeSelector": {"pool": gpu_pool}},
        "environments": environments,
        "rollout": {
            "agent": {
                "environment": environments[0]["name"],
                "tools": [{"name": "calc", "kind": "calculator"}],
            }
        },
        **extra,
    }
    return {"apiVersion": "rljob.io/v1alpha1", "kind": "RLJob", "metadata": {"name": name}, "spec": spec}


def apply(cluster: Any, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj))


def job_status(cluster: Any, namespace: str, job: str) -> dict[str, Any]:
    return (cluster.get_json("rljob", job, namespace=namespace) or {}).get("status") or {}


def condition(st: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions", []) if c["type"] == type_), {})


def pods_of(cluster: Any, namespace: str, selector: str) -> list[dict[str, Any]]:
    data = cluster.get_json("pods", "-l", selector, namespace=namespace) or {}
    return sorted(data.get("items", []), key=lambda p: p["metadata"]["name"])


def post(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return dict(json.loads(response.read()))


def test_environments_run_fenced_ready_behind_their_service_and_go_with_the_job(
    cluster: Any,
    crd: None,
    namespace: str,
    pool: Callable[..., str],
    local_cpu_node: str,
    operator_identity: str,
) -> None:
    gpu_pool = pool(2)
    judge = {
        "model": {"name": "tiny-judge", "source": {"tiny": {}}, "config": {"inline": TINY_CONFIG}},
        "promptTemplate": "Is this right? {prompt} {response} Score 0 to 10.",
    }
    job = rljob(
        "agents",
        gpu_pool,
        [{"name": "arith", "replicas": 2, "nodeSelector": {"pool": local_cpu_node}}],
        reward={"functions": [{"name": "mathAccuracy"}], "judge": judge},
    )
    labels = cluster.get_json("namespace", namespace)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    with operator(namespace):
        apply(cluster, namespace, job)

        def ready() -> dict[str, Any]:
            st = job_status(cluster, namespace, "agents")
            envs = st.get("environments") or []
            return st if envs and envs[0].get("readyReplicas") == 2 and st.get("phase") == "Running" else {}

        st = wait_for("both environment pods ready and the job Running", ready, timeout_s=120)
        (env_status,) = st["environments"]
        assert env_status == {
            "name": "arith",
            "replicas": 2,
            "readyReplicas": 2,
            "ready": "2/2",
            "url": f"http://agents-env-arith.{namespace}.svc:8080",
        }
        cond = condition(st, "EnvironmentsReady")
        assert cond["status"] == "True" and "arith 2/2" in cond["message"]
        assert condition(st, "Ready")["reason"] == "AllPodsRunning"
        # The judge's engines were planned and got their pod, with its accelerator and role.
        assert st["plan"]["judge"]["engines"] == 1 and st["plan"]["judge"]["tensorParallel"] >= 1
        assert any(r.startswith("judge max_model_len=") for r in st["plan"]["judge"]["reasons"])
        (judge_pod,) = pods_of(cluster, namespace, "rljob.io/role=judge")
        assert judge_pod["metadata"]["name"] == "agents-judge-0"
        container = judge_pod["spec"]["containers"][0]
        assert {e["name"]: e.get("value") for e in container["env"]}["RLJOB_ROLE"] == "judge"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == str(
            st["plan"]["judge"]["tensorParallel"]
        )

        envs = pods_of(cluster, namespace, "rljob.io/role=environment")
        assert [p["metadata"]["name"] for p in envs] == ["agents-env-arith-0", "agents-env-arith-1"]
        for p in envs:  # admitted under PodSecurity restricted, no token, owned by the job
            assert p["spec"]["automountServiceAccountToken"] is False
            assert p["spec"]["securityContext"]["runAsNonRoot"] is True
            assert p["spec"]["nodeName"].startswith(local_cpu_node)
            assert p["metadata"]["ownerReferences"][0]["kind"] == "RLJob"
            assert all(c["status"] == "True" for c in p["status"]["conditions"] if c["type"] == "Ready")
        svc = cluster.get_json("service", "agents-env-arith", namespace=namespace)
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == {
            "rljob.io/job": "agents",
            "rljob.io/role": "environment",
            "rljob.io/environment": "arith",
        }
        # (Its EndpointSlices stay empty here: local-exec pods report the loopback address, which an
        # endpoint may not have. DNS of a headless Service is the cluster's: the kubelet's stand-in
        # below resolves the Service and each replica's name.)
        fence = cluster.get_json("networkpolicy", "agents-env", namespace=namespace)
        # Egress in policyTypes and no egress rule (the apiserver drops the empty list): nothing goes out.
        assert fence["spec"]["policyTypes"] == ["Ingress", "Egress"] and not fence["spec"].get("egress")
        main = cluster.get_json("networkpolicy", "agents", namespace=namespace)
        assert main["spec"]["podSelector"]["matchExpressions"] == [
            {"key": "rljob.io/role", "operator": "NotIn", "values": ["environment"]}
        ]
        # The trainer reaches the environment by its Service, and an episode's replica by its own name.
        config = cluster.get_json("configmap", "agents-config", namespace=namespace)
        trainer = json.loads(config["data"]["trainer.json"])
        service = f"agents-env-arith.{namespace}.svc"
        (rendered,) = trainer["environments"]
        assert {k: rendered[k] for k in ("name", "url", "replicaUrls", "timeoutS")} == {
            "name": "arith",
            "url": f"http://{service}:8080",
            "replicaUrls": [f"http://agents-env-arith-{i}.{service}:8080" for i in (0, 1)],
            "timeoutS": 30.0,
        }
        assert trainer["agent"]["environment"] == "arith" and trainer["judge"]["engines"] == 1
        kubelet = cluster.kubelet
        any_replica = kubelet._resolve_url(namespace, "agents-env-arith", None, 8080)
        with urllib.request.urlopen(f"http://127.0.0.1:{any_replica}/healthz", timeout=10) as response:
            assert json.loads(response.read())["environment"] == "arithmetic"
        for i in (0, 1):  # each replica holds its own episodes, reached by its own name
            port = kubelet._resolve_url(namespace, "agents-env-arith", f"agents-env-arith-{i}", 8080)
            opened = post(port, "/reset", {"seed": 3, "task": "easy"})
            assert opened["observation"].startswith("Start with ")
            stepped = post(port, "/step", {"episode_id": opened["episode_id"], "action": "no idea"})
            assert stepped["done"] is False and "No number found" in stepped["observation"]

        cluster.kubectl("delete", "rljob", "agents", "-n", namespace, "--wait=true", "--timeout=60s")

        def gone() -> bool:
            left = pods_of(cluster, namespace, "rljob.io/job=agents")
            svc = cluster.get_json("service", "agents-env-arith", namespace=namespace)
            fence = cluster.get_json("networkpolicy", "agents-env", namespace=namespace)
            return not left and svc is None and fence is None

        wait_for("the environment pods, Service and NetworkPolicy deleted with the job", gone, timeout_s=60)


def test_a_broken_environment_is_named_in_status_and_an_event_and_the_trainers_keep_running(
    cluster: Any,
    crd: None,
    namespace: str,
    pool: Callable[..., str],
    local_cpu_node: str,
    kubeconfig_env: None,
) -> None:
    gpu_pool = pool(1)
    crash = "import sys; print('boom: the task file is missing', file=sys.stderr); sys.exit(3)"
    environments = [
        {"name": "crashy", "command": ["python", "-c", crash], "nodeSelector": {"pool": local_cpu_node}},
        {
            "name": "secretless",
            "env": [{"name": "API_KEY", "secretKeyRef": {"name": "env-keys", "key": "api"}}],
            "nodeSelector": {"pool": local_cpu_node},
        },
    ]
    with operator(namespace):
        apply(cluster, namespace, rljob("broken", gpu_pool, environments))

        def named() -> dict[str, Any]:
            st = job_status(cluster, namespace, "broken")
            cond = condition(st, "EnvironmentsReady")
            envs = {e["name"]: e for e in st.get("environments") or []}
            crashing = envs.get("crashy", {}).get("message") or ""
            missing = envs.get("secretless", {}).get("message") or ""
            ok = cond.get("reason") == "CrashLoopBackOff" and "CrashLoopBackOff" not in missing and missing
            return st if ok and "exited with code 3" in crashing else {}

        st = wait_for("the crashing environment named in status", named, timeout_s=120)
        cond = condition(st, "EnvironmentsReady")
        assert cond["status"] == "False"
        assert (
            "pod broken-env-crashy-0" in cond["message"]
            and "boom: the task file is missing" in cond["message"]
        )
        assert "spec.environments[0].command" in cond["message"]  # the fix
        envs = {e["name"]: e for e in st["environments"]}
        assert envs["crashy"]["ready"] == "0/1"
        secretless = envs["secretless"]["message"]
        assert 'secret "env-keys" not found' in secretless and "spec.environments[1].env" in secretless
        ready = condition(st, "Ready")
        assert ready["status"] == "False" and ready["reason"] in (
            "CrashLoopBackOff",
            "CreateContainerConfigError",
        )
        # The kubelet restarts the server; the gang does not restart for it.
        (crashy,) = pods_of(cluster, namespace, "rljob.io/environment=crashy")
        assert crashy["status"]["phase"] == "Running"
        assert crashy["status"]["containerStatuses"][0]["state"]["waiting"]["reason"] == "CrashLoopBackOff"
        assert st.get("restarts", 0) == 0 and st.get("failures", 0) == 0
        trainers = pods_of(cluster, namespace, "rljob.io/role=trainer")
        assert trainers and all(p["status"]["phase"] == "Running" for p in trainers)

        def event() -> list[dict[str, Any]]:
            data = (
                cluster.get_json(
                    "events", "--field-selector", "involvedObject.name=broken", namespace=namespace
                )
                or {}
            )
            return [
                e
                for e in data.get("items", [])
                if e["reason"] == "CrashLoopBackOff"
                and e["type"] == "Warning"
                and "broken-env-crashy-0" in e["message"]
            ]

        wait_for("a Warning Event naming the crashing pod", event, timeout_s=30)
        # The missing Secret appears: that server starts and becomes ready; the job says so.
        cluster.kubectl("create", "secret", "generic", "env-keys", "--from-literal=api=k", "-n", namespace)

        def secretless_ready() -> bool:
            envs = {e["name"]: e for e in job_status(cluster, namespace, "broken").get("environments") or []}
            return envs.get("secretless", {}).get("readyReplicas") == 1

        wait_for("the server with its Secret ready", secretless_ready, timeout_s=90)


def test_a_queued_jobs_environments_are_in_its_kueue_workload_and_placed_on_its_flavor(
    cluster: Any,
    crd: None,
    kueue: Any,
    namespace: str,
    pool: Callable[..., str],
    kubeconfig_env: None,
) -> None:
    """The real Kueue admits the job's environment servers with its core (podSet environment-<name>,
    its requests counted in the quota), and the servers go to the admitted flavor's nodes."""
    from test_kueue import cpu_rljob

    from testenv import kueue as kueue_env

    pool_name = pool(4, per_node=1, resource=None)
    flavor, cq = f"flavor-{namespace}"[:63], f"cq-{namespace}"[:63]
    queues = kueue_env.queue_manifests(
        namespace=namespace,
        flavor=flavor,
        cluster_queue=cq,
        local_queue="team-queue",
        quota={"cpu": "4", "memory": "8Gi"},
        node_labels={"pool": pool_name},
    )
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(queues))
    job = cpu_rljob("queued", {"kueue.x-k8s.io/queue-name": "team-queue"})
    job["spec"]["environments"] = [{"name": "arith", "resources": {"cpu": "500m", "memory": "512Mi"}}]
    try:
        with operator(namespace):
            apply(cluster, namespace, job)

            def admitted() -> dict[str, Any]:
                wl = cluster.get_json("workload", "rljob-queued", namespace=namespace) or {}
                conds = (wl.get("status") or {}).get("conditions") or []
                return wl if any(c["type"] == "Admitted" and c["status"] == "True" for c in conds) else {}

            wl = wait_for("the job's Workload admitted", admitted, timeout_s=90)
            sets = {s["name"]: s for s in wl["spec"]["podSets"]}
            assert {name: s["count"] for name, s in sets.items()} == {
                "trainer": 2,
                "rollout": 1,
                "environment-arith": 1,
            }
            requests = sets["environment-arith"]["template"]["spec"]["containers"][0]["resources"]["requests"]
            assert requests == {"cpu": "500m", "memory": "512Mi"}

            def placed() -> list[dict[str, Any]]:
                found = pods_of(cluster, namespace, "rljob.io/environment=arith")
                return found if found and found[0]["spec"].get("nodeName") else []

            (server,) = wait_for("the environment pod bound", placed, timeout_s=60)
            assert server["spec"]["nodeSelector"] == {"pool": pool_name}  # the flavor's nodeLabels
            assert server["spec"]["nodeName"].startswith(pool_name)
    finally:
        cluster.kubectl("delete", "rljobs", "--all", "-n", namespace, "--wait=true", check=False)
        cluster.kubectl("delete", "workloads", "--all", "-n", namespace, "--wait=true", check=False)
        cluster.kubectl("delete", "-f", "-", "--wait=false", input=yaml.safe_dump_all(queues), check=False)


def test_an_agent_environment_gets_the_jobs_endpoint_token_and_the_one_way_to_reach_it(
    cluster: Any,
    crd: None,
    namespace: str,
    pool: Callable[..., str],
    local_cpu_node: str,
    operator_identity: str,
) -> None:
    """An environment of mode agent: the operator makes the job's endpoint token Secret (immutable,
    owned by the job), hands it to trainer pod 0 (with its port `endpoint`) and to the environment's
    servers, whose processes really hold it, and opens exactly one way out of their fence: trainer
    pod 0's endpoint port (and DNS), which the job's own NetworkPolicy admits from them only."""
    import base64

    gpu_pool = pool(1)
    job = rljob(
        "agentic",
        gpu_pool,
        [{"name": "arith", "mode": "agent", "nodeSelector": {"pool": local_cpu_node}}],
    )
    del job["spec"]["rollout"]["agent"]["tools"]  # its agent brings its own (CEL refuses both)
    with operator(namespace):
        apply(cluster, namespace, job)

        def ready() -> dict[str, Any]:
            st = job_status(cluster, namespace, "agentic")
            envs = st.get("environments") or []
            return st if envs and envs[0].get("readyReplicas") == 1 else {}

        wait_for("the agent environment's server ready", ready, timeout_s=120)
        uid = cluster.get_json("rljob", "agentic", namespace=namespace)["metadata"]["uid"]
        secret_name = f"agentic-endpoint-{uid[:8]}"
        secret = cluster.get_json("secret", secret_name, namespace=namespace)
        assert secret is not None and secret["immutable"] is True
        assert secret["metadata"]["ownerReferences"][0]["kind"] == "RLJob"
        token = base64.b64decode(secret["data"]["token"]).decode()
        assert len(token) == 64 and int(token, 16) >= 0  # 32 random bytes, hex

        (trainer,) = pods_of(cluster, namespace, "rljob.io/role=trainer")
        container = trainer["spec"]["containers"][0]
        assert {"name": "endpoint", "containerPort": 8000, "protocol": "TCP"} in container["ports"]
        by_name = {e["name"]: e for e in container["env"]}
        ref = {"secretKeyRef": {"name": secret_name, "key": "token"}}
        assert (
            by_name["RLJOB_ENDPOINT_TOKEN"]["valueFrom"] == ref
            and "value" not in by_name["RLJOB_ENDPOINT_TOKEN"]
        )

        (env_pod,) = pods_of(cluster, namespace, "rljob.io/role=environment")
        env_vars = {e["name"]: e for e in env_pod["spec"]["containers"][0]["env"]}
        assert env_vars["OPENAI_API_KEY"]["valueFrom"] == ref
        # The kubelet resolved the reference: the server's process holds the token.
        pids = cluster.kubelet.local_pids(namespace, env_pod["metadata"]["name"])
        environ = psutil.Process(pids[0]).environ()
        assert environ["OPENAI_API_KEY"] == token == environ["RLJOB_ENDPOINT_TOKEN"]

        config = cluster.get_json("configmap", "agentic-config", namespace=namespace)
        trainer_json = json.loads(config["data"]["trainer.json"])
        assert trainer_json["endpoint"]["url"] == f"http://agentic-trainer-0.agentic.{namespace}.svc:8000"
        assert trainer_json["environments"][0]["mode"] == "agent"
        assert token not in json.dumps(config)  # the token is only in its Secret

        opening = cluster.get_json("networkpolicy", "agentic-env-endpoint", namespace=namespace)
        assert opening["spec"]["policyTypes"] == ["Egress"]
        to_trainer = opening["spec"]["egress"][0]
        assert to_trainer["ports"] == [{"protocol": "TCP", "port": 8000}]
        assert to_trainer["to"][0]["podSelector"]["matchLabels"]["rljob.io/index"] == "0"
        main = cluster.get_json("networkpolicy", "agentic", namespace=namespace)
        admitted = [
            r for r in main["spec"]["ingress"] if r.get("ports") == [{"protocol": "TCP", "port": "endpoint"}]
        ]
        (rule,) = admitted
        assert rule["from"][0]["podSelector"]["matchLabels"]["rljob.io/role"] == "environment"

        cluster.kubectl("delete", "rljob", "agentic", "-n", namespace, "--wait=true", "--timeout=60s")

        def gone() -> bool:
            return (
                cluster.get_json("secret", secret_name, namespace=namespace) is None
                and cluster.get_json("networkpolicy", "agentic-env-endpoint", namespace=namespace) is None
            )

        wait_for("the token Secret and the opening deleted with the job", gone, timeout_s=60)

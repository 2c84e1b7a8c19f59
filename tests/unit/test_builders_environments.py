"""Unit tests for spec.environments[] and the judge's pods in the builders (builders.environments,
builders.pods, builders.configmaps, builders.network_policy, builders.workload, builders.podgroup),
the names they use, and the API rules only the operator checks (names.validate_environment_name)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_builders import make_spec, static_plan
from test_builders_security import matches

from rljob_env import arithmetic, arithmetic_agent
from rljob_env import server as env_server
from rljob_operator import api, builders, names
from rljob_operator.builders import environments, network_policy, podgroup
from rljob_operator.decide import admission
from rljob_trainer import config as tc

JOB = builders.JobRef("demo", "team-a", "0123456789abcdef-uid")
JUDGE = {
    "model": {
        "name": "judge",
        "source": {"pvc": {"claimName": "judges", "path": "qwen3-8b"}},
        "config": {"inline": {"model_type": "llama"}},
    },
    "promptTemplate": "Rate {response} to {prompt}: 0 to 10.",
}


def agent_spec(**overrides: Any) -> api.RLJobSpec:
    base: dict[str, Any] = {
        "environments": [
            {"name": "arith", "replicas": 2, "nodeSelector": {"pool": "cpu"}},
            {
                "name": "web",
                "image": "example.com/web-env:1",
                "command": ["/bin/web-env"],
                "args": ["--listen", "$(RLJOB_ENV_PORT)"],
                "port": 9000,
                "env": [
                    {"name": "MODE", "value": "eval"},
                    {"name": "API_KEY", "secretKeyRef": {"name": "keys", "key": "web"}},
                    {"name": "RLJOB_ENV_PORT", "value": "1"},  # the operator's own wins
                ],
                "taskConfig": {"depth": 2},
            },
        ],
        "rollout": {
            "agent": {
                "maxTurns": 6,
                "maxTotalTokens": 256,
                "environment": "arith",
                "tools": [
                    {"name": "calc", "kind": "calculator"},
                    {"name": "py", "kind": "python", "memory": "64Mi", "cpuSeconds": 2.0},
                    {
                        "name": "search",
                        "kind": "http",
                        "url": "http://search.tools.svc:8080/call",
                        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                    },
                ],
            }
        },
        "lengths": {"maxCompletionTokens": 512},
    }
    base.update(overrides)
    return make_spec(**base)


def judge_plan(spec: api.RLJobSpec, tp: int = 2) -> api.PlanStatus:
    return static_plan(spec).model_copy(
        update={
            "judge": api.JudgePlanStatus(
                engines=2,
                tensor_parallel=tp,
                accelerators=2 * tp,
                max_model_len=900,
                max_num_seqs=64,
                max_num_batched_tokens=900,
                cpu_kv_cache_bytes=12345,
            )
        }
    )


def objects(spec: api.RLJobSpec, plan: api.PlanStatus | None = None, **kw: Any) -> builders.JobObjects:
    plan = plan or static_plan(spec)
    layout = builders.compute_layout(spec, plan)
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64}
    return builders.build_job_objects(
        JOB, spec, plan, layout, config, ray_token="t" * 64, judge_config=config, **kw
    )


# ---- environment pods ------------------------------------------------------------------------------
def test_environment_pods_are_hardened_servers_with_their_own_name_port_and_probe() -> None:
    spec = agent_spec()
    pods = environments.build_environment_pods(JOB, spec, attempt=3)
    assert [p["metadata"]["name"] for p in pods] == ["demo-env-arith-0", "demo-env-arith-1", "demo-env-web-0"]
    arith = pods[1]
    assert arith["metadata"]["labels"] == {
        "rljob.io/job": "demo",
        "rljob.io/role": "environment",
        "rljob.io/index": "1",
        "rljob.io/environment": "arith",
        "app.kubernetes.io/managed-by": "rljob-operator",
    }
    assert arith["metadata"]["annotations"][names.ANNOTATION_ATTEMPT] == "3"
    ps = arith["spec"]
    assert ps["restartPolicy"] == "Always"  # the kubelet restarts a server; the gang never restarts
    assert (ps["hostname"], ps["subdomain"]) == ("demo-env-arith-1", "demo-env-arith")
    assert ps["automountServiceAccountToken"] is False and ps["enableServiceLinks"] is False
    assert ps["nodeSelector"] == {"pool": "cpu"}
    (c,) = ps["containers"]
    assert c["image"] == spec.image.trainer  # the default: the trainer image ships rljob_env
    assert c["command"] == ["python", "-m", "rljob_env.arithmetic"]
    assert c["args"] == ["--port", "$(RLJOB_ENV_PORT)"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env[names.ENV_ENVIRONMENT_PORT] == "8080" and env["HOME"] == "/tmp"
    assert c["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["resources"]["requests"] == c["resources"]["limits"] == {"cpu": "500m", "memory": "512Mi"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["allowPrivilegeEscalation"] is False and sc["runAsNonRoot"] is True
    assert ps["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert ps["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}}]
    text = json.dumps(pods)
    assert "RAY_AUTH_TOKEN" not in text and "ray-auth" not in text  # no token of the job's Ray


def test_an_environment_of_its_own_image_runs_its_command_with_its_env_and_the_operators_port() -> None:
    web = environments.build_environment_pods(JOB, agent_spec())[2]
    (c,) = web["spec"]["containers"]
    assert (c["image"], c["command"], c["args"]) == (
        "example.com/web-env:1",
        ["/bin/web-env"],
        ["--listen", "$(RLJOB_ENV_PORT)"],
    )
    env = {e["name"]: e for e in c["env"]}
    assert env["RLJOB_ENV_PORT"]["value"] == "9000"  # the probe's port: the user's value never replaces it
    assert [e["name"] for e in c["env"]].count("RLJOB_ENV_PORT") == 1
    assert env["MODE"]["value"] == "eval"
    assert env["API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "keys", "key": "web"}}


def test_a_changed_environment_changes_only_its_own_pods_template_hash() -> None:
    hashes = [
        p["metadata"]["annotations"][names.ANNOTATION_TEMPLATE_HASH]
        for p in environments.build_environment_pods(JOB, agent_spec())
    ]
    spec = agent_spec()
    raw = spec.model_dump(by_alias=True, exclude_none=True)
    raw["environments"][1]["port"] = 9001
    changed = [
        p["metadata"]["annotations"][names.ANNOTATION_TEMPLATE_HASH]
        for p in environments.build_environment_pods(JOB, api.RLJobSpec.model_validate(raw))
    ]
    assert changed[:2] == hashes[:2] and changed[2] != hashes[2]


def test_the_contract_constants_agree_with_the_environment_package() -> None:
    assert names.ENV_ENVIRONMENT_PORT == env_server.ENV_PORT
    assert api.DEFAULT_ENVIRONMENT_MODULES == {
        "steps": "rljob_env.arithmetic",
        "agent": "rljob_env.arithmetic_agent",
    }
    # What each default serves: reset/step, or whole episodes (POST /episode) for mode agent.
    served = {"steps": arithmetic.Arithmetic(), "agent": arithmetic_agent.ArithmeticAgent("token")}
    for mode, module in api.DEFAULT_ENVIRONMENT_MODULES.items():
        assert module == type(served[mode]).__module__
        assert env_server.EnvironmentServer(served[mode]).agent_mode == (mode == "agent")


# ---- Service and NetworkPolicies -----------------------------------------------------------------------
def test_the_headless_service_selects_exactly_its_environments_pods() -> None:
    spec = agent_spec()
    objs = objects(spec)
    services = {s["metadata"]["name"]: s for s in objs.environment_services}
    assert set(services) == {"demo-env-arith", "demo-env-web"}
    svc = services["demo-env-arith"]
    assert svc["spec"]["clusterIP"] == "None" and "ports" not in svc["spec"]
    assert svc["spec"]["publishNotReadyAddresses"] is False
    every = [*objs.pods, *objs.environment_pods]
    selected = [
        p["metadata"]["name"]
        for p in every
        if matches({"matchLabels": svc["spec"]["selector"]}, p["metadata"]["labels"])
    ]
    assert selected == ["demo-env-arith-0", "demo-env-arith-1"]
    assert all(s in objs.children for s in objs.environment_services)  # created before the pods


def _admits(policy: dict[str, Any], source: dict[str, str], port: str | None) -> bool:
    for rule in policy["spec"].get("ingress") or []:
        if rule.get("ports") is not None and not any(p["port"] == port for p in rule["ports"]):
            continue
        if any(matches(peer["podSelector"], source) for peer in rule["from"]):
            return True
    return False


def test_environment_servers_take_only_the_jobs_trainer_and_rollout_pods_and_reach_nothing() -> None:
    objs = objects(agent_spec())
    policies = {p["metadata"]["name"]: p for p in objs.fence if p["kind"] == "NetworkPolicy"}
    fence, main = policies["demo-env"], policies["demo"]
    env_pod = objs.environment_pods[0]["metadata"]["labels"]
    trainer = objs.pods[0]["metadata"]["labels"]
    rollout = next(p for p in objs.pods if p["metadata"]["labels"]["rljob.io/role"] == "rollout")["metadata"][
        "labels"
    ]
    # The servers' policy selects them, and only them.
    assert matches(fence["spec"]["podSelector"], env_pod)
    assert not any(matches(fence["spec"]["podSelector"], p["metadata"]["labels"]) for p in objs.pods)
    assert fence["spec"]["policyTypes"] == ["Ingress", "Egress"] and fence["spec"]["egress"] == []
    assert _admits(fence, trainer, "http") and _admits(fence, rollout, "http")
    assert not _admits(fence, trainer, "metrics")  # only the server's port
    assert not _admits(fence, env_pod, "http")  # a server never reaches another server
    other_job = {**trainer, "rljob.io/job": "other"}
    assert not _admits(fence, other_job, "http")
    # The job's own policy leaves the servers out: they are neither fenced in nor admitted by it.
    assert not matches(main["spec"]["podSelector"], env_pod)
    assert all(matches(main["spec"]["podSelector"], p["metadata"]["labels"]) for p in objs.pods)
    assert not _admits(main, env_pod, None) and _admits(main, rollout, None)


def test_with_egress_restricted_the_trainers_may_still_reach_their_environments() -> None:
    settings = network_policy.Settings(egress=({"to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}]},))
    (main,) = [p for p in objects(agent_spec(), network=settings).fence if p["metadata"]["name"] == "demo"]
    env_pod = objects(agent_spec()).environment_pods[0]["metadata"]["labels"]
    assert any(matches(peer["podSelector"], env_pod) for peer in main["spec"]["egress"][0]["to"])


def test_no_environments_no_environment_objects_and_a_disabled_fence_has_no_server_policy() -> None:
    plain = objects(make_spec())
    assert plain.environment_pods == () and plain.environment_services == ()
    assert [p["metadata"]["name"] for p in plain.fence if p["kind"] == "NetworkPolicy"] == ["demo"]
    off = objects(agent_spec(), network=network_policy.Settings(enabled=False))
    assert not [p for p in off.fence if p["kind"] == "NetworkPolicy"]


# ---- trainer.json -----------------------------------------------------------------------------------
def test_the_trainer_config_has_the_agent_the_environments_urls_and_the_judge_plan() -> None:
    spec = agent_spec(reward={"judge": JUDGE})
    cfg = objects(spec, judge_plan(spec)).config_map["data"]["trainer.json"]
    parsed = tc.parse_config(json.loads(cfg))
    agent = parsed.agent
    assert agent is not None and agent.max_turns == 6 and agent.max_total_tokens == 256
    assert agent.environment == "arith"
    tools = {t.name: t for t in agent.tools}
    assert tools["py"].memory_bytes == 64 * 1024**2 and tools["py"].cpu_seconds == 2.0
    assert tools["search"].url == "http://search.tools.svc:8080/call"
    assert tools["search"].parameters == {"type": "object", "properties": {"q": {"type": "string"}}}
    arith, web = parsed.environments
    assert arith.url == "http://demo-env-arith.team-a.svc:8080"
    assert arith.replica_urls == [f"http://demo-env-arith-{i}.demo-env-arith.team-a.svc:8080" for i in (0, 1)]
    assert web.url == "http://demo-env-web.team-a.svc:9000" and web.task == {"depth": 2}
    judge = parsed.judge
    assert judge is not None and judge.kind == "llm" and judge.engines == 2 and judge.tensor_parallel == 2
    assert (judge.max_model_len, judge.max_num_seqs, judge.max_num_batched_tokens) == (900, 64, 900)
    assert judge.cpu_kv_cache_bytes == 12345
    assert judge.model.source == "pvc" and judge.model.path == "/judge-model/qwen3-8b"
    assert judge.prompt_template == JUDGE["promptTemplate"]


def test_the_trainer_config_has_the_demonstrations_in_order_with_their_tool_names() -> None:
    demos = [
        {"role": "user", "content": "What is 12 + 7?"},
        {
            "role": "assistant",
            "content": '<tool_call>{"name": "calc", "arguments": {"expression": "12+7"}}</tool_call>',
        },
        {"role": "tool", "name": "calc", "content": "19"},
        {"role": "assistant", "content": "19"},
    ]
    spec = make_spec(
        rollout={"agent": {"tools": [{"name": "calc", "kind": "calculator"}], "demonstrations": demos}}
    )
    agent = builders.render_trainer_config(spec, static_plan(spec), {"model_type": "llama"}, job=JOB).agent
    assert agent is not None
    assert [m.model_dump(exclude_none=True) for m in agent.demonstrations] == demos


def test_a_named_task_is_rendered_as_its_name() -> None:
    spec = make_spec(environments=[{"name": "arith", "task": "hard"}])
    (env,) = builders.render_trainer_config(
        spec, static_plan(spec), {"model_type": "llama"}, job=JOB
    ).environments
    assert env.task == "hard" and env.replica_urls == [
        "http://demo-env-arith-0.demo-env-arith.team-a.svc:8080"
    ]


# ---- the judge's pods ---------------------------------------------------------------------------------
def test_judge_pods_are_ray_workers_with_the_plans_accelerators_scheduled_like_rollout_pods() -> None:
    spec = agent_spec(
        reward={
            "judge": {
                **JUDGE,
                "model": {
                    **JUDGE["model"],
                    "source": {"hub": {"id": "Qwen/Qwen3-8B", "tokenSecretRef": {"name": "hf", "key": "t"}}},
                },
            }
        },
        rolloutPool={"nodeSelector": {"pool": "h100"}},
    )
    objs = objects(spec, judge_plan(spec, tp=4))
    judges = [p for p in objs.pods if p["metadata"]["labels"]["rljob.io/role"] == "judge"]
    assert [p["metadata"]["name"] for p in judges] == ["demo-judge-0", "demo-judge-1"]
    for k, pod in enumerate(judges):
        (c,) = pod["spec"]["containers"]
        env = {e["name"]: e for e in c["env"]}
        assert env[tc.ENV_ROLE]["value"] == tc.ROLE_JUDGE and env[tc.ENV_POD_INDEX]["value"] == str(k)
        assert env[tc.ENV_NUM_ACCELERATORS]["value"] == "4" and env[tc.ENV_RAY_ACCELERATOR]["value"] == "GPU"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"
        assert env["JUDGE_HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "t"}}
        assert "HF_TOKEN" not in env  # the policy's token stays with the policy's pods
        assert pod["spec"]["nodeSelector"] == {"pool": "h100"}
        assert pod["spec"]["automountServiceAccountToken"] is False
    assert tc.judge_resource_name(1) == "rljob_judge_1"
    trainer = next(p for p in objs.pods if p["metadata"]["name"] == "demo-trainer-0")
    assert "JUDGE_HF_TOKEN" in {e["name"] for e in trainer["spec"]["containers"][0]["env"]}


def test_a_judge_on_a_claim_is_mounted_in_judge_and_trainer_pods_only() -> None:
    spec = agent_spec(reward={"judge": JUDGE})
    objs = objects(spec, judge_plan(spec))
    for pod in objs.pods:
        mounts = {m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
        role = pod["metadata"]["labels"]["rljob.io/role"]
        assert ("/judge-model" in mounts) == (role in ("trainer", "judge")), pod["metadata"]["name"]


def test_the_gang_and_kueues_core_workload_hold_the_judge_and_the_environments() -> None:
    spec = agent_spec(reward={"judge": JUDGE})
    plan = judge_plan(spec)
    layout = builders.compute_layout(spec, plan)
    gang = podgroup.job_gang(JOB, spec, plan, layout)
    assert {"demo-judge-0", "demo-judge-1"} <= gang.members
    assert not any("-env-" in m for m in gang.members)  # servers restart alone, outside the gang
    pods = builders.build_pods(JOB, spec, layout)
    role = lambda r: [p for p in pods if p["metadata"]["labels"]["rljob.io/role"] == r]  # noqa: E731
    extra = admission.core_extra_pods(role("judge"), environments.build_environment_pods(JOB, spec))
    wl = admission.core_workload(
        JOB, role("trainer"), role("rollout"), queue_name="q", priority=None, extra=extra
    )
    assert [(s["name"], s["count"]) for s in wl["spec"]["podSets"]] == [
        ("trainer", 2),
        ("rollout", 2),
        ("judge", 2),
        ("environment-arith", 2),
        ("environment-web", 1),
    ]
    members = admission.pod_set_pods(role("trainer"), role("rollout"), extra)
    assert members["environment-arith"] == ["demo-env-arith-0", "demo-env-arith-1"]


# ---- names ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("job", "env", "replicas", "ok"),
    [
        ("demo", "arith", 1, True),
        ("a" * 51, "arith", 1, True),  # <job>-env-arith-0 at 63 characters
        ("a" * 51, "arith1", 1, False),
        ("a" * 40, "b" * 16, 10, True),  # ...-9 is the last replica's
        ("a" * 40, "b" * 16, 11, False),  # ...-10: one character more
    ],
)
def test_environment_names_fit_the_pods_hostnames(job: str, env: str, replicas: int, ok: bool) -> None:
    why = names.validate_environment_name(job, env, replicas)
    assert (why is None) == ok
    if not ok:
        assert "at most 63" in why and "shorten the environment's name" in why


def test_pod_names_parse_back_for_judges_and_environments_are_not_ray_pods() -> None:
    assert names.pod_name("demo", names.ROLE_JUDGE, 3) == "demo-judge-3"
    assert names.parse_pod_name("demo", "demo-judge-3") == (names.ROLE_JUDGE, 3)
    assert names.parse_pod_name("demo", "demo-env-arith-0") is None


def test_rljob_render_shows_the_servers_their_service_and_fence_and_the_judges_pods() -> None:
    from rljob_operator.cli import render

    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "vocab_size": 256,
        "max_position_embeddings": 4096,
    }
    tiny = {"name": "tiny", "source": {"tiny": {}}, "config": {"inline": config}}
    spec = agent_spec(reward={"judge": {**JUDGE, "model": tiny}}, model=tiny)
    out = render.render_job("demo", "team-a", spec, config, judge_config=config)
    kinds = [(o["kind"], o["metadata"]["name"]) for o in out]
    assert ("Service", "demo-env-arith") in kinds and ("NetworkPolicy", "demo-env") in kinds
    assert ("Pod", "demo-judge-0") in kinds and kinds[-1] == ("Pod", "demo-env-web-0")
    (cfg,) = render.render_job("demo", "team-a", spec, config, only="trainer-config", judge_config=config)
    assert cfg["environments"][0]["url"] == "http://demo-env-arith.team-a.svc:8080"
    assert cfg["judge"]["model"]["source"] == "tiny"

"""The job's OpenAI-compatible endpoint in the builders (builders.endpoint, and what it adds to
builders.pods, builders.environments, builders.configmaps, builders.network_policy,
builders.objects): an environment of mode agent gets the job a token Secret, trainer pod 0 the port
`endpoint` 8000 and the token, that environment's pods the token and a way to trainer pod 0 on that
port (and DNS), and trainer.json its `endpoint`; an environment of mode steps changes nothing."""

from __future__ import annotations

import json
from typing import Any

from test_builders_environments import JOB, agent_spec, objects
from test_builders_security import matches

from rljob_operator import api, names
from rljob_operator.builders import endpoint, network_policy
from rljob_operator.cli import render
from rljob_trainer import config as tc

TOKEN = "e" * 64


def mode_agent_spec(**overrides: Any) -> api.RLJobSpec:
    """`arith` runs the trainer's loop (steps); `web` runs its own agent (mode agent), which the
    trainer's loop drives (agent.environment), without trainer tools."""
    spec = agent_spec(**overrides)
    web = spec.environments[1].model_copy(update={"mode": "agent"})
    agent = spec.rollout.agent.model_copy(update={"environment": "web", "tools": []})
    return spec.model_copy(
        update={
            "environments": [spec.environments[0], web],
            "rollout": spec.rollout.model_copy(update={"agent": agent}),
        }
    )


def _by_name(objs: Any) -> dict[str, dict[str, Any]]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objs.all()}


def _env_var(container: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((e for e in container["env"] if e["name"] == name), None)


def test_mode_defaults_to_steps_and_the_crd_offers_agent() -> None:
    assert api.EnvironmentSpec(name="a").mode == "steps"
    assert api.EnvironmentSpec.model_validate({"name": "a", "mode": "agent"}).mode == "agent"
    schema = api.RLJobSpec.model_json_schema(by_alias=True)
    text = json.dumps(schema)
    assert '"steps"' in text and '"agent"' in text


def test_an_agent_environment_without_a_command_runs_the_shipped_agent_environment() -> None:
    spec = mode_agent_spec()
    arith = spec.environments[0].model_copy(update={"mode": "agent"})  # no image, no command
    agent = spec.rollout.agent.model_copy(update={"environment": "arith"})
    spec = spec.model_copy(
        update={"environments": [arith], "rollout": spec.rollout.model_copy(update={"agent": agent})}
    )
    (c,) = objects(spec, endpoint_token=TOKEN).environment_pods[0]["spec"]["containers"]
    # It answers POST /episode (the steps default, rljob_env.arithmetic, would answer every one 404).
    assert c["command"] == ["python", "-m", "rljob_env.arithmetic_agent"]
    assert c["args"] == ["--port", "$(RLJOB_ENV_PORT)"]
    assert _env_var(c, endpoint.OPENAI_API_KEY_ENV)["valueFrom"]["secretKeyRef"]["key"] == endpoint.TOKEN_KEY


def test_without_an_agent_environment_nothing_of_the_endpoint_exists() -> None:
    objs = objects(agent_spec())
    assert not [k for k in _by_name(objs) if "endpoint" in k]
    trainer0 = objs.pods[0]["spec"]["containers"][0]
    assert endpoint.PORT_NAME not in {p["name"] for p in trainer0["ports"]}
    assert _env_var(trainer0, tc.ENV_ENDPOINT_TOKEN) is None
    cfg = tc.parse_config(json.loads(objs.config_map["data"]["trainer.json"]))
    assert cfg.endpoint is None and {e.mode for e in cfg.environments} == {"steps"}


def test_the_token_secret_is_the_jobs_own_immutable_and_read_only_through_secret_refs() -> None:
    objs = objects(mode_agent_spec(), endpoint_token=TOKEN)
    secret = _by_name(objs)[f"Secret/demo-endpoint-{JOB.uid[:8]}"]
    assert secret["immutable"] is True and secret["stringData"] == {endpoint.TOKEN_KEY: TOKEN}
    assert secret["metadata"]["labels"]["rljob.io/role"] == names.ROLE_ENDPOINT
    # The token is in the Secret only: no pod spec holds it.
    pods = [*objs.pods, *objs.environment_pods]
    assert TOKEN not in json.dumps(pods) and TOKEN not in json.dumps(objs.config_map)
    ref = {"secretKeyRef": {"name": secret["metadata"]["name"], "key": endpoint.TOKEN_KEY}}
    trainer0 = objs.pods[0]["spec"]["containers"][0]
    assert _env_var(trainer0, tc.ENV_ENDPOINT_TOKEN) == {"name": tc.ENV_ENDPOINT_TOKEN, "valueFrom": ref}
    # Only trainer pod 0 (the driver) holds it among the Ray pods.
    assert all(_env_var(p["spec"]["containers"][0], tc.ENV_ENDPOINT_TOKEN) is None for p in objs.pods[1:])
    arith, web = (objs.environment_pods[0], objs.environment_pods[-1])
    assert arith["metadata"]["labels"][names.LABEL_ENVIRONMENT] == "arith"
    assert web["metadata"]["labels"][names.LABEL_ENVIRONMENT] == "web"
    web_c, arith_c = web["spec"]["containers"][0], arith["spec"]["containers"][0]
    assert _env_var(web_c, "OPENAI_API_KEY") == {"name": "OPENAI_API_KEY", "valueFrom": ref}
    assert _env_var(web_c, tc.ENV_ENDPOINT_TOKEN) == {"name": tc.ENV_ENDPOINT_TOKEN, "valueFrom": ref}
    assert _env_var(arith_c, "OPENAI_API_KEY") is None  # a steps environment never gets it


def test_trainer_pod_0_serves_on_port_endpoint_8000() -> None:
    objs = objects(mode_agent_spec(), endpoint_token=TOKEN)
    ports = {p["name"]: p for p in objs.pods[0]["spec"]["containers"][0]["ports"]}
    assert ports["endpoint"] == {"name": "endpoint", "containerPort": 8000, "protocol": "TCP"}
    assert tc.ENDPOINT_PORT == 8000
    # The driver listens on the port its container declares, told in its environment.
    port = _env_var(objs.pods[0]["spec"]["containers"][0], tc.ENV_ENDPOINT_PORT)
    assert port == {"name": "RLJOB_ENDPOINT_PORT", "value": "8000"}
    for pod in objs.pods[1:]:
        assert "endpoint" not in {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
        assert _env_var(pod["spec"]["containers"][0], tc.ENV_ENDPOINT_PORT) is None


def test_the_trainer_config_names_the_endpoint_and_the_mode() -> None:
    objs = objects(mode_agent_spec(), endpoint_token=TOKEN)
    cfg = tc.parse_config(json.loads(objs.config_map["data"]["trainer.json"]))
    assert cfg.endpoint is not None
    assert cfg.endpoint.url == "http://demo-trainer-0.demo.team-a.svc:8000" and cfg.endpoint.port == 8000
    assert [(e.name, e.mode) for e in cfg.environments] == [("arith", "steps"), ("web", "agent")]
    assert cfg.agent is not None and cfg.agent.environment == "web"


def test_the_agent_environments_pods_reach_trainer_pod_0_on_the_endpoint_and_nothing_else() -> None:
    objs = objects(mode_agent_spec(), endpoint_token=TOKEN)
    by = _by_name(objs)
    main, fence, reach = (
        by["NetworkPolicy/demo"],
        by["NetworkPolicy/demo-env"],
        by["NetworkPolicy/demo-env-endpoint"],
    )
    arith = objs.environment_pods[0]["metadata"]["labels"]
    web = objs.environment_pods[-1]["metadata"]["labels"]
    trainer0 = objs.pods[0]["metadata"]["labels"]
    trainer1 = {**trainer0, names.LABEL_INDEX: "1"}
    # Egress: only the web pods, only to trainer pod 0 on 8000, and DNS.
    assert matches(reach["spec"]["podSelector"], web) and not matches(reach["spec"]["podSelector"], arith)
    assert not any(matches(reach["spec"]["podSelector"], p["metadata"]["labels"]) for p in objs.pods)
    assert reach["spec"]["policyTypes"] == ["Egress"]
    to_trainer, dns = reach["spec"]["egress"]
    (peer,) = to_trainer["to"]
    assert matches(peer["podSelector"], trainer0) and not matches(peer["podSelector"], trainer1)
    assert not matches(peer["podSelector"], {**trainer0, names.LABEL_JOB: "other"})
    assert to_trainer["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert {p["port"] for p in dns["ports"]} == {53}

    # Ingress on the job's pods: the web pods on the port `endpoint` only (only trainer pod 0 has it).
    def admits(policy: dict[str, Any], source: dict[str, str], port: str | None) -> bool:
        for rule in policy["spec"]["ingress"]:
            if rule.get("ports") is not None and not any(p["port"] == port for p in rule["ports"]):
                continue
            if any(matches(p["podSelector"], source) for p in rule["from"] if "podSelector" in p):
                return True
        return False

    assert admits(main, web, "endpoint")
    assert not admits(main, web, None) and not admits(main, web, "metrics")  # Ray, NCCL, metrics: no
    assert not admits(main, arith, "endpoint")  # a steps environment still reaches nothing
    # The environments' own policy is unchanged: they still admit only trainer and rollout pods.
    assert fence["spec"]["egress"] == []


def test_a_disabled_fence_still_has_the_secret_and_no_policies() -> None:
    off = objects(mode_agent_spec(), endpoint_token=TOKEN, network=network_policy.Settings(enabled=False))
    kinds = [o["kind"] for o in off.fence]
    assert kinds == ["Secret", "Secret"]


def test_rljob_render_shows_the_endpoint_with_a_placeholder_token() -> None:
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
    out = render.render_job("demo", "team-a", mode_agent_spec(model=tiny), config)
    by = {(o["kind"], o["metadata"]["name"]): o for o in out}
    secret = by[("Secret", "demo-endpoint")]  # offline: no uid
    assert secret["stringData"][endpoint.TOKEN_KEY] == endpoint.RENDERED_TOKEN
    assert ("NetworkPolicy", "demo-env-endpoint") in by
    (cfg,) = render.render_job("demo", "team-a", mode_agent_spec(model=tiny), config, only="trainer-config")
    assert cfg["endpoint"]["url"] == "http://demo-trainer-0.demo.team-a.svc:8000"

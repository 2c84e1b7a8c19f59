"""`spec.rollout.agent` and `spec.environments`: multi-turn, tool-using episodes and the environment
servers the operator runs for them (docs/agents.md).

The agent loop itself runs in the trainer image (`rljob_trainer.config.AgentSettings`, what these
render to); the environments are pods and a Service per entry that the operator creates, fences
and deletes with the job (`builders.environments`).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from rljob_operator import quantity
from rljob_operator.api.base import CelRule, Quantity, _count, _Spec
from rljob_operator.api.model import SecretKeyRef

ToolKind = Literal["calculator", "python", "http"]
#: An environment's name: it becomes part of its Service (`<job>-env-<name>`, an RFC 1035 label).
ENVIRONMENT_NAME_PATTERN = r"^[a-z]([-a-z0-9]{0,20}[a-z0-9])?$"
#: Kueue admits a Workload of at most 8 podSets: trainer pods (1 or 2), rollout pods, judge pods
#: and one podSet per environment fit in it with at most 4 environments.
MAX_ENVIRONMENTS = 4
#: The smallest address space a python tool may have (the trainer's ToolSettings.memory_bytes floor).
MIN_TOOL_MEMORY_BYTES = 16 * 1024**2
#: What an environment runs when its command is not set, by its mode: the arithmetic game shipped in
#: the trainer image, stepped by the trainer (steps) or played by its own agent (agent).
DEFAULT_ENVIRONMENT_MODULES: dict[str, str] = {
    "steps": "rljob_env.arithmetic",
    "agent": "rljob_env.arithmetic_agent",
}


# --------------------------------------------------------------------------------------------
# spec.rollout.agent
# --------------------------------------------------------------------------------------------
class ToolSpec(_Spec):
    """A tool the policy may call between turns, offered through the model's chat template."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="(self.kind == 'http') == has(self.url)",
            message="spec.rollout.agent.tools[].url is required for kind http and forbidden otherwise (a "
            "calculator or python tool runs inside the trainer's sandbox)",
            field_path=".url",
            check=lambda s: (s.kind == "http") == (s.url is not None),
        ),
        CelRule(
            rule="!has(self.parameters) || self.kind == 'http'",
            message="spec.rollout.agent.tools[].parameters is for kind http (the calculator and python tools "
            "declare their own arguments): remove it",
            field_path=".parameters",
            reason="FieldValueForbidden",
            check=lambda s: s.parameters is None or s.kind == "http",
        ),
    )

    name: str = Field(
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="The name the model calls the tool by (letters, digits and _).",
    )
    kind: ToolKind = Field(
        description="calculator (arithmetic on numbers: no names, no calls), python (a sandboxed "
        "interpreter: no network, CPU, memory and time limits, nothing of the trainer reachable) or http "
        "(a user tool: "
        "POST {name, arguments} to url, answered {result})."
    )
    description: str | None = Field(
        None, min_length=1, max_length=1024, description="What the model is told the tool does."
    )
    url: str | None = Field(
        None,
        min_length=1,
        max_length=2048,
        pattern=r"^https?://",
        description="kind http: where calls go (in the cluster; the job's NetworkPolicy must let the "
        "trainer pods reach it).",
    )
    parameters: dict[str, Any] | None = Field(
        None,
        description="kind http: the JSON schema of the call's arguments, offered to the model through the "
        "chat template. Default: an object with no declared properties.",
    )
    timeout_seconds: float = Field(
        10.0, gt=0.0, le=3600.0, description="A call running longer fails, and its result says so."
    )
    cpu_seconds: float = Field(5.0, gt=0.0, le=3600.0, description="kind python: CPU time of one call.")
    memory: Quantity = Field("256Mi", description="kind python: address space of one call, at least 16Mi.")
    max_result_chars: int = Field(
        2000, ge=16, le=1_000_000, description="A longer result is cut, and says it was."
    )

    @model_validator(mode="after")
    def _memory_floor(self) -> ToolSpec:
        # Not CEL: a quantity's bytes need the Kubernetes parser.
        if quantity.to_bytes(self.memory) < MIN_TOOL_MEMORY_BYTES:
            raise ValueError(
                f"spec.rollout.agent.tools[].memory {self.memory} is below 16Mi: a Python interpreter "
                "does not start in less; raise it"
            )
        return self


class DemonstrationMessage(_Spec):
    """One message of a worked example shown before every task (spec.rollout.agent.demonstrations)."""

    role: Literal["user", "assistant", "tool"] = Field(
        description="user (a task), assistant (the model's reply: a tool call written as the model calls "
        "tools, or an answer) or tool (a tool's result)."
    )
    content: str = Field(max_length=4096, description="The message's text, as the chat template renders it.")
    name: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="role tool: the tool that answered (templates that render it show it).",
    )


class AgentSpec(_Spec):
    """Episodes of several turns: the model generates, calls tools or steps an environment, and
    generates again, until it answers, maxTurns or the token budget. What the engine generated is
    never re-tokenised: log-probs and staleness stay exact per token, and the tool and environment
    tokens are masked out of the loss."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="self.tools.all(t, self.tools.exists_one(u, u.name == t.name))",
            message="spec.rollout.agent.tools[].name must be unique: the model calls a tool by its name",
            field_path=".tools",
            check=lambda s: len({t.name for t in s.tools}) == len(s.tools),
        ),
        CelRule(
            rule="!has(self.demonstrations) || size(self.demonstrations) == 0 || "
            "(self.demonstrations[0].role == 'user' && "
            "self.demonstrations[size(self.demonstrations) - 1].role == 'assistant')",
            message="spec.rollout.agent.demonstrations must start with a user message (a task) and end with "
            "an assistant message (its answer): the episode's own task follows it as the next user message",
            field_path=".demonstrations",
            check=lambda s: (
                not s.demonstrations
                or (s.demonstrations[0].role == "user" and s.demonstrations[-1].role == "assistant")
            ),
        ),
    )

    max_turns: int = Field(4, ge=1, le=64, description="Model turns per episode.")
    max_total_tokens: int | None = Field(
        None,
        ge=1,
        le=1_048_576,
        description="Response tokens of one episode, generated and tool/observation tokens together; at "
        "most spec.lengths.maxCompletionTokens (the engines' context is maxPromptTokens + "
        "maxCompletionTokens). Default: spec.lengths.maxCompletionTokens.",
    )
    tools: list[ToolSpec] = Field(
        default_factory=list, max_length=16, description="Tools offered to the model (hermes tool calls)."
    )
    environment: str | None = Field(
        None,
        min_length=1,
        max_length=22,
        pattern=ENVIRONMENT_NAME_PATTERN,
        description="The name of a spec.environments[] entry whose reset/step drive the episodes "
        "(docs/contracts.md). Unset: the prompts come from spec.data and the tools are the only world.",
    )
    demonstrations: list[DemonstrationMessage] = Field(
        default_factory=list,
        max_length=32,
        description="Worked examples put before every task (in training and evaluation), after the system "
        "message: user, assistant (a tool call as the model writes one), tool and assistant messages. A "
        "small model offered tools in the system message alone may never call one, and GRPO cannot "
        "reinforce a call it never samples (docs/agents.md). Their tokens count in "
        "spec.lengths.maxPromptTokens.",
    )


class RolloutLoopSpec(_Spec):
    """How episodes are rolled out (the engines themselves are spec.resources.rollout)."""

    agent: AgentSpec | None = Field(
        None, description="Multi-turn, tool-using episodes. Unset: one turn per prompt."
    )


# --------------------------------------------------------------------------------------------
# spec.environments[]
# --------------------------------------------------------------------------------------------
class EnvVarSpec(_Spec):
    """An environment variable of an environment's container: a value, or a Secret key."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="has(self.value) != has(self.secretKeyRef)",
            message="spec.environments[].env[]: set exactly one of value or secretKeyRef",
            check=lambda s: _count(s.value, s.secret_key_ref) == 1,
        ),
    )

    name: str = Field(
        min_length=1,
        max_length=256,
        pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$",
        description="Variable name (a C identifier, or with - and .).",
    )
    value: str | None = Field(None, max_length=32768, description="The value.")
    secret_key_ref: SecretKeyRef | None = Field(
        None, description="A Secret key in the RLJob's namespace holding the value (never inline)."
    )


class EnvironmentResourcesSpec(_Spec):
    """CPU and memory of one environment pod (requests = limits)."""

    cpu: Quantity = Field("500m", description="CPU request and limit, for example 1 or 500m.")
    memory: Quantity = Field("512Mi", description="Memory request and limit, for example 1Gi.")
    scratch: Quantity = Field(
        "256Mi",
        description="Size limit of the pod's writable /tmp (an emptyDir: the root filesystem is read-only).",
    )


class EnvironmentSpec(_Spec):
    """An environment server of the job: `replicas` pods `<job>-env-<name>-<i>` under the headless
    Service `<job>-env-<name>` (each replica reachable by its own DNS name, so an episode stays on the
    replica that holds it), inside the job's NetworkPolicy (only the job's trainer and rollout pods
    reach it; it reaches nothing), under PodSecurity restricted, created and deleted with the job. It
    speaks the reset/step protocol of docs/contracts.md."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.task) || !has(self.taskConfig)",
            message="spec.environments[]: set at most one of task (a name) or taskConfig (an object)",
            field_path=".taskConfig",
            reason="FieldValueForbidden",
            check=lambda s: s.task is None or s.task_config is None,
        ),
        CelRule(
            rule="!has(self.image) || has(self.command)",
            message="spec.environments[].command is required with an image of your own (the default "
            "commands, python -m " + " or ".join(DEFAULT_ENVIRONMENT_MODULES.values()) + ", are in the "
            "trainer image only)",
            field_path=".command",
            reason="FieldValueRequired",
            check=lambda s: s.command is not None or s.image is None,
        ),
    )

    name: str = Field(
        min_length=1,
        max_length=22,
        pattern=ENVIRONMENT_NAME_PATTERN,
        description="The environment's name (lowercase letters, digits and -, starting with a letter): "
        "spec.rollout.agent.environment names it, its Service is <job>-env-<name> and its pods "
        "<job>-env-<name>-<i> (hostnames of at most 63 characters: the operator says when job and name "
        "are too long together).",
    )
    image: str | None = Field(
        None,
        min_length=1,
        max_length=512,
        description="Container image. Default: the job's trainer image (spec.image.trainer), which ships "
        "the rljob_env environments.",
    )
    command: list[Annotated[str, Field(max_length=4096)]] | None = Field(
        None,
        min_length=1,
        max_length=64,
        description="The container's command. Default: python -m "
        + DEFAULT_ENVIRONMENT_MODULES["steps"]
        + " (mode steps) or python -m "
        + DEFAULT_ENVIRONMENT_MODULES["agent"]
        + " (mode agent), the arithmetic environment shipped in the trainer image. The server listens "
        "on $RLJOB_ENV_PORT (= port); write $(RLJOB_ENV_PORT) in args to pass it.",
    )
    args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, max_length=64, description="Arguments of the command."
    )
    env: list[EnvVarSpec] = Field(
        default_factory=list, max_length=64, description="More environment variables of the container."
    )
    port: int = Field(
        8080,
        ge=1024,
        le=65535,
        description="The port the server listens on (the pod runs as non-root, so at least 1024); the "
        "container gets it as RLJOB_ENV_PORT and names it http.",
    )
    replicas: int = Field(1, ge=1, le=64, description="Pods serving this environment behind its Service.")
    resources: EnvironmentResourcesSpec = Field(
        default_factory=EnvironmentResourcesSpec, description="CPU, memory and scratch space of each pod."
    )
    readiness_path: str = Field(
        "/healthz",
        min_length=1,
        max_length=1024,
        pattern=r"^/",
        description="HTTP path of the readiness probe (GET, 200 when the server takes episodes); the "
        "Service sends requests only to ready pods.",
    )
    timeout_seconds: float = Field(
        30.0,
        gt=0.0,
        le=3600.0,
        description="One reset or step running longer fails the episode (mode agent: one whole episode, "
        "and one call to the endpoint waiting for the engines).",
    )
    mode: Literal["steps", "agent"] = Field(
        "steps",
        description="steps: the trainer's agent loop resets and steps the server (docs/contracts.md §4). "
        "agent: the server runs each whole episode itself (POST /episode) with its own agent, which calls "
        "the job's OpenAI-compatible endpoint at the base URL the episode names, with the job's token in "
        "$OPENAI_API_KEY; the operator then serves that endpoint on trainer pod 0 (port endpoint, 8000), "
        "lets these pods reach it, and every call is trained on (docs/agents.md).",
    )
    task: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="What every reset asks of the environment, by name (the arithmetic environment: easy, "
        "medium or hard). Default: the environment's own.",
    )
    task_config: dict[str, Any] | None = Field(
        None,
        description="What every reset asks of the environment, as an object it reads (the arithmetic "
        "environment: {steps, max_operand}). Set task or taskConfig, not both.",
        json_schema_extra={"maxProperties": 64},
    )
    node_selector: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict,
        description="Node labels the environment pods require (they request no accelerator). Default: any "
        "node that admits them.",
    )

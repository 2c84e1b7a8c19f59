"""Unit tests of the RLJob API models and the CRD generated from them (no cluster).

Covers: the examples parse; the committed CRD is what `rljob crd` generates; the schema is
structural with a description on every field; the CRD's defaults give the same object as the
models' defaults; every invalid manifest of `tests/rljob_api_cases.py` is refused by the models
with its field named; every CEL rule has such a case; and the CEL text and the Python check of
every rule agree on random objects (evaluated with cel-python, when it is installed).
"""

from __future__ import annotations

import copy
import types
import typing
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pydantic
import pytest
import rljob_api_cases as cases
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rljob_operator import api
from rljob_operator.api import crd

REPO_ROOT = Path(__file__).resolve().parents[2]
COMMITTED_CRD = REPO_ROOT / "crds" / crd.CRD_FILENAME
EXAMPLES = sorted(cases.EXAMPLES_DIR.glob("*.yaml"))


def _load(path: Path) -> dict[str, Any]:
    docs = api.load_manifests(path.read_text())
    assert len(docs) == 1, f"{path} should hold one RLJob"
    return docs[0]


def _crd_schema() -> dict[str, Any]:
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _rule_models() -> list[type[api.base._Model]]:
    found = [
        obj
        for obj in vars(api).values()
        if isinstance(obj, type)
        and issubclass(obj, api.base._Model)
        and "cel_rules" in vars(obj)
        and obj.cel_rules
    ]
    return sorted(found, key=lambda m: m.__name__)


# ---- examples ----------------------------------------------------------------------------------


def test_the_three_examples_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"qwen3.5-4b-gsm8k-adaptive.yaml", "qwen3-8b-ascend-910b.yaml", "tiny-cpu.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_parses_and_round_trips(path: Path) -> None:
    manifest = _load(path)
    job = api.RLJob.model_validate(manifest)
    assert (job.api_version, job.kind) == (api.API_VERSION, api.KIND)
    assert api.RLJobSpec.model_validate(job.spec.to_k8s()) == job.spec
    # Every key the user wrote survives a dump (nothing silently dropped or renamed).
    dumped = job.spec.to_k8s()

    def check_subset(written: Any, out: Any, where: str) -> None:
        if isinstance(written, dict):
            for key, value in written.items():
                assert key in out, f"{where}.{key} lost in to_k8s()"
                check_subset(value, out[key], f"{where}.{key}")
        else:
            assert written == out, f"{where}: wrote {written!r}, dumped {out!r}"

    check_subset(manifest["spec"], dumped, "spec")


def test_seed_example_matches_the_seed_run() -> None:
    spec = api.RLJob.model_validate(_load(cases.EXAMPLES_DIR / "qwen3.5-4b-gsm8k-adaptive.yaml")).spec
    assert spec.resources.mode == "adaptive"
    assert spec.resources.total_accelerators == 8
    assert (
        spec.lengths.max_prompt_tokens,
        spec.lengths.max_completion_tokens,
        spec.lengths.max_model_len,
    ) == (
        1024,
        8192,
        12288,
    )
    assert spec.model.config.preset == "Qwen/Qwen3.5-4B"


def test_tiny_example_is_a_cpu_static_two_rank_job() -> None:
    spec = api.RLJob.model_validate(_load(cases.TINY_EXAMPLE)).spec
    assert spec.resources.accelerator.kind == "cpu"
    assert spec.resources.mode == "static" and spec.resources.static is not None
    assert spec.resources.static.trainer_accelerators == 2
    assert spec.model.source.tiny is not None and spec.model.config.inline is not None
    assert spec.data.source.builtin is not None and spec.data.source.builtin.name == "toy-arithmetic"


def test_snake_case_names_are_accepted_too() -> None:
    spec = api.LengthsSpec(max_prompt_tokens=10, max_completion_tokens=5, max_model_len=15)
    assert spec.to_k8s() == {"maxPromptTokens": 10, "maxCompletionTokens": 5, "maxModelLen": 15}


def test_spec_models_are_strict_like_the_apiserver() -> None:
    with pytest.raises(pydantic.ValidationError):
        api.GRPOSpec.model_validate({"groupSize": "8"})
    assert api.GRPOSpec.model_validate({"learningRate": 1}).learning_rate == 1.0


def test_spec_accepts_read_only_mappings_like_kopf_spec() -> None:
    spec = _load(cases.TINY_EXAMPLE)["spec"]

    def freeze(value: Any) -> Any:
        if isinstance(value, dict):
            return types.MappingProxyType({k: freeze(v) for k, v in value.items()})
        return value

    assert api.RLJobSpec.model_validate(freeze(spec)) == api.RLJobSpec.model_validate(spec)


def test_load_manifests_reads_exponent_floats_like_kubectl() -> None:
    docs = api.load_manifests("a: 1e-6\nb: 2.5\nc: 3\nd: '1e-6'\n---\n")
    assert docs == [{"a": 1e-6, "b": 2.5, "c": 3, "d": "1e-6"}]


# ---- the generated CRD -------------------------------------------------------------------------


def test_committed_crd_is_what_rljob_crd_generates() -> None:
    generated = crd.render_crd_yaml()
    committed = COMMITTED_CRD.read_text() if COMMITTED_CRD.exists() else ""
    assert committed == generated, (
        f"{COMMITTED_CRD.relative_to(REPO_ROOT)} is stale: the models in operator/rljob_operator/api.py "
        "changed. Regenerate it with `rljob crd` and commit the result."
    )


def test_write_crds_is_deterministic(tmp_path: Path) -> None:
    first = crd.write_crds(tmp_path / "a")[0].read_bytes()
    second = crd.write_crds(tmp_path / "b")[0].read_bytes()
    assert first == second
    assert yaml.safe_load(first)["metadata"]["name"] == "rljobs.rljob.io"


def test_crd_names_subresources_and_columns() -> None:
    body = crd.build_crd()
    names = body["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == ("RLJob", "rljobs", ["rlj"])
    assert "all" in names["categories"]
    version = body["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["Phase", "Mode", "Step", "Reward", "Eval", "Trainer", "Rollout", "Age"]
    schema = _crd_schema()
    for column in version["additionalPrinterColumns"]:
        if column["jsonPath"].startswith(".metadata."):
            continue
        node = schema
        for part in column["jsonPath"].lstrip(".").split("."):
            assert part in node.get("properties", {}), (
                f"column {column['name']}: {column['jsonPath']} not in schema"
            )
            node = node["properties"][part]
        assert column["type"] == {"number": "number", "integer": "integer"}.get(node["type"], "string")


def _walk(node: dict[str, Any], path: str) -> typing.Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}.*")


def test_every_field_has_a_description() -> None:
    schema = _crd_schema()
    missing = [
        path
        for root in ("spec", "status")
        for path, node in _walk(schema["properties"][root], root)
        if not path.endswith("[]") and not path.endswith(".*") and not node.get("description", "").strip()
    ]
    assert not missing, f"fields without a description (kubectl explain shows nothing): {missing}"


def test_every_model_field_has_a_description() -> None:
    models = [
        obj for obj in vars(api).values() if isinstance(obj, type) and issubclass(obj, pydantic.BaseModel)
    ]
    missing = [f"{m.__name__}.{n}" for m in models for n, f in m.model_fields.items() if not f.description]
    assert not missing


_ALLOWED_KEYS = {
    "type", "format", "description", "enum", "default", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems", "maxItems", "minProperties",
    "maxProperties", "required",
    "properties", "items", "additionalProperties", "x-kubernetes-validations",
    "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
}  # fmt: skip


def test_schema_is_structural() -> None:
    """The apiserver's structural-schema rules, checked offline (the cluster test checks for real)."""
    problems: list[str] = []
    for path, node in _walk(_crd_schema(), "<root>"):
        unknown = set(node) - _ALLOWED_KEYS
        if unknown:
            problems.append(
                f"{path}: keywords {sorted(unknown)} ($ref/anyOf/allOf/nullable are not structural)"
            )
        if "type" not in node and not (
            node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
        ):
            problems.append(f"{path}: no type")
        if "properties" in node and "additionalProperties" in node:
            problems.append(f"{path}: properties and additionalProperties together")
        if node.get("additionalProperties") is False or node.get("additionalProperties") is True:
            problems.append(f"{path}: additionalProperties must be a schema")
        for key in node.get("required", []):
            if key not in node.get("properties", {}):
                problems.append(f"{path}: required {key!r} is not a property")
        if node.get("x-kubernetes-list-type") == "map":
            item = node["items"]
            for key in node["x-kubernetes-list-map-keys"]:
                if key not in item.get("required", []) and "default" not in item["properties"][key]:
                    problems.append(f"{path}: list-map key {key!r} must be required")
        if "default" in node and node.get("type") == "object" and not isinstance(node["default"], dict):
            problems.append(f"{path}: object default is not an object")
        if (
            "minimum" in node
            and isinstance(node.get("exclusiveMinimum"), (int, float))
            and not isinstance(node.get("exclusiveMinimum"), bool)
        ):
            problems.append(f"{path}: exclusiveMinimum must be a boolean in OpenAPI v3.0")
    assert not problems, "\n".join(problems)


def test_inline_model_config_keeps_unknown_fields() -> None:
    inline = _crd_schema()["properties"]["spec"]["properties"]["model"]["properties"]["config"]["properties"][
        "inline"
    ]
    assert inline["x-kubernetes-preserve-unknown-fields"] is True


def test_quantities_are_int_or_string() -> None:
    memory = _crd_schema()["properties"]["spec"]["properties"]["resources"]["properties"]["memory"]
    assert memory["x-kubernetes-int-or-string"] is True and "type" not in memory


def test_explain_text_carries_defaults_and_ranges() -> None:
    node = _crd_schema()["properties"]["spec"]["properties"]["resources"]["properties"]["acceleratorsPerNode"]
    assert "Default: 8." in node["description"] and ">= 1 and <= 64" in node["description"]


def test_explain_text_of_the_rollout_engine_names_both_engines_and_the_cpu_head_sizes() -> None:
    rollout = _crd_schema()["properties"]["spec"]["properties"]["resources"]["properties"]["rollout"]
    kind = rollout["properties"]["kind"]
    assert kind["enum"] == ["vllm", "transformers"] and kind["default"] == "vllm"
    assert "CPU pools included" in kind["description"] and "Default: vllm." in kind["description"]
    assert ", ".join(map(str, api.VLLM_CPU_ATTENTION_HEAD_SIZES)) in kind["description"]
    assert api.RolloutSpec().kind == "vllm"


def test_the_operators_cpu_head_sizes_are_the_trainers() -> None:
    """The operator may not import the trainer's engines (import contract): its own copy of vLLM
    0.32's CPU attention head sizes must equal the list the trainer's platform probe keeps."""
    from rljob_trainer.engines import platform

    assert api.VLLM_CPU_ATTENTION_HEAD_SIZES == platform.CPU_ATTENTION_HEAD_SIZES


@pytest.mark.parametrize(
    ("inline", "kind", "engine", "valid"),
    [
        ({"head_dim": 16}, "cpu", "vllm", False),
        ({"head_dim": 16}, "cpu", "transformers", True),
        ({"head_dim": 16}, "nvidia", "vllm", True),
        ({"head_dim": 32}, "cpu", "vllm", True),
        ({"head_dim": 16, "text_config": {"head_dim": 64}}, "cpu", "vllm", True),  # the planner reads it
        ({"hidden_size": 64, "num_attention_heads": 4}, "cpu", "vllm", True),  # derived: the planner's
    ],
)
def test_an_inline_head_size_vllms_cpu_attention_refuses_is_refused_at_apply(
    inline: dict[str, Any], kind: str, engine: str, valid: bool
) -> None:
    spec = copy.deepcopy(MINIMAL_SPEC)
    spec["model"]["config"]["inline"] = {"model_type": "qwen2", **inline}
    spec["resources"]["accelerator"] = {"kind": kind, **({"model": "H100-80GB"} if kind != "cpu" else {})}
    spec["resources"]["rollout"] = {"kind": engine}
    if valid:
        api.RLJobSpec.model_validate(spec)
        return
    with pytest.raises(pydantic.ValidationError) as info:
        api.RLJobSpec.model_validate(spec)
    message = str(info.value)
    assert (
        "spec.model.config.inline.head_dim" in message
        and "set spec.resources.rollout.kind to transformers" in message
    )


def test_every_cel_rule_of_the_models_is_in_the_crd() -> None:
    in_crd = {
        v["rule"]
        for _, node in _walk(_crd_schema(), "<root>")
        for v in node.get("x-kubernetes-validations", [])
    }
    declared = {r.rule for m in _rule_models() for r in m.cel_rules}
    assert declared and declared <= in_crd


# ---- defaults: the apiserver's defaulting gives what pydantic gives ---------------------------


def _apply_structural_defaults(schema: dict[str, Any], value: Any) -> Any:
    """The apiserver's defaulting algorithm: fill absent properties with `default`, then recurse."""
    if isinstance(value, dict):
        out = dict(value)
        for name, sub in schema.get("properties", {}).items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = _apply_structural_defaults(sub, out[name])
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_apply_structural_defaults(schema["items"], v) for v in value]
    return value


MINIMAL_SPEC = {
    "model": {"name": "m", "source": {"tiny": {}}, "config": {"inline": {"model_type": "qwen2"}}},
    "data": {"source": {"builtin": {"name": "toy-arithmetic"}}},
    "resources": {"accelerator": {"kind": "cpu"}, "totalAccelerators": 8},
}


@pytest.mark.parametrize("path", [None, *EXAMPLES], ids=lambda p: "minimal" if p is None else p.name)
def test_crd_defaults_equal_model_defaults(path: Path | None) -> None:
    spec = MINIMAL_SPEC if path is None else _load(path)["spec"]
    defaulted = _apply_structural_defaults(_crd_schema()["properties"]["spec"], spec)
    assert defaulted == api.RLJobSpec.model_validate(spec).to_k8s()


# ---- invalid manifests -------------------------------------------------------------------------


def test_the_base_of_the_invalid_cases_is_valid() -> None:
    api.RLJob.model_validate(_load(cases.TINY_EXAMPLE))


def test_there_are_at_least_15_invalid_cases_of_every_kind() -> None:
    ids = [c.id for c in cases.INVALID_CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 15
    for kind in ("type-", "range-", "enum-", "required-", "cel-", "unknown-field"):
        assert any(i.startswith(kind) for i in ids), kind


@pytest.mark.parametrize("case", [c for c in cases.INVALID_CASES if c.python], ids=lambda c: c.id)
def test_models_refuse_invalid_manifest_naming_the_field(case: cases.InvalidCase) -> None:
    manifest = case.apply(_load(cases.TINY_EXAMPLE))
    with pytest.raises(pydantic.ValidationError) as info:
        api.RLJob.model_validate(manifest)
    errors = "\n".join(api.describe_validation_error(info.value))
    assert case.field in errors, errors
    assert case.message in errors, errors


def test_every_cel_rule_has_an_invalid_case() -> None:
    rule_messages = [r.message for m in _rule_models() for r in m.cel_rules] + [
        v["message"] for v in crd.ROOT_VALIDATIONS
    ]
    phrases = [c.message for c in cases.INVALID_CASES if c.message]
    uncovered = [msg for msg in rule_messages if not any(p in msg for p in phrases)]
    assert not uncovered, f"CEL rules without an invalid manifest in tests/rljob_api_cases.py: {uncovered}"


# ---- CEL text and Python checks agree ----------------------------------------------------------

# Inline config.json drawn for the spec's head-size rule; sizes vLLM's CPU attention refuses (16, 24,
# 48) are most of them, since a draw is a cpu job with rollout.kind vllm and an inline config only
# about 1 time in 25.
INLINE_CONFIGS: list[dict[str, Any]] = [
    {"head_dim": 16},
    {"head_dim": 24, "hidden_size": 96},
    {"head_dim": 16, "num_attention_heads": 4},
    {"head_dim": 48},
    {"head_dim": 16, "hidden_size": 64},
    {"head_dim": 24},
    {"head_dim": 64},
    {"head_dim": 16, "text_config": {"head_dim": 16}},
    {"hidden_size": 64, "num_attention_heads": 4},
    {"head_dim": 0},
]


def _strategy_for(annotation: Any, depth: int = 0) -> st.SearchStrategy[Any]:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _strategy_for(args[0], depth)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return st.one_of(*[_strategy_for(a, depth) for a in args])
    if annotation is type(None):
        return st.none()
    if origin is typing.Literal:
        return st.sampled_from(args)
    if annotation is bool:
        return st.booleans()
    if annotation is int:  # small numbers, and now and then one past a large bound (lora.rank 512)
        return st.one_of(st.integers(1, 12), st.just(513))
    if annotation is float:
        return st.sampled_from([0.0, 0.5, 1.0, 2.0])
    if annotation is str:
        return st.sampled_from(["a", "b"])
    if origin is list:
        return st.lists(_strategy_for(args[0], depth + 1), max_size=2)
    if origin is dict and args == (str, Any):  # an inline config.json: the head-size rule reads it
        return st.sampled_from(INLINE_CONFIGS)
    if origin is dict:
        return st.just({})
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return _model_strategy(annotation, depth + 1)
    raise NotImplementedError(f"no strategy for {annotation!r}")


def _model_strategy(model: type[pydantic.BaseModel], depth: int = 0) -> st.SearchStrategy[Any]:
    """Unvalidated instances (model_construct) with every field drawn, so rules can be false."""
    fields = {name: _strategy_for(f.annotation, depth) for name, f in model.model_fields.items()}
    return st.fixed_dictionaries(fields).map(lambda values: model.model_construct(**values))


def _rare_cases(model: type[api.base._Model]) -> list[Any]:
    """Unvalidated objects on which a rare rule is false, checked besides the random draws (a cpu
    job with rollout.kind vllm and an inline config is about 1 draw in 25, and draws come in runs)."""
    if model is not api.RLJobSpec:
        return []
    spec = api.RLJobSpec.model_validate(MINIMAL_SPEC)
    config = api.ModelConfigSource.model_construct(inline={"model_type": "qwen2", "head_dim": 16})
    # An environment of mode agent named by an agent that also brings tools and demonstrations of its
    # own (each a rule of its own, false here only: random draws reach it about once in 250).
    agent = api.AgentSpec.model_construct(
        environment="web",
        tools=[api.ToolSpec.model_validate({"name": "calc", "kind": "calculator"})],
        demonstrations=[
            api.DemonstrationMessage.model_validate({"role": "user", "content": "1+1?"}),
            api.DemonstrationMessage.model_validate({"role": "assistant", "content": "2"}),
        ],
    )
    web = api.EnvironmentSpec.model_validate({"name": "web", "mode": "agent"})
    mode_agent = spec.model_copy(
        update={"environments": [web], "rollout": spec.rollout.model_copy(update={"agent": agent})}
    )
    return [spec.model_copy(update={"model": spec.model.model_copy(update={"config": config})}), mode_agent]


@pytest.mark.parametrize("model", _rule_models(), ids=lambda m: m.__name__)
def test_cel_and_python_checks_agree(model: type[api.base._Model]) -> None:
    celpy = pytest.importorskip("celpy", reason="cel-python evaluates the CEL rules offline")
    env = celpy.Environment()
    programs = [(rule, env.program(env.compile(rule.rule))) for rule in model.cel_rules]
    outcomes: set[tuple[int, bool]] = set()

    # The spec's rules are conjunctions over several fields (lora rank above vLLM's limit on a vLLM
    # job syncing adapters; an inline head_dim vLLM's CPU attention refuses on a cpu pool, also seeded
    # by `_rare_cases`): more draws, so both outcomes of each are reached whatever the seed.
    examples = 250 if model is api.RLJobSpec else 80

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(_model_strategy(model))
    def check(obj: Any) -> None:
        activation = {"self": celpy.json_to_cel(obj.to_k8s())}
        for i, (rule, program) in enumerate(programs):
            by_cel = bool(program.evaluate(activation))
            assert by_cel == rule.check(obj), (
                f"{model.__name__}: {rule.rule!r} says {by_cel} on {obj.to_k8s()}"
            )
            outcomes.add((i, by_cel))

    for case in _rare_cases(model):
        check = example(case)(check)
    check()
    # The random objects reached both outcomes of every rule, or the comparison proves little.
    assert outcomes == {(i, b) for i in range(len(programs)) for b in (True, False)}


# ---- status helpers ----------------------------------------------------------------------------


def test_rollout_status_fills_engines_awake_total() -> None:
    status = api.RolloutStatus(shared_engines=1, shared_engines_awake=0, dedicated_engines=2)
    assert status.engines_awake_total == "2/3"
    assert api.RolloutStatus().engines_awake_total is None


def test_status_times_are_kubernetes_rfc3339() -> None:
    status = api.RLJobStatus(
        start_time=datetime(2025, 1, 2, 3, 4, 5, 678, tzinfo=timezone.utc), phase="Running"
    )
    assert status.to_k8s() == {"phase": "Running", "conditions": [], "startTime": "2025-01-02T03:04:05Z"}
    assert api.RLJobStatus.model_validate(status.to_k8s()).start_time == datetime(
        2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc
    )


def test_status_ignores_fields_it_does_not_know() -> None:
    assert api.RLJobStatus.model_validate({"phase": "Pending", "fromTheFuture": 1}).phase == "Pending"


def test_set_condition_keeps_transition_time_when_status_is_unchanged() -> None:
    t0 = datetime(2025, 1, 1, tzinfo=timezone.utc)
    t1 = t0 + timedelta(minutes=5)
    first = api.Condition(type="Ready", status="False", reason="Planning", last_transition_time=t0)
    other = api.Condition(type="Planned", status="True", reason="Estimated", last_transition_time=t0)
    same = api.set_condition(
        [first, other], first.model_copy(update={"last_transition_time": t1, "message": "m"})
    )
    assert [c.type for c in same] == ["Ready", "Planned"]
    assert same[0].last_transition_time == t0 and same[0].message == "m"
    flipped = api.set_condition(
        same, api.Condition(type="Ready", status="True", reason="Running", last_transition_time=t1)
    )
    assert flipped[0].last_transition_time == t1 and flipped[0].status == "True"
    added = api.set_condition([], first)
    assert added == [first] and api.find_condition(added, "Ready") == first
    assert api.find_condition(added, "Nope") is None


def test_condition_reason_must_be_camel_case() -> None:
    with pytest.raises(pydantic.ValidationError):
        api.Condition(
            type="Ready", status="True", reason="not camel", last_transition_time=datetime.now(timezone.utc)
        )

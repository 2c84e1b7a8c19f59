"""Property: the API accepts nothing the trainer image refuses.

Every spec the RLJob models accept (hypothesis draws the trainer-facing sections within the API's
own bounds, plus every shipped example) must render a valid `rljob_trainer` TrainerConfig and a
pod set through the same builders the operator uses, with no error. A failure here is a rule the
API is missing: move it into api.py (CEL where it can be expressed) so `kubectl apply` refuses the
spec instead of the operator finding out later.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import annotated_types
import pydantic
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_builders import JOB, static_plan

from rljob_operator import api, builders, errors
from rljob_operator.decide import planning
from rljob_operator.estimator import load_preset
from rljob_trainer import config as tc

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
TINY_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 256,
    "max_position_embeddings": 8192,
    "torch_dtype": "float32",
}


def _bounds(field: pydantic.fields.FieldInfo) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in field.metadata:
        for name in ("ge", "gt", "le", "lt"):
            if isinstance(m, getattr(annotated_types, name.capitalize())):
                out[name] = getattr(m, name)
    return out


def _leaf(annotation: Any, field: pydantic.fields.FieldInfo) -> st.SearchStrategy[Any] | None:
    """A strategy for a scalar field within its declared bounds (None: not a scalar we draw)."""
    if get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        if len(inner) != 1:
            return None
        base = _leaf(inner[0], field)
        return None if base is None else st.one_of(st.none(), base)
    if get_origin(annotation) is Literal:
        return st.sampled_from(get_args(annotation))
    b = _bounds(field)
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        low = int(b.get("ge", b.get("gt", -1) + 1)) if ("ge" in b or "gt" in b) else 0
        high = int(b.get("le", b.get("lt", 2**31) - 1)) if ("le" in b or "lt" in b) else 2**31
        # Mostly small values: big ones only make every job a planning error.
        return st.one_of(st.integers(low, min(high, low + 64)), st.integers(low, high))
    if annotation is float:
        return st.floats(
            min_value=b.get("ge", b.get("gt")),
            max_value=b.get("le", b.get("lt")),
            exclude_min="gt" in b,
            exclude_max="lt" in b,
            allow_nan=False,
            allow_infinity=False,
        )
    return None


def flat_model(cls: type[pydantic.BaseModel]) -> st.SearchStrategy[dict[str, Any]]:
    """Dicts (camelCase keys) for the scalar fields of `cls`, each drawn or left to its default."""
    parts = {}
    for name, field in cls.model_fields.items():
        strategy = _leaf(field.annotation, field)
        if strategy is not None:
            parts[field.alias or name] = strategy
    return st.fixed_dictionaries({}, optional=parts)


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


data_sources = st.one_of(
    st.builds(lambda n: {"builtin": {"name": n}}, st.sampled_from(get_args(api.BuiltinDataset))),
    st.just({"pvc": {"claimName": "data", "path": "train.jsonl"}}),
    st.just({"configMapRef": {"name": "prompts", "key": "data.jsonl"}}),
    st.just({"hub": {"id": "openai/gsm8k", "subset": "main"}}),
)
model_sources = st.one_of(
    st.builds(lambda t: {"tiny": {"tokenizer": t}}, st.sampled_from(get_args(api.TinyTokenizer))),
    st.just({"pvc": {"claimName": "models", "path": "qwen"}}),
    st.just({"hub": {"id": "Qwen/Qwen3-0.6B"}}),
)
reward_functions = st.lists(
    st.one_of(
        st.builds(
            lambda n, w: {"name": n, "weight": w},
            st.sampled_from(["mathAccuracy", "format"]),
            st.floats(-10, 10),
        ),
        st.builds(
            lambda m: {"name": "module", "module": m},
            st.one_of(
                st.just({"path": "/rewards/fn.py", "function": "score"}),
                st.just({"importPath": "my_rewards.math"}),
            ),
        ),
    ),
    min_size=1,
    max_size=3,
)
accelerators = st.one_of(
    st.just(({"kind": "cpu"}, 2, 1)),
    st.just(({"kind": "nvidia", "model": "H100-80GB"}, 16, 8)),
)


@st.composite
def specs(draw: st.DrawFn) -> dict[str, Any]:
    accelerator, total, per_node = draw(accelerators)
    lora = _drop_none(draw(flat_model(api.LoRASpec)))
    model = {
        "name": "m",
        "source": draw(model_sources),
        "config": {"inline": TINY_CONFIG},
        "finetune": {"mode": draw(st.sampled_from(["lora", "full"])), "lora": lora},
    }
    if accelerator["kind"] != "cpu":
        model["dtype"] = draw(st.sampled_from(get_args(api.Dtype)))
    resources: dict[str, Any] = {
        "accelerator": accelerator,
        "totalAccelerators": total,
        "acceleratorsPerNode": per_node,
        "mode": "static",
        "static": {"trainerAccelerators": total // 2, "rolloutAccelerators": total - total // 2},
    }
    if accelerator["kind"] != "cpu":
        resources["rollout"] = {"tensorParallel": draw(st.sampled_from([1, 2, 4, 8]))}
    return {
        "model": model,
        "grpo": _drop_none(draw(flat_model(api.GRPOSpec))),
        "lengths": _drop_none(draw(flat_model(api.LengthsSpec))),
        "batching": _drop_none(draw(flat_model(api.BatchingSpec))),
        "data": {"source": draw(data_sources)},
        "reward": {"functions": draw(reward_functions)},
        "resources": resources,
        "checkpoint": draw(st.sampled_from([{}, {"path": "/ckpt", "volume": {"claimName": "ckpt"}}])),
    }


def render_everything(
    spec: api.RLJobSpec,
    plan: api.PlanStatus,
    model_config: dict[str, Any] | None,
    judge_config: dict[str, Any] | None = None,
) -> None:
    """What the operator renders for `spec`: the trainer config (validated by the trainer's own
    contract) and every pod, including the pods of the largest adaptive layout."""
    cfg = builders.render_trainer_config(spec, plan, model_config, judge_config=judge_config)
    again = tc.TrainerConfig.model_validate_json(tc.dump_config(cfg))
    assert again == cfg
    layout = builders.compute_layout(spec, plan)
    pods = builders.build_pods(JOB, spec, layout, attempt=0, config_hash="h")
    assert pods and all(p["spec"]["containers"] for p in pods)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)
@given(specs())
def test_every_spec_the_api_accepts_renders(raw: dict[str, Any]) -> None:
    try:
        spec = api.RLJobSpec.model_validate(raw)
    except pydantic.ValidationError:
        assume(False)  # the API refuses it: nothing to prove
        raise
    plan = static_plan(spec)
    try:
        render_everything(spec, plan, TINY_CONFIG)
    except errors.InvalidSpecError as exc:  # pragma: no cover - a failure names the missing API rule
        pytest.fail(f"the API accepted a spec the builders refuse: {exc}\n{raw}")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_renders_with_its_real_plan(path: Path) -> None:
    for doc in api.load_manifests(path.read_text()):
        spec = api.RLJobSpec.model_validate(doc["spec"])
        src = spec.model.config
        model_config = dict(src.inline) if src.inline is not None else load_preset(src.preset or "")
        judge_config = None
        if spec.reward.judge is not None:  # the judge's engines are planned from its own config
            js = spec.reward.judge.model.config
            judge_config = dict(js.inline) if js.inline is not None else load_preset(js.preset or "")
        plan = planning.plan_status(
            planning.plan_job(spec, model_config), planning.plan_judge(spec, judge_config)
        )
        render_everything(spec, plan, model_config, judge_config)


def test_every_loss_normalization_the_api_names_has_a_trainer_loss() -> None:
    from rljob_operator.builders import configmaps

    assert set(get_args(api.LossNormalization)) == set(configmaps._LOSS_AGG)
    assert set(configmaps._LOSS_AGG.values()) <= set(
        get_args(tc.GRPOSettings.model_fields["loss_agg"].annotation)
    )


def test_tiny_vocab_must_hold_the_builtin_tokenizer() -> None:
    modeling = pytest.importorskip("rljob_trainer.model.modeling")
    for name, size in api.TINY_TOKENIZER_VOCAB.items():
        assert size == len(modeling.build_char_tokenizer(modeling.CHARSETS[name])), name
    raw = {
        "name": "m",
        "source": {"tiny": {"tokenizer": "builtin-char"}},
        "config": {"inline": {**TINY_CONFIG, "vocab_size": 50}},
    }
    with pytest.raises(pydantic.ValidationError, match="at least 99"):
        api.ModelSpec.model_validate(raw)
    api.ModelSpec.model_validate({**raw, "source": {"tiny": {"tokenizer": "builtin-digits"}}})

"""The RLJob API on the real kube-apiserver: what a user meets with kubectl.

Applies the generated CRD to the local control plane, then checks: every example applies
cleanly and reads back into the same models (server-side defaults equal the models' defaults);
every invalid manifest of `tests/rljob_api_cases.py` is refused by `kubectl apply` with the field
named; `kubectl get rljobs` shows the printer columns from a status patched through the status
subresource; `kubectl explain` shows the descriptions.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import rljob_api_cases as cases

from rljob_operator import api
from rljob_operator.api import crd

pytestmark = pytest.mark.cluster

REPO_ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = REPO_ROOT / "crds" / crd.CRD_FILENAME
EXAMPLES = sorted(cases.EXAMPLES_DIR.glob("*.yaml"))


def _tiny() -> dict[str, Any]:
    return api.load_manifests(cases.TINY_EXAMPLE.read_text())[0]


@pytest.fixture(scope="module")
def rljob_crd(cluster: Any) -> dict[str, Any]:
    """The committed CRD, applied and Established (left installed: other tests use it too)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_PATH))
    # `cluster.apply_crds`'s wait: `kubectl wait` right after the apply fails at once while the CRD
    # has no status yet ("status.conditions accessor error"), which a larger CRD makes common.
    cluster.apply_crds(str(CRD_PATH))
    return json.loads(cluster.kubectl("get", "crd", api.CRD_NAME, "-o", "json").stdout)


@pytest.fixture(scope="module")
def shared_namespace(cluster: Any, rljob_crd: dict[str, Any]) -> Iterator[str]:
    """One namespace for the many rejected manifests (nothing is created in it when all pass)."""
    name = f"rljob-invalid-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _get(cluster: Any, namespace: str, name: str) -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", "rljob", name, "-n", namespace, "-o", "json").stdout)


def test_crd_is_structural_and_established(rljob_crd: dict[str, Any]) -> None:
    conditions = {c["type"]: c["status"] for c in rljob_crd["status"]["conditions"]}
    assert conditions.get("Established") == "True" and conditions.get("NamesAccepted") == "True"
    assert "NonStructuralSchema" not in conditions
    assert rljob_crd["status"]["acceptedNames"]["shortNames"] == ["rlj"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_applies_cleanly_and_round_trips(
    cluster: Any, rljob_crd: dict[str, Any], namespace: str, path: Path
) -> None:
    result = cluster.kubectl("apply", "-n", namespace, "-f", str(path))
    assert "created" in result.stdout and "Warning" not in result.stderr, result.stderr
    manifest = api.load_manifests(path.read_text())[0]
    stored = _get(cluster, namespace, manifest["metadata"]["name"])
    written = api.RLJobSpec.model_validate(manifest["spec"])
    read_back = api.RLJobSpec.model_validate(stored["spec"])
    assert read_back == written
    # The apiserver filled in exactly the defaults the models use, nothing more, nothing less.
    assert stored["spec"] == written.to_k8s()


def test_minimal_spec_gets_the_model_defaults_from_the_server(
    cluster: Any, rljob_crd: dict[str, Any], namespace: str
) -> None:
    minimal = {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": "minimal"},
        "spec": {
            "model": {"name": "m", "source": {"tiny": {}}, "config": {"inline": {"model_type": "qwen2"}}},
            "data": {"source": {"builtin": {"name": "toy-arithmetic"}}},
            "resources": {"accelerator": {"kind": "cpu"}, "totalAccelerators": 8},
        },
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(minimal))
    stored = _get(cluster, namespace, "minimal")["spec"]
    assert stored == api.RLJobSpec.model_validate(minimal["spec"]).to_k8s()
    assert stored["resources"]["acceleratorsPerNode"] == 8 and stored["grpo"]["groupSize"] == 8


@pytest.mark.parametrize(
    "correction",
    [
        {},
        {"importanceSampling": {"level": "token", "mode": "mask", "lower": 0.5, "upper": 5.0}},
        {
            "importanceSampling": {"level": "none"},
            "rejection": {"level": "geometric", "lower": 0.99, "upper": 1.01},
        },
    ],
    ids=["empty", "icepop", "geometric-rejection"],
)
def test_a_rollout_correction_applies_with_the_models_defaults(
    cluster: Any, rljob_crd: dict[str, Any], shared_namespace: str, correction: dict[str, Any]
) -> None:
    """spec.grpo.rolloutCorrection: what the apiserver stores (its defaults filled in) is what the
    models say, so `{}` means token-level truncated IS at 2 on both sides."""
    manifest = _tiny()
    manifest["metadata"]["name"] = f"rc-{uuid.uuid4().hex[:8]}"
    manifest["spec"].setdefault("grpo", {})["rolloutCorrection"] = correction
    cluster.kubectl("apply", "-n", shared_namespace, "-f", "-", input=json.dumps(manifest))
    try:
        stored = _get(cluster, shared_namespace, manifest["metadata"]["name"])["spec"]
        assert stored == api.RLJobSpec.model_validate(manifest["spec"]).to_k8s()
        imp = stored["grpo"]["rolloutCorrection"]["importanceSampling"]
        assert imp["upper"] == correction.get("importanceSampling", {}).get("upper", 2.0)
    finally:
        cluster.kubectl("delete", "rljob", manifest["metadata"]["name"], "-n", shared_namespace, check=False)


@pytest.mark.parametrize("case", cases.INVALID_CASES, ids=lambda c: c.id)
def test_kubectl_apply_refuses_invalid_manifest_naming_the_field(
    cluster: Any, shared_namespace: str, case: cases.InvalidCase
) -> None:
    manifest = case.apply(_tiny())
    if "metadata.name" not in case.edits:
        manifest["metadata"]["name"] = f"inv-{uuid.uuid4().hex[:8]}"
    result = cluster.kubectl(
        "apply", "-n", shared_namespace, "-f", "-", input=json.dumps(manifest), check=False
    )
    if result.returncode == 0:
        cluster.kubectl("delete", "rljob", manifest["metadata"]["name"], "-n", shared_namespace, check=False)
    assert result.returncode != 0, f"{case.id} was accepted: {result.stdout}"
    assert case.field in result.stderr, result.stderr
    assert case.message in result.stderr, result.stderr


def test_printer_columns_show_the_patched_status(
    cluster: Any, rljob_crd: dict[str, Any], namespace: str
) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", str(cases.TINY_EXAMPLE))
    status = api.RLJobStatus(
        phase="Running",
        observed_generation=1,
        conditions=[
            api.Condition(
                type="Ready",
                status="True",
                reason="PodsRunning",
                message="2 trainer pods running",
                last_transition_time=datetime(2025, 1, 1, tzinfo=timezone.utc),
                observed_generation=1,
            )
        ],
        plan=api.PlanStatus(
            trainer_accelerators=2, rollout_accelerators=0, shared_engines=1, reasons=["static"]
        ),
        rollout=api.RolloutStatus(
            shared_engines=1, shared_engines_awake=1, dedicated_engines=0, last_decision="Hold"
        ),
        progress=api.ProgressStatus(
            step=12, max_steps=20, mean_reward=0.75, eval_reward=0.5, loss=0.125, tokens_per_second=321.5
        ),
        restarts=0,
    )
    patch = json.dumps({"status": status.to_k8s()})
    cluster.kubectl(
        "patch", "rljob", "tiny-cpu", "-n", namespace, "--subresource=status", "--type=merge", "-p", patch
    )

    table = cluster.kubectl("get", "rljobs", "-n", namespace).stdout.splitlines()
    assert table[0].split() == [
        "NAME",
        "PHASE",
        "MODE",
        "STEP",
        "REWARD",
        "EVAL",
        "TRAINER",
        "ROLLOUT",
        "AGE",
    ]
    assert table[1].split()[:8] == ["tiny-cpu", "Running", "static", "12", "0.75", "0.5", "2", "1/1"]
    wide = cluster.kubectl("get", "rlj", "-n", namespace, "-o", "wide").stdout.splitlines()
    assert wide[0].split()[-5:] == ["ACCELERATOR", "LOSS", "TOKENS/S", "QUEUE", "DECISION"]
    assert wide[1].split()[-3:] == ["0.125", "321.5", "Hold"]  # QUEUE is blank: no Kueue label
    # The category `all` lists RLJobs, and the selectable field filters on the resource mode.
    assert "rljob.rljob.io/tiny-cpu" in cluster.kubectl("get", "all", "-n", namespace, "-o", "name").stdout
    selected = cluster.kubectl(
        "get", "rljobs", "-n", namespace, "--field-selector", "spec.resources.mode=adaptive", "-o", "name"
    )
    assert selected.stdout.strip() == ""

    stored = _get(cluster, namespace, "tiny-cpu")
    assert api.RLJobStatus.model_validate(stored["status"]) == status


def test_status_is_a_subresource_with_a_validated_schema(
    cluster: Any, rljob_crd: dict[str, Any], namespace: str
) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", str(cases.TINY_EXAMPLE))
    # A write to the main resource cannot set status ...
    cluster.kubectl(
        "patch", "rljob", "tiny-cpu", "-n", namespace, "--type=merge", "-p", '{"status":{"phase":"Failed"}}'
    )
    assert "status" not in _get(cluster, namespace, "tiny-cpu")
    # ... and the status subresource checks enums.
    bad = cluster.kubectl(
        "patch", "rljob", "tiny-cpu", "-n", namespace, "--subresource=status", "--type=merge",
        "-p", '{"status":{"phase":"Exploded"}}', check=False,
    )  # fmt: skip
    assert bad.returncode != 0 and "status.phase" in bad.stderr, bad.stderr


def test_kubectl_explain_shows_the_descriptions(cluster: Any, rljob_crd: dict[str, Any]) -> None:
    description = api.ResourcesSpec.model_fields["total_accelerators"].description or ""
    deadline = time.monotonic() + 60
    while True:  # the apiserver publishes a new CRD's OpenAPI a few seconds after it is Established
        result = cluster.kubectl("explain", "rljob.spec.resources", check=False)
        if (result.returncode == 0 and "totalAccelerators" in result.stdout) or time.monotonic() > deadline:
            break
        time.sleep(1)
    text = " ".join(result.stdout.split())
    assert result.returncode == 0, result.stderr
    assert api.ResourcesSpec.__doc__ and api.ResourcesSpec.model_fields["accelerator"].description
    assert "Accelerators and the trainer/rollout split." in text
    assert " ".join(description.split()) in text
    assert "enum: static, estimate, adaptive" in text
    assert "Default: 8." in text
    adaptive = " ".join(cluster.kubectl("explain", "rljob.spec.resources.adaptive.signal").stdout.split())
    assert "integrated measures load over the whole interval" in adaptive

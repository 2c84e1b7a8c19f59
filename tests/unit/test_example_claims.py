"""Every example applies as it is: the PersistentVolumeClaims an example mounts ship beside it.

For each example that mounts claims, `examples/claims/<example>.yaml` must define exactly those
claims, with access modes the operator's own claim check (`lifecycle.check_claims`) accepts for the
pods the example's real plan creates, and the example's header must name the one command that
applies both. Without them a new user's `kubectl apply` leaves the job in ClaimNotFound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rljob_operator import api, builders
from rljob_operator.decide import lifecycle, planning
from rljob_operator.estimator import load_preset

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
CLAIMS_DIR = REPO / "examples" / "claims"


def _uses(path: Path) -> list[lifecycle.ClaimUse]:
    (doc,) = api.load_manifests(path.read_text())
    spec = api.RLJobSpec.model_validate(doc["spec"])
    src = spec.model.config
    model_config = dict(src.inline) if src.inline is not None else load_preset(src.preset or "")
    plan = planning.plan_status(planning.plan_job(spec, model_config))
    return lifecycle.claims_of(spec, builders.compute_layout(spec, plan))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_the_claims_an_example_mounts_ship_beside_it(path: Path) -> None:
    uses = _uses(path)
    claims_file = CLAIMS_DIR / path.name
    if not uses:
        assert not claims_file.exists(), f"{claims_file} defines claims {path.name} does not mount"
        return
    assert claims_file.exists(), f"{path.name} mounts {[u.claim for u in uses]}: ship {claims_file}"
    docs = [d for d in yaml.safe_load_all(claims_file.read_text()) if d]
    assert all(d["kind"] == "PersistentVolumeClaim" for d in docs)
    claims = {d["metadata"]["name"]: d for d in docs}
    assert set(claims) == {u.claim for u in uses}
    lifecycle.check_claims(uses, claims, "default")  # raises: missing claim or too weak access mode
    for pvc in claims.values():
        assert pvc["spec"]["resources"]["requests"]["storage"]
    command = f"kubectl apply -f examples/claims/{path.name} -f examples/{path.name}"
    assert command in path.read_text() and command in claims_file.read_text()


def test_every_claims_file_belongs_to_an_example() -> None:
    examples = {p.name for p in EXAMPLES}
    assert {p.name for p in CLAIMS_DIR.glob("*.yaml")} <= examples

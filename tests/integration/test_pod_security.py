"""PodSecurity `restricted` on the real apiserver: every example's objects and the chart's operator
pod are admitted in a namespace that enforces it, and the namespace does refuse what it must.

`kubectl apply --dry-run=server` runs the whole admission chain (Pod Security admission included,
and the schemas of the Secret and the NetworkPolicy) without creating anything, so each example's
rendered objects (`rljob render`: the same builders the operator applies) meet exactly what a
shared cluster's tenant namespace would hold them to. The jobs that really run (tests/e2e,
tests/integration/test_operator*.py) run in such namespaces too: `LocalCluster.create_namespace`
labels every test namespace `pod-security.kubernetes.io/enforce: restricted`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from testenv.cluster import POD_SECURITY_ENFORCE

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
CHART = REPO / "helm" / "rljob"


def dry_run(cluster: Any, namespace: str, objects: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    listing = {"apiVersion": "v1", "kind": "List", "items": objects}
    return cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=json.dumps(listing), check=False
    )


def test_the_namespace_enforces_restricted(cluster: Any, namespace: str) -> None:
    """The control: what `restricted` forbids is refused here (so the tests below can fail)."""
    labels = cluster.get_json("namespace", namespace)["metadata"]["labels"]
    assert labels[POD_SECURITY_ENFORCE] == "restricted"
    plain = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plain"},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }
    refused = dry_run(cluster, namespace, [plain])
    assert refused.returncode != 0 and 'violates PodSecurity "restricted:latest"' in refused.stderr
    for what in ("allowPrivilegeEscalation != false", "runAsNonRoot != true", "seccompProfile"):
        assert what in refused.stderr, refused.stderr


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_examples_objects_are_admitted_under_restricted(
    cluster: Any, namespace: str, path: Path
) -> None:
    rendered = subprocess.run(
        [
            sys.executable,
            "-m",
            "rljob_operator.cli.commands",
            "render",
            "-f",
            str(path),
            "-n",
            namespace,
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert rendered.returncode == 0, rendered.stderr
    objects = json.loads(rendered.stdout)["items"]
    kinds = {o["kind"] for o in objects}
    assert {"Pod", "Secret", "NetworkPolicy"} <= kinds, kinds
    # The rest for real (a pod's ServiceAccount must exist for it to be admitted), then the pods.
    rest = {"apiVersion": "v1", "kind": "List", "items": [o for o in objects if o["kind"] != "Pod"]}
    created = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(rest), check=False)
    assert created.returncode == 0, created.stderr
    admitted = dry_run(cluster, namespace, [o for o in objects if o["kind"] == "Pod"])
    assert admitted.returncode == 0, admitted.stderr
    assert "violates PodSecurity" not in admitted.stderr  # not even a warning


def test_the_charts_operator_pod_is_admitted_under_restricted(cluster: Any, namespace: str) -> None:
    rendered = cluster.helm("template", "rljob", str(CHART), "--namespace", namespace)
    deployment = next(d for d in yaml.safe_load_all(rendered.stdout) if d and d["kind"] == "Deployment")
    template = deployment["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "operator", **template["metadata"]},
           "spec": template["spec"]}  # fmt: skip
    pod["spec"]["serviceAccountName"] = "default"  # the chart's own is not installed here
    admitted = dry_run(cluster, namespace, [pod])
    assert admitted.returncode == 0, admitted.stderr
    container = pod["spec"]["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True

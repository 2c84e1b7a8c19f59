"""`rljob render`: every example renders, offline, exactly what the operator's builders build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_api_renders import EXAMPLES

from rljob_operator import api, names
from rljob_operator.cli import commands
from rljob_trainer import config as tc


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_renders_all_its_objects(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert commands.main(["render", "-f", str(path), "-o", "json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["kind"] == "List"
    # The job's own objects first; an example's environments add their fence, Services and pods, and
    # one of mode agent the endpoint's token Secret.
    name = api.load_manifests(path.read_text())[0]["metadata"]["name"]
    added = (f"{name}-env", f"{name}-endpoint")
    kinds = [o["kind"] for o in listing["items"] if not o["metadata"]["name"].startswith(added)]
    assert kinds[:8] == [
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Secret",
        "NetworkPolicy",
        "Service",
        "ConfigMap",
        "ConfigMap",
    ]
    pods = [o for o in listing["items"] if o["kind"] == "Pod"]
    job = api.load_manifests(path.read_text())[0]["metadata"]["name"]
    assert pods and pods[0]["metadata"]["name"] == names.pod_name(job, names.ROLE_TRAINER, 0)
    config = next(o for o in listing["items"] if o["metadata"]["name"] == names.config_map_name(job))
    tc.TrainerConfig.model_validate_json(config["data"][tc.CONFIGMAP_KEY])  # the trainer accepts it


def test_render_only_and_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = str(Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml")
    assert commands.main(["render", "-f", tiny, "--only", "pods", "-n", "team-a"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert (
        docs
        and {d["kind"] for d in docs} == {"Pod"}
        and {d["metadata"]["namespace"] for d in docs} == {"team-a"}
    )
    assert commands.main(["render", "-f", tiny, "--only", "trainer-config", "-o", "json"]) == 0
    cfg = tc.TrainerConfig.model_validate(json.loads(capsys.readouterr().out))
    assert cfg.distributed.device == "cpu"
    assert commands.main(["render", "-f", tiny, "--only", "rbac"]) == 0
    assert {d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)} == {
        "ServiceAccount",
        "Role",
        "RoleBinding",
    }


def test_render_reports_estimator_errors_with_their_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = api.load_manifests(
        (Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml").read_text()
    )[0]
    del doc["spec"]["model"]["config"]["inline"]["num_attention_heads"]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert commands.main(["render", "-f", str(path)]) == 2
    err = capsys.readouterr().err
    assert "InvalidModelConfig" in err and "num_attention_heads" in err


def test_render_gang_adds_the_pod_group_and_the_pods_scheduling_group(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--gang` renders what a cluster serving PodGroups gets (the operator's gang step): the
    PodGroup before the pods, its minCount the trainer pods plus the plan's rollout pods, each of
    them naming it; without the flag, the plain pods (a cluster without the API)."""
    path = str(Path(__file__).resolve().parents[2] / "examples" / "qwen3-8b-ascend-910b.yaml")
    assert commands.main(["render", "-f", path, "-o", "json"]) == 0
    plain = json.loads(capsys.readouterr().out)["items"]
    assert "PodGroup" not in {o["kind"] for o in plain}
    assert all("schedulingGroup" not in o["spec"] for o in plain if o["kind"] == "Pod")
    assert commands.main(["render", "-f", path, "-o", "json", "--gang"]) == 0
    items = json.loads(capsys.readouterr().out)["items"]
    kinds = [o["kind"] for o in items]
    (group,) = [o for o in items if o["kind"] == "PodGroup"]
    pods = [o for o in items if o["kind"] == "Pod"]
    assert kinds.index("PodGroup") < kinds.index("Pod")  # the group exists before its pods
    assert group["apiVersion"] == "scheduling.k8s.io/v1beta1"
    roles = sorted({p["metadata"]["labels"][names.LABEL_ROLE] for p in pods})
    assert roles == [names.ROLE_ROLLOUT, names.ROLE_TRAINER]  # the core: trainers and rollout pods
    assert group["spec"]["schedulingPolicy"]["gang"]["minCount"] == len(pods)
    assert {p["spec"]["schedulingGroup"]["podGroupName"] for p in pods} == {group["metadata"]["name"]}
    # the rest is the same objects as without the flag
    assert [o for o in items if o["kind"] != "PodGroup"] == [
        {**o, "spec": {**o["spec"], "schedulingGroup": {"podGroupName": group["metadata"]["name"]}}}
        if o["kind"] == "Pod"
        else o
        for o in plain
    ]
    assert commands.main(["render", "-f", path, "--only", "pods", "--gang", "-o", "json"]) == 0
    only = json.loads(capsys.readouterr().out)["items"]
    assert {o["kind"] for o in only} == {"Pod"} and all(o["spec"]["schedulingGroup"] for o in only)

"""Unit tests for rljob_operator.builders.podgroup: the scheduling.k8s.io/v1beta1 gang of a job."""

from __future__ import annotations

import copy

import pytest

from rljob_operator import builders, names
from rljob_operator.builders import podgroup

JOB = builders.JobRef("demo", "team-a")


def test_pod_group_is_a_gang_of_min_count_disrupted_as_a_whole() -> None:
    group = podgroup.build_pod_group(JOB, min_count=3, priority_class_name="training")
    assert group["apiVersion"] == "scheduling.k8s.io/v1beta1" and group["kind"] == "PodGroup"
    assert group["metadata"]["name"] == names.pod_group_name("demo")
    assert group["metadata"]["namespace"] == "team-a"
    assert group["spec"] == {
        "schedulingPolicy": {"gang": {"minCount": 3}},
        "disruptionMode": {"all": {}},
        "priorityClassName": "training",
    }
    assert "priorityClassName" not in podgroup.build_pod_group(JOB, min_count=1)["spec"]


def test_an_empty_gang_is_refused() -> None:
    with pytest.raises(ValueError, match="minCount must be at least 1"):
        podgroup.build_pod_group(JOB, min_count=0)


def test_with_scheduling_group_names_the_group_on_a_copy() -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "demo-trainer-0"},
        "spec": {"containers": []},
    }
    before = copy.deepcopy(pod)
    grouped = podgroup.with_scheduling_group(pod, "demo")
    assert grouped["spec"]["schedulingGroup"] == {"podGroupName": "demo"}
    assert pod == before

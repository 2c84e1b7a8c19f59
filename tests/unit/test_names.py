"""Unit tests for rljob_operator.names: names, labels and the lock key are spelled in one place."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rljob_operator import names

_job_names = st.from_regex(r"[a-z][a-z0-9-]{0,40}[a-z0-9]", fullmatch=True)


def test_contract_names() -> None:
    assert names.trainer_pod_name("j", 0) == "j-trainer-0"
    assert names.rollout_pod_name("j", 3) == "j-rollout-3"
    assert names.config_map_name("j") == "j-config"
    assert names.telemetry_config_map_name("j") == "j-telemetry"
    assert names.service_name("j") == "j"
    assert names.service_account_name("j") == names.role_name("j") == names.role_binding_name("j") == "j"
    assert names.ray_head_host("j", "ns") == "j-trainer-0.j.ns.svc"


def test_job_key_is_namespace_slash_name() -> None:
    assert names.job_key("ns", "j") == "ns/j"
    assert names.job_key("a", "b") != names.job_key("b", "a")


def test_pod_name_rejects_unknown_role() -> None:
    with pytest.raises(ValueError, match="trainer"):
        names.pod_name("j", "worker", 0)


@given(_job_names, st.sampled_from([names.ROLE_TRAINER, names.ROLE_ROLLOUT]), st.integers(0, 999))
def test_parse_pod_name_inverts_pod_name(job: str, role: str, index: int) -> None:
    assert names.parse_pod_name(job, names.pod_name(job, role, index)) == (role, index)


def test_parse_pod_name_rejects_foreign_names() -> None:
    assert names.parse_pod_name("j", "j-trainer-x") is None
    assert names.parse_pod_name("j", "other-trainer-0") is None
    assert names.parse_pod_name("j", "j-config") is None


def test_labels_include_operator_keys() -> None:
    labels = names.pod_labels("j", names.ROLE_ROLLOUT, 2)
    assert labels[names.LABEL_JOB] == "j"
    assert labels[names.LABEL_ROLE] == "rollout"
    assert labels[names.LABEL_INDEX] == "2"
    assert names.selector_labels("j") == {names.LABEL_JOB: "j"}


@given(_job_names)
def test_valid_names_give_short_hostnames(job: str) -> None:
    if names.validate_job_name(job) is None:
        assert len(names.trainer_pod_name(job, 999)) <= 63
        assert len(names.rollout_pod_name(job, 999)) <= 63


def test_validate_job_name_messages_name_the_fix() -> None:
    too_long = "a" * (names.MAX_JOB_NAME_LENGTH + 1)
    message = names.validate_job_name(too_long)
    assert message is not None and "metadata.name" in message and str(names.MAX_JOB_NAME_LENGTH) in message
    bad = names.validate_job_name("1job")
    assert bad is not None and "RFC 1035" in bad
    assert names.validate_job_name("a" * names.MAX_JOB_NAME_LENGTH) is None


def test_kueue_queue_and_priority_labels() -> None:
    labels = {names.KUEUE_QUEUE_LABEL: "team-a", names.KUEUE_PRIORITY_CLASS_LABEL: "research.high"}
    assert names.KUEUE_QUEUE_LABEL == "kueue.x-k8s.io/queue-name"
    assert names.kueue_queue_name(labels) == "team-a"
    assert names.kueue_priority_class(labels) == "research.high"
    assert names.kueue_queue_name({}) is None and names.kueue_queue_name(None) is None
    assert names.kueue_priority_class({"other": "x"}) is None


@pytest.mark.parametrize("value", ["Team_A", "", "-q", "q-", "UPPER"])
def test_a_label_value_that_cannot_name_a_local_queue_says_which_label_and_the_fix(value: str) -> None:
    with pytest.raises(ValueError, match=r"metadata\.labels\[kueue\.x-k8s\.io/queue-name\].*LocalQueue"):
        names.kueue_queue_name({names.KUEUE_QUEUE_LABEL: value})


def test_workload_and_pod_group_names() -> None:
    assert names.workload_name("j") == "rljob-j"
    assert names.pod_group_name("j") == "j"
    assert names.LEADER_LEASE == "rljob-operator"

"""The driver's side of cooperative preemption, pure parts: reading `status.checkpointRequest`
from the RLJob, deciding whether to checkpoint now, and the SyncReport's acknowledgement fields."""

from __future__ import annotations

from rljob_trainer.outputs import telemetry, telemetry_sink
from rljob_trainer.outputs.telemetry_sink import CheckpointRequest


def test_parse_targets_reads_the_checkpoint_request_beside_the_engine_counts() -> None:
    obj = {
        "status": {
            "rollout": {"desiredSharedAwake": 1},
            "checkpointRequest": {"id": "evict-0-1700000000", "reason": "Preempted", "requestTime": "x"},
        }
    }
    targets = telemetry_sink.parse_targets(obj)
    assert targets == telemetry_sink.EngineTargets(
        1, None, CheckpointRequest(id="evict-0-1700000000", reason="Preempted")
    )


def test_no_request_without_an_id() -> None:
    assert telemetry_sink.parse_targets({"status": {}}).checkpoint_request is None
    assert telemetry_sink.parse_checkpoint_request({"checkpointRequest": None}) is None
    assert telemetry_sink.parse_checkpoint_request({"checkpointRequest": {"reason": "Preempted"}}) is None
    assert telemetry_sink.parse_checkpoint_request({"checkpointRequest": "evict"}) is None


def test_a_request_is_honoured_once() -> None:
    request = CheckpointRequest(id="a")
    assert telemetry_sink.checkpoint_to_honour(None, None) is None
    assert telemetry_sink.checkpoint_to_honour(request, None) == "a"
    assert telemetry_sink.checkpoint_to_honour(request, "a") is None  # acknowledged already
    assert telemetry_sink.checkpoint_to_honour(CheckpointRequest(id="b"), "a") == "b"  # a new eviction


def _report(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "step": 3,
        "time": 1.0,
        "intervalS": 1.0,
        "trainerWaitS": 0.5,
        "generationS": 0.5,
        "trainingS": 0.4,
        "inflightRequestSeconds": 1.0,
        "engineSeconds": 1.0,
        "snapshotInflight": 0,
        "sharedEnginesAwake": 1,
        "dedicatedEngines": 0,
        "meanReward": 0.1,
        "loss": 0.2,
        "tokensPerS": 10.0,
        "responseLenMean": 1.0,
    }
    return {**base, **over}


def test_sync_report_ack_fields_are_optional_and_round_trip_camel_case() -> None:
    old = telemetry.SyncReport.model_validate(_report())  # a report of a driver without the fields
    assert old.checkpoint_ack is None and old.checkpoint_ack_step is None
    acked = old.model_copy(update={"checkpoint_ack": "a", "checkpoint_ack_step": 3})
    (back,) = telemetry.parse_reports(telemetry.dump_reports([acked]))
    assert (back.checkpoint_ack, back.checkpoint_ack_step) == ("a", 3)
    assert '"checkpointAck": "a"' in telemetry.dump_reports([acked])

"""`rljob` subcommands that work offline: plan, validate, crd --check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rljob_operator.cli import commands

REPO = Path(__file__).resolve().parents[2]
CONTRACT_KEYS = {
    "kvBytesPerToken",
    "kvCacheTokens",
    "maxNumSeqs",
    "maxNumBatchedTokens",
    "trainerAccelerators",
    "rolloutAccelerators",
    "rolloutEngines",
    "tensorParallel",
}


@pytest.mark.parametrize("example", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_plan_json_of_every_example_carries_the_contract(
    example: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert commands.main(["plan", "-f", str(example), "-o", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan.keys() >= CONTRACT_KEYS
    assert plan["maxNumBatchedTokens"] >= plan["maxNumSeqs"] > 0
    assert plan["reasons"], "every plan explains itself"


def test_plan_table_from_a_model_config_and_flags(capsys: pytest.CaptureFixture[str]) -> None:
    config = REPO / "tests" / "data" / "model_configs" / "meta-llama__Llama-3.1-8B-Instruct.json"
    argv = ["plan", "--model-config", str(config), "--accelerator", "H100-80GB", "--total-accelerators", "8"]
    assert commands.main(argv) == 0
    out = capsys.readouterr().out
    # Llama-3.1-8B: 32 layers x 2 x 8 KV heads x 128 x 2 bytes = 128 KiB per token at TP 1.
    assert "kvBytesPerToken" in out and "131072" in out


def test_plan_reports_estimator_errors_with_their_reason(capsys: pytest.CaptureFixture[str]) -> None:
    config = REPO / "tests" / "data" / "model_configs" / "Qwen__Qwen3-8B.json"
    argv = ["plan", "--model-config", str(config), "--accelerator", "NoSuchGPU"]
    assert commands.main(argv) == 2
    assert "UnknownAccelerator" in capsys.readouterr().err


def test_validate_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = (REPO / "examples" / "tiny-cpu.yaml").read_text().replace("groupSize: 8", "groupSize: 0")
    path = tmp_path / "bad.yaml"
    path.write_text(manifest)
    with pytest.raises(SystemExit) as exc:
        commands.main(["validate", "-f", str(path)])
    assert "spec.grpo.groupSize" in str(exc.value.code)
    assert commands.main(["validate", "-f", str(REPO / "examples" / "tiny-cpu.yaml")]) == 0
    assert "valid" in capsys.readouterr().out


def test_crd_check_fails_on_a_stale_copy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert commands.main(["crd", "--check"]) == 0, "the committed crds/ and helm/rljob/crds/ are fresh"
    assert commands.main(["crd", "--output-dir", str(tmp_path)]) == 0
    written = next(tmp_path.glob("*.yaml"))
    assert commands.main(["crd", "--check", "--output-dir", str(tmp_path)]) == 0
    written.write_text(written.read_text().replace("rljobs", "rljobz", 1))
    assert commands.main(["crd", "--check", "--output-dir", str(tmp_path)]) == 1
    assert "out of date" in capsys.readouterr().err


def test_operator_log_level_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLJOB_LOG_LEVEL", "DEBUG")
    args = commands.build_parser().parse_args(["operator", "-n", "team-a"])
    assert args.log_level == "DEBUG" and args.namespace == "team-a"

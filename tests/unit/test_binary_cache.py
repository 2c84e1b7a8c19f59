"""The binary cache (`testenv.binaries.cached_build`): one build per key, never half a cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from testenv import binaries


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLJOB_CACHE_DIR", str(tmp_path / "cache"))


def test_builds_once_per_key_and_stamps_the_result() -> None:
    calls: list[Path] = []

    def build(staging: Path) -> None:
        calls.append(staging)
        (staging / "tool").write_text("built")

    first = binaries.cached_build("tools", "k1", build, "tools", None)
    again = binaries.cached_build("tools", "k1", build, "tools", None)
    assert first == again == binaries.cache_root() / "tools" / "k1"
    assert len(calls) == 1
    assert (first / "tool").read_text() == "built"
    assert (first / ".complete").read_text() == "k1"
    binaries.cached_build("tools", "k2", build, "tools", None)
    assert len(calls) == 2


def test_a_failed_build_leaves_no_cache_entry_and_the_next_call_builds() -> None:
    def broken(staging: Path) -> None:
        (staging / "half").write_text("x")
        raise RuntimeError("go build failed")

    with pytest.raises(RuntimeError, match="go build failed"):
        binaries.cached_build("tools", "k1", broken, "tools", None)
    folder = binaries.cache_root() / "tools"
    assert sorted(p.name for p in folder.iterdir()) == [".lock"]

    target = binaries.cached_build(
        "tools", "k1", lambda staging: (staging / "ok").write_text("y"), "tools", None
    )
    assert (target / "ok").exists() and (target / ".complete").exists()

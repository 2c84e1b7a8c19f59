"""The peer-parity tier (tests/peer/): verl's own code on the same tensors as rljob's (docs/testing.md)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "peer: runs a peer's own reference code (verl, in .venv-verl/)")

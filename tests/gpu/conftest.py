"""The GPU tier: tests marked `gpu` that need one CUDA device and only torch + transformers.

Skipped without CUDA. `tests/gpu/run.sh` runs them as one prepared script on a lent device (no
vLLM, no Ray, nothing fetched there). Models are random weights from shipped configs.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        available = torch.cuda.is_available()
    except ImportError:
        available = False
    skip = pytest.mark.skip(reason="needs a CUDA device (tests/gpu/run.sh on a lent GPU)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not available:
                item.add_marker(skip)

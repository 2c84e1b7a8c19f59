"""The sleep and wake rules `engines.base.SleepState` (both engines) mirrors, read from the installed
vLLM's own code: vLLM's executor sleep/wake logic runs here for real on a stand-in worker group (it
only tracks tags and sends RPCs), and the worker's level-2 handling is read from its source."""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path
from typing import Any

from rljob_trainer.engines import base


def _worker_method(name: str) -> str:
    """The source of `vllm.v1.worker.gpu_worker.Worker.<name>`, read without importing the module
    (its CUDA kernels' imports need a GPU)."""
    spec = importlib.util.find_spec("vllm.v1.worker.gpu_worker")
    assert spec is not None and spec.origin is not None
    text = Path(spec.origin).read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == "Worker":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return ast.get_source_segment(text, item) or ""
    raise AssertionError(f"vLLM's Worker has no method {name}")


def _executor() -> Any:
    from vllm.v1.executor.abstract import Executor

    class Recorder(Executor):  # only the tag bookkeeping of the real Executor.sleep / wake_up runs
        def _init_executor(self) -> None: ...

        def collective_rpc(
            self, method: Any, timeout: Any = None, args: Any = (), kwargs: Any = None, **_: Any
        ) -> Any:
            self.rpcs.append((method, kwargs))
            return []

        def check_health(self) -> None: ...

    executor = object.__new__(Recorder)
    executor.sleeping_tags = set()
    executor.rpcs = []
    if not isinstance(inspect.getattr_static(Executor, "is_sleeping", None), property):
        executor.is_sleeping = False  # vLLM 0.23 keeps a flag; 0.33 derives it from the tags
    return executor


def test_the_mirrored_release_is_the_pinned_one(vllm_version: str, tier: str) -> None:
    if tier == "cuda":
        assert vllm_version.split("+")[0] == base.MIRRORS_VLLM


def test_the_wake_tags_are_vllms() -> None:
    ex = _executor()
    ex.sleep(level=1)
    assert ex.sleeping_tags == set(base.WAKE_TAGS)


def test_vllm_wakes_weights_then_kv_cache_and_is_fully_awake_only_after_both() -> None:
    ex = _executor()
    ex.sleep(level=2)
    assert ex.sleeping_tags == set(base.WAKE_TAGS)
    ex.wake_up(["weights"])
    assert ex.is_sleeping and ex.sleeping_tags == {"kv_cache"}  # generation stays refused (SleepState)
    ex.wake_up(["kv_cache"])
    assert not ex.is_sleeping
    state = base.SleepState("e", sleep_enabled=True)
    state.on_sleep(2)
    state.on_wake(["weights"])
    assert not state.fully_awake
    state.on_wake(["kv_cache"])
    assert state.fully_awake


def test_vllm_ignores_a_whole_wake_naming_an_awake_tag_so_engines_send_only_the_asleep_ones() -> None:
    ex = _executor()
    ex.sleep(level=1)
    ex.wake_up(["weights"])
    rpcs = len(ex.rpcs)
    ex.wake_up(["weights", "kv_cache"])  # weights already awake: vLLM wakes nothing
    assert len(ex.rpcs) == rpcs and ex.sleeping_tags == {"kv_cache"}
    state = base.SleepState("e", sleep_enabled=True)
    state.on_sleep(1)
    state.on_wake(["weights"])
    assert state.on_wake(["weights", "kv_cache"]) == {"kv_cache"}  # what VLLMEngine.wake sends vLLM


def test_a_second_sleep_is_a_no_op_in_vllm_as_in_both_engines() -> None:
    ex = _executor()
    ex.sleep(level=1)
    rpcs = len(ex.rpcs)
    ex.sleep(level=2)
    assert len(ex.rpcs) == rpcs


def test_level_2_keeps_buffers_and_discards_parameters_in_vllms_worker() -> None:
    """The transformers engine discards parameters at level 2 and keeps buffers, as vLLM's worker
    saves named_buffers() before a level-2 sleep and restores them when the weights wake."""
    sleep, wake = _worker_method("sleep"), _worker_method("wake_up")
    assert "level == 2" in sleep and "named_buffers()" in sleep
    assert "_sleep_saved_buffers" in wake


def test_vllm_loads_transferred_weights_without_a_sleep_check_so_rljob_refuses_first() -> None:
    """vLLM's worker writes transferred weights wherever they are, asleep or not; both engines refuse
    an update while the weights sleep (base.EngineAsleepError), before vLLM is called."""
    assert "sleep" not in _worker_method("update_weights")
    state = base.SleepState("e", sleep_enabled=True)
    state.on_sleep(1)
    try:
        state.check_update()
    except base.EngineAsleepError:
        pass
    else:
        raise AssertionError("an update into sleeping weights was allowed")

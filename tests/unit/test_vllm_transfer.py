"""The timeout and failure rules of `weights.vllm_transfer` (the trainer side of vLLM's weight
transfer), with stand-in engines and senders: no vLLM, no GPU. What vLLM itself takes is checked by
the conformance tier (tests/conformance/)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from rljob_trainer.weights import vllm_transfer


class _Engines:
    """A stand-in for `ray_call`: each engine answers, raises, or never answers (within the timeout)."""

    def __init__(self, **behaviour: str) -> None:
        self.behaviour = behaviour
        self.calls: list[tuple[str, str, tuple[Any, ...]]] = []

    def __call__(
        self, handles: dict[str, Any], method: str, args: tuple[Any, ...], timeout_s: float
    ) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for name in handles:
            self.calls.append((name, method, args))
            how = self.behaviour.get(name, "ok")
            if how == f"fail:{method}":
                out[name] = f"{method}: TypeError: unexpected keyword"
            elif how == f"hang:{method}":
                out[name] = f"{method} timed out after {timeout_s:.0f} s"
            else:
                out[name] = None
        return out


def test_an_engine_that_fails_is_marked_and_skipped_while_the_others_go_on() -> None:
    engines = _Engines(b="fail:receive_weight_update")
    aborted: list[str] = []
    client = vllm_transfer.EngineClient(
        {"a": 1, "b": 2, "c": 3}, timeout_s=5.0, call=engines, on_failure=lambda n, e: aborted.append(n)
    )
    client.version = 7
    client.start_weight_update()
    client.update_weights({"names": []})
    client.update_weights({"names": []})
    client.finish_weight_update()
    assert set(client.failed) == {"b"} and "TypeError" in client.failed["b"] and aborted == ["b"]
    b_calls = [m for n, m, _ in engines.calls if n == "b"]
    assert b_calls == ["start_weight_update", "receive_weight_update"]  # nothing after its failure
    assert ("a", "finish_weight_update", (7,)) in engines.calls and (
        "c",
        "finish_weight_update",
        (7,),
    ) in engines.calls


def test_client_calls_reach_only_the_targets_of_the_round() -> None:
    engines = _Engines()
    client = vllm_transfer.EngineClient({"a": 1, "b": 2}, timeout_s=5.0, call=engines)
    client.targets = ["b"]
    client.start_weight_update()
    assert [n for n, _, _ in engines.calls] == ["b"]


def test_the_watchdog_aborts_a_hung_send_and_reports_it() -> None:
    release = threading.Event()
    aborted = []

    def abort() -> None:  # what ncclCommAbort does to a blocked broadcast: it returns
        aborted.append(time.monotonic())
        release.set()

    t0 = time.monotonic()
    error = vllm_transfer.send_with_watchdog(release.wait, abort=abort, timeout_s=0.3, grace_s=5.0)
    assert error is not None and "timed out after" in error and "aborted" in error
    assert aborted and 0.25 <= aborted[0] - t0 < 3.0


def test_the_watchdog_gives_up_on_a_send_the_abort_cannot_free() -> None:
    never = threading.Event()
    t0 = time.monotonic()
    error = vllm_transfer.send_with_watchdog(never.wait, abort=lambda: None, timeout_s=0.2, grace_s=0.2)
    assert error is not None and "still blocked" in error
    assert time.monotonic() - t0 < 3.0  # rank 0 returns: it never waits forever


def test_the_watchdog_passes_errors_and_successes_through() -> None:
    def boom() -> None:
        raise RuntimeError("NCCL error: remote process exited")

    assert vllm_transfer.send_with_watchdog(lambda: None, abort=lambda: None, timeout_s=1.0) is None
    error = vllm_transfer.send_with_watchdog(boom, abort=lambda: None, timeout_s=1.0)
    assert error == "RuntimeError: NCCL error: remote process exited"


class _Runtime:
    """A stand-in runtime whose futures finish after the given delays (None: never)."""

    def __init__(self, delays: list[float | None]) -> None:
        self.start = time.monotonic()
        self.futures = [(i, d) for i, d in enumerate(delays)]

    def wait_any(self, futures: list[Any], timeout_s: float | None) -> list[Any]:
        deadline = time.monotonic() + (timeout_s or 0.0)
        while True:
            now = time.monotonic() - self.start
            done = [f for f in futures if f[1] is not None and f[1] <= now]
            if done or time.monotonic() >= deadline:
                return done
            time.sleep(0.01)

    def get(self, futures: list[Any]) -> list[Any]:
        return [f"rank {i}" for i, _ in futures]


def test_a_rank_that_never_returns_fails_the_call_saying_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_transfer, "ABORT_GRACE_S", 0.0)
    rt = _Runtime([0.01, 0.02])
    assert vllm_transfer.rank_results(
        rt, rt.futures, what="weight transfer", timeout_s=0.0, clock=time.monotonic
    ) == ["rank 0", "rank 1"]
    rt = _Runtime([0.01, None])
    monkeypatch.setattr(vllm_transfer, "_RANK_MARGIN_S", 0.3)
    with pytest.raises(RuntimeError, match=r"trainer rank\(s\) \[1\] did not return from weight transfer"):
        vllm_transfer.rank_results(
            rt, rt.futures, what="weight transfer", timeout_s=0.0, clock=time.monotonic
        )

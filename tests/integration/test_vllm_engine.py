"""The real vLLM engine (vLLM's CPU build, the tests' and the CPU image's pin) behind rljob's engine
contract: generation and processed log-probs against the trainer's, weight syncs that really arrive,
pause / abort / resume as vLLM 0.32 does them, sleep on a platform without sleep mode (a stop and a
restart, never trusted to `is_sleeping()`), and an engine whose EngineCore is killed mid-generate
and mid-reload.

Each engine is a real AsyncLLM with its EngineCore and worker processes (about 20 s to start here);
one per module fixture, not per test.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import psutil
import pytest
from trainer_configs import vllm_config

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from rljob_trainer.engines import base, platform, vllm_engine  # noqa: E402
from rljob_trainer.model import modeling, sampling  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.vllm, pytest.mark.slow]

CAP = 96  # response budget of the long requests the pause tests interrupt (through EOS: ignore_eos)
PROMPTS = [[3, 5, 11], [4, 4, 11, 1], [9], [7, 2, 11, 6, 8]]
TEMPERATURE, TOP_P = 0.8, 0.9


def _cfg(dtype: str = "float32", **over):
    return vllm_config(
        dtype,
        lengths={"maxPromptTokens": 8, "maxResponseTokens": CAP},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
        **over,
    )


def _policy(cfg, seed: int) -> torch.nn.Module:
    """Weights other than the engine's start (`grpo.seed`): what a sync must carry over."""
    return modeling.build_base_model(cfg.model, init_seed=seed).eval()


def _sync(engine, cfg, policy, version: int) -> None:
    engine.update_weights(
        dict(modeling.iter_engine_weights(policy, getattr(torch, cfg.model.dtype))), version
    )


def _trainer_logprobs(policy, cfg, out: base.GenerationOutput) -> torch.Tensor:
    """The trainer's processed log-probs (temperature, then top-p, as vLLM samples) of an output."""
    compute = policy.to(getattr(torch, cfg.model.dtype))
    ids = torch.tensor([[*out.prompt_token_ids, *out.token_ids]])
    with torch.no_grad():
        logits = compute(input_ids=ids).logits[0].float()
    n = len(out.prompt_token_ids)
    logp, _ = sampling.token_log_probs(
        logits[n - 1 : -1], torch.tensor(out.token_ids), temperature=TEMPERATURE, top_p=TOP_P
    )
    return logp


def _sampling(n: int, max_tokens: int = 12, **kw) -> base.SamplingSettings:
    return base.SamplingSettings(
        temperature=TEMPERATURE, top_p=TOP_P, max_tokens=max_tokens, seeds=tuple(range(n)), **kw
    )


def _live(pids: set[int]) -> list[psutil.Process]:
    """The processes of `pids` still alive (a zombie is gone: it only waits for its parent's wait)."""
    out = []
    for pid in sorted(pids):
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.NoSuchProcess:
            pass
    return out


def _core_tracker(engine: vllm_engine.VLLMEngine) -> Callable[[], list[psutil.Process]]:
    """`cores()`: the engine's live EngineCore processes, every one vLLM's process manager has named
    since (so one that a stop signalled stays counted until it exits). Not by process title: a CI run
    found an EngineCore still titled `python`."""
    seen: set[int] = set()

    def cores() -> list[psutil.Process]:
        seen.update(engine.engine_core_pids())
        return _live(seen)

    return cores


@pytest.fixture(scope="module")
def dedicated():
    cfg = _cfg()
    engine = vllm_engine.VLLMEngine(cfg, name="dedicated-0", colocated=False)
    caps = engine.load()
    yield cfg, engine, caps
    engine.shutdown()


def test_the_engine_asks_vllm_what_its_platform_can_do(dedicated) -> None:
    _, engine, caps = dedicated
    probed = platform.probe()
    assert probed is not None and caps == probed.to_dict()
    # vLLM's CPU build: no sleep mode, no CUDA graphs, a KV cache in host memory sized in bytes.
    assert (caps["device_type"], caps["sleep_mode"], caps["static_graphs"], caps["host_memory_kv"]) == (
        "cpu",
        False,
        False,
        True,
    )
    assert engine._engine_kwargs["kv_cache_memory_bytes"] == 32 << 20
    assert engine._engine_kwargs["enforce_eager"] is True
    assert engine.starts == 1 and engine.last_start_s is not None


def test_a_weight_sync_arrives_and_the_engines_log_probs_are_the_trainers(dedicated) -> None:
    cfg, engine, _ = dedicated
    for version, seed in ((1, 7), (2, 8)):
        policy = _policy(cfg, seed)
        _sync(engine, cfg, policy, version)
        outs = engine.generate(PROMPTS, _sampling(len(PROMPTS)))
        assert engine.weights_version == version and all(o.meta["version"] == version for o in outs)
        diff = max(
            float((_trainer_logprobs(policy, cfg, o) - torch.tensor(o.logprobs)).abs().max()) for o in outs
        )
        assert diff < 1e-5, f"float32: engine vs trainer processed log-probs differ by {diff}"


def test_requests_are_seeded_per_request_not_per_batch(dedicated) -> None:
    _, engine, _ = dedicated
    both = engine.generate(PROMPTS, _sampling(len(PROMPTS)))
    alone = engine.generate(PROMPTS[2:3], base.SamplingSettings(TEMPERATURE, TOP_P, 12, seeds=(2,)))
    assert alone[0].token_ids == both[2].token_ids


def test_seeded_prompts_longer_than_one_batch_are_served_on_the_cpu_build() -> None:
    """vLLM 0.32 rewinds a seeded request's torch generator when it discards the token sampled after a
    partial (chunked) prefill; a CPU generator has no offset, and the EngineCore died ("CPU Generator
    does not use offset") as soon as the step's prompts outgrew maxNumBatchedTokens: it killed
    examples/tiny-agent-endpoint-cpu.yaml's engine on the local cluster. The engine now turns chunked
    prefill off where the platform's generator cannot rewind."""
    cfg = vllm_config(
        lengths={"maxPromptTokens": 64, "maxResponseTokens": 16},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
    )
    engine = vllm_engine.VLLMEngine(cfg, name="dedicated-1", colocated=False)
    caps = engine.load()
    try:
        assert caps["seeded_chunked_prefill"] is False  # CPU torch: generators without offsets
        prompts = [[1 + (i * 7 + j) % 9 for j in range(60)] for i in range(8)]  # 480 > 256 tokens a batch
        outs = engine.generate(prompts, _sampling(len(prompts), max_tokens=4))
        assert [len(o.token_ids) for o in outs if o.finish_reason == "length"] and all(
            o.token_ids for o in outs
        )
        alone = engine.generate(prompts[5:6], base.SamplingSettings(TEMPERATURE, TOP_P, 4, seeds=(5,)))
        assert alone[0].token_ids == outs[5].token_ids  # still seeded per request
    finally:
        engine.shutdown()


def _finished(o: base.GenerationOutput) -> bool:
    """Ran to its budget: a long request generates through the end-of-sequence token (ignore_eos), so
    it is still running whenever a test acts on it, however late a loaded machine lets the test act."""
    return o.finish_reason == "length" and len(o.token_ids) == CAP


def _generate_in_thread(engine, prompts, sampling):
    out: dict[str, object] = {}
    t = threading.Thread(target=lambda: out.update(result=engine.generate(prompts, sampling)))
    t.start()
    return t, out


def _wait_gone(cores, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while cores():
        assert time.monotonic() < deadline, f"the engine's processes must be gone: {cores()}"
        time.sleep(0.2)


def _wait_inflight(engine, n: int = 1) -> None:
    deadline = time.monotonic() + 60
    while len(engine.inflight_request_ids()) < n:
        assert time.monotonic() < deadline, "the engine never took the requests"
        time.sleep(0.01)
    time.sleep(0.1)  # a few tokens in


def test_interrupt_aborts_in_flight_requests_with_their_tokens_and_resume_serves_again(dedicated) -> None:
    _, engine, _ = dedicated
    prompts = PROMPTS * 2
    long = _sampling(len(prompts), max_tokens=CAP, stop_token_ids=(), ignore_eos=True)
    t, out = _generate_in_thread(engine, prompts, long)
    _wait_inflight(engine, len(prompts))
    engine.interrupt()  # vLLM's pause_generation(mode="abort"), returns once no call runs
    t.join(timeout=60)
    partial = [o for o in out["result"] if o.aborted]
    # A request still running was stopped with what it had; the others had ended on their own.
    assert partial and all(len(o.token_ids) < CAP for o in partial)
    assert all(o.aborted or _finished(o) for o in out["result"])
    # While paused a new call aborts every request before its first token.
    assert all(o.aborted and not o.token_ids for o in engine.generate(prompts, long))
    engine.resume()
    # A request resumes from the tokens it has, with the rest of its budget.
    rest = base.SamplingSettings(
        TEMPERATURE,
        TOP_P,
        CAP,
        seeds=tuple(range(50, 50 + len(partial))),
        stop_token_ids=(),
        max_tokens_per_request=tuple(CAP - len(o.token_ids) for o in partial),
        ignore_eos=True,
    )
    resumed = engine.generate([[*o.prompt_token_ids, *o.token_ids] for o in partial], rest)
    merged = [base.continue_output(p, r) for p, r in zip(partial, resumed, strict=True)]
    assert all(_finished(m) and m.meta["interrupts"] == 1 for m in merged)
    assert all(m.token_ids[: len(p.token_ids)] == p.token_ids for m, p in zip(merged, partial, strict=True))


def test_pause_keep_freezes_requests_that_finish_after_resume(dedicated) -> None:
    _, engine, _ = dedicated
    t, out = _generate_in_thread(
        engine, PROMPTS[:2], _sampling(2, max_tokens=CAP, stop_token_ids=(), ignore_eos=True)
    )
    _wait_inflight(engine, 2)
    engine.pause_generation(mode="keep")
    assert engine.is_paused()
    t.join(timeout=1.0)
    assert t.is_alive(), "a kept request must wait, frozen, until resume"
    engine.resume_generation()
    t.join(timeout=60)
    assert all(_finished(o) for o in out["result"])


def test_vllm_0_32_holds_a_request_submitted_during_an_abort_pause_until_resume(dedicated) -> None:
    """What `interrupt()` relies on, on the CPU pin: vLLM 0.32 queues a request that arrives while
    paused with mode "abort" and serves it after resume (0.33 refuses it with RetryableRequestError,
    which `VLLMEngine._generate_all` turns into an aborted output; tests/conformance checks 0.33's side).
    `interrupt()` aborts such a request by id, so nothing of it is sampled under weights about to change."""
    _, engine, _ = dedicated
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    assert vllm.__version__ == "0.32.0", "this test states 0.32's pause behaviour; re-read it for a new pin"
    engine.pause_generation(mode="abort")
    result: dict[str, object] = {}

    async def one() -> None:
        async for o in engine._llm.generate(
            TokensPrompt(prompt_token_ids=PROMPTS[0]), SamplingParams(max_tokens=4, seed=0), "held-0"
        ):
            result["out"] = o

    fut = asyncio.run_coroutine_threadsafe(one(), engine._loop.loop)
    time.sleep(1.0)
    assert not fut.done() and "out" not in result, "0.32 holds the request while paused"
    engine.resume_generation()
    fut.result(timeout=60)
    assert len(result["out"].outputs[0].token_ids) == 4


def test_abort_by_id_ends_that_request_only(dedicated) -> None:
    _, engine, _ = dedicated
    t, out = _generate_in_thread(
        engine, PROMPTS[:2], _sampling(2, max_tokens=CAP, stop_token_ids=(), ignore_eos=True)
    )
    _wait_inflight(engine, 2)
    first = engine.inflight_request_ids()[0]
    assert engine.abort_requests([first]) == [first]
    t.join(timeout=60)
    by_id = {o.meta.get("request_id"): o for o in out["result"] if o.meta.get("request_id")}
    aborted = [o for o in out["result"] if o.aborted]
    assert len(aborted) == 1 and len(aborted[0].token_ids) < CAP
    assert [_finished(o) for o in out["result"] if not o.aborted] == [True]
    assert first not in by_id or by_id[first].aborted


def test_weights_are_refused_while_a_generate_call_runs(dedicated) -> None:
    cfg, engine, _ = dedicated
    t, _ = _generate_in_thread(
        engine, PROMPTS[:2], _sampling(2, max_tokens=CAP, stop_token_ids=(), ignore_eos=True)
    )
    _wait_inflight(engine, 2)
    with pytest.raises(base.EngineBusyError, match="interrupt"):
        _sync(engine, cfg, _policy(cfg, 3), 9)
    t.join(timeout=60)


def test_bf16_log_probs_stay_within_the_measured_bound() -> None:
    """bf16 on both sides: engine and trainer kernels round differently (measured here: 4.4e-3 max on
    the tiny model); the bound asserted is 2e-2."""
    cfg = _cfg("bfloat16")
    engine = vllm_engine.VLLMEngine(cfg, name="bf16", colocated=False)
    engine.load()
    try:
        policy = _policy(cfg, 7)
        _sync(engine, cfg, policy, 1)
        outs = engine.generate(PROMPTS, _sampling(len(PROMPTS)))
        diff = max(
            float((_trainer_logprobs(policy, cfg, o) - torch.tensor(o.logprobs)).abs().max()) for o in outs
        )
        assert diff < 2e-2, f"bf16: engine vs trainer processed log-probs differ by {diff}"
    finally:
        engine.shutdown()


def test_sleep_without_sleep_mode_stops_the_engine_and_wake_starts_it_with_the_weights_reloaded() -> None:
    """vLLM 0.32 on CPU has no sleep mode: a shared engine told to sleep is shut down (its EngineCore
    exits, its memory is freed) and a wake starts it again; the weights loaded since it started are
    gone, so generation is refused until the current ones are loaded. The engine's own state says
    so; vLLM's `is_sleeping()` (True without sleep mode) is never asked. Then its EngineCore is killed
    mid-generate: the engine names the failure (`EngineDiedError`, a lost engine to the runtimes)."""
    cfg = _cfg(rollout={"sharedEngines": 1, "dedicatedEngines": 0, "enableSleepMode": True})
    engine = vllm_engine.VLLMEngine(cfg, name="shared-0", colocated=True)
    cores = _core_tracker(engine)
    try:
        engine.load()
        # Asleep from the start: not started at all (the driver would stop it at once).
        assert engine.sleeps_by_restart and engine.is_sleeping and engine.starts == 0
        assert not cores()
        with pytest.raises(base.EngineAsleepError):
            engine.generate(PROMPTS, _sampling(len(PROMPTS)))
        engine.wake(["weights"])
        assert engine.starts == 1 and len(cores()) == 1
        policy = _policy(cfg, 7)
        _sync(engine, cfg, policy, 1)
        engine.wake(["kv_cache"])
        first = engine.generate(PROMPTS, _sampling(len(PROMPTS)))

        engine.sleep(1)  # level 1 keeps weights on a GPU; a stop cannot
        assert engine.is_sleeping
        # vLLM's shutdown signals its EngineCore and returns; on two loaded cores the process took
        # longer than the shutdown to exit once (CI, 2026-12-07).
        _wait_gone(cores)
        engine.wake(["weights"])
        engine.wake(["kv_cache"])
        assert engine.starts == 2 and engine.start_report()["last_start_s"] > 0
        with pytest.raises(base.WeightsDiscardedError):
            engine.generate(PROMPTS, _sampling(len(PROMPTS)))
        _sync(engine, cfg, policy, 2)
        again = engine.generate(PROMPTS, _sampling(len(PROMPTS)))
        assert [o.token_ids for o in again] == [o.token_ids for o in first]

        t, out = _generate_in_thread(
            engine, PROMPTS, _sampling(len(PROMPTS), max_tokens=CAP, stop_token_ids=(), ignore_eos=True)
        )
        _wait_inflight(engine, 1)
        for core in cores():
            core.kill()
        t.join(timeout=60)
        assert "result" not in out
        with pytest.raises(base.EngineDiedError, match="engine core died"):
            engine.generate(PROMPTS, _sampling(len(PROMPTS)))

        # Started again (the driver replaces a dead engine; a sleep and a wake restart this one), its
        # EngineCore dies while a weight reload waits for it: vLLM never answers that call, and the
        # engine gives it up as a death within seconds, not after rollout.engineTimeoutS (600 s).
        engine.sleep(1)
        _wait_gone(cores)
        engine.wake(["weights"])
        (core,) = cores()
        core.suspend()  # the reload is sent and waits, as one in flight when a core dies does
        synced: dict[str, object] = {}

        def sync() -> None:
            try:
                _sync(engine, cfg, policy, 3)
            except BaseException as e:  # the thread reports what ended it
                synced["error"] = e

        t = threading.Thread(target=sync)
        t.start()
        time.sleep(2.0)
        assert t.is_alive(), f"the reload ended before its EngineCore died: {synced}"
        core.kill()
        killed = time.monotonic()
        t.join(timeout=60)
        assert not t.is_alive() and time.monotonic() - killed < 30
        assert isinstance(synced.get("error"), base.EngineDiedError), synced
    finally:
        engine.shutdown()


def test_a_head_size_the_platforms_attention_refuses_is_named_before_vllm_starts() -> None:
    cfg = _cfg(model={"hfConfig": modeling.tiny_hf_config(32, num_attention_heads=4, num_key_value_heads=2)})
    engine = vllm_engine.VLLMEngine(cfg, name="e", colocated=False)
    with pytest.raises(ValueError, match=r"head_dim is 16 \(spec.model\).*rollout.kind transformers"):
        engine.load()
    assert engine.starts == 0


def test_a_lora_adapter_arrives_through_add_lora_and_the_engine_serves_the_trainers_policy() -> None:
    """rollout.engineLora on the real engine: each sync writes the adapter as a PEFT folder, vLLM's
    add_lora takes it under a new id and remove_lora drops the previous one; generation then follows
    the trainer's LoRA policy (its processed log-probs equal the PEFT model's)."""
    peft = pytest.importorskip("peft")
    from rljob_trainer.weights import weight_sync

    cfg = _cfg(
        model={"finetune": "lora", "lora": {"rank": 4, "alpha": 8.0, "targetModules": "all-linear"}},
        rollout={"engineLora": True, "sleepLevel": 1},
    )
    engine = vllm_engine.VLLMEngine(cfg, name="lora", colocated=False)
    engine.load()
    try:
        base_model = modeling.build_base_model(cfg.model, init_seed=cfg.grpo.seed)  # what the engine loaded
        policy = modeling.apply_finetune_mode(base_model, cfg.model)
        gen = torch.Generator().manual_seed(11)
        for version in (1, 2):
            with torch.no_grad():
                for name, p in policy.named_parameters():
                    if "lora_" in name:
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            with weight_sync.engine_tensors(policy, weight_sync.SEND_ADAPTER) as tensors:
                adapter = {n: t.detach().clone() for n, t in tensors}
            engine.update_weights(adapter, version)
            assert engine.adapter_version() == version
            listed = engine._run(engine._llm.list_loras())
            assert list(listed) == [engine._adapter.lora_int_id], "the previous adapter is removed"
            outs = engine.generate(PROMPTS, _sampling(len(PROMPTS)))
            diff = max(
                float((_trainer_logprobs(policy.eval(), cfg, o) - torch.tensor(o.logprobs)).abs().max())
                for o in outs
            )
            assert diff < 1e-4, f"LoRA: engine vs trainer processed log-probs differ by {diff}"
        assert isinstance(policy, peft.PeftModel)
    finally:
        engine.shutdown()


_HOLDER = """
import sys, time
sys.path.insert(0, {tests!r})
from trainer_configs import vllm_config
from rljob_trainer.engines import vllm_engine

if __name__ == "__main__":  # vLLM spawns its processes: they import this module again
    cfg = vllm_config(distributed={{"numTrainerRanks": 1, "launcher": "local"}})
    engine = vllm_engine.VLLMEngine(cfg, name="held", colocated=False)
    engine.load()
    print("started", *engine.engine_core_pids(), flush=True)
    time.sleep(600)
"""


def test_an_engine_core_dies_with_a_front_end_killed_without_shutting_it_down(tmp_path) -> None:
    """A Ray actor killed (SIGKILL) never runs AsyncLLM.shutdown(): vLLM's workers follow their
    EngineCore, and the EngineCore now follows its parent (`platform.die_with_parent`, run in every
    vLLM process by the rljob vLLM plugin), instead of holding its memory until the pod goes."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "holder.py"
    script.write_text(_HOLDER.format(tests=str(Path(__file__).parent)))
    holder = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        started = next((line.split() for line in holder.stdout if line.startswith("started")), None)
        assert started, "the engine never started"
        children = psutil.Process(holder.pid).children(recursive=True)
        cores = _live({int(pid) for pid in started[1:]})
        assert len(cores) == 1 and cores[0] in children, (started, children)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"vLLM processes outlived their killed front end: {alive}"

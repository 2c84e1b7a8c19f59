"""LoRA-only weight sync (`rollout.engineLora`): a transformers engine serving the base model plus the
trainer's PEFT adapter takes only the adapter tensors over a real gloo group (bucketed, model dtype),
and generates exactly what an engine given the full merged model generates.

- Adapter over the wire vs merged model into a plain engine: same tokens and log-probs, a fraction of
  the bytes (printed side by side).
- After a level-2 sleep (weights discarded) the engine takes base and adapter and serves the policy again.
- The real driver in local mode with engineLora: the engine's sampling log-probs equal the trainer's.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from trainer_configs import toy_config

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from rljob_trainer import config, driver  # noqa: E402
from rljob_trainer.engines import base, transformers_engine  # noqa: E402
from rljob_trainer.model import modeling  # noqa: E402
from rljob_trainer.weights import weight_sync  # noqa: E402

pytestmark = [pytest.mark.torch]

BUCKET_BYTES = 4 * 1024  # several buckets per sync: the seams are where bugs hide


def _cfg(*, engine_lora: bool, grpo: dict[str, Any] | None = None, **rollout: Any) -> config.TrainerConfig:
    return toy_config(
        grpo={
            "groupSize": 8,
            "promptsPerStep": 16,
            "maxSteps": 160,
            "learningRate": 3e-3,
            "seed": 1,
            **(grpo or {}),
        },
        model={"finetune": "lora", "lora": {"rank": 4, "alpha": 8.0, "targetModules": "all-linear"}},
        lengths={"maxPromptTokens": 8, "maxResponseTokens": 6},
        rollout={"sharedEngines": 0, "dedicatedEngines": 1, "engineLora": engine_lora, **rollout},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
    )


def _trained_policy(cfg: config.TrainerConfig) -> torch.nn.Module:
    """The trainer's policy: the same base, and an adapter far from its zero start (as after training)."""
    model = modeling.apply_finetune_mode(
        modeling.build_base_model(cfg.model, init_seed=cfg.grpo.seed), cfg.model
    )
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def _engine(cfg: config.TrainerConfig, *, colocated: bool = False) -> transformers_engine.TransformersEngine:
    e = transformers_engine.TransformersEngine(cfg, name="e", colocated=colocated)
    e.load()
    return e


def _sync_over_gloo(
    engine: transformers_engine.TransformersEngine, tensors: list[tuple[str, Any]], version: int
) -> weight_sync.SendReport:
    """One sync over a real two-rank gloo group: trainer rank 0 here, the engine in a thread."""
    store = weight_sync.create_group_store("127.0.0.1", 2, timeout_s=60)
    address = weight_sync.GroupAddress("e", "127.0.0.1", int(store.port), 2, "gloo", 60)
    received: dict[str, Any] = {}

    def engine_side() -> None:
        group = weight_sync.open_group(address, 1)
        try:
            received["report"] = weight_sync.receive_weights(
                group, lambda items: engine.update_weights(items, engine.weights_version)
            )
            engine.update_weights([], version)
        finally:
            group.close()

    thread = threading.Thread(target=engine_side)
    thread.start()
    group = weight_sync.open_group(address, 0, store=store)
    try:
        report = weight_sync.send_weights(
            {"e": group}, tensors, version=version, dtype=torch.float32, bucket_bytes=BUCKET_BYTES
        )
    finally:
        thread.join(60)
        group.close()
    assert report.failed == {} and received["report"].version == version
    return report


def _generate(engine: transformers_engine.TransformersEngine) -> list[base.GenerationOutput]:
    prompts = [[3, 5, 11, 7], [4, 4, 11], [9, 1, 2, 11, 6]] * 3
    sampling = base.SamplingSettings(temperature=1.0, max_tokens=6, seeds=tuple(range(len(prompts))))
    return engine.generate(prompts, sampling)


def _max_logprob_gap(a: list[base.GenerationOutput], b: list[base.GenerationOutput]) -> float:
    pairs = [(x, y) for o, p in zip(a, b, strict=True) for x, y in zip(o.logprobs, p.logprobs, strict=False)]
    return max(abs(x - y) for x, y in pairs)


def _assert_same(a: list[base.GenerationOutput], b: list[base.GenerationOutput]) -> None:
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


def test_an_adapter_only_sync_generates_what_a_full_merged_sync_does() -> None:
    lora_cfg, full_cfg = _cfg(engine_lora=True), _cfg(engine_lora=False)
    policy = _trained_policy(lora_cfg)
    full = _engine(full_cfg)
    full.update_weights(dict(modeling.iter_engine_weights(policy)), 1)
    lora = _engine(lora_cfg)
    assert lora.serves_lora and not full.serves_lora
    before, target = _generate(lora), _generate(full)  # base only (adapter B is zero): not the policy
    assert _max_logprob_gap(before, target) > 1e-2

    adapter = weight_sync.lora_adapter_tensors(policy)
    assert adapter and all("lora_" in n for n, _ in adapter)
    sent = _sync_over_gloo(lora, adapter, version=1)
    _assert_same(_generate(lora), _generate(full))
    assert lora.weights_version == 1

    with weight_sync.merged_lora_tensors(policy) as merged:  # what a full sync would have sent
        full_bytes = weight_sync.send_weights({}, merged, version=1, bucket_bytes=BUCKET_BYTES).nbytes
    ratio = full_bytes / sent.nbytes
    print(f"lora sync bytes: adapter-only {sent.nbytes}, full merged {full_bytes}, ratio {ratio:.1f}")
    assert sent.buckets > 1 and sent.nbytes < full_bytes / 4


def test_after_a_level_2_sleep_base_and_adapter_restore_the_policy() -> None:
    lora_cfg = _cfg(engine_lora=True, sharedEngines=1, dedicatedEngines=0, enableSleepMode=True, sleepLevel=2)
    policy = _trained_policy(lora_cfg)
    reference = _engine(_cfg(engine_lora=False))
    reference.update_weights(dict(modeling.iter_engine_weights(policy)), 2)
    engine = _engine(lora_cfg, colocated=True)
    engine.sleep(2)
    engine.wake(["weights"])
    # The adapter alone cannot restore discarded base weights: the engine still refuses to generate.
    _sync_over_gloo(engine, weight_sync.lora_adapter_tensors(policy), version=2)
    engine.wake(["kv_cache"])
    with pytest.raises(base.WeightsDiscardedError):
        _generate(engine)
    engine = _engine(lora_cfg, colocated=True)
    engine.sleep(2)
    engine.wake(["weights"])
    _sync_over_gloo(engine, weight_sync.lora_base_and_adapter_tensors(policy), version=2)
    engine.wake(["kv_cache"])
    _assert_same(_generate(engine), _generate(reference))


def test_the_driver_with_engine_lora_keeps_the_engine_on_the_trainers_policy() -> None:
    cfg = _cfg(engine_lora=True, grpo={"maxSteps": 3, "promptsPerStep": 4})
    d = driver.GRPODriver(cfg, driver.LocalRuntime(cfg))
    sent: list[str] = []
    current = d._current_weights

    def watch(what: str = weight_sync.SEND_MERGED) -> Any:
        sent.append(what)
        return current(what)

    d._current_weights = watch  # type: ignore[method-assign]
    rows = d.run()
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert set(sent) == {weight_sync.SEND_ADAPTER}
    # The engine sampled with the trainer's policy: its log-probs equal the rank's, before each update.
    assert all(r["rollout/logprob_diff"] < 1e-4 for r in rows)
    assert d.engines["dedicated-0"].version == 3

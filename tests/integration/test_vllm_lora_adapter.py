"""The adapter directory a vLLM engine serving LoRA (`rollout.engineLora`) registers with vLLM, checked
with real peft: written from exactly what a sync sends (`weight_sync.SEND_ADAPTER`) and the trainer's
LoRA settings, it loads with `PeftModel.from_pretrained` onto a fresh tiny base and computes the
trainer's logits; a wrong alpha, rank, names or target modules is caught. Also: an engine's adapter
versions (new lora_int_id each, the old directory deleted), and that the driver sends such an engine
only the adapter, never through vLLM's full-weight transfer.

NOT RUN here: vLLM itself (no GPU, no vLLM: `engines.vllm_engine` registers this directory with
`llm_engine.add_lora(LoRARequest(...))`; that call has not run).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from trainer_configs import toy_config

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from rljob_trainer import config, driver  # noqa: E402
from rljob_trainer.model import lora_adapter, modeling  # noqa: E402
from rljob_trainer.rollout import pipeline  # noqa: E402
from rljob_trainer.weights import weight_sync  # noqa: E402

pytestmark = [pytest.mark.torch]

SEED = 1


def _cfg(lora: dict[str, Any], **rollout: Any) -> config.TrainerConfig:
    return toy_config(
        grpo={"seed": SEED},
        model={"finetune": "lora", "lora": lora},
        rollout={"kind": "vllm", "engineLora": True, "sharedEngines": 0, "dedicatedEngines": 1, **rollout},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
    )


def _trained_policy(cfg: config.TrainerConfig) -> torch.nn.Module:
    """The trainer's policy: its base, and an adapter far from its zero start (as after training)."""
    model = modeling.apply_finetune_mode(modeling.build_base_model(cfg.model, init_seed=SEED), cfg.model)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def _sent_adapter(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the driver's object-store sync hands the engine (trainer.engine_weights("adapter"))."""
    with weight_sync.engine_tensors(policy, weight_sync.SEND_ADAPTER) as tensors:
        return {n: t.detach().to("cpu").clone() for n, t in tensors}


IDS = torch.tensor([[3, 5, 11, 7, 2, 9], [4, 4, 11, 1, 6, 8]])


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _served_by_peft(directory: Path, cfg: config.TrainerConfig) -> torch.nn.Module:
    base = modeling.build_base_model(cfg.model, init_seed=SEED)  # the base the engine loads from its path
    return peft.PeftModel.from_pretrained(base, str(directory)).eval()


LORAS = [
    {"rank": 4, "alpha": 8.0, "targetModules": "all-linear"},
    {"rank": 2, "alpha": 16.0, "targetModules": ["q_proj", "v_proj", "down_proj"]},
]


@pytest.mark.parametrize("lora", LORAS, ids=["all-linear", "some-modules"])
def test_the_adapter_directory_loads_with_peft_and_computes_the_trainers_logits(
    lora: dict[str, Any], tmp_path: Path
) -> None:
    cfg = _cfg(lora)
    policy = _trained_policy(cfg)
    sent = _sent_adapter(policy)
    store = lora_adapter.AdapterStore("dedicated-0", root=tmp_path)  # its root lives as long as it does
    adapter = store.write(sent, cfg.model, 1)
    assert sorted(p.name for p in adapter.path.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]

    doc = json.loads((adapter.path / "adapter_config.json").read_text())
    assert (doc["peft_type"], doc["r"], doc["lora_alpha"]) == ("LORA", lora["rank"], lora["alpha"])
    want = (
        {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        if lora["targetModules"] == "all-linear"
        else set(lora["targetModules"])
    )
    assert set(doc["target_modules"]) == want

    served = _served_by_peft(adapter.path, cfg)
    loaded = peft.get_peft_model_state_dict(served)
    assert set(loaded) == set(sent)  # every sent tensor found its module under its PEFT name
    assert all(torch.equal(loaded[n], sent[n]) for n in sent)

    target = _logits(policy)
    with weight_sync.merged_lora_tensors(policy) as merged:  # what a merged full sync would serve
        plain = modeling.build_base_model(cfg.model, init_seed=SEED)
        plain.load_state_dict(dict(merged), strict=False)
    base_only = _logits(modeling.build_base_model(cfg.model, init_seed=SEED))
    assert not torch.allclose(base_only, target, atol=1e-3)  # the adapter matters here
    torch.testing.assert_close(_logits(served), target, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_logits(served), _logits(plain.eval()), atol=1e-5, rtol=1e-5)


def test_a_wrong_alpha_or_rank_in_the_written_config_is_seen(tmp_path: Path) -> None:
    cfg = _cfg(LORAS[0])
    policy = _trained_policy(cfg)
    sent = _sent_adapter(policy)
    store = lora_adapter.AdapterStore("e", root=tmp_path)
    wrong_alpha = cfg.model.model_copy(update={"lora": cfg.model.lora.model_copy(update={"alpha": 16.0})})
    served = _served_by_peft(store.write(sent, wrong_alpha, 1).path, cfg)
    assert not torch.allclose(_logits(served), _logits(policy), atol=1e-3)
    wrong_rank = cfg.model.model_copy(update={"lora": cfg.model.lora.model_copy(update={"rank": 8})})
    with pytest.raises(ValueError, match=r"not rank model\.lora\.rank 8"):
        store.write(sent, wrong_rank, 2)


def test_tensors_that_are_not_the_adapter_or_outside_the_target_modules_are_refused(tmp_path: Path) -> None:
    cfg = _cfg(LORAS[0])
    policy = _trained_policy(cfg)
    sent = _sent_adapter(policy)
    store = lora_adapter.AdapterStore("e", root=tmp_path)
    unprefixed = {n.removeprefix(lora_adapter.PEFT_PREFIX): t for n, t in sent.items()}
    with pytest.raises(ValueError, match="not a LoRA adapter tensor in PEFT's saved naming"):
        store.write(unprefixed, cfg.model, 1)
    with weight_sync.engine_tensors(policy, weight_sync.SEND_BASE_AND_ADAPTER) as tensors:
        base_and_adapter = dict(tensors)
    with pytest.raises(ValueError, match="only the adapter goes to a LoRA vLLM engine"):
        store.write(base_and_adapter, cfg.model, 1)
    narrow = cfg.model.model_copy(
        update={"lora": cfg.model.lora.model_copy(update={"target_modules": ["q_proj"]})}
    )
    with pytest.raises(ValueError, match=r"model.lora.targetModules \['q_proj'\] lacks"):
        store.write(sent, narrow, 1)
    assert list(store.root.iterdir()) == []  # nothing half-written was left behind


def test_each_adapter_version_gets_a_new_id_and_a_retired_one_is_deleted() -> None:
    cfg = _cfg(LORAS[0])
    sent = _sent_adapter(_trained_policy(cfg))
    store = lora_adapter.AdapterStore("dedicated-0")
    assert store.root.parent == lora_adapter.scratch_root()
    first, second = store.write(sent, cfg.model, 1), store.write(sent, cfg.model, 2)
    assert (first.lora_int_id, second.lora_int_id) == (1, 2) and first.name != second.name
    assert first.path != second.path and first.path.parent == store.root
    store.retire(first)
    assert not first.path.exists() and second.path.exists()
    store.close()
    assert not store.root.exists()


def test_the_driver_sends_a_vllm_lora_engine_only_the_adapter_never_full_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rljob_trainer.rollout import engine_sync

    cfg = _cfg(LORAS[0])
    d = driver.GRPODriver(cfg, driver.LocalRuntime(cfg))
    name = "dedicated-0"
    d.engines[name] = pipeline.EngineState(name, None, False, 0)
    d.weight_transfer[name] = d._transfer_choice(colocated=False)
    assert d.weight_transfer[name].path == weight_sync.PATH_VLLM_LORA
    assert engine_sync.what_to_send(d, name) == weight_sync.SEND_ADAPTER
    sent: list[tuple[list[str], str]] = []
    monkeypatch.setattr(
        engine_sync, "send_weights", lambda d, names, version, what: sent.append((list(names), what))
    )
    monkeypatch.setattr(
        engine_sync, "update_vllm_native", lambda *a: pytest.fail("full weights through vLLM's transfer API")
    )
    d._update_engine_weights([name])
    assert sent == [([name], weight_sync.SEND_ADAPTER)]

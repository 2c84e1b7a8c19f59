"""Which weight path each engine gets (`weight_sync.choose_weight_transfer`), for a vLLM that has or
lacks the weight-transfer API, modelled as plain data (`VLLMWeightTransferAPI`), not a mocked vLLM."""

from __future__ import annotations

import pytest

from rljob_trainer.weights import weight_sync as ws

# What `detect_vllm_weight_transfer` reports for the pinned releases (tests/conformance checks it on the
# packages): 0.33.0 (CUDA image), 0.23.0 with vllm-ascend (Ascend image); then older and unknown ones.
NEW = ws.VLLMWeightTransferAPI("0.33.0", frozenset({"nccl", "ipc"}), ws.GEN_TRAINER_ENGINES)
ASCEND = ws.VLLMWeightTransferAPI("0.23.0", frozenset({"nccl", "ipc"}), ws.GEN_STATIC_SENDER, "ascend")
NCCL_ONLY = ws.VLLMWeightTransferAPI("0.17.0", frozenset({"nccl"}), ws.GEN_STATIC_SENDER)
NO_API = ws.VLLMWeightTransferAPI("0.11.0")
UNKNOWN_SENDER = ws.VLLMWeightTransferAPI("0.40.0", frozenset({"nccl", "ipc"}), None)


def _choose(colocated: bool, vllm: ws.VLLMWeightTransferAPI | None, **kw: object) -> ws.WeightTransferChoice:
    args = {"engine_kind": "vllm", "weight_sync": "collective", "device_type": "cuda", "ray": True}
    args.update(kw)
    return ws.choose_weight_transfer(colocated=colocated, vllm=vllm, **args)  # type: ignore[arg-type]


def test_vllm_with_the_api_uses_nccl_for_dedicated_and_ipc_for_colocated_engines() -> None:
    dedicated, colocated = _choose(False, NEW), _choose(True, NEW)
    assert (dedicated.path, dedicated.backend) == (ws.PATH_VLLM_NATIVE, "nccl")
    assert (colocated.path, colocated.backend) == (ws.PATH_VLLM_NATIVE, "ipc")
    assert "0.33.0" in dedicated.reason and "dedicated" in dedicated.reason
    assert dedicated.generation == colocated.generation == ws.GEN_TRAINER_ENGINES
    assert not dedicated.fallback


def test_the_ascend_pin_gets_the_static_sender_on_its_platform() -> None:
    choice = _choose(False, ASCEND)
    assert (choice.path, choice.backend, choice.generation, choice.platform) == (
        ws.PATH_VLLM_NATIVE,
        "nccl",
        ws.GEN_STATIC_SENDER,
        "ascend",
    )


@pytest.mark.parametrize(
    ("vllm", "colocated", "reason"),
    [
        (None, False, "not installed"),
        (NO_API, False, "no WeightTransferConfig"),
        (NCCL_ONLY, True, "no 'ipc' backend"),
        (UNKNOWN_SENDER, False, "not one rljob speaks"),
    ],
)
def test_without_a_usable_api_vllm_engines_keep_the_collective_rpc_path(
    vllm: ws.VLLMWeightTransferAPI | None, colocated: bool, reason: str
) -> None:
    choice = _choose(colocated, vllm)
    assert choice.path == ws.PATH_COLLECTIVE_RPC and reason in choice.reason and choice.fallback


def test_an_nccl_only_vllm_still_gives_dedicated_engines_nccl() -> None:
    assert _choose(False, NCCL_ONLY).backend == "nccl"


def test_object_store_setting_and_local_mode_keep_vllm_on_collective_rpc() -> None:
    assert _choose(False, NEW, weight_sync="object-store").path == ws.PATH_COLLECTIVE_RPC
    assert _choose(True, NEW, ray=False).path == ws.PATH_COLLECTIVE_RPC


@pytest.mark.parametrize(("device", "backend"), [("cpu", "gloo"), ("cuda", "nccl"), ("npu", "hccl")])
def test_transformers_engines_use_our_group_on_ray_and_the_object_store_in_process(
    device: str, backend: str
) -> None:
    on_ray = _choose(False, NEW, engine_kind="transformers", device_type=device)
    assert (on_ray.path, on_ray.backend) == (ws.PATH_COLLECTIVE, backend)
    local = _choose(False, NEW, engine_kind="transformers", device_type=device, ray=False)
    assert local.path == ws.PATH_OBJECT_STORE


def test_detection_without_vllm_installed_is_none() -> None:
    pytest.importorskip("torch")
    try:
        import vllm
    except ImportError:
        vllm = None
    if getattr(vllm, "__version__", None) is None:  # not installed (or a namespace package)
        assert ws.detect_vllm_weight_transfer() is None
    else:  # a machine with vLLM: the probe reports its version and what it found
        api = ws.detect_vllm_weight_transfer()
        assert api is not None and api.backends <= {"nccl", "ipc"}


def _tiny_model(**over: object) -> dict[str, object]:
    from rljob_trainer.model import modeling

    return {
        "name": "m",
        "source": "tiny",
        "hfConfig": modeling.tiny_hf_config(32),
        "tokenizer": "builtin-digits",
        **over,
    }


@pytest.mark.parametrize(
    ("model", "rollout", "message"),
    [
        ({"finetune": "full"}, {"kind": "transformers"}, "rollout.engineLora needs model.finetune: lora"),
        # vLLM engines serving LoRA: level 2 would discard a base rljob cannot reload into LoRA layers
        ({"finetune": "lora"}, {"kind": "vllm", "sharedEngines": 1}, "needs rollout.sleepLevel 1"),
        (
            {"finetune": "lora", "lora": {"rank": 600}},
            {"kind": "vllm", "sharedEngines": 0, "dedicatedEngines": 1},
            "model.lora.rank 600 is above vLLM's largest max_lora_rank 512",
        ),
    ],
)
def test_engine_lora_the_engines_cannot_serve_is_refused_naming_the_field(
    model: dict[str, object], rollout: dict[str, object], message: str
) -> None:
    from rljob_trainer import config

    doc = {"model": _tiny_model(**model), "rollout": {"engineLora": True, **rollout}}
    with pytest.raises(ValueError, match=message):
        config.parse_config(doc)


@pytest.mark.parametrize(
    "rollout",
    [
        {"sharedEngines": 1, "sleepLevel": 1},  # level 1 keeps the base (offloaded, restored)
        {"sharedEngines": 1, "enableSleepMode": False},  # shared engines that never sleep
        {"sharedEngines": 0, "dedicatedEngines": 2},  # dedicated engines never sleep
    ],
)
def test_vllm_engines_may_serve_lora_when_their_base_is_never_discarded(rollout: dict[str, object]) -> None:
    from rljob_trainer import config

    cfg = config.parse_config(
        {"model": _tiny_model(finetune="lora"), "rollout": {"kind": "vllm", "engineLora": True, **rollout}}
    )
    assert cfg.rollout.engine_lora and cfg.rollout.kind == "vllm"


@pytest.mark.parametrize(("rank", "slot"), [(1, 1), (2, 8), (4, 8), (8, 8), (9, 16), (300, 320), (512, 512)])
def test_a_vllm_lora_engine_gets_the_smallest_max_lora_rank_vllm_accepts(rank: int, slot: int) -> None:
    from rljob_trainer import config
    from rljob_trainer.engines import vllm_engine

    cfg = config.parse_config(
        {
            "model": _tiny_model(finetune="lora", lora={"rank": rank}),
            "rollout": {"kind": "vllm", "engineLora": True, "sharedEngines": 0, "dedicatedEngines": 1},
        }
    )
    assert vllm_engine.lora_engine_args(cfg) == {"enable_lora": True, "max_lora_rank": slot, "max_loras": 1}
    assert slot in config.VLLM_MAX_LORA_RANKS
    assert (
        vllm_engine.lora_engine_args(
            cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"engine_lora": False})})
        )
        == {}
    )


@pytest.mark.parametrize("colocated", [False, True])
@pytest.mark.parametrize("vllm", [NEW, ASCEND, NCCL_ONLY, NO_API, UNKNOWN_SENDER, None])
def test_a_vllm_engine_serving_lora_takes_the_adapter_path_over_vllms_full_weight_transfer(
    colocated: bool, vllm: ws.VLLMWeightTransferAPI | None
) -> None:
    choice = _choose(colocated, vllm, engine_lora=True)
    assert (choice.path, choice.backend) == (ws.PATH_VLLM_LORA, "object-store")
    assert "engineLora" in choice.reason
    assert _choose(colocated, vllm).path != ws.PATH_VLLM_LORA  # without engineLora: full weights


def test_transformers_engines_serving_lora_keep_their_group_or_object_store() -> None:
    assert _choose(False, None, engine_kind="transformers", engine_lora=True).path == ws.PATH_COLLECTIVE
    assert (
        _choose(False, None, engine_kind="transformers", engine_lora=True, ray=False).path
        == ws.PATH_OBJECT_STORE
    )

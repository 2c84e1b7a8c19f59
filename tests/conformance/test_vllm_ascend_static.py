"""vllm-ascend 0.23.0.post1, checked statically: it has no wheel and its sdist builds only against the
CANN toolkit, so it is not installed here. scripts/test_vllm.sh extracts the sdist the Ascend lock
hash-pins under .venv-vllm-ascend/src/, and this reads its Python source (ast) for every class, method,
field and registry entry rljob's static sender (`weights.vllm_transfer`, platform "ascend") uses.
Runs in the ascend tier only."""

from __future__ import annotations

import ast

import pytest
from conftest import ROOT, TIER

from rljob_trainer.weights import vllm_transfer

SRC = ROOT / ".venv-vllm-ascend" / "src" / "vllm_ascend"
pytestmark = pytest.mark.skipif(TIER != "ascend", reason="the Ascend tier reads vllm-ascend's source")


def _module(relative: str) -> ast.Module:
    path = SRC / relative
    assert path.is_file(), f"vllm-ascend has no {relative}"
    return ast.parse(path.read_text())


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"vllm-ascend has no class {name}")


def _method_params(cls: ast.ClassDef, name: str) -> list[str]:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return [a.arg for a in node.args.args]
    raise AssertionError(f"{cls.name} has no method {name}")


def _fields(cls: ast.ClassDef) -> set[str]:
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_the_hccl_sender_takes_what_rljob_passes() -> None:
    tree = _module("distributed/weight_transfer/hccl_engine.py")
    engine = _class(tree, "HCCLWeightTransferEngine")
    assert _method_params(engine, "trainer_init") == ["init_info"]  # a staticmethod
    assert _method_params(engine, "trainer_send_weights") == ["iterator", "trainer_args"]
    assert {"group", "packed"} <= _fields(_class(tree, "HCCLTrainerSendWeightsArgs"))
    init = _fields(_class(tree, "HCCLWeightTransferInitInfo"))
    assert set(vllm_transfer.static_nccl_engine_init_info("h", 1, 2)) == init
    update = _fields(_class(tree, "HCCLWeightTransferUpdateInfo"))
    assert {"names", "dtype_names", "shapes", "packed"} <= update


def test_the_npu_ipc_sender_takes_what_rljob_passes() -> None:
    tree = _module("distributed/weight_transfer/npu_ipc_engine.py")
    engine = _class(tree, "NPUIPCWeightTransferEngine")
    assert _method_params(engine, "trainer_send_weights") == ["iterator", "trainer_args"]
    args = _class(
        tree, "NPUIPCTrainerSendWeightsArgs"
    )  # IPCTrainerSendWeightsArgs' fields, send_mode widened
    assert [b.id for b in args.bases if isinstance(b, ast.Name)] == ["IPCTrainerSendWeightsArgs"]
    assert "send_mode" in _fields(args)
    # All ranks call it; rank 0 (the global rank) ships: as IPCSession.send calls it on every rank.
    source = (SRC / "distributed/weight_transfer/npu_ipc_engine.py").read_text()
    assert "all_gather_object" in source and "get_rank() == 0" in source


def test_vllm_ascend_serves_nccl_and_ipc_with_its_own_engines() -> None:
    """rljob's engines ask for WeightTransferConfig(backend="nccl"/"ipc"); vllm-ascend swaps the
    factory's entries for its HCCL and NPU-IPC engines, so the same backends work on NPUs."""
    patch = (SRC / "patch/platform/patch_weight_transfer_engine.py").read_text()
    assert "HCCLWeightTransferEngine" in patch and "NPUIPCWeightTransferEngine" in patch
    assert '"nccl"' in patch and '"ipc"' in patch
    worker = _class(_module("worker/worker.py"), "NPUWorker")
    assert _method_params(worker, "sleep") == ["self", "level"]
    assert _method_params(worker, "wake_up") == ["self", "tags"]

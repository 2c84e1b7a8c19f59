"""Integration tests for rljob_trainer.weights.weight_sync: real processes, real gloo groups over TCP.

The trainer side runs in the test process (as trainer rank 0 would); each engine worker is its own
process (`weight_sync_engine.py`) holding a transformers model with a different random init, so
equal weights after a sync can only come from the broadcast.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rljob_trainer.weights import weight_sync  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

ENGINE = Path(__file__).with_name("weight_sync_engine.py")
FSDP_TRAINER = Path(__file__).with_name("weight_sync_fsdp_trainer.py")
REPO = Path(__file__).resolve().parents[2]
# Small buckets so one sync is many broadcasts (the bucket seams are where bugs hide).
BUCKET_BYTES = 8 * 1024


def build_trainer_model(lora: bool = False) -> torch.nn.Module:
    sys.path.insert(0, str(ENGINE.parent))
    try:
        import weight_sync_engine
    finally:
        sys.path.pop(0)
    return weight_sync_engine.build_model(seed=1, lora=lora)


def child_env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "trainer_image"), str(ENGINE.parent)]),
        **extra,
    }


class Engine:
    """One engine worker process and its end of the conversation."""

    def __init__(self, name: str, out: Path, *, lora: bool = False) -> None:
        self.name = name
        self.out = out / name
        self.out.mkdir()
        self.store = weight_sync.create_group_store("127.0.0.1", 2, timeout_s=60)
        self.address = weight_sync.GroupAddress(name, "127.0.0.1", self.store.port, 2, "gloo", timeout_s=60)
        args = {"address": self.address.__dict__, "rank": 1, "seed": 100 + len(name), "lora": lora}
        args["out"] = str(self.out)
        env = child_env()
        self.proc = subprocess.Popen(
            [sys.executable, str(ENGINE), json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.reply() == {"ready": True}

    def reply(self) -> dict[str, Any]:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise RuntimeError(f"engine {self.name} exited with {self.proc.wait()}")
        return json.loads(line)

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def join(self) -> weight_sync.WeightGroup:
        """Open the group on both sides at once (each blocks until the other has joined)."""
        self.send("join")
        group = weight_sync.open_group(self.address, 0, store=self.store)
        assert self.reply() == {"joined": True}
        return group

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        return torch.load(self.out / f"v{version}.pt")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send("exit")
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[dict[str, Any]]:
    made: dict[str, Engine] = {}

    def start(name: str, *, lora: bool = False) -> Engine:
        made[name] = Engine(name, tmp_path, lora=lora)
        return made[name]

    yield {"start": start}
    for engine in made.values():
        engine.close()


def sync(
    groups: dict[str, weight_sync.WeightGroup],
    receivers: list[Engine],
    tensors: list[tuple[str, torch.Tensor]],
    version: int,
) -> weight_sync.SendReport:
    """One sync point: the engines receive while the trainer sends (as the driver will do)."""
    for engine in receivers:
        engine.send("receive")
    report = weight_sync.send_weights(groups, tensors, version=version, bucket_bytes=BUCKET_BYTES)
    for engine in receivers:
        assert engine.reply()["version"] == version
    return report


def perturb(model: torch.nn.Module, scale: float) -> None:
    """Stand-in for an optimizer step: every trainable weight changes."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn_like(p))


def assert_equal_state(engine_state: dict[str, torch.Tensor], trainer_state: dict[str, torch.Tensor]) -> None:
    assert engine_state.keys() == trainer_state.keys()
    for name, value in trainer_state.items():
        assert torch.equal(engine_state[name], value), name


def test_engine_weights_equal_the_trainers_after_each_sync(engines: dict[str, Any]) -> None:
    model = build_trainer_model()
    engine = engines["start"]("engine-a")
    groups = {engine.name: engine.join()}
    tensors = weight_sync.model_tensors(model)
    # The tied lm_head is sent once; the receiver's alias still ends up equal.
    assert "lm_head.weight" not in dict(tensors)

    report = sync(groups, [engine], tensors, version=1)
    assert report.failed == {}
    assert report.buckets > 10
    assert report.nbytes >= sum(t.numel() * t.element_size() for _, t in tensors)
    assert_equal_state(engine.weights(1), model.state_dict())

    perturb(model, 0.1)
    sync(groups, [engine], tensors, version=2)
    after = engine.weights(2)
    assert_equal_state(after, model.state_dict())
    assert torch.equal(after["lm_head.weight"], after["model.embed_tokens.weight"])

    # An engine serving bf16: the trainer's fp32 weights travel cast, half the bytes.
    perturb(model, 0.1)
    engine.send("receive")
    bf16 = weight_sync.send_weights(
        groups, tensors, version=3, dtype=torch.bfloat16, bucket_bytes=BUCKET_BYTES
    )
    assert engine.reply()["version"] == 3
    assert bf16.nbytes < report.nbytes * 0.6
    cast = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in model.state_dict().items()}
    assert_equal_state(engine.weights(3), cast)


def test_fsdp2_trainer_ranks_stream_sharded_weights_to_the_engine(
    engines: dict[str, Any], tmp_path: Path
) -> None:
    # Two FSDP2 ranks on CPU: every parameter is a DTensor shard; rank 0 broadcasts each bucket
    # after both ranks gathered it with full_tensor().
    engine = engines["start"]("engine-fsdp")
    engine.send("join")
    engine.send("receive")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master_port = s.getsockname()[1]
    args = json.dumps({"address": engine.address.__dict__, "version": 1, "out": str(tmp_path)})
    ranks = [
        subprocess.Popen(
            [sys.executable, str(FSDP_TRAINER), args],
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(
                RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port)
            ),
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=600)[0] for proc in ranks]
    assert [proc.returncode for proc in ranks] == [0, 0]
    report = json.loads(outputs[0].strip().splitlines()[-1])
    assert report["failed"] == {}
    assert report["sharded"] == report["tensors"] > 0
    assert engine.reply() == {"joined": True}
    assert engine.reply()["version"] == 1
    assert_equal_state(engine.weights(1), torch.load(tmp_path / "expected.pt"))


def test_dropping_and_adding_engines_leaves_the_other_groups_working(engines: dict[str, Any]) -> None:
    model = build_trainer_model()
    tensors = weight_sync.model_tensors(model)
    a, b = engines["start"]("engine-a"), engines["start"]("engine-b")
    groups = {a.name: a.join(), b.name: b.join()}
    assert sync(groups, [a, b], tensors, version=1).failed == {}

    # Engine b is lost (its pod deleted); the next sync drops its group and a still gets the weights.
    b.kill()
    perturb(model, 0.1)
    report = sync(groups, [a], tensors, version=2)
    assert set(report.failed) == {"engine-b"}
    groups.pop("engine-b")
    assert_equal_state(a.weights(2), model.state_dict())

    # A new engine joins on its own store and group; a's group is the same object as before.
    c = engines["start"]("engine-c")
    group_a = groups["engine-a"]
    groups[c.name] = c.join()
    perturb(model, 0.1)
    assert sync(groups, [a, c], tensors, version=3).failed == {}
    assert groups["engine-a"] is group_a
    assert_equal_state(a.weights(3), model.state_dict())
    assert_equal_state(c.weights(3), model.state_dict())

    # Dropping a healthy engine on purpose (scale-down) closes only its group.
    groups.pop(c.name).close()
    perturb(model, 0.1)
    assert sync(groups, [a], tensors, version=4).failed == {}
    assert_equal_state(a.weights(4), model.state_dict())


def test_lora_sync_sends_only_the_adapter(engines: dict[str, Any]) -> None:
    from peft import get_peft_model_state_dict

    model = build_trainer_model(lora=True)
    perturb(model, 0.05)  # LoRA B starts at zero; make every adapter tensor non-trivial
    engine = engines["start"]("engine-lora", lora=True)
    groups = {engine.name: engine.join()}
    tensors = weight_sync.lora_adapter_tensors(model)
    report = sync(groups, [engine], tensors, version=1)

    adapter = get_peft_model_state_dict(model)
    assert_equal_state(engine.weights(1), adapter)
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    model_bytes = sum(t.numel() * t.element_size() for _, t in weight_sync.model_tensors(model))
    assert adapter_bytes <= report.nbytes < adapter_bytes + 16 * len(adapter) + 1
    assert report.nbytes < model_bytes / 10


def test_a_group_that_never_forms_times_out() -> None:
    store = weight_sync.create_group_store("127.0.0.1", 2, timeout_s=5)
    address = weight_sync.GroupAddress("engine-missing", "127.0.0.1", store.port, 2, "gloo", timeout_s=2)
    outcome: dict[str, BaseException] = {}

    def join() -> None:
        try:
            weight_sync.open_group(address, 0, store=store)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "open_group ignored its timeout"
    assert "error" in outcome

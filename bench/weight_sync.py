"""Weight-sync benchmark: Ray's object store vs a gloo collective, side by side on CPU.

Role: measures what `rljob_trainer.weights.weight_sync` buys over the old path. The bench process plays
trainer rank 0 and holds a Qwen2-layout model of at least 100M parameters built from a config
(random weights, nothing downloaded); one real Ray actor plays a rollout engine holding the same
architecture with another random init. Per sync, alternating the two paths in one run:
- object store: `weight_sync.send_weights_via_object_store` (one whole-model CPU dict put once,
  the actor deserialises it and copies it into its model in place, as the CPU engine does);
- collective: `weight_sync.send_weights` over a gloo group between the two processes, bucketed;
  the actor receives each bucket into its model in place (`weight_sync.module_loader`).
Reported per path (median over repeats): sync time (s), and peak extra host memory of the trainer
process and of the engine process (peak RSS during the sync minus RSS before it, from
/proc/self/status VmHWM after resetting it through /proc/self/clear_refs; Ray's shared-memory
object store pages count in the process that touches them). After every sync the engine's weights
are checked equal to the trainer's.

With `--lora` it also wraps the trainer's model in a LoRA adapter (rank 16 on every linear layer)
and measures, over the same gloo transport, a full sync of the merged model against an adapter-only
sync into a second engine that serves the same adapter itself (`rollout.engineLora`): sync time and
bytes on the wire, printed on a `lora:` line before the last line.

Run: `.venv/bin/python bench/weight_sync.py [--quick] [--json] [--bucket-mib 64] [--lora]`. The last line is
`weight_sync: object store X s +A MiB, collective Y s +B MiB, speedup R, memory ratio M`.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch
import transformers

from rljob_trainer.weights import weight_sync

MIB = 1024 * 1024


def model_config() -> transformers.Qwen2Config:
    """~107M parameters (Qwen2 layout, tied embeddings); --quick keeps the size, only repeats fewer."""
    return transformers.Qwen2Config(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2304,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )


def build_model(config: transformers.Qwen2Config, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.device("cpu"):
        return transformers.Qwen2ForCausalLM(config).eval()


def reset_peak() -> int:
    """Reset this process's peak RSS to its current RSS; returns the current RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def peak_since(baseline: int) -> int:
    """Peak RSS above `baseline` (bytes) since the last `reset_peak`."""
    return max(0, _status_kib("VmHWM") * 1024 - baseline)


def _status_kib(key: str) -> int:
    match = re.search(rf"^{key}:\s+(\d+)", Path("/proc/self/status").read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {key}; this bench needs Linux")
    return int(match.group(1))


def checksum(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return float(sum(t.double().sum() + t.double().abs().sum() for t in model.state_dict().values()))


class GroupReceiver:
    """What both bench engines share: a model loaded in place from a weight group it joins."""

    def __init__(self, model: torch.nn.Module, load: Any) -> None:
        self.model = model
        self.load = load
        self.group: weight_sync.WeightGroup | None = None

    def join(self, address: weight_sync.GroupAddress) -> None:
        self.group = weight_sync.open_group(address, 1)

    def receive(self) -> int:
        assert self.group is not None
        return weight_sync.receive_weights(self.group, self.load).version


@ray.remote
class BenchLoraEngine(GroupReceiver):
    """An engine serving the LoRA adapter itself: the same base, the adapter loaded in place."""

    def __init__(self, config: transformers.Qwen2Config) -> None:
        model = lora_wrap(build_model(config, seed=1))
        super().__init__(model, weight_sync.peft_adapter_loader(model))

    def adapter_checksum(self) -> float:
        from peft import get_peft_model_state_dict

        return float(sum(t.double().abs().sum() for t in get_peft_model_state_dict(self.model).values()))


def lora_wrap(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(7)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))


def run_lora(
    trainer: torch.nn.Module,
    config: transformers.Qwen2Config,
    engine: Any,
    groups: dict[str, Any],
    bucket_mib: int,
    repeats: int,
) -> dict[str, Any]:
    """Full merged sync into the plain engine vs adapter-only into an engine serving the adapter."""
    from peft import get_peft_model_state_dict

    policy = lora_wrap(trainer)
    with torch.no_grad():  # an adapter far from its zero start, as after training
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.02)
    lora_engine = BenchLoraEngine.remote(config)
    store = weight_sync.create_group_store("127.0.0.1", 2)
    address = weight_sync.GroupAddress("bench-lora-engine", "127.0.0.1", store.port, 2, "gloo")
    joined = lora_engine.join.remote(address)
    lora_groups = {address.name: weight_sync.open_group(address, 0, store=store)}
    ray.get(joined)
    out: dict[str, dict[str, list[float]]] = {
        "full_merged": {"sync_s": [], "bytes": []},
        "adapter_only": {"sync_s": [], "bytes": []},
    }
    for version in range(100, 100 + repeats):
        started = time.perf_counter()
        received = engine.receive.remote()
        with weight_sync.merged_lora_tensors(policy) as merged:
            report = weight_sync.send_weights(groups, merged, version=version, bucket_bytes=bucket_mib * MIB)
        ray.get(received)
        out["full_merged"]["sync_s"].append(time.perf_counter() - started)
        out["full_merged"]["bytes"].append(report.nbytes)
        started = time.perf_counter()
        received = lora_engine.receive.remote()
        report = weight_sync.send_weights(
            lora_groups,
            weight_sync.lora_adapter_tensors(policy),
            version=version,
            bucket_bytes=bucket_mib * MIB,
        )
        ray.get(received)
        out["adapter_only"]["sync_s"].append(time.perf_counter() - started)
        out["adapter_only"]["bytes"].append(report.nbytes)
        want = float(sum(t.double().abs().sum() for t in get_peft_model_state_dict(policy).values()))
        if abs(ray.get(lora_engine.adapter_checksum.remote()) - want) > 1e-6 * want:
            raise RuntimeError("adapter-only: the engine's adapter differs from the trainer's")
    return {name: {k: statistics.median(v) for k, v in per.items()} for name, per in out.items()}


@ray.remote
class BenchEngine(GroupReceiver):
    """A rollout-engine stand-in: a model updated in place by either path; measures its own memory."""

    def __init__(self, config: transformers.Qwen2Config) -> None:
        model = build_model(config, seed=2)
        super().__init__(model, weight_sync.module_loader(model))
        self.baseline = 0

    def reset_peak(self) -> None:
        self.baseline = reset_peak()

    def peak_extra(self) -> int:
        return peak_since(self.baseline)

    def update_weights(self, named: dict[str, torch.Tensor]) -> int:
        # The object-store path: the argument arrives as a whole deserialised dict.
        self.load(list(named.items()))
        return len(named)

    def checksum(self) -> float:
        return checksum(self.model)


def perturb(model: torch.nn.Module, step: int) -> None:
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1000 + step)
        for p in model.parameters():
            p.add_(1e-3 * torch.randn_like(p))


def run(quick: bool, bucket_mib: int, lora: bool = False) -> dict[str, Any]:
    config = model_config()
    trainer = build_model(config, seed=1)
    params = sum(p.numel() for p in trainer.parameters())
    tensors = weight_sync.model_tensors(trainer)
    model_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
    # address="local": always a private Ray instance, never another process's cluster on this machine.
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=2 * 1024**3,
    )
    try:
        engine = BenchEngine.remote(config)
        store = weight_sync.create_group_store("127.0.0.1", 2)
        address = weight_sync.GroupAddress("bench-engine", "127.0.0.1", store.port, 2, "gloo")
        joined = engine.join.remote(address)
        groups = {address.name: weight_sync.open_group(address, 0, store=store)}
        ray.get(joined)

        def object_store(version: int) -> None:
            weight_sync.send_weights_via_object_store(tensors, [engine])

        def collective(version: int) -> None:
            received = engine.receive.remote()
            report = weight_sync.send_weights(groups, tensors, version=version, bucket_bytes=bucket_mib * MIB)
            if report.failed or ray.get(received) != version:
                raise RuntimeError(f"collective sync {version} failed: {report.failed}")

        paths = {"object_store": object_store, "collective": collective}
        results: dict[str, dict[str, list[float]]] = {
            name: {"sync_s": [], "trainer_extra_bytes": [], "engine_extra_bytes": []} for name in paths
        }
        repeats = 1 if quick else 3
        version = 0
        for _ in range(repeats):
            for name, path in paths.items():
                version += 1
                perturb(trainer, version)
                ray.get(engine.reset_peak.remote())
                baseline = reset_peak()
                started = time.perf_counter()
                path(version)
                elapsed = time.perf_counter() - started
                results[name]["sync_s"].append(elapsed)
                results[name]["trainer_extra_bytes"].append(peak_since(baseline))
                results[name]["engine_extra_bytes"].append(ray.get(engine.peak_extra.remote()))
                if not abs(ray.get(engine.checksum.remote()) - checksum(trainer)) <= 1e-6 * checksum(trainer):
                    raise RuntimeError(
                        f"{name}: the engine's weights differ from the trainer's after the sync"
                    )
        lora_summary = run_lora(trainer, config, engine, groups, bucket_mib, repeats) if lora else None
    finally:
        ray.shutdown()
    summary = {
        name: {key: statistics.median(values) for key, values in per.items()} for name, per in results.items()
    }
    return {
        "parameters": params,
        "model_bytes": model_bytes,
        "bucket_bytes": bucket_mib * MIB,
        "repeats": repeats,
        "paths": summary,
        "raw": results,
        "lora": lora_summary,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="one sync per path instead of three")
    parser.add_argument("--json", action="store_true", help="print one JSON object before the last line")
    parser.add_argument("--bucket-mib", type=int, default=64, help="collective bucket size in MiB")
    parser.add_argument("--lora", action="store_true", help="also: full merged vs adapter-only sync")
    args = parser.parse_args(argv)
    out = run(args.quick, args.bucket_mib, args.lora)
    store, coll = out["paths"]["object_store"], out["paths"]["collective"]
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"model: {out['parameters'] / 1e6:.1f}M parameters, {out['model_bytes'] / MIB:.0f} MiB fp32; "
            f"bucket {args.bucket_mib} MiB; {out['repeats']} sync(s) per path"
        )
        print(f"{'path':<14}{'sync s':>9}{'trainer +MiB':>14}{'engine +MiB':>13}{'total +MiB':>12}")
        for name, row in out["paths"].items():
            total = row["trainer_extra_bytes"] + row["engine_extra_bytes"]
            print(
                f"{name:<14}{row['sync_s']:>9.2f}{row['trainer_extra_bytes'] / MIB:>14.0f}"
                f"{row['engine_extra_bytes'] / MIB:>13.0f}{total / MIB:>12.0f}"
            )
    if out["lora"]:
        full, adapter = out["lora"]["full_merged"], out["lora"]["adapter_only"]
        print(
            f"lora: full merged {full['sync_s']:.2f} s {full['bytes'] / MIB:.0f} MiB, adapter only "
            f"{adapter['sync_s']:.3f} s {adapter['bytes'] / MIB:.1f} MiB, bytes ratio "
            f"{full['bytes'] / adapter['bytes']:.1f}, speedup {full['sync_s'] / adapter['sync_s']:.1f}"
        )
    store_mib = (store["trainer_extra_bytes"] + store["engine_extra_bytes"]) / MIB
    coll_mib = (coll["trainer_extra_bytes"] + coll["engine_extra_bytes"]) / MIB
    print(
        f"weight_sync: object store {store['sync_s']:.2f} s +{store_mib:.0f} MiB, "
        f"collective {coll['sync_s']:.2f} s +{coll_mib:.0f} MiB, "
        f"speedup {store['sync_s'] / coll['sync_s']:.2f}, memory ratio {store_mib / max(coll_mib, 1.0):.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

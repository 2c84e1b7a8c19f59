"""A trainer rank for the weight-sync tests: FSDP2 (`fully_shard`) on CPU over gloo, streaming its
sharded model to an engine's group with `weight_sync.send_weights` (rank 0 sends, every rank gathers).

Run as `python weight_sync_fsdp_trainer.py '<json args>'` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set. Args: address (the engine group's GroupAddress fields; its store is served by the
test), version, out (rank 0 saves the full weights it expects the engine to hold, before sharding).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import weight_sync_engine  # next to this file; the test puts this folder on PYTHONPATH
from torch.distributed.fsdp import fully_shard

from rljob_trainer.weights import weight_sync


def main() -> None:
    args = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = weight_sync_engine.build_model(seed=1, lora=False)
    with torch.no_grad():
        torch.manual_seed(7)  # the same "training" on every rank, so the full model is well defined
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, Path(args["out"]) / "expected.pt")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    tensors = weight_sync.model_tensors(model)
    sharded = sum(1 for _, t in tensors if hasattr(t, "full_tensor"))
    groups = {}
    if rank == 0:
        address = weight_sync.GroupAddress(**args["address"])
        groups[address.name] = weight_sync.open_group(address, 0)
    report = weight_sync.send_weights(groups, tensors, version=int(args["version"]), bucket_bytes=8 * 1024)
    if rank == 0:
        print(
            json.dumps({"sharded": sharded, "tensors": report.tensors, "failed": report.failed}), flush=True
        )
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()

"""Mixed precision as a GPU run does it: fp32 master weights and optimizer state, compute in the job's
dtype (`model.dtype`, bf16 by default), gradients accumulated and reduced in fp32.

Role: the one home of the trainer's precision rules. On accelerators FSDP2 does it
(`fsdp_policy`: `MixedPrecisionPolicy(param_dtype=<dtype>, reduce_dtype=float32)` over fp32 sharded
parameters, as verl's and torchtitan's FSDP2 workers keep them). On CPU (one rank, or DDP-free gloo
ranks) `CpuMixedPrecision` does the same split by hand: the trainable parameters of the module the
optimizer sees are fp32 masters, and forward/backward run on a compute copy whose trainable
parameters are cast to the job's dtype (frozen ones, the LoRA base, are shared, never copied); after
each micro-batch its gradients are added into the masters' fp32 `.grad`, after the last one they are
all-reduced in fp32, and after the optimizer step the masters are cast back into the compute copy.

Why: a bf16 parameter updated in place loses every update smaller than half a bf16 ulp of the
weight; at the learning rates GRPO uses for full fine-tuning (1e-6 to 1e-5) that is most of them
(measured on the tiny job: 15 % of the bf16 weights moved in 30 steps at lr 1e-5 without masters,
tests/integration/test_trainer_precision.py). LoRA: the frozen base stays in the job's dtype and the
adapters are fp32 masters, computed in the job's dtype (as FSDP2's param_dtype casts them).

fp16 is refused by the config (`config.ModelSettings`): fp16 compute needs loss scaling, which rljob
does not do. Callers: `rljob_trainer.train.trainer`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def compute_dtype(name: str) -> torch.dtype:
    """The torch dtype of `model.dtype`."""
    return DTYPES[name]


def upcast_trainable_(model: torch.nn.Module) -> None:
    """Trainable parameters to fp32 in place (the masters); frozen ones and buffers keep their dtype."""
    for p in model.parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()


def cast_params_(model: torch.nn.Module, dtype: torch.dtype, *, trainable_only: bool = False) -> None:
    """Floating parameters to `dtype` in place (buffers such as rotary frequencies keep theirs, as when
    the model is built in `dtype`)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype and (p.requires_grad or not trainable_only):
            p.data = p.data.to(dtype)


def fsdp_policy(dtype: torch.dtype) -> Any:
    """FSDP2's policy: unsharded parameters (and so the compute) in `dtype`, gradients reduced and
    accumulated (also under `set_requires_gradient_sync(False)`) in fp32, over fp32 sharded masters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


class CpuMixedPrecision:
    """fp32 masters (`master`, the module the optimizer, checkpoints and the reference see) and the
    compute copy (`compute`, what forward and backward run on). With `dtype` float32 both are the same
    module and every method is a no-op but the fp32 all-reduce."""

    def __init__(self, master: torch.nn.Module, dtype: torch.dtype, *, world_size: int) -> None:
        self.master = master
        self.dtype = dtype
        self.world_size = world_size
        trainable = [(n, p) for n, p in master.named_parameters() if p.requires_grad]
        if any(p.dtype != torch.float32 for _, p in trainable):
            raise ValueError("CpuMixedPrecision needs fp32 trainable parameters (upcast_trainable_ first)")
        if dtype == torch.float32:
            self.compute = master
        else:
            # Share what is not trained (the LoRA base, buffers): only trainable tensors are copied.
            memo: dict[int, Any] = {id(p): p for p in master.parameters() if not p.requires_grad}
            memo.update({id(b): b for b in master.buffers()})
            self.compute = copy.deepcopy(master, memo)
            cast_params_(self.compute, dtype, trainable_only=True)
        compute_params = dict(self.compute.named_parameters())
        self._pairs = [(p, compute_params[n]) for n, p in trainable]

    @property
    def separate(self) -> bool:
        return self.compute is not self.master

    def masters(self) -> list[torch.nn.Parameter]:
        return [m for m, _ in self._pairs]

    def accumulate_grads(self) -> None:
        """After a micro-batch's backward: its compute-dtype gradients into the fp32 master gradients."""
        if not self.separate:
            return
        for master, comp in self._pairs:
            if comp.grad is None:
                continue
            g = comp.grad.float()
            master.grad = g if master.grad is None else master.grad.add_(g)
            comp.grad = None

    def all_reduce_grads(self) -> None:
        """Sum the fp32 master gradients over the ranks (one flat buffer; every rank calls)."""
        if self.world_size == 1:
            return
        grads = [m.grad if m.grad is not None else torch.zeros_like(m) for m, _ in self._pairs]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for (master, _), g in zip(self._pairs, grads, strict=True):
            master.grad = flat[offset : offset + g.numel()].view_as(g)
            offset += g.numel()

    def zero_grad(self) -> None:
        for master, comp in self._pairs:
            master.grad = None
            comp.grad = None

    @torch.no_grad()
    def publish(self) -> None:
        """After the optimizer step: the masters, rounded to the compute dtype, into the compute copy."""
        if self.separate:
            for master, comp in self._pairs:
                comp.copy_(master)

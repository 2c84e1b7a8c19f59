"""A training rank: one torch.distributed process that runs GRPO updates on its share of a step.

Role: holds the policy (LoRA via peft or full fine-tuning), its optimizer and, when a KL penalty is
on, the reference (the base with adapters disabled under LoRA, a frozen copy under full FT). Per
step it gets its DP-balanced shard of every mini-batch from the driver, computes old (and
reference) log-probs of the whole step in a forward-only pass before any update, then runs
micro-batches planned by `rljob_trainer.microbatch` (the planner the DP-balance simulation uses),
packed through `rljob_trainer.packing` (`use_cache=False`) or padded, and steps the optimizer
after clipping the gradient norm. Callers: `rljob_trainer.driver` (as a Ray actor, or in-process
in local mode), tests.

Parallelism: gloo + DDP on CPU, NCCL (CUDA) or HCCL (Ascend) + FSDP2 `fully_shard` on
accelerators. Every rank runs the same number of micro-batches per mini-batch (all-reduce MAX of
the planner's count, padded with zero-weight micro-batches), which DDP and FSDP collectives need.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rljob_trainer import algos, export, microbatch, modeling, packing
from rljob_trainer import config as config_mod


@dataclass(frozen=True)
class TrainSample:
    """One rollout as the trainer sees it: prompt + response token ids and the GRPO advantage.

    `rollout_logprobs` are the engine's log-probs of `response_ids` (what it sampled with; empty when
    unknown) and `weights_version` the trainer step whose weights generated it. `side` holds
    per-token arrays aligned with prompt+response (e.g. `mm_token_type_ids`); they are packed with
    the ids and passed to the model.
    """

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    advantage: float
    side: dict[str, Any] = field(default_factory=dict)
    rollout_logprobs: tuple[float, ...] = ()
    weights_version: int = 0

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def sample_from_output(out: Any, advantage: float, *, eos_id: int) -> TrainSample:
    """A `TrainSample` from an engine's `GenerationOutput` (an empty response trains on one EOS)."""
    response = tuple(out.token_ids)
    logprobs = tuple(out.logprobs) if response and len(out.logprobs) == len(response) else ()
    return TrainSample(
        tuple(out.prompt_token_ids),
        response or (eos_id,),
        advantage,
        rollout_logprobs=logprobs,
        weights_version=int(out.meta.get("version", 0)),
    )


@dataclass(frozen=True)
class RankMiniBatch:
    """This rank's share of one mini-batch plus the global counts the loss is normalised by."""

    samples: tuple[TrainSample, ...]
    global_num_seqs: int
    global_num_response_tokens: int


def micro_batch_spec(batching: config_mod.BatchingSettings) -> microbatch.MicroBatchSpec:
    """The planner spec the config asks for (same object the DP-balance simulation gets)."""
    if batching.dynamic:
        return microbatch.MicroBatchSpec(
            packed=batching.packed,
            dynamic=True,
            max_tokens_per_micro_batch=batching.max_tokens_per_micro_batch,
        )
    return microbatch.MicroBatchSpec(
        packed=batching.packed, dynamic=False, micro_batch_size=batching.micro_batch_size
    )


def resolve_device_and_backend(dist_cfg: config_mod.DistributedSettings) -> tuple[str, str]:
    """(device kind, torch.distributed backend): auto picks cuda+nccl, npu+hccl, else cpu+gloo."""
    device = dist_cfg.device
    if device == "auto":
        if torch.cuda.is_available():
            device = "cuda"
        elif hasattr(torch, "npu") and torch.npu.is_available():  # torch_npu registers torch.npu
            device = "npu"
        else:
            device = "cpu"
    backend = dist_cfg.backend
    if backend == "auto":
        backend = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}[device]
    return device, backend


def padded_token_log_probs(
    model: torch.nn.Module, sequences: Sequence[Sequence[int]], *, pad_id: int, temperature: float
) -> list[torch.Tensor]:
    """Per-sample next-token log-probs [L_i − 1] from one right-padded [B, L_max] forward."""
    device = next(model.parameters()).device
    lengths = [len(s) for s in sequences]
    width = max(lengths)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        attn[i, : len(s)] = 1
    ids, attn = ids.to(device), attn.to(device)
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits.float() / temperature
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return [lp[i, : n - 1] for i, n in enumerate(lengths)]


class TrainingRank:
    """One data-parallel rank. Construct, then `setup(master_addr, master_port)` on every rank."""

    def __init__(self, cfg: config_mod.TrainerConfig, rank: int, world_size: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.device_kind, self.backend = resolve_device_and_backend(cfg.distributed)
        self.model: torch.nn.Module | None = None
        self._wrapped: torch.nn.Module | None = None
        self._ref_model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._spec = micro_batch_spec(cfg.batching)
        self._pad_id = 0

    # ---- setup -----------------------------------------------------------------------------------
    @staticmethod
    def node_address() -> tuple[str, int]:
        """This process's reachable IP and a free TCP port (rank 0's become MASTER_ADDR/PORT)."""
        import socket

        try:
            import ray

            ip = ray.util.get_node_ip_address()
        except Exception:  # not inside Ray: local mode
            ip = "127.0.0.1"
        with socket.socket() as s:
            s.bind(("", 0))
            return ip, int(s.getsockname()[1])

    @property
    def device(self) -> torch.device:
        if self.device_kind == "cpu":
            return torch.device("cpu")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device(f"{self.device_kind}:{local}")

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        threads = self.cfg.distributed.torch_threads_per_rank
        if threads:
            torch.set_num_threads(threads)
        # Accelerators always run FSDP2, so they always need a process group (world size 1 too).
        needs_group = self.world_size > 1 or self.device_kind != "cpu"
        if needs_group and not dist.is_initialized():
            dist.init_process_group(
                backend=self.backend,
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=datetime.timedelta(minutes=10),
            )
        if self.device_kind == "cuda":
            torch.cuda.set_device(self.device)
        # Same seed on every rank: identical initial weights (tiny) and LoRA initialisation.
        torch.manual_seed(self.cfg.grpo.seed)
        tok = modeling.load_tokenizer(self.cfg.model)
        self._pad_id = int(tok.pad_token_id)
        base = modeling.build_base_model(self.cfg.model, init_seed=self.cfg.grpo.seed)
        if self.cfg.grpo.kl_coef > 0 and self.cfg.model.finetune == "full":
            self._ref_model = copy.deepcopy(base).to(self.device).eval().requires_grad_(False)
        if self.cfg.model.gradient_checkpointing:
            base.gradient_checkpointing_enable()
        model = modeling.apply_finetune_mode(base, self.cfg.model).to(self.device)
        model.train()
        self.model = model
        self._wrapped = self._wrap(model)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=self.cfg.grpo.learning_rate, weight_decay=self.cfg.grpo.weight_decay
        )
        # Seed per rank after init so dropout differs across ranks but is reproducible.
        torch.manual_seed(self.cfg.grpo.seed * 1000 + self.rank + 1)
        return {
            "rank": self.rank,
            "device": str(self.device),
            "backend": self.backend,
            "trainable_params": sum(p.numel() for p in params),
        }

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.device_kind == "cpu":
            if self.world_size == 1:
                return model
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(model)
        # FSDP2 on accelerators: shard each decoder layer, then the root.
        from torch.distributed.fsdp import fully_shard

        for module in model.modules():
            if type(module).__name__.endswith("DecoderLayer"):
                fully_shard(module)
        fully_shard(model)
        return model

    # ---- log-probs -------------------------------------------------------------------------------
    def _response_log_probs(
        self, model: torch.nn.Module, samples: Sequence[TrainSample]
    ) -> list[torch.Tensor]:
        """Per-sample log-probs of the response tokens [R_i] (grad follows torch.is_grad_enabled())."""
        temperature = self.cfg.grpo.temperature
        seqs = [list(s.prompt_ids) + list(s.response_ids) for s in samples]
        if self.cfg.batching.packed:
            side_keys = sorted(samples[0].side) if samples else []
            side = {k: [s.side[k] for s in samples] for k in side_keys}
            packed = packing.pack_sequences(seqs, side or None, device=self.device)
            per_seq = packing.packed_token_log_probs(
                model, packed, temperature=temperature, forward_side_keys=side_keys
            )
        else:
            per_seq = padded_token_log_probs(model, seqs, pad_id=self._pad_id, temperature=temperature)
        # Log-prob of token t sits at index t-1: the response starts at index len(prompt) - 1.
        return [lp[len(s.prompt_ids) - 1 :] for lp, s in zip(per_seq, samples, strict=True)]

    @contextlib.contextmanager
    def _reference(self) -> Iterator[torch.nn.Module]:
        if self._ref_model is not None:
            yield self._ref_model
            return
        model = self._parts()[0]
        if not modeling.is_lora(model):
            raise RuntimeError("a KL reference needs LoRA (adapters off) or a frozen copy (full FT)")
        with model.disable_adapter():
            yield model

    def _forward_only(self, samples: Sequence[TrainSample], *, reference: bool) -> list[torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        plan = microbatch.plan_micro_batches([s.length for s in samples], self._spec) if samples else []
        with torch.no_grad():
            for group in plan:
                mb = [samples[i] for i in group]
                if reference:
                    with self._reference() as ref:
                        lps = self._response_log_probs(ref, mb)
                else:
                    lps = self._response_log_probs(self._parts()[0], mb)
                for i, lp in zip(group, lps, strict=True):
                    out[i] = lp.detach()
        return [out[i] for i in range(len(samples))]

    def compute_log_probs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """The policy's response log-probs (forward-only): what engines must match after a sync."""
        return [lp.tolist() for lp in self._forward_only(samples, reference=False)]

    def _parts(self) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
        """(model, wrapped model, optimizer); raises before setup()."""
        if self.model is None or self._wrapped is None or self.optimizer is None:
            raise RuntimeError("setup() has not been called")
        return self.model, self._wrapped, self.optimizer

    # ---- training --------------------------------------------------------------------------------
    def _agreed_micro_batch_count(self, lengths: Sequence[int]) -> int:
        own = microbatch.count_micro_batches(lengths, self._spec)
        if self.world_size == 1:
            return own
        t = torch.tensor([own], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _grad_sync(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
        wrapped = self._wrapped
        if self.world_size == 1 or wrapped is None:
            return contextlib.nullcontext()
        if hasattr(wrapped, "no_sync"):  # DDP
            return contextlib.nullcontext() if enabled else wrapped.no_sync()
        wrapped.set_requires_gradient_sync(enabled)  # FSDP2
        return contextlib.nullcontext()

    def train_step(self, mini_batches: Sequence[RankMiniBatch]) -> dict[str, Any]:
        """One GRPO step: old (and reference) log-probs of every mini-batch first, from the weights
        the step starts with, then `ppoEpochs` passes of one optimizer update per mini-batch. So from
        the second update on the ratio differs from 1 and the clip acts.

        Returns this rank's sums (`loss`, `pg_loss`, `kl`, `clipfrac_tokens`, `loss_tokens`, `tokens`,
        `logprob_diff_sum` / `logprob_diff_tokens`: |old − engine| over response tokens), the
        per-update `pg_loss_updates` list and the replicated `grad_norm` (mean over updates); the
        driver sums over ranks.
        """
        model, wrapped, optimizer = self._parts()
        g = self.cfg.grpo
        policy_loss = algos.get_policy_loss(g.policy_loss)
        stats: dict[str, Any] = {
            "loss": 0.0,
            "pg_loss": 0.0,
            "kl": 0.0,
            "clipfrac_tokens": 0.0,
            "loss_tokens": 0.0,
            "tokens": 0.0,
            "logprob_diff_sum": 0.0,
            "logprob_diff_tokens": 0.0,
            # π_old / π_rollout over response tokens with engine log-probs (untruncated), first pass
            "is_weight_sum": 0.0,
            "is_weight_tokens": 0.0,
            "is_weight_max": 0.0,
            "is_truncated_tokens": 0.0,
        }
        pg_updates: list[float] = []
        grad_norms: list[float] = []
        # DDP/FSDP average gradients over ranks; our loss is already a share of the global sum.
        scale = float(self.world_size)
        # Old log-probs once per step, before any update (recomputing them per mini-batch would make
        # every ratio 1 and the clip a no-op).
        olds = [self._forward_only(mb.samples, reference=False) for mb in mini_batches]
        refs = (
            [self._forward_only(mb.samples, reference=True) for mb in mini_batches]
            if g.kl_coef > 0
            else [None] * len(mini_batches)
        )
        for mb, old in zip(mini_batches, olds, strict=True):
            for s, lp in zip(mb.samples, old, strict=True):
                if s.rollout_logprobs:
                    engine = torch.tensor(s.rollout_logprobs, dtype=lp.dtype)
                    stats["logprob_diff_sum"] += float((lp.cpu() - engine).abs().sum())
                    stats["logprob_diff_tokens"] += float(len(engine))
                    w = torch.exp(lp.cpu().double() - engine.double())
                    stats["is_weight_sum"] += float(w.sum())
                    stats["is_weight_tokens"] += float(w.numel())
                    stats["is_weight_max"] = max(stats["is_weight_max"], float(w.max()))
                    if g.tis_cap is not None:
                        stats["is_truncated_tokens"] += float((w > g.tis_cap).sum())
        updates = [(i, mb) for _ in range(g.ppo_epochs) for i, mb in enumerate(mini_batches)]
        for i, mb_batch in updates:
            samples = mb_batch.samples
            old, ref = olds[i], refs[i]
            before = stats["pg_loss"]
            lengths = [s.length for s in samples]
            k = self._agreed_micro_batch_count(lengths)
            plan: list[list[int]] = (
                microbatch.plan_micro_batches(lengths, self._spec, num_micro_batches=min(k, len(samples)))
                if samples
                else []
            )
            plan += [[] for _ in range(k - len(plan))]  # zero-weight micro-batches keep collectives paired
            optimizer.zero_grad(set_to_none=True)
            for j, group in enumerate(plan):
                with self._grad_sync(j == len(plan) - 1):
                    loss = self._micro_batch_loss(
                        wrapped, samples, group, old, ref, mb_batch, policy_loss, stats
                    )
                    (loss * scale).backward()
            params = [p for p in model.parameters() if p.requires_grad]
            norm = torch.nn.utils.clip_grad_norm_(params, g.grad_clip)
            grad_norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
            optimizer.step()
            pg_updates.append(stats["pg_loss"] - before)
        stats["grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        stats["pg_loss_updates"] = pg_updates
        return stats

    def _micro_batch_loss(
        self,
        wrapped: torch.nn.Module,
        samples: Sequence[TrainSample],
        group: Sequence[int],
        old: Sequence[torch.Tensor],
        ref: Sequence[torch.Tensor] | None,
        mb_batch: RankMiniBatch,
        policy_loss: algos.PolicyLoss,
        stats: dict[str, float],
    ) -> torch.Tensor:
        g = self.cfg.grpo
        if not group:
            # A dummy forward so every rank runs the same collectives; contributes zero gradient.
            dummy = TrainSample((self._pad_id,), (self._pad_id,), 0.0)
            lps = self._response_log_probs(wrapped, [dummy])
            return lps[0].sum() * 0.0
        mb = [samples[i] for i in group]
        lps = self._response_log_probs(wrapped, mb)
        logp = torch.cat(lps)
        old_lp = torch.cat([old[i] for i in group]).to(logp.device)
        adv = torch.cat(
            [
                torch.full((len(lp),), samples[i].advantage, device=logp.device)
                for i, lp in zip(group, lps, strict=True)
            ]
        )
        seq_ids = torch.cat(
            [torch.full((len(lp),), n, dtype=torch.long, device=logp.device) for n, lp in enumerate(lps)]
        )
        mask = torch.ones_like(logp)
        agg = {
            "mode": g.loss_agg,
            "global_num_seqs": mb_batch.global_num_seqs,
            "global_num_tokens": mb_batch.global_num_response_tokens,
            "token_sum_norm": self.cfg.lengths.max_response_tokens,
        }
        tis: dict[str, Any] = {}
        if g.policy_loss == "clipped-tis":
            # The engine's log-probs (the behaviour policy); a sample without them weighs 1.
            tis["rollout_logp"] = torch.cat(
                [
                    torch.tensor(samples[i].rollout_logprobs, dtype=logp.dtype, device=logp.device)
                    if samples[i].rollout_logprobs
                    else old[i].to(logp.device)
                    for i in group
                ]
            )
            tis["tis_cap"] = g.tis_cap if g.tis_cap is not None else 2.0
        per_tok, clipped = policy_loss(logp, old_lp, adv, clip_low=g.clip_low, clip_high=g.clip_high, **tis)
        pg = algos.aggregate_loss(per_tok, mask, seq_ids, **agg)
        loss = pg
        if ref is not None:
            ref_lp = torch.cat([ref[i] for i in group]).to(logp.device)
            kl_tok = algos.kl_penalty(logp, ref_lp, g.kl_estimator)
            kl = algos.aggregate_loss(kl_tok, mask, seq_ids, **agg)
            loss = loss + g.kl_coef * kl
            stats["kl"] += float(kl.detach())
        stats["loss"] += float(loss.detach())
        stats["pg_loss"] += float(pg.detach())
        stats["clipfrac_tokens"] += float(clipped.sum())
        stats["loss_tokens"] += float(clipped.numel())
        stats["tokens"] += float(sum(s.length for s in mb))
        return loss

    # ---- weights and state -----------------------------------------------------------------------
    def engine_weights(self, what: str = "merged") -> dict[str, torch.Tensor] | None:
        """The engines' weights on rank 0 (every rank must call: FSDP2 gathers): the full merged model,
        or for engines serving LoRA only the adapter, or base and adapter (`weight_sync.SEND_*`)."""
        if what == "merged":
            weights = dict(modeling.iter_engine_weights(self._parts()[0]))
        else:
            from rljob_trainer.rollout import weight_sync

            with weight_sync.engine_tensors(self._parts()[0], what) as tensors:
                weights = {n: modeling._full_tensor(t).detach().to("cpu").clone() for n, t in tensors}
        return weights if self.rank == 0 else None

    def export_hf(self, out_dir: str, step: int) -> dict[str, Any] | None:
        """Export the policy in Hugging Face format (all ranks must call; rank 0 writes, see export)."""
        model = self._parts()[0]
        offload = self.device_kind != "cpu"
        return export.export_from_rank(model, self.cfg, out_dir, step=step, rank=self.rank, offload=offload)

    def get_train_state(self) -> dict[str, Any] | None:
        """Trainable weights, optimizer state and every rank's RNG, on rank 0 (all ranks must call)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        model, _, optimizer = self._parts()
        opts = StateDictOptions(full_state_dict=True, cpu_offload=self.device_kind != "cpu")
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        msd = {k: v for k, v in get_model_state_dict(model, options=opts).items() if k in trainable}
        osd = get_optimizer_state_dict(model, optimizer, options=opts)
        rng = self._gather_rng()
        if self.rank != 0:
            return None
        return {"model": msd, "optimizer": osd, "rng": rng}

    def _gather_rng(self) -> list[torch.Tensor]:
        mine = torch.random.get_rng_state()
        if self.world_size == 1:
            return [mine]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, mine)
        return out

    def set_train_state(self, state: dict[str, Any]) -> None:
        """Load what `get_train_state` returned (every rank gets the full state)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        model, _, optimizer = self._parts()
        opts = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, state["model"], options=opts)
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=opts)
        torch.random.set_rng_state(state["rng"][self.rank])

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def split_evenly(n: int, parts: int) -> list[int]:
    """Sizes of `parts` contiguous slices of n items, the first n % parts one larger."""
    base, extra = divmod(n, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def ceil_div(a: int, b: int) -> int:
    return math.ceil(a / b)

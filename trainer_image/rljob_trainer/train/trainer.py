"""A training rank: one torch.distributed process that runs GRPO updates on its share of a step.

Role: holds the policy (LoRA via peft or full fine-tuning), its optimizer and, when a KL penalty is
on, the reference (the base with adapters disabled under LoRA, a frozen copy under full FT). Per
step it gets its DP-balanced shard of every mini-batch from the driver, computes old (and
reference) log-probs of the whole step in a forward-only pass before any update, then runs
micro-batches planned by `rljob_trainer.train.microbatch` (the planner the DP-balance simulation uses),
packed through `rljob_trainer.train.packing` (`use_cache=False`) or padded, and steps the optimizer
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

from rljob_trainer import config as config_mod
from rljob_trainer.model import modeling, precision, sampling
from rljob_trainer.outputs import export
from rljob_trainer.train import algos, microbatch, packing, rollout_correction


@dataclass(frozen=True)
class TrainSample:
    """One rollout as the trainer sees it: prompt + response token ids and the GRPO advantage.

    `rollout_logprobs` are the engine's log-probs of `response_ids` (what it sampled with; empty when
    unknown) and `weights_version` the trainer step whose weights generated it. `side` holds
    per-token arrays aligned with prompt+response (e.g. `mm_token_type_ids`); they are packed with
    the ids and passed to the model.

    `loss_mask` (aligned with `response_ids`; empty: every response token) is 1 on the tokens the
    policy generated and 0 on the tokens it did not (a multi-turn episode's tool results and
    environment observations, `rljob_trainer.rollout.agent`). A 0 token is in the forward (it is
    context for what follows) and nowhere else: not in the loss, KL, entropy, the clip and rollout
    metrics or the importance weights, and in no denominator of a per-token aggregation (a
    sequence's token count, the batch's token count): an episode weighs as its generated tokens do.
    """

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    advantage: float
    side: dict[str, Any] = field(default_factory=dict)
    rollout_logprobs: tuple[float, ...] = ()
    weights_version: int = 0
    loss_mask: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.loss_mask and len(self.loss_mask) != len(self.response_ids):
            raise ValueError(
                f"loss_mask has {len(self.loss_mask)} entries for {len(self.response_ids)} response tokens"
            )

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def mask(self) -> tuple[int, ...]:
        """1 per response token the loss trains on (all of them without a `loss_mask`)."""
        return self.loss_mask or (1,) * len(self.response_ids)

    @property
    def num_loss_tokens(self) -> int:
        """Response tokens the loss counts (the per-token aggregations' denominators)."""
        return sum(self.mask)


def sample_from_output(out: Any, advantage: float, *, eos_id: int) -> TrainSample:
    """A `TrainSample` from an engine's `GenerationOutput` (an empty response trains on one EOS), or
    from a multi-turn episode's (`rollout.agent.AgentOutput`: its `loss_mask` comes along)."""
    response = tuple(out.token_ids)
    logprobs = tuple(out.logprobs) if response and len(out.logprobs) == len(response) else ()
    mask = tuple(getattr(out, "loss_mask", ())) if response else ()
    return TrainSample(
        tuple(out.prompt_token_ids),
        response or (eos_id,),
        advantage,
        rollout_logprobs=logprobs,
        weights_version=int(out.meta.get("version", 0)),
        loss_mask=mask,
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
    model: Any,
    sequences: Sequence[Sequence[int]],
    *,
    pad_id: int,
    temperature: float,
    top_p: float = 1.0,
    with_entropy: bool = False,
    device: torch.device | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Per-sample next-token log-probs [L_i − 1] from one right-padded [B, L_max] forward, with the
    sampler's processing (`rljob_trainer.model.sampling`), and optionally the entropies."""
    lengths = [len(s) for s in sequences]
    width = max(lengths)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        attn[i, : len(s)] = 1
    ids, attn = ids.to(device), attn.to(device)
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    flat_lp, flat_ent = sampling.token_log_probs(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        ids[:, 1:].reshape(-1),
        temperature=temperature,
        top_p=top_p,
        with_entropy=with_entropy,
    )
    lp = flat_lp.view(len(sequences), width - 1)
    ent = flat_ent.view(len(sequences), width - 1) if flat_ent is not None else None
    lps = [lp[i, : n - 1] for i, n in enumerate(lengths)]
    return lps, ([ent[i, : n - 1] for i, n in enumerate(lengths)] if ent is not None else None)


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`module` in eval mode (no dropout) for the block, then back to the mode it had."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)


# The per-rank sums `TrainingRank.train_step` returns (the driver adds them up over ranks).
STAT_SUMS: tuple[str, ...] = (
    "loss",
    "pg_loss",
    "kl",
    # entropy of the processed sampling distribution, aggregated as the loss is (lossAggregation)
    "entropy",
    "pg_clipfrac_tokens",  # the clipped loss is the larger (verl's pg_clipfrac)
    "pg_clipfrac_ratio_low_tokens",  # A < 0 and ratio < 1 - clipRatioLow
    "pg_clipfrac_ratio_high_tokens",  # A > 0 and ratio > 1 + clipRatioHigh
    "pg_clipfrac_lower_tokens",  # the dual-clip bound binds (verl's pg_clipfrac_lower)
    "ppo_kl_sum",
    "out_of_nucleus_tokens",  # a -inf log-prob (outside a top-p nucleus): dropped from the loss
    "loss_tokens",
    "tokens",
    # π_old / π_rollout over response tokens with engine log-probs (untruncated), before any update
    "is_weight_sum",
    "is_weight_tokens",
    "is_weight_max",
    "is_truncated_tokens",
    "skipped_updates",
    # rollout_correction.correction_sums over the tokens with engine log-probs
    *(f"corr/{k}" for k in rollout_correction.SUM_KEYS),
)


class TrainingRank:
    """One data-parallel rank. Construct, then `setup(master_addr, master_port)` on every rank.

    `model` is the policy the optimizer, checkpoints and weight syncs see: its trainable parameters
    are fp32 masters (`rljob_trainer.model.precision`). Forward and backward run on `_compute`: the FSDP2
    module itself on accelerators (its policy computes in the job's dtype), or on CPU the compute copy
    of `precision.CpuMixedPrecision`.
    """

    def __init__(self, cfg: config_mod.TrainerConfig, rank: int, world_size: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.device_kind, self.backend = resolve_device_and_backend(cfg.distributed)
        self.dtype = precision.compute_dtype(cfg.model.dtype)
        self.model: torch.nn.Module | None = None
        self._compute: torch.nn.Module | None = None
        self._mp: precision.CpuMixedPrecision | None = None
        self._ref_model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._spec = micro_batch_spec(cfg.batching)
        self._pad_id = 0
        self._correction = correction_of(cfg.grpo)

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
        # Built in the job's dtype, as the engines build it, so the compute weights equal theirs.
        base = modeling.build_base_model(self.cfg.model, init_seed=self.cfg.grpo.seed)
        if self.cfg.grpo.kl_coef > 0 and self.cfg.model.finetune == "full":
            self._ref_model = copy.deepcopy(base).eval().requires_grad_(False)
        if self.cfg.model.gradient_checkpointing:
            base.gradient_checkpointing_enable()
        model = modeling.apply_finetune_mode(base, self.cfg.model)
        precision.upcast_trainable_(model)  # fp32 masters; the LoRA base stays in the job's dtype
        model.train()
        if self.device_kind == "cpu":
            self._mp = precision.CpuMixedPrecision(model, self.dtype, world_size=self.world_size)
            self._compute = self._mp.compute
        else:
            self._shard(model, policy=precision.fsdp_policy(self.dtype))
            self._compute = model
            if self._ref_model is not None:
                self._shard(self._ref_model, policy=None)
        self.model = model
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
            "master_dtype": str(params[0].dtype) if params else None,
            "compute_dtype": str(self.dtype),
        }

    @staticmethod
    def _shard(model: torch.nn.Module, *, policy: Any) -> None:
        """FSDP2 on accelerators: each decoder layer, then the root. `fully_shard` moves each module's
        parameters to the mesh's device as it shards them, so the full model never sits on one device."""
        from torch.distributed.fsdp import fully_shard

        kwargs = {"mp_policy": policy} if policy is not None else {}
        for module in model.modules():
            if type(module).__name__.endswith("DecoderLayer"):
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)

    # ---- log-probs -------------------------------------------------------------------------------
    def _response_log_probs(
        self, model: torch.nn.Module, samples: Sequence[TrainSample], *, with_entropy: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per-sample log-probs of the response tokens [R_i] under the sampler's processing (grad follows
        torch.is_grad_enabled()), and with `with_entropy` the entropies [R_i] (no grad)."""
        g = self.cfg.grpo
        seqs = [list(s.prompt_ids) + list(s.response_ids) for s in samples]
        # Log-prob of token t sits at index t-1: the response starts at index len(prompt) - 1.
        cut = [len(s.prompt_ids) - 1 for s in samples]
        if self.cfg.batching.packed:
            side_keys = sorted(samples[0].side) if samples else []
            side = {k: [s.side[k] for s in samples] for k in side_keys}
            packed = packing.pack_sequences(seqs, side or None, device=self.device)
            return packing.packed_log_probs_and_entropy(  # the prompts' logits are never computed
                model,
                packed,
                temperature=g.temperature,
                top_p=g.top_p,
                forward_side_keys=side_keys,
                with_entropy=with_entropy,
                skip=cut,
            )
        per_seq, ents = padded_token_log_probs(
            model,
            seqs,
            pad_id=self._pad_id,
            temperature=g.temperature,
            top_p=g.top_p,
            with_entropy=with_entropy,
            device=self.device,
        )
        lps = [lp[c:] for lp, c in zip(per_seq, cut, strict=True)]
        return lps, ([e[c:] for e, c in zip(ents, cut, strict=True)] if ents is not None else None)

    @contextlib.contextmanager
    def _reference(self) -> Iterator[torch.nn.Module]:
        if self._ref_model is not None:
            yield self._ref_model
            return
        model = self._parts()[1]
        if not modeling.is_lora(model):
            raise RuntimeError("a KL reference needs LoRA (adapters off) or a frozen copy (full FT)")
        with model.disable_adapter():
            yield model

    def _planned(self, samples: Sequence[TrainSample]) -> list[list[int]]:
        """This rank's micro-batches of `samples`, padded with empty ones to the count every rank
        agreed on (FSDP2's forward and backward are collectives: every rank runs the same number)."""
        lengths = [s.length for s in samples]
        k = self._agreed_micro_batch_count(lengths)
        plan: list[list[int]] = (
            microbatch.plan_micro_batches(lengths, self._spec, num_micro_batches=min(k, len(samples)))
            if samples
            else []
        )
        return plan + [[] for _ in range(k - len(plan))]

    def _dummy(self) -> list[TrainSample]:
        return [TrainSample((self._pad_id,), (self._pad_id,), 0.0)]

    def _forward_only(self, samples: Sequence[TrainSample], *, reference: bool) -> list[torch.Tensor]:
        """Old or reference log-probs, in eval mode: a forward-only pass has no dropout (with LoRA
        dropout > 0 a train-mode pass would make the ratio differ from 1 at unchanged weights)."""
        out: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for group in self._planned(samples):
                mb = [samples[i] for i in group] or self._dummy()
                if reference:
                    with self._reference() as ref, eval_mode(ref):
                        lps, _ = self._response_log_probs(ref, mb)
                else:
                    with eval_mode(self._parts()[1]) as model:
                        lps, _ = self._response_log_probs(model, mb)
                for i, lp in zip(group, lps, strict=False):
                    out[i] = lp.detach()
        return [out[i] for i in range(len(samples))]

    def compute_log_probs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """The policy's response log-probs (forward-only): what engines must match after a sync."""
        return [lp.tolist() for lp in self._forward_only(samples, reference=False)]

    def _parts(self) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
        """(policy with fp32 masters, the module forward/backward run on, optimizer); raises before
        setup()."""
        if self.model is None or self._compute is None or self.optimizer is None:
            raise RuntimeError("setup() has not been called")
        return self.model, self._compute, self.optimizer

    # ---- training --------------------------------------------------------------------------------
    def _agreed_micro_batch_count(self, lengths: Sequence[int]) -> int:
        own = microbatch.count_micro_batches(lengths, self._spec)
        if self.world_size == 1:
            return own
        t = torch.tensor([own], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _grad_sync(self, enabled: bool) -> None:
        """FSDP2 reduce-scatters only after a mini-batch's last micro-batch; until then it accumulates
        the unsharded gradients in its reduce dtype (fp32). The CPU path all-reduces once, by hand."""
        if self._mp is None and self.world_size > 1:
            self._parts()[1].set_requires_gradient_sync(enabled)  # type: ignore[operator]

    def _uses_engine_log_probs(self) -> bool:
        return self._correction is not None

    def _fused_old_log_probs(self, mini_batches: Sequence[RankMiniBatch]) -> bool:
        """One update per step: the old log-probs (the proximal policy, the weights the step starts
        with) are the training forward's, detached (the same weights, the same tokens), so the
        separate forward-only pass is skipped. Also with stale rollouts (maxStaleness >= 1): their
        staleness is the behaviour policy's, which truncated IS takes from the engine's own log-probs
        (`rollout_logprobs`), never from this pass. Except with LoRA dropout there: the IS weight
        old / engine would then carry the training forward's dropout, so the old log-probs come from
        the eval-mode pass as before."""
        if len(mini_batches) * self.cfg.grpo.ppo_epochs != 1:
            return False
        model = self.cfg.model
        dropout = model.finetune == "lora" and model.lora.dropout > 0
        return self.cfg.grpo.max_staleness == 0 or not dropout

    def train_step(self, mini_batches: Sequence[RankMiniBatch]) -> dict[str, Any]:
        """One GRPO step: old (and reference) log-probs of every mini-batch first, from the weights
        the step starts with, then `ppoEpochs` passes of one optimizer update per mini-batch. So from
        the second update on the ratio differs from 1 and the clip acts. With a single update the old
        log-probs are the training forward's own, detached (`_fused_old_log_probs`).

        An update whose gradient norm is not finite is skipped (no optimizer step; its gradient is
        dropped) and counted in `skipped_updates`; every rank sees the same reduced norm, so all agree.

        Returns this rank's shares, which the driver sums over ranks: `loss`, `pg_loss`, `kl`, `entropy`
        (means over the step's updates), token sums (`pg_clipfrac_*_tokens`, `ppo_kl_sum`,
        `out_of_nucleus_tokens` over `loss_tokens`; `tokens`), the engine's behaviour policy against
        π_old (`is_weight_*`, and `corr/*`: `rollout_correction.SUM_KEYS`), the
        per-update `pg_loss_updates` list, the replicated `grad_norm` (mean over updates),
        `skipped_updates` and `updates`.
        """
        model, compute, optimizer = self._parts()
        g = self.cfg.grpo
        policy_loss = algos.get_policy_loss(g.policy_loss)
        stats: dict[str, Any] = dict.fromkeys(STAT_SUMS, 0.0)
        pg_updates: list[float] = []
        grad_norms: list[float] = []
        # FSDP2 averages gradients over ranks; our loss is already a share of the global sum.
        scale = float(self.world_size) if self._mp is None else 1.0
        fused = self._fused_old_log_probs(mini_batches)
        # Old log-probs once per step, before any update (recomputing them per mini-batch would make
        # every ratio 1 and the clip a no-op).
        olds: list[list[torch.Tensor] | None] = (
            [None] * len(mini_batches)
            if fused
            else [self._forward_only(mb.samples, reference=False) for mb in mini_batches]
        )
        refs = (
            [self._forward_only(mb.samples, reference=True) for mb in mini_batches]
            if g.kl_coef > 0
            else [None] * len(mini_batches)
        )
        for mb, old in zip(mini_batches, olds, strict=True):
            if old is not None:
                self._rollout_stats(stats, mb.samples, old)
        params = [p for p in model.parameters() if p.requires_grad]
        updates = [(i, mb) for _ in range(g.ppo_epochs) for i, mb in enumerate(mini_batches)]
        for i, mb_batch in updates:
            before = stats["pg_loss"]
            plan = self._planned(mb_batch.samples)
            optimizer.zero_grad(set_to_none=True)
            if self._mp is not None:
                self._mp.zero_grad()
            for j, group in enumerate(plan):
                self._grad_sync(j == len(plan) - 1)
                loss = self._micro_batch_loss(compute, group, olds[i], refs[i], mb_batch, policy_loss, stats)
                (loss * scale).backward()
                if self._mp is not None:
                    self._mp.accumulate_grads()
            if self._mp is not None:
                self._mp.all_reduce_grads()
            norm = torch.nn.utils.clip_grad_norm_(params, g.grad_clip)
            norm_f = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            grad_norms.append(norm_f)
            if math.isfinite(norm_f):
                optimizer.step()
                if self._mp is not None:
                    self._mp.publish()
            else:
                stats["skipped_updates"] += 1
            optimizer.zero_grad(set_to_none=True)
            if self._mp is not None:
                self._mp.zero_grad()
            pg_updates.append(stats["pg_loss"] - before)
        n = max(len(updates), 1)
        for key in ("loss", "pg_loss", "kl", "entropy"):
            stats[key] /= n
        stats["updates"] = len(updates)
        stats["grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        stats["pg_loss_updates"] = pg_updates
        return stats

    def _rollout_stats(
        self, stats: dict[str, Any], samples: Sequence[TrainSample], old: Sequence[torch.Tensor]
    ) -> None:
        """The engine's behaviour policy against π_old, before any update: the untruncated IS weights
        π_old / π_rollout (`off_policy/*`) and the `rollout_correction` sums (|old − engine|, KL, PPL,
        chi², what the correction truncates, masks or rejects). Tokens with a -inf log-prob (outside
        the trainer's nucleus) are only counted (`rollout/out_of_nucleus_fraction`)."""
        pairs = [(s, lp) for s, lp in zip(samples, old, strict=True) if s.rollout_logprobs]
        if not pairs:
            return
        lp64 = torch.cat([lp.detach().cpu().double() for _, lp in pairs])
        engine = torch.cat([torch.tensor(s.rollout_logprobs, dtype=torch.float64) for s, _ in pairs])
        seq_ids = torch.cat([torch.full((len(lp),), n, dtype=torch.long) for n, (_, lp) in enumerate(pairs)])
        mask = torch.cat([torch.tensor(s.mask, dtype=torch.float64) for s, _ in pairs])
        sums = rollout_correction.correction_sums(lp64, engine, mask, seq_ids, self._correction)
        for key, value in sums.items():
            stats[f"corr/{key}"] += float(value)
        valid = algos.in_nucleus(lp64, engine) & (mask > 0)  # observation tokens: no IS weight
        w = torch.exp(lp64[valid] - engine[valid])
        stats["is_weight_sum"] += float(w.sum())
        stats["is_weight_tokens"] += float(w.numel())
        if w.numel():
            stats["is_weight_max"] = max(stats["is_weight_max"], float(w.max()))
        c = self._correction
        if c is not None and c.is_level is not None and c.is_mode == "truncate":
            stats["is_truncated_tokens"] += float(sums["is_high_tokens"])

    def _micro_batch_loss(
        self,
        compute: torch.nn.Module,
        group: Sequence[int],
        old: Sequence[torch.Tensor] | None,
        ref: Sequence[torch.Tensor] | None,
        mb_batch: RankMiniBatch,
        policy_loss: algos.PolicyLoss,
        stats: dict[str, Any],
    ) -> torch.Tensor:
        g = self.cfg.grpo
        samples = mb_batch.samples
        if not group:
            # A dummy forward so every rank runs the same collectives; contributes zero gradient.
            lps, _ = self._response_log_probs(compute, self._dummy())
            return lps[0].sum() * 0.0
        mb = [samples[i] for i in group]
        lps, ents = self._response_log_probs(compute, mb, with_entropy=True)
        logp = torch.cat(lps)
        if old is None:  # fused: the old policy is this very forward
            self._rollout_stats(stats, mb, lps)
            old_lp = logp.detach()
        else:
            old_lp = torch.cat([old[i] for i in group]).to(logp.device)
        adv = torch.cat(
            [torch.full((len(lp),), s.advantage, device=logp.device) for s, lp in zip(mb, lps, strict=True)]
        )
        seq_ids = torch.cat(
            [torch.full((len(lp),), n, dtype=torch.long, device=logp.device) for n, lp in enumerate(lps)]
        )
        # 1 on generated tokens, 0 on an episode's observation tokens (TrainSample.loss_mask).
        mask = torch.cat([torch.tensor(s.mask, dtype=logp.dtype, device=logp.device) for s in mb])
        agg = {
            "mode": g.loss_agg,
            "global_num_seqs": mb_batch.global_num_seqs,
            "global_num_tokens": mb_batch.global_num_response_tokens,
            "token_sum_norm": self.cfg.lengths.max_response_tokens,
        }
        extra: dict[str, Any] = {"clip_ratio_c": g.clip_ratio_c}
        if self._correction is not None:
            # The engine's log-probs (the behaviour policy); a sample without them weighs as on-policy.
            rollout_lp = torch.cat(
                [
                    torch.tensor(s.rollout_logprobs, dtype=logp.dtype, device=logp.device)
                    if s.rollout_logprobs
                    else old_lp[seq_ids == n].detach()
                    for n, s in enumerate(mb)
                ]
            )
            extra["weights"] = rollout_correction.correction_weights(
                old_lp.detach(), rollout_lp, mask, seq_ids, self._correction
            )["weight"].to(logp.dtype)
        if algos.needs_seq_ids(g.policy_loss):
            extra["seq_ids"] = seq_ids
            extra["mask"] = mask  # a sequence's ratio is over the tokens it generated
        per_tok, clipped = policy_loss(logp, old_lp, adv, clip_low=g.clip_low, clip_high=g.clip_high, **extra)
        pg = algos.aggregate_loss(per_tok, mask, seq_ids, **agg)
        loss = pg
        if ref is not None:
            ref_lp = torch.cat([ref[i] for i in group]).to(logp.device)
            kl_tok = algos.kl_penalty(logp, ref_lp, g.kl_estimator)
            kl = algos.aggregate_loss(kl_tok, mask, seq_ids, **agg)
            loss = loss + g.kl_coef * kl
            stats["kl"] += float(kl.detach())
        clip = algos.ppo_clip_metrics(
            logp.detach(),
            old_lp,
            adv,
            clip_low=g.clip_low,
            clip_high=g.clip_high,
            clip_ratio_c=g.clip_ratio_c,
        )
        stats["loss"] += float(loss.detach())
        stats["pg_loss"] += float(pg.detach())
        if ents is not None:  # aggregated as the loss is, as verl's actor/entropy is
            ent = torch.cat(ents).to(mask.dtype)
            stats["entropy"] += float(algos.aggregate_loss(ent, mask, seq_ids, **agg))
        m = mask.to(clipped.dtype)
        stats["pg_clipfrac_tokens"] += float((clipped * m).sum())
        stats["pg_clipfrac_ratio_low_tokens"] += float((clip["clipped_low"] * m).sum())
        stats["pg_clipfrac_ratio_high_tokens"] += float((clip["clipped_high"] * m).sum())
        stats["pg_clipfrac_lower_tokens"] += float((clip["dual_clipped"] * m).sum())
        stats["ppo_kl_sum"] += float((clip["ppo_kl"] * m).sum())
        stats["out_of_nucleus_tokens"] += float((clip["out_of_nucleus"] * m).sum())
        stats["loss_tokens"] += float(m.sum())
        stats["tokens"] += float(sum(s.length for s in mb))
        return loss

    # ---- weights and state -----------------------------------------------------------------------
    def engine_weights(self, what: str = "merged") -> dict[str, torch.Tensor] | None:
        """The engines' weights on rank 0 (every rank must call: FSDP2 gathers): the full merged model,
        or for engines serving LoRA only the adapter, or base and adapter (`weight_sync.SEND_*`)."""
        if what == "merged":
            weights = dict(modeling.iter_engine_weights(self._parts()[0], self.dtype))
        else:
            from rljob_trainer.weights import weight_sync

            with weight_sync.engine_tensors(self._parts()[0], what) as tensors:
                weights = {n: modeling._to_cpu(t, self.dtype) for n, t in tensors}
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
        if self._mp is not None:
            self._mp.publish()  # the loaded masters into the compute copy
        torch.random.set_rng_state(state["rng"][self.rank])

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def correction_of(g: config_mod.GRPOSettings) -> rollout_correction.Correction | None:
    """The rollout correction a job's GRPO settings ask for (`GRPOSettings.effective_rollout_correction`:
    spec.grpo.rolloutCorrection, else a '*-tis' loss's token TIS at tisCap), or None."""
    c = g.effective_rollout_correction()
    if c is None:
        return None
    return rollout_correction.Correction(
        is_level=c.is_level,
        is_mode=c.is_mode,
        is_lower=c.is_lower,
        is_upper=c.is_upper,
        reject_level=c.reject_level,
        reject_lower=c.reject_lower,
        reject_upper=c.reject_upper,
    )


def split_evenly(n: int, parts: int) -> list[int]:
    """Sizes of `parts` contiguous slices of n items, the first n % parts one larger."""
    base, extra = divmod(n, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def ceil_div(a: int, b: int) -> int:
    return math.ceil(a / b)

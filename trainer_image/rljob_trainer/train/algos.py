"""GRPO algorithms: advantage estimators, policy losses, KL estimators and loss aggregation.

Role: the math of one GRPO update, registered by name like verl's `register_adv_est` /
`register_policy_loss`, each vectorised function kept next to a slow reference it is tested
against. Pure tensor functions: no distributed calls, no `.item()` (callers do that). Callers:
`rljob_trainer.driver` (advantages), `rljob_trainer.train.trainer` (losses), tests.

Token tensors are flat: one entry per token of a micro-batch, packed or padded alike, with
`seq_ids` (long, same shape) giving each token's sequence index within the micro-batch and
`mask` (float, 1.0 on response tokens that count, 0.0 on prompt and padding tokens).

Out-of-nucleus tokens: with top-p < 1 a sampled token can fall outside the trainer's own nucleus,
where its processed log-prob is -inf (`rljob_trainer.model.sampling`). Every term here that compares
two log-probs of a token (the PPO and GSPO ratios, the KL estimators, the IS weights, the clip
metrics) drops such a token: its value and its gradient are 0 (`in_nucleus`), and it keeps its
place in the aggregation's denominators (as IcePop's masked tokens do), so how many fall out never
rescales the batch. -inf - (-inf) is NaN, so inputs are zeroed where dropped *before* any arithmetic
(a NaN behind a `torch.where` still poisons the backward pass). docs/numerics.md says why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

import torch

LossAgg = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]


# ---- registries ----------------------------------------------------------------------------------
class AdvEstimator(Protocol):
    def __call__(
        self, rewards: torch.Tensor, group_ids: torch.Tensor, *, norm_by_std: bool = True, eps: float = 1e-6
    ) -> torch.Tensor: ...


class PolicyLoss(Protocol):
    def __call__(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        advantages: torch.Tensor,
        *,
        clip_low: float,
        clip_high: float,
        clip_ratio_c: float = ...,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


ADV_ESTIMATORS: dict[str, AdvEstimator] = {}
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_adv_est(name: str) -> Callable[[AdvEstimator], AdvEstimator]:
    def deco(fn: AdvEstimator) -> AdvEstimator:
        if name in ADV_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADV_ESTIMATORS[name] = fn
        return fn

    return deco


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    def deco(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return deco


def get_adv_estimator(name: str) -> AdvEstimator:
    try:
        return ADV_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; valid names: {', '.join(sorted(ADV_ESTIMATORS))}"
        ) from None


def get_policy_loss(name: str) -> PolicyLoss:
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy loss {name!r}; valid names: {', '.join(sorted(POLICY_LOSSES))}"
        ) from None


# ---- advantages ----------------------------------------------------------------------------------
@register_adv_est("grpo")
def compute_grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised advantages: (r - mean_group) / (std_group + eps).

    rewards: (N,) float; group_ids: (N,) long, samples of one prompt share an id. std is the
    unbiased sample std (as verl); a group of one sample gets advantage 0. Returns (N,) float32.
    """
    r = rewards.to(torch.float64)
    _, inv = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inv.max().item()) + 1 if inv.numel() else 0
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inv, torch.ones_like(r))
    total = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inv, r)
    mean = total / count
    centred = r - mean[inv]
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inv, centred**2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    single = (count == 1)[inv]
    adv = centred / (std[inv] + eps) if norm_by_std else centred
    return torch.where(single, torch.zeros_like(adv), adv).to(torch.float32)


def compute_grpo_advantages_reference(
    rewards: list[float], group_ids: list[int], *, norm_by_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """Slow loop reference of `compute_grpo_advantages`."""
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for members in groups.values():
        if len(members) == 1:
            continue
        vals = [rewards[i] for i in members]
        mean = sum(vals) / len(vals)
        std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5
        for i in members:
            out[i] = (rewards[i] - mean) / (std + eps) if norm_by_std else rewards[i] - mean
    return out


# ---- policy losses -------------------------------------------------------------------------------
# The log-ratio log π − log π_old is clamped here before exp (verl's ±20): one token whose log-prob
# collapsed (or fell outside the trainer's top-p nucleus, -inf) must not make the ratio inf or 0·inf.
LOG_RATIO_CLAMP = 20.0
# Dual-clip default (Ye et al. 2020, verl's clip_ratio_c): for A < 0 the loss is at most -A·c.
DEFAULT_CLIP_RATIO_C = 3.0


def clamped_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """log π − log π_old clamped to ±`LOG_RATIO_CLAMP` (its gradient is 0 where clamped). (T,) -> (T,)."""
    return torch.clamp(logp - old_logp, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)


def in_nucleus(*logps: torch.Tensor) -> torch.Tensor:
    """True where every given log-prob of a token is finite: the token lies inside each policy's
    top-p nucleus. (T,) each -> (T,) bool. A token where one is -inf is dropped from every term."""
    valid = torch.isfinite(logps[0])
    for lp in logps[1:]:
        valid = valid & torch.isfinite(lp)
    return valid


def zero_where_dropped(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`x` with 0 where `valid` is False, so no -inf or NaN reaches arithmetic (or its backward)."""
    return torch.where(valid, x, torch.zeros_like(x))


def dual_clip_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, *, clip_low: float, clip_high: float, clip_ratio_c: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip with separate low/high bounds (DAPO clip-higher) and dual-clip for A < 0 (verl's
    `compute_policy_loss_vanilla`). Inputs (T,); returns (per-token loss, clipped indicator) (T,).

    loss_t = max(-A_t·ρ_t, -A_t·clip(ρ_t, 1-clip_low, 1+clip_high)), and for A_t < 0 at most
    -A_t·clip_ratio_c (a huge ratio on a negative advantage cannot dominate the batch).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual-clip), got {clip_ratio_c}")
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual = torch.minimum(loss, -advantages * clip_ratio_c)
    return torch.where(advantages < 0, dual, loss), (clipped > unclipped).to(ratio.dtype)


@register_policy_loss("clipped")
def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float = DEFAULT_CLIP_RATIO_C,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip per token with separate low/high bounds (DAPO clip-higher) and dual-clip.

    All inputs (T,). Returns (per-token loss (T,), per-token clipped indicator (T,) float).
    ρ_t = exp(clamp(logp_t - old_logp_t, ±20)); the loss is `dual_clip_loss`, times `weights` (a
    detached per-token rollout correction, `rljob_trainer.train.rollout_correction`) when given. A
    token outside either policy's nucleus (a -inf log-prob) gives 0 and no gradient (`in_nucleus`).
    """
    valid = in_nucleus(logp, old_logp)
    lp, olp = zero_where_dropped(logp, valid), zero_where_dropped(old_logp, valid)
    ratio = torch.exp(clamped_log_ratio(lp, olp))
    loss, clipped = dual_clip_loss(
        ratio, advantages, clip_low=clip_low, clip_high=clip_high, clip_ratio_c=clip_ratio_c
    )
    keep = valid.to(loss.dtype)
    if weights is not None:
        keep = keep * weights.detach().to(loss.dtype)
    return loss * keep, clipped * valid.to(clipped.dtype)


def clipped_policy_loss_reference(
    logp: list[float],
    old_logp: list[float],
    advantages: list[float],
    *,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float = DEFAULT_CLIP_RATIO_C,
) -> list[float]:
    """Slow per-token reference of `clipped_policy_loss` (losses only; 0 for a -inf log-prob)."""
    import math

    out = []
    for lp, olp, a in zip(logp, old_logp, advantages, strict=True):
        if not (math.isfinite(lp) and math.isfinite(olp)):
            out.append(0.0)
            continue
        ratio = math.exp(min(max(lp - olp, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP))
        loss = max(-a * ratio, -a * min(max(ratio, 1.0 - clip_low), 1.0 + clip_high))
        out.append(min(loss, -a * clip_ratio_c) if a < 0 else loss)
    return out


@register_policy_loss("clipped-tis")
def clipped_tis_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float = DEFAULT_CLIP_RATIO_C,
    rollout_logp: torch.Tensor | None = None,
    tis_cap: float = 2.0,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip corrected for off-policy rollouts by truncated importance sampling (decoupled PPO).

    All inputs (T,). `old_logp` is the trainer's log-prob under the weights of this step (the
    proximal policy), `rollout_logp` the engine's log-prob when it sampled the token (the behaviour
    policy: older weights under an async pipeline, and another kernel stack either way). Each token's
    clipped loss is weighted by w_t = min(exp(old_logp_t - rollout_logp_t), tis_cap), a constant
    (no gradient), as verl's TIS and Hilton et al.'s decoupled PPO do. Without `rollout_logp` it is
    `clipped_policy_loss`; given `weights` (the trainer's `spec.grpo.rolloutCorrection`, which
    replaces tisCap) those are used as they are. Returns (per-token loss (T,), clipped indicator (T,)).
    """
    if weights is None and rollout_logp is not None:
        weights = truncated_is_weights(old_logp, rollout_logp, tis_cap=tis_cap)
    return clipped_policy_loss(
        logp,
        old_logp,
        advantages,
        clip_low=clip_low,
        clip_high=clip_high,
        clip_ratio_c=clip_ratio_c,
        weights=weights,
    )


def truncated_is_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, *, tis_cap: float
) -> torch.Tensor:
    """Per-token importance weights π_old/π_rollout, truncated at `tis_cap` and detached. (T,) -> (T,).
    0 where either log-prob is -inf (the token is dropped, `in_nucleus`)."""
    if tis_cap <= 0:
        raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
    valid = in_nucleus(old_logp, rollout_logp)
    log_w = clamped_log_ratio(zero_where_dropped(old_logp, valid), zero_where_dropped(rollout_logp, valid))
    return (torch.exp(log_w).clamp(max=tis_cap) * valid.to(log_w.dtype)).detach()


def clipped_tis_policy_loss_reference(
    logp: list[float],
    old_logp: list[float],
    advantages: list[float],
    rollout_logp: list[float],
    *,
    clip_low: float,
    clip_high: float,
    tis_cap: float,
) -> list[float]:
    """Slow per-token reference of `clipped_tis_policy_loss` (losses only)."""
    import math

    base = clipped_policy_loss_reference(logp, old_logp, advantages, clip_low=clip_low, clip_high=clip_high)
    return [
        loss * min(math.exp(olp - rlp), tis_cap) if math.isfinite(olp) and math.isfinite(rlp) else 0.0
        for loss, olp, rlp in zip(base, old_logp, rollout_logp, strict=True)
    ]


def compute_off_policy_metrics(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    sample_versions: torch.Tensor,
    *,
    trainer_version: int,
    tis_cap: float,
) -> dict[str, torch.Tensor]:
    """How off-policy one batch was: staleness of its samples and the importance weights' spread.

    old_logp, rollout_logp, mask: (T,) over the batch's tokens (mask 1.0 on response tokens that
    count); sample_versions: (N,) long, the weights version each sample was generated with. Staleness
    of a sample is `trainer_version - version` (0 = on-policy). IS weights are the untruncated
    π_old/π_rollout over masked tokens inside both nuclei; `truncated_fraction` is the share above
    `tis_cap`. Returns
    0-d tensors named `off_policy/*` (callers call `.item()`); an empty batch gives zeros.
    """
    staleness = (trainer_version - sample_versions).to(torch.float64)
    keep = (mask > 0) & in_nucleus(old_logp, rollout_logp)  # a -inf log-prob: dropped, as in the loss
    weights = torch.exp((old_logp[keep] - rollout_logp[keep]).to(torch.float64))
    zero = torch.zeros((), dtype=torch.float64)
    return {
        "off_policy/staleness_mean": staleness.mean() if staleness.numel() else zero,
        "off_policy/staleness_max": staleness.max() if staleness.numel() else zero,
        "off_policy/is_weight_mean": weights.mean() if weights.numel() else zero,
        "off_policy/is_weight_max": weights.max() if weights.numel() else zero,
        "off_policy/truncated_fraction": (weights > tis_cap).to(torch.float64).mean()
        if weights.numel()
        else zero,
    }


def compute_off_policy_metrics_reference(
    old_logp: list[float],
    rollout_logp: list[float],
    mask: list[float],
    sample_versions: list[int],
    *,
    trainer_version: int,
    tis_cap: float,
) -> dict[str, float]:
    """Slow reference of `compute_off_policy_metrics`."""
    import math

    staleness = [trainer_version - v for v in sample_versions]
    weights = [
        math.exp(o - r)
        for o, r, m in zip(old_logp, rollout_logp, mask, strict=True)
        if m > 0 and math.isfinite(o) and math.isfinite(r)
    ]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    return {
        "off_policy/staleness_mean": mean([float(s) for s in staleness]),
        "off_policy/staleness_max": float(max(staleness, default=0)),
        "off_policy/is_weight_mean": mean(weights),
        "off_policy/is_weight_max": max(weights, default=0.0),
        "off_policy/truncated_fraction": mean([float(w > tis_cap) for w in weights]),
    }


# ---- per-token staleness (partial rollouts) -----------------------------------------------------
def token_staleness(token_versions: torch.Tensor, *, trainer_version: int) -> torch.Tensor:
    """Weight updates each token is behind the trainer (0 = on-policy). (T,) long -> (T,) long.

    With partial rollouts one response spans weights versions (tokens before an interrupted weight
    sync, tokens after it), so staleness, like the truncated IS weight, is a per-token quantity."""
    return trainer_version - token_versions.to(torch.long)


def compute_token_staleness_metrics(
    token_versions: torch.Tensor, interrupted: torch.Tensor, *, trainer_version: int
) -> dict[str, torch.Tensor]:
    """How stale one batch's response tokens were, and how many of its requests were resumed.

    token_versions: (T,) long over the batch's response tokens, the weights version each was sampled
    with; interrupted: (N,) bool, request n was interrupted at a weight sync and resumed. Returns 0-d
    tensors `rollout/staleness_tokens_mean`, `rollout/staleness_tokens_max`, `rollout/partial_fraction`
    (zeros for an empty batch)."""
    stale = token_staleness(token_versions, trainer_version=trainer_version).to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64)
    return {
        "rollout/staleness_tokens_mean": stale.mean() if stale.numel() else zero,
        "rollout/staleness_tokens_max": stale.max() if stale.numel() else zero,
        "rollout/partial_fraction": interrupted.to(torch.float64).mean() if interrupted.numel() else zero,
    }


def compute_token_staleness_metrics_reference(
    token_versions: list[int], interrupted: list[bool], *, trainer_version: int
) -> dict[str, float]:
    """Slow reference of `compute_token_staleness_metrics`."""
    stale = [float(trainer_version - v) for v in token_versions]
    return {
        "rollout/staleness_tokens_mean": sum(stale) / len(stale) if stale else 0.0,
        "rollout/staleness_tokens_max": max(stale, default=0.0),
        "rollout/partial_fraction": sum(interrupted) / len(interrupted) if interrupted else 0.0,
    }


# ---- KL ------------------------------------------------------------------------------------------
def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: Literal["k1", "k2", "k3"]) -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) from samples of π (Schulman's k1/k2/k3). (T,) -> (T,).

    k3 = exp(ref - logp) - (ref - logp) - 1 is unbiased and non-negative; the log-ratio is clamped to
    ±20 first and k3 to [-10, 10], as verl does, to keep one outlier token from dominating (verl
    clamps k3's log-ratio only: k1 and k2 here are clamped too, a convention the parity tier asserts).
    A token outside either nucleus (-inf) gives 0 and no gradient (`in_nucleus`).
    """
    if kind not in ("k1", "k2", "k3"):
        raise ValueError(f"unknown KL estimator {kind!r}; valid names: k1, k2, k3")
    valid = in_nucleus(logp, ref_logp)
    log_ratio = clamped_log_ratio(zero_where_dropped(logp, valid), zero_where_dropped(ref_logp, valid))
    if kind == "k1":
        out = log_ratio
    elif kind == "k2":
        out = 0.5 * log_ratio**2
    else:
        d = -log_ratio
        out = torch.clamp(torch.exp(d) - d - 1.0, min=-10.0, max=10.0)
    return out * valid.to(out.dtype)


# ---- aggregation ---------------------------------------------------------------------------------
def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    *,
    mode: LossAgg,
    global_num_seqs: int,
    global_num_tokens: int,
    token_sum_norm: int | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the global-batch loss (a scalar).

    seq-mean-token-mean: Σ_seq (Σ_t l·m / Σ_t m) / global_num_seqs — every sequence weighs the
    same however long it is and wherever (rank, micro-batch) it landed, so summing the shares over
    micro-batches and ranks gives exactly the per-sequence mean over the global batch and DP
    balancing (which only moves sequences) leaves the gradient unchanged.
    token-mean: Σ l·m / global_num_tokens.
    seq-mean-token-sum-norm (Dr. GRPO): Σ_seq (Σ_t l·m / token_sum_norm) / global_num_seqs with a
    constant `token_sum_norm` (the completion-length cap), so long answers are not down-weighted
    per token; like seq-mean-token-mean it is a sum over sequences, hence DP-balance invariant.
    """
    if global_num_seqs < 1 or global_num_tokens < 1:
        raise ValueError("global_num_seqs and global_num_tokens must be >= 1")
    lm = per_token * mask
    if mode == "token-mean":
        return lm.sum() / global_num_tokens
    if mode == "seq-mean-token-mean":
        n = int(seq_ids.max().item()) + 1 if seq_ids.numel() else 0
        seq_sum = torch.zeros(n, dtype=lm.dtype, device=lm.device).index_add(0, seq_ids, lm)
        seq_len = torch.zeros(n, dtype=lm.dtype, device=lm.device).index_add(0, seq_ids, mask.to(lm.dtype))
        return (seq_sum / seq_len.clamp(min=1.0)).sum() / global_num_seqs
    if mode == "seq-mean-token-sum-norm":
        return lm.sum() / (_token_sum_norm(token_sum_norm) * global_num_seqs)
    raise ValueError(
        f"unknown loss aggregation {mode!r}; valid: seq-mean-token-mean, token-mean, seq-mean-token-sum-norm"
    )


def _token_sum_norm(token_sum_norm: int | None) -> int:
    if token_sum_norm is None or token_sum_norm < 1:
        raise ValueError("seq-mean-token-sum-norm needs token_sum_norm >= 1 (the completion-length cap)")
    return token_sum_norm


def aggregate_loss_reference(
    per_token: list[float],
    mask: list[float],
    seq_ids: list[int],
    *,
    mode: LossAgg,
    global_num_seqs: int,
    global_num_tokens: int,
    token_sum_norm: int | None = None,
) -> float:
    """Slow reference of `aggregate_loss`."""
    if mode == "token-mean":
        return sum(v * m for v, m in zip(per_token, mask, strict=True)) / global_num_tokens
    if mode == "seq-mean-token-sum-norm":
        norm = _token_sum_norm(token_sum_norm)
        per_seq: dict[int, float] = {}
        for v, m, s in zip(per_token, mask, seq_ids, strict=True):
            per_seq[s] = per_seq.get(s, 0.0) + v * m / norm
        return sum(per_seq.values()) / global_num_seqs
    sums: dict[int, float] = {}
    lens: dict[int, float] = {}
    for v, m, s in zip(per_token, mask, seq_ids, strict=True):
        sums[s] = sums.get(s, 0.0) + v * m
        lens[s] = lens.get(s, 0.0) + m
    return sum(sums[s] / max(lens[s], 1.0) for s in sums) / global_num_seqs


# ---- GSPO, clip metrics, loss traits -------------------------------------------------------------
# verl's compute_policy_loss_gspo clamps the sequence log-ratio from above at 10.
GSPO_LOG_RATIO_MAX = 10.0


def _seq_mean(values: torch.Tensor, seq_ids: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sequence mean of `values` (T,) by `seq_ids` (T,) over the `valid` tokens (all when None),
    broadcast back to tokens (T,); a sequence without valid tokens gets 0."""
    n = int(seq_ids.max().item()) + 1 if seq_ids.numel() else 0
    w = torch.ones_like(values) if valid is None else valid.to(values.dtype)
    sums = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, seq_ids, values * w)
    counts = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, seq_ids, w)
    return (sums / counts.clamp(min=1.0))[seq_ids]


@register_policy_loss("gspo")
def gspo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    seq_ids: torch.Tensor,
    clip_ratio_c: float = DEFAULT_CLIP_RATIO_C,
    rollout_logp: torch.Tensor | None = None,
    tis_cap: float = 2.0,
    weights: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"; verl's
    `compute_policy_loss_gspo`): one importance ratio per sequence, the geometric mean of its token
    ratios s_i = exp(mean_t(log π_t − log π_old,t)), clipped per sequence. Token form (GSPO-token):
    s_i,t = sg[s_i] · π_t / sg[π_t], so every token of a sequence carries the same value and the
    gradient of log π_t. All inputs (T,), `seq_ids` the sequence of each token. `weights` (a
    detached per-token rollout correction) multiply each token's loss; without them, `rollout_logp`
    (staleness > 0) gives the truncated IS weight at `tis_cap`, as `clipped-tis` does.
    `clip_ratio_c` is accepted for a uniform call and unused (GSPO has no dual-clip). A token outside
    either nucleus (-inf: log π − sg[log π] would be NaN) gives 0 and no gradient and is left out of
    its sequence's mean. `mask` (T,) (1.0 on tokens that count; a multi-turn episode's observation
    tokens are 0) leaves the tokens it drops out of the sequence's mean as well; the caller's
    aggregation drops their loss. Returns (per-token loss (T,), clipped indicator (T,) float).
    """
    del clip_ratio_c
    valid = in_nucleus(logp, old_logp)
    lp, olp = zero_where_dropped(logp, valid), zero_where_dropped(old_logp, valid)
    in_mean = valid if mask is None else valid & (mask > 0)
    seq_log_ratio = _seq_mean(clamped_log_ratio(lp, olp), seq_ids, in_mean)
    log_s = torch.clamp(lp - lp.detach() + seq_log_ratio.detach(), max=GSPO_LOG_RATIO_MAX)
    ratio = torch.exp(log_s)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if weights is None and rollout_logp is not None:
        weights = truncated_is_weights(old_logp, rollout_logp, tis_cap=tis_cap)
    keep = valid.to(loss.dtype)
    if weights is not None:
        keep = keep * weights.detach().to(loss.dtype)
    return loss * keep, (clipped > unclipped).to(logp.dtype) * valid.to(logp.dtype)


register_policy_loss("gspo-tis")(gspo_policy_loss)


def gspo_policy_loss_reference(
    logp: list[float],
    old_logp: list[float],
    advantages: list[float],
    seq_ids: list[int],
    *,
    clip_low: float,
    clip_high: float,
) -> list[float]:
    """Slow per-token reference of `gspo_policy_loss` (losses only, no TIS; 0 for a -inf log-prob)."""
    import math

    per_seq: dict[int, list[float]] = {}
    for lp, olp, s in zip(logp, old_logp, seq_ids, strict=True):
        per_seq.setdefault(s, [])
        if math.isfinite(lp) and math.isfinite(olp):
            per_seq[s].append(min(max(lp - olp, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP))
    out = []
    for lp, olp, a, s in zip(logp, old_logp, advantages, seq_ids, strict=True):
        if not (math.isfinite(lp) and math.isfinite(olp)):
            out.append(0.0)
            continue
        ratio = math.exp(min(sum(per_seq[s]) / len(per_seq[s]), GSPO_LOG_RATIO_MAX))
        out.append(max(-a * ratio, -a * min(max(ratio, 1.0 - clip_low), 1.0 + clip_high)))
    return out


def ppo_clip_metrics(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float = DEFAULT_CLIP_RATIO_C,
) -> dict[str, torch.Tensor]:
    """Per-token indicators of which bound of the PPO clip binds, and the ppo_kl estimate. (T,) each.

    `clipped_high`: A > 0 and ρ > 1 + clip_high (the update is stopped from raising π further);
    `clipped_low`: A < 0 and ρ < 1 − clip_low; `dual_clipped`: A < 0 and the clipped loss above
    −A·clip_ratio_c, so the dual-clip bound binds (verl's `pg_clipfrac_lower`, computed as verl does);
    `ppo_kl`: log π_old − log π (k1 of KL(π_old‖π), clamped as the loss clamps it);
    `out_of_nucleus`: either log-prob is -inf (every other indicator is 0 there). Callers sum them over
    tokens (`pg_clipfrac_ratio_low`, `pg_clipfrac_ratio_high`, `pg_clipfrac_lower`, `ppo_kl` are token
    means over the step's updates).
    """
    valid = in_nucleus(logp, old_logp)
    v = valid.to(torch.float32)
    log_ratio = clamped_log_ratio(zero_where_dropped(logp, valid), zero_where_dropped(old_logp, valid))
    ratio = torch.exp(log_ratio)
    clip_loss = torch.maximum(
        -advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    )
    return {
        "clipped_high": ((advantages > 0) & (ratio > 1.0 + clip_high)).to(torch.float32) * v,
        "clipped_low": ((advantages < 0) & (ratio < 1.0 - clip_low)).to(torch.float32) * v,
        "dual_clipped": ((advantages < 0) & (clip_loss > -advantages * clip_ratio_c)).to(torch.float32) * v,
        "ppo_kl": -log_ratio.to(torch.float32) * v,
        "out_of_nucleus": 1.0 - v,
    }


def uses_rollout_logprobs(policy_loss: str) -> bool:
    """Whether a registered loss weights tokens by truncated importance sampling (`*-tis`)."""
    return policy_loss.endswith("-tis")


def needs_seq_ids(policy_loss: str) -> bool:
    """Whether a registered loss needs each token's sequence (`seq_ids`): the sequence-level ones."""
    return policy_loss.startswith("gspo")

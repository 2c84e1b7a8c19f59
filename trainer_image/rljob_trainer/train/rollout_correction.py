"""Rollout corrections: how far the engine's behaviour policy is from the trainer's, and what to do.

Role: the pure tensor math of `spec.grpo.rolloutCorrection` (trainer config `grpo.rollout_correction`).
The engine samples from π_rollout (older weights under the asynchronous pipeline, another kernel
stack and dtype always); the trainer's old log-probs are π_old. Per token the ratio r = π_old /
π_rollout, aggregated at a level (`LEVELS`: the token, the whole sequence (a product of token
ratios), or its geometric mean), then
- importance sampling (`IS_MODES`): the loss of each token times a detached weight, `truncate`d at
  `upper` (TIS) or `mask`ed to 0 outside [lower, upper] (masked IS; at the token level IcePop),
- rejection (`reject_mask`): a 0/1 mask dropping the tokens (or whole sequences) whose ratio at the
  rejection level lies outside [lower, upper];
and off-policy metrics (`correction_sums` then `correction_metrics`, verl's names and formulas).
Named variants sit in registries like `rljob_trainer.train.algos`; each fast function has a slow
reference here that a unit test holds it to, and `tests/peer/` runs verl 0.9.1's own code
(`verl/trainer/ppo/rollout_corr_helper.py`) on the same tensors.

Conventions (docs/numerics.md): the ratio is π_old/π_rollout and [lower, upper] bound that ratio
(verl's `*_k1` rejection bounds π_rollout/π_old: its "a_b" is our (1/b, 1/a)); a token with a -inf
log-prob (outside a top-p nucleus) takes no part: weight 0, left out of its sequence's sum and every
metric; rejected and masked tokens keep their place in the loss's denominators (verl drops rejected
ones from its token counts; IcePop and verl's masked IS keep them, as here).

Token tensors are flat (T,), with `seq_ids` (T,) long numbering the micro-batch's sequences from 0 and
`mask` (T,) float (1.0 on tokens that count). Callers: `rljob_trainer.train.trainer`, tests, bench.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from rljob_trainer.train import algos

Level = Literal["token", "sequence", "geometric"]
LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
# verl's SAFETY_BOUND: a log-ratio is clamped to ±20 before exp (exp(20) ≈ 4.9e8).
SAFETY_BOUND = algos.LOG_RATIO_CLAMP


@dataclass(frozen=True)
class Correction:
    """What one job asks for (the trainer config's `grpo.rollout_correction`, resolved).

    `is_level` None: no importance weights (rejection and metrics only). `is_mode` "truncate" uses
    `is_upper` alone; "mask" keeps weights inside [`is_lower`, `is_upper`]. `reject_level` None: no
    rejection. A `*_lower` of None is 1 / its upper (slime's and verl's default)."""

    is_level: Level | None = "token"
    is_mode: Literal["truncate", "mask"] = "truncate"
    is_lower: float | None = None
    is_upper: float = 2.0
    reject_level: Level | None = None
    reject_lower: float | None = None
    reject_upper: float = 2.0

    def __post_init__(self) -> None:
        for name, level in (("is_level", self.is_level), ("reject_level", self.reject_level)):
            if level is not None and level not in LEVELS:
                raise ValueError(f"{name} must be one of {', '.join(LEVELS)} or None, got {level!r}")
        if self.is_mode not in IS_MODES:
            raise ValueError(
                f"unknown importance-sampling mode {self.is_mode!r}; valid: {', '.join(IS_MODES)}"
            )
        for lo, hi, what in (
            (self.is_lower, self.is_upper, "importance sampling"),
            (self.reject_lower, self.reject_upper, "rejection"),
        ):
            if hi <= 0 or (lo is not None and not 0 < lo <= hi):
                raise ValueError(f"{what} bounds need 0 < lower <= upper, got lower={lo}, upper={hi}")


def bounds(lower: float | None, upper: float) -> tuple[float, float]:
    """(lower, upper) with the default lower 1 / upper."""
    return (1.0 / upper if lower is None else lower), upper


# ---- ratios at a level ---------------------------------------------------------------------------
def _seq_sum(values: torch.Tensor, seq_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-sequence Σ values·weight broadcast back to tokens. (T,) -> (T,)."""
    n = int(seq_ids.max().item()) + 1 if seq_ids.numel() else 0
    sums = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, seq_ids, values * weight)
    return sums[seq_ids]


def token_log_ratios(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π_old − log π_rollout with 0 where dropped, the float mask of tokens that take part).

    A token takes part where `mask` > 0 and both log-probs are finite (`algos.in_nucleus`)."""
    valid = (mask > 0) & algos.in_nucleus(old_logp, rollout_logp)
    lr = algos.zero_where_dropped(old_logp, valid) - algos.zero_where_dropped(rollout_logp, valid)
    return lr, valid.to(lr.dtype)


def level_log_ratios(
    log_ratio: torch.Tensor, valid: torch.Tensor, seq_ids: torch.Tensor, level: Level
) -> torch.Tensor:
    """The log-ratio each token is judged by (T,): its own (token), its sequence's sum (sequence:
    log Π r_t, verl's sequence IS) or mean (geometric: log of the geometric mean, verl's seq_mean_k1,
    slime's geometric level); sums and means run over the tokens that take part."""
    if level == "token":
        return log_ratio
    total = _seq_sum(log_ratio, seq_ids, valid)
    if level == "sequence":
        return total
    if level == "geometric":
        count = _seq_sum(torch.ones_like(log_ratio), seq_ids, valid)
        return total / count.clamp(min=1.0)
    raise ValueError(f"unknown level {level!r}; valid: {', '.join(LEVELS)}")


# ---- importance weights --------------------------------------------------------------------------
ISMode = Callable[[torch.Tensor, float, float], torch.Tensor]
IS_MODES: dict[str, ISMode] = {}


def register_is_mode(name: str) -> Callable[[ISMode], ISMode]:
    def deco(fn: ISMode) -> ISMode:
        if name in IS_MODES:
            raise ValueError(f"importance-sampling mode {name!r} is already registered")
        IS_MODES[name] = fn
        return fn

    return deco


def get_is_mode(name: str) -> ISMode:
    try:
        return IS_MODES[name]
    except KeyError:
        raise ValueError(
            f"unknown importance-sampling mode {name!r}; valid: {', '.join(sorted(IS_MODES))}"
        ) from None


@register_is_mode("truncate")
def truncated_weights(level_log_ratio: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """Truncated IS (TIS): w = min(exp(clamp(log r, ±20)), upper); `lower` unused. (T,) -> (T,).

    Token level: verl's `rollout_is: token` (Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training", verl PR #2953); sequence level: verl's `rollout_is: sequence`
    (Liu et al. 2025, "When speed kills stability"); slime's `tis_mode: truncate`."""
    del lower
    return torch.exp(level_log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).clamp(max=upper)


@register_is_mode("mask")
def masked_weights(level_log_ratio: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """Masked IS: w = r where lower <= r <= upper, else 0 (r = exp(clamp(log r, ±20))). (T,) -> (T,).

    At the token level this is IcePop (Ling team 2025, "Every step evolves", AReaL's
    `behave_imp_weight_mode: token_mask` with a lower bound; verl's `rollout_is_threshold: "lo_hi"`,
    `decoupled_token_icepop`); at the sequence or geometric level slime's `tis_mode: mask` (MIS).
    The bounds are compared on the log scale, so a ratio on a bound counts as inside."""
    r = torch.exp(level_log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    inside = (level_log_ratio >= math.log(lower)) & (level_log_ratio <= math.log(upper))
    return torch.where(inside, r, torch.zeros_like(r))


def reject_mask(level_log_ratio: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """Rejection: 1.0 where lower <= r <= upper at the level, else 0.0. (T,) -> (T,).

    verl's `rollout_rs` `token_k1` / `seq_sum_k1` / `seq_mean_k1` (geometric: `decoupled_geo_rs`),
    slime's `use_rs` with `rs_level`; the ratio here is π_old/π_rollout (verl's k1 bounds the inverse)."""
    inside = (level_log_ratio >= math.log(lower)) & (level_log_ratio <= math.log(upper))
    return inside.to(level_log_ratio.dtype)


def correction_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    correction: Correction,
) -> dict[str, torch.Tensor]:
    """Each token's detached loss multiplier and what went into it. Inputs (T,); outputs (T,) each:

    `weight` = IS weight × rejection keep × takes part (what the policy loss multiplies by),
    `is_weight` (1.0 without IS), `is_raw` (the untruncated level ratio), `keep` (1.0 without
    rejection), `valid` (mask and both log-probs finite)."""
    lr, valid = token_log_ratios(old_logp.detach(), rollout_logp.detach(), mask)
    is_raw = torch.exp(
        level_log_ratios(lr, valid, seq_ids, correction.is_level or "token").clamp(
            -SAFETY_BOUND, SAFETY_BOUND
        )
    )
    if correction.is_level is None:
        is_weight = torch.ones_like(lr)
    else:
        lo, hi = bounds(correction.is_lower, correction.is_upper)
        is_weight = get_is_mode(correction.is_mode)(
            level_log_ratios(lr, valid, seq_ids, correction.is_level), lo, hi
        )
    if correction.reject_level is None:
        keep = torch.ones_like(lr)
    else:
        lo, hi = bounds(correction.reject_lower, correction.reject_upper)
        keep = reject_mask(level_log_ratios(lr, valid, seq_ids, correction.reject_level), lo, hi)
    return {
        "weight": (is_weight * keep * valid).detach(),
        "is_weight": is_weight * valid,
        "is_raw": is_raw * valid,
        "keep": keep * valid + (1.0 - valid),
        "valid": valid,
    }


def correction_weights_reference(
    old_logp: list[float],
    rollout_logp: list[float],
    mask: list[float],
    seq_ids: list[int],
    correction: Correction,
) -> list[float]:
    """Slow per-token reference of `correction_weights(...)["weight"]`."""
    valid = [
        m > 0 and math.isfinite(o) and math.isfinite(r)
        for o, r, m in zip(old_logp, rollout_logp, mask, strict=True)
    ]
    per_seq: dict[int, list[float]] = {}
    for o, r, s, v in zip(old_logp, rollout_logp, seq_ids, valid, strict=True):
        per_seq.setdefault(s, [])
        if v:
            per_seq[s].append(o - r)

    def at(level: str, i: int) -> float:
        if level == "token":
            return old_logp[i] - rollout_logp[i]
        xs = per_seq[seq_ids[i]]
        return sum(xs) if level == "sequence" else (sum(xs) / len(xs) if xs else 0.0)

    out = []
    for i, v in enumerate(valid):
        if not v:
            out.append(0.0)
            continue
        w = 1.0
        if correction.is_level is not None:
            x = at(correction.is_level, i)
            r = math.exp(min(max(x, -SAFETY_BOUND), SAFETY_BOUND))
            lo, hi = bounds(correction.is_lower, correction.is_upper)
            if correction.is_mode == "truncate":
                w = min(r, hi)
            else:
                w = r if math.log(lo) <= x <= math.log(hi) else 0.0
        if correction.reject_level is not None:
            x = at(correction.reject_level, i)
            lo, hi = bounds(correction.reject_lower, correction.reject_upper)
            w *= 1.0 if math.log(lo) <= x <= math.log(hi) else 0.0
        out.append(w)
    return out


# ---- metrics -------------------------------------------------------------------------------------
# The per-rank sums `correction_sums` returns; the driver adds them over micro-batches and ranks.
SUM_KEYS: tuple[str, ...] = (
    "tokens",  # tokens that take part (in both nuclei, in the mask)
    "seqs",  # sequences with at least one such token
    "out_of_nucleus_tokens",  # masked tokens with a -inf log-prob on either side
    "masked_tokens",  # mask > 0 (all response tokens)
    "kl_sum",  # Σ log π_rollout − log π_old
    "k3_sum",  # Σ r − log r − 1
    "chi2_token_sum",  # Σ r² (clamped log r)
    "chi2_seq_sum",  # Σ_seq (Π r)² (clamped Σ log r)
    "training_ppl_sum",  # Σ_seq exp(−mean log π_old)
    "rollout_ppl_sum",  # Σ_seq exp(−mean log π_rollout)
    "training_log_ppl_sum",
    "rollout_log_ppl_sum",
    "ppl_ratio_sum",  # Σ_seq exp(mean log π_rollout − mean log π_old)
    "log_ppl_abs_diff_sum",
    "is_weight_sum",  # Σ applied IS weights (before rejection)
    "is_high_tokens",  # raw level ratio > upper
    "is_low_tokens",  # raw level ratio < lower
    "is_masked_tokens",  # mask mode: weight zeroed
    "rejected_tokens",
    "rejected_seqs",  # sequences with at least one rejected token
    "abs_diff_sum",  # Σ |log π_old − log π_rollout| (rollout/logprob_diff)
)


def correction_sums(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    correction: Correction | None,
) -> dict[str, torch.Tensor]:
    """Sums over one micro-batch (0-d float64 tensors, `SUM_KEYS`) that `correction_metrics` turns into
    the step's metrics once added over micro-batches and ranks. `correction` None: no IS/rejection,
    the mismatch metrics only. Tokens outside either nucleus are only counted."""
    old64, roll64, mask64 = old_logp.detach().double(), rollout_logp.detach().double(), mask.double()
    w = correction_weights(old64, roll64, mask64, seq_ids, correction or Correction(is_level=None))
    lr, valid = token_log_ratios(old64, roll64, mask64)
    old0, roll0 = algos.zero_where_dropped(old64, valid > 0), algos.zero_where_dropped(roll64, valid > 0)
    n = int(seq_ids.max().item()) + 1 if seq_ids.numel() else 0

    def per_seq(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.float64, device=values.device).index_add(0, seq_ids, values * valid)

    count = per_seq(torch.ones_like(lr))
    has = count > 0
    mean_old = per_seq(old0)[has] / count[has]
    mean_roll = per_seq(roll0)[has] / count[has]
    log_ratio_sum = per_seq(lr)[has]
    r = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    zero = torch.zeros((), dtype=torch.float64)
    out = {
        "tokens": valid.sum(),
        "seqs": has.sum().to(torch.float64),
        "out_of_nucleus_tokens": ((mask64 > 0).to(torch.float64) - valid).sum(),
        "masked_tokens": (mask64 > 0).to(torch.float64).sum(),
        "kl_sum": (-lr * valid).sum(),
        "k3_sum": ((torch.exp(lr) - lr - 1.0) * valid).sum(),
        "chi2_token_sum": (r.square() * valid).sum(),
        "chi2_seq_sum": torch.exp(2.0 * log_ratio_sum.clamp(-SAFETY_BOUND, SAFETY_BOUND)).sum(),
        "training_ppl_sum": torch.exp(-mean_old).sum(),
        "rollout_ppl_sum": torch.exp(-mean_roll).sum(),
        "training_log_ppl_sum": (-mean_old).sum(),
        "rollout_log_ppl_sum": (-mean_roll).sum(),
        "ppl_ratio_sum": torch.exp(mean_roll - mean_old).sum(),
        "log_ppl_abs_diff_sum": (mean_roll - mean_old).abs().sum(),
        "abs_diff_sum": (lr.abs() * valid).sum(),
        "is_weight_sum": zero,
        "is_high_tokens": zero,
        "is_low_tokens": zero,
        "is_masked_tokens": zero,
        "rejected_tokens": zero,
        "rejected_seqs": zero,
    }
    if correction is not None and correction.is_level is not None:
        lo, hi = bounds(correction.is_lower, correction.is_upper)
        raw = w["is_raw"]
        out["is_weight_sum"] = w["is_weight"].sum()
        out["is_high_tokens"] = ((raw > hi) & (valid > 0)).to(torch.float64).sum()
        out["is_low_tokens"] = ((raw < lo) & (valid > 0)).to(torch.float64).sum()
        if correction.is_mode == "mask":
            out["is_masked_tokens"] = ((w["is_weight"] == 0) & (valid > 0)).to(torch.float64).sum()
    if correction is not None and correction.reject_level is not None:
        rejected = (w["keep"] == 0) & (valid > 0)
        out["rejected_tokens"] = rejected.to(torch.float64).sum()
        out["rejected_seqs"] = (per_seq(rejected.to(torch.float64)) > 0).to(torch.float64).sum()
    return out


def correction_metrics(sums: Mapping[str, float]) -> dict[str, float]:
    """The step's `rollout_corr/*` metrics (verl's names where they mean the same; tokens outside a
    nucleus left out) and `rollout/logprob_diff`, `rollout/out_of_nucleus_fraction`, from the sums
    of `correction_sums` added over micro-batches and ranks. An empty batch gives zeros."""

    def ratio(num: str, den: str) -> float:
        d = float(sums.get(den, 0.0))
        return float(sums.get(num, 0.0)) / d if d > 0 else 0.0

    return {
        "rollout/logprob_diff": ratio("abs_diff_sum", "tokens"),
        "rollout/out_of_nucleus_fraction": ratio("out_of_nucleus_tokens", "masked_tokens"),
        "rollout_corr/kl": ratio("kl_sum", "tokens"),
        "rollout_corr/k3_kl": ratio("k3_sum", "tokens"),
        "rollout_corr/training_ppl": ratio("training_ppl_sum", "seqs"),
        "rollout_corr/rollout_ppl": ratio("rollout_ppl_sum", "seqs"),
        "rollout_corr/training_log_ppl": ratio("training_log_ppl_sum", "seqs"),
        "rollout_corr/rollout_log_ppl": ratio("rollout_log_ppl_sum", "seqs"),
        # mean log π_rollout − mean log π_old per sequence = training log-PPL − rollout log-PPL
        "rollout_corr/log_ppl_diff": ratio("training_log_ppl_sum", "seqs")
        - ratio("rollout_log_ppl_sum", "seqs"),
        "rollout_corr/log_ppl_abs_diff": ratio("log_ppl_abs_diff_sum", "seqs"),
        "rollout_corr/ppl_ratio": ratio("ppl_ratio_sum", "seqs"),
        "rollout_corr/chi2_token": ratio("chi2_token_sum", "tokens") - 1.0 if sums.get("tokens") else 0.0,
        "rollout_corr/chi2_seq": ratio("chi2_seq_sum", "seqs") - 1.0 if sums.get("seqs") else 0.0,
        "rollout_corr/rollout_is_mean": ratio("is_weight_sum", "tokens"),
        "rollout_corr/rollout_is_ratio_fraction_high": ratio("is_high_tokens", "tokens"),
        "rollout_corr/rollout_is_ratio_fraction_low": ratio("is_low_tokens", "tokens"),
        "rollout_corr/rollout_is_oob_ratio": ratio("is_masked_tokens", "tokens"),
        "rollout_corr/rollout_rs_masked_fraction": ratio("rejected_tokens", "tokens"),
        "rollout_corr/rollout_rs_seq_masked_fraction": ratio("rejected_seqs", "seqs"),
    }


def correction_metrics_reference(
    old_logp: list[float], rollout_logp: list[float], seq_ids: list[int]
) -> dict[str, float]:
    """Slow reference of the mismatch part of `correction_metrics(correction_sums(...))` (all tokens
    counted, none outside a nucleus): KL, k3, PPLs, PPL ratio, chi^2."""
    seqs: dict[int, list[tuple[float, float]]] = {}
    for o, r, s in zip(old_logp, rollout_logp, seq_ids, strict=True):
        seqs.setdefault(s, []).append((o, r))
    lrs = [o - r for o, r in zip(old_logp, rollout_logp, strict=True)]
    n_tok, n_seq = len(lrs), len(seqs)

    def clamp(x: float) -> float:
        return min(max(x, -SAFETY_BOUND), SAFETY_BOUND)

    mean_o = [sum(o for o, _ in v) / len(v) for v in seqs.values()]
    mean_r = [sum(r for _, r in v) / len(v) for v in seqs.values()]
    sums_lr = [sum(o - r for o, r in v) for v in seqs.values()]
    return {
        "rollout/logprob_diff": sum(abs(x) for x in lrs) / n_tok,
        "rollout_corr/kl": sum(-x for x in lrs) / n_tok,
        "rollout_corr/k3_kl": sum(math.exp(x) - x - 1 for x in lrs) / n_tok,
        "rollout_corr/training_ppl": sum(math.exp(-m) for m in mean_o) / n_seq,
        "rollout_corr/rollout_ppl": sum(math.exp(-m) for m in mean_r) / n_seq,
        "rollout_corr/log_ppl_diff": sum(r - o for o, r in zip(mean_o, mean_r, strict=True)) / n_seq,
        "rollout_corr/ppl_ratio": sum(math.exp(r - o) for o, r in zip(mean_o, mean_r, strict=True)) / n_seq,
        "rollout_corr/chi2_token": sum(math.exp(clamp(x)) ** 2 for x in lrs) / n_tok - 1.0,
        "rollout_corr/chi2_seq": sum(math.exp(2 * clamp(x)) for x in sums_lr) / n_seq - 1.0,
    }

"""Peer parity: rljob's GRPO math against verl 0.9.1's own code on the same tensors.

verl runs for real, in .venv-verl/ (scripts/peer_env.sh, `make setup`; never in the images), through
tests/peer/verl_side.py in a subprocess; rljob's functions run here. The tensors are the issue's: 8
groups x 4 responses, lengths 3-40, clip 0.2/0.28, dual-clip 3, TIS cap 2, in float32 as training
computes. Where the conventions agree the two are equal within `TOL` (1e-6, absolute and relative);
each convention that differs has a test below asserting exactly how (docs/numerics.md lists them).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rljob_trainer.model import sampling
from rljob_trainer.train import algos
from rljob_trainer.train import rollout_correction as rc

pytestmark = [pytest.mark.torch, pytest.mark.peer]

ROOT = Path(__file__).resolve().parents[2]
VERL_PYTHON = ROOT / ".venv-verl" / "bin" / "python"
TOL = 1e-6
GROUPS, PER_GROUP, MAX_LEN, MAX_RESPONSE_TOKENS, VOCAB = 8, 4, 40, 48, 32
CLIP_LOW, CLIP_HIGH, CLIP_C, TIS_CAP = 0.2, 0.28, 3.0, 2.0
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# (key, verl rollout_is, verl rollout_is_threshold, the same as an rljob Correction)
IS_CASES = (
    ("token-tis", "token", 2.0, rc.Correction(is_level="token", is_upper=2.0)),
    ("seq-tis", "sequence", 2.0, rc.Correction(is_level="sequence", is_upper=2.0)),
    ("token-icepop", "token", "0.5_5.0", rc.Correction(is_mode="mask", is_lower=0.5, is_upper=5.0)),
    ("seq-mis", "sequence", "0.5_2.0", rc.Correction(is_level="sequence", is_mode="mask", is_lower=0.5)),
)
# (key, verl rollout_rs option, rljob's [lower, upper] on π_old/π_rollout): verl's k1 bounds the
# inverse ratio, so verl gets "1/upper_1/lower".
RS_CASES = (
    ("token", "token_k1", "token", 0.6, 1.5),
    ("sequence", "seq_sum_k1", "sequence", 0.5, 2.0),
    ("geometric", "seq_mean_k1", "geometric", 0.9, 1.1),
)
# The largest |rljob - verl| / (1 + |verl|) per quantity, within TOL where assert_close (rtol = atol =
# TOL) passes (printed by the last test).
DIFFS: dict[str, float] = {}
Peer = tuple[dict[str, Any], dict[str, Any]]  # (the inputs, what verl computed from them)


def _close(name: str, ours: torch.Tensor | float, theirs: torch.Tensor | float) -> None:
    a = torch.as_tensor(ours, dtype=torch.float64)
    b = torch.as_tensor(theirs, dtype=torch.float64)
    d = float(((a - b).abs() / (1.0 + b.abs())).max()) if a.numel() else 0.0
    DIFFS[name] = max(DIFFS.get(name, 0.0), d)
    torch.testing.assert_close(a, b, rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")


# ---- the tensors ---------------------------------------------------------------------------------
def _inputs() -> dict[str, Any]:
    g = torch.Generator().manual_seed(38)
    b = GROUPS * PER_GROUP
    lengths = torch.randint(3, MAX_LEN + 1, (b,), generator=g)
    lengths[0], lengths[1] = 3, MAX_LEN
    mask = (torch.arange(MAX_LEN)[None, :] < lengths[:, None]).float()
    log_prob = -(torch.rand(b, MAX_LEN, generator=g) * 4 + 0.01)
    old = log_prob + 0.3 * torch.randn(b, MAX_LEN, generator=g)
    far_off = torch.rand(b, MAX_LEN, generator=g) < 0.06  # ratios of e^1.5 = 4.5: the dual clip binds
    old = torch.where(far_off, log_prob - 1.5, old)
    roll = old + 0.4 * torch.randn(b, MAX_LEN, generator=g)
    ref = log_prob + 0.2 * torch.randn(b, MAX_LEN, generator=g)
    log_prob, old, roll, ref = (t * mask for t in (log_prob, old, roll, ref))
    group_ids = torch.arange(GROUPS).repeat_interleave(PER_GROUP)
    rewards = torch.randint(0, 3, (b,), generator=g).float() * 0.5
    adv = algos.compute_grpo_advantages(rewards, group_ids)
    inf_at = [(2, 0), (5, 1), (9, 2)]
    log_prob_inf = log_prob.clone()
    for i, t in inf_at:
        log_prob_inf[i, t] = float("-inf")
    # A log-ratio 25 nats below ref (KL) in sequence 0; in a sequence with an advantage whose GSPO
    # ratio sits inside the clip band, token log-ratios against old moved by -25, +12.5, +12.5: verl's
    # sequence mean is unchanged, rljob's gains (25 - 20) / n from the clamp at -20.
    seq_lr = ((log_prob - old) * mask).sum(-1) / lengths
    far_seq = next(i for i in range(b) if adv[i] != 0 and lengths[i] >= 30 and abs(float(seq_lr[i])) < 0.05)
    log_prob_far_kl = log_prob.clone()
    log_prob_far_kl[0, 1] = ref[0, 1] - 25.0
    log_prob_far = log_prob.clone()
    for t, shift in ((7, -25.0), (8, 12.5), (9, 12.5)):
        log_prob_far[far_seq, t] = old[far_seq, t] + (log_prob[far_seq, t] - old[far_seq, t]) + shift
    return {
        "mask": mask,
        "lengths": lengths,
        "log_prob": log_prob,
        "old_log_prob": old,
        "rollout_log_prob": roll,
        "ref_log_prob": ref,
        "rewards": rewards,
        "group_ids": group_ids,
        "advantages": adv[:, None] * mask,
        # float64 for verl (its log-probs and entropy then carry no rounding of their own); rljob's
        # sampler computes in float32 whatever it is given, as training does
        "logits": 2.0 * torch.randn(b, MAX_LEN, VOCAB, generator=g, dtype=torch.float64),
        "labels": torch.randint(0, VOCAB, (b, MAX_LEN), generator=g),
        "log_prob_inf": log_prob_inf,
        "log_prob_far": log_prob_far,
        "log_prob_far_kl": log_prob_far_kl,
        "far_seq": far_seq,
        "max_response_tokens": MAX_RESPONSE_TOKENS,
        "clip_low": CLIP_LOW,
        "clip_high": CLIP_HIGH,
        "clip_ratio_c": CLIP_C,
        "tis_cap": TIS_CAP,
        "is_cases": [(k, level, thr) for k, level, thr, _ in IS_CASES],
        "rs_cases": [(k, opt, f"{1 / hi!r}_{1 / lo!r}") for k, opt, _, lo, hi in RS_CASES]
        + [("token-same-string", "token_k1", "0.6_1.5")],
    }


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> Peer:
    """(the inputs, what verl computed from them)."""
    if not VERL_PYTHON.exists():
        pytest.fail(f"{VERL_PYTHON} is missing: run `make setup` (scripts/peer_env.sh makes it)")
    x = _inputs()
    folder = tmp_path_factory.mktemp("peer")
    src, dst = folder / "in.pt", folder / "out.pt"
    torch.save(x, src)
    proc = subprocess.run(
        [str(VERL_PYTHON), str(ROOT / "tests" / "peer" / "verl_side.py"), str(src), str(dst)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return x, torch.load(dst, weights_only=False)


def _flat(x: dict[str, Any], key: str) -> torch.Tensor:
    return x[key][x["mask"].bool()]


def _seq_ids(x: dict[str, Any]) -> torch.Tensor:
    return torch.arange(x["mask"].shape[0])[:, None].expand_as(x["mask"])[x["mask"].bool()]


def _agg(per_tok: torch.Tensor, x: dict[str, Any], mode: str) -> torch.Tensor:
    return algos.aggregate_loss(
        per_tok,
        torch.ones_like(per_tok),
        _seq_ids(x),
        mode=mode,  # type: ignore[arg-type]
        global_num_seqs=x["mask"].shape[0],
        global_num_tokens=int(x["mask"].sum()),
        token_sum_norm=MAX_RESPONSE_TOKENS,
    )


def _loss(name: str, x: dict[str, Any], mode: str, *, log_prob: str = "log_prob", **extra: Any) -> dict:
    lp = _flat(x, log_prob).clone().requires_grad_(True)
    if algos.needs_seq_ids(name):
        extra["seq_ids"] = _seq_ids(x)
    per_tok, clipped = algos.get_policy_loss(name)(
        lp,
        _flat(x, "old_log_prob"),
        _flat(x, "advantages"),
        clip_low=CLIP_LOW,
        clip_high=CLIP_HIGH,
        clip_ratio_c=CLIP_C,
        **extra,
    )
    loss = _agg(per_tok, x, mode)
    loss.backward()
    m = algos.ppo_clip_metrics(
        lp.detach(), _flat(x, "old_log_prob"), _flat(x, "advantages"), clip_low=CLIP_LOW, clip_high=CLIP_HIGH
    )
    n = lp.numel()
    return {
        "loss": loss.detach(),
        "grad": lp.grad,
        "pg_clipfrac": float(clipped.sum()) / n,
        "ppo_kl": float(m["ppo_kl"].sum()) / n,
        "pg_clipfrac_lower": float(m["dual_clipped"].sum()) / n,
        "pg_clipfrac_ratio_low": float(m["clipped_low"].sum()) / n,
    }


# ---- equal where the conventions agree -----------------------------------------------------------
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_advantages_equal_verls_loop_and_vectorised(peer: Peer, norm: bool) -> None:
    x, v = peer
    ours = algos.compute_grpo_advantages(x["rewards"], x["group_ids"], norm_by_std=norm)[:, None] * x["mask"]
    for est in ("grpo", "grpo_vectorized"):
        _close(f"advantages ({est}, norm_by_std={norm})", ours, v[f"adv/{est}/{norm}"])


@pytest.mark.parametrize("mode", MODES)
def test_ppo_clip_loss_gradient_and_metrics_equal_verls_vanilla(peer: Peer, mode: str) -> None:
    x, v = peer
    ours, theirs = _loss("clipped", x, mode), v[f"vanilla/{mode}"]
    _close(f"vanilla loss ({mode})", ours["loss"], theirs["loss"])
    _close(f"vanilla gradient ({mode})", ours["grad"], theirs["grad"][x["mask"].bool()])
    assert theirs["grad"][~x["mask"].bool()].abs().max() == 0  # padding carries none in verl either
    for name in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
        _close(f"{name} (vanilla)", ours[name], theirs["metrics"][f"actor/{name}"])
    assert ours["pg_clipfrac_lower"] > 0  # the fixture exercises the dual clip


@pytest.mark.parametrize("mode", MODES)
def test_token_tis_equals_verls_rollout_is_token_on_the_vanilla_loss(peer: Peer, mode: str) -> None:
    x, v = peer
    ours = _loss("clipped-tis", x, mode, rollout_logp=_flat(x, "rollout_log_prob"), tis_cap=TIS_CAP)
    theirs = v[f"vanilla-tis/{mode}"]
    _close(f"TIS loss ({mode})", ours["loss"], theirs["loss"])
    _close(f"TIS gradient ({mode})", ours["grad"], theirs["grad"][x["mask"].bool()])


@pytest.mark.parametrize("mode", MODES)
def test_gspo_loss_gradient_and_metrics_equal_verls(peer: Peer, mode: str) -> None:
    x, v = peer
    ours, theirs = _loss("gspo", x, mode), v[f"gspo/{mode}"]
    _close(f"GSPO loss ({mode})", ours["loss"], theirs["loss"])
    _close(f"GSPO gradient ({mode})", ours["grad"], theirs["grad"][x["mask"].bool()])
    for name in ("pg_clipfrac", "ppo_kl"):
        _close(f"{name} (GSPO)", ours[name], theirs["metrics"][f"actor/{name}"])


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_equal_verls(peer: Peer, kind: str) -> None:
    x, v = peer
    ours = algos.kl_penalty(_flat(x, "log_prob"), _flat(x, "ref_log_prob"), kind)  # type: ignore[arg-type]
    _close(f"KL {kind}", ours, v[f"kl/{kind}"][x["mask"].bool()])
    if kind == "k3":  # verl's low_var_kl is its k3
        _close("KL low_var_kl", ours, v["kl/low_var_kl"][x["mask"].bool()])


def test_entropy_log_probs_and_their_aggregation_equal_verls(peer: Peer) -> None:
    x, v = peer
    logits, labels = _flat(x, "logits"), _flat(x, "labels")
    logp, ent = sampling.token_log_probs(logits, labels, temperature=1.0, top_p=1.0, with_entropy=True)
    assert ent is not None
    _close("log-probs from logits", logp, v["logprobs"][x["mask"].bool()])
    _close("entropy per token", ent, v["entropy/token"][x["mask"].bool()])
    for mode in MODES:
        _close(f"entropy aggregated ({mode})", _agg(ent, x, mode), v[f"entropy/{mode}"])


@pytest.mark.parametrize(
    ("key", "correction"), [(c[0], c[3]) for c in IS_CASES], ids=[c[0] for c in IS_CASES]
)
def test_importance_weights_equal_verls_rollout_corr_helper(
    peer: Peer, key: str, correction: rc.Correction
) -> None:
    x, v = peer
    old, roll, seq = _flat(x, "old_log_prob"), _flat(x, "rollout_log_prob"), _seq_ids(x)
    w = rc.correction_weights(old, roll, torch.ones_like(old), seq, correction)["weight"]
    theirs = v[f"is/{key}"]
    _close(f"IS weights ({key})", w, theirs["weights"][x["mask"].bool()])
    assert 0 < float((w == correction.is_upper).float().mean() + (w == 0).float().mean()) < 1  # bounds act
    sums = rc.correction_sums(old, roll, torch.ones_like(old), seq, correction)
    ours = rc.correction_metrics({k: float(s) for k, s in sums.items()})
    _close(
        f"rollout_is_mean ({key})", ours["rollout_corr/rollout_is_mean"], theirs["metrics"]["rollout_is_mean"]
    )
    if correction.is_level == "token":  # verl counts its sequence-level fractions per sequence
        for name in ("rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low"):
            _close(f"{name} ({key})", ours[f"rollout_corr/{name}"], theirs["metrics"][name])
    if correction.is_mode == "mask" and correction.is_level == "token":
        name = "rollout_is_oob_ratio"
        _close(f"{name} (IcePop)", ours[f"rollout_corr/{name}"], theirs["metrics"][name])


@pytest.mark.parametrize(("key", "option", "level", "lower", "upper"), RS_CASES, ids=[c[0] for c in RS_CASES])
def test_rejection_equals_verls_k1_rejection_with_inverted_bounds(
    peer: Peer, key: str, option: str, level: str, lower: float, upper: float
) -> None:
    x, v = peer
    old, roll, seq = _flat(x, "old_log_prob"), _flat(x, "rollout_log_prob"), _seq_ids(x)
    c = rc.Correction(is_level=None, reject_level=level, reject_lower=lower, reject_upper=upper)  # type: ignore[arg-type]
    keep = rc.correction_weights(old, roll, torch.ones_like(old), seq, c)["weight"]
    theirs = v[f"rs/{key}"]
    _close(f"rejection mask ({key})", keep, theirs["mask"][x["mask"].bool()])
    assert 0 < float(keep.mean()) < 1  # some rejected, some kept
    sums = rc.correction_sums(old, roll, torch.ones_like(old), seq, c)
    ours = rc.correction_metrics({k: float(s) for k, s in sums.items()})
    for name in ("rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction"):
        _close(f"{name} ({key})", ours[f"rollout_corr/{name}"], theirs["metrics"][name])


def test_off_policy_metrics_equal_verls(peer: Peer) -> None:
    x, v = peer
    old, roll, seq = _flat(x, "old_log_prob"), _flat(x, "rollout_log_prob"), _seq_ids(x)
    ours = rc.correction_metrics(
        {k: float(s) for k, s in rc.correction_sums(old, roll, torch.ones_like(old), seq, None).items()}
    )
    for name in (
        "kl",
        "k3_kl",
        "training_ppl",
        "training_log_ppl",
        "rollout_ppl",
        "rollout_log_ppl",
        "log_ppl_diff",
        "log_ppl_abs_diff",
        "ppl_ratio",
        "chi2_token",
        "chi2_seq",
    ):
        _close(f"rollout_corr/{name}", ours[f"rollout_corr/{name}"], v["offpolicy"][name])


# ---- where the conventions differ: each asserted -------------------------------------------------
def test_convention_out_of_nucleus_tokens_verl_nan_rljob_finite(peer: Peer) -> None:
    """A -inf log-prob (a token outside the trainer's top-p nucleus): verl's fused loss, GSPO and k3
    are NaN; rljob drops the token (value and gradient 0) and stays finite."""
    x, v = peer
    assert torch.isnan(v["nan/vanilla-fused"]) and torch.isnan(v["nan/gspo"])
    assert torch.isnan(v["nan/k3"]).any()
    lp = _flat(x, "log_prob_inf").clone().requires_grad_(True)
    adv, seq = _flat(x, "advantages"), _seq_ids(x)
    fused, _ = algos.clipped_policy_loss(lp, lp.detach(), adv, clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    gspo, _ = algos.gspo_policy_loss(
        lp, _flat(x, "old_log_prob"), adv, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, seq_ids=seq
    )
    loss = _agg(fused, x, "token-mean") + _agg(gspo, x, "seq-mean-token-mean")
    loss.backward()
    assert torch.isfinite(loss) and lp.grad is not None and torch.isfinite(lp.grad).all()
    assert torch.isfinite(algos.kl_penalty(lp.detach(), lp.detach(), "k3")).all()


def test_convention_a_group_of_one_gets_zero_not_its_reward(peer: Peer) -> None:
    """verl gives a lone sample mean 0 and std 1, so its advantage is its reward / (1 + eps); rljob
    gives 0 (no group to be relative to)."""
    x, v = peer
    ids = x["group_ids"].clone()
    ids[-1] = 99
    ours = algos.compute_grpo_advantages(x["rewards"], ids)
    assert ours[-1].item() == 0.0
    assert v["adv/single"][-1, 0].item() == pytest.approx(x["rewards"][-1].item() / (1 + 1e-6))
    _close("advantages (groups of several)", ours[:-4, None] * x["mask"][:-4], v["adv/single"][:-4])


def test_convention_dr_grpo_divides_by_the_completion_cap_not_the_padded_width(peer: Peer) -> None:
    """seq-mean-token-sum-norm: rljob divides by lengths.maxCompletionTokens; verl by its
    loss_scale_factor, which defaults to the batch's padded width (equal when set to the cap)."""
    x, v = peer
    ours = _loss("clipped", x, "seq-mean-token-sum-norm")["loss"]
    width = x["mask"].shape[1]
    assert width != MAX_RESPONSE_TOKENS
    _close("Dr. GRPO divisor", ours * MAX_RESPONSE_TOKENS / width, v["vanilla/sum-norm-default-divisor"])


def test_convention_log_ratios_beyond_20_are_clamped_in_k1_k2_and_gspo_too(peer: Peer) -> None:
    """rljob clamps every log-ratio to ±20 (verl: k3 and the PPO ratio only), so k1/k2 of a token 25
    nats off differ and GSPO's sequence ratio of a sequence holding one does."""
    x, v = peer
    mask = x["mask"].bool()
    far, ref = _flat(x, "log_prob_far_kl"), _flat(x, "ref_log_prob")
    at = 1  # token (0, 1) in the flat order
    assert algos.kl_penalty(far, ref, "k1")[at].item() == pytest.approx(-20.0)
    assert v["far/kl/k1"][0, 1].item() == pytest.approx(-25.0, abs=1e-4)
    assert algos.kl_penalty(far, ref, "k2")[at].item() == pytest.approx(200.0)
    assert v["far/kl/k2"][0, 1].item() == pytest.approx(312.5, rel=1e-4)
    _close("KL k3 beyond ±20", algos.kl_penalty(far, ref, "k3"), v["far/kl/k3"][mask])
    ours = _loss("gspo", x, "seq-mean-token-mean", log_prob="log_prob_far")["loss"]
    unmoved = _loss("gspo", x, "seq-mean-token-mean")["loss"]
    _close("GSPO with log-ratios of -25, +12.5, +12.5 (verl)", v["far/gspo"]["loss"], unmoved)
    assert abs(float(ours) - float(v["far/gspo"]["loss"])) > 1e-3


def test_convention_top_p_log_probs_are_renormalised_over_the_nucleus(peer: Peer) -> None:
    """verl's trainer log-probs ignore top-p; rljob's are the sampler's (vLLM's processed_logprobs):
    log_softmax over the nucleus, so inside it they exceed verl's by -log(the nucleus' mass), and
    outside it they are -inf."""
    x, v = peer
    logits, labels = _flat(x, "logits"), _flat(x, "labels")
    ours, _ = sampling.token_log_probs(logits, labels, temperature=1.0, top_p=0.9)
    outside = sampling.top_p_mask(logits, 0.9)
    mass = (torch.softmax(logits, -1) * (~outside)).sum(-1)
    inside = ~outside.gather(-1, labels[:, None]).squeeze(-1)
    theirs = v["logprobs"][x["mask"].bool()]
    _close("top-p log-probs - log(nucleus mass)", ours[inside], (theirs - torch.log(mass))[inside])
    assert torch.isneginf(ours[~inside]).all() and torch.isfinite(theirs).all() and (~inside).any()


def test_convention_k1_rejection_bounds_the_inverse_ratio(peer: Peer) -> None:
    """verl's token_k1 "a_b" keeps a token when π_rollout/π_old lies in [a, b]; rljob's [lower, upper]
    bounds π_old/π_rollout. The same numbers give different masks."""
    x, v = peer
    old, roll, seq = _flat(x, "old_log_prob"), _flat(x, "rollout_log_prob"), _seq_ids(x)
    c = rc.Correction(is_level=None, reject_level="token", reject_lower=0.6, reject_upper=1.5)
    keep = rc.correction_weights(old, roll, torch.ones_like(old), seq, c)["weight"]
    assert not torch.equal(keep, v["rs/token-same-string"]["mask"][x["mask"].bool()])


def test_convention_our_ratio_low_clip_fraction_is_not_verls_lower(peer: Peer) -> None:
    """verl's pg_clipfrac_lower is the dual-clip fraction (what rljob now logs under that name);
    what rljob logged as clipfrac_low (A < 0 below 1 - clipRatioLow) is pg_clipfrac_ratio_low."""
    x, v = peer
    ours = _loss("clipped", x, "token-mean")
    verl_lower = v["vanilla/token-mean"]["metrics"]["actor/pg_clipfrac_lower"]
    assert ours["pg_clipfrac_ratio_low"] != pytest.approx(verl_lower)
    assert v["verl_version"] == "0.9.1"


def test_zz_report_the_largest_differences(peer: Peer, capsys: pytest.CaptureFixture[str]) -> None:
    """Prints the largest |rljob - verl| / (1 + |verl|) per compared quantity (float32, as training
    computes; pytest -s shows it; docs/numerics.md quotes it)."""
    assert DIFFS, "no comparison ran"
    worst = max(DIFFS.values())
    with capsys.disabled():
        print(
            f"\npeer parity vs verl 0.9.1: {len(DIFFS)} quantities, "
            f"largest |diff| / (1 + |verl|) {worst:.2e}",
            file=sys.stderr,
        )
        for name, d in sorted(DIFFS.items(), key=lambda kv: -kv[1])[:8]:
            print(f"  {d:.2e}  {name}", file=sys.stderr)
    assert worst <= TOL and math.isfinite(worst)

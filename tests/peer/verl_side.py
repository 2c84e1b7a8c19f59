"""verl 0.9.1's side of the peer-parity tier: runs verl's own functions on the tier's tensors.

Run by tests/peer/test_verl_parity.py as `.venv-verl/bin/python tests/peer/verl_side.py IN OUT`
(verl lives only in .venv-verl/, made by scripts/peer_env.sh). IN is a torch.save'd dict of padded
(B, W) tensors the test built; OUT receives what verl computes from them: advantages, each policy
loss under each aggregation with its gradient and metrics, the KL estimators, entropy, log-probs,
the rollout-correction weights, rejection masks and metrics, and the cases where verl's conventions
differ from rljob's (NaN with -inf log-probs among them). No rljob code is imported here.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch
import verl
import verl.utils.torch_functional as verl_F
from verl.trainer.ppo import core_algos, rollout_corr_helper
from verl.workers.config import ActorConfig

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def actor_config(x: dict[str, Any], *, loss_scale_factor: int | None) -> ActorConfig:
    cfg = ActorConfig(
        strategy="fsdp",
        rollout_n=4,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=x["clip_low"],
        clip_ratio_low=x["clip_low"],
        clip_ratio_high=x["clip_high"],
        clip_ratio_c=x["clip_ratio_c"],
    )
    mask = x["mask"]
    cfg.global_batch_info.update(
        dp_size=1,
        batch_num_tokens=int(mask.sum()),
        global_batch_size=mask.shape[0],
        loss_scale_factor=loss_scale_factor,
    )
    return cfg


def policy_loss(
    name: str,
    x: dict[str, Any],
    mode: str,
    *,
    log_prob: torch.Tensor,
    old: torch.Tensor,
    loss_scale_factor: int | None,
    weights: torch.Tensor | None = None,
) -> dict[str, Any]:
    lp = log_prob.clone().requires_grad_(True)
    fn = core_algos.get_policy_loss_fn(name)
    loss, metrics = fn(
        old_log_prob=old,
        log_prob=lp,
        advantages=x["advantages"],
        response_mask=x["mask"],
        loss_agg_mode=mode,
        config=actor_config(x, loss_scale_factor=loss_scale_factor),
        rollout_is_weights=weights,
    )
    loss.backward()
    return {"loss": loss.detach(), "grad": lp.grad, "metrics": metrics}


def main(src: str, dst: str) -> None:
    x = torch.load(src)
    mask, lp, old = x["mask"], x["log_prob"], x["old_log_prob"]
    roll, ref = x["rollout_log_prob"], x["ref_log_prob"]
    out: dict[str, Any] = {"verl_version": verl.__version__}

    # advantages: the loop and the vectorised estimator, normalised by std or not (Dr. GRPO)
    rewards = torch.zeros_like(mask)
    last = mask.sum(-1).long() - 1
    rewards[torch.arange(mask.shape[0]), last] = x["rewards"]
    index = np.array(x["group_ids"].tolist())
    for norm in (True, False):
        for est in ("grpo", "grpo_vectorized"):
            adv, _ = core_algos.get_adv_estimator_fn(est)(
                token_level_rewards=rewards, response_mask=mask, index=index, norm_adv_by_std_in_grpo=norm
            )
            out[f"adv/{est}/{norm}"] = adv
    single = np.array([*index[:-1].tolist(), 99])  # the last sample alone in its group
    out["adv/single"], _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, single)

    # policy losses under each aggregation (Dr. GRPO's divisor given as verl's loss_scale_factor)
    lsf = x["max_response_tokens"]
    for mode in MODES:
        out[f"vanilla/{mode}"] = policy_loss("vanilla", x, mode, log_prob=lp, old=old, loss_scale_factor=lsf)
        out[f"gspo/{mode}"] = policy_loss("gspo", x, mode, log_prob=lp, old=old, loss_scale_factor=lsf)
    out["vanilla/sum-norm-default-divisor"] = policy_loss(
        "vanilla", x, "seq-mean-token-sum-norm", log_prob=lp, old=old, loss_scale_factor=None
    )["loss"]

    # token TIS (verl's rollout_is: token, threshold 2) on the vanilla loss
    tis, _ = rollout_corr_helper.compute_rollout_correction_weights(
        old - roll, mask, rollout_is="token", rollout_is_threshold=x["tis_cap"]
    )
    for mode in MODES:
        out[f"vanilla-tis/{mode}"] = policy_loss(
            "vanilla", x, mode, log_prob=lp, old=old, loss_scale_factor=lsf, weights=tis
        )

    # KL estimators; entropy and its aggregation; log-probs from logits
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        out[f"kl/{kind}"] = core_algos.kl_penalty(lp, ref, kind)
    logits = x["logits"]
    entropy = verl_F.entropy_from_logits(logits)
    out["entropy/token"] = entropy
    for mode in MODES:
        out[f"entropy/{mode}"] = core_algos.agg_loss(
            entropy,
            mask,
            mode,
            batch_num_tokens=int(mask.sum()),
            global_batch_size=mask.shape[0],
            loss_scale_factor=lsf,
        )
    out["logprobs"] = verl_F.logprobs_from_logits(logits, x["labels"])

    # rollout corrections: IS weights, rejection masks and the off-policy metrics
    log_ratio = old - roll
    for key, level, threshold in x["is_cases"]:
        w, metrics = rollout_corr_helper.compute_rollout_correction_weights(
            log_ratio, mask, rollout_is=level, rollout_is_threshold=threshold
        )
        out[f"is/{key}"] = {"weights": w, "metrics": metrics}
    for key, option, threshold in x["rs_cases"]:
        m, metrics = rollout_corr_helper.compute_rollout_rejection_mask(
            log_ratio, mask, rollout_rs=option, rollout_rs_threshold=threshold
        )
        out[f"rs/{key}"] = {"mask": m, "metrics": metrics}
    out["offpolicy"] = rollout_corr_helper.compute_offpolicy_metrics(old, roll, mask)

    # conventions: -inf log-probs (a token outside a top-p nucleus) and log-ratios beyond ±20
    lp_inf = x["log_prob_inf"]
    out["nan/vanilla-fused"] = policy_loss(
        "vanilla", x, "token-mean", log_prob=lp_inf, old=lp_inf.detach(), loss_scale_factor=lsf
    )["loss"]
    out["nan/gspo"] = policy_loss(
        "gspo", x, "seq-mean-token-mean", log_prob=lp_inf, old=old, loss_scale_factor=lsf
    )["loss"]
    out["nan/k3"] = core_algos.kl_penalty(lp_inf, lp_inf, "k3")
    for kind in ("k1", "k2", "k3"):
        out[f"far/kl/{kind}"] = core_algos.kl_penalty(x["log_prob_far_kl"], ref, kind)
    far = x["log_prob_far"]
    out["far/gspo"] = policy_loss(
        "gspo", x, "seq-mean-token-mean", log_prob=far, old=old, loss_scale_factor=lsf
    )
    torch.save(out, dst)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""The sampler's processed log-probs: temperature, then top-p, exactly as vLLM 0.33 computes them.

Role: the one home of the rule both sides of a GRPO step apply to logits, so the trainer's
log-probs are the log-probs of the distribution the engine sampled from. vLLM 0.33.0 with
`logprobs_mode="processed_logprobs"` (vllm/v1/sample/sampler.py `Sampler.forward`/`sample`, read in
the released wheel): logits to float32; greedy requests (temperature < 1e-5) return
`log_softmax(logits)` of the raw logits; otherwise `logits / temperature`, then
`ops/topk_topp_sampler.py` `apply_top_k_top_p_pytorch`: sort ascending, `probs_sum =
cumsum(softmax(sorted))`, mask the tokens whose ascending cumulative mass is `<= 1 - top_p` (never
the most likely one) to -inf, and the returned log-probs are `log_softmax` over what is left (the
nucleus renormalised). The transformers engine samples with `processed_log_probs`; the trainer's
packed and padded forwards read the sampled tokens' log-probs with `token_log_probs`. A token outside
the trainer's own nucleus gets -inf (the policy cannot sample it); callers clamp log-ratios.

Callers: `rljob_trainer.engines.transformers_engine`, `rljob_trainer.train.packing`,
`rljob_trainer.train.trainer`.
"""

from __future__ import annotations

import torch

# vLLM's `_SAMPLING_EPS`: a temperature below it is greedy sampling.
GREEDY_EPS = 1e-5
# Rows of logits processed at once when top-p needs a sort over the vocabulary (bounds its memory).
TOP_P_CHUNK_ROWS = 1024


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_EPS


def top_p_mask(scaled_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """True where a token falls outside the nucleus (vLLM's `top_p_mask`). [N, V] float -> [N, V] bool."""
    logits_sort, logits_idx = scaled_logits.sort(dim=-1, descending=False)
    probs_sum = torch.cumsum(logits_sort.softmax(dim=-1), dim=-1)
    mask_sorted = probs_sum <= 1 - top_p
    mask_sorted[..., -1] = False  # at least one: the most likely token
    return torch.zeros_like(mask_sorted).scatter_(-1, logits_idx, mask_sorted)


def processed_logits(logits: torch.Tensor, *, temperature: float, top_p: float) -> torch.Tensor:
    """float32 logits after temperature and top-p (masked to -inf). [..., V] -> [..., V]."""
    z = logits.float()
    if is_greedy(temperature):
        return z
    if temperature != 1.0:
        z = z / temperature
    if top_p >= 1.0:
        return z
    flat = z.reshape(-1, z.shape[-1])
    with torch.no_grad():
        mask = torch.cat(
            [
                top_p_mask(flat[i : i + TOP_P_CHUNK_ROWS], top_p)
                for i in range(0, flat.shape[0], TOP_P_CHUNK_ROWS)
            ]
        )
    return flat.masked_fill(mask, float("-inf")).reshape(z.shape)


def processed_log_probs(logits: torch.Tensor, *, temperature: float, top_p: float) -> torch.Tensor:
    """The log-probs vLLM returns in processed_logprobs mode. [..., V] -> [..., V] float32."""
    return torch.log_softmax(processed_logits(logits, temperature=temperature, top_p=top_p), dim=-1)


def token_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Processed log-probs of `targets` [T] under `logits` [T, V] (grad flows when enabled), and with
    `with_entropy` the entropy [T] of each processed distribution (no grad)."""
    z = processed_logits(logits, temperature=temperature, top_p=top_p)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:  # in row chunks: a [T, V] temporary per chunk, not per micro-batch
        with torch.no_grad():
            parts = []
            for i in range(0, z.shape[0], TOP_P_CHUNK_ROWS):
                lp = z[i : i + TOP_P_CHUNK_ROWS] - lse[i : i + TOP_P_CHUNK_ROWS].unsqueeze(-1)
                p = lp.exp()
                parts.append(-(p * lp.masked_fill(p == 0, 0.0)).sum(-1))
            entropy = torch.cat(parts) if parts else lse.new_zeros(0)
    return logp, entropy

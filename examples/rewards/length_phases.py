"""A two-phase length reward: the load on the rollout engines changes because the policy learns.

Used by examples/adaptive-gpu-local.yaml (mounted from the ConfigMap `adaptive-gpu-local-reward`,
key `reward.py`). Until step `SHORT_FROM_STEP` it rewards long completions (the policy learns to
write up to the completion cap, as RL makes models think longer, so generation is the
bottleneck); from then on it rewards short ones (the policy learns to stop early, generation gets
cheap, and adaptive mode calms down and drains the engine it added).

The driver calls a reward function once per step with the whole batch, so counting calls counts
steps (from the start of this process: a restarted trainer starts the count again).
"""

from __future__ import annotations

SHORT_FROM_STEP = 50
CAP_CHARS = 48  # the example's maxCompletionTokens; the digits tokenizer has one char per token

_calls = 0


def length_phases(prompts: list[str], completions: list[str], answers: list[str], **_: object) -> list[float]:
    global _calls
    _calls += 1
    fractions = [min(len(c), CAP_CHARS) / CAP_CHARS for c in completions]
    if _calls < SHORT_FROM_STEP:
        return fractions
    return [1.0 - f for f in fractions]

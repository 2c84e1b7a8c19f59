"""A two-phase reward: the load on the rollout engines changes because the policy learns.

Used by examples/adaptive-gpu-local.yaml (mounted from the ConfigMap `adaptive-gpu-local-reward`,
key `reward.py`). Until step `SHORT_FROM_STEP` it rewards answers made of digits, whatever their
length: the random policy keeps writing long answers (every wave of requests runs until its
longest answer ends near the completion cap), so generation is the bottleneck. From then on it
rewards short answers: the policy learns to stop early, generation gets cheap, and adaptive mode
calms down and drains the engine it added. Phase one does not reward length itself on purpose: a
reward that prefers more tokens teaches the policy never to stop, every completion then hits the
cap with the same reward, and GRPO (which learns from differences within a group) could never
learn to stop again.

The driver calls a reward function once per step with the whole batch, so counting calls counts
steps (from the start of this process: a restarted trainer starts the count again).
"""

from __future__ import annotations

SHORT_FROM_STEP = 50
CAP_CHARS = 48  # the example's maxCompletionTokens (the digits tokenizer writes one char per token)

_calls = 0


def length_phases(prompts: list[str], completions: list[str], answers: list[str], **_: object) -> list[float]:
    global _calls
    _calls += 1
    if _calls < SHORT_FROM_STEP:
        return [sum(ch.isdigit() for ch in c) / len(c) if c else 0.0 for c in completions]
    return [1.0 - min(len(c), CAP_CHARS) / CAP_CHARS for c in completions]

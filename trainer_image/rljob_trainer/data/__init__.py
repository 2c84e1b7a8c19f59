"""What the trainer learns from and is judged by: prompts, rewards and held-out evaluation.

`sources` loads (prompt, answer) examples (shipped in `builtin/`, files on a volume, the Hugging
Face Hub), encodes prompts and hands them out in a seeded, resumable order; `rewards` the verifiable
rewards (answer extraction, a registry, user modules); `evaluation` generates and scores the
held-out set on the engines that serve now (so it sits above `engines/`).
"""

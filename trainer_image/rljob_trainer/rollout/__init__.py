"""Rollouts between the engines and the trainer, driven by the driver: dispatch, the generation
pipeline, the staleness buffer and the driver's side of every weight sync.

`dispatcher` admits requests to engines by load; `pipeline` keeps generation ahead of training
within `maxStaleness`; `buffer` holds finished rollouts with their weights version; `engine_sync` is
the driver's side of each weight path (joining an engine's channel, one sync, a lost LoRA adapter
re-added). Below this folder: `data/` (prompts, rewards), `engines/`, `train/`, `weights/` (how
weights travel, shared by the trainer and the engines).
"""

"""The policy model as both sides of a run load it: the trainer ranks and the rollout engines.

`modeling` builds or loads the model and tokenizer (a tiny model from a config in code, or a folder)
and applies the fine-tuning mode (full or LoRA); `precision` the dtype rules (fp32 masters, bf16
compute, fp32 reductions); `sampling` the log-probs of sampled tokens under temperature and top-p,
as the engines sample them; `lora_adapter` writes a PEFT adapter folder an engine can load. It sits
low so that `train/`, `engines/`, `weights/` and `outputs/` share it without importing each other.
"""

"""The training rank and its step: what one GRPO update does on every data-parallel rank.

`trainer` is the rank (`TrainingRank`: model, optimizer, FSDP2/DDP, one step, checkpoints, exports);
`algos` the advantage estimators and policy losses (pure tensor functions, a registry); `packing`
and `microbatch` turn a rank's samples into padded or packed micro-batches (the same planner the
DP-balance simulation prices); `dynamic_sampling` drops or refills groups with no signal;
`train_metrics` the step's metrics. Below: `model/` (building and loading the policy, precision,
log-probs under the sampling parameters), `weights/`, `outputs/`, `config`.
"""

"""How weights travel from the trainer ranks to the rollout engines: both ends of every path.

`weight_sync` is the collective path (one gloo/NCCL/HCCL group per engine, bucketed, streamed from
FSDP2), the object-store fallback, and the choice of path for each engine from the installed vLLM;
`vllm_transfer` is the trainer side of vLLM's own weight-transfer API (NCCL or IPC). The trainer
sends and the engines receive through this folder, so it sits below both; `rollout.engine_sync` is
the driver's side that orders a sync.
"""

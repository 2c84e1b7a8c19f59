"""Rollouts between the engines and the trainer: dispatch, the generation pipeline, the staleness
buffer and the weight sync that keeps the engines' weights current.

`dispatcher` admits requests to engines by load; `pipeline` keeps generation ahead of training
within `maxStaleness`; `buffer` holds finished rollouts with their weights version; `weight_sync`
moves the trainer's weights to the engines (collective or object store) and picks each engine's path;
`vllm_transfer` is the trainer side of vLLM's own weight transfer; `engine_sync` is the driver's side
of every path (joining an engine's channel, one sync, a lost LoRA adapter re-added).
"""

"""What a run leaves behind and tells the world: checkpoints, exports, metrics and telemetry.

`checkpoint` saves and resumes the run (safetensors, renamed into place whole); `export` writes Hugging
Face and PEFT folders a vLLM can serve; `tracking` writes TensorBoard and optionally W&B and MLflow;
`telemetry` is the SyncReport contract the operator reads (importable without torch) and
`telemetry_sink` writes it to the job's ConfigMap; `termination` the pod's termination message.
The operator imports `telemetry` and `termination`, so this package's `__init__` imports nothing.
"""

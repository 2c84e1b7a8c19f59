"""The pods' writable scratch: every emptyDir a job's container writes, each with a sizeLimit.

Role: pure. The trainer and rollout containers run with `readOnlyRootFilesystem: true`
(PodSecurity `restricted` does not demand it; a platform team admitting a shared-cluster tenant
does), so everything they write goes to a volume:
  - `/tmp` (Ray's session logs and spilled objects, torch's compile caches, tempfiles): room for
    one spilled copy of the weights plus 8 GiB;
  - `/var/cache/rljob`, HOME and the caches (HF_HOME, XDG_CACHE_HOME: hub downloads of the model
    and the data, Triton and vLLM caches): the weights once more when they come from the hub, 8 GiB
    more when the data does, plus 2 GiB;
  - `/dev/shm` (memory-backed; Ray's object store, NCCL, the weights file a vLLM engine on CPU
    loads at each sync): the pod's memory when it sets one (the kubelet caps the tmpfs there
    anyway), else twice the weights plus 2 GiB;
  - the default checkpoint emptyDir (`spec.checkpoint.volume.emptyDir.sizeLimit` wins when set):
    `KEEP_LAST` checkpoints (trainable weights with their optimizer state, 16 bytes a parameter)
    and one more Hugging Face export than that, plus 2 GiB.
The weights are the model's parameter count (`estimator.ModelGeometry`) at the job's dtype; with
no readable config every size falls back to its floor. The kubelet evicts a pod whose disk-backed
emptyDir outgrows its limit ("Usage of EmptyDir volume ... exceeds the limit"): the job then fails
that attempt (not a disruption; `decide.lifecycle`) and says which volume.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from rljob_operator import api, errors, quantity
from rljob_operator import estimator as est

GIB = 1024**3
TMP_MOUNT = "/tmp"
CACHE_MOUNT = "/var/cache/rljob"
SHM_MOUNT = "/dev/shm"
#: Where Hugging Face puts hub downloads (models, datasets) under the cache volume.
HF_HOME = f"{CACHE_MOUNT}/huggingface"
#: Checkpoints the trainer keeps (rljob_trainer.config.CheckpointSettings.keep_last's default).
KEEP_LAST = 2
#: Bytes a trainable parameter's checkpoint holds at most: fp32 master weights, two fp32 Adam
#: moments and the bf16 copy.
CHECKPOINT_BYTES_PER_TRAINABLE_PARAM = 16
#: A LoRA adapter with its optimizer state is well under this share of the base model.
LORA_TRAINABLE_SHARE = 0.05
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class ScratchLimits:
    """sizeLimit quantities (`"12Gi"`) of the pods' emptyDirs."""

    tmp: str
    cache: str
    shm: str
    checkpoints: str


def _gib(n_bytes: float) -> str:
    return f"{max(1, math.ceil(n_bytes / GIB))}Gi"


def weight_bytes(spec: api.RLJobSpec, model_config: Mapping[str, Any] | None) -> int:
    """The model's weights at the job's dtype; 0 when the config cannot be read (then the floors)."""
    if not model_config:
        return 0
    try:
        params = est.ModelGeometry.from_hf_config(dict(model_config)).total_params
    except errors.EstimatorError:
        return 0
    return params * DTYPE_BYTES.get(spec.model.dtype, 2)


def scratch_limits(spec: api.RLJobSpec, model_config: Mapping[str, Any] | None) -> ScratchLimits:
    """The sizeLimits of one job's emptyDirs (see the module docstring for each rule)."""
    weights = weight_bytes(spec, model_config)
    from_hub = spec.model.source.hub is not None
    data_hub = spec.data.source.hub is not None
    cache = (weights if from_hub else 0) + (8 * GIB if data_hub else 0) + 2 * GIB
    memory = spec.resources.memory
    shm = quantity.to_bytes(memory) if memory is not None else 2 * weights + 2 * GIB
    trainable = weights if spec.model.finetune.mode == "full" else weights * LORA_TRAINABLE_SHARE
    params = trainable / DTYPE_BYTES.get(spec.model.dtype, 2)
    checkpoints = KEEP_LAST * params * CHECKPOINT_BYTES_PER_TRAINABLE_PARAM + (KEEP_LAST + 1) * weights
    return ScratchLimits(
        tmp=_gib(weights + 8 * GIB),
        cache=_gib(cache),
        shm=_gib(shm),
        checkpoints=_gib(checkpoints + 2 * GIB),
    )


def judge_scratch_limits(spec: api.RLJobSpec, judge_config: Mapping[str, Any] | None) -> ScratchLimits:
    """The sizeLimits of a judge pod's emptyDirs: the same rules, with the judge model's weights (it
    holds no checkpoint; its cache holds the judge's hub download)."""
    judge = spec.reward.judge
    weights = 0
    if judge is not None and judge_config:
        try:
            params = est.ModelGeometry.from_hf_config(dict(judge_config)).total_params
        except errors.EstimatorError:
            params = 0
        weights = params * DTYPE_BYTES.get(judge.model.dtype, 2)
    from_hub = judge is not None and judge.model.source.hub is not None
    memory = spec.resources.memory
    shm = quantity.to_bytes(memory) if memory is not None else 2 * weights + 2 * GIB
    return ScratchLimits(
        tmp=_gib(weights + 8 * GIB),
        cache=_gib((weights if from_hub else 0) + 2 * GIB),
        shm=_gib(shm),
        checkpoints=_gib(2 * GIB),
    )

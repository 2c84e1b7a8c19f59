"""`spec.resources`: accelerators, the static or adaptive split between trainer and rollout engines."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from rljob_operator.api.base import (
    AcceleratorKind,
    AdaptiveSignal,
    CelRule,
    KVCacheDtype,
    Quantity,
    ResourceMode,
    _Spec,
)
from rljob_trainer import config as trainer_config


# --------------------------------------------------------------------------------------------
# spec.resources
# --------------------------------------------------------------------------------------------
class CustomAcceleratorSpec(_Spec):
    """Numbers of an accelerator missing from the catalog (or overrides of a catalog entry)."""

    memory_gib: float = Field(alias="memoryGiB", gt=0.0, le=65536.0, description="Device memory in GiB.")
    hbm_bandwidth_gbps: float = Field(
        alias="hbmBandwidthGBps", gt=0.0, le=1.0e6, description="Memory bandwidth in GB/s."
    )
    bf16_tflops: float = Field(alias="bf16TFLOPS", gt=0.0, le=1.0e6, description="Dense bf16 peak in TFLOPS.")


class AcceleratorSpec(_Spec):
    """The accelerator every trainer and rollout pod uses."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="self.kind == 'cpu' || has(self.model)",
            message="spec.resources.accelerator.model is required unless kind is cpu (a catalog name such as "
            "H100-80GB, or any name together with custom)",
            field_path=".model",
            reason="FieldValueRequired",
            check=lambda s: s.kind == "cpu" or s.model is not None,
        ),
    )

    kind: AcceleratorKind = Field(
        description="nvidia (nvidia.com/gpu), ascend (huawei.com/Ascend910), amd (amd.com/gpu) or cpu (no "
        "accelerator: pods request only spec.resources.cpu and memory)."
    )
    model: str | None = Field(
        None,
        min_length=1,
        max_length=63,
        pattern=r"^[A-Za-z0-9][-_.A-Za-z0-9]*$",
        description="Catalog name: H100-80GB, H200, B200, A100-40GB, A100-80GB, L40S, MI300X, Ascend910B3, "
        "...; with custom, any name.",
    )
    resource_name: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[a-zA-Z0-9]([-_.a-zA-Z0-9]*[a-zA-Z0-9])?$",
        description="Extended resource the pods request. Default by kind: nvidia.com/gpu, "
        "huawei.com/Ascend910, "
        "amd.com/gpu.",
    )
    custom: CustomAcceleratorSpec | None = Field(
        None, description="Memory, bandwidth and peak of an accelerator missing from the catalog."
    )


class StaticSplitSpec(_Spec):
    """An explicit split of the accelerators (mode static)."""

    trainer_accelerators: int = Field(ge=1, le=65536, description="Accelerators for the trainer ranks.")
    rollout_accelerators: int = Field(
        ge=0,
        le=65536,
        description="Accelerators for dedicated rollout engines; 0 means rollout runs on the trainer "
        "accelerators (a colocated engine that sleeps during training).",
    )


WeightSyncMode = Literal["collective", "objectStore"]
LoRASyncMode = Literal["adapter", "merged"]
RolloutKind = Literal["vllm", "transformers"]
#: Head sizes vLLM 0.32's CPU attention backend runs (vllm/v1/attention/backends/cpu_attn.py,
#: `CPUAttentionBackend.get_supported_head_sizes`; "Unsupported CPU attention configuration" otherwise).
#: The operator's own copy: it may not import the trainer's `engines.platform.CPU_ATTENTION_HEAD_SIZES`,
#: which a unit test checks this equals. MLA models use vLLM's CPU MLA backends instead, not this list.
VLLM_CPU_ATTENTION_HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
#: Pod memory of a CPU job (accelerator.kind cpu) that sets no spec.resources.memory, by rollout engine.
#: vLLM's CPU engine is three processes of 2.0 GiB together (PSS, measured with vllm-cpu 0.32.0 on a
#: tiny float32 model) before its weights and KV cache, beside the trainer rank and Ray in the same pod;
#: the transformers engine runs inside the trainer's processes.
CPU_POD_MEMORY_DEFAULTS: dict[str, str] = {"vllm": "6Gi", "transformers": "2Gi"}
#: CPU request of a CPU job's pod that sets no spec.resources.cpu.
CPU_POD_CPU_DEFAULT = "1"
#: vLLM's largest max_lora_rank: vLLM engines serving the adapter (loraSync adapter) cannot hold a
#: larger rank (the trainer's rule, `rljob_trainer.config.vllm_max_lora_rank`, one list for both).
VLLM_MAX_LORA_RANK = trainer_config.VLLM_MAX_LORA_RANKS[-1]


class RolloutSpec(_Spec):
    """Rollout (vLLM) engine settings; unset numbers are chosen by the estimator."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.maxNumSeqs) || !has(self.maxNumBatchedTokens) || self.maxNumBatchedTokens >= "
            "self.maxNumSeqs",
            message="spec.resources.rollout.maxNumBatchedTokens must be at least maxNumSeqs (one token per "
            "decoding sequence); raise maxNumBatchedTokens or lower maxNumSeqs",
            field_path=".maxNumBatchedTokens",
            check=lambda s: (
                s.max_num_seqs is None
                or s.max_num_batched_tokens is None
                or s.max_num_batched_tokens >= s.max_num_seqs
            ),
        ),
    )

    kind: RolloutKind = Field(
        "vllm",
        description="Rollout engine: vllm (every pool, CPU pools included, where vLLM's CPU build runs it; "
        "on CPU its attention takes the head sizes "
        + ", ".join(map(str, VLLM_CPU_ATTENTION_HEAD_SIZES))
        + " only) or transformers (a reference engine that follows vLLM's sleep and weight rules, for "
        "tests and for models vLLM cannot run).",
    )
    tensor_parallel: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Accelerators per rollout engine; must divide acceleratorsPerNode. Default: the smallest "
        "size whose memory holds the weights and a useful KV cache.",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="Fraction of device memory a rollout engine may use (vLLM gpu_memory_utilization).",
    )
    kv_cache_dtype: KVCacheDtype = Field(
        "auto", description="KV cache precision: auto (the model dtype) or fp8."
    )
    max_num_seqs: int | None = Field(
        None,
        ge=1,
        le=1_048_576,
        description="Override: most sequences an engine decodes at once (vLLM max_num_seqs).",
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        le=67_108_864,
        description="Override: most tokens in one engine step, i.e. one prefill's length (vLLM "
        "max_num_batched_tokens). Default: min(KV capacity, max model length).",
    )
    enable_sleep_mode: bool = Field(
        True,
        description="vLLM sleep mode for engines colocated with training: they sleep (level 2) while the "
        "trainer trains and reload weights when they wake. false: they never sleep, and stay awake "
        "beside the trainer.",
    )
    drain_grace_seconds: int = Field(
        300,
        ge=0,
        le=86_400,
        description="Two-phase scale-down: after adaptive mode lowers the dedicated engines, a rollout pod "
        "above the target is deleted once the driver reports it released (no engine, no request left on "
        "it), or this many seconds after the decision without that acknowledgement. 0: at once.",
    )
    engine_timeout_seconds: float = Field(
        600.0,
        gt=0.0,
        le=86400.0,
        description="A dedicated rollout engine whose generate or weight-sync call runs longer than this is "
        "taken as hung: the driver drops it, requeues its requests and reports its pod lost.",
    )
    weight_sync: WeightSyncMode = Field(
        "collective",
        description="How new weights reach rollout engines: collective (one torch.distributed group per "
        "engine, bucketed broadcast: gloo on CPU, NCCL on GPU, HCCL on Ascend) or objectStore (the "
        "fallback: one whole-model dict through Ray's object store).",
    )
    lora_sync: LoRASyncMode = Field(
        "adapter",
        description="With model.finetune.mode lora: adapter (the engines serve the LoRA adapter on the base "
        "model, vLLM enable_lora, so a weight sync sends only the adapter; engines colocated with training "
        "then sleep at level 1, keeping the base in host memory) or merged (the engines serve the merged "
        "model, and every sync sends all weights).",
    )
    chunk_prompt_groups: int | None = Field(
        None,
        ge=1,
        le=65536,
        description="Prompt groups per generate call on a dedicated engine: a weight sync waits for at most "
        "the call in flight, so smaller chunks wait less and batch less. Default: a step's share per engine.",
    )
    partial_rollouts: bool = Field(
        False,
        description="At a weight sync, interrupt the dedicated engines' requests in flight, update the "
        "weights "
        "and resume each from the tokens it has under the new weights (AReaL's interruptible generation); "
        "every token keeps the weights version and log-prob it was sampled with, so staleness and the "
        "truncated importance weights are per token. false: the sync waits for the calls in flight. vLLM "
        "engines use pause_generation(mode=abort) / resume_generation (not yet run on a GPU: "
        "docs/pipeline.md).",
    )


class AdaptiveSpec(_Spec):
    """Adaptive mode: at each weight sync, wake the colocated engine or add rollout engines under pressure."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="self.scaleUpAfterPressuredSyncPoints >= self.wakeAfterPressuredSyncPoints",
            message="spec.resources.adaptive.scaleUpAfterPressuredSyncPoints must be at least "
            "wakeAfterPressuredSyncPoints (wake the colocated engine before adding engines)",
            field_path=".scaleUpAfterPressuredSyncPoints",
            check=lambda s: s.scale_up_after_pressured_sync_points >= s.wake_after_pressured_sync_points,
        ),
    )

    max_rollout_engines: int | None = Field(
        None,
        ge=0,
        le=65536,
        description="Most dedicated rollout engines. Default: as many as idle accelerators allow.",
    )
    signal: AdaptiveSignal = Field(
        "integrated",
        description="integrated measures load over the whole interval between sync points; snapshot reads "
        "it only at the sync point (the seed's rule, which misses generation that already finished).",
    )
    busy_threshold: float = Field(
        1.0,
        ge=0.0,
        le=1.0e6,
        description="Mean in-flight requests per engine at or above which rollout counts as busy.",
    )
    wait_threshold: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="Fraction of the interval the trainer waited for data at or above which it counts as "
        "starved.",
    )
    wake_after_pressured_sync_points: int = Field(
        2,
        ge=1,
        le=1000,
        description="Consecutive pressured sync points (busy and starved) before the colocated engine wakes.",
    )
    scale_up_after_pressured_sync_points: int = Field(
        4,
        ge=1,
        le=1000,
        description="Consecutive pressured sync points before an engine is added on idle accelerators.",
    )
    calm_sync_points_before_scale_down: int = Field(
        3,
        ge=1,
        le=1000,
        description="Consecutive calm sync points before an added engine is removed or the colocated one "
        "sleeps.",
    )
    cooldown_seconds: int = Field(
        60, ge=0, le=86400, description="Minimum seconds between two scaling decisions."
    )


class ResourcesSpec(_Spec):
    """Accelerators, how they split between trainer and rollout, and engine settings."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="self.mode != 'static' || has(self.static)",
            message="spec.resources.static (trainerAccelerators, rolloutAccelerators) is required when mode "
            "is static",
            field_path=".static",
            reason="FieldValueRequired",
            check=lambda s: s.mode != "static" or s.static is not None,
        ),
        CelRule(
            rule="self.totalAccelerators % self.acceleratorsPerNode == 0",
            message="spec.resources.acceleratorsPerNode must divide totalAccelerators (whole nodes per job)",
            field_path=".acceleratorsPerNode",
            check=lambda s: s.total_accelerators % s.accelerators_per_node == 0,
        ),
        CelRule(
            rule="!has(self.rollout.tensorParallel) || self.acceleratorsPerNode % "
            "self.rollout.tensorParallel == 0",
            message="spec.resources.rollout.tensorParallel must divide acceleratorsPerNode (an engine stays "
            "on one node)",
            field_path=".rollout.tensorParallel",
            check=lambda s: (
                s.rollout.tensor_parallel is None or s.accelerators_per_node % s.rollout.tensor_parallel == 0
            ),
        ),
        CelRule(
            rule="!has(self.static) || self.static.trainerAccelerators + self.static.rolloutAccelerators "
            "<= self.totalAccelerators",
            message="spec.resources.static: trainerAccelerators + rolloutAccelerators must not exceed "
            "totalAccelerators",
            field_path=".static",
            check=lambda s: (
                s.static is None
                or s.static.trainer_accelerators + s.static.rollout_accelerators <= s.total_accelerators
            ),
        ),
        CelRule(
            rule="!has(self.static) || !has(self.rollout.tensorParallel) "
            "|| self.static.rolloutAccelerators % self.rollout.tensorParallel == 0",
            message="spec.resources.static.rolloutAccelerators must be a multiple of rollout.tensorParallel",
            field_path=".static.rolloutAccelerators",
            check=lambda s: (
                s.static is None
                or s.rollout.tensor_parallel is None
                or s.static.rollout_accelerators % s.rollout.tensor_parallel == 0
            ),
        ),
    )

    accelerator: AcceleratorSpec = Field(description="Accelerator kind and model of every pod.")
    total_accelerators: int = Field(
        ge=1, le=65536, description="Accelerators the job may use in all (CPU jobs: worker processes)."
    )
    accelerators_per_node: int = Field(
        8, ge=1, le=64, description="Accelerators per pod (one pod per node); must divide totalAccelerators."
    )
    mode: ResourceMode = Field(
        "estimate",
        description="static uses the static split; estimate sizes trainer and rollout once before launch; "
        "adaptive also wakes the colocated engine and adds engines at weight syncs when rollout is the "
        "bottleneck.",
    )
    static: StaticSplitSpec | None = Field(
        None, description="The explicit split; required when mode is static."
    )
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec, description="Rollout engine settings and overrides."
    )
    adaptive: AdaptiveSpec = Field(default_factory=AdaptiveSpec, description="Thresholds of adaptive mode.")
    cpu: Quantity | None = Field(
        None,
        description="CPU request and limit per pod, for example 4 or 500m. Default: none for accelerator "
        "jobs, 1 for cpu jobs.",
    )
    memory: Quantity | None = Field(
        None,
        description="Memory request and limit per pod, for example 8Gi. Default: none for accelerator jobs; "
        "for cpu jobs 6Gi with rollout.kind vllm (vLLM's CPU engine alone takes about 2 GiB before its "
        "weights and KV cache) and 2Gi with transformers. On cpu jobs it is also the memory the estimator "
        "plans the rollout engine in (shared by the pod's acceleratorsPerNode workers).",
    )
    extra_resources: dict[str, Quantity] = Field(
        default_factory=dict,
        description="More resources each pod requests and is limited to, for example hugepages-2Mi: 1Gi or "
        "an RDMA device plugin's resource. Default: the node pool's (spec.pool).",
    )

    @property
    def pod_cpu(self) -> Quantity | None:
        """The CPU request (= limit) of every pod: spec.resources.cpu, else 1 on cpu jobs, else none."""
        if self.cpu is not None or self.accelerator.kind != "cpu":
            return self.cpu
        return CPU_POD_CPU_DEFAULT

    @property
    def pod_memory(self) -> Quantity | None:
        """The memory request (= limit) of every pod: spec.resources.memory, else on cpu jobs the
        default of the rollout engine (`CPU_POD_MEMORY_DEFAULTS`), else none."""
        if self.memory is not None or self.accelerator.kind != "cpu":
            return self.memory
        return CPU_POD_MEMORY_DEFAULTS[self.rollout.kind]

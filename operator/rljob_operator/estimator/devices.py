"""Accelerator catalog: memory, HBM bandwidth, dense bf16 peak and the Kubernetes resource name.

Role: the hardware side of every estimate. :mod:`rollout` and :mod:`trainer` read
``memory_bytes``; :mod:`throughput` reads ``hbm_bandwidth_bytes_per_s`` and
``bf16_flops_per_s``; the operator's pod builders read ``resource_name``. Users add or
override entries in the RLJob spec; :func:`merge_catalog` folds them in and
:func:`get_device` looks one up, raising :class:`EstimatorError` listing valid names.

``memory_bytes`` is what the runtime reports as total device memory (``torch.cuda.mem_get_info``),
which is what vLLM multiplies by ``gpu_memory_utilization``; it is a little below the marketing
capacity (an "80 GB" H100 reports about 79.2 GiB). Bandwidth and FLOPs are the vendors' published
dense (no sparsity) figures; Ascend 910B figures are the commonly published approximate values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field

from rljob_operator import errors

GIB = 1 << 30
_TB = 10**12


class DeviceSpec(BaseModel):
    """One accelerator model."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(description="Catalog key, e.g. 'H100-80GB'.")
    memory_bytes: int = Field(gt=0, description="Device memory the runtime reports, bytes.")
    hbm_bandwidth_bytes_per_s: float = Field(gt=0, description="Peak HBM bandwidth, bytes/s.")
    bf16_flops_per_s: float = Field(gt=0, description="Dense bf16 peak, FLOP/s.")
    resource_name: str = Field(default="nvidia.com/gpu", description="Kubernetes extended resource.")
    vendor: str = Field(default="nvidia", description="nvidia | amd | huawei | other")
    runtime_overhead_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Per-process runtime allowance (CUDA context, NCCL, graphs); None = built-in rule.",
    )

    @property
    def is_cpu(self) -> bool:
        """A nominal CPU "device" (tests, the local demo): no CUDA context, graphs or NCCL buffers."""
        return self.resource_name == "cpu"


def _spec(name: str, mem_gib: float, bw_tb: float, tflops: float, resource: str, vendor: str) -> DeviceSpec:
    return DeviceSpec(
        name=name,
        memory_bytes=int(mem_gib * GIB),
        hbm_bandwidth_bytes_per_s=bw_tb * _TB,
        bf16_flops_per_s=tflops * _TB,
        resource_name=resource,
        vendor=vendor,
    )


_NV, _AMD, _ASCEND = "nvidia.com/gpu", "amd.com/gpu", "huawei.com/Ascend910"

#: Built-in catalog. Memory is the runtime-reported total (GiB); bandwidth in TB/s; dense bf16 TFLOP/s.
DEFAULT_CATALOG: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        _spec("H100-80GB", 79.19, 3.35, 989.4, _NV, "nvidia"),  # H100 SXM5 HBM3
        _spec("H100-PCIe", 79.19, 2.0, 756.0, _NV, "nvidia"),
        _spec("H200", 139.8, 4.8, 989.4, _NV, "nvidia"),  # H200 SXM 141 GB HBM3e
        _spec("A100-40GB", 39.39, 1.555, 312.0, _NV, "nvidia"),
        _spec("A100-80GB", 79.15, 2.039, 312.0, _NV, "nvidia"),
        _spec("L40S", 44.39, 0.864, 362.1, _NV, "nvidia"),
        _spec("B200", 178.4, 8.0, 2250.0, _NV, "nvidia"),  # HGX B200, 180 GB HBM3e
        _spec("MI300X", 191.5, 5.3, 1307.4, _AMD, "amd"),
        _spec("Ascend910B1", 64.0, 1.6, 414.0, _ASCEND, "huawei"),
        _spec("Ascend910B2", 64.0, 1.6, 376.0, _ASCEND, "huawei"),
        _spec("Ascend910B3", 64.0, 1.6, 313.0, _ASCEND, "huawei"),
        _spec("Ascend910B4", 32.0, 0.8, 280.0, _ASCEND, "huawei"),
    )
}

#: Accepted spellings -> catalog key.
ALIASES: dict[str, str] = {
    "H100": "H100-80GB",
    "H100-SXM": "H100-80GB",
    "H100-80GB-SXM": "H100-80GB",
    "A100": "A100-80GB",
    "Ascend910B": "Ascend910B2",
    "910B1": "Ascend910B1",
    "910B2": "Ascend910B2",
    "910B3": "Ascend910B3",
    "910B4": "Ascend910B4",
}


def merge_catalog(
    custom: Iterable[DeviceSpec] = (), base: Mapping[str, DeviceSpec] | None = None
) -> dict[str, DeviceSpec]:
    """Return ``base`` (default catalog) with ``custom`` entries added; same name replaces."""
    catalog = dict(DEFAULT_CATALOG if base is None else base)
    for device in custom:
        catalog[device.name] = device
    return catalog


def get_device(name: str, custom: Iterable[DeviceSpec] = ()) -> DeviceSpec:
    """Look up ``name`` (case-insensitive, aliases allowed) in the catalog merged with ``custom``."""
    catalog = merge_catalog(custom)
    folded = {key.lower(): key for key in catalog}
    folded.update({alias.lower(): key for alias, key in ALIASES.items() if key in catalog})
    key = folded.get(name.lower())
    if key is None:
        raise errors.UnknownAcceleratorError(
            "accelerator",
            f"unknown accelerator {name!r}; valid: {', '.join(sorted(catalog))} "
            "(or add it under customDevices)",
        )
    return catalog[key]

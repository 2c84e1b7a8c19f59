"""What the installed vLLM can do on this machine, asked of vLLM itself; never inferred from a device name.

Role: vLLM keeps every device difference behind `vllm.platforms.current_platform` (cuda, rocm, cpu,
npu through vllm-ascend): `is_sleep_mode_available()`, `device_type`, the attention backends. rljob
asks the same object (`probe`) and records the answer (`EngineCapabilities`) where the driver, the
telemetry and the status read it: whether a shared engine can really sleep or must be shut down and
started again, which weight paths can work, which head sizes the attention backend takes.

`setup_vllm_process` is registered as a vLLM general plugin (pyproject's `vllm.general_plugins`
entry point), which vLLM loads in every one of its processes (the front end, EngineCore, each
worker). It does two things vLLM does not:
- `request_amx_permission`: on Linux x86-64 a process must ask the kernel for the AMX tile state
  (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`) before its first AMX instruction, and vLLM's
  CPU attention kernels use AMX for bf16 without asking (a tiny model dies with SIGILL at
  `tilezero`; a large one gets the permission by chance from oneDNN first);
- `die_with_parent`: vLLM's workers watch their EngineCore through a pipe and exit with it, but the
  EngineCore outlives a front end killed without shutting it down (a Ray actor killed, a driver
  SIGKILLed), holding gigabytes until the pod goes; the processes vLLM starts ask Linux to kill them
  when their parent exits.
Callers: vLLM (the plugin), `engines.vllm_engine`, the driver, tests.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform as host_platform
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# <asm/prctl.h>: request permission for an extended state component; 18 is the AMX tile data.
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158  # x86-64 syscall number

# vLLM 0.32's CPU attention (`cpu_attention_with_kv_cache`) supports these head sizes only
# (vllm/v1/attention/backends/cpu_attn.py `CPUAttentionBackend.get_supported_head_sizes`); read from
# the installed vLLM by `cpu_attention_head_sizes()`, kept here for the operator-side check that
# cannot import vLLM (the conformance tier asserts the two agree).
CPU_ATTENTION_HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def setup_vllm_process() -> None:
    """The vLLM general plugin: what every vLLM process needs that vLLM does not do itself."""
    request_amx_permission()
    die_with_parent()


def die_with_parent() -> bool:
    """In a process vLLM started (a `multiprocessing` child: EngineCore, a worker), have Linux SIGKILL
    it when its parent exits; exit at once if the parent is already gone. True when armed. No-op in
    the process that runs vLLM's front end (not a multiprocessing child) and off Linux."""
    import multiprocessing
    import signal
    import sys

    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if armed and parent.pid is not None and os.getppid() != parent.pid:  # it died before we armed
        os._exit(1)
    return armed


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile-data permission in this process (a vLLM general plugin: vLLM calls it in
    every process it starts). True when granted or already held; False where there is no AMX
    (another CPU, another OS): nothing to do there."""
    if host_platform.system() != "Linux" or host_platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        granted = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False
    if not granted:  # EINVAL/EOPNOTSUPP: no AMX on this CPU, nothing can use it
        log.debug("AMX tile data not granted (errno %s): no AMX here", ctypes.get_errno())
    return granted


@dataclass(frozen=True)
class EngineCapabilities:
    """What one installed vLLM can do here (`probe`); plain data, sent in telemetry as a dict.

    `device_type`: vLLM's `current_platform.device_type` ("cuda", "cpu", "npu", ...);
    `sleep_mode`: `current_platform.is_sleep_mode_available()`: without it a shared engine told to
    sleep is shut down and started again (`vllm_engine.VLLMEngine.sleep`), never trusted to sleep;
    `static_graphs`: `current_platform.support_static_graph_mode()` (CUDA graphs): where false, compiling
    the model buys little and costs every start; `host_memory_kv`: the KV cache lives in host memory
    (`current_platform.is_cpu()`), sized from bytes the engine is told (`rollout.cpuKvCacheBytes`);
    `weight_transfer_backends`: the backends of vLLM's weight-transfer API that can work on this
    platform (NCCL and CUDA IPC need a CUDA-alike device); `head_sizes`: what the attention backend
    takes, where vLLM says (empty: not restricted by rljob's knowledge); `seeded_chunked_prefill`:
    whether a seeded request may be prefilled in chunks: vLLM rewinds the request's torch generator
    when it discards the token sampled after a partial prefill, and a generator without offsets (the
    CPU's, `generator_has_offset`) kills the EngineCore there, so the engine turns chunked prefill
    off (`vllm_engine.engine_args`)."""

    vllm_version: str
    device_type: str
    sleep_mode: bool
    static_graphs: bool = True
    host_memory_kv: bool = False
    weight_transfer_backends: tuple[str, ...] = ()
    head_sizes: tuple[int, ...] = ()
    seeded_chunked_prefill: bool = True
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cpu_attention_head_sizes() -> tuple[int, ...]:
    """The head sizes the installed vLLM's CPU attention backend supports (its own list)."""
    from vllm.v1.attention.backends import cpu_attn

    return tuple(int(h) for h in cpu_attn.CPUAttentionBackend.get_supported_head_sizes())


def generator_has_offset(device: str) -> bool:
    """Whether torch's random generator on `device` keeps an offset vLLM can rewind (CUDA's does;
    the CPU's raises "CPU Generator does not use offset")."""
    import torch

    try:
        torch.Generator(device=device).get_offset()
    except RuntimeError:
        return False
    return True


def probe() -> EngineCapabilities | None:
    """Ask the installed vLLM's platform what it can do (None when vLLM is not installed). Starts
    nothing; imports vLLM."""
    try:
        import vllm
        from vllm.platforms import current_platform
    except ImportError:
        return None
    version = str(getattr(vllm, "__version__", "unknown"))
    device = str(current_platform.device_type)
    notes = []
    sleep = bool(current_platform.is_sleep_mode_available())
    if not sleep:
        notes.append(f"vLLM {version} on {device}: no sleep mode (a shared engine is stopped and restarted)")
    from rljob_trainer.weights import weight_sync  # deferred: torch

    api = weight_sync.detect_vllm_weight_transfer()
    # What the weight-transfer API offers, where the platform's collectives can carry it.
    backends = tuple(sorted(api.backends)) if api is not None and api.dist_backend != "gloo" else ()
    head_sizes: tuple[int, ...] = ()
    host_memory_kv = bool(current_platform.is_cpu())
    seeded_chunked_prefill = True
    if host_memory_kv:
        head_sizes = cpu_attention_head_sizes()
        # Only the host's generator is tried: creating another device's here would start its runtime.
        seeded_chunked_prefill = generator_has_offset("cpu")
        if not seeded_chunked_prefill:
            notes.append(
                f"vLLM {version} on {device}: chunked prefill off (a seeded request's generator cannot be "
                "rewound after a partial prefill)"
            )
    return EngineCapabilities(
        vllm_version=version,
        device_type=device,
        sleep_mode=sleep,
        static_graphs=bool(current_platform.support_static_graph_mode()),
        host_memory_kv=host_memory_kv,
        weight_transfer_backends=backends,
        head_sizes=head_sizes,
        seeded_chunked_prefill=seeded_chunked_prefill,
        notes=tuple(notes),
    )

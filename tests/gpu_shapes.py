"""GPUs of each architecture as the kernel plan sees them, for tests and tools that plan or
compile kernels without a GPU: opt-in shared memory per block (bytes) and SMs of an A100,
an RTX 3090, an RTX 4090 and an H100."""

from __future__ import annotations

from types import SimpleNamespace

GPUS = {"sm_80": (166_912, 108), "sm_86": (101_376, 82), "sm_89": (101_376, 128),
        "sm_90": (232_448, 132)}
# Peak memory bandwidth (bytes/s) of the two sm_90 GPUs the megakernel lays out differently.
H100_BANDWIDTH, H200_BANDWIDTH = 3.35e12, 4.8e12


def gpu_shape(arch: str, cooperative: bool = True, bandwidth: float = 0.0) -> SimpleNamespace:
    """What plan_kernels reads of a GPU (engine/cuda/megakernel.py's GpuShape)."""
    shared, sms = GPUS[arch]
    return SimpleNamespace(arch=arch, sm_count=sms, max_shared_per_block_optin=shared,
                           cooperative_launch=cooperative, memory_bandwidth=bandwidth)

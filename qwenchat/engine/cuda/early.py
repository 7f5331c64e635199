"""Kernel compiles started before the driver is up, so that a first run's compiles overlap
the engine's start (cuda-python's driver bindings, cuInit, the context, the weights' upload)
instead of following it.

NVRTC needs only the GPU's architecture, and NVML (the driver's management library, which
answers without initialising CUDA) gives it in about 10 ms. Where every GPU NVML reports has
the same compute capability (so CUDA's device order cannot matter), a thread guesses the
architecture and starts the run's builds, the megakernel's aside (it waits for the GPU's
shared memory and SM count); the engine's own compilation then waits for those compiles
instead of running them again (compiler.py, _IN_FLIGHT). The thread plans from builds.py,
which leaves the driver's bindings alone, and the engine waits for it (at most
EARLY_START_WAIT_S) before importing them: that import holds Python's lock for the whole of
its half second, so a thread that needs the lock meanwhile waits as long (docs/perf.md,
2026-11-28). A wrong or missing guess costs nothing but the guess: the engine compiles what
it needs as it always did."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

from qwenchat.model.checkpoint import WeightSource
from qwenchat.model.config import Qwen3Config

NVML_LIBRARY = "libnvidia-ml.so.1"
# How long the engine waits for the early compiles to be under way before it imports the
# driver's bindings (a guess, a plan and NVRTC's import: ~0.1-0.4 s where all goes well)
EARLY_START_WAIT_S = 1.0


def architecture_of(capabilities: list[tuple[int, int]]) -> str | None:
    """The one architecture of these GPUs ("sm_90"), or None where there is none or several."""
    if not capabilities or len(set(capabilities)) != 1:
        return None
    major, minor = capabilities[0]
    return f"sm_{major}{minor}"


def nvml_capabilities(load: Callable[[str], ctypes.CDLL] = ctypes.CDLL
                      ) -> list[tuple[int, int]]:
    """Every GPU's compute capability as NVML reports it, or [] where NVML is not there or
    fails (nothing is raised)."""
    try:
        nvml = load(NVML_LIBRARY)
    except OSError:
        return []
    if nvml.nvmlInit_v2() != 0:
        return []
    found: list[tuple[int, int]] = []
    try:
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            major, minor = ctypes.c_int(0), ctypes.c_int(0)
            if (nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0 or
                    nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major),
                                                            ctypes.byref(minor)) != 0):
                return []
            found.append((major.value, minor.value))
    finally:
        nvml.nvmlShutdown()
    return found


def guess_architecture() -> str | None:
    """The architecture the CUDA engine will find, where NVML can tell without CUDA."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return None  # (no GPU for CUDA: nothing will compile)
    return architecture_of(nvml_capabilities())


def start_early_compiles(config: Qwen3Config, weights: WeightSource, kv_cache: str = "bf16",
                         fp8_activations: str = "auto",
                         guess: Callable[[], str | None] = guess_architecture
                         ) -> threading.Thread:
    """A daemon thread that guesses the architecture and starts the run's non-megakernel
    builds compiling into the kernel cache (a cached build costs a file read), and ends once
    they are under way; every failure in it is silent, since the engine compiles what it
    needs anyway."""

    def run() -> None:
        try:
            arch = guess()
            if arch is None:
                return
            # (builds.py, not engine.py: the engine imports the driver's bindings)
            from qwenchat.engine.cuda.builds import (
                kernel_builds,
                prefill_paths,
                run_weights,
                unsupported_reason,
            )
            from qwenchat.engine.cuda.compiler import KernelCache

            _, weight_format = run_weights(weights)
            if unsupported_reason(config, weight_format):
                return
            hopper_gemm, hopper_attention, fp8_gemm = prefill_paths(
                config, weight_format, arch, fp8_activations=fp8_activations)
            builds = kernel_builds(config, weight_format, arch, hopper_gemm=hopper_gemm,
                                   hopper_attention=hopper_attention, megakernel=None,
                                   kv_format=kv_cache, fp8_gemm=fp8_gemm)
            KernelCache().start(builds)
        except Exception:  # (a guess: the engine's own compiles decide)
            return

    thread = threading.Thread(target=run, name="qwenchat-early-compiles", daemon=True)
    thread.start()
    return thread

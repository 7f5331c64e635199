"""Engines that run the model, and the choice between them (`--backend`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qwenchat.engine.base import Engine, GenerateRequest, Generation, StopReason
from qwenchat.engine.cuda.probe import NO_DRIVER
from qwenchat.errors import BackendUnavailable, UsageError
from qwenchat.model import rope
from qwenchat.model.checkpoint import WeightSource
from qwenchat.model.config import Qwen3Config
from qwenchat.model.fp8 import QUANTIZE_CHOICES, with_quantization
from qwenchat.model.kv_cache import KV_CACHE_CHOICES

BACKENDS = ("auto", "cuda", "cpu")
DECODES = ("auto", "megakernel", "layered")  # the CUDA engine's decode paths
# FP8 weights' prefill activations: "auto", e4m3 wherever the GPU has FP8 tensor cores
# (gemm_fp8_sm90.cu; the CPU engine rounds them only when asked, "e4m3"); "bf16" keeps the
# codes widened to bf16 (comparisons, docs/prefill_v2.md).
FP8_ACTIVATIONS = ("auto", "e4m3", "bf16")

__all__ = ["BACKENDS", "Engine", "EngineFlags", "GenerateRequest", "Generation", "StopReason",
           "check_engine_flags", "create_engine"]


@dataclass(kw_only=True)
class EngineFlags:
    """The engine's flags, which every command that runs a model takes (ask, the chat, serve,
    bench, eval) and checks alike: each command's options extend it."""

    backend: str = "auto"
    ctx: int | None = None
    device: int = 0
    decode: str = "auto"  # the CUDA engine's decode path
    quantize: str = "none"  # "fp8" or "int4": the linear layers quantized at load time
    kv_cache: str = "bf16"  # the KV cache's format (qwenchat/model/kv_cache.py)
    rope_scaling: str | None = None  # --rope-scaling (qwenchat/model/rope.py)

    def check_engine_flags(self) -> None:
        """One line (UsageError) for the first flag that is wrong, before anything loads."""
        check_engine_flags(self.backend, self.ctx, self.device, self.decode, self.quantize,
                           self.kv_cache, self.rope_scaling)

    def roped(self, config: Qwen3Config) -> Qwen3Config:
        """`config` with --rope-scaling applied."""
        return rope.with_flag(config, self.rope_scaling)

    def engine_options(self) -> dict[str, Any]:
        """create_engine's keyword arguments that these flags give (the backend, the config
        and the context are its positional ones: each command decides them)."""
        return {"device": self.device, "decode": self.decode, "quantize": self.quantize,
                "kv_cache": self.kv_cache}


def check_engine_flags(backend: str, ctx: int | None, device: int,
                       decode: str = "auto", quantize: str = "none",
                       kv_cache: str = "bf16", rope_scaling: str | None = None) -> None:
    """Validate --backend, --ctx, --device, --decode, --quantize, --kv-cache and
    --rope-scaling before anything is loaded, so mistakes fail fast."""
    if rope_scaling is not None:
        rope.parse_flag(rope_scaling)
    if backend not in BACKENDS:
        raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if decode not in DECODES:
        raise UsageError(f"--decode must be one of {', '.join(DECODES)}; got {decode!r}")
    if quantize not in QUANTIZE_CHOICES:
        raise UsageError(f"--quantize must be one of {', '.join(QUANTIZE_CHOICES)}; "
                         f"got {quantize!r}")
    if kv_cache not in KV_CACHE_CHOICES:
        raise UsageError(f"--kv-cache must be one of {', '.join(KV_CACHE_CHOICES)}; "
                         f"got {kv_cache!r}")
    if ctx is not None and ctx < 2:
        raise UsageError(f"--ctx must be at least 2 tokens; got {ctx}")
    if device < 0:
        raise UsageError(f"--device must be a GPU index (0 or more); got {device}")


def create_engine(
    backend: str,
    config: Qwen3Config,
    weights: WeightSource,
    ctx: int | None = None,
    device: int = 0,
    notice: Callable[[str], None] = lambda _: None,
    decode: str = "auto",
    quantize: str = "none",
    progress: Callable[[str], None] | None = None,
    kv_cache: str = "bf16",
    megakernel_later: bool = False,
    fp8_activations: str = "auto",
) -> Engine:
    """The engine for `backend`; `auto` falls back to the CPU and says why through `notice`.
    `quantize` "fp8" runs the linear layers in FP8 (an FP8 checkpoint always does), "int4" in
    4 bits (an AWQ checkpoint always does); `kv_cache` "int8" keeps keys and values in 8 bits
    (qwenchat/model/kv_cache.py). `progress` gets a line as
    each GPU kernel compile ends (the first run for a model). `megakernel_later` lets a first
    run answer before the decode megakernel has compiled (CudaEngine). `fp8_activations`:
    FP8 weights' prefill on e4m3 activations ("auto", where the GPU has FP8 tensor cores;
    "e4m3" also has the reference engine round them so) or bf16 ones ("bf16")."""
    check_engine_flags(backend, ctx, device, decode, quantize, kv_cache)
    rope.check_context(config, ctx)
    if backend in ("auto", "cuda") and device > 0:
        _check_device(device)
    weights = with_quantization(weights, quantize)
    if backend in ("auto", "cuda"):
        try:
            return _cuda_engine(config, weights, ctx, device, notice, decode, progress, kv_cache,
                                megakernel_later, fp8_activations)
        except BackendUnavailable as why:
            if backend == "cuda":
                fix = "" if str(why).endswith("use --backend cpu") else "; use --backend cpu"
                raise BackendUnavailable(f"--backend cuda: {why}{fix}") from None
            notice(_fallback_notice(str(why)))
    from qwenchat.engine.reference import ReferenceEngine

    return ReferenceEngine(config, weights, ctx, kv_cache=kv_cache,
                           fp8_activations=fp8_activations == "e4m3")


def _fallback_notice(why: str) -> str:
    """What `--backend auto` says as it runs on the CPU: one short line where there is no
    NVIDIA driver (a machine without a GPU, nothing to fix), else the cause and its fix."""
    if why == NO_DRIVER:
        return "no NVIDIA driver: running on the CPU (--backend cpu skips this note)"
    return f"running on the CPU: {why}"


def _check_device(device: int) -> None:
    """An explicit --device past the GPUs there are is a usage error (exit 2), not a quiet
    fall back to the CPU: the user asked for that GPU. (--device 0, the default, still falls
    back where no GPU is usable.)"""
    from qwenchat.engine.cuda.probe import probe  # (looked up now: tests stand in for it)

    gpus = len(probe().gpus)  # none where cuda-python or the driver is missing
    if device >= gpus:
        have = f"{gpus} GPU{'s' if gpus != 1 else ''}" + (f" (0-{gpus - 1})" if gpus else "")
        raise UsageError(f"--device {device}: this machine has {have}; see qwenchat info")


def _cuda_engine(config: Qwen3Config, weights: WeightSource, ctx: int | None, device: int,
                 notice: Callable[[str], None], decode: str,
                 progress: Callable[[str], None] | None, kv_cache: str = "bf16",
                 megakernel_later: bool = False, fp8_activations: str = "auto") -> Engine:
    from qwenchat.engine.cuda.early import EARLY_START_WAIT_S, start_early_compiles
    from qwenchat.engine.cuda.probe import probe

    # (the kernels a first run compiles start now, and run on beside cuda-python's import,
    # cuInit and the upload; the import waits for them to be under way: early.py)
    start_early_compiles(config, weights, kv_cache, fp8_activations).join(EARLY_START_WAIT_S)
    found = probe()
    if not found.usable:
        raise BackendUnavailable("; ".join(found.problems) or "no usable GPU")
    from qwenchat.engine.cuda.engine import CudaEngine

    return CudaEngine(config, weights, ctx, device, notice, decode, progress=progress,
                      kv_cache=kv_cache, megakernel_later=megakernel_later,
                      fp8_activations=fp8_activations)

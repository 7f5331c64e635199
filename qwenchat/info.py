"""`qwenchat info`: what this machine and installation offer, and where files live; with
`--compile`, the kernels of a model compiled ahead of its first run."""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

from qwenchat import __version__, paths
from qwenchat.errors import BackendUnavailable, UsageError
from qwenchat.model.formats import gpu_format
from qwenchat.model.fp8 import with_quantization
from qwenchat.model.locate import looks_like_path, resolve_model
from qwenchat.model.presets import named_config

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
NO_GPU = "--compile builds for a GPU and found none usable"

PACKAGES = ("numpy", "tokenizers", "safetensors", "jinja2", "huggingface_hub", "platformdirs",
            "typer", "rich", "textual", "cuda-python", "cuda-bindings", "torch", "transformers")

Section = tuple[str, list[tuple[str, str]]]
WEIGHT_FORMATS = ("bf16 (f16 and f32 checkpoints are converted to it); fp8: Qwen's FP8 "
                  "checkpoints (e4m3, 128 x 128 blocks) and any checkpoint with --quantize fp8, "
                  "converted in registers on sm_80 and newer; decode dots them on the tensor "
                  "cores on sm_89 and newer; int4: Qwen's AWQ checkpoints and --quantize int4 "
                  "(groups of 128, zero points), decode dots them on the tensor cores, prefill "
                  "dequantizes a matrix at a time to bf16")

KV_FORMATS = ("bf16; int8 (--kv-cache int8: 8-bit codes and a scale a head and token, about "
              "half the bytes a cached token takes)")


def gather() -> list[Section]:
    return [_software(), _gpu(), _locations()]


def _software() -> Section:
    rows = [("qwenchat", __version__),
            ("python", f"{platform.python_version()} ({sys.executable})"),
            ("platform", platform.platform())]
    for name in PACKAGES:
        try:
            rows.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            rows.append((name, "not installed"))
    return "Software", rows


def _gpu() -> Section:
    try:
        from qwenchat.engine.cuda.probe import probe, probe_nvrtc

        found = probe()
        # (without a driver the probe leaves NVRTC out; info still says whether it is there)
        nvrtc = found.nvrtc_version if found.driver_version else probe_nvrtc()
    except Exception as exc:  # a broken CUDA install must not break `info` itself
        return "GPU", [("status", f"CUDA probe failed: {exc}")]
    rows = [("driver", found.driver_version or "not found"),
            ("nvrtc", nvrtc or "not found")]
    for gpu in found.gpus:
        major, minor = gpu.compute_capability
        rows.append((f"gpu {gpu.index}", f"{gpu.name}, sm_{major}{minor}, "
                     f"{gpu.total_memory / 2**30:.1f} GiB, {gpu.sm_count} SMs"))
    rows.extend(("problem", p) for p in found.problems)
    rows.append(("cuda backend", "usable" if found.usable else "not usable: CPU fallback"))
    rows.append(("weight formats", WEIGHT_FORMATS))
    rows.append(("KV cache formats", KV_FORMATS))
    return "GPU", rows


def _locations() -> Section:
    cubins = paths.kernel_cache_dir()
    return "Locations", [
        ("models (Hugging Face cache)", str(paths.hf_cache_dir())),
        ("compiled kernels", f"{cubins} ({paths.tree_size(cubins) / 2**20:.1f} MiB)"),
        ("chat history", str(paths.data_dir())),
    ]


@dataclass
class CompileOptions:
    """`qwenchat info --compile`: the model (a directory or hub id) or a known size."""

    model: str | None = None
    config: str | None = None
    quantize: str = "none"
    device: int = 0
    decode: str = "auto"


def precompile(options: CompileOptions, say: Callable[[str], None]) -> str:
    """Compile every kernel a run of the model would build on this GPU into the cache, so its
    first chat starts without compiling; returns the one-line summary."""
    from qwenchat.engine import check_engine_flags

    check_engine_flags("cuda", None, options.device, options.decode, options.quantize)
    if options.model is not None and options.config is not None:
        raise UsageError("--model and --config both name the model to compile for: give one")
    known = named_config(options.config) if options.config is not None else None
    if options.model is not None and looks_like_path(options.model):
        resolve_model(options.model)  # a wrong directory is a usage error, whatever the GPU
    _require_gpu()  # before the model: nothing downloaded for a machine that cannot compile
    if known is not None:
        name, config = options.config, known
        weight_format = gpu_format(options.quantize).name
    else:
        from qwenchat.model.loader import open_model

        model = open_model(options.model or DEFAULT_MODEL)
        name, config = model.spec, model.config
        # The GPU runs FP8 checkpoints (or --quantize fp8) in FP8, AWQ ones (or --quantize
        # int4) in int4, any other dtype in bf16.
        quantized = with_quantization(model.checkpoint, options.quantize)
        weight_format = gpu_format(quantized.weight_format).name
        model.close()
    from qwenchat.engine.cuda.engine import compile_kernels

    started = time.perf_counter()
    try:
        gpu, plan, compilation = compile_kernels(config, weight_format, options.device,
                                                 options.decode, announce=say, progress=say)
    except BackendUnavailable as exc:
        raise BackendUnavailable(f"{NO_GPU}: {exc}") from None
    seconds = time.perf_counter() - started
    cached = len(plan.builds) - len(compilation.to_compile)
    return (f"{len(plan.builds)} kernels for {name} ({weight_format}, {plan.decode} decode) on "
            f"{gpu}: {len(compilation.to_compile)} compiled, {cached} already cached, "
            f"{seconds:.1f} s; kept in {paths.kernel_cache_dir()}")


def _require_gpu() -> None:
    """A one-line error where this machine has no GPU the CUDA engine can use."""
    from qwenchat.engine.cuda.probe import probe

    found = probe()
    if not found.usable:
        raise BackendUnavailable(f"{NO_GPU}: {'; '.join(found.problems) or 'no usable GPU'}")

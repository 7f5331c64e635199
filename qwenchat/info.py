"""`qwenchat info`: what this machine and installation offer, and where files live."""

from __future__ import annotations

import platform
import sys
from importlib import metadata

from qwenchat import __version__, paths

PACKAGES = ("numpy", "tokenizers", "safetensors", "jinja2", "huggingface_hub", "platformdirs",
            "typer", "rich", "textual", "cuda-python", "cuda-bindings", "torch", "transformers")

Section = tuple[str, list[tuple[str, str]]]
WEIGHT_FORMATS = ("bf16 (f16 and f32 checkpoints are converted to it); fp8: Qwen's FP8 "
                  "checkpoints (e4m3, 128 x 128 blocks) and any checkpoint with --quantize fp8, "
                  "converted in registers on sm_80 and newer")


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
        from qwenchat.engine.cuda.probe import probe

        found = probe()
    except Exception as exc:  # a broken CUDA install must not break `info` itself
        return "GPU", [("status", f"CUDA probe failed: {exc}")]
    rows = [("driver", found.driver_version or "not found"),
            ("nvrtc", found.nvrtc_version or "not found")]
    for gpu in found.gpus:
        major, minor = gpu.compute_capability
        rows.append((f"gpu {gpu.index}", f"{gpu.name}, sm_{major}{minor}, "
                     f"{gpu.total_memory / 2**30:.1f} GiB, {gpu.sm_count} SMs"))
    rows.extend(("problem", p) for p in found.problems)
    rows.append(("cuda backend", "usable" if found.usable else "not usable: CPU fallback"))
    rows.append(("weight formats", WEIGHT_FORMATS))
    return "GPU", rows


def _locations() -> Section:
    cubins = paths.kernel_cache_dir()
    return "Locations", [
        ("models (Hugging Face cache)", str(paths.hf_cache_dir())),
        ("compiled kernels", f"{cubins} ({paths.tree_size(cubins) / 2**20:.1f} MiB)"),
        ("chat history", str(paths.data_dir())),
    ]

"""Where the CUDA C++ sources are: inside the installed package, or the checkout's cuda_src/."""

from __future__ import annotations

from pathlib import Path

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def cuda_src_dir() -> Path:
    """The wheel ships cuda_src/ as qwenchat/cuda_src; an editable checkout has it beside."""
    for candidate in (_PACKAGE_ROOT / "cuda_src", _PACKAGE_ROOT.parent / "cuda_src"):
        if candidate.is_dir() and any(candidate.glob("*.cu*")):
            return candidate
    raise FileNotFoundError(f"cuda_src/ not found next to {_PACKAGE_ROOT}; reinstall qwenchat")


def kernel_sources() -> dict[str, str]:
    """Every .cu and .cuh file by name, as NVRTC will see them."""
    root = cuda_src_dir()
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(root.glob("*.cu*"))}

"""Where qwenchat keeps its files: per-user dirs from platformdirs, models in the HF cache."""

from __future__ import annotations

from pathlib import Path

from platformdirs import user_cache_path, user_data_path

APP = "qwenchat"


def cache_dir() -> Path:
    """Compiled kernels (cubins) and other things that can be rebuilt."""
    return user_cache_path(APP, appauthor=False)


def kernel_cache_dir() -> Path:
    return cache_dir() / "cubins"


def data_dir() -> Path:
    """Chat history and settings: things the user would miss."""
    return user_data_path(APP, appauthor=False)


def hf_cache_dir() -> Path:
    from huggingface_hub.constants import HF_HUB_CACHE

    return Path(HF_HUB_CACHE)


def tree_size(path: Path) -> int:
    if not path.is_dir():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())

"""Kernels compiled at run time with NVRTC, specialised to the model's dimensions, and cached.

Each `.cu` file in cuda_src/ compiles on its own, with every `.cuh` beside it handed to NVRTC
as an in-memory header, so `#include "common.cuh"` works without any include path. Cubins are
kept on disk under a key that covers everything the output depends on.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from qwenchat import paths
from qwenchat.engine.cuda.sources import kernel_sources
from qwenchat.errors import BackendUnavailable, QwenchatError
from qwenchat.model.config import Qwen3Config

# Bump when the key recipe or the entry layout changes, so older entries are never read.
FORMAT_VERSION = 1
_MAGIC = b"QWCUBIN1"
_HEADER_SIZE = len(_MAGIC) + hashlib.sha256().digest_size
_DEFINE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

Defines = Mapping[str, int | str]


class KernelCompileError(QwenchatError):
    """NVRTC rejected a kernel source; `log` holds NVRTC's full output for --debug."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message)
        self.log = log


def kernel_defines(config: Qwen3Config, weight_format: str = "bf16") -> dict[str, int]:
    """The model dimensions as the QW_* macros cuda_src/qwen3.cuh expects, and QW_FP8 for
    FP8 linear layers (cuda_src/weights.cuh)."""
    defines = {"QW_HIDDEN": config.hidden_size,
               "QW_INTERMEDIATE": config.intermediate_size,
               "QW_HEADS": config.num_attention_heads,
               "QW_KV_HEADS": config.num_key_value_heads,
               "QW_HEAD_DIM": config.head_dim,
               "QW_VOCAB": config.vocab_size}
    if weight_format == "fp8":
        defines["QW_FP8"] = 1
    return defines


def _nvrtc() -> Any:
    """The NVRTC bindings, once the library has been found and loaded."""
    try:
        from cuda.bindings import nvrtc

        err, _, _ = nvrtc.nvrtcVersion()  # the first call loads libnvrtc
    except Exception as exc:
        raise BackendUnavailable(
            "NVRTC not found: pip install 'qwenchat[cu13]' (or [cu12] for a CUDA 12 driver)"
        ) from exc
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise BackendUnavailable(f"NVRTC does not work: nvrtcVersion returned {err.name}")
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    _, major, minor = _nvrtc().nvrtcVersion()
    return int(major), int(minor)


def compile_options(arch: str, defines: Defines, extra_options: Sequence[str] = ()) -> list[str]:
    """NVRTC's command line; defines are sorted so equal dicts give equal options."""
    for name in defines:
        if not _DEFINE_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a valid macro name")
    return [f"--gpu-architecture={arch}", "-std=c++17", "--fmad=true", "-lineinfo",
            *(f"-D{name}={value}" for name, value in sorted(defines.items())),
            *extra_options]


def _read_sources(source_dir: Path | None = None) -> dict[str, str]:
    """Every .cu and .cuh file by name: cuda_src/ by default."""
    if source_dir is None:
        found = kernel_sources()
    else:
        found = {p.name: p.read_text(encoding="utf-8") for p in sorted(source_dir.iterdir())
                 if p.is_file()}
    return {name: text for name, text in found.items() if name.endswith((".cu", ".cuh"))}


def compile_source(name: str, arch: str, defines: Defines, extra_options: Sequence[str] = (),
                   source_dir: Path | None = None) -> bytes:
    """Compile cuda_src/`name` (or `source_dir`/`name`) for `arch` (e.g. "sm_90") to a cubin."""
    return _compile(name, arch, compile_options(arch, defines, extra_options),
                    _read_sources(source_dir))


def _compile(name: str, arch: str, options: list[str], sources: Mapping[str, str]) -> bytes:
    if name not in sources:
        raise KernelCompileError(f"kernel source {name} not found (have: "
                                 f"{', '.join(sorted(sources)) or 'none'})")
    nvrtc = _nvrtc()
    success = nvrtc.nvrtcResult.NVRTC_SUCCESS
    headers = sorted(n for n in sources if n.endswith(".cuh"))

    def check(result: tuple, call: str) -> Any:
        err, *values = result
        if err != success:
            _, text = nvrtc.nvrtcGetErrorString(err)
            raise KernelCompileError(f"{call} failed for {name} ({arch}): "
                                     f"{text.decode(errors='replace')}")
        return values[0] if values else None

    program = check(nvrtc.nvrtcCreateProgram(
        sources[name].encode(), name.encode(), len(headers),
        [sources[h].encode() for h in headers], [h.encode() for h in headers]),
        "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])
        if err != success:
            log_size = check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
            log = b" " * log_size  # NVRTC writes the log into this buffer
            check(nvrtc.nvrtcGetProgramLog(program, log), "nvrtcGetProgramLog")
            text = log.rstrip(b"\0").decode(errors="replace").strip()
            raise KernelCompileError(
                f"{name} does not compile for {arch}: {_first_error(text, err.name)}", text)
        size = check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        cubin = b" " * size  # NVRTC writes the cubin into this buffer
        check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def _first_error(log: str, fallback: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line]
    return (errors or lines or [fallback])[0]


class KernelCache:
    """Cubins on disk by content key; a missing, unreadable or corrupt entry is recompiled."""

    def __init__(self, directory: Path | None = None, source_dir: Path | None = None) -> None:
        self.directory = paths.kernel_cache_dir() if directory is None else directory
        self.source_dir = source_dir

    def key(self, name: str, arch: str, defines: Defines, extra_options: Sequence[str] = ()) -> str:
        return _key(name, compile_options(arch, defines, extra_options),
                    _read_sources(self.source_dir))

    def load(self, name: str, arch: str, defines: Defines, extra_options: Sequence[str] = (),
             progress: Callable[[str], None] | None = None) -> bytes:
        """The cubin for `name` on `arch` with `defines`: from disk, or compiled and stored."""
        sources = _read_sources(self.source_dir)
        options = compile_options(arch, defines, extra_options)
        path = self.directory / f"{_key(name, options, sources)}.cubin"
        cubin = _read_entry(path)
        if cubin is None:
            if progress is not None:
                progress(f"compiling {name} for {arch}")
            cubin = _compile(name, arch, options, sources)
            self._store(path, cubin)
        return cubin

    def _store(self, path: Path, cubin: bytes) -> None:
        """Write atomically; a cache that cannot be written only costs a compile next time."""
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{path.stem}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + hashlib.sha256(cubin).digest() + cubin)
            os.replace(tmp, path)
        except OSError:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    def _files(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return [p for p in self.directory.iterdir()
                if p.is_file() and p.suffix in (".cubin", ".tmp")]

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self._files())

    def clear(self) -> int:
        """Delete every entry (and stray temp file); returns how many files went."""
        files = self._files()
        for p in files:
            p.unlink(missing_ok=True)
        return len(files)


def _key(name: str, options: list[str], sources: Mapping[str, str]) -> str:
    """sha256 over all a cubin depends on: the file, every header, options (arch and defines
    included), the NVRTC version and this cache's format."""
    recipe = {"format": FORMAT_VERSION,
              "nvrtc": nvrtc_version(),
              "name": name,
              "source": sources.get(name),
              "headers": {n: text for n, text in sorted(sources.items()) if n.endswith(".cuh")},
              "options": options}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def _read_entry(path: Path) -> bytes | None:
    """The payload of a valid entry; None when missing, unreadable or corrupt."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    payload = data[_HEADER_SIZE:]
    if (len(data) <= _HEADER_SIZE or not data.startswith(_MAGIC)
            or data[len(_MAGIC):_HEADER_SIZE] != hashlib.sha256(payload).digest()):
        return None
    return payload

"""Kernels compiled at run time with NVRTC, specialised to the model's dimensions, and cached.

Each `.cu` file in cuda_src/ compiles on its own, with every `.cuh` beside it handed to NVRTC
as an in-memory header, so `#include "common.cuh"` works without any include path. Cubins are
kept on disk under a key that covers everything the output depends on.

A run's kernels compile concurrently on worker threads (NVRTC releases the GIL and compiles
independent programs in parallel), longest first, while the caller goes on uploading weights:
the first run for a model then costs about its longest kernel, not the sum (docs/perf.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwenchat import paths
from qwenchat.engine.cuda.sources import kernel_sources
from qwenchat.errors import BackendUnavailable, QwenchatError
from qwenchat.model.config import Qwen3Config
from qwenchat.model.formats import FORMATS

# Bump when the key recipe or the entry layout changes, so older entries are never read.
FORMAT_VERSION = 1
_MAGIC = b"QWCUBIN1"
_HEADER_SIZE = len(_MAGIC) + hashlib.sha256().digest_size
_DEFINE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

Defines = Mapping[str, int | str]


@dataclass(frozen=True)
class KernelBuild:
    """One cubin a run needs: a source file of cuda_src/, the architecture, the macros."""

    source: str
    arch: str
    defines: tuple[tuple[str, int | str], ...]

    @classmethod
    def of(cls, source: str, arch: str, defines: Defines) -> KernelBuild:
        return cls(source, arch, tuple(sorted(defines.items())))

    @property
    def name(self) -> str:
        """The source, and its part where it compiles as several programs (QW_PART)."""
        part = dict(self.defines).get("QW_PART")
        return self.source if part is None else f"{self.source}[{part}]"

    def __str__(self) -> str:
        return f"{self.name} for {self.arch}"


class KernelCompileError(QwenchatError):
    """NVRTC rejected a kernel source; `log` holds NVRTC's full output for --debug."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message)
        self.log = log


def kernel_defines(config: Qwen3Config, weight_format: str = "bf16",
                   kv_format: str = "bf16") -> dict[str, int]:
    """The model dimensions as the QW_* macros cuda_src/qwen3.cuh expects, QW_FP8 or
    QW_INT4 for FP8 or int4 linear layers (cuda_src/weights.cuh), QW_KV8 for an int8 KV
    cache (cuda_src/kv8.cuh), and a mixture of experts' router shape (cuda_src/moe.cuh)."""
    defines = {"QW_HIDDEN": config.hidden_size,
               "QW_INTERMEDIATE": config.intermediate_size,
               "QW_HEADS": config.num_attention_heads,
               "QW_KV_HEADS": config.num_key_value_heads,
               "QW_HEAD_DIM": config.head_dim,
               "QW_VOCAB": config.vocab_size}
    defines.update(FORMATS[weight_format].defines())
    if config.is_moe:  # the router's shape (cuda_src/moe.cuh)
        defines.update(QW_EXPERTS=config.num_experts, QW_TOPK=config.num_experts_per_tok,
                       QW_NORM_TOPK=int(config.norm_topk_prob),
                       QW_MOE_INTER=config.moe_intermediate_size)
    if kv_format == "int8":
        defines["QW_KV8"] = 1
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

    def load(self, name: str, arch: str, defines: Defines,
             progress: Callable[[str], None] | None = None) -> bytes:
        """The cubin for `name` on `arch` with `defines`: from disk, or compiled and stored."""
        build = KernelBuild.of(name, arch, defines)
        return self.start([build], announce=progress).cubin(build)

    def start(self, builds: Iterable[KernelBuild], announce: Callable[[str], None] | None = None,
              progress: Callable[[str], None] | None = None,
              workers: int | None = None) -> Compilation:
        """Begin getting every build's cubin: cached ones are read now, the rest compile on
        up to `workers` threads (default: one per CPU this process may use), in the order
        given, so list the longest first. `announce` gets one line when anything has to
        compile, `progress` a line as each compile ends."""
        return Compilation(self, list(builds), announce, progress, workers)

    def cached(self, build: KernelBuild) -> bytes | None:
        """The build's cubin where the cache holds a valid one, else None (nothing compiles)."""
        options = compile_options(build.arch, dict(build.defines))
        return _read_entry(self.directory /
                           f"{_key(build.source, options, _read_sources(self.source_dir))}.cubin")

    def start_detached(self, build: KernelBuild) -> DetachedCompile:
        """Compile `build` into this cache in a process of its own that outlives this one: a
        short run (`ask`) can answer without it and still leave the cubin for the next."""
        return DetachedCompile(self, build)

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


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# Compiles under way in this process, by cache entry: a Compilation that needs a build another
# one is already compiling (an early start, qwenchat/engine/cuda/early.py) waits for that
# compile instead of running it again.
_IN_FLIGHT: dict[Path, Future[bytes]] = {}
_IN_FLIGHT_LOCK = threading.Lock()


class Compilation:
    """The cubins of a run's builds, being read from the cache or compiled on worker threads
    (or waited for, where another Compilation of this process is compiling one already).

    `cubin(build)` waits for one; `cancel()` drops the compiles not yet started (those under
    way finish on their thread, NVRTC cannot be interrupted, and are stored)."""

    def __init__(self, cache: KernelCache, builds: list[KernelBuild],
                 announce: Callable[[str], None] | None,
                 progress: Callable[[str], None] | None, workers: int | None) -> None:
        self._sources = _read_sources(cache.source_dir)
        self._cache = cache
        self._progress = progress
        self._lock = threading.Lock()
        self._futures: dict[KernelBuild, Future[bytes]] = {}
        self.compiled: dict[KernelBuild, float] = {}  # seconds each compile took
        missing: list[tuple[KernelBuild, list[str], Path]] = []
        for build in dict.fromkeys(builds):
            options = compile_options(build.arch, dict(build.defines))
            path = cache.directory / f"{_key(build.source, options, self._sources)}.cubin"
            cubin = _read_entry(path)
            if cubin is None:
                missing.append((build, options, path))
            else:
                self._futures[build] = done = Future()
                done.set_result(cubin)
        self.to_compile = [build for build, _, _ in missing]
        if not missing:
            return
        own = []  # (the others are compiling already: their futures are waited for)
        with _IN_FLIGHT_LOCK:
            for build, options, path in missing:
                under_way = _IN_FLIGHT.get(path)
                if under_way is not None and not under_way.cancelled():
                    self._futures[build] = under_way
                    self._follow(build, under_way)
                else:
                    own.append((build, options, path))
        # (threads: as many as compile at once for this run, counting those another
        # compilation runs for it)
        threads = max(1, min(len(missing), workers or usable_cpus()))
        if announce is not None:
            if len(missing) == 1:
                announce(f"compiling {missing[0][0]} (once per model and GPU)")
            else:
                arches = " and ".join(dict.fromkeys(b.arch for b in self.to_compile))
                announce(f"compiling {len(missing)} kernels for {arches} on {threads} "
                         f"thread{'s' * (threads > 1)} (once per model and GPU)")
        if not own:
            return
        executor = ThreadPoolExecutor(min(threads, len(own)), thread_name_prefix="qwenchat-nvrtc")
        with _IN_FLIGHT_LOCK:
            for build, options, path in own:
                self._futures[build] = _IN_FLIGHT[path] = executor.submit(
                    self._compile, build, options, path)
        executor.shutdown(wait=False)  # its threads end once the queue is empty

    def _compile(self, build: KernelBuild, options: list[str], path: Path) -> bytes:
        started = time.perf_counter()
        try:
            cubin = _compile(build.source, build.arch, options, self._sources)
            self._cache._store(path, cubin)
        finally:
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT.pop(path, None)
        self._done(build, time.perf_counter() - started)
        return cubin

    def _follow(self, build: KernelBuild, under_way: Future[bytes]) -> None:
        """Report the build's compile in another Compilation as this one's when it ends."""
        started = time.perf_counter()
        under_way.add_done_callback(
            lambda done: self._done(build, time.perf_counter() - started, done))

    def _done(self, build: KernelBuild, seconds: float,
              future: Future[bytes] | None = None) -> None:
        """A compile ended (here, or in the Compilation this one waits on: `future`)."""
        if future is not None and (future.cancelled() or future.exception() is not None):
            return
        with self._lock:
            self.compiled[build] = seconds
            left = [b.name for b in self.to_compile if b not in self.compiled]
            line = (f"compiled {build.name} in {seconds:.1f} s "
                    f"({len(self.compiled)} of {len(self.to_compile)}"
                    + (f"; to go: {', '.join(left)}" if left else "") + ")")
        if self._progress is not None:
            self._progress(line)

    def cubin(self, build: KernelBuild) -> bytes:
        """The build's cubin, once compiled (a compile error is raised here)."""
        if build not in self._futures:
            raise KeyError(f"{build} was not among this compilation's builds")
        return self._futures[build].result()

    def wait(self) -> dict[KernelBuild, bytes]:
        """Every cubin, in the order of the builds."""
        return {build: self.cubin(build) for build in self._futures}

    def cancel(self) -> None:
        for future in self._futures.values():
            future.cancel()


class DetachedCompile:
    """One build compiling into the cache in a child process (`python -m
    qwenchat.engine.cuda.compiler`), in a session of its own so that Ctrl+C on the parent does
    not stop it; the parent polls for the cubin and never waits for the child at exit."""

    def __init__(self, cache: KernelCache, build: KernelBuild) -> None:
        import subprocess
        import sys

        self._cache, self.build = cache, build
        # the child's stderr: its error, if it fails (closed with this object)
        self._log = tempfile.TemporaryFile()  # noqa: SIM115
        job = {"source": build.source, "arch": build.arch, "defines": list(build.defines),
               "directory": str(cache.directory),
               "source_dir": None if cache.source_dir is None else str(cache.source_dir)}
        self._child = subprocess.Popen(
            [sys.executable, "-m", "qwenchat.engine.cuda.compiler", json.dumps(job)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log,
            start_new_session=True)

    def poll(self) -> bytes | None:
        """The cubin once the child has stored it, None while it compiles; a failed compile
        raises KernelCompileError with the child's one-line reason."""
        code = self._child.poll()
        if code is None:
            return None
        cubin = self._cache.cached(self.build)
        if cubin is not None:
            return cubin
        self._log.seek(0)
        lines = self._log.read().decode(errors="replace").strip().splitlines()
        raise KernelCompileError(f"{self.build} did not compile (exit {code}): "
                                 f"{lines[-1] if lines else 'no message'}")

    def wait(self, timeout: float | None = None) -> bytes:
        """The cubin, waiting for the child (tests and tools)."""
        self._child.wait(timeout)
        cubin = self.poll()
        assert cubin is not None
        return cubin


def _compile_job(job: Mapping[str, Any]) -> None:
    """The child of DetachedCompile: one build into the cache (a cached one is left as is)."""
    source_dir = Path(job["source_dir"]) if job["source_dir"] else None
    cache = KernelCache(Path(job["directory"]), source_dir)
    cache.load(job["source"], job["arch"], {name: value for name, value in job["defines"]})


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


if __name__ == "__main__":  # DetachedCompile's child
    import sys

    try:
        _compile_job(json.loads(sys.argv[1]))
    except QwenchatError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)

"""Every kernel in cuda_src/ compiles with NVRTC, and the cubin cache keys, stores and heals.

No GPU is needed, only NVRTC; without it these tests skip and say why. The whole matrix (every
kernel x architecture x format x shape) is marked `compile_matrix` and runs where
QWENCHAT_COMPILE_MATRIX=1 (CI sets it); the default run keeps a diagonal of it that builds
every kernel once in each weight and cache format, the architectures and the shapes taking
turns, and the megakernel in the layouts whose static shared memory is checked. Builds
compile ahead on one thread per CPU (`nvrtc_pool`), so a test mostly collects its cubin.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from gpu_shapes import GPUS, H100_BANDWIDTH, H200_BANDWIDTH, gpu_shape
from tiny_model import tiny_moe_config

from qwenchat.engine.cuda import compiler
from qwenchat.engine.cuda.builds import (
    COMPILE_ORDER,
    MOE_KERNELS,
    SM90_KERNELS,
    SM90_PARTS,
    kernel_names,
)
from qwenchat.engine.cuda.compiler import (
    KernelBuild,
    KernelCache,
    KernelCompileError,
    compile_source,
    kernel_defines,
    usable_cpus,
)
from qwenchat.engine.cuda.engine import plan_kernels
from qwenchat.engine.cuda.megakernel import (
    MEGAKERNEL_SPLIT_STATIC_SHARED,
    MEGAKERNEL_STATIC_SHARED,
    SPLIT_BELOW_FILL,
    WHOLE_RING_BYTES,
    fp8_on_tensor_cores,
    megakernel_layout,
    megakernel_static_shared,
    stage_fill,
)
from qwenchat.engine.cuda.sources import cuda_src_dir
from qwenchat.errors import BackendUnavailable, QwenchatError
from qwenchat.model.config import Qwen3Config
from qwenchat.model.formats import FP8
from qwenchat.model.presets import PRESETS


def _nvrtc_problem() -> str | None:
    try:
        compiler.nvrtc_version()
    except BackendUnavailable as exc:
        return f"{exc} ({exc.__cause__ or 'no detail'})"
    return None


NVRTC_PROBLEM = _nvrtc_problem()
needs_nvrtc = pytest.mark.skipif(NVRTC_PROBLEM is not None, reason=f"{NVRTC_PROBLEM}")
# Under pytest-xdist (--dist loadgroup) every test here runs on one worker, beside one pool.
pytestmark = pytest.mark.xdist_group("nvrtc")

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
# The default run's architectures, taking turns: one of each class of `__CUDA_ARCH__` the
# sources tell apart (test_the_default_runs_architectures_cover_every_code_path_the_sources_have);
# sm_86 compiles sm_80's code and is left to the matrix.
SAMPLED_ARCHS = ("sm_80", "sm_89", "sm_90", "sm_90a")
# Sizes that no tile divides: 3 query heads on 1 KV head, hidden 48, a prime vocabulary. They
# stay within what cuda_src/qwen3.cuh asserts (whole GQA groups, head_dim in {16, ..., 256},
# hidden and intermediate multiples of 8).
ODD_TINY = Qwen3Config(vocab_size=251, hidden_size=48, intermediate_size=80, num_hidden_layers=1,
                       num_attention_heads=3, num_key_value_heads=1, head_dim=32)
# Grouped-query attention no power of two divides: 10 query heads on 2 KV heads.
ODD_GQA = Qwen3Config(vocab_size=151_936, hidden_size=1280, intermediate_size=3456,
                      num_hidden_layers=2, num_attention_heads=10, num_key_value_heads=2,
                      head_dim=128)
SHAPES = {**PRESETS, "odd-tiny": ODD_TINY, "odd-gqa": ODD_GQA}  # every released dense size
KERNEL_FILES = sorted(p.name for p in cuda_src_dir().glob("*.cu"))

ELF_MAGIC = b"\x7fELF"

TINY_HEADER = """\
#pragma once
#ifndef TINY_SCALE
#error "TINY_SCALE must be defined by the host"
#endif
constexpr float tiny_scale = TINY_SCALE;
"""
TINY_KERNEL = """\
#include "tiny.cuh"
extern "C" __global__ void scale(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= tiny_scale;
}
"""
BROKEN_KERNEL = """\
#include "tiny.cuh"
extern "C" __global__ void broken(float* x) { x[0] = undefined_name * tiny_scale; }
"""
TINY_DEFINES = {"TINY_SCALE": 3}


# ------------------------------------------------------------------ compiling ahead
Build = tuple[str, str, dict]  # (source, architecture, defines)
# test name -> a function of the test's parameters giving the builds it will ask the pool for
AHEAD: dict[str, Callable[..., Iterable[Build]]] = {}


def compiled_ahead(builds_of: Callable[..., Iterable[Build]]):
    """Declares the builds a test compiles, so `nvrtc_pool` starts them before it runs."""
    def register(test):
        AHEAD[test.__name__] = builds_of
        return test
    return register


# NVRTC itself, as imported: the `compiles` fixture's spy on compiler._compile sees only the
# compiles of the test it serves, not those the pool runs meanwhile for later tests.
_nvrtc_compile = compiler._compile


def _pool_compile(source: str, arch: str, defines: dict) -> bytes:
    return _nvrtc_compile(source, arch, compiler.compile_options(arch, defines),
                          compiler._read_sources(None))


def _yield_to_the_tests() -> None:
    """A compile thread at the lowest priority (Linux: niceness is a thread's own), so the
    compiles started before this module (start_compiles_early) take only the CPU time that
    the other tests leave, and their timings stay theirs."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class CompilePool:
    """compile_source on a thread per CPU (NVRTC releases the GIL), each build once."""

    def __init__(self, workers: int):
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="test-nvrtc",
                                            initializer=_yield_to_the_tests)
        self._futures: dict[tuple, Future] = {}

    def submit(self, source: str, arch: str, defines: dict) -> Future:
        key = (source, arch, tuple(sorted(defines.items())))
        if key not in self._futures:
            self._futures[key] = self._executor.submit(_pool_compile, source, arch,
                                                       dict(defines))
        return self._futures[key]

    def cubin(self, source: str, arch: str, defines: dict) -> bytes:
        return self.submit(source, arch, defines).result()

    def close(self) -> None:
        for future in self._futures.values():
            future.cancel()
        self._executor.shutdown(wait=True)


def _will_run(item) -> bool:
    return not any(mark.name == "skip" or (mark.name == "skipif" and mark.args and mark.args[0])
                   for mark in item.iter_markers())


def _started_pool(session) -> CompilePool:
    """A pool that has started every build this session's tests in this module will ask for,
    in their order."""
    pool = CompilePool(usable_cpus())
    for item in session.items:
        builds_of = AHEAD.get(getattr(item, "originalname", item.name))
        if item.module.__name__ == __name__ and builds_of is not None and _will_run(item):
            params = item.callspec.params if hasattr(item, "callspec") else {}
            for build in builds_of(**params):
                pool.submit(*build)
    return pool


_EARLY: list[CompilePool] = []  # the pool start_compiles_early started


def start_compiles_early(session) -> None:
    """conftest.py calls this once the session's tests are collected: this module's builds
    start then, on low-priority threads, and compile while the tests before it run (the
    whole suite's wall clock, not only this module's)."""
    config = session.config
    if _EARLY or NVRTC_PROBLEM is not None or config.option.collectonly \
            or hasattr(config, "workerinput"):  # (xdist: a worker may run none of them)
        return
    pool = _started_pool(session)
    _EARLY.append(pool)
    config.add_cleanup(pool.close)  # (a session that ends first waits for no compile)


@pytest.fixture(scope="session")
def nvrtc_pool(request):
    """Every build this session's tests in this module ask for, compiling ahead of them (since
    the session's collection, or from here), so compiles overlap each other and the tests."""
    pool = _EARLY.pop() if _EARLY else _started_pool(request.session)
    yield pool
    pool.close()


@needs_nvrtc
def test_the_pools_compiles_are_not_counted_by_a_tests_compile_spy(compiles):
    # (the session's pool compiles later tests' builds while the cache tests count theirs)
    pool = CompilePool(1)
    try:
        cubin = pool.cubin("sampling.cu", "sm_80", kernel_defines(PRESETS["qwen3-0.6b"]))
    finally:
        pool.close()
    assert cubin.startswith(ELF_MAGIC) and compiles == []


@pytest.fixture
def src(tmp_path) -> Path:
    """A cuda_src-like directory: one header shared by a good and a broken kernel."""
    root = tmp_path / "src"
    root.mkdir()
    (root / "tiny.cuh").write_text(TINY_HEADER)
    (root / "tiny.cu").write_text(TINY_KERNEL)
    (root / "broken.cu").write_text(BROKEN_KERNEL)
    return root


@pytest.fixture
def compiles(spy_calls) -> list[str]:
    """Records every real NVRTC compile the cache asks for, by source name."""
    return spy_calls(compiler, "_compile")


def test_kernel_defines_are_the_qwen3_macros():
    assert kernel_defines(PRESETS["qwen3-0.6b"]) == {
        "QW_HIDDEN": 1024, "QW_INTERMEDIATE": 3072, "QW_HEADS": 16, "QW_KV_HEADS": 8,
        "QW_HEAD_DIM": 128, "QW_VOCAB": 151_936}


def test_every_define_becomes_one_sorted_option():
    options = compiler.compile_options("sm_90", {"B": 2, "A": "x"}, ["-G"])
    assert options == ["--gpu-architecture=sm_90", "-std=c++17", "--fmad=true", "-lineinfo",
                       "-DA=x", "-DB=2", "-G"]
    with pytest.raises(ValueError, match="macro name"):
        compiler.compile_options("sm_90", {"A B": 1})


# The kernels that read the linear layers' weights are also built for FP8 ones (weights.cuh).
FP8_KERNEL_FILES = ("gemm.cu", "layers.cu", "megakernel.cu")
# Hopper-only sources (wgmma, TMA) are built for sm_90a alone, as the engine builds them;
# gemm_fp8_sm90.cu only for FP8 weights.
BUILDS = ([(k, "bf16", arch) for k in KERNEL_FILES if k not in SM90_KERNELS for arch in ARCHS]
          + [(k, "fp8", arch) for k in FP8_KERNEL_FILES for arch in ARCHS]
          + [(k, "bf16", "sm_90a") for k in SM90_KERNELS if k != "gemm_fp8_sm90.cu"]
          + [(k, "fp8", "sm_90a") for k in SM90_KERNELS])


def test_hopper_sources_are_among_the_kernel_files():
    assert set(SM90_KERNELS) < set(KERNEL_FILES)


def kernel_body_start(sources: str, name: str) -> str:
    """The first statement of kernel `name`'s body: after its parameter list, or in the macro
    that defines it (verify.cu's VERIFY_KERNEL(name, ...), VERIFY_HEAD)."""
    if macro := re.search(r"^(VERIFY_\w+)\(" + name + ",", sources, re.M):
        sources, name = sources[sources.index(f"#define {macro[1]}("):], "name"
    start = re.search(r"__global__ void(?: __launch_bounds__\([^)]*\))?[\s\\]+" + name
                      + r"\(", sources)
    assert start, f"kernel {name} not found"
    depth, i = 1, start.end()
    while depth:
        depth += {"(": 1, ")": -1}.get(sources[i], 0)
        i += 1
    body = sources[sources.index("{", i) + 1:]
    return body.lstrip(" \\\n").split(";")[0]


def test_every_kernel_a_pass_launches_as_a_dependent_first_waits_for_the_one_before():
    """A kernel launched as a dependent (runtime.launch's programmatic dependent launch) may
    run while the previous kernel still writes its input: its first statement must be
    dependent_start (common.cuh), which waits for that kernel's end."""
    from qwenchat.engine.cuda.verify import DEPENDENT_KERNELS

    sources = "\n".join(compiler._read_sources()[f] for f in KERNEL_FILES)
    for name in sorted(DEPENDENT_KERNELS):
        assert kernel_body_start(sources, name) == "dependent_start()", name
    assert kernel_body_start(sources, "embed_rows") != "dependent_start()"  # (the check checks)


def test_the_kept_tokens_struct_is_laid_out_as_sampling_cu_declares_it():
    """_rewind passes a pass's kept tokens to count_tokens by value (engine.KeptTokens): the
    same fields, in the same order, with as many ids as a pass has rows."""
    import ctypes

    from qwenchat.engine.cuda.engine import KeptTokens
    from qwenchat.engine.cuda.verify import VERIFY_ROWS

    source = compiler._read_sources()["sampling.cu"]
    body = re.search(r"struct KeptTokens \{(.*?)\};", source, re.S).group(1)
    fields = re.findall(r"int (\w+)(?:\[(\d+)\])?;", body)
    assert [name for name, _ in fields] == [name for name, _ in KeptTokens._fields_]
    assert int(fields[0][1]) == len(KeptTokens().ids) == VERIFY_ROWS
    assert ctypes.sizeof(KeptTokens) == 4 * (VERIFY_ROWS + 3)


COMPILE_MATRIX = pytest.mark.compile_matrix


def diagonal(builds: list[tuple], shapes: Iterable[str], matrix_only: Iterable[str] = ()) -> list:
    """The builds x shapes matrix as parameters. The default run keeps one of each build's
    kernel and format (the build less its architecture, its last field): the first build of
    that kernel and format on the SAMPLED_ARCHS architecture whose turn it is, with the shape
    whose turn it is. Kernels in `matrix_only` and the rest of the matrix are marked
    `compile_matrix`."""
    shapes, kept = list(shapes), {}
    for build in builds:
        group = build[:-1]
        if group[0] in matrix_only or group in kept:
            continue
        archs = [b[-1] for b in builds if b[:-1] == group and b[-1] in SAMPLED_ARCHS]
        if archs:
            turn = len(kept)
            kept[group] = (archs[turn % len(archs)], shapes[turn % len(shapes)])
    return [pytest.param(*build, shape, marks=() if kept.get(build[:-1]) == (build[-1], shape)
                         else COMPILE_MATRIX)
            for build in builds for shape in shapes]


def every_kernel_build(kernel, weights, arch, shape) -> Build | str:
    """What the engine builds for this kernel on such a GPU, or why it builds none there."""
    config = SHAPES[shape]
    defines = kernel_defines(config, weights)
    if kernel == "megakernel.cu":  # built as the engine builds it on such a GPU, or refused
        layout = megakernel_layout(config, *GPUS[arch], weights, fp8_on_tensor_cores(arch))
        if isinstance(layout, str):  # the engine decodes with the per-op graph there
            return layout
        defines = layout.defines(config, weights)
    return kernel, arch, defines


# The megakernel, the longest build by far, is left here to the matrix: the default run builds
# it in its widest layouts, for each weight format, where its static shared memory is checked
# (test_the_megakernel_static_shared_memory_fits_what_its_layout_leaves_it).
MEGAKERNEL_IN_THE_MATRIX = ("megakernel.cu",)


@needs_nvrtc
@pytest.mark.parametrize(("kernel", "weights", "arch", "shape"),
                         diagonal(BUILDS, sorted(SHAPES), MEGAKERNEL_IN_THE_MATRIX))
@compiled_ahead(lambda **p: [b for b in [every_kernel_build(**p)] if not isinstance(b, str)])
def test_every_kernel_compiles(kernel, weights, arch, shape, nvrtc_pool):
    build = every_kernel_build(kernel, weights, arch, shape)
    if isinstance(build, str):
        assert "shared memory" in build and f"{GPUS[arch][0]:,}" in build
        return
    assert nvrtc_pool.cubin(*build).startswith(ELF_MAGIC)


def test_the_default_run_builds_every_kernel_in_every_format_and_takes_every_architecture():
    full = diagonal(BUILDS, sorted(SHAPES), MEGAKERNEL_IN_THE_MATRIX)
    kept = [p.values for p in full if not p.marks]
    assert sorted((k, w) for k, w, _, _ in kept) == sorted(
        {(k, w) for k, w, _ in BUILDS if k not in MEGAKERNEL_IN_THE_MATRIX})
    assert {arch for _, _, arch, _ in kept} == set(SAMPLED_ARCHS)
    assert {shape for *_, shape in kept} == set(SHAPES)
    assert len(full) == len(BUILDS) * len(SHAPES) and len(set(p.values for p in full)) == len(full)
    # every format of the megakernel, in the default run, where its static memory is checked
    widest = {values[0] for values in WIDEST_MEGAKERNELS if not getattr(values, "marks", ())}
    assert widest == {"bf16", "fp8", "int4"}


def test_the_default_runs_architectures_cover_every_code_path_the_sources_have():
    """An architecture the default run leaves to the matrix compiles the same code as one it
    keeps: no `__CUDA_ARCH__` test in cuda_src/ tells them apart."""
    sources = "\n".join(compiler._read_sources().values())
    tests = re.findall(r"__CUDA_ARCH__\s*(<=|>=|==|!=|<|>)\s*(\d+)", sources)
    assert tests and {op for op, _ in tests} == {">="}, "extend this check to other tests"
    bounds = {int(value) for _, value in tests}

    def code_path(arch: str) -> tuple:
        return tuple(int(arch[3:5]) * 10 >= bound for bound in sorted(bounds))

    left = set(ARCHS) - set(SAMPLED_ARCHS)
    assert left == {"sm_86"}
    for arch in left:
        assert any(code_path(arch) == code_path(kept) for kept in SAMPLED_ARCHS), arch


# The kernels that read int4 rows, on an architecture with FP8 conversion in hardware and one
# without (int4 rows take the tensor cores on both), for shapes whose rows end on a 512-column
# step and inside one (odd-gqa: 1,280 and 3,456 columns): every int4 shape is whole groups of
# 128 (Int4Weights refuses others).
INT4_SHAPES = ("qwen3-0.6b", "qwen3-8b", "qwen3-32b", "odd-gqa")


def int4_build(kernel, arch, shape) -> Build:
    config = SHAPES[shape]
    defines = kernel_defines(config, "int4")
    if kernel == "megakernel.cu":
        layout = megakernel_layout(config, *GPUS[arch], "int4", fp8_on_tensor_cores(arch))
        assert not isinstance(layout, str) and layout.mma
        defines = layout.defines(config, "int4")
    return kernel, arch, defines


@needs_nvrtc
@pytest.mark.parametrize(("kernel", "arch", "shape"), diagonal(
    [(k, a) for k in ("layers.cu", "verify.cu", "megakernel.cu") for a in ("sm_80", "sm_90")],
    INT4_SHAPES, MEGAKERNEL_IN_THE_MATRIX))
@compiled_ahead(lambda **p: [int4_build(**p)])
def test_int4_kernels_compile(kernel, arch, shape, nvrtc_pool):
    assert nvrtc_pool.cubin(*int4_build(kernel, arch, shape)).startswith(ELF_MAGIC)


@needs_nvrtc
@pytest.mark.parametrize(("kernel", "arch", "shape"), diagonal([
    *[(k, a) for k in ("layers.cu", "attention.cu", "verify.cu") for a in ("sm_80", "sm_90")],
    ("attention_sm90.cu", "sm_90a")], ["qwen3-0.6b", "qwen3-8b", "odd-tiny"]))
@compiled_ahead(lambda kernel, arch, shape: [
    (kernel, arch, kernel_defines(SHAPES[shape], "bf16", "int8"))])
def test_int8_kv_cache_kernels_compile(kernel, arch, shape, nvrtc_pool):
    defines = kernel_defines(SHAPES[shape], "bf16", "int8")
    assert defines["QW_KV8"] == 1
    assert nvrtc_pool.cubin(kernel, arch, defines).startswith(ELF_MAGIC)


def test_narrow_weights_add_one_define():
    config = PRESETS["qwen3-8b"]
    assert kernel_defines(config, "fp8") == {**kernel_defines(config), "QW_FP8": 1}
    assert kernel_defines(config, "int4") == {**kernel_defines(config), "QW_INT4": 1}


@needs_nvrtc
@pytest.mark.parametrize("arch", ARCHS)
def test_a_kernel_compiles_with_an_in_memory_header(src, arch):
    assert compile_source("tiny.cu", arch, TINY_DEFINES, source_dir=src).startswith(ELF_MAGIC)


@needs_nvrtc
def test_defines_reach_the_headers(src):
    with pytest.raises(KernelCompileError) as caught:
        compile_source("tiny.cu", "sm_90", {}, source_dir=src)
    assert "TINY_SCALE must be defined" in caught.value.log


@needs_nvrtc
def test_compile_error_is_one_line_naming_file_and_arch_with_the_log_attached(src):
    with pytest.raises(KernelCompileError) as caught:
        compile_source("broken.cu", "sm_89", TINY_DEFINES, source_dir=src)
    message = str(caught.value)
    assert "broken.cu" in message and "sm_89" in message and "undefined_name" in message
    assert "\n" not in message
    assert "undefined_name" in caught.value.log and "error" in caught.value.log


@needs_nvrtc
def test_missing_source_names_what_exists(src):
    with pytest.raises(KernelCompileError, match=r"nope\.cu not found .*tiny\.cu"):
        compile_source("nope.cu", "sm_90", TINY_DEFINES, source_dir=src)


@needs_nvrtc
def test_second_load_comes_from_disk_without_compiling(src, tmp_path, compiles):
    progress: list[str] = []
    first = KernelCache(tmp_path / "cubins", src).load("tiny.cu", "sm_90", TINY_DEFINES,
                                                       progress=progress.append)
    assert compiles == ["tiny.cu"]
    assert progress == ["compiling tiny.cu for sm_90 (once per model and GPU)"]
    progress.clear()
    second = KernelCache(tmp_path / "cubins", src).load("tiny.cu", "sm_90", TINY_DEFINES,
                                                        progress=progress.append)
    assert second == first and first.startswith(ELF_MAGIC)
    assert compiles == ["tiny.cu"] and progress == []


def _flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


def _flip_magic(data: bytes) -> bytes:
    return bytes([data[0] ^ 0xFF]) + data[1:]


@needs_nvrtc
@pytest.mark.parametrize("corrupt", [_flip_last_byte, _flip_magic, lambda d: d[:10],
                                     lambda d: b""],
                         ids=["payload-byte", "magic", "truncated", "empty"])
def test_corrupt_entry_is_recompiled_and_replaced(src, tmp_path, compiles, corrupt):
    cache = KernelCache(tmp_path / "cubins", src)
    good = cache.load("tiny.cu", "sm_90", TINY_DEFINES)
    (entry,) = (tmp_path / "cubins").glob("*.cubin")
    intact = entry.read_bytes()
    entry.write_bytes(corrupt(intact))

    assert cache.load("tiny.cu", "sm_90", TINY_DEFINES) == good
    assert compiles == ["tiny.cu", "tiny.cu"]
    assert entry.read_bytes() == intact
    cache.load("tiny.cu", "sm_90", TINY_DEFINES)
    assert len(compiles) == 2


@needs_nvrtc
def test_key_covers_defines_arch_options_and_every_source(src, tmp_path):
    cache = KernelCache(tmp_path / "cubins", src)
    base = cache.key("tiny.cu", "sm_90", {"TINY_SCALE": 3, "OTHER": 1})
    assert cache.key("tiny.cu", "sm_90", {"OTHER": 1, "TINY_SCALE": 3}) == base
    variants = {
        cache.key("tiny.cu", "sm_90", {"TINY_SCALE": 4, "OTHER": 1}),
        cache.key("tiny.cu", "sm_89", {"TINY_SCALE": 3, "OTHER": 1}),
        cache.key("tiny.cu", "sm_90", {"TINY_SCALE": 3, "OTHER": 1}, ["-G"]),
        cache.key("broken.cu", "sm_90", {"TINY_SCALE": 3, "OTHER": 1}),
    }
    (src / "tiny.cuh").write_text(TINY_HEADER + "// a header edit\n")
    variants.add(cache.key("tiny.cu", "sm_90", {"TINY_SCALE": 3, "OTHER": 1}))
    assert base not in variants and len(variants) == 5


@needs_nvrtc
def test_unwritable_cache_dir_still_returns_a_cubin(src, tmp_path, compiles):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cache = KernelCache(blocker / "cubins", src)
    for _ in range(2):
        assert cache.load("tiny.cu", "sm_90", TINY_DEFINES).startswith(ELF_MAGIC)
    assert compiles == ["tiny.cu", "tiny.cu"]
    assert cache.size_bytes() == 0


@needs_nvrtc
def test_failed_compile_leaves_nothing_in_the_cache(src, tmp_path):
    cache = KernelCache(tmp_path / "cubins", src)
    with pytest.raises(KernelCompileError, match=r"broken\.cu"):
        cache.load("broken.cu", "sm_90", TINY_DEFINES)
    assert cache.size_bytes() == 0


@needs_nvrtc
def test_size_and_clear_count_the_entries(src, tmp_path):
    cache = KernelCache(tmp_path / "cubins", src)
    assert cache.size_bytes() == 0 and cache.clear() == 0
    cache.load("tiny.cu", "sm_90", TINY_DEFINES)
    cache.load("tiny.cu", "sm_80", TINY_DEFINES)
    assert cache.size_bytes() > 0
    assert cache.clear() == 2
    assert cache.size_bytes() == 0


# ------------------------------------------------------------------ concurrent compiles
@needs_nvrtc
def test_builds_compile_concurrently_to_the_cubins_of_one_by_one_compiles(src, tmp_path):
    builds = [KernelBuild.of("tiny.cu", arch, {"TINY_SCALE": scale})
              for arch in ("sm_80", "sm_90") for scale in (2, 3)]
    announced: list[str] = []
    ended: list[str] = []
    compilation = KernelCache(tmp_path / "cubins", src).start(
        builds, announce=announced.append, progress=ended.append, workers=4)
    cubins = compilation.wait()
    assert list(cubins) == builds
    for build in builds:
        assert cubins[build] == compile_source("tiny.cu", build.arch, dict(build.defines),
                                               source_dir=src)
    assert len(set(cubins.values())) == 4
    (line,) = announced
    assert line.startswith("compiling 4 kernels for sm_80 and sm_90 on 4 threads")
    assert len(ended) == 4 and ended[-1].startswith("compiled tiny.cu in ")
    assert ended[-1].endswith("(4 of 4)") and set(compilation.compiled) == set(builds)


@needs_nvrtc
def test_cached_builds_are_read_and_only_the_missing_ones_compile(src, tmp_path, compiles):
    cache = KernelCache(tmp_path / "cubins", src)
    cached = KernelBuild.of("tiny.cu", "sm_90", TINY_DEFINES)
    cache.load("tiny.cu", "sm_90", TINY_DEFINES)
    fresh = KernelBuild.of("tiny.cu", "sm_80", TINY_DEFINES)
    announced: list[str] = []
    compilation = cache.start([cached, fresh], announce=announced.append)
    assert compilation.to_compile == [fresh]
    assert compilation.wait()[fresh].startswith(ELF_MAGIC)
    assert compiles == ["tiny.cu", "tiny.cu"]
    assert announced == ["compiling tiny.cu for sm_80 (once per model and GPU)"]
    announced.clear()
    assert cache.start([cached, fresh], announce=announced.append).to_compile == []
    assert announced == [] and len(compiles) == 2


@needs_nvrtc
def test_a_failed_build_raises_where_its_cubin_is_asked_for_and_spares_the_others(src,
                                                                                  tmp_path):
    good = KernelBuild.of("tiny.cu", "sm_90", TINY_DEFINES)
    bad = KernelBuild.of("broken.cu", "sm_90", TINY_DEFINES)
    compilation = KernelCache(tmp_path / "cubins", src).start([bad, good], workers=2)
    assert compilation.cubin(good).startswith(ELF_MAGIC)
    with pytest.raises(KernelCompileError, match=r"broken\.cu"):
        compilation.cubin(bad)
    with pytest.raises(KernelCompileError, match=r"broken\.cu"):
        compilation.wait()
    with pytest.raises(KeyError, match=r"layers\.cu"):
        compilation.cubin(KernelBuild.of("layers.cu", "sm_90", {}))


# A process that waits for the file `go`, then loads one real kernel through the cache and
# prints whether it compiled it and the cubin's digest.
_RACER = """
import hashlib, sys, time
from pathlib import Path
from qwenchat.engine.cuda.compiler import KernelCache, kernel_defines
from qwenchat.model.presets import PRESETS
cache_dir, go = Path(sys.argv[1]), Path(sys.argv[2])
while not go.exists():
    time.sleep(0.001)
said = []
cubin = KernelCache(cache_dir).load("sampling.cu", "sm_90", kernel_defines(PRESETS["qwen3-0.6b"]),
                                    progress=said.append)
print(len(said), hashlib.sha256(cubin).hexdigest())
"""


@needs_nvrtc
def test_two_processes_compiling_the_same_kernel_both_succeed_and_leave_one_entry(tmp_path):
    import hashlib
    import subprocess
    import sys

    cache_dir, go = tmp_path / "cubins", tmp_path / "go"
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, str(cache_dir), str(go)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    time.sleep(1.0)  # both past their imports, polling for `go`
    go.touch()
    results = [racer.communicate(timeout=300) for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0], [err for _, err in results]
    lines = [out.split() for out, _ in results]
    assert [compiled for compiled, _ in lines] == ["1", "1"]  # each compiled it itself
    assert lines[0][1] == lines[1][1]
    entries = list(cache_dir.iterdir())
    assert len(entries) == 1 and entries[0].suffix == ".cubin"
    payload = compiler._read_entry(entries[0])
    assert payload is not None and hashlib.sha256(payload).hexdigest() == lines[0][1]


# ------------------------------------------------------------------ what a run compiles
def _sources(plan) -> list[tuple[str, str]]:
    return [(build.source, build.arch) for build in plan.builds]


def test_a_hopper_run_compiles_the_megakernel_first_and_no_portable_gemm():
    config = PRESETS["qwen3-0.6b"]
    plan = plan_kernels(config, "bf16", gpu_shape("sm_90"))
    assert plan.decode == "megakernel" and plan.hopper_gemm and plan.hopper_attention
    assert _sources(plan) == [
        ("megakernel.cu", "sm_90"), *[("gemm_sm90.cu", "sm_90a")] * 6, ("attention.cu", "sm_90"),
        ("sampling.cu", "sm_90"), ("attention_sm90.cu", "sm_90a"), ("attention_pass.cu", "sm_90"),
        ("verify.cu", "sm_90"), ("layers.cu", "sm_90")]
    assert plan.builds[0] == plan.megakernel
    assert dict(plan.megakernel.defines) == {
        **plan.megakernel_layout.defines(config), "QW_MK_SKIP": 0}
    assert [dict(build.defines) for build in plan.builds[1:7]] == [
        {**kernel_defines(config), "QW_PART": part} for part in range(6)]


def gemm_part_build(source, weights, part) -> Build:
    defines = kernel_defines(PRESETS["qwen3-0.6b"], weights)
    return source, "sm_90a", defines if part is None else {**defines, "QW_PART": part}


def exported(cubin: bytes, names) -> set[str]:
    """The names among `names` that an ELF cubin's symbol table holds."""
    return {name for name in names if b"\0" + name.encode() + b"\0" in cubin}


@needs_nvrtc
@pytest.mark.parametrize(("source", "weights"), [
    pytest.param("gemm_sm90.cu", "bf16", marks=COMPILE_MATRIX),
    pytest.param("gemm_fp8_sm90.cu", "fp8", marks=COMPILE_MATRIX)])
@compiled_ahead(lambda source, weights: [gemm_part_build(source, weights, part)
                                         for part in (None, *range(len(SM90_PARTS[source])))])
def test_each_hopper_gemm_part_holds_its_kernels_and_together_they_are_the_whole(
        source, weights, nvrtc_pool):
    names = SM90_KERNELS[source]
    whole = nvrtc_pool.cubin(*gemm_part_build(source, weights, None))
    assert exported(whole, names) == set(names)
    parts = SM90_PARTS[source]
    for part, held in enumerate(parts):
        cubin = nvrtc_pool.cubin(*gemm_part_build(source, weights, part))
        assert exported(cubin, names) == set(held), part
        assert kernel_names(KernelBuild.of(*gemm_part_build(source, weights, part))) == held
    assert sorted(name for held in parts for name in held) == sorted(names)


def test_a_layered_run_compiles_no_megakernel():
    plan = plan_kernels(PRESETS["qwen3-0.6b"], "bf16", gpu_shape("sm_90"), decode="layered")
    assert plan.decode == "layered" and plan.megakernel is None
    assert "megakernel.cu" not in {source for source, _ in _sources(plan)}


# Qwen3-30B-A3B's shape (config.json of Qwen/Qwen3-30B-A3B).
MOE_30B = dataclasses.replace(PRESETS["qwen3-1.7b"], num_hidden_layers=48, num_attention_heads=32,
                              num_key_value_heads=4, tie_word_embeddings=False, num_experts=128,
                              num_experts_per_tok=8, moe_intermediate_size=768,
                              norm_topk_prob=True)


def test_a_mixture_of_experts_decodes_on_the_megakernel_and_builds_moe_cu_as_dense_runs_do_not():
    plan = plan_kernels(MOE_30B, "fp8", gpu_shape("sm_90"))
    assert plan.decode == "megakernel" and plan.why_layered is None
    mk = dict(plan.megakernel.defines)
    assert (mk["QW_EXPERTS"], mk["QW_TOPK"], mk["QW_MOE_INTER"]) == (128, 8, 768)
    assert "QW_MK_SPLIT" not in mk  # (the experts' rows stream whole)
    moe = [build for build in plan.builds if build.source == "moe.cu"]
    assert [build.arch for build in moe] == ["sm_90"]
    assert dict(moe[0].defines)["QW_MOE_INTER"] == 768 and dict(moe[0].defines)["QW_TOPK"] == 8
    dense = plan_kernels(PRESETS["qwen3-0.6b"], "bf16", gpu_shape("sm_90"))
    assert "moe.cu" not in {source for source, _ in _sources(dense)}


def test_the_megakernel_leaves_to_the_graph_a_mixture_of_experts_with_dense_layers():
    mixed = dataclasses.replace(MOE_30B, mlp_only_layers=(0,))
    plan = plan_kernels(mixed, "bf16", gpu_shape("sm_90"))
    assert plan.decode == "layered" and plan.megakernel is None
    assert plan.why_layered == ("the megakernel routes a mixture of experts whose every layer is "
                                "sparse; this model's mlp_only_layers or decoder_sparse_step "
                                "leave dense ones")
    assert megakernel_layout(MOE_30B, 232_448, 132, "bf16", rows="parts") == (
        "the megakernel streams a mixture of experts' rows whole, not in parts")


def moe_build(weights, arch) -> Build:
    return "moe.cu", arch, kernel_defines(MOE_30B, weights)


@needs_nvrtc
@pytest.mark.parametrize(("weights", "arch"), [pytest.param("bf16", "sm_80", marks=COMPILE_MATRIX),
                                               ("fp8", "sm_90"),
                                               pytest.param("bf16", "sm_90", marks=COMPILE_MATRIX),
                                               pytest.param("fp8", "sm_80", marks=COMPILE_MATRIX)])
@compiled_ahead(lambda weights, arch: [moe_build(weights, arch)])
def test_a_mixture_of_experts_kernels_compile_for_its_shape(weights, arch, nvrtc_pool):
    cubin = nvrtc_pool.cubin(*moe_build(weights, arch))
    assert exported(cubin, MOE_KERNELS) == set(MOE_KERNELS)
    assert kernel_names(KernelBuild.of(*moe_build(weights, arch))) == MOE_KERNELS


@needs_nvrtc
@compiled_ahead(lambda: [("score.cu", "sm_90", {})])
def test_evals_scoring_kernels_compile_with_no_model_defines(nvrtc_pool):
    """score.cu takes the vocabulary as an argument: one build a GPU for every model."""
    from qwenchat.engine.cuda.scoring import SCORE_KERNELS

    assert exported(nvrtc_pool.cubin("score.cu", "sm_90", {}), SCORE_KERNELS) == set(SCORE_KERNELS)


def test_portable_prefill_on_another_gpu_compiles_no_hopper_source():
    plan = plan_kernels(PRESETS["qwen3-4b"], "fp8", gpu_shape("sm_89"))
    assert _sources(plan) == [
        ("megakernel.cu", "sm_89"), ("attention.cu", "sm_89"), ("sampling.cu", "sm_89"),
        ("gemm.cu", "sm_89"), ("attention_pass.cu", "sm_89"), ("verify.cu", "sm_89"),
        ("layers.cu", "sm_89")]
    assert all(dict(build.defines)["QW_FP8"] == 1 for build in plan.builds)
    hopper = plan_kernels(PRESETS["qwen3-4b"], "bf16", gpu_shape("sm_90"))
    forced = plan_kernels(PRESETS["qwen3-4b"], "bf16", gpu_shape("sm_90"),
                          prefill_kernels="portable")
    assert not forced.hopper_gemm and not forced.hopper_attention
    assert set(_sources(hopper)) - set(_sources(forced)) == {
        ("gemm_sm90.cu", "sm_90a"), ("attention_sm90.cu", "sm_90a")}
    assert set(_sources(forced)) - set(_sources(hopper)) == {("gemm.cu", "sm_90")}
    with pytest.raises(BackendUnavailable, match="needs an sm_90 GPU; this is sm_86"):
        plan_kernels(PRESETS["qwen3-4b"], "bf16", gpu_shape("sm_86"), prefill_kernels="hopper")


def test_a_mixture_of_experts_on_hopper_builds_the_wgmma_grouped_products_for_bf16_experts():
    """moe_sm90.cu (both its parts) where the dense products run on Hopper's GEMMs and the
    experts are bf16; moe.cu's moe_gemm everywhere (the decode's and the others' path)."""
    a3b = PRESETS["qwen3-30b-a3b"]
    hopper = _sources(plan_kernels(a3b, "bf16", gpu_shape("sm_90")))
    assert hopper.count(("moe_sm90.cu", "sm_90a")) == 2 and ("moe.cu", "sm_90") in hopper
    for other in (plan_kernels(a3b, "int4", gpu_shape("sm_90")),
                  plan_kernels(a3b, "bf16", gpu_shape("sm_89")),
                  plan_kernels(a3b, "bf16", gpu_shape("sm_90"), prefill_kernels="portable"),
                  plan_kernels(PRESETS["qwen3-4b"], "bf16", gpu_shape("sm_90"))):
        assert "moe_sm90.cu" not in {source for source, _ in _sources(other)}


def test_fp8_weights_on_hopper_prefill_on_the_e4m3_gemm_unless_asked_for_bf16():
    config = PRESETS["qwen3-4b"]
    plan = plan_kernels(config, "fp8", gpu_shape("sm_90"))
    assert plan.fp8_gemm
    assert ("gemm_fp8_sm90.cu", "sm_90a") in _sources(plan)
    assert ("gemm_sm90.cu", "sm_90a") not in _sources(plan)
    widened = plan_kernels(config, "fp8", gpu_shape("sm_90"), fp8_activations="bf16")
    assert not widened.fp8_gemm and ("gemm_sm90.cu", "sm_90a") in _sources(widened)
    for other in (plan_kernels(config, "bf16", gpu_shape("sm_90")),
                  plan_kernels(config, "fp8", gpu_shape("sm_89")),
                  plan_kernels(config, "fp8", gpu_shape("sm_90"), prefill_kernels="portable")):
        assert not other.fp8_gemm
        assert "gemm_fp8_sm90.cu" not in {source for source, _ in _sources(other)}


def test_where_the_megakernel_cannot_run_the_plan_says_why_and_compiles_the_graph():
    plan = plan_kernels(PRESETS["qwen3-0.6b"], "bf16", gpu_shape("sm_90", cooperative=False))
    assert plan.decode == "layered" and "cooperative" in plan.why_layered
    assert plan.megakernel is None
    small = plan_kernels(ODD_TINY, "bf16", gpu_shape("sm_90"))
    assert small.decode == "layered" and "head_dim 32" in small.why_layered
    assert "attention_sm90.cu" not in {s for s, _ in _sources(small)}  # head_dim 32


def test_an_unknown_megakernel_part_is_refused_before_anything_compiles():
    with pytest.raises(QwenchatError, match="unknown megakernel part 'nope'"):
        plan_kernels(PRESETS["qwen3-0.6b"], "bf16", gpu_shape("sm_90"), megakernel_skip=["nope"])


def test_fp8_rows_go_to_the_tensor_cores_where_the_gpu_converts_fp8():
    config = PRESETS["qwen3-0.6b"]
    for arch, on in (("sm_80", False), ("sm_86", False), ("sm_89", True), ("sm_90", True)):
        plan = plan_kernels(config, "fp8", gpu_shape(arch))
        assert plan.megakernel_layout.mma is on
        assert dict(plan.megakernel.defines)["QW_MK_F8_MMA"] == int(on)
    fma = plan_kernels(config, "fp8", gpu_shape("sm_90"), megakernel_consumer="fma")
    assert dict(fma.megakernel.defines)["QW_MK_F8_MMA"] == 0
    bf16 = plan_kernels(config, "bf16", gpu_shape("sm_90"))
    assert not bf16.megakernel_layout.mma and "QW_MK_F8_MMA" not in dict(bf16.megakernel.defines)
    with pytest.raises(QwenchatError, match="unknown megakernel consumer 'tc'; known: auto, fma"):
        plan_kernels(config, "fp8", gpu_shape("sm_90"), megakernel_consumer="tc")


def test_stages_hold_parts_of_rows_where_whole_rows_fill_them_poorly_or_do_not_fit():
    # Whole rows where they fill a stage well (measured faster there), parts of rows where
    # they do not (4B and 14B bf16) or cannot fit at all: every size and format decodes in the
    # megakernel on an H100 (32B bf16, its 100 KB SwiGLU vector beside three 31 KB stages),
    # and on a 99 KB card (RTX 4090) FP8 up to 14B, whose 17.5 KB down rows no stage there
    # holds whole, and bf16 up to 8B.
    def plan(name, fmt, arch="sm_90"):
        return megakernel_layout(PRESETS[name], *GPUS[arch], fmt, fmt == "fp8" and arch >= "sm_89")

    split = {("qwen3-4b", "bf16"), ("qwen3-14b", "bf16"), ("qwen3-32b", "bf16")}
    for name in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"):
        for fmt in ("bf16", "fp8"):
            layout = plan(name, fmt)
            assert not isinstance(layout, str), (name, fmt, layout)
            assert layout.split == ((name, fmt) in split), (name, fmt)
            assert layout.stages >= (2 if fmt == "fp8" else 3), (name, fmt)
            assert layout.stage_bytes >= 31 * 1024, (name, fmt)
            whole = stage_fill(PRESETS[name], layout, fmt) if not layout.split else None
            assert whole is None or whole >= SPLIT_BELOW_FILL or fmt == "fp8", (name, fmt)
    assert (plan("qwen3-32b", "bf16").stages, plan("qwen3-32b", "bf16").stage_bytes) == (3, 31744)
    assert dict(plan("qwen3-14b", "bf16").defines(PRESETS["qwen3-14b"]))["QW_MK_SPLIT"] == 1
    assert "QW_MK_SPLIT" not in dict(plan("qwen3-8b", "bf16").defines(PRESETS["qwen3-8b"]))
    # FP8 on the tensor cores (its f16 vectors need no more of the union region) keeps the
    # 32 KB ring on an H100, as does the CUDA-core consumer. On an H200 (more bandwidth a SM),
    # from 1.7B up a warp dots 2,048-2,560 columns of a row, and a stage holds whole gate/up
    # pairs of hidden-wide rows, at least ten of them, three stages (two for 32B, where three
    # would hold eight).
    for name in ("qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"):
        cfg = PRESETS[name]
        fma = megakernel_layout(cfg, *GPUS["sm_90"], "fp8", False, "auto", H200_BANDWIDTH)
        h100 = megakernel_layout(cfg, *GPUS["sm_90"], "fp8", True, "auto", H100_BANDWIDTH)
        mma = megakernel_layout(cfg, *GPUS["sm_90"], "fp8", True, "auto", H200_BANDWIDTH)
        assert h100 == plan(name, "fp8") and (h100.stage_bytes, h100.mma_seg) == (32768, 1024)
        assert mma.fixed <= fma.fixed and mma.mma and not fma.mma
        assert (fma.stage_bytes, fma.mma_seg) == (32768, 1024)
        assert 2048 <= mma.mma_seg <= 2560 and mma.mma_seg % 256 == 0, name
        assert dict(mma.defines(cfg, "fp8"))["QW_MK_MMA_SEG"] == mma.mma_seg
        row = FP8.row_bytes(cfg.hidden_size)
        rows = mma.stage_bytes // row
        assert rows >= 10 and rows % 2 == 0 and mma.stage_bytes - rows * row < 128, name
        assert mma.stages == (2 if name == "qwen3-32b" else 3), name
        room = GPUS["sm_90"][0] - MEGAKERNEL_STATIC_SHARED - mma.fixed
        assert mma.stages * mma.stage_bytes <= room, name
    small = megakernel_layout(PRESETS["qwen3-0.6b"], *GPUS["sm_90"], "fp8", True, "auto",
                              H200_BANDWIDTH)
    assert small == plan("qwen3-0.6b", "fp8") and small.mma_seg == 1024
    assert "QW_MK_MMA_SEG" not in dict(small.defines(PRESETS["qwen3-0.6b"], "fp8"))
    card = GPUS["sm_89"]
    for name, fmt, parts in (("qwen3-4b", "fp8", False), ("qwen3-8b", "fp8", False),
                             ("qwen3-14b", "fp8", True), ("qwen3-4b", "bf16", True),
                             ("qwen3-8b", "bf16", True)):
        small = plan(name, fmt, "sm_89")
        assert not isinstance(small, str) and small.stages >= 2 and small.split == parts, name
        static = MEGAKERNEL_SPLIT_STATIC_SHARED if parts else MEGAKERNEL_STATIC_SHARED
        assert static + small.fixed + small.stages * small.stage_bytes <= card[0]
    down_row = FP8.row_bytes(PRESETS["qwen3-14b"].intermediate_size)
    assert plan("qwen3-14b", "fp8", "sm_89").stage_bytes < down_row
    assert "shared memory" in plan("qwen3-14b", "bf16", "sm_89")  # its vectors do not fit
    assert "shared memory" in plan("qwen3-32b", "bf16", "sm_89")


def test_eight_query_heads_a_kv_head_fit_a_99_kb_card_with_the_attention_sums_halved():
    # 32B and 30B-A3B (8 query heads a kv head) keep a slot of attention partial outputs a warp
    # (64 KB of the union region) wherever that fits, and on a 99 KB card a slot for two warps
    # (QW_MK_COMB_HALF), which makes them fit; every other layout is as before.
    card = GPUS["sm_89"]
    for name, fmt in (("qwen3-30b-a3b", "int4"), ("qwen3-30b-a3b", "fp8"),
                      ("qwen3-30b-a3b", "bf16"), ("qwen3-32b", "fp8"), ("qwen3-32b", "int4")):
        cfg = PRESETS[name]
        small = megakernel_layout(cfg, *card, fmt, fmt == "fp8")
        assert not isinstance(small, str) and small.comb_half and small.stages >= 2, name
        assert dict(small.defines(cfg, fmt))["QW_MK_COMB_HALF"] == 1
        static = megakernel_static_shared(cfg, small.split)
        assert static + small.fixed + small.stages * small.stage_bytes <= card[0], name
        assert small.split == (name == "qwen3-32b"), name  # (32B's SwiGLU vector: parts)
        for arch in ("sm_80", "sm_90"):  # where the whole slots fit
            big = megakernel_layout(cfg, *GPUS[arch], fmt, fmt == "fp8")
            assert not big.comb_half and "QW_MK_COMB_HALF" not in dict(big.defines(cfg, fmt))
    for name in ("qwen3-8b", "qwen3-14b"):  # (4 and 5 query heads: they fit as they were)
        layout = megakernel_layout(PRESETS[name], *card, "fp8", True)
        assert not isinstance(layout, str) and not layout.comb_half, name


@needs_nvrtc
@pytest.mark.parametrize("model", [pytest.param("qwen3-30b-a3b", marks=COMPILE_MATRIX),
                                   pytest.param("qwen3-32b", marks=COMPILE_MATRIX)])
@compiled_ahead(lambda model: [
    ("megakernel.cu", "sm_89",
     dict(plan_kernels(PRESETS[model], "int4", gpu_shape("sm_89")).megakernel.defines))])
def test_the_megakernel_with_halved_attention_sums_compiles_and_its_static_memory_fits(
        model, nvrtc_pool):
    plan = plan_kernels(PRESETS[model], "int4", gpu_shape("sm_89"))
    assert plan.decode == "megakernel" and plan.megakernel_layout.comb_half
    cubin = nvrtc_pool.cubin("megakernel.cu", "sm_89", dict(plan.megakernel.defines))
    static = megakernel_static_shared(PRESETS[model], plan.megakernel_layout.split)
    assert 16 * 1024 < static_shared(cubin, "decode_megakernel") <= static


def test_how_stages_hold_rows_can_be_forced_and_an_unknown_way_is_refused():
    h100 = gpu_shape("sm_90")
    small = plan_kernels(PRESETS["qwen3-0.6b"], "bf16", h100)
    parts = plan_kernels(PRESETS["qwen3-0.6b"], "bf16", h100, megakernel_rows="parts")
    assert not small.megakernel_layout.split and parts.megakernel_layout.split
    assert dict(parts.megakernel.defines)["QW_MK_SPLIT"] == 1
    wide = plan_kernels(PRESETS["qwen3-14b"], "bf16", h100, megakernel_rows="whole")
    assert not wide.megakernel_layout.split and wide.megakernel_layout.stage_bytes == 65536
    too_wide = plan_kernels(PRESETS["qwen3-32b"], "bf16", h100, megakernel_rows="whole")
    assert too_wide.decode == "layered" and "shared memory" in too_wide.why_layered
    with pytest.raises(QwenchatError, match="unknown megakernel rows 'half'; known: auto, "
                                            "whole, parts"):
        plan_kernels(PRESETS["qwen3-0.6b"], "bf16", h100, megakernel_rows="half")


def test_a_ring_of_whole_rows_holds_three_stages_or_four_of_int4_where_more_would_fit():
    # (measured on the H100: deeper rings were slower, docs/perf.md 2026-11-27)
    h100 = GPUS["sm_90"]
    for name in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"):
        for fmt in ("bf16", "fp8", "int4"):
            layout = megakernel_layout(PRESETS[name], *h100, fmt, fmt == "fp8", "auto",
                                       H100_BANDWIDTH)
            if layout.split:  # (parts of rows keep what fits: 4B and 14B bf16 four, 32B three)
                assert layout.stages == (3 if name == "qwen3-32b" else 4), (name, fmt)
                continue
            assert layout.stage_bytes == 32768, (name, fmt)
            assert layout.stages * layout.stage_bytes <= WHOLE_RING_BYTES[fmt], (name, fmt)
            assert layout.stages == (3 if fmt != "int4" or name == "qwen3-32b" else 4), (name, fmt)
    # Where less room is left, fewer stages still (and smaller ones on a 99 KB card).
    assert megakernel_layout(PRESETS["qwen3-0.6b"], *GPUS["sm_89"], "bf16").stages == 2


def test_stage_fill_is_the_least_filled_phase_with_whole_rows():
    # 14B bf16 on an H100: a 34 KB down row alone in a 64 KB stage; 8B: three 8 KB Q/K/V rows
    # of a 32 KB stage and one 24 KB down row in it.
    h100 = GPUS["sm_90"]
    wide = megakernel_layout(PRESETS["qwen3-14b"], *h100, "bf16")
    whole = dataclasses.replace(wide, stage_bytes=65536, split=False)
    assert stage_fill(PRESETS["qwen3-14b"], whole, "bf16") == pytest.approx(34816 / 65536)
    eight = megakernel_layout(PRESETS["qwen3-8b"], *h100, "bf16")
    assert stage_fill(PRESETS["qwen3-8b"], eight, "bf16") == pytest.approx(0.75)


def static_shared(cubin: bytes, kernel: str) -> int:
    """The static shared memory of `kernel` in an ELF cubin: its .nv.shared section's size."""
    import struct

    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    size, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * size) for i in range(count)]
    table = sections[names][4]
    for section in sections:
        name = cubin[table + section[0]:cubin.index(b"\0", table + section[0])].decode()
        if name == f".nv.shared.{kernel}":
            return section[5]
    raise AssertionError(f"no .nv.shared.{kernel} section")


def _widest_plan(weights, bandwidth, model="qwen3-32b"):
    return plan_kernels(PRESETS[model], weights, gpu_shape("sm_90", bandwidth=bandwidth))


# (weights, parts of rows, bandwidth, model): the megakernel's default-run builds
WIDEST_MEGAKERNELS = [("bf16", True, H100_BANDWIDTH, "qwen3-32b"),
                      ("fp8", False, H100_BANDWIDTH, "qwen3-32b"),
                      ("int4", False, H100_BANDWIDTH, "qwen3-30b-a3b"),
                      pytest.param("fp8", False, H200_BANDWIDTH, "qwen3-32b",
                                   marks=COMPILE_MATRIX)]


@needs_nvrtc
@pytest.mark.parametrize(("weights", "split", "bandwidth", "model"), WIDEST_MEGAKERNELS)
@compiled_ahead(lambda weights, bandwidth, model, **_: [
    ("megakernel.cu", "sm_90", dict(_widest_plan(weights, bandwidth, model).megakernel.defines))])
def test_the_megakernel_static_shared_memory_fits_what_its_layout_leaves_it(
        weights, split, bandwidth, model, nvrtc_pool):
    # The layout gives the dynamic part all but megakernel_static_shared: whole rows, parts of
    # rows (their row table) or experts (their routing and down rows' sums). 32B's static part
    # is the largest of the dense models (its attention groups of 8 heads; with parts of rows,
    # its row table), int4 30B-A3B's of the experts'. On an H200 32B's FP8 rows take two 62 KB
    # stages and 2,560-column warp segments.
    plan = _widest_plan(weights, bandwidth, model)
    assert plan.decode == "megakernel" and plan.megakernel_layout.split is split
    if model == "qwen3-32b":
        assert plan.megakernel_layout.mma_seg == (2560 if bandwidth == H200_BANDWIDTH else 1024)
    cubin = nvrtc_pool.cubin("megakernel.cu", "sm_90", dict(plan.megakernel.defines))
    static = megakernel_static_shared(PRESETS[model], split)
    assert 16 * 1024 < static_shared(cubin, "decode_megakernel") <= static


@needs_nvrtc
def test_a_layout_whose_union_region_is_not_the_kernels_does_not_compile():
    # The host places the layer table after the union region it sized; the kernel asserts at
    # compile time that it sizes that region the same (every build above passes the check).
    plan = plan_kernels(PRESETS["qwen3-8b"], "fp8", gpu_shape("sm_90"))
    defines = dict(plan.megakernel.defines)
    defines["QW_MK_HOST_UNION"] -= 128
    with pytest.raises(KernelCompileError, match="sizes the union region as the kernel does"):
        compile_source("megakernel.cu", "sm_90", defines)


def test_the_megakernel_can_be_laid_out_for_less_shared_memory_than_the_gpu_has():
    # An H100 running the layout of an RTX 4090 (99 KB a block): 8B FP8 in two 16 KB stages,
    # 8B bf16 in two 10 KB ones holding parts of rows (its float vectors take more), 14B bf16
    # on the graph, as on that card; never more than the GPU has.
    h100 = gpu_shape("sm_90")
    fp8 = plan_kernels(PRESETS["qwen3-8b"], "fp8", h100, megakernel_shared=101_376)
    assert fp8.decode == "megakernel"
    expected = megakernel_layout(PRESETS["qwen3-8b"], 101_376, 132, "fp8", True)
    assert fp8.megakernel_layout == expected
    assert (fp8.megakernel_layout.stages, fp8.megakernel_layout.stage_bytes) == (2, 16384)
    bf16 = plan_kernels(PRESETS["qwen3-8b"], "bf16", h100, megakernel_shared=101_376)
    assert (bf16.megakernel_layout.stages, bf16.megakernel_layout.stage_bytes) == (2, 10240)
    wide = plan_kernels(PRESETS["qwen3-14b"], "bf16", h100, megakernel_shared=101_376)
    assert wide.decode == "layered" and "101,376" in wide.why_layered
    for wrong in (232_449, 1024):
        with pytest.raises(QwenchatError, match=f"must be 49,152 to 232,448 bytes on this GPU; "
                                                f"got {wrong:,}"):
            plan_kernels(PRESETS["qwen3-8b"], "fp8", h100, megakernel_shared=wrong)


def consumer_build(arch, name, consumer) -> Build:
    plan = plan_kernels(PRESETS[name], "fp8", gpu_shape(arch), megakernel_consumer=consumer)
    return "megakernel.cu", arch, dict(plan.megakernel.defines)


@needs_nvrtc
@pytest.mark.parametrize(("arch", "name", "consumer"), [
    pytest.param("sm_90", "qwen3-14b", "auto", marks=COMPILE_MATRIX),
    pytest.param("sm_90", "qwen3-14b", "fma", marks=COMPILE_MATRIX),
    pytest.param("sm_89", "qwen3-4b", "auto", marks=COMPILE_MATRIX),
    pytest.param("sm_89", "qwen3-4b", "fma", marks=COMPILE_MATRIX)])
@compiled_ahead(lambda **p: [consumer_build(**p)])
def test_the_fp8_megakernel_compiles_with_either_consumer(arch, name, consumer, nvrtc_pool):
    assert nvrtc_pool.cubin(*consumer_build(arch, name, consumer)).startswith(ELF_MAGIC)


def owed_refill_build(arch, name, weights, rows) -> Build:
    """The megakernel with the owed refill (QW_MK_OWE, an experiment: docs/perf.md, twenty-first
    session), so that its code keeps compiling beside the default's."""
    plan = plan_kernels(PRESETS[name], weights, gpu_shape(arch), megakernel_rows=rows)
    return "megakernel.cu", arch, {**dict(plan.megakernel.defines), "QW_MK_OWE": 1}


@needs_nvrtc
@pytest.mark.parametrize(("arch", "name", "weights", "rows"), [
    pytest.param("sm_90", "qwen3-0.6b", "bf16", "auto", marks=COMPILE_MATRIX),
    pytest.param("sm_80", "qwen3-0.6b", "bf16", "auto", marks=COMPILE_MATRIX),
    pytest.param("sm_90", "qwen3-4b", "fp8", "parts", marks=COMPILE_MATRIX),
    pytest.param("sm_90", "qwen3-30b-a3b", "int4", "auto", marks=COMPILE_MATRIX)])
@compiled_ahead(lambda **p: [owed_refill_build(**p)])
def test_the_owed_refill_experiment_compiles(arch, name, weights, rows, nvrtc_pool):
    build = owed_refill_build(arch, name, weights, rows)
    assert build[2].get("QW_MK_SPLIT", 0) == (rows == "parts")  # both ways of streaming rows
    assert nvrtc_pool.cubin(*build).startswith(ELF_MAGIC)


def test_every_source_has_a_place_in_the_compile_order():
    assert set(COMPILE_ORDER) == set(KERNEL_FILES)


def _timeline_plan(arch):
    return plan_kernels(PRESETS["qwen3-0.6b"], "bf16", gpu_shape(arch), megakernel_timeline=64)


@needs_nvrtc
@pytest.mark.parametrize("arch", [pytest.param("sm_80", marks=COMPILE_MATRIX),
                                  pytest.param("sm_90", marks=COMPILE_MATRIX)])
@compiled_ahead(lambda arch: [("megakernel.cu", arch,
                               dict(_timeline_plan(arch).megakernel.defines))])
def test_the_megakernel_timeline_build_compiles(arch, nvrtc_pool):
    plan = _timeline_plan(arch)
    assert dict(plan.megakernel.defines)["QW_MK_TIMELINE"] == 64
    plain = plan_kernels(PRESETS["qwen3-0.6b"], "bf16", gpu_shape(arch))
    assert "QW_MK_TIMELINE" not in dict(plain.megakernel.defines)
    cubin = nvrtc_pool.cubin("megakernel.cu", arch, dict(plan.megakernel.defines))
    assert cubin.startswith(ELF_MAGIC) and b"qw_timeline" in cubin


def test_short_prompts_split_k_where_few_tiles_would_leave_the_sms_idle():
    from qwenchat.engine.cuda.prefill import SPLIT_K_MOST, split_k

    sms = 132
    # 8B shapes, a 32-token turn: Q/K/V's 48 tiles of 128 columns alone fill 48 of 132 SMs
    assert split_k(32, 6144, 4096, sms) == 8
    assert split_k(32, 4096, 12288, sms) > 1
    for m, n, k in [(32, 6144, 4096), (9, 24576, 4096), (64, 1024, 3072), (40, 2048, 200)]:
        splits = split_k(m, n, k, sms)
        steps = -(-k // 64)
        per = -(-steps // splits)
        assert 1 <= splits <= SPLIT_K_MOST and -(-steps // per) == splits  # no empty run
    assert split_k(32, 6144, 4096, sms, budget_floats=32 * 6144 * 2) <= 2  # the scratch
    assert split_k(2048, 6144, 4096, sms) == 1  # long prompts: tiles enough
    assert split_k(32, 6144, 64, sms) == 1  # one step: nothing to split


def test_a_short_prompt_replays_a_graph_of_whole_steps_of_16_rows_within_the_cache():
    from types import SimpleNamespace

    from qwenchat.engine.cuda.prefill import SHORT_PROMPT_ROWS, Prefill

    engine = SimpleNamespace(capacity=1024)
    assert Prefill.short_prompt_rows(engine, 300, 40) == 48
    assert Prefill.short_prompt_rows(engine, 0, 9) == 16
    assert Prefill.short_prompt_rows(engine, 0, SHORT_PROMPT_ROWS) == SHORT_PROMPT_ROWS
    assert Prefill.short_prompt_rows(engine, 0, SHORT_PROMPT_ROWS + 1) is None
    assert Prefill.short_prompt_rows(engine, 1000, 20) is None  # rows 1000-1031: past the end
    assert Prefill.short_prompt_rows(engine, 992, 20) == 32


def test_passes_share_one_scratch_of_partial_sums_sized_by_the_largest():
    from qwenchat.engine.cuda.engine import decode_split_options, partials_bytes
    from qwenchat.engine.cuda.layered import DECODE_MAX_CHUNK
    from qwenchat.engine.cuda.prefill import (
        PREFILL_MAX_KEY_SPLITS,
        PREFILL_QUERIES_PER_BLOCK,
        SPLIT_K_BYTES,
    )
    from qwenchat.engine.cuda.verify import VERIFY_ROWS
    from qwenchat.model.presets import PRESETS

    config = PRESETS["qwen3-8b"]
    chunk_floats = config.num_attention_heads * config.head_dim
    # 131,072 positions: chunks of at most 256 keys, and the speculative pass's rows of them
    assert decode_split_options(config, 131072, 132) == [16, 131072 // DECODE_MAX_CHUNK]
    assert partials_bytes(config, 131072, True, 132) == VERIFY_ROWS * chunk_floats * 512 * 4
    assert VERIFY_ROWS * chunk_floats * 512 * 4 == 64 * 2**20
    # a short context: split K's products are the largest
    assert decode_split_options(config, 4096, 132) == [16, 66]
    assert partials_bytes(config, 4096, True, 132) == SPLIT_K_BYTES
    # without split K (FP8 weights on e4m3): a prefill's key splits
    assert partials_bytes(config, 4096, False, 132) == (
        PREFILL_QUERIES_PER_BLOCK * PREFILL_MAX_KEY_SPLITS * chunk_floats * 4)


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b"])
def test_a_passs_chunks_are_longer_than_a_steps_and_never_past_the_kernels_most(preset):
    """A speculative pass takes the fewest chunks of at most VerifyPass.pass_chunk keys (a
    decode step: DECODE_SHORT_CHUNK): at 2,000 positions 16 chunks where a step takes the
    most. Every length up to the capacity keeps each chunk within DECODE_MAX_CHUNK keys
    (attention.cu traps past it)."""
    from qwenchat.engine.cuda.engine import decode_split_options
    from qwenchat.engine.cuda.layered import DECODE_MAX_CHUNK, LayeredDecode
    from qwenchat.engine.cuda.verify import VerifyPass
    from qwenchat.model.presets import PRESETS

    class Splits(LayeredDecode, VerifyPass):  # (CudaEngine's choice of chunks, alone)
        def __init__(self, options: list[int]) -> None:
            self.split_options = options

    assert VerifyPass.pass_chunk <= DECODE_MAX_CHUNK
    for capacity in (4096, 40960, 131072):
        options = decode_split_options(PRESETS[preset], capacity, 132)
        engine = Splits(options)
        if capacity == 4096:
            assert engine._pass_splits(2008) == 16
            assert engine._splits_for(2008) == options[-1] > 16
        for length in range(1, capacity + 1, 7):
            assert math.ceil(length / engine._pass_splits(length)) <= DECODE_MAX_CHUNK


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b", "qwen3-32b"])
def test_a_passs_packed_attention_stays_within_its_block_and_the_prefills_partial_sums(preset):
    """attn_pass_packed: a block's query tile holds every row's query heads of a kv head (the
    kernel traps past PF_Q), the key splits for any length up to the capacity are within
    PASS_MAX_KEY_SPLITS and no more than the 64-key tiles, and the prefill's partial sums
    ([rows][heads][splits][head_dim], CudaEngine.partials and prefill_part_ml) hold a pass's
    8 rows of the most splits. A wider group than Qwen3's attends on the decode kernels."""
    from qwenchat.engine.cuda.prefill import PREFILL_MAX_KEY_SPLITS, PREFILL_QUERIES_PER_BLOCK
    from qwenchat.engine.cuda.verify import (
        PASS_MAX_KEY_SPLITS,
        VERIFY_ROWS,
        VerifyPass,
        packed_attention_fits,
    )
    from qwenchat.model.presets import PRESETS

    pf_q = int(re.search(r"constexpr int PF_Q = (\d+);",
                         compiler._read_sources()["prefill_attention.cuh"]).group(1))
    assert pf_q == PREFILL_QUERIES_PER_BLOCK
    config = PRESETS[preset]
    group = config.num_attention_heads // config.num_key_value_heads
    assert packed_attention_fits(config) and VERIFY_ROWS * group <= pf_q
    wide = dataclasses.replace(config, num_attention_heads=16 * config.num_key_value_heads)
    assert not packed_attention_fits(wide)
    assert VERIFY_ROWS * PASS_MAX_KEY_SPLITS <= PREFILL_QUERIES_PER_BLOCK * PREFILL_MAX_KEY_SPLITS

    class Splits(VerifyPass):  # (CudaEngine's choice of key splits, alone)
        def __init__(self) -> None:
            self.config = config
            self.device = dataclasses.make_dataclass("Device", ["sm_count"])(132)

    engine = Splits()
    seen = set()
    for length in range(1, 131_072 + 1, 13):
        splits = engine._packed_splits(length)
        assert 1 <= splits <= min(PASS_MAX_KEY_SPLITS, math.ceil(length / 64))
        seen.add(splits)
    assert engine._packed_splits(9) == 1 and max(seen) == min(
        PASS_MAX_KEY_SPLITS, math.ceil(2 * 132 / config.num_key_value_heads))


def test_the_prefill_chunk_fills_the_attention_blocks_last_wave():
    from qwenchat.engine.cuda.prefill import attention_wave_chunk

    # 8B: 1,856 tokens of scratch are 15 tiles of 128 queries x 32 heads = 480 blocks, 4 waves
    # of 132 SMs; 1,536 tokens are 384 blocks in 3 waves, more queries a wave
    assert attention_wave_chunk(1856, 32, 132) == 1536
    assert attention_wave_chunk(2048, 16, 132) == 2048  # 0.6B: 256 blocks, 2 waves already
    assert attention_wave_chunk(2048, 32, 132) == 2048  # 4B: 512 and 384 blocks tie a wave
    assert attention_wave_chunk(1408, 40, 132) == 1152  # 14B: 360 blocks, 3 waves
    for most in (64, 200, 700, 1856, 2048):
        for heads in (8, 16, 32, 40, 64):
            chunk = attention_wave_chunk(most, heads, 132)
            assert most // 2 <= chunk <= most


def test_a_routed_pairs_staging_holds_each_of_its_uses_in_turn():
    """moe.py stages a token's attention rows (qkv and q), then its pairs' fp32 gate/up outputs
    (off Hopper), then their bf16 down outputs, in the same bytes, the down outputs a part of
    the columns at a time so that they take no more than the rest; the attention's output
    shares the SwiGLU rows. 30B-A3B has no dense layer, so its chunk spends nothing on a dense
    MLP's rows: 4,096 tokens in bf16 on Hopper (its down products in halves), eight times the
    512 that separate buffers left."""
    from types import MethodType, SimpleNamespace

    from qwenchat.engine.cuda.engine import CudaEngine
    from qwenchat.engine.cuda.moe import moe_down_parts, moe_stage_bytes
    from qwenchat.engine.cuda.prefill import dense_mlp_rows
    from qwenchat.model.presets import PRESETS

    a3b = PRESETS["qwen3-30b-a3b"]
    attention = 5120 * 4 + 4096 * 2  # qkv (fp32) and q (bf16) rows
    # 8 bf16 rows of 2,048 are 32 KB: a half is within the attention's 28 KB, the whole not
    assert moe_down_parts(a3b, attention) == 2
    assert moe_stage_bytes(a3b, True, attention) == attention
    # off Hopper the fp32 gate/up rows (8 x 2 x 768 x 4 = 48 KB) set the floor: whole
    assert moe_down_parts(a3b, 8 * 2 * 768 * 4) == 1
    assert moe_stage_bytes(a3b, False, attention) == 8 * 2 * 768 * 4
    for overrides, parts in (({}, 1), ({"hidden_size": 256, "moe_intermediate_size": 16}, 4),
                             ({"hidden_size": 240, "moe_intermediate_size": 16}, 2)):
        config = Qwen3Config.from_dict(tiny_moe_config(**overrides))
        k, h, inter = config.num_experts_per_tok, config.hidden_size, config.moe_intermediate_size
        got = moe_down_parts(config, 2 * inter * 4 * k)
        assert got == parts and h % (8 * got) == 0, overrides
        assert moe_stage_bytes(config, False, 0) == max(2 * inter * 4 * k, k * h * 2 // got)
    assert not dense_mlp_rows(a3b)
    assert dense_mlp_rows(Qwen3Config.from_dict(tiny_moe_config(mlp_only_layers=[0])))
    for fmt, fp8, chunk in (("bf16", False, 4096), ("fp8", True, 3584), ("int4", False, 2560)):
        engine = SimpleNamespace(config=a3b, gemm90=True, fp8_gemm=fp8, attention90=True,
                                 weight_format=fmt, device=SimpleNamespace(sm_count=132))
        engine._staging_bytes_per_token = MethodType(CudaEngine._staging_bytes_per_token, engine)
        floor = attention if fmt != "int4" else 8 * 2 * 768 * 4  # (int4: moe_gemm's gate/up)
        assert engine._staging_bytes_per_token(attention) == 128 * 4 + 8 * (32 + 768 * 2) + floor
        assert CudaEngine._prefill_chunk_tokens(engine) == chunk, fmt


def test_capacity_planning_charges_the_kv_cache_and_little_more_per_position():
    from types import SimpleNamespace

    from qwenchat.engine.cuda.engine import MEMORY_MARGIN, CudaEngine
    from qwenchat.model.kv_cache import bytes_per_position
    from qwenchat.model.presets import PRESETS

    config = PRESETS["qwen3-8b"]
    ctx = 20_000
    per_position = bytes_per_position(config, "bf16")
    free = MEMORY_MARGIN + 2**30 + ctx * per_position * 101 // 100
    engine = SimpleNamespace(config=config, kv_format="bf16", weight_format="bf16",
                             device=SimpleNamespace(mem_info=lambda: (free, 80 * 2**30)))
    assert CudaEngine._choose_capacity(engine, ctx, lambda _: None) == ctx


# ------------------------------------------------------------ compiles in a process of their own
@needs_nvrtc
def test_a_detached_compile_stores_the_cubin_one_by_one_compiling_gives(src, tmp_path):
    cache = KernelCache(tmp_path / "cubins", src)
    build = KernelBuild.of("tiny.cu", "sm_90", TINY_DEFINES)
    assert cache.cached(build) is None
    job = cache.start_detached(build)
    cubin = job.wait(timeout=120)
    assert cubin == compile_source("tiny.cu", "sm_90", TINY_DEFINES, source_dir=src)
    assert cache.cached(build) == cubin and job.poll() == cubin


@needs_nvrtc
def test_a_detached_compile_that_fails_says_why_in_one_line(src, tmp_path):
    cache = KernelCache(tmp_path / "cubins", src)
    job = cache.start_detached(KernelBuild.of("broken.cu", "sm_90", TINY_DEFINES))
    with pytest.raises(KernelCompileError) as caught:
        job.wait(timeout=120)
    message = str(caught.value)
    assert "broken.cu for sm_90 did not compile (exit 1)" in message
    assert "undefined_name" in message and "\n" not in message
    assert cache.size_bytes() == 0


# A process that starts a detached compile of one real kernel and exits at once.
_LEAVER = """
import sys
from pathlib import Path
from qwenchat.engine.cuda.compiler import KernelBuild, KernelCache, kernel_defines
from qwenchat.model.presets import PRESETS
build = KernelBuild.of("sampling.cu", "sm_90", kernel_defines(PRESETS["qwen3-0.6b"]))
KernelCache(Path(sys.argv[1])).start_detached(build)
"""


@needs_nvrtc
def test_a_detached_compile_outlives_the_process_that_started_it(tmp_path):
    import subprocess
    import sys

    cache_dir = tmp_path / "cubins"
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", _LEAVER, str(cache_dir)], check=True, timeout=120)
    build = KernelBuild.of("sampling.cu", "sm_90", kernel_defines(PRESETS["qwen3-0.6b"]))
    cache = KernelCache(cache_dir)
    while cache.cached(build) is None:
        assert time.perf_counter() - started < 120, "the detached compile never stored its cubin"
        time.sleep(0.05)
    assert cache.cached(build) == compile_source("sampling.cu", "sm_90",
                                                 kernel_defines(PRESETS["qwen3-0.6b"]))


def test_a_mixture_of_experts_with_more_hidden_rows_a_block_than_the_down_sums_hold_is_refused():
    # The experts' down rows meet in a table of MEGAKERNEL_EXPERT_ROWS hidden rows a block
    # (DOWN_ROWS in mk_layout.cuh): 30B-A3B's 2,048 rows need 32 blocks at least.
    from qwenchat.engine.cuda.megakernel import MEGAKERNEL_EXPERT_ROWS

    cfg = PRESETS["qwen3-30b-a3b"]
    fewest = -(-cfg.hidden_size // MEGAKERNEL_EXPERT_ROWS)
    assert not isinstance(megakernel_layout(cfg, GPUS["sm_90"][0], fewest, "fp8", True), str)
    too_few = megakernel_layout(cfg, GPUS["sm_90"][0], fewest - 1, "fp8", True)
    assert isinstance(too_few, str) and "too wide" in too_few


@needs_nvrtc
def test_a_build_another_compilation_is_compiling_is_waited_for_not_compiled_again(
        src, tmp_path, compiles, monkeypatch):
    # An early start (qwenchat/engine/cuda/early.py) and the engine's own compilation ask for
    # the same builds: the second waits for the first's compile, and reports it as its own.
    import threading

    started, release = threading.Event(), threading.Event()
    spy = compiler._compile

    def held(*args, **kwargs):
        started.set()
        release.wait(10)
        return spy(*args, **kwargs)

    monkeypatch.setattr(compiler, "_compile", held)
    cache = KernelCache(tmp_path / "cubins", src)
    build = KernelBuild.of("tiny.cu", "sm_90", TINY_DEFINES)
    early = cache.start([build])
    assert started.wait(10)
    progress: list[str] = []
    second = cache.start([build], progress=progress.append)
    release.set()
    assert second.cubin(build) == early.cubin(build)
    assert second.cubin(build).startswith(ELF_MAGIC)
    assert compiles == ["tiny.cu"] and second.to_compile == [build]
    assert len(progress) == 1 and progress[0].startswith("compiled tiny.cu in ")
    assert not compiler._IN_FLIGHT  # (nothing left under way)
    assert cache.start([build]).to_compile == []  # and it is in the cache


# --- compiles started before the driver is up (qwenchat/engine/cuda/early.py) ---------------
class FakeNvml:
    """libnvidia-ml's calls that early.py makes, answering for GPUs of these capabilities."""

    def __init__(self, capabilities, init=0):
        self.capabilities, self.init, self.shut = capabilities, init, False

    def nvmlInit_v2(self):
        return self.init

    def nvmlDeviceGetCount_v2(self, count):
        count._obj.value = len(self.capabilities)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        handle._obj.value = index + 1
        return 0

    def nvmlDeviceGetCudaComputeCapability(self, handle, major, minor):
        major._obj.value, minor._obj.value = self.capabilities[handle.value - 1]
        return 0

    def nvmlShutdown(self):
        self.shut = True
        return 0


def test_the_architecture_is_guessed_only_where_every_gpu_has_the_same():
    from qwenchat.engine.cuda import early

    h100s = FakeNvml([(9, 0), (9, 0)])
    assert early.nvml_capabilities(lambda _: h100s) == [(9, 0), (9, 0)] and h100s.shut
    assert early.architecture_of([(9, 0), (9, 0)]) == "sm_90"
    assert early.architecture_of([(8, 9)]) == "sm_89"
    assert early.architecture_of([(9, 0), (8, 9)]) is None  # (CUDA's order is not NVML's)
    assert early.architecture_of([]) is None
    assert early.nvml_capabilities(lambda _: FakeNvml([(9, 0)], init=9)) == []

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    assert early.nvml_capabilities(missing) == []


def test_no_guess_where_cuda_sees_no_gpu(monkeypatch):
    from qwenchat.engine.cuda import early

    monkeypatch.setattr(early, "nvml_capabilities", lambda: [(9, 0)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert early.guess_architecture() is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert early.guess_architecture() == "sm_90"


def test_an_early_start_plans_its_builds_without_the_drivers_bindings():
    # cuda-python's driver bindings take half a second to import, holding Python's lock
    # throughout: the early start must have its compiles out without them (early.py).
    code = """
import sys
from qwenchat.engine.cuda import early
from qwenchat.engine.cuda.compiler import KernelCache
from qwenchat.model.presets import PRESETS
from qwenchat.model.random_weights import RandomWeights

started = []
KernelCache.start = lambda self, builds, *a, **k: started.append(len(list(builds)))
config = PRESETS["qwen3-30b-a3b"]
early.start_early_compiles(config, RandomWeights(config), guess=lambda: "sm_90").join(30)
print(started, sorted(m for m in ("cuda.bindings.driver", "qwenchat.engine.cuda.runtime",
                                  "qwenchat.engine.cuda.engine") if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    builds, imported = done.stdout.strip().split("] [")
    assert int(builds.strip("[")) > 0  # (it did plan and start them)
    assert imported.strip("]") == ""


def test_the_engine_imports_the_drivers_bindings_after_the_early_compiles_are_under_way(
        monkeypatch):
    from qwenchat.engine import create_engine
    from qwenchat.engine.cuda import early
    from qwenchat.engine.cuda import probe as cuda_probe
    from qwenchat.engine.cuda.probe import CudaProbe
    from qwenchat.model.random_weights import RandomWeights

    under_way = threading.Event()

    def start(*_args, **_kwargs):
        def run():
            threading.Event().wait(0.2)  # (a guess and a plan that take a while)
            under_way.set()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    seen: list[bool] = []

    def probe():
        seen.append(under_way.is_set())
        return CudaProbe(nvrtc_version=None)  # (no driver: the CPU engine answers)

    monkeypatch.setattr(early, "start_early_compiles", start)
    monkeypatch.setattr(cuda_probe, "probe", probe)
    config = dataclasses.replace(PRESETS["qwen3-0.6b"], num_hidden_layers=1,
                                 max_position_embeddings=64)
    create_engine("auto", config, RandomWeights(config), ctx=16).close()
    assert seen == [True]


@pytest.mark.parametrize(("name", "weights", "kv"), [("qwen3-0.6b", "bf16", "bf16"),
                                                     ("qwen3-8b", "fp8", "int8"),
                                                     ("qwen3-30b-a3b", "int4", "bf16")])
def test_an_early_start_compiles_the_builds_the_engines_plan_will_ask_for(
        name, weights, kv, monkeypatch):
    # The same builds as plan_kernels' on that GPU, less the megakernel (which waits for the
    # GPU's shared memory): the engine's compilation then waits for them (compiler.py).
    from qwenchat.engine.cuda import early
    from qwenchat.model.fp8 import with_quantization
    from qwenchat.model.random_weights import RandomWeights

    started: list[list[KernelBuild]] = []
    monkeypatch.setattr(KernelCache, "start", lambda self, builds, *a, **k: started.append(
        list(builds)))
    config = PRESETS[name]
    source = with_quantization(RandomWeights(config), "none" if weights == "bf16" else weights)
    early.start_early_compiles(config, source, kv, guess=lambda: "sm_90").join(30)
    plan = plan_kernels(config, weights, gpu_shape("sm_90"), kv_format=kv)
    assert plan.megakernel is not None
    assert started == [[b for b in plan.builds if b != plan.megakernel]]
    started.clear()
    early.start_early_compiles(config, source, kv, guess=lambda: None).join(30)
    assert started == []

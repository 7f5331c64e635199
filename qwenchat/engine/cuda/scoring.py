"""`qwenchat eval`'s windows on the GPU. Every position's logits come from products of the
window's rows with the LM head (bf16 in every format: on gemm.cu built for bf16, or the
engine's Hopper GEMM where it takes bf16 weights), the normed rows split in two bf16 parts so
that the logits are the float rows' as decoding computes them. score.cu reduces them on the
device to a few numbers a row: the log-sum-exp, the target's logit, the first maximum and,
against a base engine's rows on the same GPU, the KL divergence. Only those come back, where
the per-row path (prefill_logits) brings 151,936 floats a row to the host."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qwenchat.engine.base import GenerateRequest
from qwenchat.engine.cuda import runtime as rt
from qwenchat.engine.cuda.compiler import KernelBuild, KernelCache, kernel_defines
from qwenchat.engine.cuda.prefill import GEMM90_BOX, GEMM_TILE, gemm_shared_bytes
from qwenchat.errors import QwenchatError
from qwenchat.sampling.params import LiveParams, SamplingParams

# score.cu's kernels (eval's only: built on first use)
SCORE_KERNELS = ("rmsnorm_rows_split", "score_rows", "gather_logits")
SCORE_FIELDS = 8  # score.cu's out: a row's eight doubles
SCORE_THREADS = 512


# Left free beside a window's logits (the driver, other programs, a base engine's next window)
SCORE_MARGIN = 512 * 2**20


def check_window_memory(rows: int, nbytes: int, free: int) -> None:
    """One line where a window's logits (rows x vocabulary floats) do not fit the GPU."""
    if nbytes > free - SCORE_MARGIN:
        raise QwenchatError(
            f"a window of {rows:,} tokens needs {nbytes / 2**30:.1f} GiB of GPU memory for its "
            f"logits and {max(0, free - SCORE_MARGIN) / 2**30:.1f} GiB are free; use a smaller "
            "--window")


@dataclass(frozen=True)
class DeviceRows:
    """A window's rows of logits on the GPU (float32, `vocab` apart), valid until the engine
    that made them scores its next window."""

    ptr: int
    rows: int
    vocab: int

    def row(self, r: int) -> int:
        return self.ptr + r * self.vocab * 4


class Scoring:
    """CudaEngine's part for eval (a mixin: it uses the engine's buffers and launches)."""

    # The LM head's products on gemm_sm90.cu where it can (sm_90, bf16 and int4 layers): on
    # the 0.6B shape 35.6K / 33.9K scored tok/s against gemm.cu's 31.0K / 30.7K, the same
    # figures to the last digit (H100, docs/perf.md); False: gemm.cu everywhere.
    score_on_hopper_gemm = True
    _score_kernels: dict[str, rt.Kernel] | None = None
    _score_logits: rt.DeviceBuffer | None = None
    _score_lo: rt.DeviceBuffer | None = None
    _score_tensor_maps: tuple[rt.TensorMap, rt.TensorMap, rt.TensorMap] | None = None
    _score_small: tuple[rt.DeviceBuffer, rt.DeviceBuffer] | None = None

    def prepare_scoring(self) -> None:
        """Compile (or load) the scoring kernels now, not in the first window's time."""
        self.device.make_current()
        self._scoring_kernels()

    def window_rows(self, token_ids: Sequence[int]) -> DeviceRows:
        """Prefill `token_ids` after whatever the cache holds, keeping every position's logits
        on the device."""
        cfg = self.config
        n = len(token_ids)
        if n == 0:
            raise ValueError("window_rows needs at least one token")
        self.device.make_current()
        kernels = self._scoring_kernels()
        logits = self._score_rows_buffer(n)
        row_bytes = cfg.vocab_size * 4
        lo, maps, c_int = self._score_lo_buffer(), self._score_maps(), ctypes.c_int
        for a in range(0, n, self.chunk):
            part = list(token_ids[a : a + self.chunk])
            self.prefill(part)  # (x: every row's hidden state, whichever pass ran it)
            m = len(part)
            rt.launch(kernels["rmsnorm_rows_split"], m, 256,
                      [self.x, self.final_norm, c_int(cfg.hidden_size),
                       ctypes.c_float(cfg.rms_norm_eps), self.xn, lo], stream=self.stream)
            out = rt.Ptr(logits.ptr + a * row_bytes)
            if maps is not None:  # the engine's Hopper GEMM takes bf16 weights: it runs them
                for kind, map_a in zip(("store", "add"), maps[:2], strict=True):
                    self._gemm90(kind, map_a, maps[2], self.lm_head, out, m, cfg.vocab_size,
                                 cfg.hidden_size, ldc=cfg.vocab_size)
                continue
            grid = (math.ceil(cfg.vocab_size / GEMM_TILE), math.ceil(m / GEMM_TILE))
            for kernel, a_rows in (("gemm_store", self.xn), ("gemm_add", lo)):
                rt.launch(kernels[kernel], grid, 256,
                          [a_rows, self.lm_head, out, c_int(m), c_int(cfg.vocab_size),
                           c_int(cfg.hidden_size), c_int(cfg.vocab_size)],
                          shared=gemm_shared_bytes("bf16"), stream=self.stream)
        self.stream.synchronize()  # (another engine's stream may read them: a live base)
        return DeviceRows(logits.ptr, n, cfg.vocab_size)

    def decode_rows(self, token_ids: Sequence[int]) -> np.ndarray:
        """eval --path decode: each of `token_ids` in turn through the engine's own decode step
        (the megakernel, one step a launch, or the per-op graph), after what the cache holds,
        the id fed from the host instead of the one the step chose (teacher-forced); the
        logits after each, as rows (ids x vocabulary, float32). A step's numerics do not
        depend on how many steps a launch runs, so these are the logits a reply decodes with."""
        self._check_prefill(token_ids, self.config.vocab_size)
        self.device.make_current()
        self._adopt_megakernel()
        request = GenerateRequest(LiveParams(SamplingParams(temperature=0.0)), frozenset(),
                                  seed=0)
        self._reset_sampling_state()
        self._request = request
        mega = self.decode == "megakernel"
        if mega:
            self._megakernel_begin(request)
        else:
            self._set_params(request.params.current, request.seed, 0)
        out = np.empty((len(token_ids), self.config.vocab_size), np.float32)
        try:
            for i, token in enumerate(token_ids):
                self._feed_next(token, self.position)
                if mega:  # (a launch from step 1 on feeds the token in self.token)
                    self._launch_megakernel(1, i + 1)
                else:
                    self._decode_graph(self.position + 1).launch(self.stream)
                self.logits.download(out[i], stream=self.stream)
                self.stream.synchronize()
                self._tokens.append(int(token))
        finally:
            if mega:
                self._megakernel_end()
        self._logits_valid = True  # (the last id's: a reply may follow, as after prefill)
        return out

    def score_rows(self, rows: DeviceRows, first: int, targets: np.ndarray,
                   base: DeviceRows | None = None) -> np.ndarray:
        """score.cu's eight numbers for rows first.. (one a target), as (n, 8) float64."""
        n = len(targets)
        if first < 0 or first + n > rows.rows or (base is not None and base.rows < first + n):
            raise ValueError(f"rows {first}..{first + n} of a window of {rows.rows}")
        if base is not None and base.vocab != rows.vocab:
            raise ValueError("a base with another vocabulary")
        self.device.make_current()
        ids, out = self._score_scratch(n, 1)
        ids.upload(np.ascontiguousarray(targets, np.int32), stream=self.stream)
        rt.launch(self._scoring_kernels()["score_rows"], n, SCORE_THREADS,
                  [rt.Ptr(rows.row(first)), rt.Ptr(base.row(first) if base else 0),
                   ctypes.c_longlong(rows.vocab), ctypes.c_int(rows.vocab), ids,
                   out], stream=self.stream)
        result = np.empty((n, SCORE_FIELDS), np.float64)
        out.download(result, stream=self.stream)
        self.stream.synchronize()
        return result

    def gather_rows(self, rows: DeviceRows, first: int, ids: np.ndarray) -> np.ndarray:
        """Our logits at `ids` (n x k) for rows first.., as float32."""
        n, k = ids.shape
        self.device.make_current()
        ids_buffer, out = self._score_scratch(n, k)
        ids_buffer.upload(np.ascontiguousarray(ids, np.int32), stream=self.stream)
        rt.launch(self._scoring_kernels()["gather_logits"], n, 256,
                  [rt.Ptr(rows.row(first)), ctypes.c_longlong(rows.vocab), ids_buffer,
                   ctypes.c_int(k), out], stream=self.stream)
        result = np.empty((n, k), np.float32)
        out.download(result, stream=self.stream)
        self.stream.synchronize()
        return result

    def download_rows(self, rows: DeviceRows, first: int, n: int) -> np.ndarray:
        """Rows first.. of the window to the host (a base on the CPU, a top-k to save)."""
        self.device.make_current()
        out = np.empty((n, rows.vocab), np.float32)
        self._score_logits.download(out, offset=(rows.row(first) - self._score_logits.ptr),
                                    stream=self.stream)
        self.stream.synchronize()
        return out

    # ----------------------------------------------------------------------------- set-up
    def _scoring_kernels(self) -> dict[str, rt.Kernel]:
        """score.cu and, where the Hopper GEMM does not take the LM head, gemm.cu built for
        bf16, compiled on first use (once per model and GPU: the kernel cache keeps them)."""
        if self._score_kernels is None:
            arch = self.device.arch
            builds = [KernelBuild.of("score.cu", arch, {})]
            if self._score_maps() is None:
                builds.append(KernelBuild.of("gemm.cu", arch, kernel_defines(self.config, "bf16")))
            compilation = KernelCache().start(builds, announce=self.notice)
            kernels = {}
            for build, cubin in compilation.wait().items():
                module = rt.Module(cubin)
                self._modules.append(module)
                names = SCORE_KERNELS if build.source == "score.cu" else ("gemm_store", "gemm_add")
                for name in names:
                    kernels[name] = module.function(name)
            for name in ("gemm_store", "gemm_add"):
                if name in kernels:
                    kernels[name].set_max_dynamic_shared(gemm_shared_bytes("bf16"))
            self._score_kernels = kernels
        return self._score_kernels

    def _score_maps(self) -> tuple[rt.TensorMap, rt.TensorMap, rt.TensorMap] | None:
        """The tensor maps of the LM head's products on gemm_sm90.cu (the two parts of the
        normed rows, the LM head), where the engine runs that GEMM on bf16 weights (bf16 and
        int4 layers: int4 ones reach it as bf16 slices); else None (gemm.cu, built for bf16)."""
        if not (self.score_on_hopper_gemm and self.gemm90) or self.weight_format == "fp8":
            return None
        if self._score_tensor_maps is None:
            cfg, rows = self.config, self.chunk
            self._score_tensor_maps = (
                rt.tile_map(self.xn.ptr, rows, cfg.hidden_size, GEMM90_BOX, 64),
                rt.tile_map(self._score_lo_buffer().ptr, rows, cfg.hidden_size, GEMM90_BOX, 64),
                rt.tile_map(self.lm_head.ptr, cfg.vocab_size, cfg.hidden_size, GEMM90_BOX, 64))
        return self._score_tensor_maps

    def _score_lo_buffer(self) -> rt.DeviceBuffer:
        """The normed rows' second bf16 part, a chunk's rows (xn holds the first)."""
        if self._score_lo is None:
            self._score_lo = self._device_buffer(self.chunk * self.config.hidden_size * 2)
        return self._score_lo

    def _score_rows_buffer(self, n: int) -> rt.DeviceBuffer:
        nbytes = n * self.config.vocab_size * 4
        if self._score_logits is None or self._score_logits.nbytes < nbytes:
            free, _ = self.device.mem_info()
            held = 0 if self._score_logits is None else self._score_logits.nbytes
            check_window_memory(n, nbytes, free + held)
            self._score_logits = self._regrown(self._score_logits, nbytes)
        return self._score_logits

    def _score_scratch(self, n: int, k: int) -> tuple[rt.DeviceBuffer, rt.DeviceBuffer]:
        """(ids: n x k int32, out: n x max(k, 2 SCORE_FIELDS) floats), grown as needed."""
        ids, out = self._score_small or (None, None)
        ids = self._regrown(ids, max(n * k * 4, 4096))
        out = self._regrown(out, max(n * max(k * 4, SCORE_FIELDS * 8), 4096))
        self._score_small = (ids, out)
        return ids, out

    def _regrown(self, buffer: rt.DeviceBuffer | None, nbytes: int) -> rt.DeviceBuffer:
        """`buffer` where it holds `nbytes`, else a new one in its place (the old freed)."""
        if buffer is not None and buffer.nbytes >= nbytes:
            return buffer
        if buffer is not None:
            self._buffers.remove(buffer)
            buffer.free()
        return self._device_buffer(nbytes)

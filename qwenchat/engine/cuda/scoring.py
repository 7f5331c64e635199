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
from qwenchat.engine.cuda.prefill import GEMM90_BOX, GEMM90_BOX_K, GEMM_TILE, gemm_shared_bytes
from qwenchat.engine.cuda.verify import VERIFY_ROWS
from qwenchat.errors import QwenchatError
from qwenchat.sampling.params import LiveParams, SamplingParams

# score.cu's kernels (eval's only: built on first use)
SCORE_KERNELS = ("rmsnorm_rows_split", "score_rows", "gather_logits")
SCORE_FIELDS = 8  # score.cu's out: a row's eight doubles
SCORE_THREADS = 512
# Window graphs kept at once (eval's windows need one, a shorter last window and a long
# window's chunks a few more)
WINDOW_GRAPHS = 8


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
    # A window's passes as replayed graphs (_window_graph); False: launched one by one
    score_in_graphs = True
    _score_kernels: dict[str, rt.Kernel] | None = None
    _score_logits: rt.DeviceBuffer | None = None
    _score_parts_buffer: rt.DeviceBuffer | None = None
    _score_tensor_maps: tuple[rt.TensorMap, rt.TensorMap] | None = None
    _score_small: tuple[rt.DeviceBuffer, rt.DeviceBuffer] | None = None

    def prepare_scoring(self) -> None:
        """Compile (or load) the scoring kernels now, not in the first window's time."""
        self.device.make_current()
        self._scoring_kernels()

    def window_rows(self, token_ids: Sequence[int]) -> DeviceRows:
        """Prefill `token_ids` after whatever the cache holds, keeping every position's logits
        on the device. The engine is left with no next-token logits (a window's last row is
        not computed again as decoding would: prefill what follows to go on)."""
        n = len(token_ids)
        if n == 0:
            raise ValueError("window_rows needs at least one token")
        self.device.make_current()
        self._scoring_kernels()
        logits = self._score_rows_buffer(n)
        row_bytes = self.config.vocab_size * 4
        for a in range(0, n, self.chunk):
            part = list(token_ids[a : a + self.chunk])
            out = rt.Ptr(logits.ptr + a * row_bytes)
            if not self._window_graph(part, out):
                self.prefill(part)  # (x: every row's hidden state, whichever pass ran it)
                self._window_products(len(part), out)
        self.stream.synchronize()  # (another engine's stream may read them: a live base)
        self._logits_valid = False
        return DeviceRows(logits.ptr, n, self.config.vocab_size)

    def _window_products(self, m: int, out: rt.Ptr) -> None:
        """The logits of the m rows in x, to `out` (m rows, vocabulary floats apart)."""
        cfg, c_int, h = self.config, ctypes.c_int, self.config.hidden_size
        kernels, parts, maps = self._scoring_kernels(), self._score_parts(), self._score_maps()
        if maps is not None:  # the engine's Hopper GEMM takes bf16 weights: it runs them, as
            # one product of twice the depth over each row's two parts side by side ([hi | lo]
            # . [W | W]^T: the LM head's columns walked twice), stored once
            rt.launch(kernels["rmsnorm_rows_split"], m, 256,
                      [self.x, self.final_norm, c_int(h), ctypes.c_float(cfg.rms_norm_eps),
                       parts, rt.Ptr(parts.ptr + h * 2), c_int(2 * h)], stream=self.stream)
            self._gemm90("store", maps[0], maps[1], self.lm_head, out, m, cfg.vocab_size, 2 * h,
                         ldc=cfg.vocab_size, b_depth=h)
            return
        rt.launch(kernels["rmsnorm_rows_split"], m, 256,
                  [self.x, self.final_norm, c_int(h), ctypes.c_float(cfg.rms_norm_eps),
                   self.xn, parts, c_int(h)], stream=self.stream)
        grid = (math.ceil(cfg.vocab_size / GEMM_TILE), math.ceil(m / GEMM_TILE))
        for kernel, a_rows in (("gemm_store", self.xn), ("gemm_add", parts)):
            rt.launch(kernels[kernel], grid, 256,
                      [a_rows, self.lm_head, out, c_int(m), c_int(cfg.vocab_size),
                       c_int(h), c_int(cfg.vocab_size)],
                      shared=gemm_shared_bytes("bf16"), stream=self.stream)

    def _window_graph(self, part: list[int], out: rt.Ptr) -> bool:
        """A part that prefill would run kernel by kernel (_forward_prefill: more tokens than
        its short graphs and the verify pass take), run with its products as one graph
        launch, and True; False for any other part. eval's windows repeat the same length
        at the same position (0, after truncate), so a graph is captured once per (position,
        length, destination) and replayed: on the 0.6B shape a window's ~230 launches took
        more host time than the GPU took to run them (docs/perf.md). The same kernels with the
        same arguments run, so the rows are the ones prefill + _window_products give (less
        prefill's last-row logits, which window_rows does not keep)."""
        start, m = self.position, len(part)
        if (not self.score_in_graphs or m <= VERIFY_ROWS
                or self.short_prompt_rows(start, m) is not None):
            return False
        self._check_prefill(part, self.config.vocab_size)
        self.ids.upload(np.asarray(part, np.int32), stream=self.stream)
        key = (start, m, self.prefill_attention, out.address)
        graph = self._window_graphs.get(key)
        if graph is None:
            if len(self._window_graphs) >= WINDOW_GRAPHS:
                self._close_window_graphs()
            with rt.Graph.capture(self.stream) as graph:
                self._forward_prefill(start, m)
                self._window_products(m, out)
            self._window_graphs[key] = graph
        graph.launch(self.stream)
        self._tokens.extend(part)
        return True

    def _close_window_graphs(self) -> None:
        rt.close_graphs(getattr(self, "_window_graphs", {}))  # (none if set-up stopped first)

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
            self._score_parts()  # (before any window graph captures a use of it)
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

    def _score_maps(self) -> tuple[rt.TensorMap, rt.TensorMap] | None:
        """The tensor maps of the LM head's product on gemm_sm90.cu (the normed rows' two parts
        side by side, the LM head), where the engine runs that GEMM on bf16 weights (bf16 and
        int4 layers: int4 ones reach it as bf16 slices) and its K steps divide the hidden size;
        else None (gemm.cu, built for bf16, two products)."""
        h = self.config.hidden_size
        if (not (self.score_on_hopper_gemm and self.gemm90) or self.weight_format == "fp8"
                or h % GEMM90_BOX_K):
            return None
        if self._score_tensor_maps is None:
            self._score_tensor_maps = (
                rt.tile_map(self._score_parts().ptr, self.chunk, 2 * h, GEMM90_BOX, GEMM90_BOX_K),
                rt.tile_map(self.lm_head.ptr, self.config.vocab_size, h, GEMM90_BOX,
                            GEMM90_BOX_K))
        return self._score_tensor_maps

    def _score_parts(self) -> rt.DeviceBuffer:
        """A chunk's normed rows' parts: [hi | lo] a row (the Hopper GEMM's), or lo alone
        (gemm.cu's: hi in xn)."""
        if self._score_parts_buffer is None:
            self._score_parts_buffer = self._device_buffer(self.chunk * self.config.hidden_size * 4)
        return self._score_parts_buffer

    def _score_rows_buffer(self, n: int) -> rt.DeviceBuffer:
        nbytes = n * self.config.vocab_size * 4
        if self._score_logits is None or self._score_logits.nbytes < nbytes:
            free, _ = self.device.mem_info()
            held = 0 if self._score_logits is None else self._score_logits.nbytes
            check_window_memory(n, nbytes, free + held)
            self._close_window_graphs()  # (they write to the old buffer)
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

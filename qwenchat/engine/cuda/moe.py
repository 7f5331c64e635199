"""A mixture of experts' layers on the per-op path (cuda_src/moe.cu): the router and the chosen
experts for one token (the layered decode) and for a pass's tokens (prefill and the speculative
pass), grouped by expert on the device: no host round trip in either. A pass of a few tokens (a
speculative pass) reads each chosen expert once for its tokens on verify.cuh's product. The
megakernel routes its own (megakernel.cu) where every layer is sparse; elsewhere these models
decode here."""

from __future__ import annotations

import ctypes
import math

import numpy as np

from qwenchat.engine.cuda import runtime as rt
from qwenchat.engine.cuda.builds import moe90_runs
from qwenchat.engine.cuda.prefill import (
    GEMM90_BOX,
    GEMM90_BOX_K,
    GEMM90_SHARED,
    GEMM90_THREADS,
    gemm_shared_bytes,
)
from qwenchat.engine.cuda.verify import VERIFY_ROWS, VERIFY_THREADS, VERIFY_TILE
from qwenchat.engine.cuda.weights import LayerBuffers
from qwenchat.model.config import Qwen3Config
from qwenchat.model.formats import FORMATS, FP8

GROUP_ROWS = 128  # rows of a grouped product's tile (gemm.cuh's BM, moe_sm90.cu's)
MOE90_COLUMNS = (128, 256)  # moe_sm90.cu's columns a block: SwiGLU's features, down's outputs
GEMV_ROWS_PER_BLOCK = 16  # moe_gate_up: 8 warps x 2 rows (rmsnorm_gemv<2>)
ROUTER_ROWS_PER_BLOCK = 8  # the router's logits for one token: moe_router, a row a warp
DOWN_ROWS_PER_BLOCK = 8  # moe_down: a row a warp


DOWN_PARTS = (1, 2, 4, 8)  # the parts of the hidden columns a pass's down products may take


def down_part_counts(hidden: int) -> list[int]:
    """The counts of parts the hidden columns may be cut into for the down products: each part
    a multiple of 8 columns (moe_combine's 16-byte loads), 8 parts at most."""
    return [p for p in DOWN_PARTS if hidden % (8 * p) == 0]


def moe_down_parts(cfg: Qwen3Config, floor: int) -> int:
    """The parts of the hidden columns a chunk's down products and weighted sums take in turn
    (each part's bf16 rows staged, then summed into x, before the next): the fewest for which a
    token's k down rows (32 KB on 30B-A3B) take no more of the staging than `floor`, what its
    other tenants take a token anyway (the attention's rows; off Hopper the fp32 gate/up
    rows); the most there may be (down_part_counts) where none does."""
    k, h = cfg.num_experts_per_tok, cfg.hidden_size
    fitting = down_part_counts(h)
    return next((p for p in fitting if k * h * 2 // p <= floor), fitting[-1])


def moe_stage_bytes(cfg: Qwen3Config, moe90: bool, attention: int) -> int:
    """A token's staging in a pass: its attention's `attention` bytes of rows (qkv and q, dead
    by the sparse MLP), then per routed pair its fp32 gate/up outputs (moe_gemm; moe_sm90.cu
    applies SwiGLU in the product), then (the same bytes) its bf16 down outputs, one part of
    the columns at a time (moe_down_parts). (Its input row is read where it lies: the gate/up
    product gathers it.)"""
    k, h, inter = cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    floor = max(attention, 0 if moe90 else k * 2 * inter * 4)
    return max(floor, k * h * 2 // moe_down_parts(cfg, floor))


class MoeLayers:
    """CudaEngine's sparse layers. Uses the engine's config, weight_format, kernels, stream
    and buffers (x, xn)."""

    # A pass of at most this many tokens takes its experts on moe.cu's moe_few_* products
    # (verify.cuh's, at most VERIFY_ROWS tokens); 0 sends every pass to the grouped GEMMs.
    moe_few_rows = VERIFY_ROWS

    def _staging_bytes_per_token(self, attention: int) -> int:
        """The scratch a pass's token takes for its `attention` bytes (its qkv and q rows) and
        in a sparse layer (prefill sizes its chunks with it): its router logits, its top-k
        weights and experts, and per routed pair its places in the grouping and its SwiGLU row
        (which the attention's output row shares: dead by then too), and its staging
        (moe_stage_bytes)."""
        cfg = self.config
        if not cfg.is_moe:
            return attention
        k, inter = cfg.num_experts_per_tok, cfg.moe_intermediate_size
        moe90 = moe90_runs(cfg, self.weight_format, self.gemm90)
        return (cfg.num_experts * 4 + k * (8 + 8 + 16) + max(k * inter * 2, cfg.q_size * 2)
                + moe_stage_bytes(cfg, moe90, attention))

    def _allocate_moe(self, tokens: int, attention: int) -> None:
        """Scratch for `tokens` tokens a pass (and one token's decode, which reuses it), whose
        staging also holds each token's `attention` bytes of rows (qkv and q: engine.py puts
        them there), and the attention's output rows (in moe_act)."""
        cfg = self.config
        inter, k, e = cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.num_experts
        pairs = tokens * k
        moe90 = moe90_runs(cfg, self.weight_format, self.gemm90)
        self.moe_logits = self._device_buffer(tokens * e * 4)
        self.moe_weights = self._device_buffer(pairs * 4)
        self.moe_ids = self._device_buffer(pairs * 4)
        self.moe_counts = self._device_buffer(e * 4)
        self.moe_slot = self._device_buffer(pairs * 4)
        self.moe_token = self._device_buffer(pairs * 4)
        self.moe_tiles = self._device_buffer(self._moe_most_tiles(tokens) * 16)
        self.moe_n_tiles = self._device_buffer(4)
        # The fp32 gate/up outputs (moe_gu) are dead once SwiGLU has read them, which is
        # before the down products write theirs (moe_y, bf16 as transformers' experts give
        # them, a part of the columns at a time): one staging buffer holds both, and before
        # them a layer's qkv and q rows (engine.py: dead once attention has run).
        # (And a few-token pass's fp32 gate/up rows and, after them, its bf16 down rows, which
        # moe_few_down writes while it reads the gate/up rows: _moe_few.)
        few_gu = VERIFY_ROWS * k * 2 * inter * 4
        self.moe_stage_size = max(tokens * moe_stage_bytes(cfg, moe90, attention),
                                  few_gu + VERIFY_ROWS * k * cfg.hidden_size * 2)
        self.moe_stage = self._device_buffer(self.moe_stage_size)
        self.moe_gu = rt.Ptr(self.moe_stage.ptr)
        self.moe_y = rt.Ptr(self.moe_stage.ptr)
        self.moe_few_y = rt.Ptr(self.moe_stage.ptr + few_gu)
        self.moe_read = self._device_buffer(8)  # experts a few-token pass read: experts_read
        self.moe_read.fill_u8(0)
        self.moe_act = self._device_buffer(tokens * max(k * inter, cfg.q_size) * 2)

    def _moe_pass_parts(self, n: int) -> int:
        """The parts of the columns a pass of n tokens takes its down products in: the fewest
        whose bf16 rows fit the staging (a chunk's moe_down_parts; one for a few tokens)."""
        cfg = self.config
        k, h = cfg.num_experts_per_tok, cfg.hidden_size
        return next(p for p in down_part_counts(h) if n * k * h * 2 // p <= self.moe_stage_size)

    def _moe_most_tiles(self, tokens: int) -> int:
        """The grouped products' tiles for `tokens` tokens at most: a partial tile an expert."""
        cfg = self.config
        return math.ceil(tokens * cfg.num_experts_per_tok / GROUP_ROWS) + cfg.num_experts

    def _moe_expert_bytes(self) -> tuple[int, int]:
        """An expert's gate/up rows and down rows, in bytes of the model's format."""
        cfg, fmt = self.config, FORMATS[self.weight_format]
        inter = cfg.moe_intermediate_size
        return 2 * inter * fmt.row_bytes(cfg.hidden_size), cfg.hidden_size * fmt.row_bytes(inter)

    def _moe_decode(self, w: LayerBuffers) -> None:
        """x += the sparse MLP of one token (x, float): the router's logits (RMSNorm fused),
        its top-k, the chosen experts' gate/up rows, and their down rows summed with their
        weights in rank order."""
        cfg, c_int = self.config, ctypes.c_int
        eps = ctypes.c_float(cfg.rms_norm_eps)
        h, inter, k, e = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok,
                          cfg.num_experts)
        self._launch("moe_router", math.ceil(e / ROUTER_ROWS_PER_BLOCK), 256, self.x,
                     w.post_norm, w.router, eps, self.moe_logits)
        self._launch("moe_route", 1, 32, self.moe_logits, c_int(1), self.moe_weights,
                     self.moe_ids)
        self._launch("moe_gate_up", (math.ceil(2 * inter / GEMV_ROWS_PER_BLOCK), k), 256, self.x,
                     w.post_norm, w.experts_gate_up, self.moe_ids, eps, self.moe_gu)
        self._launch("moe_down", math.ceil(h / DOWN_ROWS_PER_BLOCK), 256, self.moe_gu,
                     w.experts_down, self.moe_ids, self.moe_weights, self.x)

    def _build_moe_maps(self) -> None:
        """moe_sm90.cu's tensor maps of each sparse layer's experts (every expert's rows as one
        matrix), where it runs: Hopper, bf16 and FP8 experts (FP8: their codes)."""
        cfg = self.config
        self.moe90 = moe90_runs(cfg, self.weight_format, self.gemm90)
        if not self.moe90:
            return
        h, inter, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts

        def experts(buffer, rows: int, cols: int) -> rt.TensorMap:
            if self.weight_format == "fp8":  # the codes of each packed row (weights.cuh)
                return rt.tile_map(buffer.ptr, rows, cols, GEMM90_BOX, GEMM90_BOX_K, codes=True,
                                   row_bytes=FP8.row_bytes(cols))
            return rt.tile_map(buffer.ptr, rows, cols, GEMM90_BOX, GEMM90_BOX_K)

        self.moe90_maps = [
            None if w.experts_gate_up is None else
            (experts(w.experts_gate_up, e * 2 * inter, h), experts(w.experts_down, e * h, inter),
             rt.tile_map(w.router.ptr, e, h, GEMM90_BOX, GEMM90_BOX_K))
            for w in self.layers]

    def _moe_gate_up(self, layer: int, w: LayerBuffers, n: int) -> None:
        """moe_act = SwiGLU of the pairs' gate/up products (grouped order, the tiles moe_place
        listed): on Hopper moe_sm90.cu, SwiGLU in the product; elsewhere moe.cu's moe_gemm,
        then moe_swiglu."""
        cfg, c_int = self.config, ctypes.c_int
        h, inter = cfg.hidden_size, cfg.moe_intermediate_size
        tiles = self._moe_most_tiles(n)
        if self.moe90:
            map_gate_up = self.moe90_maps[layer][0]
            self._launch("moe90_gate_up", (math.ceil(inter / MOE90_COLUMNS[0]), tiles),
                         GEMM90_THREADS, self.xn, self.moe_token, map_gate_up, w.experts_gate_up,
                         c_int(cfg.num_experts * 2 * inter), self.moe_act, self.moe_tiles,
                         self.moe_n_tiles, c_int(inter), c_int(h), shared=GEMM90_SHARED)
            return
        gate_up_bytes, _ = self._moe_expert_bytes()
        self._launch("moe_gemm", (math.ceil(2 * inter / GROUP_ROWS), tiles), 256, self.xn,
                     self.moe_token, w.experts_gate_up, ctypes.c_longlong(gate_up_bytes),
                     self.moe_gu, self.moe_tiles, self.moe_n_tiles, c_int(2 * inter), c_int(h),
                     shared=gemm_shared_bytes(self.weight_format))
        pairs = n * cfg.num_experts_per_tok
        self._launch("moe_swiglu", min(4096, math.ceil(pairs * inter / 256)), 256, self.moe_gu,
                     c_int(pairs), self.moe_act)

    def _moe_down(self, layer: int, w: LayerBuffers, n: int, col0: int, width: int) -> None:
        """moe_y (bf16, `width` a pair) = the pairs' down products of the hidden columns col0 ..
        col0 + width (grouped order): moe_sm90.cu on Hopper, moe_gemm elsewhere (from the
        part's first row of each expert's down rows)."""
        cfg, c_int = self.config, ctypes.c_int
        h, inter = cfg.hidden_size, cfg.moe_intermediate_size
        tiles = self._moe_most_tiles(n)
        if self.moe90:
            self._launch("moe90_down", (math.ceil(width / MOE90_COLUMNS[1]), tiles),
                         GEMM90_THREADS, self.moe_act, self.moe90_maps[layer][1], w.experts_down,
                         c_int(cfg.num_experts * h), self.moe_y, self.moe_tiles,
                         self.moe_n_tiles, c_int(h), c_int(inter), c_int(col0), c_int(width),
                         shared=GEMM90_SHARED)
            return
        _, down_bytes = self._moe_expert_bytes()
        row_bytes = FORMATS[self.weight_format].row_bytes(inter)
        self._launch("moe_gemm", (math.ceil(width / GROUP_ROWS), tiles), 256, self.moe_act,
                     rt.Ptr(0), rt.Ptr(w.experts_down.ptr + col0 * row_bytes),
                     ctypes.c_longlong(down_bytes), self.moe_y, self.moe_tiles,
                     self.moe_n_tiles, c_int(width), c_int(inter),
                     shared=gemm_shared_bytes(self.weight_format))

    def _moe_router_logits(self, layer: int, w: LayerBuffers, n: int) -> None:
        """moe_logits = xn . router^T (fp32): on Hopper gemm_sm90.cu's product, its K split
        where the experts' few columns leave SMs idle (a 4,096-token chunk of 30B-A3B: 32
        tiles on 132 SMs); elsewhere moe.cu's moe_router_gemm."""
        cfg, c_int = self.config, ctypes.c_int
        h, e = cfg.hidden_size, cfg.num_experts
        if self.moe90 and self.weight_format == "bf16":  # (gemm_sm90.cu's B: bf16 there)
            map_a, map_router = self.gemm90_maps_a["xn"], self.moe90_maps[layer][2]
            if not self._gemm90_split("store", map_a, map_router, w.router, self.moe_logits, n,
                                      e, h, 0, e):
                self._gemm90("store", map_a, map_router, w.router, self.moe_logits, n, e, h)
            return
        self._launch("moe_router_gemm", (math.ceil(e / GROUP_ROWS), math.ceil(n / GROUP_ROWS)),
                     256, self.xn, w.router, self.moe_logits, c_int(n), c_int(e), c_int(h),
                     shared=gemm_shared_bytes("bf16"))

    def _moe_pass(self, layer: int, w: LayerBuffers, n: int, parts: int | None = None,
                  after: rt.DeviceBuffer | None = None) -> None:
        """x += the sparse MLP of n tokens (x after attention; with `parts` set, a speculative
        pass's, whose o_proj left the norm's input in pass_xg and pass_sq, `parts` sums of
        squares a token: verify.cuh's PassNorm; with `after`, the next norm's weights, the
        pass's input to that norm left there too, one sum a token): the post-attention
        RMSNorm, the router's logits on the tensor cores, the top-k, the tokens' rows grouped
        by expert (moe_count, moe_place: the order of the tokens kept within an expert, so a
        run's layout is always the same), each expert's rows through its gate/up and down
        products (tiles listed on the device, the grid sized for the most there can be), and
        each token's experts summed back with their weights in rank order (a part of the
        columns at a time where a chunk's bf16 down rows would not fit the staging whole). A
        pass of at most moe_few_rows tokens takes _moe_few instead."""
        cfg, c_int = self.config, ctypes.c_int
        if n <= self.moe_few_rows:
            if parts is None:
                parts = self._pass_norm_rows(n, w.post_norm)
            self._moe_few(w, n, parts, after)
            return
        self._launch("rmsnorm_rows", n, 256, self.x, w.post_norm, c_int(n),
                     ctypes.c_float(cfg.rms_norm_eps), self.xn)
        k, e = cfg.num_experts_per_tok, cfg.num_experts
        pairs = n * k
        self._moe_router_logits(layer, w, n)
        self._launch("moe_route", math.ceil(n * 32 / 256), 256, self.moe_logits, c_int(n),
                     self.moe_weights, self.moe_ids)
        self._launch("moe_count", e, 1024, self.moe_ids, c_int(pairs), self.moe_counts)
        self._launch("moe_place", e, 1024, self.moe_ids, c_int(pairs), self.moe_counts,
                     self.moe_slot, self.moe_token, self.moe_tiles, self.moe_n_tiles)
        self._moe_gate_up(layer, w, n)
        parts = self._moe_pass_parts(n)
        width = cfg.hidden_size // parts
        for col0 in range(0, cfg.hidden_size, width):
            self._moe_down(layer, w, n, col0, width)
            self._launch("moe_combine", n, 256, self.moe_y, self.moe_slot, self.moe_weights,
                         c_int(n), self.x, c_int(col0), c_int(width), *[rt.Ptr(0)] * 3)
        if after is not None:
            self._pass_norm_rows(n, after)

    def _moe_few(self, w: LayerBuffers, n: int, parts: int,
                 after: rt.DeviceBuffer | None = None) -> None:
        """x += the sparse MLP of a pass of n <= VERIFY_ROWS tokens (their normed rows in
        pass_xg and pass_sq, `parts` sums a token) in five launches (moe.cu): the router's
        logits and the routing and grouping in one block (moe_few_router, moe_few_route),
        each chosen expert's gate/up and down rows read once
        for its pairs (moe_few_gate_up, moe_few_down: 16 rows of one expert a block, SwiGLU
        applied as down reads its input), and each token's experts summed back in rank order
        (moe_combine; with `after`, the next norm's weights, writing that norm's input too).
        An expert's pairs are one tile (a token routes to it once), so there are at most as
        many tiles as pairs or experts."""
        cfg, c_int = self.config, ctypes.c_int
        h, inter, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        tiles = min(n * cfg.num_experts_per_tok, e)
        norm = (self.pass_sq, c_int(parts), ctypes.c_float(cfg.rms_norm_eps))
        self._launch("moe_few_router", math.ceil(e / VERIFY_TILE), VERIFY_THREADS, self.pass_xg,
                     c_int(n), w.router, self.moe_logits, *norm)
        self._launch("moe_few_route", 1, VERIFY_THREADS, self.moe_logits, c_int(n),
                     self.moe_weights, self.moe_ids, self.moe_counts, self.moe_slot,
                     self.moe_token, self.moe_tiles, self.moe_n_tiles, self.moe_read)
        self._launch("moe_few_gate_up", (math.ceil(2 * inter / VERIFY_TILE), tiles),
                     VERIFY_THREADS, self.pass_xg, self.moe_token, w.experts_gate_up,
                     self.moe_gu, self.moe_tiles, self.moe_n_tiles, *norm)
        self._launch("moe_few_down", (math.ceil(h / VERIFY_TILE), tiles), VERIFY_THREADS,
                     self.moe_gu, w.experts_down, self.moe_few_y, self.moe_tiles,
                     self.moe_n_tiles)
        next_norm = ((after, self.pass_xg, self.pass_sq) if after is not None
                     else (rt.Ptr(0),) * 3)
        self._launch("moe_combine", n, 256, self.moe_few_y, self.moe_slot, self.moe_weights,
                     c_int(n), self.x, c_int(0), c_int(h), *next_norm)

    def experts_read(self) -> int | None:
        """The experts that passes of a few tokens (speculative passes, short prompts' parts)
        have read since the engine started, each chosen expert counted once a layer a pass
        (bench: what a pass reads); None for a dense model."""
        if not self.config.is_moe:
            return None
        self.stream.synchronize()
        count = np.zeros(1, np.uint64)
        self.moe_read.download(count)
        return int(count[0])

    def _moe_shared(self) -> None:
        """The grouped products' dynamic shared memory (gemm.cuh), past the 48 KB default."""
        if "moe_gemm" not in self.k:
            return
        self.k["moe_gemm"].set_max_dynamic_shared(gemm_shared_bytes(self.weight_format))
        self.k["moe_router_gemm"].set_max_dynamic_shared(gemm_shared_bytes("bf16"))

"""Prefill: the new tokens through every layer as batched tensor-core GEMMs and flash
attention (gemm.cu, attention.cu, layers.cu; on Hopper gemm_sm90.cu, gemm_fp8_sm90.cu for FP8
weights, and attention_sm90.cu), in chunks that bound the scratch memory."""

from __future__ import annotations

import ctypes
import math

import numpy as np

from qwenchat.engine.cuda import runtime as rt
from qwenchat.model import rope
from qwenchat.model.config import Qwen3Config
from qwenchat.model.formats import FP8, INT4

GEMM_TILE = 128
ROPE_WARPS = 8  # layers.cu's qk_norm_rope_store: a warp a token's head, 8 warps a block
PREFILL_QUERIES_PER_BLOCK = 64
PREFILL_MAX_KEY_SPLITS = 16  # a few new tokens' attention split over the cached keys
PREFILL_MIN_SPLIT_KEYS = 256  # keys per split at least: fewer is not worth a merge
PREFILL_SCRATCH_BUDGET = 160 * 2**20
# A mixture of experts' prefill reads every expert again for each chunk (1.2 GB a layer on
# 30B-A3B in bf16), so longer chunks are worth more scratch: 4,096 tokens on 30B-A3B (bf16
# experts on Hopper; its down products a quarter of the columns at a time, moe.py), its
# scratch in all within the 256 MB the dense sizes keep to.
MOE_PREFILL_SCRATCH_BUDGET = 212 * 2**20
PREFILL_LONGEST, MOE_PREFILL_LONGEST = 2048, 4096  # a chunk's tokens at most
GEMM90_SHARED = 193 * 1024  # gemm_sm90.cu's SHARED_BYTES: a 192 KiB ring aligned to 1 KiB
GEMM90_THREADS = 384  # a producer warpgroup and two consumers
GEMM90_BOX = 128  # rows of one TMA box, of A and of B
GEMM90_BOX_K = 64  # its K side: 64 bf16 (128 bytes), gemm_sm90.cu's K step (BK)
# What a 128-wide tile of columns costs against a 256-wide one of the same rows: 0.65 on the
# 8B shapes on an H100 (half the work at 574-512 against 746-758 TFLOP/s, docs/perf.md).
GEMM90_NARROW_COST = 0.65
# "hopper": gemm_sm90.cu and attention_sm90.cu (sm_90, bf16 weights); "portable": gemm.cu and
# attention.cu, the kernels of every other GPU; "auto": hopper wherever it can run.
PREFILL_KERNELS = ("auto", "hopper", "portable")
ATTENTION90_QUERIES = 128  # queries per block
# attention_sm90.cu's THREADS: two consumer warpgroups and a producer warpgroup (the TMA
# thread's, which gives its registers to the ping-pong consumers; for an int8 cache, four
# warps that turn its tiles into bf16).
ATTENTION90_THREADS = 3 * 128
# Short prompts (a chat's next message): a product of at most this many rows would cover few
# SMs with its tiles, so gemm_sm90.cu splits K too, each split's partial product into
# SPLIT_K_BYTES of scratch, summed in order by splitk_sum / splitk_swiglu.
SPLIT_K_MAX_ROWS = 64
SPLIT_K_BYTES = 24 * 2**20
SPLIT_K_MOST = 16
# A pass of at most SHORT_PROMPT_ROWS tokens (and more than the speculative pass takes) replays
# a CUDA graph instead of launching ~10 kernels a layer from Python (a few ms on a small
# model: the launches, not the GPU, set a chat turn's time), its rows rounded up to a multiple
# of SHORT_PROMPT_STEP so that a few graphs serve every turn; the first position is read from
# device memory.
SHORT_PROMPT_ROWS = 64
SHORT_PROMPT_STEP = 16
# gemm_fp8_sm90.cu: FP8 weights times e4m3 activations (a scale a token and 128 columns, made
# by quantize_rows_e4m3 or by the SwiGLU product's epilogue); its SHARED_BYTES are
# GEMM90_SHARED, its THREADS GEMM90_THREADS.
GEMM_FP8_KERNELS = ("gemm_fp8_store_128", "gemm_fp8_store_256", "gemm_fp8_add_128",
                    "gemm_fp8_add_256", "gemm_fp8_swiglu", "quantize_rows_e4m3")


def attention90_shared(head_dim: int) -> int:
    """attention_sm90.cu's dynamic shared memory (SHARED_BYTES): Q and three stages of a K and
    a V tile, each 128 rows of head_dim bf16 values, plus 1 KiB to align them."""
    return (head_dim // 64) * 128 * 128 * (1 + 3 * 2) + 1024


def gemm90_width(m: int, n: int, sms: int) -> int:
    """Columns per tile of gemm_sm90.cu for an m x n product: 256, unless 128-wide tiles
    would end in fewer waves over the SMs than what they cost more."""
    tiles_m = math.ceil(m / 128)

    def cost(width: int) -> float:
        waves = math.ceil(tiles_m * math.ceil(n / width) / sms)
        return waves * (1.0 if width == 256 else GEMM90_NARROW_COST)

    return min((256, 128), key=cost)


def split_k(m: int, n: int, k: int, sms: int, budget_floats: int = SPLIT_K_BYTES // 4) -> int:
    """How many runs of K gemm_sm90.cu's 128 x 128 tiles of an m x n x k product take (one
    block each): the count whose blocks' waves over the SMs times each block's 64-deep steps
    is least (the fewest of equals), with every run at least one step and the partial products
    within the scratch."""
    tiles, steps = math.ceil(m / 128) * math.ceil(n / 128), math.ceil(k / 64)
    best, best_cost = 1, math.ceil(tiles / sms) * steps
    for splits in range(2, min(SPLIT_K_MOST, steps) + 1):
        per = math.ceil(steps / splits)
        if math.ceil(steps / per) != splits or splits * m * n > budget_floats:
            continue
        cost = math.ceil(tiles * splits / sms) * per
        if cost < best_cost:
            best, best_cost = splits, cost
    return best


def attention_wave_chunk(most: int, heads: int, sm_count: int) -> int:
    """The prefill chunk (at most `most` tokens) for attention_sm90.cu. Deep in a long prompt
    every block of a chunk's attention (a head's 128 queries) walks about as many keys, so a
    chunk takes as long as its waves of blocks over the SMs: of the whole tiles from `most`
    down to half of it, the one that moves the most queries a wave (the larger of equals).
    8B's 32 heads: 1,856 tokens would be 15 tiles, 480 blocks, 4 waves of 132 SMs (464
    queries a wave); 1,536 are 384 blocks in 3 (512)."""
    def per_wave(chunk: int) -> float:
        return chunk / math.ceil(math.ceil(chunk / ATTENTION90_QUERIES) * heads / sm_count)
    if most < 2 * ATTENTION90_QUERIES:
        return most
    tiles = range(most // ATTENTION90_QUERIES * ATTENTION90_QUERIES, most // 2 - 1,
                  -ATTENTION90_QUERIES)
    return max([most, *tiles], key=lambda chunk: (per_wave(chunk), chunk))


def gemm_shared_bytes(weight_format: str) -> int:
    """gemm.cu's dynamic shared memory (SHARED_BYTES): 4 stages of 128 x 40 bf16 A and B
    tiles; for FP8 weights, 4 stages of A and of B's 128 x 32 codes plus one bf16 B tile."""
    stages, tile = 4, 128 * 40 * 2
    if weight_format == "fp8":
        return stages * tile + tile + stages * 128 * 32
    return stages * 2 * tile


DEQUANT_SLICE_BYTES = 64 * 2**20  # int4 weights dequantized for prefill: this much at a time


def dequant_slice_rows(cols: int) -> int:
    """Rows of `cols` bf16 columns that a slice of dequantized int4 weights holds (whole
    256-row tiles of the GEMMs)."""
    return max(256, DEQUANT_SLICE_BYTES // (2 * cols) // 256 * 256)


def gate_up_slice(cfg: Qwen3Config) -> int:
    """Features (gate and up rows each) a dequantized slice of gate/up holds: whole 128-row
    tiles of the SwiGLU GEMM."""
    return min(cfg.intermediate_size,
               max(128, DEQUANT_SLICE_BYTES // (4 * cfg.hidden_size) // 128 * 128))


def dequant_scratch_bytes(cfg: Qwen3Config, weight_format: str) -> int:
    """The bf16 matrix that int4 weights are dequantized into before the prefill's products,
    a slice of at most DEQUANT_SLICE_BYTES at a time, or 0 for other formats."""
    if weight_format != "int4":
        return 0
    h, q, inter = cfg.hidden_size, cfg.q_size, cfg.intermediate_size
    qkv_rows = q + 2 * cfg.kv_size
    return 2 * max(min(qkv_rows, dequant_slice_rows(h)) * h,
                   min(h, dequant_slice_rows(q)) * q,
                   min(h, dequant_slice_rows(inter)) * inter,
                   2 * gate_up_slice(cfg) * h)


def prefill_attention_shared(head_dim: int) -> int:
    """attn_prefill's dynamic shared memory: two stages of a K and a V tile (PF_KV keys of
    head_dim + 8 bf16 values each) in attention.cu."""
    keys = 64 if head_dim <= 128 else 32
    return 2 * 2 * keys * (head_dim + 8) * 2


def prefill_scratch_budget(cfg: Qwen3Config) -> int:
    """The scratch a prefill's chunk may take (its length follows from it)."""
    return MOE_PREFILL_SCRATCH_BUDGET if cfg.is_moe else PREFILL_SCRATCH_BUDGET


def dense_mlp_rows(cfg: Qwen3Config) -> bool:
    """Whether any layer's MLP is dense (a mixture of experts may have none: then the dense
    MLP's scratch is not needed)."""
    return cfg.sparse_layers < cfg.num_hidden_layers


class Prefill:
    """CudaEngine's prefill launches. Uses the engine's kernels (k), stream, buffers and
    capacity; prefill() in the engine drives it chunk by chunk."""

    def _prefill_chunk_tokens(self) -> int:
        cfg = self.config
        gate_up = 0 if self.gemm90 else 2 * 4  # fp32 gate/up rows, unless fused into SwiGLU
        # act in bf16, or (e4m3 activations) in codes and scales, with xn's or attn's codes
        act, codes = (1.04, max(cfg.hidden_size, cfg.q_size) * 1.04) if self.fp8_gemm else (2, 0)
        mlp = cfg.intermediate_size * (gate_up + act) if dense_mlp_rows(cfg) else 0
        attention = (cfg.q_size + 2 * cfg.kv_size) * 4 + cfg.q_size * 2  # qkv, q
        attn = 0 if cfg.is_moe else cfg.q_size * 2  # (a mixture of experts': in its scratch)
        per_token = int(cfg.hidden_size * (4 + 2) + attn + mlp + codes + 4
                        + self._staging_bytes_per_token(attention))
        longest = MOE_PREFILL_LONGEST if cfg.is_moe else PREFILL_LONGEST
        most = int(max(64, min(longest, prefill_scratch_budget(cfg) // per_token // 64 * 64)))
        if not self.attention90:
            return most
        return attention_wave_chunk(most, cfg.num_attention_heads, self.device.sm_count)

    def _qk_norm_rope_store(self, layer: int, n: int, pos_at, start: int) -> None:
        """q (bf16) and the layer's cache rows of n tokens' qkv rows: each head normed and
        rotated at position start + t (with `pos_at` a device pointer, the position there +
        t instead). One warp a token's head (layers.cu)."""
        cfg, w = self.config, self.layers[layer]
        items = n * (cfg.num_attention_heads + cfg.num_key_value_heads)
        self._launch("qk_norm_rope_store", math.ceil(items / ROPE_WARPS), 32 * ROPE_WARPS,
                     self.qkv, ctypes.c_int(n), pos_at, ctypes.c_int(start), w.q_norm, w.k_norm,
                     self.inv_freq, ctypes.c_float(cfg.rms_norm_eps), ctypes.c_int(self.capacity),
                     self.q, self.k_cache[layer], self.v_cache[layer])

    def _forward_prefill(self, start: int, n: int, start_at: rt.Ptr | None = None) -> None:
        """Run n tokens (ids already in self.ids) at positions start.. through every layer;
        with `start_at`, the kernels read the first position there instead (a graph's, for
        any start with the same attention split: _forward_short)."""
        cfg, c_int, c_float = self.config, ctypes.c_int, ctypes.c_float
        eps = c_float(cfg.rms_norm_eps)
        h, qkv_cols, inter = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.intermediate_size
        scale = c_float(rope.softmax_scale(cfg))
        self._launch("embed_rows", n, 256, self.ids, c_int(n), self.embed, self.x)
        for i, w in enumerate(self.layers):
            self._launch("rmsnorm_rows", n, 256, self.x, w.input_norm, c_int(n), eps, self.xn)
            self._quantize("xn", n, h)
            self._product("store", "xn", i, "qkv", self.qkv, n, qkv_cols, h)
            self._qk_norm_rope_store(i, n, start_at or rt.Ptr(0), start)
            if self.prefill_attention:
                self._attention_prefill(i, start, n, scale, start_at)
            self._quantize("attn", n, cfg.q_size)
            self._product("add", "attn", i, "o", self.x, n, h, cfg.q_size)
            if w.router is not None:  # a mixture of experts (moe.py; its RMSNorm too)
                self._moe_pass(i, w, n)
                continue
            self._launch("rmsnorm_rows", n, 256, self.x, w.post_norm, c_int(n), eps, self.xn)
            self._quantize("xn", n, h)
            self._gate_up(i, n)
            self._product("add", "act", i, "down", self.x, n, h, inter)

    def _product(self, kind: str, a: str, layer: int, weight: str, c, m: int, n: int,
                 k: int) -> None:
        """c = (kind "store") or += ("add") buffer `a` . layer's `weight`^T, on gemm_sm90.cu
        where the engine uses it, else gemm.cu. int4 weights are dequantized to bf16 a slice
        of rows at a time (_dequant), each slice's product writing its columns of c."""
        b = getattr(self.layers[layer], weight)
        if self.fp8_gemm:
            self._gemm_fp8(kind, a, self.gemm90_maps[layer][weight], b, c, m, n, k)
            return
        if self.weight_format != "int4":
            maps = self.gemm90_maps[layer][weight] if self.gemm90 else None
            self._gemm_any(kind, a, maps, b, c, m, n, k, ldc=n)
            return
        rows = dequant_slice_rows(k)
        for r0 in range(0, n, rows):
            r = min(rows, n - r0)
            self._dequant(b, r0, r, k, 0)
            maps = self.w16_maps[weight] if self.gemm90 else None
            self._gemm_any(kind, a, maps, self.w16, rt.Ptr(c.ptr + 4 * r0), m, r, k, ldc=n)

    def _gate_up(self, layer: int, m: int) -> None:
        """act = silu(gate) * up for m tokens (xn): SwiGLU in gate/up's product on gemm_sm90.cu,
        else gate/up into gu and swiglu_rows. int4 weights: a slice of features at a time
        (their gate rows, then their up rows, dequantized)."""
        cfg = self.config
        h, inter = cfg.hidden_size, cfg.intermediate_size
        w = self.layers[layer].gate_up
        if self.fp8_gemm:
            self._gemm_fp8("swiglu", "xn", self.gemm90_maps[layer]["gate_up"], w, self.actq, m,
                           inter, h)
            return
        if self.weight_format != "int4":
            if self.gemm90:
                self._gemm90("swiglu", self.gemm90_maps_a["xn"], self.gemm90_maps[layer]["gate_up"],
                             w, self.act, m, inter, h, up_row=inter)
            else:
                self._gemm("gemm_store", self.xn, w, self.gu, m, 2 * inter, h)
        else:
            features = gate_up_slice(cfg)
            for f0 in range(0, inter, features):
                f = min(features, inter - f0)
                self._dequant(w, f0, f, h, 0)
                self._dequant(w, inter + f0, f, h, features)
                if self.gemm90:
                    self._gemm90("swiglu", self.gemm90_maps_a["xn"], self.w16_maps["gate_up"],
                                 self.w16, rt.Ptr(self.act.ptr + 2 * f0), m, f, h,
                                 up_row=features, ldc=inter)
                    continue
                for half in range(2):  # the gate rows' product, then the up rows'
                    rows = rt.Ptr(self.w16.ptr + half * features * h * 2)
                    self._gemm("gemm_store", self.xn, rows,
                               rt.Ptr(self.gu.ptr + 4 * (f0 + half * inter)), m, f, h,
                               ldc=2 * inter)
        if not self.gemm90:
            blocks = min(4096, math.ceil(m * inter / 256))
            self._launch("swiglu_rows", blocks, 256, self.gu, ctypes.c_int(m), self.act)

    def _gemm_any(self, kind: str, a: str, maps, b, c, m: int, n: int, k: int,
                  ldc: int) -> None:
        if self.gemm90:
            self._gemm90(kind, self.gemm90_maps_a[a], maps, b, c, m, n, k, ldc=ldc)
        else:
            self._gemm(f"gemm_{kind}", getattr(self, a), b, c, m, n, k, ldc=ldc)

    def _quantize(self, a: str, m: int, cols: int) -> None:
        """Buffer `a`'s m rows of bf16 activations as e4m3 codes and scales (xq), for
        gemm_fp8_sm90.cu; nothing on the other paths."""
        if not self.fp8_gemm:
            return
        items = m * math.ceil(cols / 128)  # a warp a group of 128 columns of a row
        self._launch("quantize_rows_e4m3", math.ceil(items / 8), 256, getattr(self, a),
                     ctypes.c_int(m), ctypes.c_int(cols), ctypes.c_int(cols), self.xq,
                     self.xq_scales)

    def _gemm_fp8(self, kind: str, a: str, map_b: rt.TensorMap, b, c, m: int, n: int,
                  k: int) -> None:
        """gemm_fp8_sm90.cu: c = or += a's e4m3 codes . the FP8 weights b^T (kind "store",
        "add"), or ("swiglu", n features) actq = e4m3(silu(gate) * up) with its scales."""
        if kind == "swiglu":
            self._launch("gemm_fp8_swiglu", (math.ceil(m / 128), math.ceil(n / 128)),
                         GEMM90_THREADS, self.gemm90_maps_a[a], map_b, self.xq_scales, b,
                         self.actq, self.actq_scales, ctypes.c_int(m), ctypes.c_int(n),
                         ctypes.c_int(k), ctypes.c_int(n), ctypes.c_int(n), shared=GEMM90_SHARED)
            return
        width = gemm90_width(m, n, self.device.sm_count)
        scales = self.actq_scales if a == "act" else self.xq_scales
        self._launch(f"gemm_fp8_{kind}_{width}", (math.ceil(m / 128), math.ceil(n / width)),
                     GEMM90_THREADS, self.gemm90_maps_a[a], map_b, scales, b, c, rt.Ptr(0),
                     ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(0),
                     ctypes.c_int(n), shared=GEMM90_SHARED)

    def _dequant(self, weights, row0: int, rows: int, cols: int, to_row: int) -> None:
        """int4 rows row0 .. row0 + rows of `weights` as bf16 rows of the scratch matrix from
        row `to_row` (dequant_int4_rows): about a tenth of a 4K-token prefill's time
        (docs/perf.md)."""
        total = rows * cols // 8
        self._launch("dequant_int4_rows", min(32 * self.device.sm_count, math.ceil(total / 256)),
                     256, rt.Ptr(weights.ptr + row0 * INT4.row_bytes(cols)), ctypes.c_int(rows),
                     ctypes.c_int(cols), rt.Ptr(self.w16.ptr + to_row * cols * 2))

    def _build_tensor_maps(self) -> None:
        """Tensor maps of the Hopper kernels' operands, encoded once: the activation buffers
        (a chunk's rows; rows past a pass's tokens are read but never stored), the KV caches
        for attention_sm90 and each layer's weights for gemm_sm90."""
        cfg, c = self.config, self.chunk
        qkv_cols = cfg.q_size + 2 * cfg.kv_size

        def tiles(buffer, rows: int, cols: int) -> rt.TensorMap:
            return rt.tile_map(buffer.ptr, rows, cols, GEMM90_BOX, GEMM90_BOX_K)

        def codes(buffer, rows: int, cols: int, packed: bool = False) -> rt.TensorMap:
            """e4m3 codes in 128 x 128-byte boxes (gemm_fp8_sm90.cu); packed: FP8 weight rows,
            their codes (weights.cuh)."""
            return rt.tile_map(buffer.ptr, rows, cols, GEMM90_BOX, 128, swizzled_codes=True,
                               row_bytes=FP8.row_bytes(cols) if packed else None)

        def weights(buffer, rows: int, cols: int) -> rt.TensorMap:
            if self.fp8_gemm:
                return codes(buffer, rows, cols, packed=True)
            if self.weight_format == "fp8":  # the codes of each packed row (weights.cuh)
                return rt.tile_map(buffer.ptr, rows, cols, GEMM90_BOX, 64, codes=True,
                                   row_bytes=FP8.row_bytes(cols))
            return tiles(buffer, rows, cols)

        if self.attention90:
            cache_rows = cfg.num_key_value_heads * self.capacity
            # an int8 cache is read by ordinary loads (attention_sm90.cu): its buffers instead
            self.attention90_kv = [(k, v) if self.kv_format == "int8" else
                                   (tiles(k, cache_rows, cfg.head_dim),
                                    tiles(v, cache_rows, cfg.head_dim))
                                   for k, v in zip(self.k_cache, self.v_cache, strict=True)]
            self.q_map = tiles(self.q, c, cfg.q_size)
        if not self.gemm90:
            return
        if self.fp8_gemm:  # e4m3 codes: xn's and attn's share xq
            self.gemm90_maps_a = {"xn": codes(self.xq, c, cfg.hidden_size),
                                  "attn": codes(self.xq, c, cfg.q_size),
                                  **({"act": codes(self.actq, c, cfg.intermediate_size)}
                                     if dense_mlp_rows(cfg) else {})}
        else:
            self.gemm90_maps_a = {"xn": tiles(self.xn, c, cfg.hidden_size),
                                  "attn": tiles(self.attn, c, cfg.q_size),
                                  **({"act": tiles(self.act, c, cfg.intermediate_size)}
                                     if dense_mlp_rows(cfg) else {})}
        if self.weight_format == "int4":  # the slices _dequant makes, every layer's
            h, q, inter = cfg.hidden_size, cfg.q_size, cfg.intermediate_size
            self.w16_maps = {
                "qkv": tiles(self.w16, min(qkv_cols, dequant_slice_rows(h)), h),
                "o": tiles(self.w16, min(h, dequant_slice_rows(q)), q),
                "gate_up": tiles(self.w16, 2 * gate_up_slice(cfg), h),
                "down": tiles(self.w16, min(h, dequant_slice_rows(inter)), inter)}
            return
        self.gemm90_maps = [{"qkv": weights(w.qkv, qkv_cols, cfg.hidden_size),
                             "o": weights(w.o, cfg.hidden_size, cfg.q_size),
                             **({} if w.gate_up is None else {  # (experts: moe.py)
                                 "gate_up": weights(w.gate_up, 2 * cfg.intermediate_size,
                                                    cfg.hidden_size),
                                 "down": weights(w.down, cfg.hidden_size,
                                                 cfg.intermediate_size)})}
                            for w in self.layers]

    def _gemm90(self, kind: str, map_a: rt.TensorMap, map_b: rt.TensorMap, b, c, m: int,
                n: int, k: int, up_row: int = 0, ldc: int | None = None,
                b_depth: int = 0) -> None:
        """c = or += A . B^T (kind "store", "add"), or c = silu(gate) * up ("swiglu"); b is
        B's buffer (FP8 rows' scales are read from it); c's rows are ldc apart (n). With
        b_depth (store and add, bf16 B), B is b_depth deep and k a multiple of it: A's
        columns walk B's again from 0 every b_depth. A few rows (a short prompt) split K where
        that fills the chip better (_gemm90_split)."""
        if kind == "swiglu" and b_depth:
            raise ValueError("b_depth is for store and add")
        if m <= SPLIT_K_MAX_ROWS and self._gemm90_split(kind, map_a, map_b, b, c, m, n, k,
                                                        up_row, n if ldc is None else ldc,
                                                        b_depth):
            return
        width = 256 if kind == "swiglu" else gemm90_width(m, n, self.device.sm_count)
        name = "gemm90_swiglu" if kind == "swiglu" else f"gemm90_{kind}_{width}"
        tiles_n = math.ceil(n / (128 if kind == "swiglu" else width))
        self._launch(name, (math.ceil(m / 128), tiles_n), GEMM90_THREADS, map_a, map_b, b, c,
                     ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k),
                     ctypes.c_int(up_row or b_depth), ctypes.c_int(n if ldc is None else ldc),
                     shared=GEMM90_SHARED)

    def _gemm90_split(self, kind: str, map_a: rt.TensorMap, map_b: rt.TensorMap, b, c, m: int,
                      n: int, k: int, up_row: int, ldc: int, b_depth: int = 0) -> bool:
        """_gemm90's product with K split into runs (split_k), each run's partial product
        into splitk_parts, then summed in order: False where one run is best (or the
        product's B is a slice of int4 weights, whose gate rows are not B's first half)."""
        cols = 2 * n if kind == "swiglu" else n
        if kind == "swiglu" and up_row != n:
            return False
        splits = split_k(m, cols, k, self.device.sm_count)
        if splits == 1:
            return False
        c_int = ctypes.c_int
        self._launch("gemm90_store_128", (math.ceil(m / 128), math.ceil(cols / 128), splits),
                     GEMM90_THREADS, map_a, map_b, b, self.splitk_parts, c_int(m), c_int(cols),
                     c_int(k), c_int(b_depth), c_int(cols), shared=GEMM90_SHARED)
        blocks = min(4 * self.device.sm_count, math.ceil(m * n / 256))
        if kind == "swiglu":
            self._launch("splitk_swiglu", blocks, 256, self.splitk_parts, c_int(splits),
                         c_int(m), c_int(n), c, c_int(ldc))
        else:
            self._launch("splitk_sum", blocks, 256, self.splitk_parts, c_int(splits), c_int(m),
                         c_int(n), c, c_int(ldc), c_int(kind == "add"))
        return True

    def short_prompt_rows(self, start: int, n: int) -> int | None:
        """The rows of the graph a pass of n tokens at `start` replays (n rounded up to a
        multiple of SHORT_PROMPT_STEP), or None where it takes the kernels one by one: more
        than SHORT_PROMPT_ROWS tokens, or rows that would pass the cache's end. (The padding
        rows' keys and values land past the prompt, where nothing reads them before the next
        tokens overwrite them.)"""
        rows = math.ceil(n / SHORT_PROMPT_STEP) * SHORT_PROMPT_STEP
        if n > SHORT_PROMPT_ROWS or start + rows > self.capacity:
            return None
        return rows

    def _forward_short(self, start: int, tokens: np.ndarray, rows: int) -> None:
        """_forward_prefill of `tokens` at start.. as one graph launch: the tokens padded with
        token 0 to `rows`, the graph captured on first use for these rows, key split and
        prefill_attention."""
        padded = np.zeros(rows, np.int32)
        padded[: len(tokens)] = tokens
        self.ids.upload(padded, stream=self.stream)
        self.short_start.upload(np.array([start], np.int32), stream=self.stream)
        key = (rows, self.prefill_key_splits(start, rows), self.prefill_attention)
        graph = self._short_graphs.get(key)
        if graph is None:
            with rt.Graph.capture(self.stream) as graph:
                self._forward_prefill(start, rows, rt.Ptr(self.short_start.ptr))
            self._short_graphs[key] = graph
        graph.launch(self.stream)

    def _close_short(self) -> None:
        rt.close_graphs(getattr(self, "_short_graphs", {}))  # (none if set-up stopped first)

    def prefill_key_splits(self, start: int, n: int) -> int:
        """Blocks along the keys for the prefill attention of n tokens after `start` cached
        ones: one, unless a single tile of queries per head would leave the chip mostly idle
        while each block walks a long cached prefix (a chat's next message)."""
        heads = self.config.num_attention_heads
        if n > PREFILL_QUERIES_PER_BLOCK or heads >= self.device.sm_count:
            return 1
        by_keys = (start + n) // PREFILL_MIN_SPLIT_KEYS
        return max(1, min(PREFILL_MAX_KEY_SPLITS, by_keys,
                          math.ceil(2 * self.device.sm_count / heads)))

    def _attention_prefill(self, layer: int, start: int, n: int, scale: ctypes.c_float,
                           start_at: rt.Ptr | None = None) -> None:
        c_int, heads = ctypes.c_int, self.config.num_attention_heads
        splits = self.prefill_key_splits(start, n)
        if self.attention90 and splits == 1 and start_at is None:
            k, v = self.attention90_kv[layer]
            self._launch("attn_prefill90", (heads, math.ceil(n / ATTENTION90_QUERIES)),
                         ATTENTION90_THREADS, self.q_map, k, v,
                         c_int(start), c_int(n), c_int(self.capacity), scale, self.attn,
                         shared=attention90_shared(self.config.head_dim))
            return
        self._launch("attn_prefill", (math.ceil(n / PREFILL_QUERIES_PER_BLOCK), heads, splits),
                     128, self.q, self.k_cache[layer], self.v_cache[layer],
                     start_at or rt.Ptr(0), c_int(start), c_int(n), c_int(self.capacity), scale,
                     self.attn, self.prefill_part_o,
                     self.prefill_part_ml, shared=prefill_attention_shared(self.config.head_dim))
        if splits > 1:
            self._launch("attn_prefill_merge", (n, heads), self.config.head_dim,
                         self.prefill_part_o, self.prefill_part_ml, c_int(splits), self.attn)

    def _gemm(self, kernel: str, a, b, c, m: int, n: int, k: int,
              ldc: int | None = None) -> None:
        grid = (math.ceil(n / GEMM_TILE), math.ceil(m / GEMM_TILE))
        self._launch(kernel, grid, 256, a, b, c, ctypes.c_int(m), ctypes.c_int(n),
                     ctypes.c_int(k), ctypes.c_int(n if ldc is None else ldc),
                     shared=gemm_shared_bytes(self.weight_format))

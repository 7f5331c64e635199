"""Prefill: the new tokens through every layer as batched tensor-core GEMMs and flash
attention (gemm.cu, attention.cu, layers.cu), in chunks that bound the scratch memory."""

from __future__ import annotations

import ctypes
import math

from qwenchat.engine.cuda import runtime as rt

GEMM_TILE = 128
PREFILL_QUERIES_PER_BLOCK = 64
PREFILL_MAX_KEY_SPLITS = 16  # a few new tokens' attention split over the cached keys
PREFILL_MIN_SPLIT_KEYS = 256  # keys per split at least: fewer is not worth a merge
PREFILL_SCRATCH_BUDGET = 160 * 2**20


def gemm_shared_bytes(weight_format: str) -> int:
    """gemm.cu's dynamic shared memory (SHARED_BYTES): 4 stages of 128 x 40 bf16 A and B
    tiles; for FP8 weights, 4 stages of A and of B's 128 x 32 codes plus one bf16 B tile."""
    stages, tile = 4, 128 * 40 * 2
    if weight_format == "fp8":
        return stages * tile + tile + stages * 128 * 32
    return stages * 2 * tile


def prefill_attention_shared(head_dim: int) -> int:
    """attn_prefill's dynamic shared memory: two stages of a K and a V tile (PF_KV keys of
    head_dim + 8 bf16 values each) in attention.cu."""
    keys = 64 if head_dim <= 128 else 32
    return 2 * 2 * keys * (head_dim + 8) * 2


class Prefill:
    """CudaEngine's prefill launches. Uses the engine's kernels (k), stream, buffers and
    capacity; prefill() in the engine drives it chunk by chunk."""

    def _prefill_chunk_tokens(self) -> int:
        cfg = self.config
        per_token = (cfg.hidden_size * (4 + 2) + (cfg.q_size + 2 * cfg.kv_size) * 4
                     + cfg.q_size * 2 * 2 + cfg.intermediate_size * (2 * 4 + 2) + 4)
        chunk = PREFILL_SCRATCH_BUDGET // per_token
        return int(max(64, min(2048, chunk // 64 * 64)))

    def _forward_prefill(self, start: int, n: int) -> None:
        """Run n tokens (ids already in self.ids) at positions start.. through every layer."""
        cfg, c_int, c_float = self.config, ctypes.c_int, ctypes.c_float
        eps = c_float(cfg.rms_norm_eps)
        h, qkv_cols, inter = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.intermediate_size
        scale = c_float(cfg.head_dim**-0.5)
        rope_block = max(32, cfg.head_dim // 2)
        heads_total = cfg.num_attention_heads + cfg.num_key_value_heads
        self._launch("embed_rows", n, 256, self.ids, c_int(n), self.embed, self.x)
        for i, w in enumerate(self.layers):
            self._launch("rmsnorm_rows", n, 256, self.x, w.input_norm, c_int(n), eps, self.xn)
            self._gemm("gemm_store", self.xn, w.qkv, self.qkv, n, qkv_cols, h)
            self._launch("qk_norm_rope_store", (n, heads_total), rope_block, self.qkv, c_int(n),
                         rt.Ptr(0), c_int(start), w.q_norm, w.k_norm, self.inv_freq, eps,
                         c_int(self.capacity), self.q, self.k_cache[i], self.v_cache[i])
            self._attention_prefill(i, start, n, scale)
            self._gemm("gemm_add", self.attn, w.o, self.x, n, h, cfg.q_size)
            self._launch("rmsnorm_rows", n, 256, self.x, w.post_norm, c_int(n), eps, self.xn)
            self._gemm("gemm_store", self.xn, w.gate_up, self.gu, n, 2 * inter, h)
            blocks = min(4096, math.ceil(n * inter / 256))
            self._launch("swiglu_rows", blocks, 256, self.gu, c_int(n), self.act)
            self._gemm("gemm_add", self.act, w.down, self.x, n, h, inter)

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

    def _attention_prefill(self, layer: int, start: int, n: int, scale: ctypes.c_float) -> None:
        c_int, heads = ctypes.c_int, self.config.num_attention_heads
        splits = self.prefill_key_splits(start, n)
        self._launch("attn_prefill", (math.ceil(n / PREFILL_QUERIES_PER_BLOCK), heads, splits),
                     128, self.q, self.k_cache[layer], self.v_cache[layer], c_int(start),
                     c_int(n), c_int(self.capacity), scale, self.attn, self.prefill_part_o,
                     self.prefill_part_ml, shared=prefill_attention_shared(self.config.head_dim))
        if splits > 1:
            self._launch("attn_prefill_merge", (n, heads), self.config.head_dim,
                         self.prefill_part_o, self.prefill_part_ml, c_int(splits), self.attn)

    def _gemm(self, kernel: str, a, b, c, m: int, n: int, k: int) -> None:
        grid = (math.ceil(n / GEMM_TILE), math.ceil(m / GEMM_TILE))
        self._launch(kernel, grid, 256, a, b, c, ctypes.c_int(m), ctypes.c_int(n),
                     ctypes.c_int(k), shared=gemm_shared_bytes(self.weight_format))

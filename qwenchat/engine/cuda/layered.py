"""The per-op decode path ("layered"): one token through a CUDA graph of per-op kernels
(layers.cu, attention.cu) and the GPU sampler (sampling.cu), its position and input token in
device memory. Used where the megakernel cannot run, and by tests as its reference."""

from __future__ import annotations

import ctypes
import math

from qwenchat.engine.cuda import runtime as rt
from qwenchat.engine.cuda.sampler import SAMPLER_HISTOGRAM_BYTES
from qwenchat.model import rope
from qwenchat.sampling.params import SamplingParams

GEMV_ROWS_PER_BLOCK = 16  # 8 warps x 2 rows (rmsnorm_gemv2)
RESIDUAL_ROWS_PER_BLOCK = 8  # 8 warps x 1 row (gemv_residual_*)
DECODE_MAX_CHUNK = 256  # keys per flash-decoding block at most (attention.cu)
DECODE_SHORT_CHUNK = 64  # keys per block below which the fewer-split graph is used


class LayeredDecode:
    """CudaEngine's per-op decode: a graph per flash-decoding split count, captured on first
    use. Uses the engine's kernels, stream, buffers and _lm_head."""

    def _splits_for(self, length: int, most_keys: int = DECODE_SHORT_CHUNK) -> int:
        """The fewest chunks that keep each at most `most_keys` keys, else the most."""
        for splits in self.split_options:
            if math.ceil(length / splits) <= most_keys:
                return splits
        return self.split_options[-1]

    def _forward_decode(self, splits: int) -> None:
        """One token (self.token) at position *self.pos through every layer, logits out."""
        cfg, c_int, c_float = self.config, ctypes.c_int, ctypes.c_float
        eps = c_float(cfg.rms_norm_eps)
        h, qkv_cols, inter = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.intermediate_size
        scale = c_float(rope.softmax_scale(cfg))
        gemv, residual = GEMV_ROWS_PER_BLOCK, RESIDUAL_ROWS_PER_BLOCK
        self._launch("embed_rows", 1, 256, self.token, c_int(1), self.embed, self.x)
        for i, w in enumerate(self.layers):
            self._launch("rmsnorm_gemv2", math.ceil(qkv_cols / gemv), 256, self.x, w.input_norm,
                         w.qkv, c_int(qkv_cols), eps, self.qkv)
            self._qk_norm_rope_store(i, 1, self.pos, 0)
            self._launch("attn_decode_partial", (cfg.num_key_value_heads, splits), 128,
                         self.q, self.k_cache[i], self.v_cache[i], self.pos, c_int(self.capacity),
                         scale, self.part_o, self.part_ml)
            self._launch("attn_decode_merge", cfg.num_attention_heads, min(cfg.head_dim, 128),
                         self.part_o, self.part_ml, c_int(splits), self.attn_f32,
                         shared=(splits + 3) // 4 * 16)
            self._launch("gemv_residual_attn", math.ceil(h / residual), 256, self.attn_f32, w.o,
                         c_int(h), self.x)
            if w.router is not None:  # a mixture of experts (moe.py)
                self._moe_decode(w)
                continue
            self._launch("rmsnorm_gemv2", math.ceil(2 * inter / gemv), 256, self.x, w.post_norm,
                         w.gate_up, c_int(2 * inter), eps, self.gu)
            self._launch("gemv_residual_swiglu", math.ceil(h / residual), 256, self.gu, w.down,
                         c_int(h), self.x)
        self._lm_head(self._ptr(self.x), self._ptr(self.logits))

    def _sample(self, advance: bool) -> None:
        self._launch("sample_prepare", self.sample_blocks, 256, self.logits, self.work,
                     self.params, self.seen, self.counts, self.partial_val, self.partial_idx)
        rt.launch(self.k["sample_token"], 1, 1024,
                  [self.work, self.params, self.partial_val, self.partial_idx,
                   ctypes.c_int(self.sample_blocks), self.seen, self.counts, self.token,
                   self.pos if advance else rt.Ptr(0)],
                  shared=SAMPLER_HISTOGRAM_BYTES, stream=self.stream)

    def _set_params(self, params: SamplingParams, seed: int, step: int) -> None:
        host = self._host_params
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "top_k"):
            host[name] = getattr(params, name)
        host["step"] = step
        host["seed"] = seed & ((1 << 64) - 1)
        self.params.upload(host, stream=self.stream)

    def _decode_graph(self, length: int) -> rt.Graph:
        splits = self._splits_for(length)
        if splits not in self._graphs:
            with rt.Graph.capture(self.stream) as graph:
                self._forward_decode(splits)
                self._sample(advance=True)
            self._graphs[splits] = graph
        return self._graphs[splits]

    def _read_token(self) -> int:
        self.token.download(self._host_token, stream=self.stream)
        self.stream.synchronize()
        return int(self._host_token[0])

    def _layered_token(self, fed: int | None, params: SamplingParams, seed: int,
                       step: int) -> int | None:
        self._set_params(params, seed, step)
        if fed is None:
            self._sample(advance=False)
        else:
            self._decode_graph(self.position + 1).launch(self.stream)
            self._tokens.append(fed)
        return self._read_token()

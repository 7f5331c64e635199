"""A speculative pass's forward on the GPU: the fed token and up to SPECULATE_MOST proposals
through every layer in one CUDA graph (a graph per row count, key split count and attention
form, captured on first use), their first position read from device memory. The linear layers run
on verify.cu (each weight read once for all rows, on the tensor cores, with blocks enough to
fill the chip at 8 rows), the LM head too; attention on prefill's tensor-core kernel with a
block a kv head taking every row's query heads (attn_pass_packed), or on the decode kernels
with a row per grid slice where a kv head's group is too wide for that."""

from __future__ import annotations

import ctypes
import math

import numpy as np

from qwenchat.engine.cuda import runtime as rt
from qwenchat.engine.cuda.builds import VERIFY_KERNELS
from qwenchat.engine.cuda.layered import DECODE_MAX_CHUNK
from qwenchat.engine.cuda.prefill import PREFILL_QUERIES_PER_BLOCK, prefill_attention_shared
from qwenchat.engine.speculate import SPECULATE_MOST
from qwenchat.model import rope
from qwenchat.model.config import Qwen3Config

# The kernels a pass launches that begin with common.cuh's dependent_start: on Hopper each may
# start while the one before it ends (programmatic dependent launch), its blocks taking the
# SMs the other's last blocks leave free. (Not embed_rows: the graph's first kernel.)
DEPENDENT_KERNELS = frozenset((
    *VERIFY_KERNELS, "rmsnorm_rows", "qk_norm_rope_store", "attn_decode_partial",
    "attn_decode_merge", "attn_pass_packed", "swiglu_rows", "moe_few_router", "moe_few_route",
    "moe_few_gate_up", "moe_few_down", "moe_combine"))
VERIFY_THREADS = 256  # verify.cuh's VT_THREADS
VERIFY_ROWS = SPECULATE_MOST + 1  # a pass's rows at most: verify.cuh's VT_TOKENS
# The prefill attention's key splits a pass may take: the prefill's partial sums hold
# PREFILL_QUERIES_PER_BLOCK rows of PREFILL_MAX_KEY_SPLITS splits, twice a pass's 8 rows of 64.
PASS_MAX_KEY_SPLITS = 64
VERIFY_TILE = 16  # weight rows of one mma tile


def pass_norm_parts(config: Qwen3Config) -> int:
    """The most sums of squares a token a pass's RMSNorm inputs hold (verify.cuh's PassNorm):
    a block's of the products that add to the residual stream, 16 rows each at least."""
    return math.ceil(config.hidden_size / VERIFY_TILE)


def packed_attention_fits(config: Qwen3Config) -> bool:
    """Whether attn_pass_packed holds a pass: a block takes every row's query heads of a kv
    head as its query tile (prefill_attention.cuh's PF_Q rows; it traps past them). Every Qwen3 size
    does (8 query heads a kv head at most); a wider group's pass attends on the decode
    kernels."""
    group = config.num_attention_heads // config.num_key_value_heads
    return VERIFY_ROWS * group <= PREFILL_QUERIES_PER_BLOCK


def verify_kernel(kind: str, weight_format: str) -> tuple[str, int]:
    """verify.cu's kernel for a product ("xn", "attn", "act", "head") and the weight rows a
    block takes: two tiles only for o_proj's float input with FP8 weights (verify.cu)."""
    if kind == "attn" and weight_format == "fp8":
        return "verify_attn_r2", 2 * VERIFY_TILE
    return f"verify_{kind}", VERIFY_TILE


class VerifyPass:
    """CudaEngine's speculative pass. Uses the engine's kernels, stream, prefill buffers (x,
    xn, qkv, q, act, ids), KV caches, flash-decoding split options and partial sums
    (`partials`); allocates its own scratch (the rows' logits, gate/up sums, the chunks' maxima
    and sums) on first use."""

    # Whether a pass's kernels are launched as dependents where the GPU can (compute
    # capability 9.0 and up): DEPENDENT_KERNELS.
    dependent_launches = True
    # The most keys of a pass's attention chunk (attention.cu's DC_MAX_CHUNK at most): a pass
    # has a block per row as well as per chunk and kv head, so fewer, longer chunks than a
    # decode step's still fill the chip.
    pass_chunk = DECODE_MAX_CHUNK
    # A pass's attention: "packed" on attn_pass_packed (prefill's tensor-core attention, a block
    # a kv head and key split taking every row's query heads, so the keys are read once; bf16
    # rows into o_proj), or "decode" on the decode kernels (a block a row, kv head and chunk:
    # the tests' oracle and the A/B's baseline).
    pass_attention = "packed"
    _dependent_now = False  # while a pass's graph is captured: CudaEngine._launch

    def _verify_state(self) -> None:
        if getattr(self, "_verify_graphs", None) is not None:
            return
        cfg, rows, most = self.config, VERIFY_ROWS, self.split_options[-1]
        if not packed_attention_fits(cfg):
            self.pass_attention = "decode"
        self.pass_logits = self._device_buffer(rows * cfg.vocab_size * 4)  # a row each token
        self.verify_gu = self._device_buffer(rows * 2 * cfg.intermediate_size * 4)
        self.verify_attn = self._device_buffer(rows * cfg.q_size * 4)
        # (its chunks' outputs: verify_part_o, in the engine's shared partials)
        self.verify_part_ml = self._device_buffer(rows * cfg.num_attention_heads * most * 2 * 4)
        self.verify_pos = self._device_buffer(4)
        self.verify_choice = self._device_buffer(rows * 4)  # rows_argmax's tokens
        self._verify_pinned = [rt.PinnedBuffer(64 + 2 * rows * 4)]
        host = self._verify_pinned[0]
        self._host_verify_pos = host.array(np.int32, 1)
        self._host_verify_choice = host.array(np.int32, 16 + rows)[16:]
        self._host_verify_ids = host.array(np.int32, 16 + 2 * rows)[16 + rows:]
        self._host_pass_rows: np.ndarray | None = None
        self._verify_graphs: dict[tuple[int, int, str], rt.Graph] = {}

    def _upload_pass_ids(self, tokens: list[int]) -> None:
        """A pass's tokens into self.ids, through pinned memory (an async copy: the stream is
        synchronized before the host array is written again)."""
        host = self._host_verify_ids[: len(tokens)]
        host[:] = tokens
        self.ids.upload(host, stream=self.stream)

    def _keep_pass_row(self, row: int) -> None:
        """The pass's row `row` of logits as the last position's (self.logits), on the device."""
        nbytes = self.config.vocab_size * 4
        self.logits.copy_from(self.pass_logits, nbytes, src_offset=row * nbytes,
                              stream=self.stream)

    def _pass_rows_host(self) -> np.ndarray:
        """Pinned host rows for a pass's logits (downloaded only where verify needs them)."""
        if self._host_pass_rows is None:
            cfg = self.config
            pinned = rt.PinnedBuffer(VERIFY_ROWS * cfg.vocab_size * 4)
            self._verify_pinned.append(pinned)
            self._host_pass_rows = pinned.array(np.float32).reshape(VERIFY_ROWS, cfg.vocab_size)
        return self._host_pass_rows

    def _verify_product(self, kind: str, a, weight, out, n: int, rows: int,
                        norm_in: int | None = None, norm_out: rt.DeviceBuffer | None = None
                        ) -> int:
        """out (n x rows floats) = or += a . weight^T on verify.cu: kind "xn" or "head" (the
        LM head) after an RMSNorm (a is pass_xg, `norm_in` the sums of squares a token in
        pass_sq), "attn" (o_proj's float input) or "act" (down's), which add to the residual
        stream and write the next norm's pass_xg and pass_sq (its weights `norm_out`).
        Returns the product's blocks: for "attn" and "act", the sums of squares a token."""
        name, per_block = verify_kernel(kind, self.weight_format)
        blocks = math.ceil(rows / per_block)
        args = [a, ctypes.c_int(n), weight, ctypes.c_int(rows), out]
        if norm_in is not None:
            args += [self.pass_sq, ctypes.c_int(norm_in), ctypes.c_float(self.config.rms_norm_eps)]
        else:
            args += [norm_out, self.pass_xg, self.pass_sq]
        self._launch(name, blocks, VERIFY_THREADS, *args)
        return blocks

    def _pass_norm_rows(self, n: int, norm: rt.DeviceBuffer) -> int:
        """pass_xg and pass_sq from x itself (one sum a token), where no product wrote them."""
        self._launch("verify_norm_rows", n, 1024, self.x, ctypes.c_int(n), norm, self.pass_xg,
                     self.pass_sq)
        return 1

    def _forward_verify(self, n: int, splits: int) -> None:
        """n tokens (self.ids) at positions *verify_pos.. through every layer, each row's
        logits into pass_logits. No RMSNorm kernels: o_proj and down write the next norm's
        input (verify.cuh's PassNorm)."""
        cfg, c_int, c_float = self.config, ctypes.c_int, ctypes.c_float
        h, qkv_cols, inter = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.intermediate_size
        scale = c_float(rope.softmax_scale(cfg))
        self._launch("embed_rows", n, 256, self.ids, c_int(n), self.embed, self.x)
        parts = self._pass_norm_rows(n, self.layers[0].input_norm)
        for i, w in enumerate(self.layers):
            after = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            self._verify_product("xn", self.pass_xg, w.qkv, self.qkv, n, qkv_cols, parts)
            self._qk_norm_rope_store(i, n, self.verify_pos, 0)
            if self.pass_attention == "packed":
                self._launch("attn_pass_packed", (1, cfg.num_key_value_heads, splits), 128,
                             self.q, self.k_cache[i], self.v_cache[i], self.verify_pos, c_int(n),
                             c_int(self.capacity), scale, self.attn, self.prefill_part_o,
                             self.prefill_part_ml, shared=prefill_attention_shared(cfg.head_dim))
                if splits > 1:
                    self._launch("attn_prefill_merge", (n, cfg.num_attention_heads), cfg.head_dim,
                                 self.prefill_part_o, self.prefill_part_ml, c_int(splits),
                                 self.attn)
                parts = self._verify_product("attn_bf16", self.attn, w.o, self.x, n, h,
                                             norm_out=w.post_norm)
            else:
                self._launch("attn_decode_partial", (cfg.num_key_value_heads, splits, n), 128,
                             self.q, self.k_cache[i], self.v_cache[i], self.verify_pos,
                             c_int(self.capacity), scale, self.verify_part_o,
                             self.verify_part_ml)
                self._launch("attn_decode_merge", (cfg.num_attention_heads, n),
                             min(cfg.head_dim, 128), self.verify_part_o, self.verify_part_ml,
                             c_int(splits), self.verify_attn, shared=(splits + 3) // 4 * 16)
                parts = self._verify_product("attn", self.verify_attn, w.o, self.x, n, h,
                                             norm_out=w.post_norm)
            if w.router is not None:  # a mixture of experts (moe.py: the next norm's input too)
                self._moe_pass(i, w, n, parts, after)
                parts = 1
                continue
            self._verify_product("xn", self.pass_xg, w.gate_up, self.verify_gu, n, 2 * inter,
                                 parts)
            blocks = min(4096, math.ceil(n * inter / 256))
            self._launch("swiglu_rows", blocks, 256, self.verify_gu, c_int(n), self.act)
            parts = self._verify_product("act", self.act, w.down, self.x, n, h, norm_out=after)
        self._verify_product("head", self.pass_xg, self.lm_head, self.pass_logits, n,
                             cfg.vocab_size, parts)

    def _packed_splits(self, length: int) -> int:
        """attn_pass_packed's key splits for a pass over `length` keys: enough blocks to
        fill the chip twice, no more than the tiles of 64 keys; at most what the prefill's
        partial sums hold for VERIFY_ROWS rows (PASS_MAX_KEY_SPLITS)."""
        return max(1, min(PASS_MAX_KEY_SPLITS, math.ceil(length / 64),
                          math.ceil(2 * self.device.sm_count / self.config.num_key_value_heads)))

    def _pass_splits(self, length: int) -> int:
        """The fewest flash-decoding chunks that keep each at most pass_chunk keys, else the
        most (LayeredDecode's rule with longer chunks)."""
        return self._splits_for(length, self.pass_chunk)

    def _verify_forward(self, start: int, n: int) -> None:
        """The pass's forward for n tokens already in self.ids, the first at position start:
        one graph launch."""
        self._verify_state()
        splits = (self._pass_splits(start + n) if self.pass_attention == "decode"
                  else self._packed_splits(start + n))
        key = (n, splits, self.pass_attention)  # (the tests switch the attention)
        if key not in self._verify_graphs:
            self._dependent_now = (self.dependent_launches
                                   and self.device.compute_capability >= (9, 0))
            try:
                with rt.Graph.capture(self.stream) as graph:
                    self._forward_verify(n, splits)
            finally:
                self._dependent_now = False
            self._verify_graphs[key] = graph
        self._host_verify_pos[0] = start
        self.verify_pos.upload(self._host_verify_pos, stream=self.stream)
        self._verify_graphs[key].launch(self.stream)

    def _close_verify(self) -> None:
        rt.close_graphs(getattr(self, "_verify_graphs", None) or {})
        for pinned in getattr(self, "_verify_pinned", ()):
            pinned.free()
        self._verify_graphs = None
        self._verify_pinned = []

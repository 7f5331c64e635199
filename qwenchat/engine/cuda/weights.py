"""Weight upload: every tensor the kernels read, in the layout they read it
(cuda_src/weights.cuh). Random weights (`bench --config`) are not uploaded but drawn on the
device, value for value as the CPU draws them, once the kernels are loaded."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qwenchat.engine.cuda import runtime as rt
from qwenchat.model import awq, fp8, rope
from qwenchat.model.checkpoint import WeightSource
from qwenchat.model.formats import FORMATS, FP8, INT4
from qwenchat.model.random_weights import INT4_SALT, DeviceDraw


@dataclass
class LayerBuffers:
    input_norm: rt.DeviceBuffer
    qkv: rt.DeviceBuffer  # [q; k; v] rows, hidden columns
    q_norm: rt.DeviceBuffer
    k_norm: rt.DeviceBuffer
    o: rt.DeviceBuffer
    post_norm: rt.DeviceBuffer
    gate_up: rt.DeviceBuffer | None  # [gate; up] rows (None in a mixture of experts' layer)
    down: rt.DeviceBuffer | None
    # A mixture of experts' layer (cuda_src/moe.cu): the router's rows (bf16), every expert's
    # [gate; up] rows one expert after another, and every expert's down rows.
    router: rt.DeviceBuffer | None = None
    experts_gate_up: rt.DeviceBuffer | None = None
    experts_down: rt.DeviceBuffer | None = None


def _upload_rows(parts: Sequence[np.ndarray]) -> rt.DeviceBuffer:
    """One device buffer holding `parts` (bf16 bit arrays) one after another, no host concat."""
    total = sum(p.nbytes for p in parts)
    buffer = rt.DeviceBuffer(total)
    offset = 0
    for part in parts:
        buffer.upload(np.ascontiguousarray(part), offset=offset)
        offset += part.nbytes
    return buffer


DRAW_THREADS = 256


class WeightUpload:
    """CudaEngine's weights on the device: per-layer buffers, the embedding, the final norm,
    the LM head and RoPE's inverse frequencies. Uses the engine's config, weight_format and
    _buffers (every allocation is freed by close())."""

    def _upload_weights(self, weights: WeightSource) -> None:
        cfg = self.config
        # Random weights say how the device draws each tensor (qwenchat/model/random_weights.py).
        device_draw = getattr(weights, "device_draw", None)
        self._pending_draws: list[tuple[int, tuple[int, int], DeviceDraw]] = []
        shapes = cfg.tensor_shapes()

        def drawn(names: Sequence[str]) -> rt.DeviceBuffer | None:
            """One buffer for `names`, to be drawn on the device; None if any cannot be."""
            if device_draw is None:
                return None
            draws = [device_draw(n) for n in names]
            if any(d is None for d in draws):
                return None
            matrices = [(shapes[n][0], math.prod(shapes[n][1:])) for n in names]
            sizes = [rows_ * FORMATS[d.format].row_bytes(cols)
                     for (rows_, cols), d in zip(matrices, draws, strict=True)]
            buffer = rt.DeviceBuffer(sum(sizes))
            self._buffers.append(buffer)
            offset = 0
            for matrix, d, size in zip(matrices, draws, sizes, strict=True):
                self._pending_draws.append((buffer.ptr + offset, matrix, d))
                offset += size
            return buffer

        def one(name: str) -> rt.DeviceBuffer:
            buffer = drawn([name])
            if buffer is not None:
                return buffer
            buffer = _upload_rows([weights.bf16_bits(name)])
            self._buffers.append(buffer)
            return buffer

        def rows(*names: str) -> rt.DeviceBuffer:
            """Linear layers, one after another, in the model's format (weights.cuh)."""
            buffer = drawn(names)
            if buffer is not None:
                return buffer
            if self.weight_format == "fp8":
                parts = [fp8.pack_rows(*weights.fp8(n)) for n in names]
            elif self.weight_format == "int4":
                parts = [awq.gpu_rows(*weights.groups(n)) for n in names]
            else:
                parts = [weights.bf16_bits(n) for n in names]
            buffer = _upload_rows(parts)
            self._buffers.append(buffer)
            return buffer

        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            attention = dict(
                input_norm=one(p + "input_layernorm.weight"),
                qkv=rows(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                         p + "self_attn.v_proj.weight"),
                q_norm=one(p + "self_attn.q_norm.weight"),
                k_norm=one(p + "self_attn.k_norm.weight"),
                o=rows(p + "self_attn.o_proj.weight"),
                post_norm=one(p + "post_attention_layernorm.weight"))
            if cfg.sparse_layer(i):
                experts = range(cfg.num_experts)
                self.layers.append(LayerBuffers(
                    **attention, gate_up=None, down=None, router=one(p + "mlp.gate.weight"),
                    experts_gate_up=rows(*(f"{p}mlp.experts.{e}.{proj}_proj.weight"
                                           for e in experts for proj in ("gate", "up"))),
                    experts_down=rows(*(f"{p}mlp.experts.{e}.down_proj.weight"
                                        for e in experts))))
            else:
                self.layers.append(LayerBuffers(
                    **attention, gate_up=rows(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down=rows(p + "mlp.down_proj.weight")))
        self.embed = one("model.embed_tokens.weight")
        self.final_norm = one("model.norm.weight")
        head = weights.lm_head_name()
        self.lm_head = self.embed if head == "model.embed_tokens.weight" else one(head)
        self.weight_bytes = sum(b.nbytes for b in self._buffers)
        inv_freq = rope.inv_freq(cfg)  # (YaRN's blend where the config scales RoPE)
        self.inv_freq = self._device_buffer(inv_freq.nbytes)
        self.inv_freq.upload(inv_freq)

    def _draw_weights(self) -> None:
        """Draw the random weights _upload_weights left to the device (layers.cu's draw_bf16,
        draw_fp8_rows and draw_int4_rows), each table and scale block uploaded once."""
        if not self._pending_draws:
            return
        uploaded: dict[int, rt.DeviceBuffer] = {}  # by id of the table array
        temporary: list[rt.DeviceBuffer] = []

        def upload(array: np.ndarray) -> rt.DeviceBuffer:
            buffer = rt.DeviceBuffer(array.nbytes)
            buffer.upload(np.ascontiguousarray(array))
            temporary.append(buffer)
            return buffer

        most = 32 * self.device.sm_count
        for ptr, (rows, cols), draw in self._pending_draws:
            if rows * cols >= 2**32:
                raise ValueError(f"a {rows} x {cols} tensor is too large to draw on the device")
            key = ctypes.c_uint32(draw.key)
            if draw.int4_unit is not None:
                words = INT4.row_bytes(cols) // 4
                grid = min(most, math.ceil(rows * words / DRAW_THREADS))
                self._launch("draw_int4_rows", grid, DRAW_THREADS, rt.Ptr(ptr),
                             ctypes.c_int(rows), ctypes.c_int(cols), ctypes.c_int(words), key,
                             ctypes.c_uint32(draw.key ^ INT4_SALT),
                             ctypes.c_float(draw.int4_unit))
                continue
            if id(draw.table) not in uploaded:
                uploaded[id(draw.table)] = upload(draw.table)
            table = uploaded[id(draw.table)]
            if draw.scales is None:
                grid = min(most, math.ceil(rows * cols / DRAW_THREADS))
                self._launch("draw_bf16", grid, DRAW_THREADS, rt.Ptr(ptr),
                             ctypes.c_uint32(rows * cols), key, table)
            else:
                words = FP8.row_bytes(cols) // 4
                grid = min(most, math.ceil(rows * words / DRAW_THREADS))
                self._launch("draw_fp8_rows", grid, DRAW_THREADS, rt.Ptr(ptr),
                             ctypes.c_int(rows), ctypes.c_int(cols), ctypes.c_int(words), key,
                             table, upload(draw.scales.astype(np.float32)),
                             ctypes.c_int(draw.scales.shape[1]))
        self.stream.synchronize()
        for buffer in temporary:
            buffer.free()
        self._pending_draws = []


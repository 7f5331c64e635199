"""Weight upload: every tensor the kernels read, in the layout they read it
(cuda_src/weights.cuh)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qwenchat.engine.cuda import runtime as rt
from qwenchat.model import fp8
from qwenchat.model.checkpoint import WeightSource


@dataclass
class LayerBuffers:
    input_norm: rt.DeviceBuffer
    qkv: rt.DeviceBuffer  # [q; k; v] rows, hidden columns
    q_norm: rt.DeviceBuffer
    k_norm: rt.DeviceBuffer
    o: rt.DeviceBuffer
    post_norm: rt.DeviceBuffer
    gate_up: rt.DeviceBuffer  # [gate; up] rows
    down: rt.DeviceBuffer


def _upload_rows(parts: Sequence[np.ndarray]) -> rt.DeviceBuffer:
    """One device buffer holding `parts` (bf16 bit arrays) one after another, no host concat."""
    total = sum(p.nbytes for p in parts)
    buffer = rt.DeviceBuffer(total)
    offset = 0
    for part in parts:
        buffer.upload(np.ascontiguousarray(part), offset=offset)
        offset += part.nbytes
    return buffer


class WeightUpload:
    """CudaEngine's weights on the device: per-layer buffers, the embedding, the final norm,
    the LM head and RoPE's inverse frequencies. Uses the engine's config, weight_format and
    _buffers (every allocation is freed by close())."""

    def _upload_weights(self, weights: WeightSource) -> None:
        cfg = self.config

        def one(name: str) -> rt.DeviceBuffer:
            buffer = _upload_rows([weights.bf16_bits(name)])
            self._buffers.append(buffer)
            return buffer

        def rows(*names: str) -> rt.DeviceBuffer:
            """Linear layers, one after another, in the model's format (weights.cuh)."""
            if self.weight_format == "fp8":
                parts = [fp8.pack_rows(*weights.fp8(n)) for n in names]
            else:
                parts = [weights.bf16_bits(n) for n in names]
            buffer = _upload_rows(parts)
            self._buffers.append(buffer)
            return buffer

        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(LayerBuffers(
                input_norm=one(p + "input_layernorm.weight"),
                qkv=rows(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                         p + "self_attn.v_proj.weight"),
                q_norm=one(p + "self_attn.q_norm.weight"),
                k_norm=one(p + "self_attn.k_norm.weight"),
                o=rows(p + "self_attn.o_proj.weight"),
                post_norm=one(p + "post_attention_layernorm.weight"),
                gate_up=rows(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=rows(p + "mlp.down_proj.weight"),
            ))
        self.embed = one("model.embed_tokens.weight")
        self.final_norm = one("model.norm.weight")
        head = weights.lm_head_name()
        self.lm_head = self.embed if head == "model.embed_tokens.weight" else one(head)
        self.weight_bytes = sum(b.nbytes for b in self._buffers)
        exponents = np.arange(0, cfg.head_dim, 2, dtype=np.float32) / np.float32(cfg.head_dim)
        inv_freq = (np.float32(1.0) / (np.float32(cfg.rope_theta) ** exponents)).astype(np.float32)
        self.inv_freq = self._device_buffer(inv_freq.nbytes)
        self.inv_freq.upload(inv_freq)

"""Qwen's AWQ checkpoints: 4-bit weights in groups of 128 input columns, with zero points.

A linear layer `<module>.weight` (out x in) is stored as AutoAWQ's "gemm" layout:
  `<module>.qweight`  int32 (in, out / 8): eight 4-bit codes a word, the word's nibble i
                      (bits 4i .. 4i + 3) holding output column 8 w + ORDER[i];
  `<module>.qzeros`   int32 (in / 128, out / 8): the groups' zero points, packed the same way;
  `<module>.scales`   fp16 (in / 128, out): the groups' scales.
A weight is (code - zero) x scale of its group of 128 input columns. `--quantize int4` makes
the same layout at load time (Int4Weights). NumPy only: both engines use it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from qwenchat.errors import ModelError
from qwenchat.model import fp8
from qwenchat.model.formats import BLOCK, INT4

if TYPE_CHECKING:
    from qwenchat.model.checkpoint import WeightSource
    from qwenchat.model.config import Qwen3Config

BITS = INT4.bits
GROUP = BLOCK  # input columns a scale and a zero point cover
PACK = 32 // BITS  # codes a 32-bit word holds
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column (within a word's 8) held by nibble i
SUFFIXES = ("qweight", "qzeros", "scales")
BAND = 256  # output rows a worker thread quantizes (or lays out for the GPU) at a time


def packed_shapes(out_features: int, in_features: int) -> dict[str, tuple[int, int]]:
    """The three tensors' shapes for an (out x in) weight."""
    groups = in_features // GROUP
    return {"qweight": (in_features, out_features // PACK),
            "qzeros": (groups, out_features // PACK),
            "scales": (groups, out_features)}


def unpack(words: np.ndarray) -> np.ndarray:
    """int32 words (rows x cols / 8) -> their codes (rows x cols, uint8), columns in order."""
    u = np.ascontiguousarray(words).view(np.uint32)
    nibbles = np.stack([(u >> (BITS * i)) & 0xF for i in range(PACK)], axis=-1)  # [.., w, i]
    codes = np.empty_like(nibbles, dtype=np.uint8)
    codes[..., list(ORDER)] = nibbles  # nibble i is column ORDER[i] of its word
    return codes.reshape(words.shape[0], -1)


def pack(codes: np.ndarray) -> np.ndarray:
    """Codes (rows x cols, values 0-15, cols a multiple of 8) -> int32 words, AWQ's order."""
    rows, cols = codes.shape
    grouped = codes.reshape(rows, cols // PACK, PACK).astype(np.uint32)
    words = np.zeros((rows, cols // PACK), np.uint32)
    for i, column in enumerate(ORDER):
        words |= grouped[:, :, column] << np.uint32(BITS * i)
    return words.view(np.int32)


def dequantize(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The (out x in) float32 weight: (code - zero) x scale, group by group."""
    codes = unpack(qweight).astype(np.float32)  # (in, out)
    zeros = np.repeat(unpack(qzeros).astype(np.float32), GROUP, axis=0)
    return np.ascontiguousarray(((codes - zeros) * np.repeat(
        scales.astype(np.float32), GROUP, axis=0)).T)


def quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round-to-nearest asymmetric 4-bit codes of an (out x in) float32 weight, in groups of
    128 input columns: (qweight, qzeros, scales as fp16), AWQ's layout. Each group's range
    [min, max] (widened to hold 0) maps onto 0..15; the zero point is rounded, so 0 stays
    exact. Bands of BAND output rows run on every core (`--quantize int4` at load time)."""
    out_features, in_features = weight.shape
    groups = in_features // GROUP
    qweight = np.empty((in_features, out_features // PACK), np.int32)
    qzeros = np.empty((groups, out_features // PACK), np.int32)
    scales = np.empty((groups, out_features), np.float16)

    def band(o0: int) -> None:
        o1 = min(out_features, o0 + BAND)
        w = weight[o0:o1].T.reshape(groups, GROUP, o1 - o0).astype(np.float32)
        low = np.minimum(w.min(axis=1), 0.0)
        high = np.maximum(w.max(axis=1), 0.0)
        s16 = ((high - low) / (2**BITS - 1)).astype(np.float16)
        step = s16.astype(np.float32)
        safe = np.where(step > 0, step, 1.0)
        zeros = np.clip(np.rint(-low / safe), 0, 2**BITS - 1)
        codes = np.clip(np.rint(w / safe[:, None, :]) + zeros[:, None, :], 0, 2**BITS - 1)
        qweight[:, o0 // PACK : o1 // PACK] = pack(codes.reshape(in_features, o1 - o0)
                                                   .astype(np.uint8))
        qzeros[:, o0 // PACK : o1 // PACK] = pack(zeros.astype(np.uint8))
        scales[:, o0:o1] = s16

    fp8.on_every_core(band, range(0, out_features, BAND))
    return qweight, qzeros, scales


def gpu_rows(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """An AWQ layer as the GPU engine's rows (uint8, out x INT4.row_bytes(in),
    cuda_src/weights.cuh): each output row's codes along its inputs, eight a word in ORDER
    (as AWQ packs its output columns), then a record per group, the f16 scale in the low half
    and the f16 value 1024 + zero in the high half, then zeros to 16 bytes. Bands of BAND
    rows run on every core."""
    in_features, out_features = qweight.shape[0], qweight.shape[1] * PACK
    groups = in_features // GROUP
    out = np.zeros((out_features, INT4.row_bytes(in_features)), np.uint8)

    def band(o0: int) -> None:
        o1 = min(out_features, o0 + BAND)
        words = slice(o0 // PACK, o1 // PACK)
        codes = unpack(qweight[:, words])  # (in, o1 - o0)
        out[o0:o1, : in_features // 2] = pack(np.ascontiguousarray(codes.T)).view(np.uint8)
        zero_bits = np.uint32(0x6400) + unpack(qzeros[:, words]).astype(np.uint32)  # 1024 + z
        records = (scales[:, o0:o1].astype(np.float16).view(np.uint16).astype(np.uint32)
                   | (zero_bits << np.uint32(16)))  # (groups, o1 - o0)
        out[o0:o1, in_features // 2 : in_features // 2 + 4 * groups] = (
            np.ascontiguousarray(records.T).view(np.uint8))

    fp8.on_every_core(band, range(0, out_features, BAND))
    return out


def check_int4_shape(cfg: Qwen3Config) -> None:
    """One line (ModelError) unless every linear layer's inputs are whole groups of 128."""
    widths = [("hidden_size", cfg.hidden_size), ("intermediate_size", cfg.intermediate_size),
              ("num_attention_heads x head_dim", cfg.q_size)]
    if cfg.is_moe:  # (an expert's down projection takes its moe_intermediate_size inputs)
        widths.append(("moe_intermediate_size", cfg.moe_intermediate_size))
    for name, columns in widths:
        if columns % GROUP:
            raise ModelError(f"--quantize int4 needs every linear layer's inputs in whole "
                             f"groups of {GROUP} columns; this model's {name} is {columns}")


class Int4Weights(fp8.QuantizedLinears):
    """`--quantize int4`: a checkpoint's linear layers as 4-bit codes in AWQ's layout (round
    to nearest, asymmetric, groups of 128 input columns: `quantize`), made at load time; an
    AWQ checkpoint's own codes are kept. Everything else passes through as the checkpoint has
    it. (Calibrated AWQ checkpoints are the better 4-bit models where Qwen publishes one.)"""

    weight_format = "int4"

    def __init__(self, source: WeightSource):
        check_int4_shape(source.config)
        super().__init__(source)

    def groups(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(qweight, qzeros, scales) of a linear layer `<module>.weight`."""
        own = getattr(self.source, "awq_groups", None)
        packed = own(name) if own is not None else None
        return packed if packed is not None else quantize(self.source.float32(name))

    def linear(self, name: str) -> np.ndarray:
        return dequantize(*self.groups(name))

"""Qwen's fine-grained FP8 weights: float8 e4m3 values in 128 × 128 blocks, one scale a block.

A linear layer's weight is stored as e4m3 codes plus `<name>_scale_inv`, a (ceil(out/128),
ceil(in/128)) tensor; the weight is code × its block's scale. The same recipe (absmax of the
block / 448, rounded to nearest even) quantizes a bf16 checkpoint at load time
(`--quantize fp8`). NumPy only: both engines use it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from qwenchat.model.floats import E4M3_MAX, e4m3_to_f32, f32_to_bf16_bits, f32_to_e4m3
from qwenchat.model.formats import BLOCK, FP8, is_linear

if TYPE_CHECKING:
    from qwenchat.model.checkpoint import WeightSource

SCALE_SUFFIX = "_scale_inv"  # model.layers.0.mlp.up_proj.weight -> ...weight_scale_inv
QUANTIZE_CHOICES = ("none", "fp8", "int4")


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    rows, cols = shape
    return math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)


def expand_scales(scales: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Each element's scale: the block scales repeated over their 128 × 128 blocks."""
    rows, cols = shape
    return np.repeat(np.repeat(scales, BLOCK, axis=0)[:rows], BLOCK, axis=1)[:, :cols]


def dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """code × its block's scale, in float32."""
    out = e4m3_to_f32(codes)
    for r in range(0, codes.shape[0], BLOCK):  # a band of blocks at a time: no full-size copy
        out[r : r + BLOCK] *= np.repeat(scales[r // BLOCK], BLOCK)[: codes.shape[1]]
    return out


def quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scales) of a float32 matrix: each 128 × 128 block scaled so its largest
    magnitude maps to 448, then rounded to e4m3. An all-zero block gets scale 0.

    Bands of 128 rows are independent and NumPy lets go of the GIL inside them, so they run
    on every core: `--quantize fp8` converts every weight of the model at load time."""
    rows, cols = weight.shape
    scales = np.zeros(scale_shape(weight.shape), np.float32)
    codes = np.empty(weight.shape, np.uint8)

    def band(b: int) -> None:
        r = b * BLOCK
        part = np.zeros((min(BLOCK, rows - r), scales.shape[1] * BLOCK), np.float32)
        part[:, :cols] = weight[r : r + BLOCK]
        blocks = part.reshape(part.shape[0], -1, BLOCK)
        scales[b] = np.abs(blocks).max(axis=(0, 2)) / np.float32(E4M3_MAX)
        divisor = np.where(scales[b] > 0, scales[b], np.float32(1))
        blocks /= divisor[None, :, None]
        codes[r : r + BLOCK] = f32_to_e4m3(part)[:, :cols]

    on_every_core(band, range(scales.shape[0]))
    return codes, scales


def quantize_activations(x: np.ndarray) -> np.ndarray:
    """x (tokens x columns, float32) as FP8 tensor cores would take it under Qwen's "dynamic"
    activation scheme: each token's columns in groups of BLOCK, each group e4m3 codes times
    its own scale (max |x| / 448); returns code x scale as float32. The reference engine's
    `fp8_activations` applies it to every linear layer's input (docs/prefill_v2.md)."""
    x = np.asarray(x, np.float32)
    rows, cols = x.shape
    groups = -(-cols // BLOCK)
    padded = np.zeros((rows, groups * BLOCK), np.float32)
    padded[:, :cols] = x
    blocks = padded.reshape(rows, groups, BLOCK)
    scale = np.abs(blocks).max(axis=2, keepdims=True) / np.float32(E4M3_MAX)
    safe = np.where(scale > 0, scale, np.float32(1))
    values = e4m3_to_f32(f32_to_e4m3(blocks / safe)) * scale
    return values.reshape(rows, groups * BLOCK)[:, :cols].astype(np.float32)


def on_every_core(work: Callable[[int], None], items: Iterable[int]) -> None:
    """work(item) for every item on a pool of threads, one a core (at most 16): for NumPy work
    on independent bands of a matrix, which lets go of the GIL."""
    with ThreadPoolExecutor(max_workers=min(os.cpu_count() or 1, 16)) as pool:
        list(pool.map(work, items))


class QuantizedLinears:
    """A WeightSource whose linear layers a subclass serves quantized (`linear`: the layer
    dequantized to float32), everything else (norms, embedding, LM head) as `source` has it."""

    weight_format = ""

    def __init__(self, source: WeightSource):
        self.source = source
        self.config = source.config

    def linear(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def float32(self, name: str) -> np.ndarray:
        return self.linear(name) if is_linear(name) else self.source.float32(name)

    def bf16_bits(self, name: str) -> np.ndarray:
        if is_linear(name):
            return f32_to_bf16_bits(self.linear(name))
        return self.source.bf16_bits(name)

    def lm_head_name(self) -> str:
        return self.source.lm_head_name()

    def device_draw(self, name: str) -> Any:
        """The source's device draw (random weights), where it gives this tensor in the format
        this source serves it in; None where it would be quantized here, on the CPU."""
        own = getattr(self.source, "device_draw", None)
        draw = own(name) if own is not None else None
        if draw is None or (is_linear(name) and draw.format != self.weight_format):
            return None
        return draw

    def close(self) -> None:
        self.source.close()


class Fp8Weights(QuantizedLinears):
    """Linear layers in FP8: the checkpoint's own blocks where it has them, else its weights
    quantized at load time with the same recipe."""

    weight_format = "fp8"

    def fp8(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(codes uint8 [out, in], scales float32 [ceil(out/128), ceil(in/128)])."""
        own = getattr(self.source, "fp8_blocks", None)
        blocks = own(name) if own is not None else None
        return blocks if blocks is not None else quantize(self.source.float32(name))

    def linear(self, name: str) -> np.ndarray:
        return dequantize(*self.fp8(name))


def with_quantization(weights: WeightSource, quantize_to: str) -> WeightSource:
    """The weights an engine runs: 4-bit linears when asked (`--quantize int4`) or when the
    source holds 4-bit ones (an AWQ checkpoint, random int4 weights), FP8 linears when asked
    (`--quantize fp8`) or when the checkpoint holds any (a layer it left in bf16 is quantized
    too, so every linear layer has one format), else the checkpoint as it is. A mixture of
    experts' experts are linear layers too; its router stays as the checkpoint has it."""
    if quantize_to == "int4" or weights.weight_format in ("awq", "int4"):
        from qwenchat.model.awq import Int4Weights  # (awq imports this module)

        return weights if isinstance(weights, Int4Weights) else Int4Weights(weights)
    if quantize_to == "fp8" or weights.weight_format == "fp8":
        return weights if isinstance(weights, Fp8Weights) else Fp8Weights(weights)
    return weights


def pack_rows(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(codes, block scales) as the GPU's packed rows (uint8, rows x FP8.row_bytes(cols)): the
    row's codes, then a float32 scale per 128 columns (its block's), padded to 16 bytes."""
    rows, cols = codes.shape
    out = np.zeros((rows, FP8.row_bytes(cols)), np.uint8)
    out[:, :cols] = codes
    per_row = np.ascontiguousarray(np.repeat(scales.astype(np.float32), BLOCK, axis=0)[:rows])
    out[:, cols : cols + 4 * scales.shape[1]] = per_row.view(np.uint8)
    return out

"""Random weights for any Qwen3 shape, so `qwenchat bench` runs with nothing downloaded:
bf16, or (weight_format "fp8" / "int4") linear layers drawn directly as FP8 codes and block
scales, or as 4-bit codes with their groups' scales and zeros (AWQ's layout).

Every tensor is a pure function of (seed, tensor name): asking in any order, or twice, gives
the same values. Values are exact bfloat16 numbers, so `float32` and `bf16_bits` describe the
very same weights and the CPU and GPU engines compute with identical inputs.

Drawing a normal float32 per element and rounding it to bf16 costs ~25 ns an element in NumPy,
a quarter of a minute for Qwen3-0.6B. Instead each value indexes a table of 65,536 bf16-rounded
normal samples with 16 bits of a counter-based hash of (tensor key, element index): the same
distribution (bf16 has only 65,536 values anyway) at the cost of a few integer operations and
one gather, in bands of rows on every core. FP8 linear layers index a table of 256 e4m3 codes
of normal samples with 8 bits of the same hash, and each 128 × 128 block's scale comes from
the hash of the block's index. Such an FP8 model is a different random model from the bf16 one
of the same seed (`--quantize fp8` on a bf16 source quantizes that source instead). int4
linear layers take the top 4 bits of the hash as the code, and each group of 128 input columns
of a row its scale and zero from the hash of the group's index (INT4_SALT).

Because the hash needs nothing but the index, the GPU engine draws the very same values on
the device (`device_draw`: the key and the table; cuda_src/layers.cu's draw kernels), so even
Qwen3-32B is ready without drawing or copying gigabytes on the host.
"""

from __future__ import annotations

import hashlib
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from qwenchat.model import awq, fp8
from qwenchat.model.config import Qwen3Config
from qwenchat.model.floats import E4M3_MAX, bf16_bits_to_f32, f32_to_bf16_bits, f32_to_e4m3
from qwenchat.model.formats import is_linear

TABLE_SIZE = 1 << 16  # one entry per value of a 16-bit index
FP8_SPREAD = 4.0  # an FP8 block's codes span ±4 standard deviations (clipped beyond)
BAND_VALUES = 1 << 22  # values a band draws on one thread
HASH_STEP = 0x9E3779B9  # the element index's multiplier in the hash (2^32 / golden ratio)
SCALE_SALT = 0x5CA1E5  # the FP8 block scales' key is the codes' key xor this
INT4_SALT = 0x6E4A11  # the int4 groups' key is the codes' key xor this
INT4_SPREAD = 4.6  # about the standard deviation of (code - zero) for uniform codes


def mix32(x: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finalizer, elementwise on uint32 (cuda_src/layers.cu: draw_mix)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def draw_hash(key: int, start: int, count: int) -> np.ndarray:
    """The hash of elements start .. start + count - 1 of a tensor with this key (uint32)."""
    index = np.arange(start, start + count, dtype=np.uint32)
    return mix32(index * np.uint32(HASH_STEP) + np.uint32(key))


@dataclass(frozen=True)
class DeviceDraw:
    """What the GPU needs to draw a tensor exactly as RandomWeights does on the CPU: the
    tensor's key and table (bf16 bits indexed by hash >> 16, or e4m3 codes by hash >> 24),
    for FP8 the block scales (float32, [row blocks, column blocks]), for int4 the unit its
    groups' scales are drawn around (layers.cu's draw_int4_rows; no table)."""

    key: int
    table: np.ndarray | None
    scales: np.ndarray | None = None
    int4_unit: float | None = None

    @property
    def format(self) -> str:
        """The format the tensor is drawn in: "bf16", "fp8" or "int4"."""
        if self.int4_unit is not None:
            return "int4"
        return "fp8" if self.scales is not None else "bf16"


class RandomWeights:
    """A WeightSource of seeded random weights in the shapes `config` implies.

    Scales keep activations O(1) at every size: norm weights 1 + 0.1·N(0,1), projections
    N(0,1)/sqrt(fan_in), embedding and LM head N(0,1)/sqrt(hidden_size), so the logits of the
    final RMS-normed state are about N(0,1): finite, and neither flat nor one-hot.
    """

    def __init__(self, config: Qwen3Config, seed: int = 0, weight_format: str = "bf16"):
        if weight_format not in ("bf16", "fp8", "int4"):
            raise ValueError(f"random weights come in bf16, fp8 or int4, not {weight_format!r}")
        if weight_format == "int4":  # (the same check and line as Int4Weights)
            awq.check_int4_shape(config)
        self.config = config
        self.seed = seed
        self.weight_format = weight_format
        self._shapes = config.tensor_shapes()
        # A few 128 KiB tables, one per distinct scale, shared by all tensors of that scale.
        self._tables: dict[tuple[float, float], np.ndarray] = {}
        self._fp8_codes: np.ndarray | None = None

    def float32(self, name: str) -> np.ndarray:
        """The tensor as float32 (a new array); every value is exactly a bfloat16 number, or
        (FP8 linear layers) exactly code × block scale, or (int4) (code - zero) × scale."""
        blocks = self.fp8_blocks(name)
        if blocks is not None:
            return fp8.dequantize(*blocks)
        groups = self.awq_groups(name)
        if groups is not None:
            return awq.dequantize(*groups)
        # Gathering from the table's float32 form writes the result once, with no bf16-sized
        # intermediate to widen afterwards.
        return self._gather(name, bf16_bits_to_f32(self._table(name)))

    def bf16_bits(self, name: str) -> np.ndarray:
        """The tensor as bfloat16 bit patterns (uint16), rounded to nearest even from float32."""
        if self.weight_format != "bf16" and is_linear(name):
            return f32_to_bf16_bits(self.float32(name))
        return self._gather(name, self._table(name))

    def fp8_blocks(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(codes, scales) of an FP8 linear layer, as a checkpoint's would be; None for a
        tensor kept in bf16 (and for every tensor of bf16 random weights)."""
        if self.weight_format != "fp8" or not is_linear(name):
            return None
        return self._gather(name, self._fp8_table()), self._fp8_scales(name)

    def awq_groups(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(qweight, qzeros, scales) of an int4 linear layer in AWQ's layout, as a checkpoint's
        would be; None for a tensor kept in bf16 (and for every tensor unless int4)."""
        if self.weight_format != "int4" or not is_linear(name):
            return None
        codes = self._gather(name, np.arange(16, dtype=np.uint8))  # (out, in): hash >> 28
        scales, zeros = self._int4_groups(name)  # (groups, out)
        return awq.pack(np.ascontiguousarray(codes.T)), awq.pack(zeros), scales

    def _int4_unit(self, name: str) -> np.float32:
        return np.float32(1.0 / (INT4_SPREAD * math.sqrt(self._shape(name)[1])))

    def _int4_groups(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(scales fp16, zeros uint8), each [groups, out]: scales of 0.5 to 1.5 units (as
        float32 arithmetic, then rounded to f16), zeros 7 or 8, from the hash of group g of
        row r at index g * rows + r (layers.cu: draw_int4_rows)."""
        rows, cols = self._shape(name)
        groups = cols // awq.GROUP
        h = draw_hash(self._key(name) ^ INT4_SALT, 0, groups * rows).reshape(groups, rows)
        unit = self._int4_unit(name)
        byte = (h >> np.uint32(24)).astype(np.float32)
        scales = (unit * (byte / np.float32(255)) + unit * np.float32(0.5)).astype(np.float16)
        zeros = (np.uint32(7) + ((h >> np.uint32(23)) & np.uint32(1))).astype(np.uint8)
        return scales, zeros

    def device_draw(self, name: str) -> DeviceDraw:
        """The key and table (and FP8 scales, or int4's unit) from which the GPU draws this
        tensor."""
        if self.weight_format == "int4" and is_linear(name):
            return DeviceDraw(self._key(name), None, int4_unit=float(self._int4_unit(name)))
        if self.weight_format != "fp8" or not is_linear(name):
            return DeviceDraw(self._key(name), self._table(name))
        return DeviceDraw(self._key(name), self._fp8_table(), self._fp8_scales(name))

    def lm_head_name(self) -> str:
        if self.config.tie_word_embeddings:
            return "model.embed_tokens.weight"
        return "lm_head.weight"

    def dtype(self, name: str) -> str:
        self._shape(name)
        if is_linear(name) and self.weight_format != "bf16":
            return {"fp8": "F8_E4M3", "int4": "I32"}[self.weight_format]
        return "BF16"

    def close(self) -> None:
        self._tables.clear()

    def _shape(self, name: str) -> tuple[int, ...]:
        try:
            return self._shapes[name]
        except KeyError:
            raise KeyError(f"{name}: not a tensor of this Qwen3 config") from None

    def _gather(self, name: str, table: np.ndarray) -> np.ndarray:
        """The tensor: `table` indexed by the top bits of each element's hash (16 bits for a
        table of 65,536, 8 for one of 256, 4 for 16), in bands of whole rows on every core."""
        shape = self._shape(name)
        rows = shape[0]
        cols = math.prod(shape[1:])
        out = np.empty(shape, table.dtype)
        flat = out.reshape(rows, cols)
        band_rows = max(1, BAND_VALUES // cols)
        key = self._key(name)
        shift = np.uint32(32 - int(table.size - 1).bit_length())

        def band(b: int) -> None:
            r = b * band_rows
            part = flat[r : r + band_rows]
            index = draw_hash(key, r * cols, part.size) >> shift
            np.take(table, index.reshape(part.shape), out=part)

        with ThreadPoolExecutor(max_workers=min(os.cpu_count() or 1, 16)) as pool:
            list(pool.map(band, range(-(-rows // band_rows))))
        return out

    def _fp8_scales(self, name: str) -> np.ndarray:
        """Block scales of 0.5 to 1.5 units (a code's value in a unit block): blocks differ,
        as a real checkpoint's do."""
        shape = self._shape(name)
        unit = np.float32(FP8_SPREAD / E4M3_MAX / math.sqrt(shape[1]))
        count = math.prod(fp8.scale_shape(shape))
        byte = draw_hash(self._key(name) ^ SCALE_SALT, 0, count) >> np.uint32(24)
        scales = unit * (byte.astype(np.float32) / np.float32(255) + np.float32(0.5))
        return scales.reshape(fp8.scale_shape(shape))

    def _key(self, name: str) -> int:
        """The tensor's 32-bit key: a stable hash of (seed, name)."""
        digest = hashlib.blake2b(f"{self.seed}:{name}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little")

    def _table(self, name: str) -> np.ndarray:
        """bf16 bits of 65,536 normal samples with the tensor's mean and standard deviation."""
        shape = self._shape(name)
        if name.endswith("norm.weight"):
            mean, std = 1.0, 0.1
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            mean, std = 0.0, 1.0 / math.sqrt(self.config.hidden_size)
        else:
            mean, std = 0.0, 1.0 / math.sqrt(shape[1])
        if (mean, std) not in self._tables:
            stream = np.random.Generator(np.random.Philox(np.random.SeedSequence([self.seed])))
            normal = stream.standard_normal(TABLE_SIZE, dtype=np.float32)
            self._tables[mean, std] = f32_to_bf16_bits(np.float32(mean) + np.float32(std) * normal)
        return self._tables[mean, std]

    def _fp8_table(self) -> np.ndarray:
        """e4m3 codes of 256 normal samples, ±FP8_SPREAD standard deviations mapped to ±448."""
        if self._fp8_codes is None:
            stream = np.random.Generator(np.random.Philox(np.random.SeedSequence([self.seed, 8])))
            normal = np.clip(stream.standard_normal(256, dtype=np.float32), -FP8_SPREAD,
                             FP8_SPREAD)
            self._fp8_codes = f32_to_e4m3(normal * np.float32(E4M3_MAX / FP8_SPREAD))
        return self._fp8_codes

"""Random bf16 weights for any Qwen3 shape, so `qwenchat bench` runs with nothing downloaded.

Every tensor is a pure function of (seed, tensor name): asking in any order, or twice, gives
the same values. Values are exact bfloat16 numbers, so `float32` and `bf16_bits` describe the
very same weights and the CPU and GPU engines compute with identical inputs.

Drawing a normal float32 per element and rounding it to bf16 costs ~25 ns an element in NumPy,
a quarter of a minute for Qwen3-0.6B. Instead each tensor indexes, with 16 raw random bits an
element, a table of 65,536 bf16-rounded normal samples: the same distribution (bf16 has only
65,536 values anyway) at the cost of one gather, about 3 s for 0.6B on two slow cores.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from qwenchat.model.config import Qwen3Config
from qwenchat.model.floats import bf16_bits_to_f32, f32_to_bf16_bits

TABLE_SIZE = 1 << 16  # one entry per value of a 16-bit index


class RandomWeights:
    """A WeightSource of seeded random weights in the shapes `config` implies.

    Scales keep activations O(1) at every size: norm weights 1 + 0.1·N(0,1), projections
    N(0,1)/sqrt(fan_in), embedding and LM head N(0,1)/sqrt(hidden_size), so the logits of the
    final RMS-normed state are about N(0,1): finite, and neither flat nor one-hot.
    """

    weight_format = "bf16"

    def __init__(self, config: Qwen3Config, seed: int = 0):
        self.config = config
        self.seed = seed
        self._shapes = config.tensor_shapes()
        # A few 128 KiB tables, one per distinct scale, shared by all tensors of that scale.
        self._tables: dict[tuple[float, float], np.ndarray] = {}

    def float32(self, name: str) -> np.ndarray:
        """The tensor as float32 (a new array); every value is exactly a bfloat16 number."""
        # Gathering from the table's float32 form writes the result once, with no bf16-sized
        # intermediate to widen afterwards.
        return bf16_bits_to_f32(self._table(name))[self._indices(name)]

    def bf16_bits(self, name: str) -> np.ndarray:
        """The tensor as bfloat16 bit patterns (uint16), rounded to nearest even from float32."""
        return self._table(name)[self._indices(name)]

    def lm_head_name(self) -> str:
        if self.config.tie_word_embeddings:
            return "model.embed_tokens.weight"
        return "lm_head.weight"

    def dtype(self, name: str) -> str:
        self._shape(name)
        return "BF16"

    def close(self) -> None:
        self._tables.clear()

    def _shape(self, name: str) -> tuple[int, ...]:
        try:
            return self._shapes[name]
        except KeyError:
            raise KeyError(f"{name}: not a tensor of this Qwen3 config") from None

    def _indices(self, name: str) -> np.ndarray:
        """Uniform 16-bit table indices in the tensor's shape, from the name's own stream."""
        shape = self._shape(name)
        count = math.prod(shape)
        stream = np.random.Generator(np.random.Philox(self._seed_sequence(name)))
        # Four indices per 64-bit word: the cheapest uniform draw NumPy offers.
        raw = stream.bit_generator.random_raw(-(-count // 4))
        return raw.view(np.uint16)[:count].reshape(shape)

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

    def _seed_sequence(self, name: str) -> np.random.SeedSequence:
        # A stable hash (Python's hash() is salted per process) of the name picks the stream.
        digest = hashlib.blake2b(name.encode(), digest_size=16).digest()
        words = [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]
        return np.random.SeedSequence([self.seed, *words])

"""How a linear layer's weights are held on the GPU: one object a format.

bf16 values; FP8 e4m3 codes with a float32 scale a 128 x 128 block (Qwen's FP8 files, or
`--quantize fp8`); int4 codes with a scale and a zero point a group of 128 input columns (AWQ
files, or `--quantize int4`). On the GPU a row is its codes, then (narrow formats) a 4-byte
record for each 128 columns, padded to 16 bytes (cuda_src/weights.cuh). Each format owns that
geometry, the bytes it makes, and the kernels' define that selects it; the loader, the engines,
the kernel layouts and the bench ask the object instead of testing the format's name, so a new
kind of weight (a mixture of experts' experts, issue 43) meets one place. Quantizing and
dequantizing stay with the file formats (fp8.py, awq.py). A leaf module: NumPy-free, and
imported by the rest of model/ rather than importing it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

BLOCK = 128  # columns a narrow row's record covers: an FP8 block's width, an int4 group

# A projection inside a layer: the tensors FP8 and AWQ checkpoints store narrow (norms, the
# embedding, the LM head and a mixture of experts' router keep the checkpoint's own dtype).
LINEAR_SUFFIXES = ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                   "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
                   "mlp.up_proj.weight", "mlp.down_proj.weight")
EXPERT_SUFFIXES = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")  # mlp.experts.{e}.


def is_linear(name: str) -> bool:
    """Whether the tensor `name` is one of a layer's linear projections (LINEAR_SUFFIXES, or
    an expert's: model.layers.{i}.mlp.experts.{e}.*_proj.weight)."""
    return name.startswith("model.layers.") and (
        name.endswith(LINEAR_SUFFIXES) or (".mlp.experts." in name
                                           and name.endswith(EXPERT_SUFFIXES)))


@dataclass(frozen=True)
class WeightFormat:
    """A linear layer's format on the GPU: `bits` a weight's code, `record` bytes of a block's
    or group's record after a row's codes (0: none), `define` the kernels' macro for it."""

    name: str
    bits: int
    record: int = 0
    define: str | None = None

    @property
    def narrow(self) -> bool:
        """Codes narrower than bf16 (their rows carry records)."""
        return self.bits < 16

    def code_bytes(self, cols: int) -> int:
        """Bytes of a row's codes (values, for bf16)."""
        return cols * self.bits // 8

    def record_bytes(self, cols: int) -> int:
        """Bytes of a row's records, padded to 16 (0 for bf16)."""
        return -(-self.record * math.ceil(cols / BLOCK) // 16) * 16

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of `cols` columns on the GPU."""
        return self.code_bytes(cols) + self.record_bytes(cols)

    def linear_bytes(self, shape: tuple[int, ...]) -> int:
        """Bytes a linear layer's (rows, cols) weight occupies on the GPU."""
        rows, cols = shape
        return rows * self.row_bytes(cols)

    def weight_bytes(self, shapes: Mapping[str, tuple[int, ...]]) -> int:
        """GPU bytes of these tensors: the linear layers in this format, the rest bf16."""
        return sum(self.linear_bytes(shape) if is_linear(name) else 2 * math.prod(shape)
                   for name, shape in shapes.items())

    def defines(self) -> dict[str, int]:
        """The kernels' macro for this format (cuda_src/weights.cuh), if it needs one."""
        return {self.define: 1} if self.define else {}


BF16 = WeightFormat("bf16", 16)
FP8 = WeightFormat("fp8", 8, record=4, define="QW_FP8")  # a float32 scale a block
INT4 = WeightFormat("int4", 4, record=4, define="QW_INT4")  # an f16 scale and zero a group
FORMATS = {f.name: f for f in (BF16, FP8, INT4)}


def gpu_format(stored: str) -> WeightFormat:
    """The format the GPU's kernels run linear layers stored (or quantized) as `stored` in: FP8
    and int4 as they are, anything else (bf16, f16, f32, "none") as bf16."""
    return FORMATS.get(stored, BF16)

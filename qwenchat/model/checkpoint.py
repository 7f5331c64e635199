"""Safetensors checkpoints (single file or sharded), memory-mapped and validated before use.

The format is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the raw data. We read it ourselves so that bfloat16 tensors map
straight into NumPy (as uint16 bit patterns) without a framework, and so every tensor's
presence, shape, dtype and byte range can be checked against the file before anything runs.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from qwenchat.errors import ModelError
from qwenchat.model import awq, fp8
from qwenchat.model.config import Qwen3Config
from qwenchat.model.floats import bf16_bits_to_f32, f32_to_bf16_bits
from qwenchat.model.formats import is_linear

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024

# On-disk dtype -> the NumPy dtype its bytes are viewed as (bf16 and e4m3 as raw bit patterns).
DISK_DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F8_E4M3": np.dtype("u1"),
    "I32": np.dtype("<i4"),  # AWQ's packed 4-bit codes and zero points
}
FLOAT_DTYPES = ("BF16", "F16", "F32")


@dataclass(frozen=True)
class TensorEntry:
    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


class WeightSource(Protocol):
    """What an engine reads weights from: a checkpoint on disk, or random weights for bench."""

    config: Qwen3Config
    weight_format: str  # of the linear layers: "bf16", "f16", "f32", "fp8" or "awq"

    def float32(self, name: str) -> np.ndarray: ...

    def bf16_bits(self, name: str) -> np.ndarray: ...

    def lm_head_name(self) -> str: ...


class Checkpoint:
    """The tensors of one model, memory-mapped; nothing is read until a tensor is asked for."""

    def __init__(self, directory: Path, config: Qwen3Config):
        self.directory = directory
        self.config = config
        self.entries = _index_entries(directory)
        self._maps: dict[Path, mmap.mmap] = {}
        self._scales: dict[str, np.ndarray] = {}  # FP8 block scales, read and checked at open
        self._awq: dict[str, str] = {}  # AWQ weights: `<module>.weight` -> `<module>`
        self._validate()

    @property
    def files(self) -> list[Path]:
        return sorted({e.path for e in self.entries.values()})

    def dtype(self, name: str) -> str:
        return self.entries[name].dtype

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as an array view into the mapped file (no copy)."""
        entry = self.entries[name]
        buffer = self._map(entry.path)
        array = np.frombuffer(buffer, DISK_DTYPES[entry.dtype], _numel(entry.shape), entry.offset)
        return array.reshape(entry.shape)

    @property
    def weight_format(self) -> str:
        """How the linear layers are stored: "awq" or "fp8" if any is, else their dtype
        ("bf16", ...)."""
        if self._awq:
            return "awq"
        linear = [e.dtype for n, e in self.entries.items() if is_linear(n)]
        return "fp8" if "F8_E4M3" in linear else (linear[0] if linear else "BF16").lower()

    def float32(self, name: str) -> np.ndarray:
        """The tensor upcast to float32 (a new array); FP8 and AWQ weights dequantized."""
        groups = self.awq_groups(name)
        if groups is not None:
            return awq.dequantize(*groups)
        blocks = self.fp8_blocks(name)
        if blocks is not None:
            return fp8.dequantize(*blocks)
        array = self.raw(name)
        if self.entries[name].dtype == "BF16":
            return bf16_bits_to_f32(array)
        return array.astype(np.float32)

    def bf16_bits(self, name: str) -> np.ndarray:
        """The tensor as bfloat16 bit patterns, rounding fp16/fp32 (and dequantized FP8 and
        AWQ)."""
        if name not in self._awq and self.entries[name].dtype == "BF16":
            return self.raw(name)
        return f32_to_bf16_bits(self.float32(name))

    def awq_groups(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """An AWQ layer's (qweight, qzeros, scales as float32), `<module>.weight` naming it;
        None for a tensor stored in any other way."""
        module = self._awq.get(name)
        if module is None:
            return None
        return (self.raw(f"{module}.qweight"), self.raw(f"{module}.qzeros"),
                self.float32(f"{module}.scales"))

    def fp8_blocks(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """An FP8 tensor's e4m3 codes (a view into the file) and its block scales as float32;
        None for a tensor stored in any other dtype."""
        if name in self._awq or self.entries[name].dtype != "F8_E4M3":
            return None
        return self.raw(name), self._scales[name]

    def lm_head_name(self) -> str:
        if self.config.tie_word_embeddings:
            return "model.embed_tokens.weight"
        return "lm_head.weight"

    def close(self) -> None:
        """Unmap the files; a mapping still viewed by an array stays until the array is gone."""
        for buffer in self._maps.values():
            with contextlib.suppress(BufferError):
                buffer.close()
        self._maps.clear()

    def _map(self, path: Path) -> mmap.mmap:
        if path not in self._maps:
            with path.open("rb") as handle:
                self._maps[path] = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        return self._maps[path]

    def _read_scales(self, name: str) -> np.ndarray:
        """An FP8 tensor's block scales as float32, checked: a NaN, infinite or negative scale
        (a damaged file) would silently poison every logit."""
        scale_name = name + fp8.SCALE_SUFFIX
        entry = self.entries[scale_name]
        raw = self.raw(scale_name)
        scales = bf16_bits_to_f32(raw) if entry.dtype == "BF16" else raw.astype(np.float32)
        bad = ~(np.isfinite(scales) & (scales >= 0))
        if bad.any():
            i, j = (int(k) for k in np.argwhere(bad)[0])
            raise ModelError(f"{entry.path}: tensor {scale_name} holds {scales[i, j]} at block "
                             f"({i}, {j}); scales must be finite and not negative (a damaged "
                             "file: download the model again)")
        return scales

    def _validate(self) -> None:
        for name, shape in self.config.tensor_shapes().items():
            module = name.removesuffix(".weight")
            if is_linear(name) and f"{module}.qweight" in self.entries:
                self._validate_awq(name, module, shape)
                continue
            entry = self.entries.get(name)
            if entry is None:
                where = INDEX_FILE if (self.directory / INDEX_FILE).is_file() else SINGLE_FILE
                raise ModelError(f"{self.directory / where}: tensor {name} is missing")
            if entry.shape != shape:
                raise ModelError(
                    f"{entry.path}: tensor {name} has shape {list(entry.shape)}, "
                    f"config.json implies {list(shape)}"
                )
            if entry.dtype == "F8_E4M3":
                self._validate_fp8(entry)
            elif entry.dtype not in FLOAT_DTYPES:
                raise ModelError(f"{entry.path}: tensor {name} has dtype {entry.dtype}; "
                                 "qwenchat reads it as BF16, F16 or F32")

    def _validate_awq(self, name: str, module: str, shape: tuple[int, ...]) -> None:
        """An AWQ linear layer: its three tensors present, of AWQ's dtypes and of the shapes
        config.json implies (qwenchat.model.awq)."""
        config_file = self.directory / "config.json"
        first = self.entries[f"{module}.qweight"]
        if self.config.quantization != "awq":
            raise ModelError(f"{first.path}: tensor {first.name} is AWQ-packed but {config_file} "
                             "declares no AWQ quantization_config (quant_method \"awq\")")
        out_features, in_features = shape
        if in_features % awq.GROUP or out_features % awq.PACK:
            raise ModelError(f"{first.path}: {module} is {out_features} x {in_features}; AWQ "
                             f"needs input columns in whole groups of {awq.GROUP} and output "
                             f"columns in words of {awq.PACK}")
        dtypes = {"qweight": ("I32",), "qzeros": ("I32",), "scales": FLOAT_DTYPES}
        for suffix, want in awq.packed_shapes(out_features, in_features).items():
            tensor = f"{module}.{suffix}"
            entry = self.entries.get(tensor)
            if entry is None:
                raise ModelError(f"{first.path}: AWQ tensor {tensor} is missing (an AWQ layer "
                                 "needs qweight, qzeros and scales)")
            if entry.dtype not in dtypes[suffix]:
                raise ModelError(f"{entry.path}: tensor {tensor} has dtype {entry.dtype}; AWQ's "
                                 f"{suffix} is {' or '.join(dtypes[suffix])}")
            if entry.shape != want:
                raise ModelError(f"{entry.path}: tensor {tensor} has shape {list(entry.shape)}, "
                                 f"but the {out_features} x {in_features} weight in AWQ's "
                                 f"layout needs {list(want)}")
        scales = self.float32(f"{module}.scales")
        bad = ~np.isfinite(scales)
        if bad.any():
            i, j = (int(k) for k in np.argwhere(bad)[0])
            raise ModelError(f"{self.entries[module + '.scales'].path}: tensor {module}.scales "
                             f"holds {scales[i, j]} at ({i}, {j}); scales must be finite (a "
                             "damaged file: download the model again)")
        self._awq[name] = module

    def _validate_fp8(self, entry: TensorEntry) -> None:
        name, config_file = entry.name, self.directory / "config.json"
        if not is_linear(name):
            raise ModelError(f"{entry.path}: tensor {name} is F8_E4M3; only the linear layers "
                             "(the *_proj weights) may be FP8")
        if self.config.quantization != "fp8":
            raise ModelError(f"{entry.path}: tensor {name} is F8_E4M3 but {config_file} "
                             "declares no FP8 quantization_config (quant_method \"fp8\")")
        scale = self.entries.get(name + fp8.SCALE_SUFFIX)
        if scale is None:
            raise ModelError(f"{entry.path}: FP8 tensor {name} has no scales "
                             f"({name}{fp8.SCALE_SUFFIX} is missing)")
        if scale.dtype not in FLOAT_DTYPES:
            raise ModelError(f"{scale.path}: tensor {scale.name} has dtype {scale.dtype}; "
                             "qwenchat reads BF16, F16 or F32 scales")
        want = fp8.scale_shape(entry.shape)
        if scale.shape != want:
            raise ModelError(f"{scale.path}: tensor {scale.name} has shape {list(scale.shape)}, "
                             f"but 128 x 128 blocks of the {list(entry.shape)} weight need "
                             f"{list(want)}")
        self._scales[name] = self._read_scales(name)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _index_entries(directory: Path) -> dict[str, TensorEntry]:
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelError(f"{index}: not a valid safetensors index ({exc})") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ModelError(f"{index}: weight_map must map tensor names to file names")
        shards = sorted(set(weight_map.values()))
        entries: dict[str, TensorEntry] = {}
        for shard in shards:
            entries.update(read_header(directory / shard))
        for name, shard in weight_map.items():
            if name not in entries:
                raise ModelError(f"{directory / shard}: tensor {name} (listed in {INDEX_FILE}) "
                                 "is not in the file")
        return entries
    single = directory / SINGLE_FILE
    if single.is_file():
        return read_header(single)
    raise ModelError(
        f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}; qwenchat needs safetensors weights"
    )


@dataclass(frozen=True)
class TensorOut:
    """A tensor to write: its header entry, and what makes its bytes when their turn comes
    (so that a large file is written one tensor at a time)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    data: Callable[[], bytes]


def write_safetensors(path: Path, tensors: Sequence[TensorOut],
                      before_each: Callable[[TensorOut], None] = lambda _: None) -> None:
    """One safetensors file: the header (padded to 8 bytes), then each tensor's bytes in
    order, each checked against the size its header entry gave."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for t in tensors:
            before_each(t)
            data = t.data()
            if len(data) != t.nbytes:
                raise AssertionError(f"{t.name}: {len(data)} bytes where {t.nbytes} were set")
            handle.write(data)


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse one safetensors header and check every tensor's byte range against the file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise ModelError(f"{path}: file is truncated (no safetensors header)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise ModelError(f"{path}: header length {header_len} does not fit in the "
                                 f"{size}-byte file (truncated or not safetensors)")
            header = json.loads(handle.read(header_len))
    except FileNotFoundError:
        raise ModelError(f"{path}: weight file not found") from None
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise ModelError(f"{path}: safetensors header is not a JSON object")
    data_start = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = str(spec["dtype"]), tuple(int(d) for d in spec["shape"])
            begin, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ModelError(f"{path}: tensor {name} has a malformed header entry") from None
        if not 0 <= begin <= end:
            raise ModelError(f"{path}: tensor {name} has an invalid byte range [{begin}, {end}]")
        if dtype not in DISK_DTYPES:
            raise ModelError(f"{path}: tensor {name} has dtype {dtype}; qwenchat reads BF16, "
                             "F16, F32, FP8 (F8_E4M3) and AWQ (I32 codes) checkpoints")
        expected = _numel(shape) * DISK_DTYPES[dtype].itemsize
        if end - begin != expected:
            raise ModelError(f"{path}: tensor {name} spans {end - begin} bytes but its shape "
                             f"{list(shape)} and dtype {dtype} need {expected}")
        if data_start + end > size:
            raise ModelError(f"{path}: file is truncated: tensor {name} ends at byte "
                             f"{data_start + end} but the file has {size} bytes")
        entries[name] = TensorEntry(name, path, dtype, shape, data_start + begin, expected)
    return entries

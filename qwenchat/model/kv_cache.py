"""The KV cache's formats (`--kv-cache`): what a cached key or value row holds.

  bf16  every value as the GPU's bf16 (the CPU engine keeps float32: it is the oracle);
  int8  each row of head_dim values (one head, one token) as int8 codes and one float scale:
        scale = max |x| / 127, code = round(x / scale), a value is code x scale.

A row's scale is its own (per head and token), so a large key elsewhere costs no precision
here and appending a token never rescales what is cached. INT8 rather than FP8 e4m3 with the
same scales: measured on random 0.6B-shaped weights, 1,024-token prompt, 64 steps, against
float32 keys and values, int8 rows give a median relative logit error of 1.5e-2, e4m3 rows
5.7e-2 (3 mantissa bits), bf16 rounding 3.8e-3; int8 blocks of 32 (llama.cpp's q8_0) 1.2e-2
for 12 more bytes a row (docs/perf.md). NumPy only: the reference engine stores exactly the
values an 8-bit cache holds (codes times their scale, as float32).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from qwenchat.model.config import Qwen3Config

KV_CACHE_CHOICES = ("bf16", "int8")
INT8_MAX = 127


def bytes_per_value(kv_format: str) -> int:
    """Bytes of one cached value (a row's scale comes on top: row_scale_bytes)."""
    return 2 if kv_format == "bf16" else 1


def row_scale_bytes(kv_format: str) -> int:
    """Bytes of one cached row's scale (one head, one token)."""
    return 0 if kv_format == "bf16" else 4


def bytes_per_position(config: Qwen3Config, kv_format: str = "bf16") -> int:
    """Bytes one cached token takes over every layer: a key and a value row of each kv head,
    each with its scale in an 8-bit cache."""
    scales = config.num_hidden_layers * 2 * config.num_key_value_heads * row_scale_bytes(kv_format)
    return config.kv_bytes_per_position(bytes_per_value(kv_format)) + scales


def cached(rows: np.ndarray, kv_format: str) -> np.ndarray:
    """The values a cache of `kv_format` holds for `rows` (float32, last axis: a head's
    head_dim values): as they are for bf16 (the reference keeps float32), else each row's
    int8 codes times its scale."""
    if kv_format == "bf16":
        return rows
    if kv_format != "int8":
        raise ValueError(f"unknown KV-cache format {kv_format!r}; known: "
                         f"{', '.join(KV_CACHE_CHOICES)}")
    codes, scales = int8_rows(rows)
    return (codes * scales[..., None]).astype(np.float32)


def int8_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's (last axis) int8 codes and float32 scale, as an int8 cache stores them:
    scale = max |x| / 127, code = rint(x / scale) (0 for an all-zero row)."""
    x = np.asarray(rows, np.float32)
    scale = np.abs(x).max(axis=-1, keepdims=True) / np.float32(INT8_MAX)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.clip(np.rint(x / safe), -INT8_MAX, INT8_MAX).astype(np.int8)
    return codes, scale[..., 0]

"""Floating-point formats NumPy lacks, as raw bit patterns: bfloat16 (uint16) and float8 e4m3
(uint8), with the exact conversions both engines share."""

from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0  # the largest finite e4m3 value


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bfloat16 (ties to even), returned as uint16 bit patterns."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(values)
    out = rounded.astype(np.uint16)
    out[nan] = 0x7FC0
    return out


def _e4m3_values() -> np.ndarray:
    """The float32 value of each of the 256 e4m3 codes (S.EEEE.MMM, bias 7, no infinities;
    S.1111.111 is NaN)."""
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 0xF, (codes & 7).astype(np.float64)
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0**-6,
                         (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    magnitude[(codes & 0x7F) == 0x7F] = np.nan
    return np.where(codes & 0x80, -magnitude, magnitude).astype(np.float32)


E4M3_VALUES = _e4m3_values()


def e4m3_to_f32(codes: np.ndarray) -> np.ndarray:
    return E4M3_VALUES[codes]


def f32_to_e4m3(values: np.ndarray) -> np.ndarray:
    """The nearest e4m3 codes (ties to even), saturating at ±448; NaN stays NaN."""
    v = np.ascontiguousarray(values, dtype=np.float32)
    bits = v.view(np.uint32)
    magnitude = bits & np.uint32(0x7FFFFFFF)
    # Normal range: keep 3 of float32's 23 mantissa bits, rounding to nearest even, and
    # re-bias the exponent (127 -> 7); a carry out of the mantissa bumps the exponent as it
    # should. Below 2^-6 the steps are 2^-9 apart (rint is round-half-even; 8 steps is the
    # smallest normal, code 8, so the two ranges meet). 32-bit integers throughout: this runs
    # over every weight of a model quantized at load time.
    rounded = (magnitude + np.uint32(0x7FFFF) + ((magnitude >> 20) & np.uint32(1))) >> 20
    code = rounded.view(np.int32) - np.int32((127 - 7) << 3)
    small = magnitude < np.uint32(0x3C800000)  # 2^-6
    if small.any():
        tiny = magnitude[small].view(np.float32) * np.float32(512)
        code[small] = np.rint(tiny).astype(np.int32)
    np.clip(code, 0, 0x7E, out=code)
    code[magnitude > np.uint32(0x7F800000)] = 0x7F  # NaN
    code |= (bits >> 31).view(np.int32) << 7
    return code.astype(np.uint8)

"""The 8-bit KV cache's format (qwenchat/model/kv_cache.py) and the reference engine with it."""

from __future__ import annotations

import numpy as np
import pytest
from hf_compare import relative_error
from tiny_model import tiny_config

from qwenchat.engine.reference import ReferenceEngine
from qwenchat.model.config import Qwen3Config
from qwenchat.model.kv_cache import KV_CACHE_CHOICES, bytes_per_value, cached, row_scale_bytes
from qwenchat.model.random_weights import RandomWeights


def test_int8_rows_are_codes_times_their_own_scale():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((3, 5, 64)).astype(np.float32) * np.float32(7)
    rows[1, 2] *= 1000  # one large row costs the others nothing
    rows[2, 4] = 0.0  # an all-zero row stays zero
    held = cached(rows, "int8")
    assert held.dtype == np.float32 and held.shape == rows.shape
    scale = np.abs(rows).max(axis=-1, keepdims=True) / np.float32(127)
    safe = np.where(scale > 0, scale, 1)
    codes = held / safe
    assert np.allclose(codes, np.rint(codes), atol=1e-4) and np.rint(np.abs(codes)).max() == 127
    assert np.all(np.abs(held - rows) <= scale / 2 * (1 + 1e-6))
    assert not held[2, 4].any()
    # each row's largest value is kept (its code is ±127)
    ends = np.abs(rows).argmax(axis=-1)
    assert np.allclose(np.take_along_axis(held, ends[..., None], -1),
                       np.take_along_axis(rows, ends[..., None], -1), rtol=1e-6)


def test_bf16_rows_are_kept_and_other_formats_are_refused():
    rows = np.linspace(-1, 1, 32, dtype=np.float32).reshape(2, 16)
    assert cached(rows, "bf16") is rows
    with pytest.raises(ValueError, match="bf16, int8"):
        cached(rows, "fp8")
    assert KV_CACHE_CHOICES == ("bf16", "int8")
    assert (bytes_per_value("bf16"), row_scale_bytes("bf16")) == (2, 0)
    assert (bytes_per_value("int8"), row_scale_bytes("int8")) == (1, 4)


def test_the_reference_with_an_int8_cache_follows_the_float_cache_closely():
    """Teacher-forced greedy steps: the int8 cache's logits within 3e-2 of the float32
    cache's (the relative error of the largest logit), and its cache holds int8 rows."""
    config = Qwen3Config.from_dict(tiny_config(max_position_embeddings=512))
    weights = RandomWeights(config, seed=4)
    plain = ReferenceEngine(config, weights, 256)
    eight = ReferenceEngine(config, weights, 256, kv_cache="int8")
    assert (plain.kv_format, eight.kv_format) == ("bf16", "int8")
    prompt = [int(i) for i in np.random.default_rng(1).integers(0, config.vocab_size, 100)]
    worst = relative_error(eight.prefill_logits(prompt)[-1], plain.prefill_logits(prompt)[-1])
    for _ in range(32):
        token = int(np.argmax(plain.last_logits()))
        worst = max(worst, relative_error(eight.last_logits(), plain.last_logits()))
        plain.prefill([token])
        eight.prefill([token])
    assert 0 < worst <= 3e-2
    keys = eight._k[0, :, : eight.position]
    scale = np.abs(keys).max(axis=-1, keepdims=True) / np.float32(127)
    codes = keys / np.where(scale > 0, scale, 1)
    assert np.allclose(codes, np.rint(codes), atol=1e-3)

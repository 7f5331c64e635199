"""The weight formats as objects (qwenchat/model/formats.py): their rows' geometry on the GPU,
their bytes and kernel defines, against the layouts the kernels read (cuda_src/weights.cuh)."""

from __future__ import annotations

import pytest

from qwenchat.model.formats import BF16, FORMATS, FP8, INT4, gpu_format, is_linear
from qwenchat.model.presets import PRESETS


@pytest.mark.parametrize(("fmt", "cols", "codes", "records"), [
    (BF16, 1024, 2048, 0),
    (FP8, 1024, 1024, 32),    # eight float32 scales, a 16-byte multiple already
    (FP8, 272, 272, 16),      # three scales (the last block partial), padded to 16
    (FP8, 17408, 17408, 544),
    (INT4, 1024, 512, 32),    # eight (scale, zero) f16 pairs
    (INT4, 2560, 1280, 80),
])
def test_a_row_is_its_codes_then_its_records_padded_to_16_bytes(fmt, cols, codes, records):
    assert (fmt.code_bytes(cols), fmt.record_bytes(cols)) == (codes, records)
    assert fmt.row_bytes(cols) == codes + records and fmt.row_bytes(cols) % 16 == 0
    assert fmt.linear_bytes((3, cols)) == 3 * fmt.row_bytes(cols)
    assert fmt.narrow == (fmt is not BF16)


def test_each_format_selects_its_kernels_by_one_define():
    assert (BF16.defines(), FP8.defines(), INT4.defines()) == ({}, {"QW_FP8": 1}, {"QW_INT4": 1})
    assert list(FORMATS) == ["bf16", "fp8", "int4"]


def test_what_a_stored_format_runs_as_on_the_gpu():
    assert gpu_format("fp8") is FP8 and gpu_format("int4") is INT4
    for stored in ("bf16", "f16", "f32", "none"):
        assert gpu_format(stored) is BF16


def test_weight_bytes_count_the_linear_layers_in_the_format_and_the_rest_in_bf16():
    config = PRESETS["qwen3-0.6b"]
    shapes = config.tensor_shapes()
    linear = {n: s for n, s in shapes.items() if is_linear(n)}
    assert len(linear) == 7 * config.num_hidden_layers
    rest = sum(2 * s[0] * (s[1] if len(s) > 1 else 1) for n, s in shapes.items() if n not in linear)
    for fmt in FORMATS.values():
        assert fmt.weight_bytes(shapes) == rest + sum(fmt.linear_bytes(s) for s in linear.values())
    # FP8 halves the linear layers' bytes and adds a scale a 128 columns of a row.
    assert FP8.weight_bytes(shapes) < BF16.weight_bytes(shapes) < 2 * FP8.weight_bytes(shapes)
    assert not is_linear("model.embed_tokens.weight")
    assert not is_linear("model.layers.0.input_layernorm.weight")
    assert is_linear("model.layers.27.mlp.down_proj.weight")

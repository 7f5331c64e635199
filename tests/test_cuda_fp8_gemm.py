"""Issue 25's draft FP8 GEMM (cuda_src/gemm_fp8_sm90.cu) against NumPy: the activation
quantizer against fp8.quantize_activations, and the e4m3 x e4m3 products with their block
scales against the dequantized matrices' product (GPU only, sm_90; skipped elsewhere).
Written without a GPU: the first run is the next session's."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from test_cuda_engine import download, poisoned, rel_err, upload

from qwenchat.model import fp8
from qwenchat.model.config import Qwen3Config
from qwenchat.model.floats import bf16_bits_to_f32, e4m3_to_f32, f32_to_bf16_bits

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_gpu")]

SHARED = 6 * 2 * 128 * 128 + 1024  # gemm_fp8_sm90.cu's SHARED_BYTES


@pytest.fixture(scope="module")
def fp8_gemm():
    from qwenchat.engine.cuda import runtime as rt
    from qwenchat.engine.cuda.compiler import KernelCache, kernel_defines

    if rt.Device(0).arch != "sm_90":
        pytest.skip("gemm_fp8_sm90.cu needs an sm_90 GPU")
    config = Qwen3Config(vocab_size=1000, hidden_size=256, intermediate_size=384,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=128)
    module = rt.Module(KernelCache().load("gemm_fp8_sm90.cu", "sm_90a",
                                          kernel_defines(config, "fp8")))
    for name in ("gemm_fp8_store", "gemm_fp8_add"):
        module.function(name).set_max_dynamic_shared(SHARED)
    return rt, module, rt.Stream()


def quantized_rows(rt, module, stream, x_bits: np.ndarray):
    """quantize_rows_e4m3 on bf16 rows: (codes buffer, scales buffer, codes, scales)."""
    m, k = x_bits.shape
    groups = -(-k // 128)
    codes, scales = poisoned(rt, m * k), poisoned(rt, m * groups * 4)
    rt.launch(module.function("quantize_rows_e4m3"), (groups, m), 32,
              [upload(rt, x_bits), ctypes.c_int(m), ctypes.c_int(k), ctypes.c_int(k), codes,
               scales], stream=stream)
    stream.synchronize()
    return (codes, scales, download(codes, np.uint8, (m, k)),
            download(scales, np.float32, (m, groups)))


@pytest.mark.parametrize(("m", "k"), [(5, 256), (33, 384), (1, 200)])
def test_activation_codes_are_the_references(fp8_gemm, m, k):
    rt, module, stream = fp8_gemm
    x = bf16_bits_to_f32(f32_to_bf16_bits(
        np.random.default_rng(m + k).standard_normal((m, k)).astype(np.float32)))
    _, _, codes, scales = quantized_rows(rt, module, stream, f32_to_bf16_bits(x))
    values = e4m3_to_f32(codes) * np.repeat(scales, 128, axis=1)[:, :k]
    assert np.array_equal(values, fp8.quantize_activations(x))


@pytest.mark.parametrize("kind", ["store", "add"])
@pytest.mark.parametrize(("m", "n", "k"), [(77, 256, 256), (130, 384, 384), (1, 128, 128)])
def test_fp8_products_match_the_dequantized_matrices(fp8_gemm, m, n, k, kind):
    rt, module, stream = fp8_gemm
    rng = np.random.default_rng(m + n + k)
    x_bits = f32_to_bf16_bits(rng.standard_normal((m, k)).astype(np.float32))
    a_codes, a_scales, codes, scales = quantized_rows(rt, module, stream, x_bits)
    a = e4m3_to_f32(codes) * np.repeat(scales, 128, axis=1)[:, :k]
    w_codes, w_scales = fp8.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    b = upload(rt, fp8.pack_rows(w_codes, w_scales))
    expected = a @ fp8.dequantize(w_codes, w_scales).T
    base = rng.standard_normal((m, n)).astype(np.float32) if kind == "add" else 0
    out = upload(rt, np.zeros((m, n), np.float32) + base)
    maps = [rt.tile_map(a_codes.ptr, m, k, 128, 128, swizzled_codes=True),
            rt.tile_map(b.ptr, n, k, 128, 128, swizzled_codes=True,
                        row_bytes=fp8.packed_row_bytes(k))]
    rt.launch(module.function(f"gemm_fp8_{kind}"), ((m + 127) // 128, (n + 127) // 128), 384,
              [*maps, a_scales, b, out, ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k),
               ctypes.c_int(n)], shared=SHARED, stream=stream)
    stream.synchronize()
    assert rel_err(download(out, np.float32, (m, n)), base + expected) <= 1e-4

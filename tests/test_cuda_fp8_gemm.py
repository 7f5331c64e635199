"""Issue 25's draft FP8 GEMM (cuda_src/gemm_fp8_sm90.cu) against NumPy: the activation
quantizer against fp8.quantize_activations, and the e4m3 x e4m3 products with their block
scales against the dequantized matrices' product (GPU only, sm_90; skipped elsewhere).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from test_cuda_engine import download, poisoned, rel_err, upload

from qwenchat.model import fp8
from qwenchat.model.config import Qwen3Config
from qwenchat.model.floats import bf16_bits_to_f32, e4m3_to_f32, f32_to_bf16_bits
from qwenchat.model.formats import FP8

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_gpu")]

SHARED = 193 * 1024  # gemm_fp8_sm90.cu's SHARED_BYTES
KERNELS = ("gemm_fp8_store_128", "gemm_fp8_store_256", "gemm_fp8_add_128", "gemm_fp8_add_256",
           "gemm_fp8_swiglu")


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
    for name in KERNELS:
        module.function(name).set_max_dynamic_shared(SHARED)
    return rt, module, rt.Stream()


def quantized_rows(rt, module, stream, x_bits: np.ndarray):
    """quantize_rows_e4m3 on bf16 rows: (codes buffer, scales buffer, codes, scales)."""
    m, k = x_bits.shape
    groups = -(-k // 128)
    codes, scales = poisoned(rt, m * k), poisoned(rt, m * groups * 4)
    rt.launch(module.function("quantize_rows_e4m3"), -(-m * groups // 8), 256,
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


def packed_weights(rng, n: int, k: int):
    codes, scales = fp8.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    return fp8.pack_rows(codes, scales), fp8.dequantize(codes, scales)


def maps(rt, a_codes, b, m: int, n: int, k: int):
    return [rt.tile_map(a_codes.ptr, m, k, 128, 128, swizzled_codes=True),
            rt.tile_map(b.ptr, n, k, 128, 128, swizzled_codes=True,
                        row_bytes=FP8.row_bytes(k))]


# Hopper's e4m3 products accumulate a 128-deep block in fewer bits than fp32 (about 14 of the
# mantissa's 23, DeepSeek-V3's report): 3e-4 of the largest output on these sizes, against
# 1e-6 for fp32 sums; each block's partial sums are promoted into fp32.
FP8_ACCUMULATION = 1e-3


@pytest.mark.parametrize("kernel", ["store_128", "store_256", "add_128", "add_256"])
@pytest.mark.parametrize(("m", "n", "k"), [(77, 256, 256), (130, 384, 384), (1, 128, 128),
                                           (300, 640, 1152)])
def test_fp8_products_match_the_dequantized_matrices(fp8_gemm, m, n, k, kernel):
    rt, module, stream = fp8_gemm
    rng = np.random.default_rng(m + n + k)
    x_bits = f32_to_bf16_bits(rng.standard_normal((m, k)).astype(np.float32))
    a_codes, a_scales, codes, scales = quantized_rows(rt, module, stream, x_bits)
    a = e4m3_to_f32(codes) * np.repeat(scales, 128, axis=1)[:, :k]
    packed, w = packed_weights(rng, n, k)
    b = upload(rt, packed)
    expected = a @ w.T
    base = rng.standard_normal((m, n)).astype(np.float32) if kernel.startswith("add") else 0
    out = upload(rt, np.zeros((m, n), np.float32) + base)
    width = int(kernel.split("_")[1])
    rt.launch(module.function(f"gemm_fp8_{kernel}"), ((m + 127) // 128, -(-n // width)), 384,
              [*maps(rt, a_codes, b, m, n, k), a_scales, b, out, rt.Ptr(0), ctypes.c_int(m),
               ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(0), ctypes.c_int(n)],
              shared=SHARED, stream=stream)
    stream.synchronize()
    assert rel_err(download(out, np.float32, (m, n)), base + expected) <= FP8_ACCUMULATION


@pytest.mark.parametrize(("m", "inter", "k"), [(77, 256, 256), (200, 384, 640)])
def test_fp8_swiglu_writes_the_references_e4m3_activations(fp8_gemm, m, inter, k):
    """silu(x . gate^T) * (x . up^T), quantized as fp8.quantize_activations in the epilogue."""
    rt, module, stream = fp8_gemm
    rng = np.random.default_rng(m + inter)
    x_bits = f32_to_bf16_bits(rng.standard_normal((m, k)).astype(np.float32))
    a_codes, a_scales, codes, scales = quantized_rows(rt, module, stream, x_bits)
    a = e4m3_to_f32(codes) * np.repeat(scales, 128, axis=1)[:, :k]
    packed, w = packed_weights(rng, 2 * inter, k)
    b = upload(rt, packed)
    gate, up = a @ w[:inter].T, a @ w[inter:].T
    act = gate / (1 + np.exp(-gate)) * up
    groups = inter // 128
    out_codes, out_scales = poisoned(rt, m * inter), poisoned(rt, m * groups * 4)
    rt.launch(module.function("gemm_fp8_swiglu"), ((m + 127) // 128, groups), 384,
              [*maps(rt, a_codes, b, m, 2 * inter, k), a_scales, b, out_codes, out_scales,
               ctypes.c_int(m), ctypes.c_int(inter), ctypes.c_int(k), ctypes.c_int(inter),
               ctypes.c_int(inter)], shared=SHARED, stream=stream)
    stream.synchronize()
    got_scales = download(out_scales, np.float32, (m, groups))
    ref_scales = np.abs(act.reshape(m, groups, 128)).max(axis=2) / 448
    # (act multiplies two products: twice their error)
    assert np.abs(got_scales / ref_scales - 1).max() <= 2 * FP8_ACCUMULATION
    expanded = np.repeat(got_scales, 128, 1)
    ours = e4m3_to_f32(download(out_codes, np.uint8, (m, inter))) * expanded
    # Each value within half an e4m3 step of act (3 mantissa bits: 1/16 of the value; below
    # the normal range 2^-10 of the scale), plus the products' error on the group's scale.
    bound = np.abs(act) / 16 + expanded * (2.0**-10 + 448 * 2 * FP8_ACCUMULATION)
    assert (np.abs(ours - act) <= bound).all()

"""verify.cu, the speculative pass's linear layers and LM head (GPU only): every kernel and
row count 1-8, bf16 and FP8 weights, each input kind, against NumPy with the
same bf16 rounding of the activations (and of code x scale for FP8) that the kernels make."""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest

from qwenchat.model.floats import bf16_bits_to_f32, e4m3_to_f32, f32_to_bf16_bits

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_gpu")]


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def engine(request):
    from qwenchat.engine.cuda.engine import CudaEngine
    from qwenchat.model.presets import PRESETS
    from qwenchat.model.random_weights import RandomWeights

    config = dataclasses.replace(PRESETS["qwen3-0.6b"], num_hidden_layers=2)
    engine = CudaEngine(config, RandomWeights(config, seed=1, weight_format=request.param),
                        ctx=512)
    engine._verify_state()
    yield engine
    engine.close()


def host_weights(engine, buffer, rows: int, cols: int, fp8: bool) -> np.ndarray:
    """A layer's weights as the kernel multiplies them: bf16 values, or FP8 code x its
    block's scale rounded to bf16."""
    if not fp8:
        bits = np.empty((rows, cols), np.uint16)
        buffer.download(bits)
        return bf16_bits_to_f32(bits)
    from qwenchat.model.formats import FP8

    packed = np.empty((rows, FP8.row_bytes(cols)), np.uint8)
    buffer.download(packed)
    blocks = -(-cols // 128)
    scales = np.ascontiguousarray(packed[:, cols : cols + 4 * blocks]).view(np.float32)
    values = e4m3_to_f32(packed[:, :cols]) * np.repeat(scales, 128, axis=1)[:, :cols]
    return bf16_bits_to_f32(f32_to_bf16_bits(values))


def bf16(values: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(f32_to_bf16_bits(values))


def host_norm(buffer, cols: int) -> np.ndarray:
    bits = np.empty(cols, np.uint16)
    buffer.download(bits)
    return bf16_bits_to_f32(bits)


@pytest.mark.parametrize("name", ["verify_xn", "verify_attn", "verify_attn_r2", "verify_act",
                                  "verify_head"])
def test_verify_products_equal_numpy_for_every_row_count(engine, name):
    """verify_xn and verify_head take an RMSNorm's input as the product before left it
    (verify.cuh's PassNorm: bf16 rows of x times the norm's weights, and sums of squares a
    token in parts) and multiply each token's sums by its 1/rms; verify_attn and verify_act
    add to the residual stream and leave the next norm's input: x_new times its weights in
    bf16, and each block's sum of x_new^2 a token."""
    from qwenchat.engine.cuda import runtime as rt
    from qwenchat.engine.cuda.verify import VERIFY_KERNELS, VERIFY_ROWS, VERIFY_TILE

    assert name in VERIFY_KERNELS
    kind = name.split("_")[1]
    per_block = VERIFY_TILE * (2 if name.endswith("_r2") else 1)
    cfg, w = engine.config, engine.layers[0]
    weight, a_buffer, k, n_out = {
        "xn": (w.qkv, engine.pass_xg, cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size),
        "attn": (w.o, engine.verify_attn, cfg.q_size, cfg.hidden_size),
        "act": (w.down, engine.act, cfg.intermediate_size, cfg.hidden_size),
        "head": (engine.lm_head, engine.pass_xg, cfg.hidden_size, cfg.vocab_size)}[kind]
    adds = kind in ("attn", "act")  # o_proj and down add to the residual stream
    rows = n_out - (0 if adds else 8)  # (a last tile cut short; the residual's rows all)
    blocks = -(-rows // per_block)
    fp8 = engine.weight_format == "fp8" and kind != "head"  # the LM head is bf16 in both
    weights = host_weights(engine, weight, n_out, k, fp8)[:rows]
    # the LM head's rows: its first and last 2,048 (its last tile cut short too)
    check = np.r_[0:2048, rows - 2048 : rows] if kind == "head" else np.arange(rows)
    weights = weights[check].astype(np.float64)
    gain = host_norm(w.post_norm, cfg.hidden_size)  # (the next norm's, for o_proj and down)
    eps, parts = np.float32(cfg.rms_norm_eps), 5
    rng = np.random.default_rng(7)
    out = rt.DeviceBuffer(VERIFY_ROWS * rows * 4)
    try:
        for n in range(1, VERIFY_ROWS + 1):
            a = rng.standard_normal((VERIFY_ROWS, k)).astype(np.float32) * 3
            if kind == "attn":  # float activations, rounded by the kernel
                a_buffer.upload(a)
            else:
                a_buffer.upload(f32_to_bf16_bits(a))
            before = rng.standard_normal((VERIFY_ROWS, rows)).astype(np.float32)
            out.upload(before)
            if adds:
                args = [w.post_norm, engine.pass_xg, engine.pass_sq]
            else:  # sums of squares of some x, in parts
                squares = rng.uniform(0.5, 2.0, (VERIFY_ROWS, parts)).astype(np.float32) * k
                engine.pass_sq.upload(squares)
                args = [engine.pass_sq, ctypes.c_int(parts), ctypes.c_float(eps)]
            engine._launch(name, blocks, 256, a_buffer, ctypes.c_int(n), weight,
                           ctypes.c_int(rows), out, *args)
            engine.stream.synchronize()
            got = np.empty((VERIFY_ROWS, rows), np.float32)
            out.download(got)
            want = bf16(a[:n]).astype(np.float64) @ weights.T
            if adds:
                want += before[:n, check]
            else:
                want /= np.sqrt(squares[:n].astype(np.float64).sum(axis=1, keepdims=True) / k
                                + eps)
            scale = np.abs(want).max()
            assert np.abs(got[:n, check] - want).max() <= 2e-5 * scale, (name, n)
            assert np.array_equal(got[n:], before[n:]), "rows past n are left alone"
            if adds:  # the next norm's input, from the new x as the kernel stored it
                xg = np.empty((VERIFY_ROWS, rows), np.uint16)
                engine.pass_xg.download(xg)
                np.testing.assert_array_equal(xg[:n], f32_to_bf16_bits(got[:n] * gain))
                sq = np.empty(VERIFY_ROWS * blocks, np.float32)
                engine.pass_sq.download(sq)
                x2 = got[:n].astype(np.float64) ** 2
                want_sq = np.add.reduceat(x2, np.arange(0, rows, per_block), axis=1)
                np.testing.assert_allclose(sq[: n * blocks].reshape(n, blocks), want_sq,
                                           rtol=1e-5)
    finally:
        out.free()


def test_the_norm_rows_kernel_leaves_what_a_product_would(engine):
    """verify_norm_rows (the embedding's rows, a sparse layer's output): bf16 of x times the
    norm's weights and one sum of squares a token."""
    cfg = engine.config
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, cfg.hidden_size)).astype(np.float32) * 2
    engine.x.upload(x)
    w = engine.layers[1].input_norm
    engine._launch("verify_norm_rows", 5, 1024, engine.x, ctypes.c_int(5), w, engine.pass_xg,
                   engine.pass_sq)
    engine.stream.synchronize()
    xg = np.empty((5, cfg.hidden_size), np.uint16)
    engine.pass_xg.download(xg)
    np.testing.assert_array_equal(xg, f32_to_bf16_bits(x * host_norm(w, cfg.hidden_size)))
    sq = np.empty(5, np.float32)
    engine.pass_sq.download(sq)
    np.testing.assert_allclose(sq, (x.astype(np.float64) ** 2).sum(axis=1), rtol=1e-5)


@pytest.fixture(scope="module", params=[("bf16", "bf16", 16, 8), ("fp8", "int8", 32, 4)],
                ids=lambda p: f"{p[0]}-kv{p[1]}-group{p[2] // p[3]}")
def pass_engine(request):
    """Two-layer engines whose query groups are 0.6B's (2) and 30B-A3B's (8)."""
    from qwenchat.engine.cuda.engine import CudaEngine
    from qwenchat.model.presets import PRESETS
    from qwenchat.model.random_weights import RandomWeights

    weights, kv, heads, kv_heads = request.param
    config = dataclasses.replace(PRESETS["qwen3-0.6b"], num_hidden_layers=2,
                                 num_attention_heads=heads, num_key_value_heads=kv_heads)
    engine = CudaEngine(config, RandomWeights(config, seed=3, weight_format=weights), ctx=2048,
                        kv_cache=kv)
    yield engine
    engine.close()


@pytest.mark.parametrize("pos", [1, 300, 1500])
def test_a_passs_packed_attention_gives_the_decode_attentions_logits(pass_engine, pos):
    """The pass with its attention on attn_pass_packed (prefill's tensor-core attention, every
    row's query heads of a kv head in a block; bf16 rows into o_proj) and on the decode
    kernels: the same logits within bf16's rounding of the attention rows."""
    engine = pass_engine
    cfg = engine.config
    rng = np.random.default_rng(pos)
    ids = [int(i) for i in rng.integers(0, cfg.vocab_size, pos + 8)]
    seen = {}
    try:
        for attention in ("decode", "packed"):
            engine.truncate(0)
            engine.prefill(ids[:pos])
            engine.pass_attention = attention
            engine._verify_state()
            engine._upload_pass_ids(ids[pos:])
            engine._verify_forward(pos, 8)
            engine.stream.synchronize()
            out = np.empty((8, cfg.vocab_size), np.float32)
            engine.pass_logits.download(out)
            seen[attention] = out
    finally:
        engine.pass_attention = "packed"
    assert np.isfinite(seen["packed"]).all()
    assert not np.array_equal(seen["packed"], seen["decode"])  # two computations, not one graph
    spread = np.abs(seen["decode"]).max()
    np.testing.assert_allclose(seen["packed"], seen["decode"], atol=2e-2 * spread, rtol=0)


def test_a_verify_product_is_the_same_each_run(engine):
    """No atomics: the warps' sums (and the norm's parts) are added in one order, so repeated
    products are equal bit for bit."""
    from qwenchat.engine.cuda import runtime as rt

    cfg, w = engine.config, engine.layers[1]
    rows = 2 * cfg.intermediate_size
    rng = np.random.default_rng(3)
    engine.pass_xg.upload(f32_to_bf16_bits(rng.standard_normal((8, cfg.hidden_size))))
    engine.pass_sq.upload(rng.uniform(1, 2, (8, 7)).astype(np.float32))
    out = rt.DeviceBuffer(8 * rows * 4)
    try:
        results = []
        for _ in range(3):
            engine._verify_product("xn", engine.pass_xg, w.gate_up, out, 8, rows, 7)
            engine.stream.synchronize()
            got = np.empty((8, rows), np.float32)
            out.download(got)
            results.append(got)
        assert all(np.array_equal(results[0], r) for r in results[1:])
    finally:
        out.free()

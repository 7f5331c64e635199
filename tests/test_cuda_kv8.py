"""The int8 KV cache on the GPU (cuda_src/kv8.cuh) against the reference engine's int8 cache
(GPU only; skipped elsewhere)."""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest
from hf_compare import relative_error
from test_cuda_engine import (
    download,
    poisoned,
    reference_attention,
    rel_err,
    run_decode_attention,
    run_prefill_attention,
    upload,
)
from test_cuda_fp8 import greedy_against_the_reference

from qwenchat.engine.reference import ReferenceEngine
from qwenchat.model.config import Qwen3Config
from qwenchat.model.floats import bf16_bits_to_f32, f32_to_bf16_bits
from qwenchat.model.kv_cache import int8_rows
from qwenchat.model.presets import PRESETS
from qwenchat.model.random_weights import RandomWeights

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_gpu")]


@pytest.fixture(scope="module", params=["qwen3-0.6b", "qwen3-8b"])
def shape(request):
    config = dataclasses.replace(PRESETS[request.param], num_hidden_layers=2)
    return config, RandomWeights(config, seed=3)


@pytest.mark.parametrize(("decode", "prefill_kernels"), [("megakernel", "auto"),
                                                       ("layered", "portable")])
def test_int8_cache_prefill_and_greedy_follow_the_reference(shape, decode, prefill_kernels):
    from test_cuda_fp8 import one_step_a_launch

    from qwenchat.engine.cuda.engine import CudaEngine

    config, weights = shape
    gpu = CudaEngine(config, weights, ctx=1024, kv_cache="int8", decode=decode,
                     prefill_kernels=prefill_kernels)
    one_step_a_launch(gpu)
    ref = ReferenceEngine(config, weights, 1024, kv_cache="int8")
    try:
        assert gpu.kv_format == "int8" and gpu.decode == decode
        prompt = [int(i) for i in np.random.default_rng(4).integers(0, config.vocab_size, 300)]
        # in two parts: the second attends to the first through the cache's int8 rows
        assert relative_error(gpu.prefill_logits(prompt[:200]),
                              ref.prefill_logits(prompt[:200])) <= 2e-2
        assert relative_error(gpu.prefill_logits(prompt[200:]),
                              ref.prefill_logits(prompt[200:])) <= 2e-2
        worst, ties = greedy_against_the_reference(gpu, ref, 64)
        print(f"{config.hidden_size}: worst {worst:.2e}; near-ties: {ties or 'none'}")
        assert worst <= 2e-2
    finally:
        gpu.close()


def test_int8_cache_takes_about_half_the_bytes_and_its_logits_stay_near_bf16s(shape):
    from qwenchat.engine.cuda.engine import CudaEngine

    config, weights = shape
    eight = CudaEngine(config, weights, ctx=1024, kv_cache="int8")
    plain = CudaEngine(config, weights, ctx=1024)
    try:
        assert eight.kv_bytes < 0.52 * plain.kv_bytes
        prompt = [int(i) for i in np.random.default_rng(5).integers(0, config.vocab_size, 700)]
        error = relative_error(eight.prefill_logits(prompt), plain.prefill_logits(prompt))
        print(f"int8 against bf16 cache at 700 tokens: {error:.2e}")
        assert error <= 3e-2
    finally:
        eight.close()
        plain.close()


def test_a_short_prefill_on_the_pass_reads_the_int8_cache(shape):
    """Chunks of at most 8 tokens run as a speculative pass (verify.cu's graph, whose
    attention is attn_decode_partial with a row a token)."""
    from qwenchat.engine.cuda.engine import CudaEngine

    config, weights = shape
    gpu = CudaEngine(config, weights, ctx=512, kv_cache="int8")
    ref = ReferenceEngine(config, weights, 512, kv_cache="int8")
    try:
        prompt = [int(i) for i in np.random.default_rng(6).integers(0, config.vocab_size, 50)]
        gpu.prefill(prompt)
        ref.prefill(prompt)
        for n in (1, 6, 8):
            rows = [int(i) for i in np.random.default_rng(n).integers(0, config.vocab_size, n)]
            gpu.prefill(rows)
            ref.prefill(rows)
            assert relative_error(gpu.last_logits(), ref.last_logits()) <= 2e-2
    finally:
        gpu.close()


# --- each attention kernel against NumPy on int8 caches off the tile grid ----------------

ODD = Qwen3Config(vocab_size=1000, hidden_size=48, intermediate_size=80, num_hidden_layers=1,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=64)


def int8_cache(rng, kv_heads: int, capacity: int, head_dim: int):
    """A layer's int8 key (or value) buffer of random rows (every row, past the prompt too),
    as kv8.cuh lays it out, and the values it holds."""
    codes, scales = int8_rows(rng.standard_normal((kv_heads, capacity, head_dim))
                              .astype(np.float32) * rng.uniform(0.2, 3.0, (kv_heads, capacity, 1))
                              .astype(np.float32))
    raw = np.concatenate([codes.view(np.uint8).ravel(), scales.astype(np.float32).view(np.uint8)
                          .ravel()])
    return raw, codes.astype(np.float32) * scales[..., None]


@pytest.fixture(scope="module")
def int8_kernels():
    from qwenchat.engine.cuda import runtime as rt
    from qwenchat.engine.cuda.compiler import KernelCache, kernel_defines

    device = rt.Device(0)
    module = rt.Module(KernelCache().load("attention.cu", device.arch,
                                          kernel_defines(ODD, "bf16", "int8")))
    return rt, module, rt.Stream()


def query_rows(rng, n: int, config):
    return f32_to_bf16_bits(rng.standard_normal((n, config.num_attention_heads, config.head_dim))
                            .astype(np.float32))


@pytest.mark.parametrize(("start", "n", "splits"), [(0, 83, 1), (37, 130, 1), (200, 1, 3),
                                                    (450, 30, 5), (0, 64, 16)])
def test_int8_prefill_attention_matches_numpy(int8_kernels, start, n, splits):
    rt, module, stream = int8_kernels
    rng = np.random.default_rng(start + n)
    cap, d, kvh, heads = 509, ODD.head_dim, ODD.num_key_value_heads, ODD.num_attention_heads
    q = query_rows(rng, n, ODD)
    (k_raw, k), (v_raw, v) = int8_cache(rng, kvh, cap, d), int8_cache(rng, kvh, cap, d)
    got = run_prefill_attention(rt, module, stream, q, upload(rt, k_raw), upload(rt, v_raw),
                                start, cap, splits)
    length = start + n
    expected = reference_attention(bf16_bits_to_f32(q), k[:, :length], v[:, :length], start,
                                   heads // kvh)
    assert rel_err(got, expected) <= 2e-2


@pytest.mark.parametrize(("position", "splits"), [(0, 8), (300, 8), (4000, 24)])
def test_int8_decode_attention_matches_numpy(int8_kernels, position, splits):
    """attn_decode_partial: the per-op graph's and the speculative pass's attention."""
    rt, module, stream = int8_kernels
    rng = np.random.default_rng(position)
    cap, d, kvh, heads = 4099, ODD.head_dim, ODD.num_key_value_heads, ODD.num_attention_heads
    q = query_rows(rng, 1, ODD)
    (k_raw, k), (v_raw, v) = int8_cache(rng, kvh, cap, d), int8_cache(rng, kvh, cap, d)
    got = run_decode_attention(rt, module, stream, q, upload(rt, k_raw), upload(rt, v_raw),
                               position, cap, kvh, splits)
    length = position + 1
    expected = reference_attention(bf16_bits_to_f32(q), k[:, :length], v[:, :length], position,
                                   heads // kvh)
    # (code x scale is formed in floats here: only the query's bf16 and the sums' order differ)
    assert rel_err(got, expected) <= 1e-3


@pytest.fixture(scope="module", params=[64, 128])
def int8_hopper_attention(request):
    from qwenchat.engine.cuda import runtime as rt
    from qwenchat.engine.cuda.compiler import KernelCache, kernel_defines
    from qwenchat.engine.cuda.prefill import attention90_shared

    if rt.Device(0).arch != "sm_90":
        pytest.skip("attention_sm90.cu needs an sm_90 GPU")
    config = dataclasses.replace(ODD, head_dim=request.param)
    module = rt.Module(KernelCache().load("attention_sm90.cu", "sm_90a",
                                          kernel_defines(config, "bf16", "int8")))
    function = module.function("attn_prefill90")
    function.set_max_dynamic_shared(attention90_shared(config.head_dim))
    return rt, config, function, rt.Stream()


@pytest.mark.parametrize(("start", "n"), [(0, 83), (37, 130), (200, 1), (0, 300), (90, 257),
                                          (0, 400)])
def test_int8_hopper_prefill_attention_matches_numpy(int8_hopper_attention, start, n):
    """The converters' tiles: a capacity no tile divides (the last KV head's last tile runs
    past the buffer's rows: read as zeros), random rows past the prompt (masked)."""
    from qwenchat.engine.cuda.prefill import (
        ATTENTION90_QUERIES,
        ATTENTION90_THREADS,
        attention90_shared,
    )

    rt, config, function, stream = int8_hopper_attention
    rng = np.random.default_rng(start + n + config.head_dim)
    cap, d = 400, config.head_dim
    kvh, heads = config.num_key_value_heads, config.num_attention_heads
    q = query_rows(rng, n, config)
    (k_raw, k), (v_raw, v) = int8_cache(rng, kvh, cap, d), int8_cache(rng, kvh, cap, d)
    q_buffer, out = upload(rt, q), poisoned(rt, n * heads * d * 2)
    args = [rt.tile_map(q_buffer.ptr, n, heads * d, 128, 64), upload(rt, k_raw),
            upload(rt, v_raw), ctypes.c_int(start), ctypes.c_int(n), ctypes.c_int(cap),
            ctypes.c_float(d**-0.5), out]
    rt.launch(function, (heads, (n + ATTENTION90_QUERIES - 1) // ATTENTION90_QUERIES),
              ATTENTION90_THREADS, args, shared=attention90_shared(d), stream=stream)
    stream.synchronize()
    length = start + n
    expected = reference_attention(bf16_bits_to_f32(q), k[:, :length], v[:, :length], start,
                                   heads // kvh)
    got = bf16_bits_to_f32(download(out, np.uint16, (n, heads, d)))
    assert np.isfinite(got).all() and rel_err(got, expected) <= 2e-2


@pytest.fixture(scope="module", params=[64, 128])
def bf16_hopper_attention(request):
    from qwenchat.engine.cuda import runtime as rt
    from qwenchat.engine.cuda.compiler import KernelCache, kernel_defines
    from qwenchat.engine.cuda.prefill import attention90_shared

    if rt.Device(0).arch != "sm_90":
        pytest.skip("attention_sm90.cu needs an sm_90 GPU")
    config = dataclasses.replace(ODD, head_dim=request.param)
    module = rt.Module(KernelCache().load("attention_sm90.cu", "sm_90a", kernel_defines(config)))
    function = module.function("attn_prefill90")
    function.set_max_dynamic_shared(attention90_shared(config.head_dim))
    return rt, config, function, rt.Stream()


@pytest.mark.parametrize(("start", "n"), [(0, 83), (37, 130), (200, 1), (0, 300), (90, 257),
                                          (0, 400)])
def test_bf16_hopper_prefill_attention_matches_numpy(bf16_hopper_attention, start, n):
    """The ping-pong schedule (a bf16 cache): one to four key tiles a block, both warpgroups
    handing the tensor cores over, head_dim 64 and 128; rows past the prompt random (masked)."""
    from qwenchat.engine.cuda.prefill import (
        ATTENTION90_QUERIES,
        ATTENTION90_THREADS,
        attention90_shared,
    )

    rt, config, function, stream = bf16_hopper_attention
    rng = np.random.default_rng(start + n + config.head_dim)
    cap, d = 400, config.head_dim
    kvh, heads = config.num_key_value_heads, config.num_attention_heads
    q = query_rows(rng, n, config)
    k_bits, v_bits = (f32_to_bf16_bits(rng.standard_normal((kvh, cap, d)).astype(np.float32))
                      for _ in range(2))
    q_buffer, out = upload(rt, q), poisoned(rt, n * heads * d * 2)
    k_buffer, v_buffer = upload(rt, k_bits), upload(rt, v_bits)
    args = [rt.tile_map(q_buffer.ptr, n, heads * d, 128, 64),
            rt.tile_map(k_buffer.ptr, kvh * cap, d, 128, 64),
            rt.tile_map(v_buffer.ptr, kvh * cap, d, 128, 64), ctypes.c_int(start),
            ctypes.c_int(n), ctypes.c_int(cap), ctypes.c_float(d**-0.5), out]
    rt.launch(function, (heads, (n + ATTENTION90_QUERIES - 1) // ATTENTION90_QUERIES),
              ATTENTION90_THREADS, args, shared=attention90_shared(d), stream=stream)
    stream.synchronize()
    length = start + n
    expected = reference_attention(bf16_bits_to_f32(q), bf16_bits_to_f32(k_bits)[:, :length],
                                   bf16_bits_to_f32(v_bits)[:, :length], start, heads // kvh)
    got = bf16_bits_to_f32(download(out, np.uint16, (n, heads, d)))
    assert np.isfinite(got).all() and rel_err(got, expected) <= 2e-2


TAIL = 64  # the prompt's last positions whose prefill logits are compared


@pytest.mark.parametrize("position", [1024, 8192, 32768])
def test_int8_cache_stays_near_the_bf16_cache_at_long_positions(shape, position):
    """A prompt of `position` tokens, then one decode step: the logits of both against the
    bf16 cache's (the decode step in the megakernel where it can run). The prefill's logits
    are compared on its last TAIL positions (each attends to the whole cache before it): all
    of them would be 20 GB at 32K positions (tokens x vocab floats), which under -n 8 took the
    host's memory (issue 41, item 7)."""
    from test_cuda_fp8 import one_step_a_launch

    from qwenchat.engine.base import GenerateRequest
    from qwenchat.engine.cuda.engine import CudaEngine
    from qwenchat.sampling.params import LiveParams, SamplingParams

    config, weights = shape
    eight = CudaEngine(config, weights, ctx=position + 8, kv_cache="int8")
    plain = CudaEngine(config, weights, ctx=position + 8)
    one_step_a_launch(eight)
    try:
        prompt = [int(i) for i in np.random.default_rng(position).integers(0, config.vocab_size,
                                                                          position)]
        head, tail = prompt[:-TAIL], prompt[-TAIL:]
        eight.prefill(head)
        plain.prefill(head)
        prefill_error = relative_error(eight.prefill_logits(tail), plain.prefill_logits(tail))
        request = GenerateRequest(LiveParams(SamplingParams(temperature=0.0, max_tokens=2)),
                                  frozenset(), seed=0)
        tokens = iter(eight.generate(request))
        expected = plain.prefill_logits([next(tokens)])  # (the first comes from the prefill)
        next(tokens)  # chosen by the decode step of the first
        decode_error = relative_error(eight.last_logits(), expected)
        print(f"{config.hidden_size} at {position}: prefill {prefill_error:.2e}, "
              f"decode ({eight.decode}) {decode_error:.2e}")
        assert prefill_error <= 3e-2 and decode_error <= 3e-2
    finally:
        eight.close()
        plain.close()

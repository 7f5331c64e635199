"""The int8 KV cache on the GPU (cuda_src/kv8.cuh) against the reference engine's int8 cache
(GPU only; skipped elsewhere)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hf_compare import relative_error
from test_cuda_fp8 import greedy_against_the_reference

from qwenchat.engine.reference import ReferenceEngine
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

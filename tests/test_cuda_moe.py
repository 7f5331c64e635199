"""The mixture-of-experts router on the GPU (cuda_src/moe.cuh, moe.cu) against the reference
engine's (qwenchat/engine/reference.py, route): GPU only; skipped elsewhere."""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest

from qwenchat.engine.reference import route
from qwenchat.model.presets import PRESETS

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_gpu")]


# (experts, a token's, norm_topk_prob): Qwen3-30B-A3B's, and an odd count with an odd top-k.
@pytest.mark.parametrize(("experts", "top_k", "norm"), [(128, 8, True), (7, 3, False),
                                                         (60, 4, False), (33, 1, True)])
def test_the_router_chooses_the_references_experts_with_its_weights(experts, top_k, norm):
    from test_cuda_engine import download, poisoned, upload

    from qwenchat.engine.cuda import runtime as rt
    from qwenchat.engine.cuda.compiler import KernelCache, kernel_defines

    config = dataclasses.replace(PRESETS["qwen3-0.6b"], num_experts=experts,
                                 num_experts_per_tok=top_k, moe_intermediate_size=64,
                                 norm_topk_prob=norm)
    device = rt.Device(0)
    module = rt.Module(KernelCache().load("moe.cu", device.arch, kernel_defines(config)))
    rng = np.random.default_rng(experts + top_k)
    tokens = 301
    logits = (rng.standard_normal((tokens, experts)) * 2).astype(np.float32)
    logits[7, :] = 0.5  # every expert equal: the lowest numbers, each 1 / experts
    logits[8, 1::2] = logits[8, ::2][: experts // 2]  # pairs of equal logits
    weights = poisoned(rt, tokens * top_k * 4)
    chosen = poisoned(rt, tokens * top_k * 4)
    stream = rt.Stream()
    rt.launch(module.function("moe_route"), (tokens * 32 + 255) // 256, 256,
              [upload(rt, logits), ctypes.c_int(tokens), weights, chosen], stream=stream)
    stream.synchronize()
    got_w = download(weights, np.float32, (tokens, top_k))
    got_e = download(chosen, np.int32, (tokens, top_k))
    want_w, want_e = route(logits, top_k, norm)
    np.testing.assert_array_equal(got_e, want_e)
    np.testing.assert_allclose(got_w, want_w, rtol=2e-6, atol=0)
    assert list(got_e[7]) == list(range(top_k))
    assert np.all(np.diff(got_w, axis=1) <= 0)  # largest first


# --- the engine on tiny mixtures of experts (moe.cu, qwenchat/engine/cuda/moe.py) -------------
# TINY_MOE: 5 experts, 3 a token, layer 1 dense among sparse ones. "wide": experts of 128 rows
# on a 128-wide model, so that FP8's 128-column blocks are whole and int8 caches are not
# involved; 300 tokens x 3 experts make several 128-row tiles an expert in the grouped products.
MOE_SHAPES = {"tiny": {}, "wide": dict(hidden_size=128, intermediate_size=128, head_dim=32,
                                       moe_intermediate_size=128, num_experts=9,
                                       num_experts_per_tok=4, norm_topk_prob=False, seed=3)}


@pytest.fixture(scope="module", params=[(shape, dtype) for shape in MOE_SHAPES
                                        for dtype in ("BF16", "FP8")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def moe_dir(request, tmp_path_factory, tiny_tokenizer):
    from tiny_model import write_tiny_moe_model

    shape, dtype = request.param
    return write_tiny_moe_model(tmp_path_factory.mktemp(f"moe-{shape}-{dtype}") / "m",
                                dtype=dtype, tokenizer=tiny_tokenizer, **MOE_SHAPES[shape])


def test_prefill_logits_of_a_mixture_of_experts_match_the_reference(moe_dir):
    from test_cuda_engine import engines, rel_err

    gpu_engine, ref = engines(moe_dir)
    assert gpu_engine.decode == "layered"
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 400, 300)]
    assert rel_err(gpu_engine.prefill_logits(ids), ref.prefill_logits(ids)) <= 2e-2


def test_decode_of_a_mixture_of_experts_follows_the_reference_for_128_steps(moe_dir):
    from test_cuda_engine import engines, worst_greedy_decode_error

    gpu_engine, ref = engines(moe_dir)
    prompt = [int(i) for i in np.random.default_rng(1).integers(0, 400, 40)]
    gpu_engine.prefill(prompt)
    ref.prefill(prompt)
    assert worst_greedy_decode_error(gpu_engine, ref, 128) <= 2e-2


def test_a_mixture_of_experts_prefilled_in_parts_and_decoded_is_one_prefill(moe_dir):
    """A prefill in three calls, each taking another of the engine's routes (a chunk; a short
    prompt's captured graph; a few tokens as a speculative pass's rows, verify.py): the logits
    of the reference's prefill of the same tokens after each. (Decode steps: the test above.)"""
    from test_cuda_engine import engines, rel_err

    from qwenchat.engine.cuda.verify import VERIFY_ROWS

    gpu_engine, ref = engines(moe_dir)
    ids = [int(i) for i in np.random.default_rng(2).integers(0, 400, 200)]
    for part in (ids[:150], ids[150:195], ids[195:200]):
        gpu_engine.prefill(part)
        ref.prefill(part)
        assert rel_err(gpu_engine.last_logits(), ref.last_logits()) <= 2e-2, len(part)
    assert len(ids[195:200]) <= VERIFY_ROWS and gpu_engine.short_prompt_rows(150, 45) is not None


def test_a_mixture_of_experts_gives_the_same_tokens_run_after_run(moe_dir):
    from test_cuda_engine import engines

    from qwenchat.engine.base import GenerateRequest
    from qwenchat.sampling.params import LiveParams, SamplingParams

    replies = []
    for _ in range(2):
        gpu_engine, _ = engines(moe_dir)
        gpu_engine.prefill([int(i) for i in np.random.default_rng(4).integers(0, 400, 60)])
        params = LiveParams(SamplingParams(temperature=0.8, top_p=0.9, max_tokens=64))
        replies.append(list(gpu_engine.generate(GenerateRequest(params, frozenset(), seed=7))))
        gpu_engine.close()
    assert replies[0] == replies[1] and len(replies[0]) == 64

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

"""FP8 weights on the GPU: Qwen's FP8 checkpoints and `--quantize fp8` against the NumPy
reference on the same (dequantized) weights (GPU only; skipped elsewhere)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hf_compare import relative_error
from tiny_model import write_quantized_copy, write_tiny_model

from qwenchat.engine.base import GenerateRequest
from qwenchat.engine.reference import ReferenceEngine
from qwenchat.model import fp8
from qwenchat.model.fp8 import Fp8Weights
from qwenchat.model.loader import open_model_dir
from qwenchat.sampling.params import LiveParams, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_gpu")]


@pytest.fixture(scope="module", params=["BF16", "F32"])
def fp8_dir(request, tmp_path_factory, tiny_tokenizer) -> Path:
    """A tiny FP8 checkpoint in Qwen's layout, scales in each dtype the published files use;
    head_dim 64 so the megakernel could take it."""
    return write_tiny_model(tmp_path_factory.mktemp(f"fp8-{request.param}") / "m", dtype="FP8",
                            scale_dtype=request.param, tokenizer=tiny_tokenizer,
                            max_position_embeddings=2048, head_dim=64)


DECODES = ["megakernel", "layered"]


def one_step_a_launch(gpu) -> None:
    """The megakernel one step a launch, none queued: last_logits() stays the last token's."""
    if gpu.decode == "megakernel":
        gpu.steps_per_launch, gpu.launches_ahead = 1, 0


# On Hopper the FP8 weights' prefill takes e4m3 activations (gemm_fp8_sm90.cu). On these
# shallow random models that noise reaches ~10% of the largest logit (on the reference alone:
# e4m3 against float32 inputs, docs/prefill_v2.md), past any useful tolerance, while on
# full-depth models it averages to a few 1e-3. So the checks against the reference on them
# run the bf16-activation prefill (every GPU but sm_90 prefills so anyway), and the e4m3
# path has its own tests: its kernels against NumPy (test_cuda_fp8_gemm.py), full
# depth against the reference and the bf16 activations, parts against one pass.
WIDENED = {"fp8_activations": "bf16"}


def engines(directory: Path, ctx: int | None = None, decode: str = "layered",
            quantize: str = "none"):
    from qwenchat.engine import create_engine
    from qwenchat.engine.cuda.engine import CudaEngine

    model = open_model_dir(directory)
    gpu = CudaEngine(model.config, fp8.with_quantization(model.checkpoint, quantize), ctx,
                     decode=decode, **WIDENED)
    kwargs = {"quantize": quantize}
    assert gpu.decode == decode
    one_step_a_launch(gpu)
    ref = create_engine("cpu", model.config, model.checkpoint, ctx, **kwargs)
    assert gpu.weight_format == ref.weight_format == "fp8"
    return gpu, ref


# FP8 logits on the GPU differ from the reference's by up to ~7e-3 of the largest on these
# shapes (docs/perf.md), as bf16's do: two tokens closer than this are a near-tie either side
# may break.
NEAR_TIE = 1e-2


def greedy_against_the_reference(gpu, ref, steps: int) -> tuple[float, list[str]]:
    """Greedy decode on the GPU with the reference following its tokens: the worst relative
    logit error, and every step where the two chose differently: allowed only where the GPU
    chose by its own logits and the reference's two logits are within NEAR_TIE of the
    largest (the list shows them)."""
    request = GenerateRequest(LiveParams(SamplingParams(temperature=0.0, max_tokens=steps)),
                              frozenset(), seed=0)
    worst, ties = 0.0, []
    for step, token in enumerate(gpu.generate(request)):
        expected = ref.last_logits()
        best = int(np.argmax(expected))
        if token != best:
            ours = gpu.last_logits()
            gap = float(expected[best] - expected[token])
            assert token == int(np.argmax(ours)), f"step {step}: {token} is not the GPU's argmax"
            assert gap <= NEAR_TIE * float(np.abs(expected).max()), (
                f"step {step}: GPU chose {token}, the reference {best} by {gap:.4g}")
            ties.append(f"step {step}: {token} vs {best}, logits {expected[token]:.6g} / "
                        f"{expected[best]:.6g}")
        worst = max(worst, relative_error(gpu.last_logits(), expected))
        ref.prefill([token])
    return worst, ties


def test_fp8_prefill_logits_match_the_reference(fp8_dir):
    gpu, ref = engines(fp8_dir, decode="layered")
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 400, 256)]
    assert relative_error(gpu.prefill_logits(ids), ref.prefill_logits(ids)) <= 2e-2
    gpu.close()


def test_e4m3_prefill_in_parts_is_one_pass_and_near_the_bf16_activations(fp8_dir):
    """gemm_fp8_sm90.cu's prefill: in parts of 100 tokens bit-equal to one pass of 300, and
    (printed) how far its logits lie from the bf16-activation path's on the same weights."""
    from qwenchat.engine.cuda.engine import CudaEngine

    model = open_model_dir(fp8_dir)
    parts, one, widened = (CudaEngine(model.config, model.checkpoint, 512, decode="layered",
                                      fp8_activations=a) for a in ("auto", "auto", "bf16"))
    if not parts.fp8_gemm:
        pytest.skip("e4m3 activations need gemm_fp8_sm90.cu (sm_90)")
    assert not widened.fp8_gemm
    ids = [int(i) for i in np.random.default_rng(7).integers(0, 400, 300)]
    for a in range(0, 300, 100):
        parts.prefill(ids[a : a + 100])
    one.prefill(ids)
    assert np.array_equal(parts.last_logits(), one.last_logits())
    widened.prefill(ids)
    error = relative_error(one.last_logits(), widened.last_logits())
    print(f"e4m3 against bf16 activations: {error:.2e}")
    for engine in (parts, one, widened):
        engine.close()


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "odd blocks"])
def test_e4m3_prefill_at_full_depth_follows_the_reference(shape):
    """28 layers of random FP8 weights (0.6B's widths, or ODD_BLOCKS'): the e4m3 prefill's
    logits against the reference with the same activation scheme and against the GPU's
    bf16-activation prefill over 128 positions: median error within 5e-3, 95% of positions
    within 2e-2 and top-1 agreeing. (Not every position: on these random models a position
    now and then is chaotic under e4m3 noise. On the reference alone, e4m3 against float32
    inputs, position 68 of this prompt is 1.99 off while bf16 inputs stay within 1.6e-4 of
    float32 everywhere: docs/prefill_v2.md.)"""
    from qwenchat.engine.cuda.engine import CudaEngine
    from qwenchat.model.presets import PRESETS
    from qwenchat.model.random_weights import RandomWeights

    config = dataclasses.replace(PRESETS["qwen3-0.6b"], num_hidden_layers=28)
    if shape == "odd blocks":
        config = dataclasses.replace(config, **{**ODD_BLOCKS, "num_hidden_layers": 28})
    weights = RandomWeights(config, seed=3, weight_format="fp8")
    prompt = [int(i) for i in np.random.default_rng(8).integers(0, config.vocab_size, 128)]
    logits = {}
    for activations in ("auto", "bf16"):
        gpu = CudaEngine(config, weights, ctx=160, decode="layered", fp8_activations=activations)
        if activations == "auto" and not gpu.fp8_gemm:
            gpu.close()
            pytest.skip("e4m3 activations need gemm_fp8_sm90.cu (sm_90)")
        logits[activations] = gpu.prefill_logits(prompt)
        gpu.close()
    ours = logits["auto"]
    oracle = ReferenceEngine(config, weights, ctx=160, fp8_activations=True).prefill_logits(prompt)
    for name, other in (("reference", oracle), ("bf16 activations", logits["bf16"])):
        errors = np.abs(ours - other).max(axis=1) / np.abs(other).max(axis=1)
        agree = float(np.mean(ours.argmax(axis=1) == other.argmax(axis=1)))
        print(f"{shape} against the {name}: median {np.median(errors):.2e}, max "
              f"{errors.max():.2e}, top-1 {agree:.1%}")
        assert np.median(errors) <= 5e-3
        assert np.quantile(errors, 0.95) <= 2e-2 and agree >= 0.95


@pytest.mark.parametrize("decode", DECODES)
def test_fp8_greedy_decode_follows_the_reference_for_256_steps(fp8_dir, decode):
    follows_the_reference(*engines(fp8_dir, decode=decode), prompt_seed=1, prompt_tokens=40,
                          steps=256)


def follows_the_reference(gpu, ref, prompt_seed: int, prompt_tokens: int, steps: int) -> None:
    """A random prompt, then greedy steps within 2e-2 of the reference (partings at
    near-ties only)."""
    prompt = [int(i) for i in np.random.default_rng(prompt_seed).integers(0, 400, prompt_tokens)]
    gpu.prefill(prompt)
    ref.prefill(prompt)
    worst, ties = greedy_against_the_reference(gpu, ref, steps)
    print(f"{gpu.decode}: worst relative logit error {worst:.2e}; near-ties: {ties or 'none'}")
    assert worst <= 2e-2
    gpu.close()


@pytest.mark.parametrize("decode", DECODES)
def test_quantize_fp8_on_the_gpu_equals_the_fp8_checkpoint_of_the_same_weights(
        tiny_tokenizer, tmp_path, decode):
    plain = write_tiny_model(tmp_path / "bf16", tokenizer=tiny_tokenizer,
                             max_position_embeddings=512, head_dim=64)
    offline = write_quantized_copy(plain, tmp_path / "fp8")
    ids = [int(i) for i in np.random.default_rng(2).integers(0, 400, 100)]
    at_load, _ = engines(plain, quantize="fp8", decode=decode)
    from_file, _ = engines(offline, decode=decode)
    same_logits_and_replies(at_load, from_file, ids)


def same_logits_and_replies(one, other, ids: list[int]) -> None:
    """Two engines on the same weights: equal prefill logits and equal greedy replies of 64
    tokens (both are closed)."""
    assert np.array_equal(one.prefill_logits(ids), other.prefill_logits(ids))
    request = GenerateRequest(LiveParams(SamplingParams(temperature=0.0, max_tokens=64)),
                              frozenset(), seed=0)
    assert list(one.generate(request)) == list(other.generate(request))
    one.close()
    other.close()


def peak_stays_within_256_mib(make) -> None:
    """The engine `make()` builds (prefill 299 tokens, then 20 greedy steps) never holds
    more GPU memory than its weights, its KV cache and 256 MiB (it is closed)."""
    from qwenchat.engine.cuda import runtime as rt

    before = rt.allocated_bytes()
    rt.reset_peak()
    gpu = make()
    gpu.prefill(list(range(1, 300)))
    list(gpu.generate(GenerateRequest(
        LiveParams(SamplingParams(temperature=0.0, max_tokens=20)), frozenset(), seed=0)))
    used = rt.peak_allocated_bytes() - before
    assert used <= gpu.weight_bytes + gpu.kv_bytes + 256 * 2**20
    gpu.close()


def test_fp8_weights_take_about_half_the_memory_and_peak_stays_within_256_mib(fp8_dir):
    from qwenchat.model.formats import FORMATS

    def make():
        gpu, _ = engines(fp8_dir, ctx=1024, decode="layered")
        shapes = gpu.config.tensor_shapes()
        fp8, bf16 = (FORMATS[name].weight_bytes(shapes) for name in ("fp8", "bf16"))
        assert gpu.weight_bytes == fp8 < bf16
        return gpu

    peak_stays_within_256_mib(make)


@pytest.fixture(scope="module", params=["qwen3-0.6b", "qwen3-14b", "qwen3-32b"])
def quantized_shape(request):
    """Two layers of a real width, quantized at load time, and the reference on the same
    FP8 weights."""
    from qwenchat.model.presets import PRESETS
    from qwenchat.model.random_weights import RandomWeights

    config = dataclasses.replace(PRESETS[request.param], num_hidden_layers=2)
    weights = Fp8Weights(RandomWeights(config, seed=3))
    return config, weights, ReferenceEngine(config, weights, ctx=256)


@pytest.mark.parametrize("decode", DECODES)
def test_real_widths_in_fp8_prefill_and_decode_as_the_reference(quantized_shape, decode):
    from qwenchat.engine.cuda.engine import CudaEngine

    config, weights, ref = quantized_shape
    gpu = CudaEngine(config, weights, ctx=256, decode=decode, **WIDENED)
    # 32B is too wide for the megakernel on an H100: it says so and uses the graph.
    assert gpu.decode in (decode, "layered")
    prefill_and_decode_as_the_reference(gpu, ref)


def prefill_and_decode_as_the_reference(gpu, ref) -> None:
    """A random 24-token prompt's logits, then 32 greedy steps (the reference following),
    within 2e-2 of the reference's (the GPU engine is closed)."""
    try:
        one_step_a_launch(gpu)
        config = gpu.config
        prompt = [int(i) for i in np.random.default_rng(4).integers(0, config.vocab_size, 24)]
        ref.truncate(0)
        assert relative_error(gpu.prefill_logits(prompt), ref.prefill_logits(prompt)) <= 2e-2
        worst, ties = greedy_against_the_reference(gpu, ref, 32)
        print(f"{config.hidden_size}: worst {worst:.2e}; near-ties: {ties or 'none'}")
        assert worst <= 2e-2
    finally:
        gpu.close()


# The shape the FP8 divergence was seen on (issue 22): 10 query / 2 KV heads of 128, hidden
# 1280 (10 blocks of 128), intermediate 3456 (27 blocks: an odd count), 3 layers.
ODD_BLOCKS = dict(hidden_size=1280, intermediate_size=3456, num_attention_heads=10,
                  num_key_value_heads=2, head_dim=128, num_hidden_layers=3,
                  max_position_embeddings=2048, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def odd_blocks_fp8_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("fp8-odd") / "m", dtype="FP8",
                            scale_dtype="BF16", tokenizer=tiny_tokenizer, **ODD_BLOCKS)


@pytest.mark.parametrize("prefill_kernels", ["hopper", "portable"])
def test_an_odd_count_of_fp8_blocks_prefills_as_the_reference(odd_blocks_fp8_dir,
                                                              prefill_kernels, cuda_gpu):
    if prefill_kernels == "hopper" and cuda_gpu.gpus[0].compute_capability != (9, 0):
        pytest.skip("the Hopper prefill needs sm_90")
    from qwenchat.engine.cuda.engine import CudaEngine

    model = open_model_dir(odd_blocks_fp8_dir)
    gpu = CudaEngine(model.config, model.checkpoint, 512, decode="layered",
                     prefill_kernels=prefill_kernels, **WIDENED)
    ref = ReferenceEngine(model.config, Fp8Weights(model.checkpoint), 512)
    prefills_as_the_reference(gpu, ref, 200, seed=5, label=f"{prefill_kernels} prefill")


def prefills_as_the_reference(gpu, ref, tokens: int, seed: int, label: str) -> None:
    """A random prompt's prefill logits within 2e-2 of the reference's (the GPU engine is
    closed)."""
    ids = [int(i) for i in np.random.default_rng(seed).integers(0, 400, tokens)]
    error = relative_error(gpu.prefill_logits(ids), ref.prefill_logits(ids))
    print(f"{label}: relative logit error {error:.2e}")
    assert error <= 2e-2
    gpu.close()


@pytest.mark.parametrize("decode", DECODES)
def test_an_odd_count_of_fp8_blocks_decodes_as_the_reference(odd_blocks_fp8_dir, decode):
    follows_the_reference(*engines(odd_blocks_fp8_dir, ctx=512, decode=decode), prompt_seed=6,
                          prompt_tokens=30, steps=64)

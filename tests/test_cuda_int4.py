"""4-bit weights on the GPU: Qwen's AWQ checkpoints and `--quantize int4` against the NumPy
reference on the same (dequantized) weights, on both decode paths, prefill and the speculative
pass (GPU only; skipped elsewhere)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hf_compare import relative_error
from test_cuda_fp8 import (
    ODD_BLOCKS,
    follows_the_reference,
    one_step_a_launch,
    peak_stays_within_256_mib,
    prefill_and_decode_as_the_reference,
    prefills_as_the_reference,
    same_logits_and_replies,
)
from tiny_model import write_tiny_model

from qwenchat.engine.reference import ReferenceEngine
from qwenchat.model.awq import Int4Weights
from qwenchat.model.loader import open_model_dir

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_gpu")]

DECODES = ["megakernel", "layered"]


@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A tiny AWQ checkpoint in the published layout (fp16 beside the codes); head_dim 64 so
    the megakernel takes it, down_proj's 384 inputs an odd count of groups (3)."""
    return write_tiny_model(tmp_path_factory.mktemp("awq") / "m", dtype="AWQ", head_dim=64,
                            tokenizer=tiny_tokenizer, max_position_embeddings=2048)


def engines(directory: Path, ctx: int | None = None, decode: str = "layered", **kwargs):
    from qwenchat.engine.cuda.engine import CudaEngine

    model = open_model_dir(directory)
    gpu = CudaEngine(model.config, model.checkpoint, ctx, decode=decode, **kwargs)
    assert gpu.decode == decode and gpu.weight_format == "int4"
    one_step_a_launch(gpu)
    ref = ReferenceEngine(model.config, model.checkpoint, ctx)
    return gpu, ref


@pytest.mark.parametrize("prefill_kernels", ["hopper", "portable"])
def test_awq_prefill_logits_match_the_reference(awq_dir, prefill_kernels, cuda_gpu):
    if prefill_kernels == "hopper" and cuda_gpu.gpus[0].compute_capability != (9, 0):
        pytest.skip("the Hopper prefill needs sm_90")
    gpu, ref = engines(awq_dir, prefill_kernels=prefill_kernels)
    prefills_as_the_reference(gpu, ref, 256, seed=0, label=f"{prefill_kernels} prefill")


@pytest.mark.parametrize("decode", DECODES)
def test_awq_greedy_decode_follows_the_reference_for_256_steps(awq_dir, decode):
    follows_the_reference(*engines(awq_dir, decode=decode), prompt_seed=1, prompt_tokens=40,
                          steps=256)


@pytest.mark.parametrize("rows", ["whole", "parts"])
def test_both_megakernel_streams_decode_int4_as_the_reference(awq_dir, rows):
    """Whole rows (two a warp on the tensor cores) and runs of items (one row an mma)."""
    gpu, ref = engines(awq_dir, decode="megakernel", megakernel_rows=rows)
    assert gpu.mk_layout.split == (rows == "parts") and gpu.mk_layout.mma
    follows_the_reference(gpu, ref, prompt_seed=7, prompt_tokens=20, steps=64)


@pytest.mark.parametrize("decode", DECODES)
def test_quantize_int4_on_the_gpu_equals_the_awq_checkpoint_of_the_same_codes(
        awq_dir, tmp_path, tiny_tokenizer, decode):
    """`--quantize int4` of the dequantized weights makes the checkpoint's own codes again
    (each group's range holds its codes' extremes), so both run the same 4-bit weights."""
    from qwenchat.engine import create_engine

    model = open_model_dir(awq_dir)
    ids = [int(i) for i in np.random.default_rng(2).integers(0, 400, 100)]
    from_file = create_engine("cuda", model.config, model.checkpoint, 512, decode=decode)
    plain = Int4Weights(model.checkpoint)
    at_load = create_engine("cuda", model.config, plain, 512, decode=decode)
    assert from_file.weight_format == at_load.weight_format == "int4"
    same_logits_and_replies(at_load, from_file, ids)


def test_int4_weights_take_about_a_quarter_of_bf16_and_peak_stays_within_256_mib(awq_dir):
    from qwenchat.model.formats import FORMATS

    def make():
        gpu, _ = engines(awq_dir, ctx=1024, decode="layered")
        shapes = gpu.config.tensor_shapes()
        int4, fp8 = (FORMATS[name].weight_bytes(shapes) for name in ("int4", "fp8"))
        assert gpu.weight_bytes == int4 < fp8
        return gpu

    peak_stays_within_256_mib(make)


@pytest.fixture(scope="module", params=["qwen3-0.6b", "qwen3-8b", "qwen3-14b", "odd-groups"])
def int4_shape(request):
    """Two layers of a real width with random int4 weights, and the reference on them; and
    a shape whose rows end inside a 512-column step (hidden 1280: 10 groups of 128, the MLP's
    3456: 27)."""
    from qwenchat.model.config import Qwen3Config
    from qwenchat.model.presets import PRESETS
    from qwenchat.model.random_weights import RandomWeights

    if request.param == "odd-groups":
        config = Qwen3Config(vocab_size=151_936, **{**ODD_BLOCKS, "num_hidden_layers": 2})
    else:
        config = dataclasses.replace(PRESETS[request.param], num_hidden_layers=2)
    weights = Int4Weights(RandomWeights(config, seed=3, weight_format="int4"))
    return config, weights, ReferenceEngine(config, weights, ctx=256)


@pytest.mark.parametrize("decode", DECODES)
def test_real_widths_in_int4_prefill_and_decode_as_the_reference(int4_shape, decode):
    """Random int4 weights drawn on the device (layers.cu's draw_int4_rows) are the ones the
    CPU draws, and every path computes with them as the reference does."""
    from qwenchat.engine.cuda.engine import CudaEngine

    config, weights, ref = int4_shape
    gpu = CudaEngine(config, weights, ctx=256, decode=decode)
    assert gpu.decode == decode and gpu.weight_format == "int4"
    prefill_and_decode_as_the_reference(gpu, ref)


def test_real_widths_prefill_int4_slices_on_the_portable_gemm_as_the_reference(int4_shape):
    """gemm.cu's products of the dequantized slices (8B: gate/up in 6 slices, down in 4)."""
    from qwenchat.engine.cuda.engine import CudaEngine

    config, weights, ref = int4_shape
    gpu = CudaEngine(config, weights, ctx=256, decode="layered", prefill_kernels="portable")
    try:
        prompt = [int(i) for i in np.random.default_rng(5).integers(0, config.vocab_size, 40)]
        ref.truncate(0)
        assert relative_error(gpu.prefill_logits(prompt), ref.prefill_logits(prompt)) <= 2e-2
    finally:
        gpu.close()


@pytest.mark.parametrize("decode", DECODES)
def test_the_speculative_pass_of_int4_weights_gives_the_reference_logits(awq_dir, decode):
    """verify.cu's int4 products: a prefill of at most 8 tokens runs as a speculative pass
    (one graph of verify.cu's products), after a prompt prefilled the long way."""
    gpu, ref = engines(awq_dir, ctx=512, decode=decode)
    prompt = [int(i) for i in np.random.default_rng(8).integers(0, 400, 30)]
    gpu.prefill(prompt)
    ref.prefill(prompt)
    for n in (1, 5, 8):
        rows = [int(i) for i in np.random.default_rng(9 + n).integers(0, 400, n)]
        gpu.prefill(rows)
        ref.prefill(rows)
        error = relative_error(gpu.last_logits(), ref.last_logits())
        print(f"pass of {n}: relative logit error {error:.2e}")
        assert error <= 2e-2
    gpu.close()

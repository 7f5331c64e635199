"""The CUDA engine and its kernels against the NumPy reference (GPU only; skipped elsewhere)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tiny_model import write_tiny_model

from qwenchat.engine.base import GenerateRequest, StopReason
from qwenchat.engine.reference import ReferenceEngine
from qwenchat.model.config import Qwen3Config
from qwenchat.model.floats import bf16_bits_to_f32, f32_to_bf16_bits
from qwenchat.model.loader import open_model_dir
from qwenchat.sampling.params import LiveParams, SamplingParams
from qwenchat.sampling.sampler import sample_token_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_gpu")]


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def engines(model_dir: Path, ctx: int | None = None, decode: str = "layered",
            steps_per_launch: int | None = None, prefill_kernels: str = "auto"):
    from qwenchat.engine.cuda.engine import CudaEngine

    model = open_model_dir(model_dir)
    gpu_engine = CudaEngine(model.config, model.checkpoint, ctx, decode=decode,
                            prefill_kernels=prefill_kernels)
    if decode == "megakernel":  # the tiny shapes used with it have whole-line KV rows
        assert gpu_engine.decode == "megakernel", "the megakernel was not used"
    if steps_per_launch is not None and decode == "megakernel":
        # One step a launch and none queued ahead: the logits stay those of the last token.
        gpu_engine.steps_per_launch = steps_per_launch
        gpu_engine.launches_ahead = 0
    return gpu_engine, ReferenceEngine(model.config, model.checkpoint, ctx)


DECODES = ["megakernel", "layered"]


def worst_greedy_decode_error(gpu_engine, ref, steps: int) -> float:
    """Greedy decode on the GPU; the reference follows the GPU's tokens. The largest relative
    error of the logits over the steps."""
    request = GenerateRequest(LiveParams(SamplingParams(temperature=0.0, max_tokens=steps)),
                              frozenset(), seed=0)
    worst = 0.0
    for token in gpu_engine.generate(request):
        worst = max(worst, rel_err(gpu_engine.last_logits(), ref.last_logits()))
        ref.prefill([token])
    return worst


# head_dim 64: the megakernel needs key/value rows of whole 128-byte lines (engine.py).
SHAPES = {
    "tied": dict(head_dim=64),
    "untied-gqa3": dict(tie_word_embeddings=False, hidden_size=48, num_attention_heads=3,
                        num_key_value_heads=1, head_dim=64, intermediate_size=80, seed=4),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def model_dir(request, tmp_path_factory, tiny_tokenizer):
    return write_tiny_model(tmp_path_factory.mktemp(request.param) / "m", tokenizer=tiny_tokenizer,
                            max_position_embeddings=2048, **SHAPES[request.param])


# ------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("prefill_kernels", ["auto", "portable"])
def test_prefill_logits_match_the_reference_at_every_position(model_dir, prefill_kernels):
    """"auto" is the Hopper kernels on an H100; "portable" those of every other GPU."""
    gpu_engine, ref = engines(model_dir, prefill_kernels=prefill_kernels)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 400, 256)]
    assert rel_err(gpu_engine.prefill_logits(ids), ref.prefill_logits(ids)) <= 2e-2


@pytest.mark.parametrize("decode", DECODES)
def test_decode_logits_match_the_reference_for_256_steps(model_dir, decode):
    gpu_engine, ref = engines(model_dir, decode=decode, steps_per_launch=1)
    prompt = [int(i) for i in np.random.default_rng(1).integers(0, 400, 40)]
    gpu_engine.prefill(prompt)
    ref.prefill(prompt)
    assert worst_greedy_decode_error(gpu_engine, ref, 256) <= 2e-2


@pytest.mark.parametrize("decode", DECODES)
def test_greedy_tokens_equal_the_reference_over_512_steps(tiny_model_dir, tmp_path,
                                                          tiny_tokenizer, decode):
    directory = write_tiny_model(tmp_path / "m", tokenizer=tiny_tokenizer,
                                 max_position_embeddings=1024, head_dim=64)
    gpu_engine, ref = engines(directory, decode=decode)
    prompt = [int(i) for i in np.random.default_rng(2).integers(0, 400, 20)]
    outputs = []
    for engine in (gpu_engine, ref):
        engine.prefill(prompt)
        params = LiveParams(SamplingParams(temperature=0.0, max_tokens=512))
        outputs.append(list(engine.generate(GenerateRequest(params, frozenset(), seed=0))))
    assert outputs[0] == outputs[1]


def test_cache_reuse_truncate_and_prefill_in_chunks(model_dir):
    gpu_engine, ref = engines(model_dir)
    ids = [int(i) for i in np.random.default_rng(3).integers(0, 400, 300)]
    gpu_engine.prefill(ids[:100])
    gpu_engine.prefill(ids[100:250])
    gpu_engine.truncate(180)
    gpu_engine.prefill(ids[180:])
    ref.prefill(ids)
    assert gpu_engine.tokens == ids
    assert rel_err(gpu_engine.last_logits(), ref.last_logits()) <= 2e-2


def test_a_prefill_in_parts_of_the_engines_passes_is_the_same_as_one_call(model_dir):
    """The chat prefills a long prompt in parts of prefill_chunk tokens (to show progress and
    stop between two): the cache and logits must be those of one call, bit for bit."""
    one, _ = engines(model_dir)
    parts, _ = engines(model_dir)
    one.chunk = parts.chunk = 64  # passes smaller than the scratch allows: several in 300
    step = parts.prefill_chunk
    assert step == 64
    ids = [int(i) for i in np.random.default_rng(4).integers(0, 400, 4 * step + 44)]
    one.prefill(ids)
    for at in range(0, len(ids), step):
        parts.prefill(ids[at : at + step])
    assert parts.tokens == one.tokens == ids
    assert np.array_equal(parts.last_logits(), one.last_logits())
    request = GenerateRequest(LiveParams(SamplingParams(temperature=0.0, max_tokens=32)),
                              frozenset(), seed=0)
    assert list(parts.generate(request)) == list(one.generate(request))


@pytest.mark.parametrize("decode", DECODES)
def test_sampling_is_reproducible_and_params_apply_mid_reply(model_dir, decode):
    gpu_engine, _ = engines(model_dir, decode=decode, steps_per_launch=1)
    prompt = [5, 6, 7, 8]

    def run(seed: int, switch_at: int | None = None) -> list[int]:
        gpu_engine.truncate(0)
        gpu_engine.prefill(prompt)
        params = LiveParams(SamplingParams(temperature=1.3, top_k=0, top_p=1.0, seed=seed,
                                           max_tokens=40))
        tokens = []
        for token in gpu_engine.generate(GenerateRequest(params, frozenset(), seed=0)):
            tokens.append(token)
            if switch_at is not None and len(tokens) == switch_at:
                params.update(temperature=0.0)
            if switch_at is not None and len(tokens) > switch_at:
                assert token == int(np.argmax(gpu_engine.last_logits()))
        return tokens

    assert run(3) == run(3)
    assert run(3) != run(4)
    run(3, switch_at=10)


@pytest.mark.parametrize("decode", DECODES)
def test_cancel_and_capacity_stop_the_reply(model_dir, decode):
    gpu_engine, _ = engines(model_dir, ctx=64, decode=decode)
    gpu_engine.prefill(list(range(10, 50)))
    request = GenerateRequest(LiveParams(SamplingParams(temperature=0.0)), frozenset(), seed=0)
    generation = gpu_engine.generate(request)
    tokens = list(generation)
    assert generation.stop_reason is StopReason.CONTEXT_FULL
    assert gpu_engine.position == 64 and len(tokens) == 25
    gpu_engine.truncate(39)  # dropping tokens drops the logits: one token must run again
    gpu_engine.prefill([49])
    request = GenerateRequest(LiveParams(SamplingParams(temperature=0.0)), frozenset(), seed=0)
    generation = gpu_engine.generate(request)
    for count, _ in enumerate(generation, start=1):
        if count == 3:
            request.cancel.set()
    assert generation.stop_reason is StopReason.CANCELLED and count == 3


def test_auto_decode_is_the_megakernel_and_gives_the_graphs_greedy_tokens(model_dir):
    gpu_engine, _ = engines(model_dir, decode="auto")
    assert gpu_engine.decode == "megakernel"
    prompt = [int(i) for i in np.random.default_rng(8).integers(0, 400, 40)]
    outputs = {}
    for decode in DECODES:
        gpu_engine.decode = decode
        gpu_engine.truncate(0)
        gpu_engine.prefill(prompt)
        params = LiveParams(SamplingParams(temperature=0.0, max_tokens=24))
        outputs[decode] = list(gpu_engine.generate(GenerateRequest(params, frozenset(), seed=0)))
    assert outputs["megakernel"] == outputs["layered"]


def test_a_cold_start_answers_on_the_graph_then_takes_the_megakernel_once_compiled(
        model_dir, tmp_path, monkeypatch):
    from qwenchat.engine.cuda.engine import CudaEngine

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # an empty kernel cache
    model = open_model_dir(model_dir)
    notices: list[str] = []
    cold = CudaEngine(model.config, model.checkpoint, notice=notices.append,
                      megakernel_later=True)
    assert cold.decode == "layered" and cold.megakernel_pending is not None
    assert any("megakernel in the background" in line for line in notices)
    prompt = [int(i) for i in np.random.default_rng(9).integers(0, 400, 40)]

    def greedy(engine) -> list[int]:
        engine.truncate(0)
        engine.prefill(prompt)
        params = LiveParams(SamplingParams(temperature=0.0, max_tokens=24))
        return list(engine.generate(GenerateRequest(params, frozenset(), seed=0)))

    # The first reply runs while the megakernel still compiles. (Its compile, a process of its
    # own, can end before the graph's kernels have loaded, most often on a loaded machine: the
    # first reply would then begin on the megakernel. Its result is held back until then.)
    pending, held = cold.megakernel_pending, [True]
    poll = pending.poll
    monkeypatch.setattr(pending, "poll", lambda: None if held[0] else poll())
    first = greedy(cold)
    assert cold.decode == "layered" and cold.megakernel_pending is pending
    held[0] = False
    pending.wait(timeout=300)
    assert cold.decode == "layered"  # (a reply in progress keeps its path)
    second = greedy(cold)
    assert cold.decode == "megakernel" and cold.megakernel_pending is None
    assert second == first
    warm = CudaEngine(model.config, model.checkpoint, megakernel_later=True)
    assert warm.decode == "megakernel" and warm.megakernel_pending is None
    assert greedy(warm) == first
    for engine in (cold, warm):
        engine.close()


def test_the_megakernel_refuses_key_value_rows_shorter_than_a_cache_line(tiny_model_dir):
    gpu_engine, _ = engines(tiny_model_dir, decode="auto")  # head_dim 16
    assert gpu_engine.decode == "layered"


# ------------------------------------------------------------------------------ kernels
@pytest.fixture(scope="module")
def kernels():
    """Kernels compiled for an odd shape, with a stream to launch them on."""
    from qwenchat.engine.cuda import runtime as rt
    from qwenchat.engine.cuda.compiler import KernelCache, kernel_defines

    config = Qwen3Config(vocab_size=1000, hidden_size=48, intermediate_size=80,
                         num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2,
                         head_dim=64)
    device = rt.Device(0)
    cache = KernelCache()
    modules = {name: rt.Module(cache.load(name, device.arch, kernel_defines(config)))
               for name in ("gemm.cu", "attention.cu", "sampling.cu")}
    return rt, config, modules, rt.Stream()


def upload(rt, array: np.ndarray):
    buffer = rt.DeviceBuffer(array.nbytes)
    buffer.upload(np.ascontiguousarray(array))
    return buffer


def poisoned(rt, nbytes: int):
    buffer = rt.DeviceBuffer(nbytes)
    buffer.fill_u8(0xFF)  # NaN patterns in every float: any unwritten element fails the check
    return buffer


def download(buffer, dtype, shape) -> np.ndarray:
    out = np.empty(shape, dtype)
    buffer.download(out)
    return out


@pytest.mark.parametrize(("m", "n", "k"), [(77, 200, 72), (1, 48, 48), (130, 129, 264)])
def test_gemm_matches_numpy_on_sizes_off_the_tile_grid(kernels, m, n, k):
    from qwenchat.engine.cuda.prefill import gemm_shared_bytes

    rt, _, modules, stream = kernels
    rng = np.random.default_rng(m * n)
    a_bits = f32_to_bf16_bits(rng.standard_normal((m, k)).astype(np.float32))
    b_bits = f32_to_bf16_bits(rng.standard_normal((n, k)).astype(np.float32))
    expected = bf16_bits_to_f32(a_bits) @ bf16_bits_to_f32(b_bits).T
    a, b, c = upload(rt, a_bits), upload(rt, b_bits), poisoned(rt, m * n * 4)
    grid = ((n + 127) // 128, (m + 127) // 128)
    args = [a, b, c, ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(n)]
    shared = gemm_shared_bytes("bf16")
    for name in ("gemm_store", "gemm_add"):
        modules["gemm.cu"].function(name).set_max_dynamic_shared(shared)
    rt.launch(modules["gemm.cu"].function("gemm_store"), grid, 256, args, shared=shared,
              stream=stream)
    stream.synchronize()
    out = download(c, np.float32, (m, n))
    assert np.isfinite(out).all() and rel_err(out, expected) <= 1e-4
    base = rng.standard_normal((m, n)).astype(np.float32)
    c.upload(base)
    rt.launch(modules["gemm.cu"].function("gemm_add"), grid, 256, args, shared=shared,
              stream=stream)
    stream.synchronize()
    assert rel_err(download(c, np.float32, (m, n)), base + expected) <= 1e-4


def _hopper_gemm_functions(weight_format: str):
    from qwenchat.engine.cuda import runtime as rt
    from qwenchat.engine.cuda.compiler import KernelCache, kernel_defines
    from qwenchat.engine.cuda.prefill import GEMM90_SHARED

    device = rt.Device(0)
    if device.arch != "sm_90":
        pytest.skip(f"gemm_sm90.cu needs an sm_90 GPU; this is {device.arch}")
    config = Qwen3Config(vocab_size=1000, hidden_size=48, intermediate_size=80,
                         num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2,
                         head_dim=64)
    module = rt.Module(KernelCache().load("gemm_sm90.cu", "sm_90a",
                                          kernel_defines(config, weight_format)))
    functions = {}
    for name in ("gemm90_store_128", "gemm90_store_256", "gemm90_add_128", "gemm90_add_256",
                 "gemm90_swiglu"):
        functions[name] = module.function(name)
        functions[name].set_max_dynamic_shared(GEMM90_SHARED)
    for name in ("splitk_sum", "splitk_swiglu"):
        functions[name] = module.function(name)
    return rt, functions, rt.Stream()


@pytest.fixture(scope="module")
def hopper_gemm():
    """gemm_sm90.cu built for sm_90a; skips on other GPUs (the engine uses gemm.cu there)."""
    return _hopper_gemm_functions("bf16")


@pytest.fixture(scope="module")
def hopper_gemm_fp8():
    """gemm_sm90.cu for FP8 weights (QW_FP8)."""
    return _hopper_gemm_functions("fp8")


# Rows, columns and depths off every tile: one row, a partial K step, odd N, several K steps.
GEMM90_SIZES = [(77, 200, 72), (1, 48, 48), (130, 129, 264), (300, 520, 1032)]


@pytest.mark.parametrize("width", [128, 256])
@pytest.mark.parametrize(("m", "n", "k"), GEMM90_SIZES)
def test_hopper_gemm_matches_numpy_on_sizes_off_the_tile_grid(hopper_gemm, m, n, k, width):
    from qwenchat.engine.cuda.prefill import GEMM90_SHARED, GEMM90_THREADS

    rt, functions, stream = hopper_gemm
    rng = np.random.default_rng(m * n + width)
    a_bits = f32_to_bf16_bits(rng.standard_normal((m, k)).astype(np.float32))
    b_bits = f32_to_bf16_bits(rng.standard_normal((n, k)).astype(np.float32))
    expected = bf16_bits_to_f32(a_bits) @ bf16_bits_to_f32(b_bits).T
    a, b, c = upload(rt, a_bits), upload(rt, b_bits), poisoned(rt, m * n * 4)
    maps = [rt.tile_map(a.ptr, m, k, 128, 64), rt.tile_map(b.ptr, n, k, 128, 64)]
    grid = ((m + 127) // 128, (n + width - 1) // width)
    args = [*maps, b, c, ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(0),
            ctypes.c_int(n)]
    rt.launch(functions[f"gemm90_store_{width}"], grid, GEMM90_THREADS, args,
              shared=GEMM90_SHARED, stream=stream)
    stream.synchronize()
    out = download(c, np.float32, (m, n))
    assert np.isfinite(out).all() and rel_err(out, expected) <= 1e-4
    base = rng.standard_normal((m, n)).astype(np.float32)
    c.upload(base)
    rt.launch(functions[f"gemm90_add_{width}"], grid, GEMM90_THREADS, args,
              shared=GEMM90_SHARED, stream=stream)
    stream.synchronize()
    assert rel_err(download(c, np.float32, (m, n)), base + expected) <= 1e-4


def test_hopper_gemm_writes_a_slice_of_a_wider_c(hopper_gemm):
    """ldc: the product of a slice of B's rows lands in its columns of a wider C (the int4
    prefill's dequantized slices), the other columns untouched."""
    from qwenchat.engine.cuda.prefill import GEMM90_SHARED, GEMM90_THREADS

    rt, functions, stream = hopper_gemm
    m, n, k, ldc, first = 130, 200, 264, 520, 256
    rng = np.random.default_rng(11)
    a_bits = f32_to_bf16_bits(rng.standard_normal((m, k)).astype(np.float32))
    b_bits = f32_to_bf16_bits(rng.standard_normal((n, k)).astype(np.float32))
    expected = bf16_bits_to_f32(a_bits) @ bf16_bits_to_f32(b_bits).T
    base = rng.standard_normal((m, ldc)).astype(np.float32)
    a, b, c = upload(rt, a_bits), upload(rt, b_bits), upload(rt, base)
    maps = [rt.tile_map(a.ptr, m, k, 128, 64), rt.tile_map(b.ptr, n, k, 128, 64)]
    args = [*maps, b, rt.Ptr(c.ptr + 4 * first), ctypes.c_int(m), ctypes.c_int(n),
            ctypes.c_int(k), ctypes.c_int(0), ctypes.c_int(ldc)]
    rt.launch(functions["gemm90_add_128"], ((m + 127) // 128, (n + 127) // 128), GEMM90_THREADS,
              args, shared=GEMM90_SHARED, stream=stream)
    stream.synchronize()
    out = download(c, np.float32, (m, ldc))
    want = base.copy()
    want[:, first:first + n] += expected
    assert np.array_equal(out[:, :first], base[:, :first])
    assert np.array_equal(out[:, first + n:], base[:, first + n:])
    assert rel_err(out[:, first:first + n], want[:, first:first + n]) <= 1e-4


@pytest.mark.parametrize(("m", "inter", "k"), [(77, 200, 72), (1, 48, 48), (260, 384, 520)])
def test_hopper_gate_up_product_applies_swiglu(hopper_gemm, m, inter, k):
    """B is [gate; up] (2 x inter rows); the output is bf16(silu(gate) * up), inter wide."""
    from qwenchat.engine.cuda.prefill import GEMM90_SHARED, GEMM90_THREADS

    rt, functions, stream = hopper_gemm
    rng = np.random.default_rng(m + inter)
    a_bits = f32_to_bf16_bits(rng.standard_normal((m, k)).astype(np.float32))
    b_bits = f32_to_bf16_bits(rng.standard_normal((2 * inter, k)).astype(np.float32) * 0.2)
    gu = bf16_bits_to_f32(a_bits) @ bf16_bits_to_f32(b_bits).T
    gate, up = gu[:, :inter], gu[:, inter:]
    expected = gate / (1 + np.exp(-gate)) * up
    a, b = upload(rt, a_bits), upload(rt, b_bits)
    out_buffer = poisoned(rt, m * inter * 2)
    maps = [rt.tile_map(a.ptr, m, k, 128, 64), rt.tile_map(b.ptr, 2 * inter, k, 128, 64)]
    args = [*maps, b, out_buffer, ctypes.c_int(m), ctypes.c_int(inter), ctypes.c_int(k),
            ctypes.c_int(inter), ctypes.c_int(inter)]
    rt.launch(functions["gemm90_swiglu"], ((m + 127) // 128, (inter + 127) // 128),
              GEMM90_THREADS, args, shared=GEMM90_SHARED, stream=stream)
    stream.synchronize()
    out = bf16_bits_to_f32(download(out_buffer, np.uint16, (m, inter)))
    assert np.isfinite(out).all() and rel_err(out, expected) <= 1e-2


@pytest.mark.parametrize("kind", ["store_128", "add_256", "swiglu"])
@pytest.mark.parametrize(("m", "n", "k"), [(77, 200, 144), (1, 48, 48), (300, 520, 1040)])
def test_hopper_gemm_turns_fp8_codes_into_the_bf16_weights_of_gemm_cu(hopper_gemm_fp8, m, n, k,
                                                                      kind):
    """B in the packed FP8 rows (codes, then a scale per 128 columns): the product is that of
    A with bf16(code x scale), the weights gemm.cu makes of the same rows."""
    from qwenchat.engine.cuda.prefill import GEMM90_SHARED, GEMM90_THREADS
    from qwenchat.model.formats import FP8
    from qwenchat.model.fp8 import dequantize, pack_rows, quantize

    rt, functions, stream = hopper_gemm_fp8
    rng = np.random.default_rng(m + n + k)
    rows = 2 * n if kind == "swiglu" else n
    a_bits = f32_to_bf16_bits(rng.standard_normal((m, k)).astype(np.float32))
    codes, scales = quantize(rng.standard_normal((rows, k)).astype(np.float32) * 0.1)
    weights = bf16_bits_to_f32(f32_to_bf16_bits(dequantize(codes, scales)))
    product = bf16_bits_to_f32(a_bits) @ weights.T
    a, b = upload(rt, a_bits), upload(rt, pack_rows(codes, scales))
    maps = [rt.tile_map(a.ptr, m, k, 128, 64),
            rt.tile_map(b.ptr, rows, k, 128, 64, codes=True, row_bytes=FP8.row_bytes(k))]
    if kind == "swiglu":
        gate, up = product[:, :n], product[:, n:]
        expected = gate / (1 + np.exp(-gate)) * up
        out = poisoned(rt, m * n * 2)
        args = [*maps, b, out, ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k),
                ctypes.c_int(n), ctypes.c_int(n)]
        rt.launch(functions["gemm90_swiglu"], ((m + 127) // 128, (n + 127) // 128),
                  GEMM90_THREADS, args, shared=GEMM90_SHARED, stream=stream)
        stream.synchronize()
        got = bf16_bits_to_f32(download(out, np.uint16, (m, n)))
        assert np.isfinite(got).all() and rel_err(got, expected) <= 1e-2
        return
    width = int(kind.split("_")[1])
    base = rng.standard_normal((m, n)).astype(np.float32) if kind.startswith("add") else 0
    out = upload(rt, np.zeros((m, n), np.float32) + base)
    args = [*maps, b, out, ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(0),
            ctypes.c_int(n)]
    rt.launch(functions[f"gemm90_{kind}"], ((m + 127) // 128, (n + width - 1) // width),
              GEMM90_THREADS, args, shared=GEMM90_SHARED, stream=stream)
    stream.synchronize()
    # (a weight may round to the other bf16 neighbour: code x scale is formed as gemm.cu does)
    assert rel_err(download(out, np.float32, (m, n)), base + product) <= 1e-3


def reference_attention(q, k, v, start, group):
    """q: (n, heads, d); k, v: (kv_heads, length, d); causal with `start` cached keys."""
    n, heads, d = q.shape
    out = np.empty_like(q)
    for h in range(heads):
        scores = q[:, h] @ k[h // group].T / np.sqrt(d)
        mask = np.arange(k.shape[1])[None, :] > (start + np.arange(n))[:, None]
        scores[mask] = -np.inf
        p = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ v[h // group]
    return out


@pytest.mark.parametrize(("start", "n", "splits"), [
    (0, 83, 1), (37, 130, 1), (200, 1, 1),
    (200, 1, 3),  # one new token after a cached prefix, its keys in three blocks
    (450, 30, 5),  # a chat's next message: 480 keys in 5 splits of 2 tiles (one split empty)
    (0, 64, 16),  # more splits than tiles of keys: the empty ones must weigh nothing
])
def test_prefill_attention_matches_numpy(kernels, start, n, splits):
    rt, cfg, modules, stream = kernels
    rng = np.random.default_rng(start + n)
    cap, d, kvh, heads = 512, cfg.head_dim, cfg.num_key_value_heads, cfg.num_attention_heads
    q = f32_to_bf16_bits(rng.standard_normal((n, heads, d)).astype(np.float32))
    kc = f32_to_bf16_bits(rng.standard_normal((kvh, cap, d)).astype(np.float32))
    vc = f32_to_bf16_bits(rng.standard_normal((kvh, cap, d)).astype(np.float32))
    got = run_prefill_attention(rt, modules["attention.cu"], stream, q, upload(rt, kc),
                                upload(rt, vc), start, cap, splits)
    length = start + n
    expected = reference_attention(bf16_bits_to_f32(q), bf16_bits_to_f32(kc)[:, :length],
                                   bf16_bits_to_f32(vc)[:, :length], start, heads // kvh)
    assert rel_err(got, expected) <= 2e-2


def run_prefill_attention(rt, module, stream, q: np.ndarray, k_cache, v_cache, start: int,
                          capacity: int, splits: int) -> np.ndarray:
    """attention.cu's attn_prefill (and its merge of `splits` key blocks) for the queries q
    (bf16 bits, (n, heads, head_dim)) over the uploaded caches: the output as floats."""
    from qwenchat.engine.cuda.prefill import prefill_attention_shared

    n, heads, d = q.shape
    out = poisoned(rt, n * heads * d * 2)
    part_o = poisoned(rt, n * heads * splits * d * 4)
    part_ml = poisoned(rt, n * heads * splits * 2 * 4)
    prefill = module.function("attn_prefill")
    prefill.set_max_dynamic_shared(prefill_attention_shared(d))
    rt.launch(prefill, ((n + 63) // 64, heads, splits), 128,
              [upload(rt, q), k_cache, v_cache, rt.Ptr(0), ctypes.c_int(start),
               ctypes.c_int(n), ctypes.c_int(capacity), ctypes.c_float(d**-0.5), out, part_o,
               part_ml],
              shared=prefill_attention_shared(d), stream=stream)
    if splits > 1:
        rt.launch(module.function("attn_prefill_merge"), (n, heads), d,
                  [part_o, part_ml, ctypes.c_int(splits), out], stream=stream)
    stream.synchronize()
    return bf16_bits_to_f32(download(out, np.uint16, (n, heads, d)))


def run_decode_attention(rt, module, stream, q: np.ndarray, k_cache, v_cache, position: int,
                         capacity: int, kv_heads: int, splits: int) -> np.ndarray:
    """attention.cu's attn_decode_partial and attn_decode_merge for one query row q (bf16
    bits, (1, heads, head_dim)) at `position`: the output as floats."""
    _, heads, d = q.shape
    part_o, part_ml = poisoned(rt, heads * splits * d * 4), poisoned(rt, heads * splits * 8)
    out = poisoned(rt, heads * d * 4)
    rt.launch(module.function("attn_decode_partial"), (kv_heads, splits), 128,
              [upload(rt, q), k_cache, v_cache, upload(rt, np.array([position], np.int32)),
               ctypes.c_int(capacity), ctypes.c_float(d**-0.5), part_o, part_ml], stream=stream)
    rt.launch(module.function("attn_decode_merge"), heads, min(d, 128),
              [part_o, part_ml, ctypes.c_int(splits), out], shared=(splits + 3) // 4 * 16,
              stream=stream)
    stream.synchronize()
    return download(out, np.float32, (1, heads, d))


@pytest.mark.parametrize(("position", "splits"), [(0, 8), (300, 8), (4000, 24)])
def test_decode_attention_matches_numpy(kernels, position, splits):
    rt, cfg, modules, stream = kernels
    rng = np.random.default_rng(position)
    cap, d, kvh, heads = 8192, cfg.head_dim, cfg.num_key_value_heads, cfg.num_attention_heads
    q = f32_to_bf16_bits(rng.standard_normal((1, heads, d)).astype(np.float32))
    kc = f32_to_bf16_bits(rng.standard_normal((kvh, cap, d)).astype(np.float32))
    vc = f32_to_bf16_bits(rng.standard_normal((kvh, cap, d)).astype(np.float32))
    got = run_decode_attention(rt, modules["attention.cu"], stream, q, upload(rt, kc),
                               upload(rt, vc), position, cap, kvh, splits)
    length = position + 1
    expected = reference_attention(bf16_bits_to_f32(q), bf16_bits_to_f32(kc)[:, :length],
                                   bf16_bits_to_f32(vc)[:, :length], position, heads // kvh)
    assert rel_err(got, expected) <= 1e-3


def test_count_tokens_takes_a_passs_kept_tokens_by_value(kernels):
    """The rewind after a pass: its kept tokens (repeats counted twice) seen and counted, and
    the next step's token and position, all from the launch's own arguments."""
    from qwenchat.engine.cuda.engine import KeptTokens

    rt, cfg, modules, stream = kernels
    counts0 = np.arange(cfg.vocab_size, dtype=np.int32) % 3
    seen, counts = upload(rt, np.zeros(cfg.vocab_size, np.uint8)), upload(rt, counts0)
    token, pos = poisoned(rt, 4), poisoned(rt, 4)
    kept = KeptTokens(n=5, next_token=9, position=321)
    kept.ids[:6] = [3, 9, 3, 7, 9, 500]  # (the sixth is past n: not counted)
    rt.launch(modules["sampling.cu"].function("count_tokens"), 1, 32,
              [kept, seen, counts, token, pos], stream=stream)
    stream.synchronize()
    want_seen = np.zeros(cfg.vocab_size, np.uint8)
    want_seen[[3, 7, 9]] = 1
    want_counts = counts0.copy()
    want_counts[[3, 7, 9]] += [2, 1, 2]
    np.testing.assert_array_equal(download(seen, np.uint8, cfg.vocab_size), want_seen)
    np.testing.assert_array_equal(download(counts, np.int32, cfg.vocab_size), want_counts)
    assert download(token, np.int32, 1)[0] == 9 and download(pos, np.int32, 1)[0] == 321


def run_sampler(kernels, logits, params: dict, seen=None, counts=None, step=0, seed=0):
    from qwenchat.engine.cuda.sampler import SAMPLE_PARAMS, SAMPLER_HISTOGRAM_BYTES

    rt, cfg, modules, stream = kernels
    record = np.zeros(1, SAMPLE_PARAMS)
    defaults = dict(temperature=1.0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                    presence_penalty=0.0, frequency_penalty=0.0, top_k=0)
    for key, value in {**defaults, **params}.items():
        record[key] = value
    record["step"], record["seed"] = step, seed
    token = poisoned(rt, 4)
    blocks = 3  # several partial maxima to merge, as on the real vocabulary
    seen_buf = upload(rt, seen if seen is not None else np.zeros(cfg.vocab_size, np.uint8))
    counts_buf = upload(rt, counts if counts is not None else np.zeros(cfg.vocab_size, np.int32))
    work, record_buf = rt.DeviceBuffer(cfg.vocab_size * 4), upload(rt, record)
    partial_val, partial_idx = poisoned(rt, blocks * 4), poisoned(rt, blocks * 4)
    sampling = modules["sampling.cu"]
    rt.launch(sampling.function("sample_prepare"), blocks, 256,
              [upload(rt, logits.astype(np.float32)), work, record_buf, seen_buf, counts_buf,
               partial_val, partial_idx], stream=stream)
    choose = sampling.function("sample_token")
    choose.set_max_dynamic_shared(SAMPLER_HISTOGRAM_BYTES)
    rt.launch(choose, 1, 1024, [work, record_buf, partial_val, partial_idx, ctypes.c_int(blocks),
                                seen_buf, counts_buf, token, rt.Ptr(0)],
              shared=SAMPLER_HISTOGRAM_BYTES, stream=stream)
    stream.synchronize()
    return int(download(token, np.int32, 1)[0])


SAMPLERS = {
    # top-k within the megakernel's 64 candidates a block: chosen among the candidates
    "top-k 20": dict(temperature=0.7, top_k=20, top_p=0.8),
    "top-k 64, penalties": dict(temperature=0.6, top_k=64, top_p=0.95, repetition_penalty=1.3,
                                presence_penalty=0.5, frequency_penalty=0.25),
    # no top-k, or a larger one: chosen over the whole vocabulary
    "no top-k, min-p": dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.05),
    "top-k 100": dict(temperature=0.8, top_k=100, top_p=1.0),
}


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_the_sampler_kernel_draws_what_its_numpy_model_draws(kernels, sampler):
    from collections import Counter

    vocab = kernels[1].vocab_size
    params = SamplingParams(**SAMPLERS[sampler])
    fields = {name: getattr(params, name) for name in (
        "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
        "frequency_penalty", "top_k")}
    rng = np.random.default_rng(9)
    for step in range(40):
        logits = (3 * rng.standard_normal(vocab)).astype(np.float32)
        context = [int(i) for i in rng.integers(0, vocab, 30)]
        counts = Counter(int(i) for i in rng.integers(0, vocab, 10))
        seen = np.zeros(vocab, np.uint8)
        seen[context + list(counts)] = 1
        count_array = np.zeros(vocab, np.int32)
        count_array[list(counts)] = list(counts.values())
        token = run_sampler(kernels, logits, fields, seen=seen, counts=count_array, step=step,
                            seed=13)
        assert token == sample_token_gpu(logits, params, 13, step, context, counts), step


def test_greedy_is_the_exact_first_argmax(kernels):
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    logits[[17, 901]] = logits.max() + 1.0  # a tie: the lower id wins, as in NumPy and torch
    assert run_sampler(kernels, logits, {"temperature": 0.0}) == 17


def test_penalties_follow_the_reference_rules(kernels):
    logits = np.zeros(1000, np.float32)
    logits[[3, 4, 5]] = [2.0, 1.9, -0.5]
    seen = np.zeros(1000, np.uint8)
    seen[3] = 1
    assert run_sampler(kernels, logits, {"temperature": 0.0, "repetition_penalty": 1.2},
                       seen=seen) == 4  # 2.0 / 1.2 < 1.9
    counts = np.zeros(1000, np.int32)
    counts[4] = 2
    assert run_sampler(kernels, logits, {"temperature": 0.0, "repetition_penalty": 1.2,
                                         "frequency_penalty": 0.5}, seen=seen,
                       counts=counts) == 3  # 1.9 - 1.0 < 1.667


@pytest.mark.parametrize(("params", "allowed"), [
    ({"top_k": 3}, {10, 11, 12}),
    ({"top_p": 0.45}, {10}),
    ({"top_p": 0.75}, {10, 11}),
    ({"top_p": 0.85}, {10, 11, 12}),
    ({"min_p": 0.35}, {10, 11}),
    ({"top_k": 2, "top_p": 0.85}, {10, 11}),
])
def test_filters_keep_exactly_the_reference_candidates(kernels, params, allowed):
    probs = np.full(1000, 1e-9)
    probs[10:14] = [0.5, 0.3, 0.15, 0.05]
    logits = np.log(probs).astype(np.float32)
    drawn = {run_sampler(kernels, logits, params, step=s, seed=7) for s in range(200)}
    assert drawn == allowed


def test_sampling_frequencies_follow_the_distribution(kernels):
    probs = np.full(1000, 1e-9)
    probs[:4] = [0.4, 0.3, 0.2, 0.1]
    logits = np.log(probs).astype(np.float32)
    draws = np.array([run_sampler(kernels, logits, {}, step=s, seed=11) for s in range(2000)])
    for token, p in enumerate([0.4, 0.3, 0.2, 0.1]):
        assert abs(np.mean(draws == token) - p) < 0.04


# ------------------------------------------------------------------------------ CLI
def test_ask_on_cuda_prints_the_cpu_backends_greedy_text(model_dir):
    script = Path(sys.executable).parent / "qwenchat"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "qwenchat"]
    answers = []
    for backend in ("cuda", "cpu"):
        result = subprocess.run(
            [*command, "ask", "--backend", backend, "--model", str(model_dir), "--temperature",
             "0", "--max-tokens", "60", "-s", "Be brief.", "Hello 你好"],
            capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert result.returncode == 0, result.stderr
        answers.append(result.stdout)
    assert answers[0] == answers[1]


def test_peak_memory_is_weights_plus_cache_plus_256_mib(model_dir):
    from qwenchat.engine.cuda import runtime as rt

    before = rt.allocated_bytes()
    rt.reset_peak()
    gpu_engine, _ = engines(model_dir, ctx=1024)
    gpu_engine.prefill(list(range(1, 300)))
    list(gpu_engine.generate(GenerateRequest(
        LiveParams(SamplingParams(temperature=0.0, max_tokens=20)), frozenset(), seed=0)))
    used = rt.peak_allocated_bytes() - before
    assert used <= gpu_engine.weight_bytes + gpu_engine.kv_bytes + 256 * 2**20
    gpu_engine.close()


# ------------------------------------------------------------------------------ real shapes
REAL_SHAPES = {"qwen3-0.6b": None, "qwen3-1.7b": 2}  # preset -> layers kept (None: all)


@pytest.fixture(scope="module", params=list(REAL_SHAPES))
def real_shape(request):
    import dataclasses

    from qwenchat.engine.cuda.engine import CudaEngine
    from qwenchat.model.presets import PRESETS
    from qwenchat.model.random_weights import RandomWeights

    config = PRESETS[request.param]
    if REAL_SHAPES[request.param]:
        config = dataclasses.replace(config, num_hidden_layers=REAL_SHAPES[request.param])
    weights = RandomWeights(config, seed=0)
    gpu_engine = CudaEngine(config, weights, ctx=1024, decode="megakernel")
    yield config, weights, gpu_engine, ReferenceEngine(config, weights, ctx=1024)
    gpu_engine.close()


def test_real_shapes_prefill_matches_the_reference_and_transformers(real_shape):
    config, weights, gpu_engine, ref = real_shape
    ids = [int(i) for i in np.random.default_rng(5).integers(0, config.vocab_size, 256)]
    gpu_engine.truncate(0)
    ours = gpu_engine.prefill_logits(ids)
    ref.truncate(0)
    assert rel_err(ours, ref.prefill_logits(ids)) <= 2e-2
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from qwenchat.bench import transformers_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers_model(config, weights, device)
    with torch.no_grad():
        theirs = model(torch.tensor([ids], device=device)).logits[0].float().cpu().numpy()
    del model
    assert rel_err(ours, theirs) <= 2e-2


def test_real_shapes_short_prompt_after_a_history_splits_k_and_matches_the_reference(
        real_shape):
    """A chat's next message: 40 tokens after 300 cached, one graph launch (rows padded to 48,
    the start read from device memory) whose products split K (gemm_sm90.cu, where it runs),
    within 2e-2 of the reference, the same whether prefill_logits or prefill ran it; then 20
    more tokens at position 340."""
    from qwenchat.engine.cuda.prefill import SPLIT_K_MAX_ROWS, split_k

    config, _, gpu_engine, ref = real_shape
    rng = np.random.default_rng(11)
    history, turn = ([int(i) for i in rng.integers(0, config.vocab_size, n)] for n in (300, 40))
    assert len(turn) <= SPLIT_K_MAX_ROWS
    if gpu_engine.gemm90:  # the shapes split: Q/K/V at least
        qkv = config.q_size + 2 * config.kv_size
        assert split_k(len(turn), qkv, config.hidden_size, gpu_engine.device.sm_count) > 1
    gpu_engine.truncate(0)
    gpu_engine.prefill(history)
    ours = gpu_engine.prefill_logits(turn)
    again = gpu_engine.last_logits()
    gpu_engine.truncate(300)
    gpu_engine.prefill(turn)
    assert np.array_equal(gpu_engine.last_logits(), again)
    ref.truncate(0)
    ref.prefill(history)
    assert rel_err(ours, ref.prefill_logits(turn)) <= 2e-2
    # The next turn, shorter, at another start: another graph (or the same one replayed)
    # reading its start from device memory
    reply = [int(i) for i in rng.integers(0, config.vocab_size, 20)]
    assert rel_err(gpu_engine.prefill_logits(reply), ref.prefill_logits(reply)) <= 2e-2
    assert len(gpu_engine._short_graphs) <= 2


def test_hopper_gemm_split_k_sums_its_parts_in_order(hopper_gemm):
    """gemm90_store_128 over runs of K (gridDim.z) into partial products, then splitk_sum
    (store and add) and splitk_swiglu, against NumPy."""
    from qwenchat.engine.cuda.prefill import GEMM90_SHARED, GEMM90_THREADS

    rt, functions, stream = hopper_gemm
    rng = np.random.default_rng(3)
    m, inter, k, splits = 37, 200, 520, 3  # 9 steps of 64: runs of 3
    a_bits = f32_to_bf16_bits(rng.standard_normal((m, k)).astype(np.float32))
    b_bits = f32_to_bf16_bits(rng.standard_normal((2 * inter, k)).astype(np.float32) * 0.1)
    product = bf16_bits_to_f32(a_bits) @ bf16_bits_to_f32(b_bits).T
    a, b = upload(rt, a_bits), upload(rt, b_bits)
    n = 2 * inter
    parts = poisoned(rt, splits * m * n * 4)
    maps = [rt.tile_map(a.ptr, m, k, 128, 64), rt.tile_map(b.ptr, n, k, 128, 64)]
    rt.launch(functions["gemm90_store_128"], (1, (n + 127) // 128, splits), GEMM90_THREADS,
              [*maps, b, parts, ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k),
               ctypes.c_int(0), ctypes.c_int(n)], shared=GEMM90_SHARED, stream=stream)
    base = rng.standard_normal((m, n)).astype(np.float32)
    c = upload(rt, base)
    rt.launch(functions["splitk_sum"], 8, 256, [parts, ctypes.c_int(splits), ctypes.c_int(m),
                                                ctypes.c_int(n), c, ctypes.c_int(n),
                                                ctypes.c_int(1)], stream=stream)
    act = poisoned(rt, m * inter * 2)
    rt.launch(functions["splitk_swiglu"], 8, 256, [parts, ctypes.c_int(splits),
                                                   ctypes.c_int(m), ctypes.c_int(inter), act,
                                                   ctypes.c_int(inter)], stream=stream)
    stream.synchronize()
    assert rel_err(download(c, np.float32, (m, n)), base + product) <= 1e-4
    gate, up = product[:, :inter], product[:, inter:]
    expected = gate / (1 + np.exp(-gate)) * up
    got = bf16_bits_to_f32(download(act, np.uint16, (m, inter)))
    assert rel_err(got, expected) <= 1e-2


@pytest.mark.parametrize("decode", DECODES)
def test_real_shapes_decode_matches_the_reference_for_256_steps(real_shape, decode):
    config, _, gpu_engine, ref = real_shape
    gpu_engine.decode = decode
    gpu_engine.steps_per_launch, gpu_engine.launches_ahead = 1, 0
    prompt = [int(i) for i in np.random.default_rng(6).integers(0, config.vocab_size, 32)]
    gpu_engine.truncate(0)
    ref.truncate(0)
    gpu_engine.prefill(prompt)
    ref.prefill(prompt)
    assert worst_greedy_decode_error(gpu_engine, ref, 256) <= 2e-2


def drawn_at_a_near_tie(monkeypatch, token: int, logits, params, seed: int, step: int,
                        context, counts) -> bool:
    """Whether the replica (sample_token_gpu) draws `token` for a uniform number within 1e-5
    of this step's: the GPU's weights (expf on the device) differ from the replica's in
    their low bits, and summed over ~16K kept tokens that can move a boundary that far
    (measured: 5.5e-6 of the total mass at step 36 of the 0.6B shape, no top-k, min-p)."""
    from qwenchat.sampling import sampler as sampling

    u = sampling.uniform(seed, step)
    for shift in (-1e-5, 1e-5):
        monkeypatch.setattr(sampling, "uniform", lambda _seed, _step, v=u + shift: v)
        drawn = sample_token_gpu(logits, params, seed, step, context, counts)
        monkeypatch.undo()
        if drawn == token:
            return True
    return False


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_sampled_tokens_are_the_gpu_samplers_draws_from_the_logits(real_shape, decode, sampler,
                                                                   monkeypatch):
    from collections import Counter

    config, _, gpu_engine, _ = real_shape
    gpu_engine.decode = decode
    gpu_engine.steps_per_launch, gpu_engine.launches_ahead = 1, 0  # last_logits(): the step's
    prompt = [int(i) for i in np.random.default_rng(8).integers(0, config.vocab_size, 24)]
    gpu_engine.truncate(0)
    gpu_engine.prefill(prompt)
    params = SamplingParams(**SAMPLERS[sampler], seed=11, max_tokens=48)
    context, counts = list(prompt), Counter()
    tokens, near_ties = [], 0
    for step, token in enumerate(gpu_engine.generate(GenerateRequest(LiveParams(params),
                                                                     frozenset(), seed=0))):
        logits = gpu_engine.last_logits()
        expected = sample_token_gpu(logits, params, 11, step, context, counts)
        if token != expected:  # allowed only where the draw sits on a boundary
            assert drawn_at_a_near_tie(monkeypatch, token, logits, params, 11, step, context,
                                       counts), f"step {step}: {token}, not {expected}"
            near_ties += 1
        tokens.append(token)
        context.append(token)
        counts[token] += 1
    assert len(tokens) == 48 and len(set(tokens)) > 1  # a real draw, not one repeated token
    assert near_ties <= 2


def test_megakernel_applies_a_parameter_change_to_the_next_token_mid_launch(real_shape):
    config, _, gpu_engine, ref = real_shape
    gpu_engine.decode = "megakernel"
    gpu_engine.steps_per_launch, gpu_engine.launches_ahead = 64, 1
    prompt = [int(i) for i in np.random.default_rng(7).integers(0, config.vocab_size, 16)]
    gpu_engine.truncate(0)
    gpu_engine.prefill(prompt)
    params = LiveParams(SamplingParams(temperature=1.5, top_k=0, top_p=1.0, seed=3,
                                       max_tokens=60))
    tokens, sampled_before_switch = [], None
    for token in gpu_engine.generate(GenerateRequest(params, frozenset(), seed=0)):
        tokens.append(token)
        if len(tokens) == 8:
            params.update(temperature=0.0)  # written to mapped memory before update returns
            # What the kernel had chosen once the change was there to read: counted after the
            # write, so that a host thread descheduled between the two (a loaded machine, -n 8)
            # cannot let tokens sampled before the write count as after it.
            sampled_before_switch = gpu_engine.megakernel_produced()
    assert sampled_before_switch < len(tokens), (
        f"the launch ended before the change ({sampled_before_switch} of {len(tokens)} tokens "
        "produced when it landed)")
    ref.truncate(0)
    ref.prefill(prompt)
    for index, token in enumerate(tokens):
        # Two tokens may be chosen with the old parameters after the count: the one in flight,
        # and the next, whose parameters the kernel fetches while it chooses the one in flight
        # (so that a change costs no step its wait for the host).
        if index > sampled_before_switch + 1:
            # Greedy from here on. bf16 on the GPU against float32 here may swap near-ties, so
            # "greedy" means within 2% of the logit range of the top (a T=1.5 draw over the
            # whole vocabulary lands far below it).
            logits = ref.last_logits()
            assert logits[token] >= logits.max() - 0.02 * (logits.max() - logits.min()), (
                f"token {index} (the change landed with {sampled_before_switch} produced) is "
                f"{(logits.max() - logits[token]) / (logits.max() - logits.min()):.1%} of the "
                "logit range below the top: not greedy")
        ref.prefill([token])


def test_megakernel_cancel_stops_within_one_step(real_shape):
    gpu_engine = real_shape[2]
    gpu_engine.decode = "megakernel"
    gpu_engine.steps_per_launch, gpu_engine.launches_ahead = 64, 1
    gpu_engine.truncate(0)
    gpu_engine.prefill(list(range(100, 120)))
    request = GenerateRequest(LiveParams(SamplingParams(temperature=0.0)), frozenset(), seed=0)
    generation = gpu_engine.generate(request)
    for count, _ in enumerate(generation, start=1):
        if count == 5:
            request.cancel.set()
            produced_at_cancel = gpu_engine.megakernel_produced()
    assert generation.stop_reason is StopReason.CANCELLED and count == 5
    assert gpu_engine.megakernel_produced() <= produced_at_cancel + 1
    assert gpu_engine.position == 20 + 4


def greedy_tokens(gpu_engine, prompt, n, eos=frozenset(), pause_s=0.0):
    """A greedy reply of at most n tokens on the megakernel, the host pausing `pause_s` after
    each of the first eight tokens (a busy UI thread); also the request's stop reason."""
    gpu_engine.truncate(0)
    gpu_engine.prefill(prompt)
    request = GenerateRequest(LiveParams(SamplingParams(temperature=0.0, max_tokens=n)), eos,
                              seed=0)
    generation = gpu_engine.generate(request)
    tokens = []
    for token in generation:
        tokens.append(token)
        if len(tokens) <= 8:
            time.sleep(pause_s)
    return tokens, generation.stop_reason


def queued_megakernel(real_shape, steps_per_launch: int):
    """The shape's engine on the megakernel, one launch queued behind the running one."""
    gpu_engine = real_shape[2]
    gpu_engine.decode = "megakernel"
    gpu_engine.steps_per_launch, gpu_engine.launches_ahead = steps_per_launch, 1
    return gpu_engine


def test_megakernel_queues_the_next_launch_so_a_late_host_loses_nothing(real_shape):
    gpu_engine = queued_megakernel(real_shape, 16)
    prompt = list(range(300, 330))
    alone, _ = greedy_tokens(gpu_engine, prompt, 100)
    gpu_engine.truncate(0)
    gpu_engine.prefill(prompt)
    request = GenerateRequest(LiveParams(SamplingParams(temperature=0.0, max_tokens=100)),
                              frozenset(), seed=0)
    generation = gpu_engine.generate(request)
    first = next(generation)
    assert gpu_engine._mk_requested == 32  # the running launch and one queued behind it
    time.sleep(0.5)  # far longer than both launches take: the second ran without the host
    assert gpu_engine.megakernel_produced() == 32
    late = [first, *generation]
    assert late == alone and len(late) == 100
    paused, reason = greedy_tokens(gpu_engine, prompt, 100, pause_s=0.02)
    assert paused == alone and reason is StopReason.MAX_TOKENS


def test_megakernel_stops_at_eos_and_the_launch_queued_behind_writes_nothing(real_shape):
    gpu_engine = queued_megakernel(real_shape, 8)
    prompt = list(range(500, 520))
    alone, _ = greedy_tokens(gpu_engine, prompt, 60)
    end = alone.index(alone[19])  # the first time the 20th token appears: a stop there
    tokens, reason = greedy_tokens(gpu_engine, prompt, 60, eos=frozenset({alone[end]}))
    assert reason is StopReason.EOS and tokens == alone[: end + 1]
    assert gpu_engine.megakernel_produced() == end + 1  # nothing after the EOS, in any launch
    assert gpu_engine.position == len(prompt) + end  # the EOS itself is never run
    # The next reply starts from the right place.
    again, _ = greedy_tokens(gpu_engine, prompt, 60)
    assert again == alone


# ------------------------------------------------------------------ the largest sizes
@pytest.fixture(scope="module", params=["qwen3-14b", "qwen3-32b"])
def wide_shape(request):
    """Two layers of 14B's or 32B's width (SwiGLU vectors of 17,408 and 25,600 floats, longer
    than a block's static shared memory), with the reference engine on the same weights."""
    import dataclasses

    from qwenchat.model.presets import PRESETS
    from qwenchat.model.random_weights import RandomWeights

    config = dataclasses.replace(PRESETS[request.param], num_hidden_layers=2)
    weights = RandomWeights(config, seed=1)
    return config, weights, ReferenceEngine(config, weights, ctx=256)


@pytest.mark.parametrize("decode", DECODES)
def test_the_largest_widths_decode_as_the_reference_on_both_paths(wide_shape, decode):
    from qwenchat.engine.cuda.engine import CudaEngine
    from qwenchat.engine.cuda.megakernel import fp8_on_tensor_cores, megakernel_layout

    config, weights, ref = wide_shape
    notices = []
    gpu_engine = CudaEngine(config, weights, ctx=256, decode=decode, notice=notices.append)
    try:
        device = gpu_engine.device
        fits = megakernel_layout(config, device.max_shared_per_block_optin, device.sm_count,
                                 gpu_engine.weight_format, fp8_on_tensor_cores(device.arch))
        if decode == "megakernel" and isinstance(fits, str):
            # Too wide for the megakernel on this GPU: it says why and uses the graph.
            assert gpu_engine.decode == "layered" and any(fits in n for n in notices)
        else:
            assert gpu_engine.decode == decode
        if gpu_engine.decode == "megakernel":
            gpu_engine.steps_per_launch, gpu_engine.launches_ahead = 1, 0
        prompt = [int(i) for i in np.random.default_rng(8).integers(0, config.vocab_size, 24)]
        ref.truncate(0)
        expected = ref.prefill_logits(prompt)
        assert rel_err(gpu_engine.prefill_logits(prompt), expected) <= 2e-2
        assert worst_greedy_decode_error(gpu_engine, ref, 32) <= 2e-2
    finally:
        gpu_engine.close()


# ------------------------------------------------------------------ cold start
def test_a_cold_engine_compiles_its_kernels_concurrently_and_reports_each(isolated_home,
                                                                          tiny_model_dir):
    from qwenchat.engine.cuda.engine import CudaEngine

    model = open_model_dir(tiny_model_dir)
    notices: list[str] = []
    ended: list[str] = []
    engine = CudaEngine(model.config, model.checkpoint, 256, notice=notices.append,
                        progress=ended.append)
    try:
        engine.prefill([1, 2, 3])
        tokens = list(engine.generate(GenerateRequest(
            LiveParams(SamplingParams(temperature=0.0, max_tokens=4)), frozenset(), seed=0)))
    finally:
        engine.close()
    (announced,) = [n for n in notices if n.startswith("compiling ")]
    count = int(announced.split()[1])
    assert count >= 4 and len(ended) == count
    assert ended[-1].endswith(f"({count} of {count})")
    assert len(tokens) == 4  # the engine built from them answers


def test_info_compile_fills_the_cache_so_the_first_engine_compiles_nothing(isolated_home,
                                                                           tiny_model_dir):
    from qwenchat.engine.cuda.engine import CudaEngine
    from qwenchat.info import CompileOptions, precompile

    said: list[str] = []
    summary = precompile(CompileOptions(model=str(tiny_model_dir)), said.append)
    assert said[0].startswith("compiling ") and ", 0 already cached" in summary
    model = open_model_dir(tiny_model_dir)
    notices: list[str] = []
    ended: list[str] = []
    CudaEngine(model.config, model.checkpoint, 256, notice=notices.append,
               progress=ended.append).close()
    assert not [n for n in notices if n.startswith("compiling")] and ended == []
    assert ": 0 compiled," in precompile(CompileOptions(model=str(tiny_model_dir)), said.append)


# ------------------------------------------------------------------ random weights on the device
@pytest.mark.parametrize("weight_format", ["bf16", "fp8"])
def test_random_weights_drawn_on_the_device_are_the_cpus_to_the_bit(weight_format):
    import dataclasses

    from qwenchat.engine.cuda.engine import CudaEngine
    from qwenchat.model import fp8
    from qwenchat.model.presets import PRESETS
    from qwenchat.model.random_weights import RandomWeights

    config = dataclasses.replace(PRESETS["qwen3-0.6b"], num_hidden_layers=2,
                                 tie_word_embeddings=False)
    weights = RandomWeights(config, seed=5, weight_format=weight_format)
    engine = CudaEngine(config, weights, ctx=256, decode="layered")
    try:
        def device(buffer) -> np.ndarray:
            out = np.empty(buffer.nbytes, np.uint8)
            buffer.download(out)
            return out

        def host(*names: str) -> np.ndarray:
            parts = [fp8.pack_rows(*weights.fp8_blocks(n)) if weights.fp8_blocks(n) is not None
                     else weights.bf16_bits(n) for n in names]
            return np.concatenate([np.ascontiguousarray(p).view(np.uint8).ravel()
                                   for p in parts])

        layer = "model.layers.1."
        assert np.array_equal(device(engine.layers[1].gate_up),
                              host(layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"))
        assert np.array_equal(device(engine.layers[1].qkv),
                              host(*(layer + f"self_attn.{x}_proj.weight" for x in "qkv")))
        assert np.array_equal(device(engine.layers[1].k_norm),
                              host(layer + "self_attn.k_norm.weight"))
        assert np.array_equal(device(engine.embed), host("model.embed_tokens.weight"))
        assert np.array_equal(device(engine.lm_head), host("lm_head.weight"))
    finally:
        engine.close()


# ---------------------------------------------------------------------------------- YaRN
@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen3-8b"])
def test_yarn_prefill_and_decode_past_the_original_length_follow_the_reference(decode, shape):
    """Two layers of 0.6B's or 8B's widths with YaRN x4 over 256 trained positions: a
    700-token prompt (positions to 2.7x the original length) and 64 greedy steps on each
    decode path, within 2e-2 of the reference (the frequency table and the attention factor in
    the softmax scale, issue 26). The megakernel's attention runs on the CUDA cores for 0.6B's
    two query heads a kv head, on the tensor cores for 8B's four."""
    import dataclasses

    from qwenchat.engine.cuda.engine import CudaEngine
    from qwenchat.model import rope
    from qwenchat.model.presets import PRESETS
    from qwenchat.model.random_weights import RandomWeights

    config = rope.with_flag(dataclasses.replace(PRESETS[shape], num_hidden_layers=2),
                            "yarn:4:256")
    weights = RandomWeights(config, seed=9)
    gpu = CudaEngine(config, weights, ctx=1024, decode=decode)
    ref = ReferenceEngine(config, weights, ctx=1024)
    try:
        if gpu.decode == "megakernel":
            gpu.steps_per_launch, gpu.launches_ahead = 1, 0
        prompt = [int(i) for i in np.random.default_rng(9).integers(0, config.vocab_size, 700)]
        assert rel_err(gpu.prefill_logits(prompt), ref.prefill_logits(prompt)) <= 2e-2
        assert worst_greedy_decode_error(gpu, ref, 64) <= 2e-2
    finally:
        gpu.close()


# ------------------------------------------------------------------------------ eval's rows
@pytest.mark.parametrize("decode", DECODES)
def test_decode_rows_are_the_logits_a_greedy_reply_decodes_with(model_dir, decode):
    """eval --path decode's teacher-forced steps: within 2e-2 of the reference's logits token
    by token, and bit for bit the logits a greedy reply's own steps give once the cache holds
    the same ids (the steps are the reply's, only their input comes from the host)."""
    gpu_engine, ref = engines(model_dir, decode=decode, steps_per_launch=1)
    again, _ = engines(model_dir, decode=decode, steps_per_launch=1)
    prompt = [int(i) for i in np.random.default_rng(5).integers(0, 400, 40)]
    try:
        rows = gpu_engine.decode_rows(prompt)
        assert rows.shape == (len(prompt), ref.config.vocab_size)
        expected = []
        for token in prompt:
            ref.prefill([token])
            expected.append(ref.last_logits())
        assert rel_err(rows, np.stack(expected)) <= 2e-2
        request = GenerateRequest(LiveParams(SamplingParams(temperature=0.0, max_tokens=24)),
                                  frozenset(), seed=0)
        reply, logits = [], []
        for token in gpu_engine.generate(request):  # (each token's logits: it was drawn from)
            reply.append(token)
            logits.append(gpu_engine.last_logits())
        assert len(reply) == 24
        forced = again.decode_rows(prompt + reply[:-1])
        assert np.array_equal(forced[len(prompt) - 1:], np.stack(logits))
        assert again.position == len(prompt) + len(reply) - 1
    finally:
        gpu_engine.close()
        again.close()


@pytest.mark.parametrize("hopper", [False, True])  # the LM head's products: gemm.cu or sm90
def test_evals_window_graphs_give_the_rows_launched_kernels_give(model_dir, hopper):
    """A window replayed as a graph (_window_graph) computes what its kernels launched one by
    one do, bit for bit, captured first on a fresh engine (nothing allocated during the
    capture); replayed on other ids, it gives theirs, not the captured window's."""
    gpu_engine, _ = engines(model_dir)
    if hopper and not gpu_engine.gemm90:
        gpu_engine.close()
        pytest.skip("the Hopper GEMM runs on sm_90 only")
    gpu_engine.score_on_hopper_gemm = hopper
    rng = np.random.default_rng(11)
    vocab = gpu_engine.config.vocab_size
    n = min(200, gpu_engine.chunk)
    windows = [rng.integers(0, vocab, n).tolist() for _ in range(2)]

    def run(ids):
        gpu_engine.truncate(0)
        rows = gpu_engine.window_rows(ids)
        assert gpu_engine.position == n
        with pytest.raises(RuntimeError, match="prefill first"):
            gpu_engine.last_logits()  # (window_rows keeps none)
        return gpu_engine.download_rows(rows, 0, n)

    try:
        replayed = [run(ids) for ids in windows + windows[:1]]
        assert len(gpu_engine._window_graphs) == 1  # captured once, replayed twice
        gpu_engine.score_in_graphs = False
        launched = [run(ids) for ids in windows]
        for rows, rows_g in zip(launched + launched[:1], replayed, strict=True):
            assert np.array_equal(rows, rows_g)
        assert not np.array_equal(replayed[0], replayed[1])
    finally:
        gpu_engine.close()


@pytest.mark.parametrize("hopper", [False, True])  # the LM head's products: gemm.cu or sm90
@pytest.mark.parametrize("n", [300, 7])  # a prefill's rows; a window the speculative pass runs
def test_evals_rows_and_their_scores_on_the_device_are_the_hosts(model_dir, n, hopper):
    """window_rows (the LM head as products of the window's rows) gives the per-row path's
    logits, and score.cu's numbers are eval.py's from those logits on the host."""
    from qwenchat import eval as ev
    from qwenchat.engine.cuda.engine import CudaEngine

    gpu_engine, _ = engines(model_dir)
    if hopper and not gpu_engine.gemm90:
        gpu_engine.close()
        pytest.skip("the Hopper GEMM runs on sm_90 only")
    gpu_engine.score_on_hopper_gemm = hopper
    model = open_model_dir(model_dir)
    other = CudaEngine(model.config, model.checkpoint, decode="layered")
    rng = np.random.default_rng(n)
    vocab = model.config.vocab_size
    ids = rng.integers(0, vocab, n).tolist()
    other_ids = rng.integers(0, vocab, n).tolist()  # a base whose rows differ from ours
    try:
        host = gpu_engine.prefill_logits(ids)  # a row at a time: the LM head's GEMV
        gpu_engine.truncate(0)
        rows = gpu_engine.window_rows(ids)
        got = gpu_engine.download_rows(rows, 0, n)
        assert rel_err(got, host) < 5e-5
        base_host = other.prefill_logits(other_ids)
        other.truncate(0)
        base_rows = other.window_rows(other_ids)
        first = 1
        targets = rng.integers(0, vocab, n - first)
        figures = gpu_engine.score_rows(rows, first, targets, base_rows)
        ours, theirs = ev.Rows.of(got[first:]), ev.Rows.of(other.download_rows(base_rows, first,
                                                                                n - first))
        at = np.arange(n - first)
        np.testing.assert_allclose(figures[:, 0], ours.lse, rtol=0, atol=2e-6)
        assert np.array_equal(figures[:, 1], ours.logits[at, targets].astype(np.float64))
        assert np.array_equal(figures[:, 2], ours.argmax())
        np.testing.assert_allclose(figures[:, 3], ev.kl_full(theirs, ours), rtol=1e-4, atol=1e-7)
        assert figures[:, 3].min() > 1e-3  # (different contexts: far apart)
        np.testing.assert_allclose(figures[:, 4], theirs.lse, rtol=0, atol=2e-6)
        assert np.array_equal(figures[:, 5], theirs.logits[at, targets].astype(np.float64))
        assert np.array_equal(figures[:, 6], theirs.argmax())
        assert rel_err(theirs.logits, base_host[first:]) < 5e-5
        alone = gpu_engine.score_rows(rows, first, targets)  # no base: those four are NaN
        assert np.array_equal(alone[:, :3], figures[:, :3]) and np.isnan(alone[:, 3:7]).all()
        top = rng.integers(0, vocab, (n - first, 5))
        assert np.array_equal(gpu_engine.gather_rows(rows, first, top),
                              np.take_along_axis(got[first:], top, axis=-1))
    finally:
        gpu_engine.close()
        other.close()

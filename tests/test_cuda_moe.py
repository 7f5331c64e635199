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
# Against the reference, every expert is chosen (top-k = all of them; TINY_MOE's layer 1 stays
# dense): the routing weights are then continuous in the router's logits, so the engines' small
# differences (the GPU's prefill takes bf16 inputs) stay small, where with a real top-k a
# router near-tie would send a token to another expert on one engine than on the other. The
# top-k choice itself is checked against NumPy on the GPU's own logits (the stage tests below),
# and a run's tokens against a second run's on a real top-k ("wide-top4").
# "all-wide": experts of 128 rows on a 128-wide model (FP8's 128-column blocks whole); 300
# tokens make several 128-row tiles an expert in the grouped products.
MOE_SHAPES = {
    "all-tiny": dict(num_experts=4, num_experts_per_tok=4),
    "all-wide": dict(hidden_size=128, intermediate_size=128, head_dim=32, moe_intermediate_size=128,
                     num_experts=6, num_experts_per_tok=6, norm_topk_prob=False, seed=3),
    "wide-top4": dict(hidden_size=128, intermediate_size=128, head_dim=32,
                      moe_intermediate_size=128, num_experts=9, num_experts_per_tok=4,
                      norm_topk_prob=False, seed=3),
    "wide-long": dict(hidden_size=128, intermediate_size=128, head_dim=32,
                      moe_intermediate_size=3200, num_experts=5, num_experts_per_tok=4,
                      norm_topk_prob=True, seed=5),
    # The decode megakernel's (every layer sparse, whole-line KV rows: head_dim 64)
    "mk-all": dict(hidden_size=128, intermediate_size=128, head_dim=64, num_attention_heads=2,
                   num_key_value_heads=1, moe_intermediate_size=128, num_experts=6,
                   num_experts_per_tok=6, norm_topk_prob=False, mlp_only_layers=[], seed=3),
    "mk-top4": dict(hidden_size=128, intermediate_size=128, head_dim=64, num_attention_heads=2,
                    num_key_value_heads=1, moe_intermediate_size=128, num_experts=9,
                    num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[], seed=4),
    # Hopper's grouped products (moe_sm90.cu) off their tiles' grid: 336 features end inside a
    # 128-wide tile (its gate box reads into the up rows, its up box into the next expert's),
    # 464 outputs inside a 256-wide one, K = 336 and 464 inside a 64-deep step (and, FP8,
    # inside a 128-column block); 500 tokens to 3 of 5 experts make about three tiles an
    # expert, the last partial.
    "odd-wide": dict(hidden_size=464, intermediate_size=128, head_dim=32,
                     moe_intermediate_size=336, num_experts=5, num_experts_per_tok=3,
                     norm_topk_prob=True, seed=6),
}
ALL_ROUTED = ("all-tiny", "all-wide")
FORMATS = ("BF16", "FP8", "AWQ")  # (AWQ: int4 rows are whole groups of 128, so the wide shapes)


def write_moe(tmp_path_factory, tiny_tokenizer, shape: str, dtype: str = "BF16"):
    from tiny_model import write_tiny_moe_model

    return write_tiny_moe_model(tmp_path_factory.mktemp(f"moe-{shape}-{dtype}") / "m",
                                dtype=dtype, tokenizer=tiny_tokenizer, **MOE_SHAPES[shape])


@pytest.fixture(scope="module", params=[(shape, dtype) for shape in ALL_ROUTED
                                        for dtype in FORMATS
                                        if dtype != "AWQ" or shape == "all-wide"],
                ids=lambda p: f"{p[0]}-{p[1]}")
def moe_dir(request, tmp_path_factory, tiny_tokenizer):
    return write_moe(tmp_path_factory, tiny_tokenizer, *request.param)


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


def test_a_mixture_of_experts_on_an_int8_cache_follows_the_reference_on_one(moe_dir):
    """The int8 KV cache (kv8.cuh) under the sparse layers: prefill in two parts (the second
    attends to the first through the cache's int8 rows) and 64 greedy steps, against the
    reference engine on its own int8 cache."""
    from test_cuda_engine import rel_err, worst_greedy_decode_error

    from qwenchat.engine.cuda.engine import CudaEngine
    from qwenchat.engine.reference import ReferenceEngine
    from qwenchat.model.loader import open_model_dir

    model = open_model_dir(moe_dir)
    gpu = CudaEngine(model.config, model.checkpoint, 512, kv_cache="int8", decode="layered")
    ref = ReferenceEngine(model.config, model.checkpoint, 512, kv_cache="int8")
    try:
        assert gpu.kv_format == "int8"
        prompt = [int(i) for i in np.random.default_rng(6).integers(0, 400, 300)]
        for part in (prompt[:200], prompt[200:]):
            assert rel_err(gpu.prefill_logits(part), ref.prefill_logits(part)) <= 2e-2
        assert worst_greedy_decode_error(gpu, ref, 64) <= 2e-2
    finally:
        gpu.close()


@pytest.mark.parametrize("dtype", FORMATS)
def test_a_mixture_of_experts_gives_the_same_tokens_run_after_run(tmp_path_factory,
                                                                  tiny_tokenizer, dtype):
    from test_cuda_engine import engines

    from qwenchat.engine.base import GenerateRequest
    from qwenchat.sampling.params import LiveParams, SamplingParams

    directory = write_moe(tmp_path_factory, tiny_tokenizer, "wide-top4", dtype)
    replies = []
    for _ in range(2):
        gpu_engine, _ = engines(directory)
        gpu_engine.prefill([int(i) for i in np.random.default_rng(4).integers(0, 400, 300)])
        params = LiveParams(SamplingParams(temperature=0.8, top_p=0.9, max_tokens=64))
        replies.append(list(gpu_engine.generate(GenerateRequest(params, frozenset(), seed=7))))
        gpu_engine.close()
    assert replies[0] == replies[1] and len(replies[0]) == 64


# --- each stage of a sparse layer against NumPy, on the GPU's own output of the stage before --
# (so that a router near-tie cannot hide a wrong product: the experts are checked on the
# experts the GPU chose, and the choice on the logits it computed)
@pytest.fixture(scope="module", params=FORMATS)
def wide_engine(request, tmp_path_factory, tiny_tokenizer):
    from qwenchat.engine.cuda.engine import CudaEngine
    from qwenchat.model.loader import open_model_dir

    model = open_model_dir(write_moe(tmp_path_factory, tiny_tokenizer, "wide-top4",
                                     request.param))
    engine = CudaEngine(model.config, model.checkpoint, decode="layered")
    yield engine, model
    engine.close()


def moe_weights(model, layer: int, rounded: bool):
    """The router (experts x hidden) as the GPU holds it, in bf16 (an AWQ file's float16 router
    is rounded on upload, as its norms and embedding are), and each expert's gate, up and down
    rows as the checkpoint holds them (FP8 and int4: code x scale), `rounded` to bf16 as the
    prefill's products take them."""
    prefix = f"model.layers.{layer}.mlp."

    def get(name: str) -> np.ndarray:
        values = model.checkpoint.float32(prefix + name).astype(np.float64)
        return bf16_round(values) if rounded else values

    experts = [{proj: get(f"experts.{e}.{proj}_proj.weight") for proj in ("gate", "up", "down")}
               for e in range(model.config.num_experts)]
    return bf16_round(model.checkpoint.float32(prefix + "gate.weight").astype(np.float64)), experts


def bf16_round(values: np.ndarray) -> np.ndarray:
    from qwenchat.model.floats import bf16_bits_to_f32, f32_to_bf16_bits

    return bf16_bits_to_f32(f32_to_bf16_bits(values.astype(np.float32))).astype(np.float64)


def silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def test_a_pass_routes_groups_and_sums_its_tokens_experts_as_numpy_does(wide_engine):
    check_pass(*wide_engine, 300)


def check_pass_in_parts(engine, model, n: int, parts: int) -> None:
    """check_pass with the staging taken as too short for the pass's bf16 down rows whole, so
    that its down products and weighted sums run a `parts`th of the columns at a time."""
    cfg = model.config
    whole = n * cfg.num_experts_per_tok * cfg.hidden_size * 2
    kept = engine.moe_stage_size
    engine.moe_stage_size = whole // parts  # (the buffer itself is larger: nothing overflows)
    try:
        assert engine._moe_pass_parts(n) == parts
        check_pass(engine, model, n)
    finally:
        engine.moe_stage_size = kept


def test_a_pass_sums_its_experts_a_part_of_the_columns_at_a_time_where_staging_is_short(
        wide_engine):
    check_pass_in_parts(*wide_engine, 300, 4)


@pytest.mark.parametrize("dtype", ["BF16", "FP8"])
def test_hoppers_grouped_products_take_experts_off_their_tiles_grid(tmp_path_factory,
                                                                    tiny_tokenizer, dtype):
    from qwenchat.engine.cuda.engine import CudaEngine
    from qwenchat.model.loader import open_model_dir

    model = open_model_dir(write_moe(tmp_path_factory, tiny_tokenizer, "odd-wide", dtype))
    engine = CudaEngine(model.config, model.checkpoint, decode="layered")
    try:
        # moe_sm90.cu wherever Hopper's GEMMs run the dense products (moe.cu's moe_gemm else)
        assert engine.moe90 == engine.gemm90
        check_pass(engine, model, 500)
        # a half of 464 outputs (232) a part: inside one 256-wide tile, off its grid
        check_pass_in_parts(engine, model, 500, 2)
    finally:
        engine.close()


def check_pass(engine, model, n: int) -> np.ndarray:
    """One sparse layer's pass over n random rows: the router's logits, its choices and
    weights, the grouping and the experts' sum, each against NumPy on the GPU's own input: x
    after RMSNorm, as rmsnorm_rows left it in xn, or for a pass of at most moe_few_rows as
    verify.cuh's PassNorm takes it (x times the norm's weights in bf16, over the rms).
    Returns the experts chosen (n x top-k)."""
    from test_cuda_engine import download

    from qwenchat.model.floats import bf16_bits_to_f32, f32_to_bf16_bits

    cfg = model.config
    h, k, e = cfg.hidden_size, cfg.num_experts_per_tok, cfg.num_experts
    assert n <= engine.chunk and cfg.sparse_layer(0)
    rng = np.random.default_rng(5)
    x0 = rng.standard_normal((n, h)).astype(np.float32)
    engine.xn.fill_u8(0xFF)  # (NaN: the pass writes what it reads)
    engine.x.upload(x0)
    engine._moe_pass(0, engine.layers[0], n)
    engine.stream.synchronize()
    gain = bf16_bits_to_f32(download(engine.layers[0].post_norm, np.uint16, (h,)))
    rms = np.sqrt((x0.astype(np.float64) ** 2).mean(axis=1, keepdims=True)
                  + np.float32(cfg.rms_norm_eps))
    if n <= engine.moe_few_rows:
        xn = bf16_bits_to_f32(f32_to_bf16_bits(x0 * gain)).astype(np.float64) / rms
    else:  # (rmsnorm_rows' bf16 rows, as the GPU stored them)
        xn = bf16_bits_to_f32(download(engine.xn, np.uint16, (n, h))).astype(np.float64)
        want_xn = x0 / rms * gain
        assert np.abs(xn - want_xn).max() <= 2**-7 * np.abs(want_xn).max()
    router, experts = moe_weights(model, 0, rounded=True)

    logits = download(engine.moe_logits, np.float32, (n, e))
    want = xn @ router.T
    assert np.abs(logits - want).max() <= 1e-5 * np.abs(want).max()
    chosen = download(engine.moe_ids, np.int32, (n, k))
    weights = download(engine.moe_weights, np.float32, (n, k))
    want_w, want_e = route(logits, k, cfg.norm_topk_prob)
    np.testing.assert_array_equal(chosen, want_e)
    np.testing.assert_allclose(weights, want_w, rtol=2e-6)

    # The grouping: every pair has a row, expert by expert, the tokens in order within one.
    slot = download(engine.moe_slot, np.int32, (n * k,))
    token = download(engine.moe_token, np.int32, (n * k,))
    assert sorted(slot.tolist()) == list(range(n * k))
    np.testing.assert_array_equal(token[slot], np.arange(n * k) // k)
    order = np.argsort(chosen.reshape(-1), kind="stable")
    np.testing.assert_array_equal(slot[order], np.arange(n * k))
    counts = np.bincount(chosen.reshape(-1), minlength=e)
    np.testing.assert_array_equal(download(engine.moe_counts, np.int32, (e,)), counts)
    assert int(download(engine.moe_n_tiles, np.int32, (1,))[0]) == int(np.sum(-(-counts // 128)))
    if n > 128:  # (the rows are enough for an expert's to take more than one tile)
        assert counts.max() > 128

    # The experts' outputs are rounded to bf16 (as transformers' are) before their weighted sum;
    # one that lies on the edge between two bf16 values may round the other way on the GPU
    # (slack: one bf16 step of each), as may a SwiGLU output (the 2e-3).
    out, slack = x0.astype(np.float64), np.zeros((n, h))
    for t in range(n):
        for j in range(k):
            ex = experts[chosen[t, j]]
            act = bf16_round(silu(ex["gate"] @ xn[t]) * (ex["up"] @ xn[t]))
            y = ex["down"] @ act
            out[t] += weights[t, j] * bf16_round(y)
            slack[t] += weights[t, j] * np.abs(y) * 2.0**-7
    got = download(engine.x, np.float32, (n, h))
    assert np.all(np.abs(got - out) <= 2e-3 * np.abs(out - x0).max() + slack)
    return chosen


@pytest.mark.parametrize("n", [1, 5, 8])
def test_a_few_token_pass_reads_each_chosen_expert_once_for_its_tokens(wide_engine, n,
                                                                       spy_calls):
    """A pass of at most VERIFY_ROWS tokens (a speculative pass) routes and groups its pairs in
    one block (moe_few_route) and takes its experts on verify.cuh's product (moe_few_gate_up,
    moe_few_down) instead of the grouped GEMMs: the same routing, grouping and sums as
    NumPy's."""
    engine, model = wide_engine
    names = spy_calls(engine, "_launch")  # (the kernels launched)
    read = engine.experts_read()
    chosen = check_pass(engine, model, n)
    # (bench's bytes of a pass: each expert chosen counted once)
    assert engine.experts_read() - read == len(np.unique(chosen))
    assert {"moe_few_router", "moe_few_route", "moe_few_gate_up", "moe_few_down"} <= set(names)
    assert not {"moe_gemm", "moe90_gate_up", "moe90_down", "moe_route", "moe_place",
                "moe_swiglu"} & set(names)


@pytest.mark.parametrize(("n", "few_rows"), [(3, None), (5, 2)])
def test_a_pass_leaves_the_next_norms_input(wide_engine, n, few_rows, monkeypatch):
    """Given the next norm's weights, a pass's sparse layer leaves that norm's input as
    verify.cuh's PassNorm takes it: x times the weights in bf16 (from the new x, bit for bit)
    and one sum of x^2 a token (moe_combine for a few rows, verify_norm_rows after the grouped
    products)."""
    from test_cuda_engine import download

    from qwenchat.model.floats import bf16_bits_to_f32, f32_to_bf16_bits

    engine, model = wide_engine
    if few_rows is not None:  # (the grouped products for a pass of at most VERIFY_ROWS)
        monkeypatch.setattr(engine, "moe_few_rows", few_rows)
    h = model.config.hidden_size
    engine.x.upload(np.random.default_rng(n).standard_normal((n, h)).astype(np.float32))
    nxt = engine.layers[0].input_norm
    engine.pass_xg.fill_u8(0xFF)
    engine._moe_pass(0, engine.layers[0], n, None, nxt)
    engine.stream.synchronize()
    x = download(engine.x, np.float32, (n, h))
    gain = bf16_bits_to_f32(download(nxt, np.uint16, (h,)))
    np.testing.assert_array_equal(download(engine.pass_xg, np.uint16, (n, h)),
                                  f32_to_bf16_bits(x * gain))
    np.testing.assert_allclose(download(engine.pass_sq, np.float32, (n,)),
                               (x.astype(np.float64) ** 2).sum(axis=1), rtol=1e-5)


def test_a_pass_of_more_tokens_than_the_few_rows_takes_the_grouped_products(wide_engine,
                                                                             spy_calls):
    engine, model = wide_engine
    names = spy_calls(engine, "_launch")  # (the kernels launched)
    check_pass(engine, model, engine.moe_few_rows + 1)
    assert "moe_few_gate_up" not in names and "moe_few_down" not in names


@pytest.mark.parametrize("dtype", ["BF16", "FP8"])
def test_the_few_token_products_take_rows_and_columns_off_their_grid(tmp_path_factory,
                                                                     tiny_tokenizer, dtype,
                                                                     spy_calls):
    """odd-wide's experts on the few-token products: K = 464 (gate/up) and 336 (down) end inside
    a step of 64 bf16 or 128 FP8 columns, and 7 tokens leave a row of the mma's 8 empty."""
    from qwenchat.engine.cuda.engine import CudaEngine
    from qwenchat.model.loader import open_model_dir

    model = open_model_dir(write_moe(tmp_path_factory, tiny_tokenizer, "odd-wide", dtype))
    engine = CudaEngine(model.config, model.checkpoint, decode="layered")
    try:
        names = spy_calls(engine, "_launch")  # (the kernels launched)
        check_pass(engine, model, 7)
        assert "moe_few_down" in names
    finally:
        engine.close()


def test_a_decode_step_routes_and_sums_its_experts_as_numpy_does(wide_engine):
    check_decode_step(*wide_engine)


def test_experts_whose_vectors_outgrow_shared_memory_are_staged_one_at_a_time(
        tmp_path_factory, tiny_tokenizer):
    """moe_down stages the top-k experts' SwiGLU vectors at once where they fit in 48 KB: here
    4 x 3,200 floats do not, and it takes them one expert at a time."""
    from qwenchat.engine.cuda.engine import CudaEngine
    from qwenchat.model.loader import open_model_dir

    model = open_model_dir(write_moe(tmp_path_factory, tiny_tokenizer, "wide-long"))
    cfg = model.config
    assert cfg.num_experts_per_tok * cfg.moe_intermediate_size * 4 > 48 * 1024
    engine = CudaEngine(cfg, model.checkpoint, decode="layered")
    try:
        check_decode_step(engine, model)
    finally:
        engine.close()


def check_decode_step(engine, model) -> None:
    """One token's sparse layer 0 (moe_router, moe_route, moe_gate_up, moe_down) against
    NumPy, each stage on the GPU's output of the one before."""
    from test_cuda_engine import download

    from qwenchat.model.floats import bf16_bits_to_f32

    cfg = model.config
    h, k, e = cfg.hidden_size, cfg.num_experts_per_tok, cfg.num_experts
    x0 = np.random.default_rng(6).standard_normal(h).astype(np.float32)
    engine.x.upload(x0)
    engine._moe_decode(engine.layers[0])
    engine.stream.synchronize()
    norm = bf16_bits_to_f32(model.checkpoint.bf16_bits(
        "model.layers.0.post_attention_layernorm.weight")).astype(np.float64)
    xs = x0 / np.sqrt(np.mean(x0.astype(np.float64) ** 2) + cfg.rms_norm_eps) * norm
    router, experts = moe_weights(model, 0, rounded=False)
    logits = download(engine.moe_logits, np.float32, (1, e))
    want = xs @ router.T
    assert np.abs(logits[0] - want).max() <= 1e-5 * np.abs(want).max()
    chosen = download(engine.moe_ids, np.int32, (1, k))
    weights = download(engine.moe_weights, np.float32, (1, k))
    want_w, want_e = route(logits, k, cfg.norm_topk_prob)
    np.testing.assert_array_equal(chosen, want_e)
    np.testing.assert_allclose(weights, want_w, rtol=2e-6)
    out = x0.astype(np.float64)
    for j in range(k):
        ex = experts[chosen[0, j]]
        out += weights[0, j] * (ex["down"] @ (silu(ex["gate"] @ xs) * (ex["up"] @ xs)))
    got = download(engine.x, np.float32, (h,))
    assert np.abs(got - out).max() <= 1e-3 * np.abs(out - x0).max()


# --- the decode megakernel routing on the device (megakernel.cu, route_block; mk_pipe.cuh) ---
@pytest.mark.parametrize("dtype", FORMATS)
def test_the_megakernel_decodes_a_mixture_of_experts_as_the_reference_does(
        tmp_path_factory, tiny_tokenizer, dtype):
    """Every expert routed (mk-all), so the weights are continuous in the router's logits:
    128 greedy steps, one a launch (the logits of each step), against the reference."""
    from test_cuda_engine import engines, worst_greedy_decode_error

    gpu_engine, ref = engines(write_moe(tmp_path_factory, tiny_tokenizer, "mk-all", dtype),
                              decode="megakernel", steps_per_launch=1)
    try:
        prompt = [int(i) for i in np.random.default_rng(8).integers(0, 400, 40)]
        gpu_engine.prefill(prompt)
        ref.prefill(prompt)
        assert worst_greedy_decode_error(gpu_engine, ref, 128) <= 2e-2
    finally:
        gpu_engine.close()


def megakernel_engine(param: str, tmp_path_factory, tiny_tokenizer):
    """A megakernel engine: "SHAPE FORMAT" (a tiny model of MOE_SHAPES), or "qwen3-30b-a3b
    FORMAT LAYERS [EXPERTS]" (its first LAYERS layers on random weights; EXPERTS: that many
    experts, every one routed); "kv8" at the end: an int8 KV cache; "small": the layout of a
    99 KB card (RTX 4090: two 16 KB stages, the attention's sums in half the slots)."""
    from qwenchat.engine.cuda.engine import CudaEngine
    from qwenchat.model.loader import open_model_dir
    from qwenchat.model.random_weights import RandomWeights

    name, fmt, *rest = param.split()
    kv_cache = "int8" if "kv8" in rest else "bf16"
    shared = 101_376 if "small" in rest else None
    rest = [r for r in rest if r not in ("kv8", "small")]
    if name in MOE_SHAPES:
        model = open_model_dir(write_moe(tmp_path_factory, tiny_tokenizer, name, fmt))
        config, weights = model.config, model.checkpoint
    else:
        config = dataclasses.replace(PRESETS[name], num_hidden_layers=int(rest[0]))
        if len(rest) > 1:
            config = dataclasses.replace(config, num_experts=int(rest[1]),
                                         num_experts_per_tok=int(rest[1]))
        weights = RandomWeights(config, seed=2, weight_format=fmt)
    # (FP8: the prefill's activations in bf16 too, as the decode paths take them, so that the
    # logits recomputed after a prefill are those of the decode paths; its default e4m3
    # activations move the KV rows of later layers by up to 2x of their largest on these
    # random weights, issue 40)
    engine = CudaEngine(config, weights, ctx=1024, decode="megakernel", fp8_activations="bf16",
                        kv_cache=kv_cache, megakernel_shared=shared)
    assert engine.decode == "megakernel" and engine.kv_format == kv_cache
    assert engine.mk_layout.comb_half == (shared is not None)
    return engine


# (Not FP8 here: FP8 random weights at these widths fall into a greedy loop of two tokens whose
# logits are bistable, where the GPU's paths and the reference engine all part at the same few
# positions; docs/perf.md, 2026-11-27 third session. FP8 is checked by the tests on a real
# top-k below and by the tiny shapes against the reference.)
@pytest.fixture(scope="module", params=["qwen3-30b-a3b bf16 2 8", "qwen3-30b-a3b int4 3 8",
                                        "qwen3-30b-a3b bf16 2 8 small"])
def all_routed_engine(request, tmp_path_factory, tiny_tokenizer):
    """Qwen3-30B-A3B's widths (2,048-wide rows, experts of 768 rows, eight a token: gate/up
    stages that straddle two experts), with eight experts, every one routed."""
    engine = megakernel_engine(request.param, tmp_path_factory, tiny_tokenizer)
    yield engine
    engine.close()


def test_the_megakernels_greedy_tokens_are_the_per_op_paths_on_every_expert(all_routed_engine):
    """512 greedy tokens on the megakernel and on the per-op path (moe.cu), equal except at
    near-ties of the two paths' logits (test_megakernel.py's rule). Every expert is routed, so
    the paths' small differences cannot choose other experts on one than on the other."""
    from test_megakernel import greedy_paths_agree, prompt_for

    ties = greedy_paths_agree(all_routed_engine, prompt_for(all_routed_engine, seed=5), 512)
    assert len(ties) <= 8, f"too many near-ties to be ties: {ties}"


def test_speculative_greedy_on_every_expert_is_plain_greedy(all_routed_engine):
    """Prompt lookup's passes (their experts on the few-token products) against plain greedy
    decoding, 256 tokens: equal except at near-ties of a pass's and a step's logits
    (test_cuda_speculative.py's rule)."""
    from test_cuda_speculative import greedy_agrees, prompt_for

    assert all_routed_engine.can_speculate
    ties, (passes, proposed, kept) = greedy_agrees(all_routed_engine,
                                                   prompt_for(all_routed_engine), 256)
    assert passes > 0 and kept > 0, (passes, proposed, kept)
    assert len(ties) <= 8, f"too many near-ties to be ties: {ties}"


@pytest.fixture(scope="module", params=["mk-top4 BF16", "mk-top4 FP8", "mk-top4 AWQ",
                                        "qwen3-30b-a3b bf16 2", "qwen3-30b-a3b fp8 4",
                                        "qwen3-30b-a3b int4 4", "qwen3-30b-a3b fp8 4 kv8",
                                        "qwen3-30b-a3b int4 4 small"])
def routed_engine(request, tmp_path_factory, tiny_tokenizer):
    """A megakernel engine on a real top-k: the tiny mk-top4, or Qwen3-30B-A3B's shape (its
    first layers, random weights): 128 experts, 8 a token."""
    engine = megakernel_engine(request.param, tmp_path_factory, tiny_tokenizer)
    yield engine
    engine.close()


def test_the_megakernel_routes_a_real_top_k_as_the_per_op_path_does(routed_engine):
    """The first decode step after each of eight prompts: the megakernel's logits within
    PATHS_AGREE of the per-op path's. The two paths' activations differ a little (the graph
    rounds some to bf16), so a router near-tie may choose another expert on one path, which
    moves the logits further: one prompt in eight may part so."""
    from test_megakernel import PATHS_AGREE, decode_logits, reply

    engine, apart = routed_engine, []
    for seed in range(8):
        prompt = [int(i) for i in np.random.default_rng(seed).integers(
            0, engine.config.vocab_size, 24)]
        engine.decode = "layered"
        prefix = prompt + reply(engine, prompt, 2)[:1]
        graph = decode_logits(engine, "layered", prefix)
        ours = decode_logits(engine, "megakernel", prefix)
        spread = float(np.abs(ours - graph).max() / np.abs(graph).max())
        if spread > PATHS_AGREE:
            apart.append(f"prompt {seed}: {spread:.2e}")
    engine.decode = "megakernel"
    assert len(apart) <= 1, apart


def test_the_megakernel_on_a_mixture_of_experts_repeats_its_sampled_tokens(routed_engine):
    from test_megakernel import SAMPLED, prompt_for, reply

    routed_engine.decode = "megakernel"
    prompt = prompt_for(routed_engine, seed=6)
    first = reply(routed_engine, prompt, 128, seed=11, **SAMPLED)
    assert reply(routed_engine, prompt, 128, seed=11, **SAMPLED) == first and len(first) == 128
    assert reply(routed_engine, prompt, 128, seed=12, **SAMPLED) != first


@pytest.mark.parametrize("param", ["qwen3-30b-a3b bf16 2 8 99"])
def test_a_prefill_writes_the_kv_rows_the_megakernel_wrote_decoding(param, tmp_path_factory,
                                                                   tiny_tokenizer):
    """The KV rows of every layer after a greedy reply on the megakernel, against a prefill of
    the same tokens: within 2e-2 of the largest (the paths round differently), at every
    position, so that a sparse layer's output is the same on both paths."""
    from test_cuda_engine import download
    from test_megakernel import prompt_for, reply

    from qwenchat.model.floats import bf16_bits_to_f32

    *engine_param, steps = param.split()
    engine = megakernel_engine(" ".join(engine_param), tmp_path_factory, tiny_tokenizer)
    cfg = engine.config
    shape = (cfg.num_key_value_heads, engine.capacity, cfg.head_dim)

    def rows(n: int) -> list[np.ndarray]:
        engine.stream.synchronize()
        return [bf16_bits_to_f32(download(buffer, np.uint16, shape))[:, :n]
                for buffer in (*engine.k_cache, *engine.v_cache)]

    try:
        prompt = prompt_for(engine, seed=5)
        tokens = reply(engine, prompt, int(steps) + 1)
        n = len(prompt) + int(steps)
        decoded = rows(n)
        engine.truncate(0)
        engine.prefill(prompt + tokens[:-1])
        for layer, (ours, theirs) in enumerate(zip(decoded, rows(n), strict=True)):
            error = np.abs(ours - theirs).max(axis=(0, 2)) / np.abs(theirs).max()
            assert error.max() <= 2e-2, (layer, np.nonzero(error > 2e-2)[0][:8].tolist())
    finally:
        engine.close()


def test_the_megakernel_stops_a_mixture_of_experts_at_eos_and_goes_on(routed_engine):
    """A reply that ends at an EOS in the middle of a launch (the stream had issued, or held
    until routing, stages of the next step: mk_pipe.cuh, issue_held), and the next reply from
    the same place: the same tokens as without the EOS, nothing after it, no hang."""
    from test_cuda_engine import greedy_tokens

    from qwenchat.engine.base import StopReason

    engine = routed_engine
    engine.decode = "megakernel"
    engine.steps_per_launch, engine.launches_ahead = 8, 1  # (a launch queued behind)
    prompt = [int(i) for i in np.random.default_rng(9).integers(0, 400, 20)]
    alone, _ = greedy_tokens(engine, prompt, 40)
    end = alone.index(alone[13])  # the first time the 14th token appears: a stop there
    tokens, reason = greedy_tokens(engine, prompt, 40, eos=frozenset({alone[end]}))
    assert reason is StopReason.EOS and tokens == alone[: end + 1]
    assert engine.megakernel_produced() == end + 1
    again, _ = greedy_tokens(engine, prompt, 40)
    assert again == alone


def test_the_timeline_of_a_sparse_layer_has_its_router_between_o_proj_and_gate_up(
        tmp_path_factory, tiny_tokenizer):
    """The timeline build (tests/step_timeline.py) on a mixture of experts: every step's phases
    in the kernel's order (the router's rows between o_proj and gate/up, the experts' down rows
    as one phase), and the tokens of the plain build."""
    from test_megakernel import plain_and_timeline

    from qwenchat.engine.cuda.engine import CudaEngine
    from qwenchat.engine.cuda.megakernel import TIMELINE_KINDS
    from qwenchat.model.loader import open_model_dir

    model = open_model_dir(write_moe(tmp_path_factory, tiny_tokenizer, "mk-top4", "BF16"))
    layers, steps = model.config.num_hidden_layers, 6
    plain, timed, records = plain_and_timeline(
        lambda timeline: CudaEngine(model.config, model.checkpoint, ctx=256,
                                    decode="megakernel", megakernel_timeline=timeline),
        steps, 6 * layers + 2)
    assert plain == timed
    kinds = [TIMELINE_KINDS[k] for k in records["kind"].max(axis=1)]
    one_step = (["qkv", "attention", "o_proj", "router", "gate_up", "down"] * layers
                + ["lm_head", "sample"])
    assert kinds == ["sample"] + one_step * (steps - 1)  # the first samples the prefill's

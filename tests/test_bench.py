"""`qwenchat bench`: random weights, what the bench measures and reports, and its command line.

Speeds are never asserted: these tests prove that every requested number is measured, that
the byte arithmetic is right, and that what cannot be measured says why.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hf_compare import relative_error, require_transformers
from tiny_model import AWQ_SHAPE, tiny_config, tiny_moe_config

from qwenchat import bench as bench_module
from qwenchat.bench import (
    BenchSettings,
    bytes_per_step,
    cpu_warning,
    measure_engine,
    transformers_model,
    weight_bytes_per_step,
)
from qwenchat.engine.reference import ReferenceEngine
from qwenchat.errors import UsageError
from qwenchat.model.config import Qwen3Config
from qwenchat.model.floats import bf16_bits_to_f32, f32_to_bf16_bits
from qwenchat.model.presets import PRESETS
from qwenchat.model.random_weights import RandomWeights

SCRIPT = Path(sys.executable).parent / "qwenchat"
TIED = Qwen3Config.from_dict(tiny_config())
UNTIED = Qwen3Config.from_dict(tiny_config(tie_word_embeddings=False, hidden_size=40,
                                           num_attention_heads=3, num_key_value_heads=1,
                                           head_dim=24, intermediate_size=72))


@pytest.mark.parametrize("config", [TIED, UNTIED], ids=["tied", "untied"])
def test_random_weights_have_the_config_shapes_and_finite_bf16_values(config):
    weights = RandomWeights(config)
    for name, shape in config.tensor_shapes().items():
        bits, values = weights.bf16_bits(name), weights.float32(name)
        assert bits.shape == values.shape == shape, name
        assert bits.dtype == np.uint16 and values.dtype == np.float32
        assert np.isfinite(values).all(), name
        assert weights.dtype(name) == "BF16"
        # float32 is the bf16 value widened, and rounding it again changes nothing: the CPU
        # engine (float32) and a GPU engine (bf16 bits) compute with identical weights.
        np.testing.assert_array_equal(values, bf16_bits_to_f32(bits))
        np.testing.assert_array_equal(f32_to_bf16_bits(values), bits)
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    assert weights.lm_head_name() == head
    with pytest.raises(KeyError, match="not a tensor of this Qwen3 config"):
        weights.float32("lm_head.weight" if config.tie_word_embeddings else "model.nothing")


def test_random_weights_are_a_pure_function_of_seed_and_name():
    names = list(TIED.tensor_shapes())
    forward = {n: RandomWeights(TIED, seed=7).float32(n) for n in names}
    backward = {n: RandomWeights(TIED, seed=7).float32(n) for n in reversed(names)}
    other_seed = RandomWeights(TIED, seed=8)
    for name in names:
        np.testing.assert_array_equal(forward[name], backward[name])
        assert not np.array_equal(forward[name], other_seed.float32(name)), name
    q0, q1 = (forward[f"model.layers.{i}.self_attn.q_proj.weight"] for i in (0, 1))
    assert not np.array_equal(q0, q1)


def test_random_weights_drawn_in_bands_are_one_seeded_tensor_with_no_repeated_band():
    from qwenchat.model.floats import bf16_bits_to_f32
    from qwenchat.model.random_weights import BAND_VALUES

    # 0.6B's widths with a vocabulary of three bands and a part (0.6B's own: 38 bands, 13 times
    # the values to draw, three times over)
    config = dataclasses.replace(PRESETS["qwen3-0.6b"], vocab_size=3 * (BAND_VALUES // 1024) + 7)
    name = "model.embed_tokens.weight"  # 12,295 x 1,024
    rows, cols = config.tensor_shapes()[name]
    band_rows = BAND_VALUES // cols
    assert rows > 3 * band_rows
    bits = RandomWeights(config, seed=3).bf16_bits(name)
    assert np.array_equal(bits, RandomWeights(config, seed=3).bf16_bits(name))
    assert np.array_equal(bf16_bits_to_f32(bits), RandomWeights(config, seed=3).float32(name))
    first, second = bits[:band_rows], bits[band_rows : 2 * band_rows]
    assert np.mean(first == second) < 0.01  # independent streams, not one stream twice
    values = bf16_bits_to_f32(bits)
    assert abs(values.std() * np.sqrt(config.hidden_size) - 1) < 0.01
    assert abs(values.mean()) < 1e-3


def test_random_weights_are_scaled_for_sane_activations():
    weights = RandomWeights(PRESETS["qwen3-0.6b"])
    down = weights.float32("model.layers.3.mlp.down_proj.weight")  # fan-in 3072
    norm = weights.float32("model.layers.3.input_layernorm.weight")
    assert down.std() == pytest.approx(1 / math.sqrt(3072), rel=0.05)
    assert abs(float(down.mean())) < 1e-3
    assert norm.mean() == pytest.approx(1.0, abs=0.02) and norm.std() == pytest.approx(0.1, rel=0.2)


@pytest.mark.parametrize("config", [TIED, UNTIED], ids=["tied", "untied"])
def test_reference_engine_on_random_weights_gives_finite_varied_logits(config):
    engine = ReferenceEngine(config, RandomWeights(config))
    engine.prefill(list(range(1, 33)))
    logits = engine.last_logits()
    assert np.isfinite(logits).all()
    assert 0.1 < logits.std() < 10, "logits neither flat nor blown up"


@pytest.mark.parametrize("config", [TIED, UNTIED], ids=["tied", "untied"])
def test_transformers_runs_the_same_weights(config):
    torch, _ = require_transformers()
    weights = RandomWeights(config)
    ids = list(range(3, 40))
    engine = ReferenceEngine(config, weights)
    ours = engine.prefill_logits(ids)
    with torch.no_grad():
        theirs = transformers_model(config, weights)(torch.tensor([ids])).logits[0].numpy()
    assert relative_error(ours, theirs) < 1e-4


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_transformers_runs_the_same_mixture_of_experts(norm_topk_prob):
    """--compare-hf on a Qwen3-MoE config: transformers' Qwen3MoeForCausalLM, every expert's
    matrices where the checkpoint puts them (transformers 5 packs them into 3-D tensors), a
    dense layer among the sparse ones, 3 of 5 experts a token."""
    torch, _ = require_transformers()
    config = Qwen3Config.from_dict(tiny_moe_config(norm_topk_prob=norm_topk_prob))
    assert config.is_moe and not config.sparse_layer(1)
    weights = RandomWeights(config)
    ids = list(range(3, 40))
    ours = ReferenceEngine(config, weights).prefill_logits(ids)
    with torch.no_grad():
        theirs = transformers_model(config, weights)(torch.tensor([ids])).logits[0].numpy()
    assert relative_error(ours, theirs) < 1e-4


def test_transformers_runs_the_same_yarn_past_the_original_length():
    """--compare-hf with --rope-scaling: transformers gets the same YaRN (rope_parameters)."""
    torch, _ = require_transformers()
    from qwenchat.model import rope

    config = rope.with_flag(TIED, "yarn:4:16")
    weights = RandomWeights(config)
    ids = list(range(3, 60))  # positions to 3.5x the 16 trained ones
    ours = ReferenceEngine(config, weights).prefill_logits(ids)
    with torch.no_grad():
        theirs = transformers_model(config, weights)(torch.tensor([ids])).logits[0].numpy()
    assert relative_error(ours, theirs) < 1e-4
    plain = ReferenceEngine(TIED, weights, 64).prefill_logits(ids)
    assert relative_error(plain, theirs) > 1e-3  # (YaRN mattered)


def bench(config: Qwen3Config, ctx: int, **settings) -> tuple:
    labels: list[str] = []
    engine = ReferenceEngine(config, RandomWeights(config), ctx)
    chosen = BenchSettings(**settings)
    return measure_engine(engine, chosen, "tiny", "random", labels.append), labels, chosen


def test_every_prompt_size_and_position_is_measured_with_positive_numbers():
    result, labels, settings = bench(TIED, 64, prompts=(4, 16), positions=(1, 8, 20), steps=4,
                                     repeats=2)
    assert [p.tokens for p in result.prefill] == [4, 16]
    for p in result.prefill:
        assert p.skipped is None and p.tok_s > 0 and p.seconds > 0
        assert p.tok_s == pytest.approx(p.tokens / p.seconds)
        assert p.ttft_s >= p.seconds
    assert [d.position for d in result.decode] == [1, 8, 20]
    for d in result.decode:
        assert d.skipped is None and d.tok_s > 0
        assert d.bytes_per_step == bytes_per_step(TIED, d.position)
        assert d.gb_s == pytest.approx(d.bytes_per_step * d.tok_s / 1e9)
        assert d.copy_fraction is None  # the reference engine cannot measure a ceiling
    assert result.ctx == 64 and result.engine == ReferenceEngine.name
    assert len(labels) == settings.planned_items(compare_hf=False)


def test_sampled_decode_uses_qwens_non_thinking_sampler_and_says_so(monkeypatch):
    import io

    from qwenchat.bench import render

    requested = []
    generate = ReferenceEngine.generate

    def spy(self, request):
        requested.append(request.params.current)
        return generate(self, request)

    monkeypatch.setattr(ReferenceEngine, "generate", spy)
    result, _, _ = bench(TIED, 64, prompts=(4,), positions=(1, 8), steps=4, repeats=1,
                         sampled=True)
    decode_params = requested[-1]  # the prefill's TTFT request comes first
    assert (decode_params.temperature, decode_params.top_p, decode_params.top_k) == (0.7, 0.8, 20)
    assert all(d.tok_s > 0 for d in result.decode)
    text = io.StringIO()
    render(result, text)
    assert "4 decode steps, sampled (temperature 0.7, top-p 0.8, top-k 20)," in text.getvalue()
    greedy, _, _ = bench(TIED, 64, prompts=(4,), positions=(1,), steps=4, repeats=1)
    assert greedy.sampler == "greedy" and requested[-1].temperature == 0.0


def test_what_does_not_fit_the_context_is_skipped_with_the_reason():
    result, _, _ = bench(TIED, 16, prompts=(16, 17), positions=(1, 12, 13, 100), steps=4,
                         repeats=1)
    assert [p.skipped is None for p in result.prefill] == [True, False]
    assert "16-token context" in result.prefill[1].skipped
    measured = {d.position: d for d in result.decode}
    assert measured[1].tok_s and measured[12].tok_s  # 12 + 4 steps fill the 16 slots exactly
    for position in (13, 100):
        assert measured[position].tok_s is None
        assert "16-token context" in measured[position].skipped
        assert "--ctx" in measured[position].skipped


class _InstrumentedEngine(ReferenceEngine):
    """What a GPU engine adds: a measured ceiling, its peak memory and its device's name."""

    device_name = "Test GPU"

    def copy_bandwidth(self) -> float:
        return 2e9

    def peak_memory_bytes(self) -> int:
        return 12345


def test_copy_bandwidth_peak_memory_and_device_come_from_the_engine():
    engine = _InstrumentedEngine(TIED, RandomWeights(TIED), 32)
    settings = BenchSettings(prompts=(4,), positions=(1, 8), steps=2, repeats=1)
    result = measure_engine(engine, settings, "tiny", "random")
    assert result.copy_bandwidth_bytes_s == 2e9
    assert result.peak_memory_bytes == 12345 and result.device == "Test GPU"
    for d in result.decode:
        assert d.copy_fraction == pytest.approx(d.gb_s * 1e9 / 2e9)
    record = json.loads(result.to_json())
    assert record["copy_bandwidth_bytes_s"] == 2e9
    assert record["decode"][1]["copy_fraction"] == pytest.approx(result.decode[1].copy_fraction)


def test_bytes_per_decode_step_for_qwen3_0_6b():
    config = PRESETS["qwen3-0.6b"]
    h, i, q, kv, d = 1024, 3072, 16 * 128, 8 * 128, 128
    layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + 2 * d
    head = 151_936 * h  # tied: the embedding is read in full, once, as the LM head
    weights = 2 * (28 * layer + head + h)
    assert weights == weight_bytes_per_step(config)
    assert weights == pytest.approx(1.19e9, rel=0.01)
    assert 2 * 28 * layer == pytest.approx(28 * 31.5e6, rel=0.01)
    assert config.kv_bytes_per_position() == 28 * 2 * 8 * 128 * 2 == 114_688
    assert bytes_per_step(config, 4096) == weights + 4096 * 114_688


def test_an_untied_embedding_is_not_counted_as_read():
    tied, untied = PRESETS["qwen3-4b"], PRESETS["qwen3-8b"]
    assert weight_bytes_per_step(tied) == 2 * tied.parameter_count()
    embedding = 2 * untied.vocab_size * untied.hidden_size
    assert weight_bytes_per_step(untied) == 2 * untied.parameter_count() - embedding


def test_a_moe_step_reads_the_experts_a_token_routes_to_not_all_of_them():
    from test_config import QWEN3_30B_A3B

    config = Qwen3Config.from_dict(QWEN3_30B_A3B)  # 48 sparse layers, 8 of 128 experts
    embedding = 2 * config.vocab_size * config.hidden_size  # (untied: one row a step)
    assert weight_bytes_per_step(config) == 2 * config.active_parameter_count() - embedding
    expert = 3 * config.hidden_size * config.moe_intermediate_size  # (bf16: 2 bytes each)
    assert weight_bytes_per_step(config) < 2 * (config.parameter_count() - 48 * 120 * expert)
    # ~6.1 GB in bf16 (issue 43's figure); FP8 halves the experts and attention but not the
    # LM head (0.62 GB) or the router: 3.46 GB
    assert weight_bytes_per_step(config) / 1e9 == pytest.approx(6.1, abs=0.1)
    assert weight_bytes_per_step(config, "fp8") / 1e9 == pytest.approx(3.46, abs=0.01)


def test_default_ctx_fits_the_largest_position_and_prompt_within_the_model():
    settings = BenchSettings(prompts=(512, 4096), positions=(1, 1024), steps=64)
    assert settings.default_ctx(PRESETS["qwen3-0.6b"]) == 4096
    settings = BenchSettings(positions=(1, 32768), steps=64)
    assert settings.default_ctx(PRESETS["qwen3-0.6b"]) == 32768 + 64 + 1
    assert settings.default_ctx(TIED) == TIED.max_position_embeddings


def test_the_cpu_warning_suggests_only_the_small_sizes_not_already_given():
    assert cpu_warning(BenchSettings()).endswith("e.g. --positions 1,128 --prompts 128")
    assert cpu_warning(BenchSettings(positions=(1, 128))).endswith("e.g. --prompts 128")
    assert cpu_warning(BenchSettings(prompts=(64,))).endswith("e.g. --positions 1,128")
    small = cpu_warning(BenchSettings(positions=(1, 128), prompts=(128,)))
    assert "CPU reference engine" in small and "try" not in small and "--" not in small


def qwenchat(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def tiny_config_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bench") / "config.json"
    path.write_text(json.dumps(tiny_config()))
    return path


SMALL = ("--backend", "cpu", "--positions", "1,8", "--prompts", "8", "--steps", "4")


def test_cli_prints_one_json_object(tiny_config_file):
    result = qwenchat("bench", "--config", str(tiny_config_file), *SMALL, "--json")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["model"] == str(tiny_config_file)
    assert record["config"]["hidden_size"] == 64 and record["weights"].startswith("random")
    assert record["ctx"] == 8 + 4 + 1
    assert [p["tokens"] for p in record["prefill"]] == [8]
    assert record["prefill"][0]["tok_s"] > 0 and record["prefill"][0]["ttft_s"] > 0
    assert [d["position"] for d in record["decode"]] == [1, 8]
    assert all(d["tok_s"] > 0 and d["gb_s"] > 0 for d in record["decode"])
    assert record["transformers"] == []
    assert "CPU reference engine" in result.stderr and "Traceback" not in result.stderr


def test_cli_prints_tables(tiny_config_file):
    result = qwenchat("bench", "--config", str(tiny_config_file), *SMALL, "--positions",
                      "1,600")
    assert result.returncode == 0, result.stderr
    assert "prefill" in result.stdout and "decode" in result.stdout
    assert "qwenchat at position 600 skipped" in result.stdout


@pytest.mark.parametrize("args, needle", [
    (("--config", "qwen3-0.6b", "--model", "Qwen/Qwen3-0.6B"), "not both"),
    (("--positions", "1,x"), "--positions"),
    (("--prompts", ""), "--prompts"),
    (("--positions", "0,8"), "--positions"),
    (("--steps", "0"), "--steps"),
    (("--repeats", "0"), "--repeats"),
    (("--config", "qwen3-9b"), "qwen3-0.6b"),
    (("--backend", "tpu"), "--backend"),
    (("--steps", "many"), "--steps"),
])
def test_cli_usage_errors_are_one_line(args, needle):
    result = qwenchat("bench", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qwenchat: error:"), result.stderr
    assert needle in lines[0]
    assert result.stdout == ""


def test_compare_hf_on_the_cpu_reports_transformers_eager(tiny_config_file):
    torch, _ = require_transformers()
    result = qwenchat("bench", "--config", str(tiny_config_file), *SMALL, "--compare-hf",
                      "--json", timeout=120)
    assert result.returncode == 0, result.stderr
    variants = {t["variant"]: t for t in json.loads(result.stdout)["transformers"]}
    eager = variants["eager"]
    assert eager["unavailable"] is None
    assert [d["position"] for d in eager["decode"]] == [1, 8]
    assert all(d["tok_s"] > 0 and d["gb_s"] > 0 for d in eager["decode"])
    assert [(p["tokens"], p["tok_s"] > 0) for p in eager["prefill"]] == [(8, True)]
    assert variants["static+compile"]["prefill"] == []
    if not torch.cuda.is_available():
        assert eager["device"] == "CPU" and eager["dtype"] == "float32"
        assert "CUDA" in variants["static+compile"]["unavailable"]


def test_fp8_steps_count_codes_and_scales_and_keep_the_bf16_floor_beside():
    import io

    from qwenchat.bench import render
    from qwenchat.model.fp8 import Fp8Weights

    config = PRESETS["qwen3-8b"]
    h, i, q, kv = 4096, 12288, 32 * 128, 8 * 128
    # Each row: its codes, then one float32 scale per 128 columns, padded to 16 bytes.
    rows_of_h = (q + 2 * kv + 2 * i) * (h + 128)  # q, k, v, gate, up: 4096 columns
    rows_of_q = h * (q + 128)  # o_proj
    rows_of_i = h * (i + 384)  # down_proj
    norms = 2 * (2 * h + 2 * 128)
    layers = 36 * (rows_of_h + rows_of_q + rows_of_i + norms)
    head_and_final = 2 * (config.vocab_size * h + h)
    assert weight_bytes_per_step(config, "fp8") == layers + head_and_final
    assert weight_bytes_per_step(config, "fp8") / weight_bytes_per_step(config) == pytest.approx(
        0.555, abs=0.005)  # the bf16 LM head (1.2 GB) keeps it above a half
    engine = _InstrumentedEngine(TIED, Fp8Weights(RandomWeights(TIED)), 32)
    assert engine.weight_format == "fp8"
    result = measure_engine(engine, BenchSettings(prompts=(4,), positions=(1,), steps=2,
                                                  repeats=1), "tiny", "random")
    d = result.decode[0]
    assert d.bytes_per_step == bytes_per_step(TIED, 1, "fp8") < bytes_per_step(TIED, 1)
    assert d.floor_tok_s == pytest.approx(2e9 / d.bytes_per_step)
    assert d.bf16_floor_tok_s == pytest.approx(2e9 / bytes_per_step(TIED, 1))
    text = io.StringIO()
    render(result, text)
    shown = text.getvalue()
    assert "of fp8 weights (bf16: " in shown and "bf16 floor" in shown


def test_random_fp8_weights_are_seeded_finite_codes_with_block_scales():
    from qwenchat.model import fp8
    from qwenchat.model.floats import e4m3_to_f32

    # (0.6B's widths; a vocabulary of 4,096 keeps the embedding's check short)
    config = dataclasses.replace(PRESETS["qwen3-0.6b"], vocab_size=4096)
    name = "model.layers.2.mlp.down_proj.weight"  # 1024 x 3072, fan-in 3072
    weights = RandomWeights(config, seed=5, weight_format="fp8")
    assert weights.weight_format == "fp8" and weights.dtype(name) == "F8_E4M3"
    codes, scales = weights.fp8_blocks(name)
    assert codes.shape == (1024, 3072) and codes.dtype == np.uint8
    assert scales.shape == fp8.scale_shape(codes.shape) and (scales > 0).all()
    assert np.isfinite(e4m3_to_f32(codes)).all()  # no NaN codes
    again_codes, again_scales = RandomWeights(config, seed=5, weight_format="fp8").fp8_blocks(name)
    assert np.array_equal(codes, again_codes) and np.array_equal(scales, again_scales)
    other_codes, _ = RandomWeights(config, seed=6, weight_format="fp8").fp8_blocks(name)
    assert not np.array_equal(codes, other_codes)
    # The blocks differ in scale, and the weights keep the bf16 model's spread.
    assert len(np.unique(scales)) > scales.size // 4
    values = weights.float32(name)
    assert np.array_equal(values, fp8.dequantize(codes, scales))
    assert values.std() == pytest.approx(1 / math.sqrt(3072), rel=0.1)
    assert np.array_equal(weights.bf16_bits(name), f32_to_bf16_bits(values))
    # Norms and the embedding stay the bf16 random model's.
    plain = RandomWeights(config, seed=5)
    for kept in ("model.layers.2.input_layernorm.weight", "model.embed_tokens.weight"):
        assert weights.fp8_blocks(kept) is None and weights.dtype(kept) == "BF16"
        assert np.array_equal(weights.float32(kept), plain.float32(kept))
    assert plain.fp8_blocks(name) is None
    with pytest.raises(ValueError, match="bf16, fp8 or int4"):
        RandomWeights(config, weight_format="q8")


def test_bench_quantize_fp8_on_a_config_draws_fp8_weights(tiny_config_file):
    result = qwenchat("bench", "--config", str(tiny_config_file), *SMALL, "--quantize", "fp8",
                      "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["weights"] == "random FP8 (seed 0)"
    assert record["weight_format"] == "fp8"


def test_bench_quantize_int4_on_a_config_draws_int4_weights(tiny_config_file, tmp_path):
    # (a shape whose linear inputs are whole groups of 128 columns)
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(tiny_config(**AWQ_SHAPE)))
    result = qwenchat("bench", "--config", str(whole), *SMALL, "--quantize", "int4", "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["weights"] == "random int4 (seed 0)"
    assert record["weight_format"] == "int4"
    odd = qwenchat("bench", "--config", str(tiny_config_file), *SMALL, "--quantize", "int4")
    assert odd.returncode == 1
    assert odd.stderr.strip().splitlines()[-1] == (
        "qwenchat: error: --quantize int4 needs every linear layer's inputs in whole groups "
        "of 128 columns; this model's hidden_size is 64")


def test_random_int4_weights_are_seeded_codes_in_awqs_layout():
    from qwenchat.model import awq

    config = Qwen3Config.from_dict(tiny_config(**AWQ_SHAPE))
    weights = RandomWeights(config, seed=5, weight_format="int4")
    name = "model.layers.1.mlp.down_proj.weight"  # inputs: 3 groups of 128
    qweight, qzeros, scales = weights.awq_groups(name)
    out_features, in_features = config.tensor_shapes()[name]
    assert qweight.shape == (in_features, out_features // 8) and scales.dtype == np.float16
    codes, zeros = awq.unpack(qweight), awq.unpack(qzeros)
    assert codes.min() == 0 and codes.max() == 15  # uniform codes: every value appears
    assert set(np.unique(zeros)) == {7, 8}
    unit = 1 / (4.6 * np.sqrt(in_features))
    assert 0.5 * unit * 0.999 <= scales.astype(np.float32).min()
    assert scales.astype(np.float32).max() <= 1.5 * unit * 1.001
    values = weights.float32(name)
    assert np.array_equal(values, awq.dequantize(qweight, qzeros, scales))
    assert 0.7 < values.std() * np.sqrt(in_features) < 1.3  # unit-variance rows, as bf16's
    again = RandomWeights(config, seed=5, weight_format="int4")
    assert np.array_equal(again.awq_groups(name)[0], qweight)
    assert not np.array_equal(RandomWeights(config, seed=6, weight_format="int4")
                              .awq_groups(name)[0], qweight)
    kept = "model.layers.1.input_layernorm.weight"
    assert weights.awq_groups(kept) is None
    assert np.array_equal(weights.float32(kept), RandomWeights(config, seed=5).float32(kept))
    assert weights.device_draw(name).format == "int4"
    assert weights.device_draw(kept).format == "bf16"


def test_bench_kv_cache_int8_counts_the_bytes_an_8bit_cache_reads(tmp_path):
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(tiny_config(**AWQ_SHAPE)))
    result = qwenchat("bench", "--config", str(whole), *SMALL, "--kv-cache", "int8", "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    config = Qwen3Config.from_dict(tiny_config(**AWQ_SHAPE))
    row = config.head_dim + 4  # int8 codes and a float scale
    assert record["kv_format"] == "int8"
    assert record["kv_bytes_per_position"] == (config.num_hidden_layers * 2
                                               * config.num_key_value_heads * row)
    decoded = next(d for d in record["decode"] if d["tok_s"])
    assert decoded["bytes_per_step"] == (record["weight_bytes_per_step"]
                                         + record["kv_bytes_per_position"] * decoded["position"])
    plain = json.loads(qwenchat("bench", "--config", str(whole), *SMALL, "--json").stdout)
    assert plain["kv_format"] == "bf16"
    assert plain["kv_bytes_per_position"] == config.kv_bytes_per_position()


def table_result(config: Qwen3Config, prefill, transformers=()) -> bench_module.BenchResult:
    """A result holding these prefill rows (and transformers' results), for the tables."""
    return bench_module.BenchResult(
        model="m", weights="random", engine="e", device="d", config=config, parameters=1,
        ctx=1024, steps=4, repeats=3, sampler="greedy", weight_format="bf16",
        weight_bytes_per_step=1, kv_format="bf16", kv_bytes_per_position=1,
        copy_bandwidth_bytes_s=None, peak_memory_bytes=None, prefill=list(prefill), decode=[],
        transformers=list(transformers))


def test_the_prefill_table_puts_transformers_beside_us_with_the_ratio():
    config = TIED
    ours = [bench_module.PrefillResult(512, 60_000.0, 512 / 60_000, 0.009),
            bench_module.PrefillResult(4096, 80_000.0, 4096 / 80_000, 0.052)]
    theirs = bench_module.TransformersResult("eager", "GPU", "bfloat16", prefill=[
        bench_module.PrefillResult(512, 15_000.0, 512 / 15_000),
        bench_module.PrefillResult(4096, None, skipped="does not fit the 1024-token context")])
    result = table_result(config, ours, [theirs])
    out = io.StringIO()
    bench_module.render(result, out)
    rows = {tuple(line.split("│")[1:3]): line for line in out.getvalue().splitlines()
            if line.startswith("│")}
    ours_512 = next(v for k, v in rows.items() if "qwenchat" in k[0] and "512" in k[1])
    assert "60,000" in ours_512 and "4.00" in ours_512  # 60,000 / 15,000
    ours_4k = next(v for k, v in rows.items() if "qwenchat" in k[0] and "4096" in k[1])
    assert ours_4k.rstrip("│ ").endswith("–")  # no transformers figure to compare with
    hf_512 = next(v for k, v in rows.items() if "hf eager" in k[0] and "512" in k[1])
    assert "15,000" in hf_512
    assert "hf eager prefill of 4096 tokens skipped: does not fit" in out.getvalue()


def test_the_attentions_time_is_the_prefill_with_it_less_the_prefill_without_it():
    from fake_engine import FakeEngine

    class AttentionSwitch(FakeEngine):
        prefill_attention = True

        def prefill(self, token_ids):
            time.sleep(0.06 if self.prefill_attention else 0.02)  # attention: 40 ms
            super().prefill(token_ids)

    engine = AttentionSwitch(TIED, [1, 2, 3], capacity=256)
    settings = BenchSettings(prompts=(100,), positions=(1,), steps=2, repeats=3)
    result = bench_module._measure_prefill(engine, 100, settings, np.random.default_rng(0))
    assert engine.prefill_attention is True  # switched back on
    assert 0.03 <= result.attention_s <= 0.05
    flops = 4 * TIED.head_dim * TIED.num_attention_heads * TIED.num_hidden_layers * 100 * 101 // 2
    assert bench_module.attention_flops(TIED, 100) == flops
    assert result.attention_tflop_s == pytest.approx(flops / result.attention_s / 1e12)
    out = io.StringIO()
    bench_module.render(table_result(TIED, [result]), out)
    row = next(line for line in out.getvalue().splitlines() if "qwenchat" in line)
    assert "attn TFLOP/s" in out.getvalue() and bench_module._ms(result.attention_s) in row


def test_a_mixture_of_experts_gets_no_attention_share():
    """Without attention a mixture of experts routes other experts: the difference would be
    the routing's, not the attention's, so the bench leaves it out."""
    from fake_engine import FakeEngine

    class AttentionSwitch(FakeEngine):
        prefill_attention = True
        switched = False

        def prefill(self, token_ids):
            self.switched |= not self.prefill_attention
            super().prefill(token_ids)

    config = Qwen3Config.from_dict(tiny_moe_config())
    engine = AttentionSwitch(config, [1, 2, 3], capacity=256)
    settings = BenchSettings(prompts=(100,), positions=(1,), steps=2, repeats=2)
    result = bench_module._measure_prefill(engine, 100, settings, np.random.default_rng(0))
    assert result.tok_s > 0 and not engine.switched
    assert result.attention_s is None and result.attention_tflop_s is None


def test_after_prefills_each_prompt_behind_a_cached_history():
    result, _, settings = bench(TIED, 64, prompts=(4,), positions=(1,), steps=2, repeats=2,
                                after=20)
    assert settings.default_ctx(TIED) >= 24
    (p,) = result.prefill
    assert p.after == 20 and p.skipped is None and p.tok_s > 0
    assert bench_module.attention_flops(TIED, 4, 20) == (
        4 * TIED.head_dim * TIED.num_attention_heads * TIED.num_hidden_layers * (4 * 20 + 10))
    out = io.StringIO()
    bench_module.render(table_result(TIED, [p]), out)
    assert "4 after 20" in out.getvalue()
    with pytest.raises(UsageError, match="--after"):
        BenchSettings(after=-1)


def test_speculation_measures_the_oracle_at_each_share_of_wrong_proposals_and_the_draft():
    engine = ReferenceEngine(TIED, RandomWeights(TIED), 64)
    draft = ReferenceEngine(bench_module.draft_shape(TIED), RandomWeights(TIED, seed=1), 64)
    settings = BenchSettings(prompts=(4,), positions=(3,), steps=24, repeats=1,
                             speculation=True)
    assert settings.default_ctx(TIED) == 3 + 24 + 1 + 8  # room for a pass past the last step
    labels: list[str] = []
    result = measure_engine(engine, settings, "tiny", "random", labels.append, draft)
    assert len(labels) == settings.planned_items(compare_hf=False)
    rows = result.speculation
    assert [(r.proposer, r.corrupt) for r in rows] == [
        ("oracle", c) for c in bench_module.ORACLE_CORRUPTION] + [("draft", None)]
    perfect, *corrupted, drafted = rows
    # The oracle's own continuation is kept whole (greedy replies are plain decoding's)...
    assert perfect.acceptance == 1.0 and perfect.accepted == perfect.proposed > 0
    assert perfect.tokens == 24 and perfect.passes < 24 / 2
    # ...and wrong proposals cost acceptance; a random draft is (almost) never kept.
    assert all(r.acceptance < 1.0 for r in corrupted)
    assert drafted.proposed > 0 and drafted.acceptance < 0.5
    for r in rows:
        assert r.plain_tok_s == result.decode[0].tok_s and r.tok_s > 0
        assert r.accepted + r.passes <= r.tokens  # a pass emits its kept proposals and one
    record = json.loads(result.to_json())["speculation"][0]
    assert record["acceptance"] == 1.0 and record["speedup"] == pytest.approx(perfect.speedup)
    out = io.StringIO()
    bench_module.render(result, out)
    assert "oracle, 0% made wrong" in out.getvalue() and "random draft" in out.getvalue()


MOE = Qwen3Config.from_dict(tiny_moe_config())


def test_a_pass_reads_the_experts_its_tokens_chose_where_a_step_reads_top_k():
    per = bench_module.expert_bytes(MOE)
    assert per == 3 * MOE.moe_intermediate_size * MOE.hidden_size * 2  # gate, up, down in bf16
    assert bench_module.expert_bytes(TIED) == 0
    step = bench_module.weight_bytes_per_step(MOE)
    k = MOE.num_experts_per_tok
    assert bench_module.pass_weight_bytes(MOE, "bf16", k) == step
    assert bench_module.pass_weight_bytes(MOE, "bf16", k + 1.5) == (
        step + round(1.5 * MOE.sparse_layers * per))


class CountingEngine(ReferenceEngine):
    """A reference engine whose passes report four experts a sparse layer read, as the CUDA
    engine's experts_read counts them."""

    read = 0

    def experts_read(self) -> int:
        return self.read

    def _speculative_pass(self, *args, **kwargs):
        self.read += 4 * self.config.sparse_layers
        return super()._speculative_pass(*args, **kwargs)


def test_speculation_on_a_mixture_of_experts_reports_the_experts_a_pass_read():
    engine = CountingEngine(MOE, RandomWeights(MOE), 64)
    settings = BenchSettings(prompts=(4,), positions=(3,), steps=16, repeats=1,
                             speculation=True)
    result = measure_engine(engine, settings, "tiny", "random")
    assert result.speculation and all(r.passes > 0 for r in result.speculation)
    assert all(r.experts_a_layer == 4.0 for r in result.speculation)
    out = io.StringIO()
    bench_module.render(result, out)
    read = bench_module.pass_weight_bytes(MOE, "bf16", 4.0)
    assert (f"read 4.0 experts a layer, {MOE.num_experts_per_tok} a plain step: "
            f"{read / 1e3:.2f} kB" in out.getvalue().replace("\n", " "))
    # a dense model's passes (or an engine that does not count) say nothing of experts
    dense = measure_engine(ReferenceEngine(TIED, RandomWeights(TIED), 64), settings, "tiny",
                           "random")
    assert all(r.experts_a_layer is None for r in dense.speculation)


def test_speculation_is_skipped_where_the_context_leaves_no_room_for_it():
    engine = ReferenceEngine(TIED, RandomWeights(TIED), 30)
    settings = BenchSettings(prompts=(4,), positions=(3,), steps=24, repeats=1,
                             speculation=True)
    assert measure_engine(engine, settings, "tiny", "random").speculation == []

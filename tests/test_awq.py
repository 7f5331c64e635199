"""Qwen's AWQ checkpoints (issue 24, first part): the 4-bit layout packed and unpacked in
AutoAWQ's order, config.json's declaration, each tensor checked at open, and the reference
engine on them equal to transformers on the dequantized weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hf_compare import hf_logits, relative_error, require_transformers
from tiny_model import (
    AWQ_QUANTIZATION,
    AWQ_SHAPE,
    awq_tensors,
    random_tensors,
    refusal_line,
    tiny_config,
    without_quantization_config,
    write_dequantized_copy,
    write_edited_model,
    write_safetensors,
    write_tiny_model,
)

from qwenchat.engine.reference import ReferenceEngine
from qwenchat.errors import ModelError
from qwenchat.model import awq
from qwenchat.model.config import Qwen3Config
from qwenchat.model.loader import open_model_dir

LINEAR = "model.layers.0.mlp.down_proj"  # 128 x 384: three groups of 128 input columns


# ------------------------------------------------------------------------------ the layout
def test_a_word_holds_column_order_i_in_nibble_i():
    """AutoAWQ's "gemm" packing: nibble i of a word holds output column ORDER[i] of its 8."""
    codes = np.arange(8, dtype=np.uint8)[None, :]  # column j holds code j
    word = int(awq.pack(codes).view(np.uint32)[0, 0])
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]
    assert np.array_equal(awq.unpack(awq.pack(codes)), codes)
    rng = np.random.default_rng(0)
    many = rng.integers(0, 16, (5, 24), dtype=np.uint8)
    assert np.array_equal(awq.unpack(awq.pack(many)), many)


def test_dequantize_is_code_minus_zero_times_scale_per_group():
    rng = np.random.default_rng(1)
    out_features, in_features = 16, 256
    codes = rng.integers(0, 16, (in_features, out_features), dtype=np.uint8)
    zeros = rng.integers(0, 16, (2, out_features), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, (2, out_features)).astype(np.float16)
    weight = awq.dequantize(awq.pack(codes), awq.pack(zeros), scales)
    assert weight.shape == (out_features, in_features)
    for o, i in [(0, 0), (3, 127), (15, 128), (7, 255)]:
        g = i // awq.GROUP
        want = (float(codes[i, o]) - float(zeros[g, o])) * float(scales[g, o])
        assert weight[o, i] == pytest.approx(want, rel=1e-6)


def test_round_to_nearest_keeps_each_weight_within_half_a_step_and_zero_exact():
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((24, 384)).astype(np.float32)
    weight[:, 5] = 0.0
    qweight, qzeros, scales = awq.quantize(weight)
    assert qweight.dtype == qzeros.dtype == np.int32 and scales.dtype == np.float16
    assert {k: v.shape for k, v in zip(awq.SUFFIXES, (qweight, qzeros, scales), strict=True)} \
        == awq.packed_shapes(24, 384)
    back = awq.dequantize(qweight, qzeros, scales)
    step = np.repeat(scales.astype(np.float32), awq.GROUP, axis=0).T
    # half a step, plus the slack of a zero point rounded to a whole code
    assert np.all(np.abs(back - weight) <= step * 1.0 + 1e-6)
    assert np.all(back[:, 5] == 0.0)


# ------------------------------------------------------------------------------ config.json
def test_qwens_awq_declaration_is_read():
    raw = tiny_config(**AWQ_SHAPE, quantization_config=AWQ_QUANTIZATION)
    assert Qwen3Config.from_dict(raw).quantization == "awq"
    upper = {**AWQ_QUANTIZATION, "version": "GEMM", "modules_to_not_convert": []}
    assert Qwen3Config.from_dict(tiny_config(quantization_config=upper)).quantization == "awq"


@pytest.mark.parametrize(("change", "message"), [
    ({"bits": 8}, "quantization_config.bits=8"),
    ({"group_size": 64}, "quantization_config.group_size=64"),
    ({"zero_point": False}, "quantization_config.zero_point=false"),
    ({"version": "gemv"}, 'quantization_config.version="gemv"'),
    ({"modules_to_not_convert": "lm_head"}, "quantization_config.modules_to_not_convert"),
])
def test_other_awq_settings_are_refused_in_one_line(change, message):
    with pytest.raises(ModelError) as caught:
        Qwen3Config.from_dict(tiny_config(quantization_config={**AWQ_QUANTIZATION, **change}))
    assert message in str(caught.value) and "\n" not in str(caught.value)


# ------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("awq") / "m", dtype="AWQ",
                            tokenizer=tiny_tokenizer)


def test_an_awq_checkpoint_opens_as_awq_and_dequantizes_its_layers(awq_dir):
    model = open_model_dir(awq_dir)
    try:
        assert model.checkpoint.weight_format == "awq"
        weight = model.checkpoint.float32(f"{LINEAR}.weight")
        raw = {s: model.checkpoint.raw(f"{LINEAR}.{s}") for s in awq.SUFFIXES}
        scales = raw["scales"].astype(np.float32)
        assert np.array_equal(weight, awq.dequantize(raw["qweight"], raw["qzeros"], scales))
        assert weight.shape == (128, 384)
        bits = model.checkpoint.bf16_bits(f"{LINEAR}.weight")
        assert bits.dtype == np.uint16 and bits.shape == (128, 384)
        # fp16 tensors beside them are read as the file has them
        assert model.checkpoint.dtype("model.norm.weight") == "F16"
    finally:
        model.close()


def _nan_scale(tensors, dtypes):
    tensors[f"{LINEAR}.scales"] = tensors[f"{LINEAR}.scales"].astype(np.float32)
    tensors[f"{LINEAR}.scales"][1, 2] = np.nan


BROKEN = {
    "missing qzeros": (lambda t, d: (t.pop(f"{LINEAR}.qzeros"), d.pop(f"{LINEAR}.qzeros")),
                       f"AWQ tensor {LINEAR}.qzeros is missing"),
    "qweight shape": (lambda t, d: t.__setitem__(f"{LINEAR}.qweight",
                                                 np.zeros((384, 8), np.int32)),
                      "in AWQ's layout needs [384, 16]"),
    "qzeros shape (groups)": (lambda t, d: t.__setitem__(f"{LINEAR}.qzeros",
                                                         np.zeros((2, 16), np.int32)),
                              "needs [3, 16]"),
    "scales dtype": (lambda t, d: d.__setitem__(f"{LINEAR}.scales", "I32"),
                     "AWQ's scales is BF16 or F16 or F32"),
    "qweight dtype": (lambda t, d: d.__setitem__(f"{LINEAR}.qweight", "F32"),
                      "AWQ's qweight is I32"),
    "corrupt scale (NaN)": (_nan_scale, "holds nan at (1, 2)"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_awq_checkpoint_is_refused_in_one_line(case, tmp_path, tiny_tokenizer):
    edit, message = BROKEN[case]
    directory = write_edited_model(tmp_path / "m", tiny_tokenizer, "AWQ", edit)
    assert message in refusal_line(directory)


def test_awq_tensors_without_a_quantization_config_are_refused(awq_dir, tmp_path):
    directory = without_quantization_config(awq_dir, tmp_path / "m")
    with pytest.raises(ModelError, match="declares no AWQ quantization_config"):
        open_model_dir(directory)


def test_a_layer_whose_inputs_are_not_whole_groups_is_refused(tmp_path, tiny_tokenizer):
    """intermediate 320: down_proj's inputs would end in a part of a group."""
    directory = tmp_path / "m"
    write_tiny_model(directory, dtype="AWQ", tokenizer=tiny_tokenizer)
    raw = json.loads((directory / "config.json").read_text())
    raw["intermediate_size"] = 320
    (directory / "config.json").write_text(json.dumps(raw))
    config = Qwen3Config.from_dict({**raw, "quantization_config": None})
    tensors = random_tensors(config)
    down = tensors.pop(f"{LINEAR}.weight")
    encoded, dtypes = awq_tensors({k: v for k, v in tensors.items()
                                   if not k.endswith("down_proj.weight")})
    for layer in range(config.num_hidden_layers):  # packed as if 384 wide, to reach the check
        module = f"model.layers.{layer}.mlp.down_proj"
        padded = np.zeros((128, 384), np.float32)
        padded[:, :320] = down
        for suffix, array in zip(awq.SUFFIXES, awq.quantize(padded), strict=True):
            encoded[f"{module}.{suffix}"] = array
            dtypes[f"{module}.{suffix}"] = "F16" if suffix == "scales" else "I32"
    write_safetensors(directory / "model.safetensors", encoded, dtypes)
    with pytest.raises(ModelError) as caught:
        open_model_dir(directory)
    assert "whole groups of 128" in str(caught.value) and "\n" not in str(caught.value)


# ------------------------------------------------------------------------------ engines
def prompt_ids(n: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(5).integers(3, 400, n)]


def test_the_reference_engine_on_awq_equals_transformers_on_the_dequantized_weights(
        awq_dir, tmp_path):
    require_transformers()
    plain = write_dequantized_copy(awq_dir, tmp_path / "f32", dtype="F32")
    model = open_model_dir(awq_dir)
    ids = prompt_ids(48)
    ours = ReferenceEngine(model.config, model.checkpoint).prefill_logits(ids)
    assert relative_error(ours, hf_logits(plain, ids)) <= 1e-4


def test_the_reference_engine_answers_greedily_as_on_the_dequantized_copy(awq_dir, tmp_path):
    from qwenchat.engine.base import GenerateRequest
    from qwenchat.sampling.params import LiveParams, SamplingParams

    plain = write_dequantized_copy(awq_dir, tmp_path / "f32", dtype="F32")
    replies = []
    for directory in (awq_dir, plain):
        model = open_model_dir(directory)
        engine = ReferenceEngine(model.config, model.checkpoint)
        engine.prefill(prompt_ids(12))
        request = GenerateRequest(LiveParams(SamplingParams(temperature=0.0, max_tokens=40)),
                                  frozenset(), seed=0)
        replies.append(list(engine.generate(request)))
        model.close()
    assert replies[0] == replies[1]


def test_ask_answers_from_an_awq_checkpoint_on_the_cpu(awq_dir):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "qwenchat", "ask", "-m", str(awq_dir),
                           "--backend", "cpu", "--max-tokens", "8", "--temperature", "0",
                           "--json", "hello"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["weights"] == "int4" and record["stop_reason"] in ("max_tokens", "eos")


# ------------------------------------------------------------------------------ --quantize int4
def test_quantize_int4_gives_the_logits_of_the_same_codes_written_as_a_4bit_checkpoint(
        tmp_path, tiny_tokenizer):
    from qwenchat.model.fp8 import with_quantization

    source = write_tiny_model(tmp_path / "bf16", tokenizer=tiny_tokenizer, **AWQ_SHAPE)
    model = open_model_dir(source)
    quantized = with_quantization(model.checkpoint, "int4")
    assert quantized.weight_format == "int4"
    ids = prompt_ids(24)
    at_load = ReferenceEngine(model.config, quantized).prefill_logits(ids)
    # the same codes, written offline in AWQ's layout (the other tensors as the source has them)
    tensors = {n: model.checkpoint.float32(n) for n in model.config.tensor_shapes()}
    encoded, dtypes = awq_tensors(tensors)
    for name in tensors:
        if name in encoded:
            dtypes[name] = "BF16"
    offline = tmp_path / "awq"
    shutil.copytree(source, offline)
    raw = json.loads((offline / "config.json").read_text())
    raw["quantization_config"] = AWQ_QUANTIZATION
    (offline / "config.json").write_text(json.dumps(raw))
    write_safetensors(offline / "model.safetensors", encoded, dtypes)
    written = open_model_dir(offline)
    assert np.array_equal(ReferenceEngine(written.config, written.checkpoint)
                          .prefill_logits(ids), at_load)
    # and an AWQ checkpoint keeps its own codes under --quantize int4
    again = with_quantization(written.checkpoint, "int4")
    name = f"{LINEAR}.weight"
    assert np.array_equal(again.float32(name), written.checkpoint.float32(name))
    # a 4-bit model is not the bf16 one: the codes did change the weights
    assert not np.array_equal(quantized.float32(name), model.checkpoint.float32(name))
    model.close()
    written.close()


def test_quantize_int4_is_a_choice_of_every_command_and_others_are_refused():
    from qwenchat.engine import check_engine_flags
    from qwenchat.errors import UsageError

    check_engine_flags("cpu", None, 0, "auto", "int4")
    with pytest.raises(UsageError, match="--quantize must be one of none, fp8, int4"):
        check_engine_flags("cpu", None, 0, "auto", "int8")

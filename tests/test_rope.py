"""--rope-scaling and the context limits (qwenchat/model/rope.py), on the CPU. The YaRN
frequencies and logits against transformers are in test_reference_engine.py."""

from __future__ import annotations

import dataclasses

import pytest

from qwenchat.errors import UsageError
from qwenchat.model import rope
from qwenchat.model.presets import PRESETS


@pytest.mark.parametrize(("flag", "parsed"), [
    ("yarn", (4.0, None)), ("yarn:2", (2.0, None)), ("YARN:8:4096", (8.0, 4096)),
    (" yarn:1.5 ", (1.5, None)), ("none", None)])
def test_the_flag_parses_to_a_factor_and_an_original_length(flag, parsed):
    assert rope.parse_flag(flag) == parsed


@pytest.mark.parametrize("flag", ["linear", "yarn:x", "yarn:0.5", "yarn:4:0", "yarn:1:2:3",
                                  "yarn:inf", ""])
def test_a_bad_flag_is_one_usage_line(flag):
    with pytest.raises(UsageError, match="--rope-scaling"):
        rope.parse_flag(flag)


@pytest.mark.parametrize("flag", ["linear", "dynamic:2", "Llama3"])
def test_another_rope_type_is_refused_naming_it(flag):
    kind = flag.split(":")[0].lower()
    with pytest.raises(UsageError, match=f"unsupported rope type '{kind}'.*YaRN"):
        rope.parse_flag(flag)


def test_yarn_on_qwen3_is_qwens_recipe_and_raises_the_limit():
    config = rope.with_flag(PRESETS["qwen3-8b"], "yarn")
    assert config.rope_scaling == rope.Yarn(factor=4.0, original_max_position_embeddings=32768)
    assert config.trained_positions == 32768 and config.context_limit == 131072
    assert rope.with_flag(config, "none").rope_scaling is None
    assert rope.with_flag(config, None) is config
    short = dataclasses.replace(PRESETS["qwen3-8b"], max_position_embeddings=4096)
    assert rope.with_flag(short, "yarn:2").context_limit == 8192  # over its own 4,096


def test_yarn_scales_the_scores_by_the_square_of_its_attention_factor():
    plain = PRESETS["qwen3-8b"]
    config = rope.with_flag(plain, "yarn")
    factor = 0.1 * __import__("math").log(4.0) + 1.0
    assert rope.attention_factor(config) == pytest.approx(factor)
    assert rope.softmax_scale(config) == pytest.approx(128**-0.5 * factor**2)
    assert rope.softmax_scale(plain) == 128**-0.5 and rope.attention_factor(plain) == 1.0


def test_a_context_past_the_limit_names_the_way_out():
    plain = PRESETS["qwen3-8b"]
    rope.check_context(plain, None)
    rope.check_context(plain, 40960)
    with pytest.raises(UsageError, match=r"--ctx 50,000 .*40,960 .*--rope-scaling yarn"):
        rope.check_context(plain, 50000)
    yarn = rope.with_flag(plain, "yarn")
    rope.check_context(yarn, 131072)
    with pytest.raises(UsageError, match=r"131,072 .*yarn:5"):
        rope.check_context(yarn, 140000)


def test_create_engine_refuses_a_context_past_the_limit_and_a_missing_device(monkeypatch):
    from qwenchat.engine import create_engine
    from qwenchat.engine.cuda import probe as cuda_probe
    from qwenchat.model.random_weights import RandomWeights

    config = dataclasses.replace(PRESETS["qwen3-0.6b"], num_hidden_layers=1,
                                 max_position_embeddings=256)
    weights = RandomWeights(config)
    with pytest.raises(UsageError, match="--rope-scaling yarn"):
        create_engine("cpu", config, weights, ctx=300)
    one_gpu = cuda_probe.CudaProbe(gpus=[cuda_probe.GpuInfo(0, "GPU", (9, 0), 80 * 2**30, 132)])
    monkeypatch.setattr(cuda_probe, "probe", lambda: one_gpu)
    with pytest.raises(UsageError, match=r"--device 1: this machine has 1 GPU \(0-0\)"):
        create_engine("auto", config, weights, ctx=64, device=1)

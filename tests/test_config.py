"""Qwen3Config: published configs parse to the presets, Qwen3-MoE configs to their experts, and
everything outside the Qwen3 family is refused with a message that names the field and its
value."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
from tiny_model import tiny_config, tiny_moe_config

from qwenchat.errors import ModelError
from qwenchat.model.config import Qwen3Config
from qwenchat.model.presets import PRESETS

SOURCE = "broken/config.json"


def configs_dir() -> Path:
    value = os.environ.get("QWENCHAT_TEST_CONFIGS")
    if value:
        return Path(value)
    return Path(__file__).parents[1].parent / "shared/fixtures/qwen3-configs"


def refusal(overrides: dict, drop: tuple[str, ...] = ()) -> str:
    raw = tiny_config(**overrides)
    for name in drop:
        raw.pop(name)
    with pytest.raises(ModelError) as caught:
        Qwen3Config.from_dict(raw, source=SOURCE)
    return str(caught.value)


def assert_names(message: str, *words: str) -> None:
    """Each word appears in the message as a whole token (so "0" is not found inside "10")."""
    assert SOURCE in message, message
    for word in words:
        assert re.search(rf"(?<![\w.-]){re.escape(word)}(?![\w])", message), (word, message)


def transformers5_raw(name: str = "qwen3-0.6b", **changes) -> dict:
    """A config.json as transformers 5 writes it: rope_parameters, layer_types, dtype."""
    p = PRESETS[name]
    raw = {
        "model_type": "qwen3",
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "head_dim": p.head_dim,
        "rms_norm_eps": p.rms_norm_eps,
        "max_position_embeddings": p.max_position_embeddings,
        "tie_word_embeddings": p.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * p.num_hidden_layers,
        "rope_parameters": {"rope_theta": p.rope_theta, "rope_type": "default"},
        "dtype": "bfloat16",
    }
    raw.update(changes)
    return raw


# --- parsing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_published_config_parses_to_its_preset(name):
    directory = configs_dir()
    if not (directory / f"{name}.json").is_file():
        pytest.skip(f"no {name}.json among the Qwen3 config fixtures at {directory} "
                    "(set QWENCHAT_TEST_CONFIGS)")
    assert Qwen3Config.from_file(directory / f"{name}.json") == PRESETS[name]


def test_transformers5_config_parses_to_the_same_config():
    assert Qwen3Config.from_dict(transformers5_raw()) == PRESETS["qwen3-0.6b"]


def test_rope_theta_is_read_from_rope_parameters():
    raw = transformers5_raw(rope_parameters={"rope_theta": 500_000.0, "rope_type": "default"})
    assert Qwen3Config.from_dict(raw).rope_theta == 500_000.0


@pytest.mark.parametrize("field", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("key", ["rope_type", "type"])
def test_yarn_is_read_from_either_field_and_either_key(field, key):
    from qwenchat.model.rope import Yarn

    raw = transformers5_raw(**{field: {key: "yarn", "factor": 4.0, "beta_fast": 16,
                                       "original_max_position_embeddings": 32768,
                                       "rope_theta": 1e6}})
    if field == "rope_scaling":
        raw.pop("rope_parameters")
    config = Qwen3Config.from_dict(raw)
    assert config.rope_scaling == Yarn(factor=4.0, original_max_position_embeddings=32768,
                                       beta_fast=16.0)
    assert config.trained_positions == 32768 and config.context_limit == 131072


def test_plain_rope_keeps_the_configs_maximum_as_its_limit():
    config = Qwen3Config.from_dict(transformers5_raw())
    assert config.rope_scaling is None
    assert config.trained_positions == config.context_limit == config.max_position_embeddings


def test_dtype_stands_in_for_torch_dtype():
    assert Qwen3Config.from_dict(transformers5_raw(dtype="float16")).torch_dtype == "float16"


def test_head_dim_absent_defaults_to_hidden_size_over_heads():
    raw = tiny_config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    del raw["head_dim"]
    assert Qwen3Config.from_dict(raw).head_dim == 64


def test_num_key_value_heads_absent_means_one_per_query_head():
    raw = tiny_config()
    del raw["num_key_value_heads"]
    assert Qwen3Config.from_dict(raw).num_key_value_heads == raw["num_attention_heads"]


# --- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field", "value"),
    [
        ({"architectures": ["Qwen3MoeForCausalLM"]}, "model_type", "qwen3_moe"),
        ({"model_type": "qwen3_moe"}, "architectures", "Qwen3ForCausalLM"),
        ({"architectures": ["LlamaForCausalLM"]}, "architectures", "LlamaForCausalLM"),
        ({"architectures": "Qwen3ForCausalLM"}, "architectures", "Qwen3ForCausalLM"),
        ({"model_type": "qwen2"}, "model_type", "qwen2"),
        ({"num_experts": 128, "num_experts_per_tok": 8}, "num_experts", "qwen3_moe"),
        ({"moe_intermediate_size": 768}, "moe_intermediate_size", "768"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "rope_scaling", "linear"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0}},
         "rope_parameters", "dynamic"),
        ({"rope_scaling": {"type": "longrope"}}, "rope_scaling", "longrope"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling",
         "original_max_position_embeddings"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": "big",
                           "original_max_position_embeddings": 32768}}, "rope_scaling.factor",
         "big"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 0.5,
                           "original_max_position_embeddings": 32768}}, "rope_scaling",
         "factor >= 1"),
        ({"rope_scaling": "yarn"}, "rope_scaling", "yarn"),
        ({"use_sliding_window": True}, "use_sliding_window", "true"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types",
         "sliding_attention"),
        ({"attention_bias": True}, "attention_bias", "true"),
        ({"hidden_act": "gelu"}, "hidden_act", "gelu"),
    ],
)
def test_config_outside_qwen3_is_refused_naming_field_and_value(overrides, field, value):
    assert_names(refusal(overrides), field, value)


def test_model_type_missing_is_refused():
    assert_names(refusal({}, drop=("model_type",)), "model_type")


def test_heads_not_a_multiple_of_kv_heads_is_refused_naming_both():
    message = refusal({"num_attention_heads": 6, "num_key_value_heads": 4, "head_dim": 16})
    assert_names(message, "num_attention_heads", "6", "num_key_value_heads", "4")


def test_odd_head_dim_is_refused():
    assert_names(refusal({"head_dim": 15}), "head_dim", "15")


@pytest.mark.parametrize(
    "field",
    ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
     "num_attention_heads"],
)
def test_missing_required_field_is_refused_naming_it(field):
    assert_names(refusal({}, drop=(field,)), field)


@pytest.mark.parametrize("value", [0, -2])
@pytest.mark.parametrize(
    "field",
    ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"],
)
def test_size_that_is_not_positive_is_refused_naming_field_and_value(field, value):
    assert_names(refusal({field: value}), field, str(value))


def test_zero_heads_without_head_dim_is_refused_as_a_model_error():
    # head_dim falls back to hidden_size // num_attention_heads: it must not divide by zero.
    assert_names(refusal({"num_attention_heads": 0}, drop=("head_dim",)), "num_attention_heads")


@pytest.mark.parametrize("field", ["rms_norm_eps", "rope_theta"])
@pytest.mark.parametrize("value", [0.0, -1.0, math.nan])
def test_non_positive_eps_or_theta_is_refused(field, value):
    assert_names(refusal({field: value}), field)


def test_size_that_is_not_a_number_is_refused():
    assert_names(refusal({"hidden_size": "large"}), "large")


def test_non_json_config_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{ this is not json", encoding="utf-8")
    with pytest.raises(ModelError, match=re.escape(str(path))):
        Qwen3Config.from_file(path)


def test_config_file_holding_a_list_is_refused_naming_it(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps([tiny_config()]), encoding="utf-8")
    with pytest.raises(ModelError, match=re.escape(str(path))):
        Qwen3Config.from_file(path)


def test_missing_config_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "config.json"
    with pytest.raises(ModelError, match=re.escape(str(path))):
        Qwen3Config.from_file(path)


def test_config_file_parse_failure_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config(hidden_act="gelu")), encoding="utf-8")
    with pytest.raises(ModelError, match=re.escape(str(path))):
        Qwen3Config.from_file(path)


# --- derived sizes ---------------------------------------------------------------------------


def test_tied_config_has_no_lm_head_tensor():
    shapes = PRESETS["qwen3-0.6b"].tensor_shapes()
    assert "lm_head.weight" not in shapes
    assert len(shapes) == 1 + 11 * 28 + 1


def test_untied_config_has_an_lm_head_the_shape_of_the_embedding():
    shapes = PRESETS["qwen3-8b"].tensor_shapes()
    assert shapes["lm_head.weight"] == shapes["model.embed_tokens.weight"] == (151_936, 4096)
    assert len(shapes) == 1 + 11 * 36 + 2


def test_query_projection_is_wider_than_hidden_size_in_qwen3_0_6b():
    shapes = PRESETS["qwen3-0.6b"].tensor_shapes()
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (2048, 1024)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (1024, 1024)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (1024, 2048)
    assert shapes["model.layers.27.self_attn.q_norm.weight"] == (128,)


def test_qwen3_0_6b_has_596_million_parameters():
    # Per layer: q 2048x1024, k and v 1024x1024, o 1024x2048, gate/up/down 3x1024x3072,
    # two 1024 norms and two 128 q/k norms = 15,730,944; 28 layers = 440,466,432;
    # plus the tied embedding 151,936x1024 = 155,582,464 and the final 1024 norm.
    assert PRESETS["qwen3-0.6b"].parameter_count() == 596_049_920


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_count_is_the_sum_of_tensor_sizes(name):
    config = PRESETS[name]
    assert config.parameter_count() == sum(math.prod(s) for s in config.tensor_shapes().values())


def test_kv_cache_of_qwen3_0_6b_takes_114688_bytes_per_position_in_bf16():
    assert PRESETS["qwen3-0.6b"].kv_bytes_per_position(2) == 114_688


# --- mixture of experts ----------------------------------------------------------------------

# Qwen/Qwen3-30B-A3B's config.json, as published.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


def moe_refusal(overrides: dict) -> str:
    with pytest.raises(ModelError) as caught:
        Qwen3Config.from_dict(tiny_moe_config(**overrides), source=SOURCE)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_qwen3_30b_a3b_parses_with_every_layer_sparse():
    config = Qwen3Config.from_dict(QWEN3_30B_A3B)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.norm_topk_prob) == (128, 8, 768, True)
    assert config.is_moe and all(config.sparse_layer(n) for n in range(48))


def test_qwen3_30b_a3b_parses_to_its_preset():
    assert Qwen3Config.from_dict(QWEN3_30B_A3B) == PRESETS["qwen3-30b-a3b"]


def test_qwen3_30b_a3b_has_30_5_billion_parameters_and_3_3_billion_active():
    config = Qwen3Config.from_dict(QWEN3_30B_A3B)
    assert config.parameter_count() == 30_532_122_624
    assert config.active_parameter_count() == 3_353_032_704
    assert config.parameter_count() == sum(math.prod(s) for s in config.tensor_shapes().values())


def test_qwen3_30b_a3b_names_a_router_and_128_experts_a_layer():
    shapes = Qwen3Config.from_dict(QWEN3_30B_A3B).tensor_shapes()
    assert shapes["model.layers.47.mlp.gate.weight"] == (128, 2048)
    assert shapes["model.layers.0.mlp.experts.127.gate_proj.weight"] == (768, 2048)
    assert shapes["model.layers.0.mlp.experts.0.down_proj.weight"] == (2048, 768)
    assert "model.layers.0.mlp.gate_proj.weight" not in shapes
    assert "model.layers.0.mlp.experts.128.up_proj.weight" not in shapes


def test_mlp_only_layers_and_sparse_step_make_dense_layers_of_intermediate_size():
    config = Qwen3Config.from_dict(tiny_moe_config(num_hidden_layers=6, decoder_sparse_step=2,
                                                   mlp_only_layers=[3]))
    assert [config.sparse_layer(n) for n in range(6)] == [False, True, False, False, False,
                                                          True]
    shapes = config.tensor_shapes()
    assert shapes["model.layers.3.mlp.down_proj.weight"] == (64, 96)
    assert shapes["model.layers.5.mlp.experts.4.down_proj.weight"] == (64, 48)
    assert config.parameter_count() == sum(math.prod(s) for s in shapes.values())


def test_moe_fields_left_out_take_transformers_defaults():
    raw = tiny_moe_config()
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                 "intermediate_size", "tie_word_embeddings"):
        del raw[name]
    config = Qwen3Config.from_dict(raw)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.norm_topk_prob, config.decoder_sparse_step, config.mlp_only_layers,
            config.intermediate_size, config.tie_word_embeddings) == (
        128, 8, 768, False, 1, (), 6144, False)


def test_a_dense_config_has_no_experts():
    config = PRESETS["qwen3-8b"]
    assert not config.is_moe and not any(config.sparse_layer(n) for n in range(36))
    assert config.active_parameter_count() == config.parameter_count()


@pytest.mark.parametrize(("overrides", "words"), [
    ({"num_experts_per_tok": 6}, ["num_experts_per_tok", "6", "num_experts", "5"]),
    ({"num_experts": 0}, ["num_experts", "0"]),
    ({"num_experts": -4}, ["num_experts", "-4"]),
    ({"num_experts_per_tok": 0}, ["num_experts_per_tok", "0"]),
    ({"moe_intermediate_size": 0}, ["moe_intermediate_size", "0"]),
    ({"moe_intermediate_size": 47.5}, ["moe_intermediate_size", "47.5"]),
    ({"decoder_sparse_step": 0}, ["decoder_sparse_step", "0"]),
    ({"decoder_sparse_step": "2"}, ["decoder_sparse_step"]),
    ({"norm_topk_prob": "yes"}, ["norm_topk_prob", "yes"]),
    ({"mlp_only_layers": [3]}, ["mlp_only_layers", "3", "num_hidden_layers"]),
    ({"mlp_only_layers": [-1]}, ["mlp_only_layers", "-1"]),
    ({"mlp_only_layers": ["one"]}, ["mlp_only_layers", "one"]),
    ({"mlp_only_layers": 1}, ["mlp_only_layers", "1"]),
    ({"intermediate_size": 0}, ["intermediate_size", "0"]),
])
def test_an_expert_field_the_engines_cannot_run_is_refused_naming_it(overrides, words):
    assert_names(moe_refusal(overrides), *words)


@pytest.mark.parametrize("quantization", [
    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
     "weight_block_size": [128, 128]},
    {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
     "version": "gemm"},
])
def test_fp8_and_awq_moe_checkpoints_parse_as_their_dense_kin_do(quantization):
    # (Qwen3-30B-A3B-FP8 and AWQ releases: experts and attention narrow, the router not)
    config = Qwen3Config.from_dict(tiny_moe_config(quantization_config=quantization),
                                   source=SOURCE)
    assert config.is_moe and config.quantization == quantization["quant_method"]

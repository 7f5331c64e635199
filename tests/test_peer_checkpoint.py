"""tests/peer_checkpoint.py: the file the peers read holds bench's random weights exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
from peer_checkpoint import config_json, preset, write_checkpoint
from tiny_model import write_tiny_model, write_tiny_moe_model

from qwenchat.model.config import Qwen3Config
from qwenchat.model.loader import open_model_dir
from qwenchat.model.random_weights import RandomWeights


@pytest.mark.parametrize("write", [write_tiny_model, write_tiny_moe_model], ids=["dense", "moe"])
def test_a_peer_checkpoint_opens_with_benchs_random_weights(tmp_path, write):
    source = write(tmp_path / "source")  # (a config of this kind, and tokenizer files)
    config = Qwen3Config.from_file(source / "config.json")
    directory = write_checkpoint(tmp_path / "peer", config, source, seed=3)
    model = open_model_dir(directory)
    try:
        assert model.config == config
        assert model.tokenizer.vocab_size <= config.vocab_size
        expected = RandomWeights(config, seed=3)
        names = list(config.tensor_shapes())
        raw = (directory / "model.safetensors").read_bytes()
        header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
        assert sorted(k for k in header if k != "__metadata__") == sorted(names)
        assert {header[name]["dtype"] for name in names} == {"BF16"}
        for name in names:
            got = model.checkpoint.bf16_bits(name)
            assert got.shape == config.tensor_shapes()[name], name
            np.testing.assert_array_equal(got, expected.bf16_bits(name), err_msg=name)
    finally:
        model.close()
    assert not list(directory.glob("*.partial"))


def test_a_peer_config_names_the_architecture_transformers_and_llama_cpp_load():
    dense, moe = config_json(preset("qwen3-8b", 2)), config_json(preset("qwen3-30b-a3b", 3))
    assert (dense["architectures"], dense["model_type"]) == (["Qwen3ForCausalLM"], "qwen3")
    assert "num_experts" not in dense and dense["tie_word_embeddings"] is False
    assert (moe["architectures"], moe["model_type"]) == (["Qwen3MoeForCausalLM"], "qwen3_moe")
    assert (moe["num_hidden_layers"], moe["num_experts"], moe["num_experts_per_tok"],
            moe["moe_intermediate_size"], moe["mlp_only_layers"]) == (3, 128, 8, 768, [])
    assert Qwen3Config.from_dict(json.loads(json.dumps(moe))) == preset("qwen3-30b-a3b", 3)


def test_a_layer_count_outside_the_shape_ends_in_one_line():
    with pytest.raises(SystemExit, match=r"--layers: qwen3-0\.6b has 1 to 28 layers"):
        preset("qwen3-0.6b", 29)

"""Qwen3-MoE (Qwen3MoeForCausalLM) on the reference engine: logits and greedy replies equal to
transformers', routing as its router computes it, every expert tensor checked, and what the GPU
engine cannot run (a shape off its kernels' grid) refused in one line. The GPU engine's own tests:
test_cuda_moe.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hf_compare import hf_greedy_text, require_transformers
from tiny_model import TINY_MOE, random_tensors, write_safetensors, write_tiny_moe_model

from qwenchat.engine.base import GenerateRequest
from qwenchat.engine.reference import ReferenceEngine, SparseMoE, route
from qwenchat.errors import BackendUnavailable, ModelError
from qwenchat.model.config import Qwen3Config
from qwenchat.model.loader import open_model_dir
from qwenchat.sampling.params import LiveParams, SamplingParams

SCRIPT = Path(sys.executable).parent / "qwenchat"
# (The logits against transformers', at every position and step, run on three MoE shapes in
# test_reference_engine.py: its model_dir takes them.)


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return write_tiny_moe_model(tmp_path_factory.mktemp("moe") / "m", tokenizer=tiny_tokenizer)


def engine_for(directory: Path) -> ReferenceEngine:
    model = open_model_dir(directory)
    return ReferenceEngine(model.config, model.checkpoint)


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(0, 400, n)]


def qwenchat(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdin=subprocess.DEVNULL)


# --- against transformers --------------------------------------------------------------------


def test_ask_greedy_answer_is_exactly_what_transformers_generates(tiny_moe_dir):
    question = "Hello, how are you? 你好 😀"
    expected = hf_greedy_text(tiny_moe_dir, [{"role": "user", "content": question}], 30)
    result = qwenchat("ask", "--backend", "cpu", "--model", str(tiny_moe_dir), "--temperature",
                      "0",
                      "--max-tokens", "30", question)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_picks_and_weights_experts_as_transformers_does(norm_topk_prob):
    torch, transformers = require_transformers()
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = transformers.Qwen3MoeConfig(hidden_size=32, num_experts=7, num_experts_per_tok=3,
                                         norm_topk_prob=norm_topk_prob)
    router = Qwen3MoeTopKRouter(config)
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((7, 32)).astype(np.float32) / np.sqrt(32)
    hidden = rng.standard_normal((200, 32)).astype(np.float32)
    router.weight.data.copy_(torch.from_numpy(weight))
    with torch.no_grad():
        _, their_weights, their_experts = router(torch.from_numpy(hidden))
    weights, experts = route(hidden @ weight.T, 3, norm_topk_prob)
    assert np.array_equal(experts, their_experts.numpy())
    np.testing.assert_allclose(weights, their_weights.numpy(), rtol=1e-6, atol=0)


@pytest.mark.parametrize(("layers", "step", "dense"), [
    (4, 1, []), (4, 1, [0, 3]), (6, 2, []), (6, 3, [2]), (3, 4, []),
])
def test_sparse_layers_are_those_transformers_builds(layers, step, dense):
    _, transformers = require_transformers()
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        Qwen3MoeDecoderLayer,
        Qwen3MoeSparseMoeBlock,
    )

    experts = {"num_hidden_layers": layers, "decoder_sparse_step": step,
               "mlp_only_layers": dense, "num_experts": 5, "num_experts_per_tok": 3}
    ours = Qwen3Config.from_dict({**_dense_fields(), **TINY_MOE, **experts})
    theirs = transformers.Qwen3MoeConfig(**_dense_fields(), **experts)
    for n in range(layers):
        block = Qwen3MoeDecoderLayer(theirs, n).mlp
        assert ours.sparse_layer(n) == isinstance(block, Qwen3MoeSparseMoeBlock), n


def _dense_fields() -> dict:
    return {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "moe_intermediate_size": 16}


# --- the engine on its own -------------------------------------------------------------------


def test_decode_token_by_token_gives_the_logits_of_one_prefill(tiny_moe_dir):
    ids = prompt_ids(30, seed=2)
    whole = engine_for(tiny_moe_dir).prefill_logits(ids)
    engine = engine_for(tiny_moe_dir)
    engine.prefill(ids[:5])
    rows = [engine.last_logits()]
    for token in ids[5:]:
        engine.prefill([token])
        rows.append(engine.last_logits())
    np.testing.assert_allclose(np.stack(rows), whole[4:], rtol=0,
                               atol=1e-4 * np.abs(whole).max())


def test_grouping_tokens_by_expert_equals_routing_each_token_alone(tiny_moe_dir):
    engine = engine_for(tiny_moe_dir)
    moe = engine.layers[0].mlp
    assert isinstance(moe, SparseMoE)
    h = np.random.default_rng(4).standard_normal((40, engine.config.hidden_size))
    h = h.astype(np.float32)
    together = moe(h, lambda x: x)
    alone = np.concatenate([moe(h[t : t + 1], lambda x: x) for t in range(len(h))])
    # (float32 products of other shapes sum in other orders in BLAS, by machine: an output near
    # zero can differ by a few float32 steps of the largest; a wrong grouping would differ by
    # the outputs themselves)
    np.testing.assert_allclose(together, alone, rtol=1e-5, atol=2e-6 * np.abs(alone).max())


def test_every_expert_is_used_and_a_dense_layer_stays_dense(tiny_moe_dir):
    engine = engine_for(tiny_moe_dir)
    assert [type(w.mlp).__name__ for w in engine.layers] == ["SparseMoE", "DenseMLP",
                                                             "SparseMoE"]
    moe = engine.layers[0].mlp
    h = np.random.default_rng(5).standard_normal((64, engine.config.hidden_size))
    _, experts = route(h.astype(np.float32) @ moe.router.T, moe.top_k, moe.norm_topk_prob)
    assert set(experts.ravel()) == set(range(5))
    assert all(len(set(row)) == 3 for row in experts)


def test_greedy_reply_runs_to_max_tokens(tiny_moe_dir):
    engine = engine_for(tiny_moe_dir)
    engine.prefill(prompt_ids(12))
    params = LiveParams(SamplingParams(temperature=0.0, max_tokens=15))
    tokens = list(engine.generate(GenerateRequest(params, frozenset(), seed=0)))
    assert len(tokens) == 15


def test_ask_on_the_cpu_answers_with_a_moe_model(tiny_moe_dir):
    result = qwenchat("ask", "--backend", "cpu", "--model", str(tiny_moe_dir), "--temperature",
                      "0", "--max-tokens", "8", "--json", "Hi")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["generated_tokens"] == 8 and record["text"] and result.stderr == ""


def test_info_names_total_and_active_parameters_and_the_experts(tiny_moe_dir):
    from qwenchat.tui.loader import _engine_text

    engine = engine_for(tiny_moe_dir)
    config = engine.config
    total, active = config.parameter_count(), config.active_parameter_count()
    assert total - active == 2 * (5 - 3) * 3 * 64 * 48  # two sparse layers, two idle experts
    assert "M active a token; 5 experts, 3 a token)" in _engine_text(engine)


# --- checkpoints -----------------------------------------------------------------------------


def rewritten(directory: Path, edit) -> str:
    """The one-line ModelError of the model at `directory` once `edit(tensors)` changed its
    (single-file, BF16) weights."""
    config = Qwen3Config.from_file(directory / "config.json")
    tensors = random_tensors(config, 0)
    dtypes = edit(tensors) or "BF16"
    write_safetensors(directory / "model.safetensors", tensors, dtypes)
    with pytest.raises(ModelError) as caught:
        open_model_dir(directory)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def without(name: str):
    def edit(tensors: dict[str, np.ndarray]) -> None:
        del tensors[name]

    return edit


@pytest.fixture
def moe_copy(tmp_path, tiny_tokenizer) -> Path:
    return write_tiny_moe_model(tmp_path / "m", tokenizer=tiny_tokenizer)


def test_a_missing_expert_tensor_is_refused_naming_it(moe_copy):
    name = "model.layers.2.mlp.experts.4.down_proj.weight"
    message = rewritten(moe_copy, without(name))
    assert name in message and "missing" in message


def test_a_router_of_the_wrong_shape_is_refused_naming_both_shapes(moe_copy):
    name = "model.layers.0.mlp.gate.weight"

    def edit(tensors):
        tensors[name] = tensors[name][:4]

    assert f"{name} has shape [4, 64], config.json implies [5, 64]" in rewritten(moe_copy, edit)


def test_the_dense_layer_of_a_moe_model_needs_its_dense_mlp(moe_copy):
    name = "model.layers.1.mlp.gate_proj.weight"
    assert name in rewritten(moe_copy, without(name))


def test_an_fp8_expert_in_a_checkpoint_that_declares_no_fp8_is_refused_naming_it(moe_copy):
    # (an expert is a linear layer: checked as FP8 tensors are; the written FP8 and AWQ
    # checkpoints that do run: tests/test_quantize.py)
    name = "model.layers.0.mlp.experts.1.up_proj.weight"

    def edit(tensors):
        tensors[name] = np.zeros(tensors[name].shape, np.uint8)
        return {n: "F8_E4M3" if n == name else "BF16" for n in tensors}

    message = rewritten(moe_copy, edit)
    assert name in message and "declares no FP8 quantization_config" in message


def test_quantize_fp8_runs_a_moe_model_and_int4_names_the_width_it_needs(tiny_moe_dir):
    result = qwenchat("ask", "--backend", "cpu", "--model", str(tiny_moe_dir), "--quantize",
                      "fp8", "--max-tokens", "4", "Hi")
    assert result.returncode == 0 and result.stdout.strip(), result.stderr
    # (the tiny model is 64 wide: int4's groups need 128; a wide one runs, test_quantize.py)
    result = qwenchat("ask", "--backend", "cpu", "--model", str(tiny_moe_dir), "--quantize",
                      "int4", "Hi")
    assert result.returncode != 0 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert "groups of 128" in result.stderr


# --- the GPU engine --------------------------------------------------------------------------

def test_cuda_engine_runs_experts_in_every_format_and_names_a_shape_it_cannot(tiny_moe_dir):
    from qwenchat.engine.cuda.builds import unsupported_reason

    config = open_model_dir(tiny_moe_dir).config
    assert unsupported_reason(config) is None
    fields = {**_dense_fields(), **TINY_MOE}
    wide = Qwen3Config.from_dict({**fields, "moe_intermediate_size": 12800})
    assert unsupported_reason(wide) == ("this model's moe_intermediate_size 12800 (the CUDA "
                                        "kernels take at most 12,288)")
    odd = Qwen3Config.from_dict({**fields, "moe_intermediate_size": 56})
    assert unsupported_reason(odd, "fp8") == ("this model's moe_intermediate_size 56 (the CUDA "
                                              "kernels need a multiple of 16 for fp8 weights)")
    assert unsupported_reason(odd) is None
    groups = Qwen3Config.from_dict({**fields, "hidden_size": 128, "num_attention_heads": 4,
                                    "head_dim": 32, "intermediate_size": 128,
                                    "moe_intermediate_size": 192})
    assert unsupported_reason(groups, "int4") == ("this model's moe_intermediate_size 192 (the "
                                                  "CUDA kernels need a multiple of 128 for int4 "
                                                  "weights)")


def test_backends_refuse_an_expert_shape_off_the_kernels_grid_before_touching_the_gpu(
        tmp_path, tiny_tokenizer, monkeypatch):
    """With a GPU there, --backend cuda exits with the one line and auto says it and runs on
    the CPU; no device is opened either way."""
    from qwenchat.engine import create_engine
    from qwenchat.engine.cuda import probe as cuda_probe
    from qwenchat.engine.cuda import runtime as rt

    gpu = cuda_probe.CudaProbe(driver_version="13.0", nvrtc_version="13.0",
                               gpus=[cuda_probe.GpuInfo(0, "GPU", (9, 0), 80 * 2**30, 132)])
    monkeypatch.setattr(cuda_probe, "probe", lambda: gpu)

    def no_device(*args, **kwargs):
        raise AssertionError("the GPU was opened")

    monkeypatch.setattr(rt, "Device", no_device)
    model = open_model_dir(write_tiny_moe_model(tmp_path / "m", tokenizer=tiny_tokenizer,
                                                moe_intermediate_size=36))
    why = ("this model's moe_intermediate_size 36 (the CUDA kernels need a multiple of 8 for "
           "bf16 weights)")
    with pytest.raises(BackendUnavailable) as caught:
        create_engine("cuda", model.config, model.checkpoint)
    assert str(caught.value) == f"--backend cuda: {why}; use --backend cpu"
    said: list[str] = []
    engine = create_engine("auto", model.config, model.checkpoint, notice=said.append)
    assert isinstance(engine, ReferenceEngine)
    assert said == [f"running on the CPU: {why}; use --backend cpu"]

"""The NumPy reference engine: logits against transformers, KV-cache consistency, generation."""

from __future__ import annotations

import numpy as np
import pytest
from hf_compare import hf_logits, relative_error, require_transformers
from tiny_model import write_tiny_model, write_tiny_moe_model

from qwenchat.engine.base import GenerateRequest, StopReason
from qwenchat.engine.reference import ReferenceEngine
from qwenchat.errors import ContextFullError, UsageError
from qwenchat.model.loader import open_model_dir
from qwenchat.sampling.params import LiveParams, SamplingParams

SHAPES = {
    "tied-bf16": dict(dtype="BF16"),
    "untied-odd-heads-f32": dict(dtype="F32", tie_word_embeddings=False, hidden_size=40,
                                 num_attention_heads=3, num_key_value_heads=1, head_dim=24,
                                 intermediate_size=72),
    "sharded-f16-mha": dict(dtype="F16", shards=3, num_attention_heads=4,
                            num_key_value_heads=4, num_hidden_layers=3),
}
# Mixtures of experts (Qwen3MoeForCausalLM), compared with transformers the same way.
MOE_SHAPES = {
    # TINY_MOE: 3 of 5 experts, renormalised, layer 1 of 3 dense (mlp_only_layers), untied.
    "moe-top3-of-5-normalised-bf16": dict(),
    # Every second layer sparse (decoder_sparse_step), weights as the softmax gives them, tied,
    # odd head counts.
    "moe-top3-of-5-raw-f32-every-second-layer": dict(
        dtype="F32", norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[],
        num_hidden_layers=4, tie_word_embeddings=True, hidden_size=40, num_attention_heads=3,
        num_key_value_heads=1, head_dim=24, intermediate_size=72, moe_intermediate_size=24),
    # One expert a token (its weight 1 once renormalised), sharded.
    "moe-top1-of-7-sharded-f16": dict(dtype="F16", shards=3, num_experts=7,
                                      num_experts_per_tok=1, mlp_only_layers=[0]),
}


@pytest.fixture(scope="module", params=[*SHAPES, *MOE_SHAPES])
def model_dir(request, tmp_path_factory, tiny_tokenizer):
    directory = tmp_path_factory.mktemp(request.param) / "m"
    if request.param in MOE_SHAPES:
        return write_tiny_moe_model(directory, tokenizer=tiny_tokenizer,
                                    **MOE_SHAPES[request.param])
    return write_tiny_model(directory, tokenizer=tiny_tokenizer, **SHAPES[request.param])


def engine_for(directory, ctx=None) -> ReferenceEngine:
    model = open_model_dir(directory)
    return ReferenceEngine(model.config, model.checkpoint, ctx)


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(0, 400, n)]


def greedy(max_tokens: int | None = None) -> LiveParams:
    return LiveParams(SamplingParams(temperature=0.0, max_tokens=max_tokens))


def test_prefill_logits_match_transformers_at_every_position(model_dir):
    require_transformers()
    ids = prompt_ids(64)
    ours = engine_for(model_dir).prefill_logits(ids)
    assert relative_error(ours, hf_logits(model_dir, ids)) <= 1e-4


def test_decode_steps_match_transformers_logits(model_dir):
    require_transformers()
    ids = prompt_ids(24, seed=1)
    engine = engine_for(model_dir)
    engine.prefill(ids[:8])
    rows = [engine.last_logits()]
    for token in ids[8:]:
        engine.prefill([token])
        rows.append(engine.last_logits())
    reference = hf_logits(model_dir, ids)[7:]
    assert relative_error(np.stack(rows), reference) <= 1e-4


def test_chunked_prefill_equals_single_prefill(tiny_model_dir):
    ids = prompt_ids(40, seed=2)
    whole = engine_for(tiny_model_dir).prefill_logits(ids)
    engine = engine_for(tiny_model_dir)
    engine.prefill(ids[:17])
    tail = engine.prefill_logits(ids[17:])
    np.testing.assert_allclose(tail, whole[17:], rtol=0, atol=1e-4 * np.abs(whole).max())


def test_truncate_then_prefill_recomputes_the_same_logits(tiny_model_dir):
    ids = prompt_ids(30, seed=3)
    engine = engine_for(tiny_model_dir)
    engine.prefill(ids)
    expected = engine.last_logits()
    engine.prefill(prompt_ids(10, seed=9))  # junk after the prompt
    engine.truncate(12)
    assert engine.position == 12 and engine.tokens == ids[:12]
    engine.prefill(ids[12:])
    assert relative_error(engine.last_logits(), expected) <= 1e-5


def test_greedy_generation_picks_the_argmax_of_each_step(tiny_model_dir):
    engine = engine_for(tiny_model_dir)
    engine.prefill(prompt_ids(12))
    tokens, argmaxes = [], []
    for token in engine.generate(GenerateRequest(greedy(20), frozenset(), seed=0)):
        argmaxes.append(int(np.argmax(engine.last_logits())))
        tokens.append(token)
    assert tokens == argmaxes and len(tokens) == 20


def test_generation_stops_at_max_tokens_and_caches_all_but_the_last_token(tiny_model_dir):
    engine = engine_for(tiny_model_dir)
    engine.prefill(prompt_ids(12))
    generation = engine.generate(GenerateRequest(greedy(7), frozenset(), seed=0))
    tokens = list(generation)
    assert generation.stop_reason is StopReason.MAX_TOKENS
    assert len(tokens) == 7
    assert engine.tokens == prompt_ids(12) + tokens[:-1]


def test_generation_stops_on_an_eos_id(tiny_model_dir):
    engine = engine_for(tiny_model_dir)
    engine.prefill(prompt_ids(12))
    free_run = list(engine.generate(GenerateRequest(greedy(10), frozenset(), seed=0)))
    stop_id = free_run[3]
    engine = engine_for(tiny_model_dir)
    engine.prefill(prompt_ids(12))
    generation = engine.generate(GenerateRequest(greedy(10), frozenset({stop_id}), seed=0))
    tokens = list(generation)
    assert generation.stop_reason is StopReason.EOS
    assert tokens == free_run[: free_run.index(stop_id) + 1]


def test_cancel_stops_within_one_step(tiny_model_dir):
    engine = engine_for(tiny_model_dir)
    engine.prefill(prompt_ids(12))
    request = GenerateRequest(greedy(), frozenset(), seed=0)
    generation = engine.generate(request)
    tokens = []
    for token in generation:
        tokens.append(token)
        if len(tokens) == 3:
            request.cancel.set()
    assert generation.stop_reason is StopReason.CANCELLED
    assert len(tokens) == 3
    assert engine.position == 12 + 2


def test_parameter_change_applies_to_the_next_token(tiny_model_dir):
    engine = engine_for(tiny_model_dir)
    engine.prefill(prompt_ids(12))
    params = LiveParams(SamplingParams(temperature=1.5, top_k=0, top_p=1.0, seed=5))
    generation = engine.generate(GenerateRequest(params, frozenset(), seed=0))
    greedy_steps = []
    for count, token in enumerate(generation, start=1):
        if count > 4:
            greedy_steps.append(token == int(np.argmax(engine.last_logits())))
        if count == 4:
            params.update(temperature=0.0)
        if count == 12:
            params.update(max_tokens=13)
    assert greedy_steps and all(greedy_steps)
    assert generation.stop_reason is StopReason.MAX_TOKENS and count == 13


def test_same_seed_gives_the_same_tokens(tiny_model_dir):
    def run(seed: int) -> list[int]:
        engine = engine_for(tiny_model_dir)
        engine.prefill(prompt_ids(12))
        params = LiveParams(SamplingParams(temperature=1.2, top_k=0, top_p=1.0, seed=seed,
                                           max_tokens=30))
        return list(engine.generate(GenerateRequest(params, frozenset(), seed=0)))

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_generation_stops_when_the_context_is_full(tiny_model_dir):
    engine = engine_for(tiny_model_dir, ctx=20)
    engine.prefill(prompt_ids(12))
    generation = engine.generate(GenerateRequest(greedy(), frozenset(), seed=0))
    tokens = list(generation)
    assert generation.stop_reason is StopReason.CONTEXT_FULL
    assert engine.position == 20 and len(tokens) == 9


def test_prefill_past_capacity_is_refused_before_any_work(tiny_model_dir):
    engine = engine_for(tiny_model_dir, ctx=16)
    engine.prefill(prompt_ids(10))
    with pytest.raises(ContextFullError, match="16-token context"):
        engine.prefill(prompt_ids(7))
    assert engine.position == 10


def test_token_ids_outside_the_vocabulary_are_refused(tiny_model_dir):
    engine = engine_for(tiny_model_dir)
    with pytest.raises(UsageError, match="outside the vocabulary"):
        engine.prefill([1, 2, engine.config.vocab_size])
    assert engine.position == 0


def test_truncate_beyond_the_cache_is_refused(tiny_model_dir):
    engine = engine_for(tiny_model_dir)
    engine.prefill(prompt_ids(5))
    with pytest.raises(UsageError, match="truncate"):
        engine.truncate(6)


# ---------------------------------------------------------------------------------- YaRN
# Qwen's recipe scaled down: trained on 64 positions, extended 4x.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.fixture(scope="module", params=["rope_scaling", "rope_parameters"])
def yarn_dir(request, tmp_path_factory, tiny_tokenizer):
    """A tiny model with YaRN in its config.json, as older configs (rope_scaling, "type")
    and transformers 5's (rope_parameters, "rope_type", rope_theta inside) write it."""
    entry = ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
             if request.param == "rope_scaling" else {**YARN, "rope_theta": 1_000_000.0})
    return write_tiny_model(tmp_path_factory.mktemp(f"yarn-{request.param}") / "m",
                            tokenizer=tiny_tokenizer, max_position_embeddings=64,
                            **{request.param: entry})


def test_yarn_prefill_matches_transformers_below_and_past_the_original_length(yarn_dir):
    require_transformers()
    ids = prompt_ids(200, seed=4)  # positions 0-199: to three times the 64 trained ones
    engine = engine_for(yarn_dir)
    assert engine.capacity == 256  # the default context: factor x the original length
    ours, theirs = engine.prefill_logits(ids), hf_logits(yarn_dir, ids)
    assert relative_error(ours[:64], theirs[:64]) <= 1e-4
    assert relative_error(ours[64:], theirs[64:]) <= 1e-4


def test_yarn_greedy_reply_past_the_original_length_is_transformers(yarn_dir):
    torch, _ = require_transformers()
    from hf_compare import hf_model

    ids = prompt_ids(60, seed=5)
    engine = engine_for(yarn_dir)
    engine.prefill(ids)
    ours = list(engine.generate(GenerateRequest(greedy(40), frozenset(), seed=0)))
    model = hf_model(yarn_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    assert ours == out[0, len(ids):].tolist()


def test_yarn_frequencies_blend_as_transformers_computes_them():
    _, transformers = require_transformers()
    import dataclasses

    from qwenchat.model import rope
    from qwenchat.model.presets import PRESETS

    for factor, original in ((4.0, 32768), (2.0, 4096), (8.0, 64)):
        config = dataclasses.replace(
            PRESETS["qwen3-8b"], rope_scaling=rope.Yarn(factor=factor,
                                                       original_max_position_embeddings=original))
        hf = transformers.Qwen3Config(
            head_dim=config.head_dim, hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            max_position_embeddings=config.max_position_embeddings,
            rope_parameters={"rope_type": "yarn", "rope_theta": config.rope_theta,
                             "factor": factor, "original_max_position_embeddings": original})
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
        np.testing.assert_allclose(rope.inv_freq(config), inv_freq.numpy(), rtol=1e-6)
        assert rope.attention_factor(config) == pytest.approx(scaling, rel=1e-12)


def test_rope_scaling_on_the_command_line_is_the_config_entry(yarn_dir, tiny_tokenizer, tmp_path):
    """--rope-scaling yarn:4:64 on a plain config gives the logits of the same YaRN written
    into config.json, bit for bit."""
    from qwenchat.model import rope

    plain_dir = write_tiny_model(tmp_path / "plain", tokenizer=tiny_tokenizer,
                                 max_position_embeddings=64)
    plain = open_model_dir(plain_dir)
    config = rope.with_flag(plain.config, "yarn:4:64")
    assert config.rope_scaling == open_model_dir(yarn_dir).config.rope_scaling
    ids = prompt_ids(150, seed=6)
    ours = ReferenceEngine(config, plain.checkpoint).prefill_logits(ids)
    assert np.array_equal(ours, engine_for(yarn_dir).prefill_logits(ids))
    assert not np.array_equal(ours, ReferenceEngine(plain.config, plain.checkpoint, 256)
                              .prefill_logits(ids))  # (YaRN changes them)

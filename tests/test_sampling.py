"""Sampling: parameter validation, Qwen3's presets, the NumPy sampler and its agreement with
transformers' logits processors."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from decimal import Decimal

import numpy as np
import pytest

from qwenchat.errors import ModelError, UsageError
from qwenchat.sampling.params import (
    MAX_SEED,
    NON_THINKING,
    THINKING,
    LiveParams,
    SamplingParams,
    eos_token_ids,
    generation_defaults,
    parse_value,
)
from qwenchat.sampling.sampler import (
    apply_penalties,
    filtered_distribution,
    sample_token,
    splitmix64,
    uniform,
)

# name -> (lowest accepted, highest accepted, just below, just above, the range's ends)
BOUNDS = {
    "temperature": (0.0, 2.0, -5e-324, math.nextafter(2.0, 3.0), (0, 2)),
    "top_p": (5e-324, 1.0, 0.0, math.nextafter(1.0, 2.0), (0, 1)),
    "top_k": (0, 1_000_000, -1, 1_000_001, (0, 1_000_000)),
    "min_p": (0.0, 1.0, -5e-324, math.nextafter(1.0, 2.0), (0, 1)),
    "repetition_penalty": (5e-324, 2.0, 0.0, math.nextafter(2.0, 3.0), (0, 2)),
    "presence_penalty": (-2.0, 2.0, math.nextafter(-2.0, -3.0), math.nextafter(2.0, 3.0), (-2, 2)),
    "frequency_penalty": (-2.0, 2.0, math.nextafter(-2.0, -3.0), math.nextafter(2.0, 3.0),
                          (-2, 2)),
    "seed": (0, MAX_SEED, -1, MAX_SEED + 1, (0, MAX_SEED)),
    "max_tokens": (1, 10_000_000, 0, 10_000_001, (1, 10_000_000)),
}
FLOAT_FIELDS = [n for n in BOUNDS if n not in ("top_k", "seed", "max_tokens")]
INT_FIELDS = ["top_k", "seed", "max_tokens"]


def _dashed(name: str) -> str:
    return name.replace("_", "-")


def _plain(**changes) -> SamplingParams:
    """Temperature 1 and every filter and penalty off, then `changes`."""
    base = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0)
    return SamplingParams(**{**base, **changes})


def _probs(values) -> np.ndarray:
    return np.log(np.asarray(values, dtype=np.float64))


# ------------------------------------------------------------------- validation


@pytest.mark.parametrize("name", list(BOUNDS))
def test_each_parameter_accepts_both_ends_of_its_range(name):
    low, high = BOUNDS[name][:2]
    assert getattr(SamplingParams(**{name: low}), name) == low
    assert getattr(SamplingParams(**{name: high}), name) == high
    assert parse_value(_dashed(name), repr(low)) == low
    assert parse_value(_dashed(name), repr(high)) == high


def _states_number(message: str, number: int) -> bool:
    """Whether the requirement part of a refusal (before "; got") mentions `number`."""
    requirement = message.split("; got")[0]
    found = re.findall(r"-?\d+(?:[,_ ]\d{3})*(?:\.\d+)?", requirement)
    return any(Decimal(re.sub(r"[,_ ]", "", n)) == number for n in found)


@pytest.mark.parametrize("side", ["below", "above"])
@pytest.mark.parametrize("name", list(BOUNDS))
def test_value_just_outside_the_range_is_a_usage_error_naming_parameter_and_range(name, side):
    # The message must name the end of the range that was crossed: "top-k must be an
    # integer ≥ 0 (0 = off); got 1000001" contradicts itself.
    outside = BOUNDS[name][2 if side == "below" else 3]
    crossed = BOUNDS[name][4][0 if side == "below" else 1]
    for refuse in (lambda: SamplingParams(**{name: outside}),
                   lambda: parse_value(_dashed(name), repr(outside))):
        with pytest.raises(UsageError) as info:
            refuse()
        assert info.value.exit_code == 2
        message = str(info.value)
        assert message.startswith(f"{_dashed(name)} must be"), message
        assert _states_number(message, crossed), message


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_are_refused(name, bad):
    with pytest.raises(UsageError, match=re.escape(_dashed(name))):
        SamplingParams(**{name: bad})
    with pytest.raises(UsageError, match=re.escape(_dashed(name))):
        parse_value(_dashed(name), str(bad))


@pytest.mark.parametrize("name", INT_FIELDS)
def test_integer_parameters_refuse_bools_and_floats(name):
    low = BOUNDS[name][0]
    for bad in (True, False, float(low) + 1.0):
        with pytest.raises(UsageError, match=_dashed(name)):
            SamplingParams(**{name: bad})


@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_float_parameters_refuse_bools_but_take_ints(name):
    with pytest.raises(UsageError, match=re.escape(_dashed(name))):
        SamplingParams(**{name: True})
    assert getattr(SamplingParams(**{name: 1}), name) == 1


@pytest.mark.parametrize("name,text", [("top-k", "x"), ("top-k", "1.5"), ("top-k", ""),
                                       ("seed", "abc"), ("max-tokens", "2.0"),
                                       ("temperature", "warm"), ("top-p", "none")])
def test_parse_value_refuses_text_that_is_not_a_number_of_the_right_kind(name, text):
    with pytest.raises(UsageError) as info:
        parse_value(name, text)
    assert info.value.exit_code == 2
    assert name in str(info.value) and repr(text) in str(info.value)


@pytest.mark.parametrize("name", ["top-q", "temp", "", "seeds"])
def test_parse_value_refuses_unknown_names_and_lists_the_known_ones(name):
    with pytest.raises(UsageError, match="unknown sampling parameter") as info:
        parse_value(name, "1")
    assert "top-p" in str(info.value) and "max-tokens" in str(info.value)


@pytest.mark.parametrize("name", ["seed", "max-tokens", "max_tokens"])
@pytest.mark.parametrize("text", ["none", "None", " NONE ", "off"])
def test_none_turns_off_seed_and_max_tokens(name, text):
    assert parse_value(name, text) is None
    assert getattr(SamplingParams(**{name.replace("-", "_"): None}), name.replace("-", "_")) \
        is None


def test_parse_value_reads_numbers_with_their_types():
    assert parse_value("top-k", "40") == 40 and isinstance(parse_value("top-k", "40"), int)
    assert parse_value("temperature", "0.25") == 0.25
    assert parse_value("top_p", "1") == 1.0 and isinstance(parse_value("top_p", "1"), float)
    assert parse_value("seed", str(MAX_SEED)) == MAX_SEED


def test_none_is_refused_for_parameters_that_need_a_value():
    for name in ("temperature", "top_k", "min_p"):
        with pytest.raises(UsageError, match=_dashed(name)):
            SamplingParams(**{name: None})


def test_greedy_means_temperature_zero():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=5e-324).greedy


# ---------------------------------------------------------------------- presets


def _core(params: SamplingParams) -> tuple[float, float, int, float]:
    return params.temperature, params.top_p, params.top_k, params.min_p


def test_presets_are_qwen3_model_card_values():
    assert _core(THINKING) == (0.6, 0.95, 20, 0.0)
    assert _core(NON_THINKING) == (0.7, 0.8, 20, 0.0)
    for preset in (THINKING, NON_THINKING):
        assert (preset.repetition_penalty, preset.presence_penalty,
                preset.frequency_penalty) == (1.0, 0.0, 0.0)
        assert preset.seed is None and preset.max_tokens is None


def _write_generation_config(directory, config) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    text = config if isinstance(config, str) else json.dumps(config)
    (directory / "generation_config.json").write_text(text)


def test_thinking_defaults_come_from_generation_config(tmp_path):
    _write_generation_config(tmp_path, {"do_sample": True, "temperature": 0.3, "top_p": 0.5,
                                        "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.1})
    params = generation_defaults(tmp_path, thinking=True)
    assert _core(params) == (0.3, 0.5, 7, 0.05)
    assert params.repetition_penalty == 1.1


def test_thinking_defaults_keep_the_preset_for_keys_the_file_lacks_or_nulls(tmp_path):
    _write_generation_config(tmp_path, {"temperature": 0.9, "top_k": None})
    assert _core(generation_defaults(tmp_path, thinking=True)) == (0.9, 0.95, 20, 0.0)


def test_do_sample_false_makes_thinking_defaults_greedy(tmp_path):
    _write_generation_config(tmp_path, {"do_sample": False, "temperature": 0.6})
    params = generation_defaults(tmp_path, thinking=True)
    assert params.temperature == 0.0 and params.greedy


def test_non_thinking_defaults_ignore_generation_config(tmp_path):
    _write_generation_config(tmp_path, {"temperature": 0.3, "top_p": 0.5, "top_k": 7})
    assert generation_defaults(tmp_path, thinking=False) == NON_THINKING


def test_thinking_defaults_fall_back_to_the_preset(tmp_path):
    assert generation_defaults(tmp_path, thinking=True) == THINKING  # no file
    assert generation_defaults(None, thinking=True) == THINKING


def test_real_generation_config_gives_the_thinking_preset(real_tokenizer_dir):
    assert generation_defaults(real_tokenizer_dir, thinking=True) == THINKING


@pytest.mark.parametrize("text", ["{not json", "\xff\xfe"])
def test_unreadable_generation_config_is_a_model_error(tmp_path, text):
    (tmp_path / "generation_config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ModelError, match=r"generation_config\.json"):
        generation_defaults(tmp_path, thinking=True)


def test_out_of_range_generation_config_is_a_model_error_naming_file_and_field(tmp_path):
    _write_generation_config(tmp_path, {"temperature": 5.0})
    with pytest.raises(ModelError, match=r"generation_config\.json.*temperature"):
        generation_defaults(tmp_path, thinking=True)


@pytest.mark.parametrize("value,expected", [
    (151645, [151645]),
    ([151645, 151643], [151643, 151645]),
    ([7, 7, 3], [3, 7]),
])
def test_eos_token_ids_read_an_int_or_a_list(tmp_path, value, expected):
    _write_generation_config(tmp_path, {"eos_token_id": value})
    assert eos_token_ids(tmp_path, fallback=[1, 2]) == expected


@pytest.mark.parametrize("config", [{}, {"eos_token_id": None}, {"eos_token_id": []}])
def test_eos_token_ids_fall_back_when_the_file_has_none(tmp_path, config):
    _write_generation_config(tmp_path, config)
    assert eos_token_ids(tmp_path, fallback=[9, 4, 9]) == [4, 9]


def test_eos_token_ids_fall_back_without_a_file(tmp_path):
    assert eos_token_ids(tmp_path, fallback=[151645]) == [151645]


def test_real_eos_token_ids_are_im_end_and_end_of_text(real_tokenizer_dir):
    assert eos_token_ids(real_tokenizer_dir, fallback=[]) == [151643, 151645]


# ------------------------------------------------------------------------ sampler


def test_splitmix64_matches_the_reference_sequence():
    # splitmix64 seeded with 0: each output is the mix of state += 0x9E3779B97F4A7C15.
    gamma = 0x9E3779B97F4A7C15
    assert [splitmix64(k * gamma % 2**64) for k in range(3)] == [
        0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_uniform_lies_in_unit_interval_and_is_roughly_uniform():
    draws = np.array([uniform(12345, step) for step in range(10_000)])
    assert draws.min() >= 0.0 and draws.max() < 1.0
    assert abs(draws.mean() - 0.5) < 0.01
    assert abs(draws.var() - 1 / 12) < 0.005
    counts = np.histogram(draws, bins=10, range=(0.0, 1.0))[0]
    assert np.all(np.abs(counts - 1000) < 150)
    seeds = np.array([uniform(seed, 0) for seed in range(10_000)])
    assert abs(seeds.mean() - 0.5) < 0.01


def test_uniform_is_a_pure_function_of_seed_and_step():
    assert uniform(7, 3) == uniform(7, 3)
    assert len({uniform(7, step) for step in range(100)}) == 100
    assert len({uniform(seed, 3) for seed in range(100)}) == 100
    assert 0.0 <= uniform(MAX_SEED, 2**40) < 1.0


def test_temperature_zero_takes_the_first_argmax_whatever_the_seed():
    logits = np.array([1.0, 5.0, -2.0, 5.0, 4.9], dtype=np.float32)
    greedy = SamplingParams(temperature=0.0, top_k=3, top_p=0.1, min_p=0.9)
    tokens = {sample_token(logits, greedy, seed, step) for seed in range(20) for step in range(5)}
    assert tokens == {int(np.argmax(logits))} == {1}


def test_temperature_zero_matches_torch_argmax_on_random_logits():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.integers(-4, 5, size=64).astype(np.float32)  # many ties
        expected = int(torch.argmax(torch.from_numpy(logits)))
        assert sample_token(logits, SamplingParams(temperature=0.0), 1, 0) == expected


def test_greedy_choice_sees_the_penalties():
    logits = np.array([2.0, 1.9, 0.0], dtype=np.float32)
    params = SamplingParams(temperature=0.0, presence_penalty=0.5)
    assert sample_token(logits, params, 0, 0) == 0
    assert sample_token(logits, params, 0, 0, reply_counts={0: 1}) == 1


def test_top_k_one_always_takes_the_argmax():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=1000).astype(np.float32)
    params = _plain(temperature=2.0, top_k=1)
    tokens = {sample_token(logits, params, seed, step)
              for seed in range(50) for step in range(4)}
    assert tokens == {int(np.argmax(logits))}


def test_same_seed_and_step_give_the_same_token_and_other_seeds_differ():
    logits = np.zeros(1000, dtype=np.float32)  # uniform over 1000 tokens
    params = _plain()
    first = [sample_token(logits, params, 42, step) for step in range(200)]
    again = [sample_token(logits, params, 42, step) for step in range(200)]
    other = [sample_token(logits, params, 43, step) for step in range(200)]
    assert first == again
    assert sum(a != b for a, b in zip(first, other, strict=True)) > 190
    assert len(set(first)) > 150  # different steps differ too


def test_sample_frequencies_match_the_filtered_distribution():
    logits = np.array([2.0, 1.5, 1.2, 0.3, -0.5, -3.0, 1.9, 0.0], dtype=np.float32)
    params = _plain(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05)
    order, probs = filtered_distribution(logits, params)
    assert 2 < order.size < 6
    draws = 20_000
    counts = Counter(sample_token(logits, params, 2024, step) for step in range(draws))
    assert set(counts) <= set(order.tolist())
    for token, p in zip(order.tolist(), probs, strict=True):
        assert abs(counts[token] / draws - p) < 0.02, (token, counts[token] / draws, p)


def test_top_k_keeps_the_k_most_likely():
    logits = _probs([0.1, 0.4, 0.05, 0.25, 0.2])
    order, probs = filtered_distribution(logits, _plain(top_k=3))
    assert order.tolist() == [1, 3, 4]
    np.testing.assert_allclose(probs, np.array([0.4, 0.25, 0.2]) / 0.85, rtol=1e-12)


@pytest.mark.parametrize("top_p,kept", [(0.3, 1), (0.5, 1), (0.51, 2), (0.79, 2), (0.81, 3),
                                        (0.94, 3), (0.96, 4), (1.0, 4)])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    logits = _probs([0.15, 0.5, 0.05, 0.3])
    order, probs = filtered_distribution(logits, _plain(top_p=top_p))
    assert order.tolist() == [1, 3, 0, 2][:kept]
    expected = np.array([0.5, 0.3, 0.15, 0.05])[:kept]
    np.testing.assert_allclose(probs, expected / expected.sum(), rtol=1e-12)


@pytest.mark.parametrize("min_p,kept", [(0.05, 4), (0.2, 3), (0.31, 2), (0.61, 1), (1.0, 1)])
def test_min_p_keeps_tokens_at_least_min_p_times_the_top(min_p, kept):
    logits = _probs([0.15, 0.5, 0.05, 0.3])
    order, _ = filtered_distribution(logits, _plain(min_p=min_p))
    assert order.tolist() == [1, 3, 0, 2][:kept]


def test_temperature_sharpens_before_filtering():
    logits = _probs([0.5, 0.3, 0.15, 0.05])
    order, probs = filtered_distribution(logits, _plain(temperature=0.5))
    expected = np.array([0.5, 0.3, 0.15, 0.05]) ** 2
    np.testing.assert_allclose(probs, expected / expected.sum(), rtol=1e-12)
    # p=0.8 of the sharpened distribution (0.676, 0.243, ...) needs two tokens.
    order, _ = filtered_distribution(logits, _plain(temperature=0.5, top_p=0.8))
    assert order.tolist() == [0, 1]


# ---------------------------------------------------------------------- penalties


def test_penalties_off_leave_logits_unchanged_and_the_input_untouched():
    logits = np.array([1.5, -0.5, 0.0, 3.0], dtype=np.float32)
    copy = logits.copy()
    out = apply_penalties(logits, _plain(), [0, 1, 1, 3], {1: 2})
    np.testing.assert_array_equal(out, copy)
    penalised = apply_penalties(logits, _plain(repetition_penalty=1.5, presence_penalty=1.0),
                                [0, 1], {3: 1})
    np.testing.assert_array_equal(logits, copy)
    assert not np.array_equal(penalised, copy)


def test_presence_and_frequency_penalties_follow_openai_over_reply_tokens():
    logits = np.array([1.0, 2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    context = [0, 1, 1, 2]  # prompt tokens: presence/frequency ignore them
    reply = [3, 4, 4, 4, 1]
    params = _plain(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, params, context + reply, Counter(reply))
    expected = logits.astype(np.float64).copy()
    for token, count in Counter(reply).items():
        expected[token] -= 0.5 * (count > 0) + 0.25 * count
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-6)
    assert out[0] == logits[0] and out[2] == logits[2]


def test_negative_presence_and_frequency_penalties_encourage_repeats():
    logits = np.zeros(3, dtype=np.float32)
    out = apply_penalties(logits, _plain(presence_penalty=-2.0, frequency_penalty=-1.0),
                          [], {2: 3})
    np.testing.assert_allclose(out, [0.0, 0.0, 5.0])


def test_repetition_penalty_applies_before_presence_and_frequency():
    logits = np.array([2.0, -1.0], dtype=np.float32)
    params = _plain(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, params, [0, 1], {0: 2, 1: 1})
    np.testing.assert_allclose(out, [2.0 / 2 - 1.0, -1.0 * 2 - 0.75])


@pytest.mark.parametrize("penalty", [0.5, 0.9, 1.1, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    torch = pytest.importorskip("torch")
    logits_process = pytest.importorskip("transformers.generation.logits_process")
    rng = np.random.default_rng(int(penalty * 10))
    vocab = 500
    logits = (3 * rng.normal(size=vocab)).astype(np.float32)
    logits[:5] = [0.0, -0.0, 1e-8, -1e-8, 0.0]
    prompt = [int(i) for i in rng.integers(0, vocab, size=60)] + [0, 1, 2, 3]
    reply = [int(i) for i in rng.integers(0, vocab, size=40)]
    processor = logits_process.RepetitionPenaltyLogitsProcessor(penalty=float(penalty))
    input_ids = torch.tensor([prompt + reply])
    expected = processor(input_ids, torch.from_numpy(logits.copy())[None])[0].numpy()
    ours = apply_penalties(logits, _plain(repetition_penalty=penalty), prompt, Counter(reply))
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=0)
    assert not np.allclose(ours, logits)


# ------------------------------------------------- warper chain against transformers


def _transformers_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities after transformers' Temperature → TopK → TopP → MinP warpers, in float64."""
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    warpers = [lp.TemperatureLogitsWarper(float(params.temperature))]
    if params.top_k > 0:
        warpers.append(lp.TopKLogitsWarper(top_k=params.top_k))
    if params.top_p < 1.0:
        warpers.append(lp.TopPLogitsWarper(top_p=params.top_p))
    if params.min_p > 0.0:
        warpers.append(lp.MinPLogitsWarper(min_p=params.min_p))
    scores = torch.from_numpy(logits.astype(np.float64))[None]
    input_ids = torch.zeros((1, 1), dtype=torch.long)
    for warper in warpers:
        scores = warper(input_ids, scores)
    return torch.softmax(scores, dim=-1)[0].numpy()


CHAIN_CASES = [
    dict(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0),  # Qwen3 thinking
    dict(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0),  # Qwen3 non-thinking
    dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0),
    dict(temperature=1.3, top_p=0.5, top_k=0, min_p=0.0),
    dict(temperature=0.4, top_p=1.0, top_k=50, min_p=0.1),
    dict(temperature=1.0, top_p=0.9, top_k=100, min_p=0.05),
    dict(temperature=2.0, top_p=0.99, top_k=1000, min_p=0.02),
    dict(temperature=0.9, top_p=0.7, top_k=5, min_p=0.3),
    dict(temperature=1.5, top_p=1.0, top_k=1, min_p=0.0),
]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("case", CHAIN_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_filtered_distribution_matches_transformers_warper_chain(case, seed):
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=1000) * rng.uniform(0.5, 4.0)).astype(np.float32)
    params = SamplingParams(**case)
    expected = _transformers_distribution(logits, params)
    order, probs = filtered_distribution(logits, params)
    assert set(order.tolist()) == set(np.flatnonzero(expected > 0).tolist())
    np.testing.assert_allclose(probs, expected[order], rtol=0, atol=1e-6)
    assert np.all(np.diff(probs) <= 0), "candidates come most likely first"


@pytest.mark.parametrize("case", CHAIN_CASES[:4] + CHAIN_CASES[5:6],
                         ids=lambda c: "-".join(map(str, c.values())))
def test_filtered_distribution_on_tied_logits_matches_transformers_up_to_tie_breaking(case):
    # bf16 logits tie often. Where a top-p cut falls inside a run of equal logits,
    # transformers keeps the tied tokens with the highest ids and we keep the lowest ids:
    # which tokens survive may differ, the kept probabilities may not.
    for seed in range(10):
        rng = np.random.default_rng(seed)
        logits = np.round(rng.normal(size=200) * 4) / 4
        params = SamplingParams(**case)
        expected = _transformers_distribution(logits, params)
        _, probs = filtered_distribution(logits, params)
        kept = np.sort(expected[expected > 0])[::-1]
        np.testing.assert_allclose(probs, kept, rtol=0, atol=1e-9)


def test_equal_logits_are_ordered_by_id():
    logits = np.array([0.0, 1.0, 1.0, 0.5, 1.0], dtype=np.float32)
    order, _ = filtered_distribution(logits, _plain(top_p=0.5))
    assert order.tolist() == [1, 2]


# ---------------------------------------------------------------------- LiveParams


def test_live_params_update_changes_current_and_bumps_version():
    live = LiveParams(THINKING)
    assert live.current == THINKING and live.version == 0
    updated = live.update(temperature=1.2, seed=7)
    assert updated is live.current
    assert (live.current.temperature, live.current.seed, live.current.top_p) == (1.2, 7, 0.95)
    assert live.version == 1
    live.set(NON_THINKING)
    assert live.current == NON_THINKING and live.version == 2


def test_live_params_invalid_update_raises_and_keeps_the_old_params():
    live = LiveParams(NON_THINKING)
    live.update(top_k=40)
    before, version = live.current, live.version
    with pytest.raises(UsageError, match="top-p"):
        live.update(top_p=0.0)
    with pytest.raises(UsageError, match="seed"):
        live.update(seed=-1)
    assert live.current is before and live.current.top_k == 40
    assert live.version == version

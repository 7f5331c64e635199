"""Speculative decoding: the prompt-lookup proposer, the verification rule, and the reference
engine's reply loop with them (plain decoding's tokens, cache and stops)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
from tiny_model import tiny_config

from qwenchat.engine.base import GenerateRequest, StopReason
from qwenchat.engine.reference import ReferenceEngine
from qwenchat.engine.speculate import DraftProposer
from qwenchat.errors import UsageError
from qwenchat.model.config import Qwen3Config
from qwenchat.model.random_weights import RandomWeights
from qwenchat.sampling.lookup import PromptLookup
from qwenchat.sampling.params import LiveParams, SamplingParams
from qwenchat.sampling.sampler import sample_token
from qwenchat.sampling.speculative import (
    AdaptiveK,
    draft_cost,
    draft_token,
    draw_from,
    target_distribution,
    verify,
)

SAMPLED = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=0.5,
                         frequency_penalty=0.2, repetition_penalty=1.1)
GREEDY = SamplingParams(temperature=0.0, presence_penalty=1.5)


def naive_lookup(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The proposer's rule, by brute force."""
    end = len(tokens)
    for n in range(min(max_ngram, end - 1), min_ngram - 1, -1):
        tail = tokens[end - n:]
        for start in range(end - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                extended = list(tokens)
                for i in range(start + n, start + n + k):
                    extended.append(extended[i])
                return extended[start + n:start + n + k]
    return []


def test_lookup_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_tail():
    lookup = PromptLookup(max_ngram=3)
    lookup.reset([5, 6, 7, 8, 1, 6, 7, 9, 2, 5, 6, 7])
    # "5 6 7" occurred at the start, followed by 8; "6 7" later, followed by 9: the longest wins.
    assert lookup.propose(3) == [8, 1, 6]
    repeating = PromptLookup(max_ngram=2)
    repeating.reset([1, 2, 3, 4, 3, 4])
    assert repeating.propose(5) == [3, 4, 3, 4, 3]  # "3 4" two back: the period goes on
    lookup.extend([4])
    assert lookup.propose(2) == []  # 4 never occurred before
    lookup.extend([6])
    # "4 6" never occurred; "6" last occurred in the "5 6 7" before the 4.
    assert lookup.propose(2) == [7, 4]
    assert lookup.propose(0) == []


def test_lookup_indexed_as_it_grows_proposes_what_a_search_of_the_whole_context_finds():
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(0, 6, 400)]
    grown = PromptLookup(max_ngram=4, min_ngram=2)
    for end in range(1, len(tokens) + 1):
        grown.extend(tokens[end - 1:end])
        expected = naive_lookup(tokens[:end], 5, 4, 2)
        assert grown.propose(5) == expected, end
        if end % 97 == 0:
            fresh = PromptLookup(max_ngram=4, min_ngram=2)
            fresh.reset(tokens[:end])
            assert fresh.propose(5) == expected


def test_lookup_refuses_an_empty_range_of_ngram_lengths():
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(max_ngram=1, min_ngram=2)


def plain_reply(rows: np.ndarray, params: SamplingParams, seed: int, context: list[int]
                ) -> list[int]:
    """Plain decoding over fixed rows of logits: a token per row, the penalties counting the
    reply so far."""
    counts: Counter[int] = Counter()
    out = []
    for step, row in enumerate(rows):
        token = sample_token(row, params, seed, step, context, counts)
        out.append(token)
        counts[token] += 1
    return out


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_one_hot_proposals_keep_plain_decodings_tokens_exactly(params):
    # Target rows that do not depend on the tokens (so plain decoding over them is well
    # defined), proposals right for a while and then wrong: every pass keeps plain decoding's
    # tokens, whatever was proposed.
    rng = np.random.default_rng(1)
    rows = rng.normal(0, 3, (64, 50)).astype(np.float32)
    context = [1, 2, 3]
    for seed in range(20):
        plain = plain_reply(rows, params, seed, context)
        out: list[int] = []
        while len(out) < len(rows):
            k = int(rng.integers(0, 6))
            k = min(k, len(rows) - len(out) - 1)
            right = int(rng.integers(0, k + 1))
            proposal = plain[len(out):len(out) + right] + [
                (t + 1) % 50 for t in plain[len(out) + right:len(out) + k]]
            kept = verify(rows[len(out):len(out) + k + 1], proposal, params, seed, len(out),
                          context, Counter(out))
            assert kept == plain[len(out):len(out) + len(kept)]
            assert len(kept) == min(right, k) + 1
            out += kept
        assert out == plain


def test_a_draft_models_proposals_keep_the_targets_distribution():
    # Speculative sampling: whatever the draft's q, the first and second tokens a pass gives
    # are distributed as the target's p. Over 40,000 seeds (fixed, so the test is
    # deterministic), each token's share is within 5 standard errors of p: a correct rule fails
    # this with probability ~1e-5 for a fresh choice of seeds.
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0)
    target = np.log(np.array([0.35, 0.25, 0.2, 0.1, 0.06, 0.04]))
    draft = np.log(np.array([0.1, 0.4, 0.05, 0.3, 0.1, 0.05]))
    second = np.log(np.array([0.05, 0.15, 0.5, 0.1, 0.1, 0.1]))
    p = target_distribution(target, params, [], {})
    p2 = target_distribution(second, params, [], {})
    n = 40_000
    first_tokens, second_tokens = np.zeros(6), np.zeros(6)
    accepted = 0
    for seed in range(n):
        d0, q0 = draft_token(draft, params, seed, 0, [], {})
        d1, q1 = draft_token(draft, params, seed, 1, [], {})
        kept = verify(np.stack([target, second, target]), [d0, d1], params, seed, 0, [], {},
                      np.stack([q0, q1]))
        first_tokens[kept[0]] += 1
        if len(kept) > 1:  # the first was kept: the second is drawn as p2, as plain would
            second_tokens[kept[1]] += 1
            accepted += 1
    for counts, probs, total in ((first_tokens, p, n), (second_tokens, p2, accepted)):
        share = counts / total
        error = np.sqrt(probs * (1 - probs) / total)
        assert np.all(np.abs(share - probs) < 5 * error), (share, probs)
    # The acceptance rate is sum(min(p, q)), as speculative sampling promises.
    q = target_distribution(draft, params, [], {})
    assert accepted / n == pytest.approx(np.minimum(p, q).sum(), abs=0.01)


def test_the_same_seed_gives_the_same_pass():
    rng = np.random.default_rng(2)
    rows = rng.normal(0, 2, (4, 30)).astype(np.float32)
    draft = rng.normal(0, 2, 30).astype(np.float32)
    proposals = [draft_token(draft, SAMPLED, 7, s, [], {}) for s in range(3)]
    runs = [verify(rows, [d for d, _ in proposals], SAMPLED, 7, 0, [], {},
                   np.stack([q for _, q in proposals])) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


def test_verify_needs_a_row_of_logits_per_proposal_and_one_more():
    with pytest.raises(ValueError, match="3 proposed tokens need 4 rows"):
        verify(np.zeros((3, 8), np.float32), [1, 2, 3], GREEDY, 0, 0, [], {})


def test_draw_from_follows_the_plain_samplers_order_of_candidates():
    p = np.array([0.0, 0.5, 0.2, 0.3])
    assert [draw_from(p, u) for u in (0.0, 0.49, 0.51, 0.79, 0.81, 0.999)] == [1, 1, 3, 3, 2, 2]


# ------------------------------------------------------------------ the reference engine's loop
TINY = Qwen3Config.from_dict(tiny_config(vocab_size=96))


def run(engine: ReferenceEngine, prompt: list[int], params: SamplingParams, speculate: int,
        eos: frozenset[int] = frozenset()) -> tuple[list[int], StopReason]:
    engine.truncate(0)
    engine.prefill(prompt)
    generation = engine.generate(GenerateRequest(LiveParams(params), eos, seed=5,
                                                 speculate=speculate))
    return list(generation), generation.stop_reason


@pytest.fixture(scope="module")
def tiny_engine():
    return ReferenceEngine(TINY, RandomWeights(TINY, seed=3), ctx=512)


PROMPT = [7, 8, 9, 10, 11, 7, 8, 9, 12, 13, 7, 8, 9, 10, 11, 3]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=200),
                                    SamplingParams(temperature=0.9, top_k=8, top_p=0.95,
                                                   presence_penalty=0.3, frequency_penalty=0.1,
                                                   repetition_penalty=1.05, max_tokens=200)],
                         ids=["greedy", "sampled"])
def test_prompt_lookup_replies_are_plain_decodings_tokens_and_cache(tiny_engine, params):
    plain, plain_stop = run(tiny_engine, PROMPT, params, 0)
    plain_k = tiny_engine._k[:, :, :tiny_engine.position].copy()
    plain_logits, plain_position = tiny_engine.last_logits(), tiny_engine.position
    fast, fast_stop = run(tiny_engine, PROMPT, params, 6)
    assert fast == plain and fast_stop == plain_stop == StopReason.MAX_TOKENS
    stats = tiny_engine.speculation
    assert stats.passes > 0 and stats.accepted <= stats.proposed  # it did speculate
    if params.greedy:  # (this random model's greedy replies repeat themselves: lookup hits)
        assert stats.accepted > 0
    # The cache holds what plain decoding's does (the verify passes run several tokens at
    # once, so its floats may differ in the last bits), and the last logits are the same.
    assert tiny_engine.position == plain_position
    np.testing.assert_allclose(tiny_engine._k[:, :, :plain_position], plain_k, rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(tiny_engine.last_logits(), plain_logits, rtol=1e-4, atol=1e-4)


def test_a_speculative_reply_stops_on_the_token_plain_decoding_stops_on(tiny_engine):
    greedy = SamplingParams(temperature=0.0, max_tokens=120)
    plain, _ = run(tiny_engine, PROMPT, greedy, 0)
    # EOS: a token the reply produces late, so that a pass runs over it.
    eos = frozenset({plain[90]})
    cut = plain.index(plain[90]) + 1
    plain_eos, stop = run(tiny_engine, PROMPT, greedy, 0, eos)
    position = tiny_engine.position
    fast_eos, fast_stop = run(tiny_engine, PROMPT, greedy, 6, eos)
    assert fast_eos == plain_eos == plain[:cut] and fast_stop == stop == StopReason.EOS
    assert tiny_engine.position == position
    # max_tokens inside what a pass would keep.
    for limit in (1, 2, 37, 38, 39):
        few = SamplingParams(temperature=0.0, max_tokens=limit)
        assert run(tiny_engine, PROMPT, few, 6) == (plain[:limit], StopReason.MAX_TOKENS)
    # The cache's end.
    small = ReferenceEngine(TINY, RandomWeights(TINY, seed=3), ctx=len(PROMPT) + 45)
    unlimited = SamplingParams(temperature=0.0)
    plain_full = run(small, PROMPT, unlimited, 0)
    assert plain_full[1] == StopReason.CONTEXT_FULL
    assert run(small, PROMPT, unlimited, 6) == plain_full
    assert small.position == small.capacity


def test_adaptive_k_pauses_after_fruitless_passes_longer_each_time_until_one_pays():
    adapt = AdaptiveK(7)
    assert adapt.ready()
    adapt.update(7, 0)
    assert adapt.ready() and adapt.k == 1  # 7 proposals: too few to judge by
    adapt.update(1, 0)  # none of 8 kept: pause
    assert adapt.k == 1
    first = AdaptiveK.FIRST_PAUSE
    assert [adapt.ready() for _ in range(first + 1)] == [False] * first + [True]
    adapt.update(1, 0)  # the probe fails: at once a pause twice as long
    assert [adapt.ready() for _ in range(2 * first + 1)] == [False] * 2 * first + [True]
    adapt.update(1, 0)
    assert [adapt.ready() for _ in range(4 * first + 1)] == [False] * 4 * first + [True]
    adapt.update(1, 1)  # one pays: back to the first pause, k grows again
    assert adapt.pause == AdaptiveK.FIRST_PAUSE and adapt.k == 2
    adapt.update(2, 2)
    adapt.update(3, 0)
    adapt.update(1, 0)
    assert adapt.ready()  # (3 kept of 7 proposed in the window: no pause)
    adapt.update(2, 0)
    assert adapt.ready()  # (2 kept of 8: a quarter, no pause)
    adapt.update(1, 0)  # none of the last 7 kept: pause, as long as the first again
    assert [adapt.ready() for _ in range(first + 1)] == [False] * first + [True]


def test_adaptive_k_pauses_when_passes_give_fewer_tokens_than_their_cost():
    """A pass costs PASS_COST plain steps and each proposal `proposal_cost`: speculation goes
    on while its passes give more tokens than that cost would have decoded plainly."""
    lookup = AdaptiveK(7)  # free proposals
    lookup.update(7, 1)
    lookup.update(2, 0)  # 3 tokens from 2 passes (2.5 steps), 1 of 9 proposals kept
    assert lookup.ready()
    drafted = AdaptiveK(7, proposal_cost=0.5)  # a draft half the model's size
    drafted.update(7, 1)
    drafted.update(2, 0)  # the same 3 tokens cost 2.5 + 4.5 steps: pause
    assert not drafted.ready()
    small = AdaptiveK(7, proposal_cost=0.05)  # a draft a twentieth of the model
    small.update(7, 1)
    small.update(2, 0)  # 3 tokens for 2.95 steps: on
    assert small.ready()
    # A step's cost has a floor that does not shrink with the model: Qwen3-0.6B drafts for
    # 8B at a quarter of its step (H100), for 32B at under a tenth, for itself at one.
    assert draft_cost(596_049_920, 8_190_735_360) == pytest.approx(0.25, abs=0.01)
    assert draft_cost(596_049_920, 32_762_123_264) < 0.1
    assert draft_cost(10**9, 10**9) == 1.0


def test_a_draft_that_never_agrees_costs_few_passes(tiny_engine):
    # A draft whose argmax is never the target's: after the first fruitless passes
    # speculation pauses, longer each time, so most of the reply decodes plainly.
    class Contrary:
        def start(self, context):
            pass

        def extend(self, tokens):
            pass

        def propose(self, k, params, seed, step):
            row = tiny_engine.last_logits()  # the target's own next token, then avoided
            return [(int(np.argmax(row)) + 1) % 96] * k, None

    greedy = SamplingParams(temperature=0.0, max_tokens=300)
    plain, _ = run(tiny_engine, PROMPT, greedy, 0)
    tiny_engine.truncate(0)
    tiny_engine.prefill(PROMPT)
    reply = list(tiny_engine.generate(GenerateRequest(LiveParams(greedy), frozenset(), seed=5,
                                                      speculate=7, proposer=Contrary())))
    stats = tiny_engine.speculation
    assert reply == plain and stats.accepted == 0
    # Two passes (7 + 1 proposals), then one probe after each pause of 16, 32, 64 and 128
    # steps: 6 passes in 300 steps.
    assert stats.passes <= 6


def test_adaptive_k_grows_after_full_passes_and_shrinks_to_what_was_kept():
    adapt = AdaptiveK(5)
    adapt.update(5, 1)
    assert adapt.k == 2
    adapt.update(2, 2)
    assert adapt.k == 3
    adapt.update(3, 0)
    assert adapt.k == 1
    for _ in range(9):
        adapt.update(adapt.k, adapt.k)
    assert adapt.k == 5
    with pytest.raises(ValueError, match="at least 1"):
        AdaptiveK(0)


# ------------------------------------------------------------------ a draft model's proposals
def run_draft(engine: ReferenceEngine, draft: ReferenceEngine, params: SamplingParams,
              seed: int = 5) -> list[int]:
    engine.truncate(0)
    engine.prefill(PROMPT)
    proposer = DraftProposer(draft, engine.config.vocab_size)
    return list(engine.generate(GenerateRequest(LiveParams(params), frozenset(), seed=seed,
                                                speculate=4, proposer=proposer)))


def test_greedy_with_a_draft_model_is_plain_greedy(tiny_engine):
    greedy = SamplingParams(temperature=0.0, max_tokens=80)
    plain, _ = run(tiny_engine, PROMPT, greedy, 0)
    position = tiny_engine.position
    other = ReferenceEngine(TINY, RandomWeights(TINY, seed=4), ctx=512)  # a poor draft
    assert run_draft(tiny_engine, other, greedy) == plain
    assert tiny_engine.position == position and tiny_engine.speculation.passes > 0
    # The draft's cache follows the reply: before the last pass's proposals (at most 3 of the
    # 4 ran through it), it holds the reply's own tokens.
    held = len(other.tokens) - 3
    assert held > len(PROMPT) and other.tokens[:held] == (PROMPT + plain)[:held]
    same = ReferenceEngine(TINY, RandomWeights(TINY, seed=3), ctx=512)  # the target itself
    assert run_draft(tiny_engine, same, greedy) == plain
    stats = tiny_engine.speculation
    assert stats.accepted == stats.proposed  # its argmax is the target's every time


def test_a_greedy_draft_proposes_through_its_own_decode_path(tiny_engine):
    """Greedy proposals come from the draft engine's generate (its megakernel on the GPU), one
    call a pass, and are what draft_token's argmax gives; with presence or frequency
    penalties (over the reply so far) it drafts a token at a time instead."""
    draft = ReferenceEngine(TINY, RandomWeights(TINY, seed=4), ctx=512)
    calls = []
    original = draft.generate
    draft.generate = lambda request: calls.append(request) or original(request)
    proposer = DraftProposer(draft, TINY.vocab_size)
    proposer.start(PROMPT)
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.1)
    proposal, q = proposer.propose(4, greedy, 0, 0)
    assert q is None and len(proposal) == 4 and len(calls) == 1
    expected, tokens = [], list(PROMPT)
    reference = ReferenceEngine(TINY, RandomWeights(TINY, seed=4), ctx=512)
    reference.prefill(tokens)
    for i in range(4):
        token, _ = draft_token(reference.last_logits(), greedy, 0, i, tokens, Counter())
        expected.append(token)
        tokens.append(token)
        reference.prefill([token])
    assert proposal == expected
    proposer.propose(3, SamplingParams(temperature=0.0, presence_penalty=0.5), 0, 0)
    assert len(calls) == 1


def test_sampling_with_a_draft_is_repeatable_and_keeps_what_a_perfect_draft_proposes(
        tiny_engine):
    sampled = SamplingParams(temperature=0.9, top_k=8, top_p=0.95, max_tokens=60)
    other = ReferenceEngine(TINY, RandomWeights(TINY, seed=4), ctx=512)
    first = run_draft(tiny_engine, other, sampled, seed=11)
    assert len(first) == 60
    assert run_draft(tiny_engine, other, sampled, seed=11) == first
    same = ReferenceEngine(TINY, RandomWeights(TINY, seed=3), ctx=512)
    run_draft(tiny_engine, same, sampled, seed=11)
    stats = tiny_engine.speculation
    # q = p (up to the batched pass's rounding): min(1, p/q) keeps (nearly) every proposal.
    assert stats.passes > 0 and stats.accepted >= 0.95 * stats.proposed


def test_a_draft_with_another_vocabulary_is_refused_in_one_line(tiny_engine):
    wide = Qwen3Config.from_dict(tiny_config(vocab_size=128))
    draft = ReferenceEngine(wide, RandomWeights(wide), ctx=64)
    with pytest.raises(UsageError, match="vocabulary has 128 tokens and the model's 96"):
        DraftProposer(draft, tiny_engine.config.vocab_size)


def test_a_drafted_reply_is_distributed_as_a_plain_one(tiny_engine):
    # The second and third tokens of a reply (the first is drawn before any pass) over 1,500
    # seeds, sampled with a poor draft and plainly: each (token, position) share agrees within
    # 5 standard errors of the difference (a correct rule fails this for a fresh choice of
    # seeds with probability about 1e-4, over the ~20 cells).
    params = SamplingParams(temperature=1.0, top_k=4, top_p=1.0, max_tokens=3)
    other = ReferenceEngine(TINY, RandomWeights(TINY, seed=4), ctx=512)
    n = 1_500
    plain, drafted = Counter(), Counter()
    prompt = [7, 8, 9, 10]
    for seed in range(n):
        for counter, kwargs in ((plain, {}), (drafted, {"speculate": 2, "proposer":
                                                         DraftProposer(other, 96)})):
            tiny_engine.truncate(0)
            tiny_engine.prefill(prompt)
            reply = list(tiny_engine.generate(GenerateRequest(
                LiveParams(params), frozenset(), seed=seed, **kwargs)))
            counter.update((i, t) for i, t in enumerate(reply) if i > 0)
    assert tiny_engine.speculation.passes > 0
    for cell in set(plain) | set(drafted):
        a, b = plain[cell] / n, drafted[cell] / n
        error = np.sqrt((a * (1 - a) + b * (1 - b)) / n)
        assert abs(a - b) <= 5 * max(error, 1 / n), (cell, a, b)


def test_speculation_switched_on_and_off_during_a_reply_changes_only_the_passes(tiny_engine):
    greedy = SamplingParams(temperature=0.0, max_tokens=150)
    plain, _ = run(tiny_engine, PROMPT, greedy, 0)
    assert tiny_engine.speculation.passes == 0  # off: the plain loop's steps
    tiny_engine.truncate(0)
    tiny_engine.prefill(PROMPT)
    request = GenerateRequest(LiveParams(greedy), frozenset(), seed=5)
    reply, passes_at = [], {}
    for token in tiny_engine.generate(request):
        reply.append(token)
        if len(reply) == 30:
            request.speculate = 7  # switched on
        if len(reply) == 100:
            passes_at[100] = tiny_engine.speculation.passes
            request.speculate = 0  # and off again
    assert reply == plain
    assert passes_at[100] > 0 and tiny_engine.speculation.passes == passes_at[100]


def test_verify_draws_with_the_engines_own_sampler():
    """The CUDA engine verifies with the GPU sampler's draw (sample_token_gpu), which picks
    other tokens than sample_token for the same uniform number: one-hot proposals drawn by it
    are all kept with it, and the token after them is its draw too."""
    from qwenchat.sampling.sampler import sample_token_gpu

    rng = np.random.default_rng(4)
    params = SamplingParams(temperature=0.8, top_k=30, top_p=0.9, presence_penalty=0.4)
    logits = rng.standard_normal((6, 500)).astype(np.float32)
    context, counts = [3, 4, 5], Counter({7: 1})
    drawn, running = [], Counter(counts)
    for i in range(6):
        drawn.append(sample_token_gpu(logits[i], params, 11, 20 + i, context, running))
        running[drawn[-1]] += 1
    assert verify(logits, drawn[:5], params, 11, 20, context, counts,
                  sample=sample_token_gpu) == drawn
    cpu = verify(logits, drawn[:5], params, 11, 20, context, counts)
    assert cpu != drawn  # (the two rules part on this data: the choice of rule matters)


class RunAheadEngine(ReferenceEngine):
    """The reference engine with a decode that "runs ahead" as the megakernel's does: after
    each plain step it reports tokens under way until `ahead` more plain steps were taken,
    and records the plain runs the loop plans."""

    def __init__(self, *args, ahead: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.ahead, self.pending, self.plans, self.proposed_while_pending = ahead, 0, [], 0

    def _plain_pending(self) -> bool:
        return self.pending > 0

    def _plan_plain(self, steps):
        self.plans.append(steps)

    def _next_token(self, fed, params, seed, step):
        self.pending = max(0, self.pending - 1) if self.pending else self.ahead
        return super()._next_token(fed, params, seed, step)

    def _speculative_pass(self, fed, proposal, params, seed, step, draft_probs):
        self.proposed_while_pending += self.pending > 0
        return super()._speculative_pass(fed, proposal, params, seed, step, draft_probs)


def test_the_loop_plans_plain_runs_and_waits_for_tokens_under_way():
    """The reply loop tells the engine how many plain steps come before a pass may (one while
    speculating, the rest of a pause, no bound while speculation is off), and proposes nothing
    while plain tokens are still under way; the reply is plain decoding's all the same."""
    greedy = SamplingParams(temperature=0.0, max_tokens=120)
    plain, _ = run(ReferenceEngine(TINY, RandomWeights(TINY, seed=3), ctx=512), PROMPT, greedy, 0)
    engine = RunAheadEngine(TINY, RandomWeights(TINY, seed=3), ctx=512, ahead=2)
    fast, _ = run(engine, PROMPT, greedy, 6)
    assert fast == plain and engine.speculation.passes > 0
    assert engine.proposed_while_pending == 0
    assert set(engine.plans) <= {1} | set(range(2, AdaptiveK.LONGEST_PAUSE + 2))
    assert 1 in engine.plans
    engine.plans.clear()
    assert run(engine, PROMPT, greedy, 0)[0] == plain  # speculation off: no bound
    assert engine.plans and set(engine.plans) == {None}
    # A draft that never agrees pauses speculation: a plan covers the rest of the pause.
    never = RunAheadEngine(TINY, RandomWeights(TINY, seed=3), ctx=512)
    never.truncate(0)
    never.prefill(PROMPT)
    request = GenerateRequest(LiveParams(greedy), frozenset(), seed=5, speculate=6,
                              proposer=NeverAgrees())
    assert list(never.generate(request)) == plain
    assert max(p for p in never.plans if p is not None) >= AdaptiveK.FIRST_PAUSE
    # ... and probes after it, though its plain steps run ahead (tokens under way at most
    # steps of the pause): two passes, then one within `ahead` steps of each pause's end.
    ahead = RunAheadEngine(TINY, RandomWeights(TINY, seed=3), ctx=512, ahead=2)
    ahead.truncate(0)
    ahead.prefill(PROMPT)
    request = dataclasses.replace(request, proposer=NeverAgrees())
    assert list(ahead.generate(request)) == plain
    assert never.speculation.passes >= 5
    assert ahead.speculation.passes >= never.speculation.passes - 1
    assert ahead.proposed_while_pending == 0


class NeverAgrees:
    """Proposes tokens the tiny model's greedy reply never has next (one-hot)."""

    def start(self, context):
        self.last = context[-1]

    def extend(self, tokens):
        self.last = tokens[-1]

    def propose(self, k, params, seed, step):
        return [(self.last + 1 + i) % TINY.vocab_size for i in range(k)], None

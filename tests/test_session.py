"""The chat session: KV-cache reuse across turns, events, cancel, dropping turns to fit."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
from fake_engine import FakeEngine

from qwenchat.engine.reference import ReferenceEngine
from qwenchat.errors import ContextFullError, UsageError
from qwenchat.model.config import Qwen3Config
from qwenchat.model.loader import open_model_dir
from qwenchat.model.tokenizer import Message, Tokenizer
from qwenchat.sampling.params import LiveParams, SamplingParams
from qwenchat.session import ChatSession, Progress, TextPiece, TurnsDropped


def new_session(model_dir, ctx=None, max_tokens=12, system="Be brief.") -> ChatSession:
    model = open_model_dir(model_dir)
    engine = ReferenceEngine(model.config, model.checkpoint, ctx)
    params = LiveParams(SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return ChatSession(engine, model.tokenizer, model.eos_ids, params, system=system)


def run_turn(session: ChatSession, text: str, cancel=None):
    events = list(session.send(text, cancel))
    answer = "".join(e.text for e in events if isinstance(e, TextPiece) and e.kind == "answer")
    final = [e for e in events if isinstance(e, Progress) and e.final]
    assert len(final) == 1
    return answer, final[0].stats, events


def test_reply_text_is_the_decode_of_the_generated_tokens(tiny_model_dir):
    session = new_session(tiny_model_dir)
    prompt_len = len(session.tokenizer.encode_chat(
        [Message("system", "Be brief."), Message("user", "Hello")], enable_thinking=False))
    answer, stats, _ = run_turn(session, "Hello")
    generated = session.engine.tokens[prompt_len:]
    # the last sampled token is never fed back, so the cache holds all but one
    assert stats.generated_tokens == len(generated) + 1
    assert answer.startswith(session.tokenizer.decode(generated))
    assert session.messages[-1] == Message("assistant", answer)


def test_second_turn_prefills_only_what_differs_from_the_cache(tiny_model_dir):
    session = new_session(tiny_model_dir)
    run_turn(session, "Hello")
    cached = session.engine.tokens
    _, stats, _ = run_turn(session, "And again?")
    rendered = session.tokenizer.encode_chat(
        session.context_messages()[:-1], enable_thinking=False)
    common = next(i for i, (a, b) in enumerate(zip(cached, rendered, strict=False)) if a != b)
    assert stats.reused_tokens == common > 0
    assert stats.prefill_tokens == stats.prompt_tokens - common
    assert stats.prompt_tokens == len(rendered)


def test_reused_cache_gives_the_same_reply_as_a_fresh_session(tiny_model_dir):
    session = new_session(tiny_model_dir)
    run_turn(session, "Hello")
    reused_answer, stats, _ = run_turn(session, "Tell me more")
    assert stats.reused_tokens > 0
    fresh = new_session(tiny_model_dir)
    fresh.messages = session.messages[:-1]
    fresh.messages.pop()  # replay the last user turn on a cold cache
    fresh_answer, fresh_stats, _ = run_turn(fresh, "Tell me more")
    assert fresh_stats.reused_tokens == 0
    assert fresh_answer == reused_answer


def test_cancel_keeps_the_partial_reply_and_a_consistent_cache(tiny_model_dir):
    session = new_session(tiny_model_dir, max_tokens=40)
    cancel = threading.Event()
    seen = []
    for event in session.send("Hello", cancel):
        if isinstance(event, TextPiece):
            seen.append(event.text)
            if len(seen) == 3:
                cancel.set()
        if isinstance(event, Progress) and event.final:
            stats = event.stats
    assert stats.stop_reason == "cancelled"
    assert session.messages[-1].role == "assistant"
    assert session.last_reply.stopped
    assert session.engine.position == len(session.engine.tokens)
    # the next turn behaves exactly as on a fresh session with the same history
    answer, _, _ = run_turn(session, "Continue")
    fresh = new_session(tiny_model_dir, max_tokens=40)
    fresh.messages = session.messages[:-2]
    fresh_answer, _, _ = run_turn(fresh, "Continue")
    assert answer == fresh_answer


def test_abandoned_stream_is_recorded_as_stopped(tiny_model_dir):
    session = new_session(tiny_model_dir, max_tokens=40)
    stream = session.send("Hello")
    next(e for e in stream if isinstance(e, TextPiece))
    stream.close()  # what Ctrl+C in the consumer does
    assert session.last_reply.stats.stop_reason == "cancelled"
    assert [m.role for m in session.messages] == ["user", "assistant"]


def test_oldest_turns_are_dropped_with_a_notice_and_the_system_prompt_kept(tiny_model_dir):
    session = new_session(tiny_model_dir, ctx=96, max_tokens=8)
    dropped_events = []
    for i in range(8):
        _, _, events = run_turn(session, f"Question number {i} about the fox and the dog")
        dropped_events += [e for e in events if isinstance(e, TurnsDropped)]
    assert dropped_events and "dropped" in dropped_events[0].message
    context = session.context_messages()
    assert context[0] == Message("system", "Be brief.")
    assert context[1].role == "user" and session.first_in_context > 0
    assert len(session.messages) == 16  # the history itself is kept whole


def test_a_prompt_longer_than_the_context_is_an_error_that_changes_nothing(tiny_model_dir):
    session = new_session(tiny_model_dir, ctx=64)
    with pytest.raises(ContextFullError, match="context holds 64"):
        run_turn(session, "fox " * 200)
    assert session.messages == []
    answer, _, _ = run_turn(session, "Hi")
    assert session.messages[-1] == Message("assistant", answer)


def test_empty_prompt_is_refused(tiny_model_dir):
    session = new_session(tiny_model_dir)
    with pytest.raises(UsageError, match="empty"):
        list(session.send("   "))


def test_regenerate_replaces_the_last_reply(tiny_model_dir):
    session = new_session(tiny_model_dir)
    first, _, _ = run_turn(session, "Hello")
    again = "".join(e.text for e in session.regenerate() if isinstance(e, TextPiece))
    assert again == first  # greedy: the same answer, now from a reused cache
    assert [m.role for m in session.messages] == ["user", "assistant"]


def test_stats_report_timings_and_kv_position(tiny_model_dir):
    session = new_session(tiny_model_dir, max_tokens=10)
    _, stats, _ = run_turn(session, "Hello")
    assert stats.stop_reason in ("max_tokens", "eos")
    assert stats.ttft_s is not None and stats.ttft_s >= stats.prefill_s > 0
    assert stats.position == session.engine.position
    assert stats.capacity == session.engine.capacity
    if stats.generated_tokens > 1:
        assert stats.decode_tok_s and stats.decode_tok_s > 0


# --------------------------------------------------- the history prefilled between turns
QWEN3_VOCAB = 151_936


def real_template_session(real_tokenizer_dir, tiny_model_dir, thinking: bool,
                          reply: str) -> ChatSession:
    """A session with Qwen3's own tokenizer and chat template over a scripted engine, whose
    cache records exactly the tokens the model would have been given."""
    tokenizer = Tokenizer(real_tokenizer_dir)
    config = dataclasses.replace(Qwen3Config.from_file(tiny_model_dir / "config.json"),
                                 vocab_size=QWEN3_VOCAB)
    script = [*tokenizer.encode(reply), tokenizer.im_end_id]
    engine = FakeEngine(config, script, capacity=8192)
    eos = frozenset({tokenizer.im_end_id, tokenizer.end_of_text_id})
    params = LiveParams(SamplingParams(temperature=0.0))
    return ChatSession(engine, tokenizer, eos, params, system="Be brief.", thinking=thinking)


def turn_header(thinking: bool, text: str) -> str:
    """What Qwen3's template adds for one more user message and the reply's start."""
    start = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return start if thinking else start + "<think>\n\n</think>\n\n"


@pytest.mark.parametrize("thinking", [False, True], ids=["non-thinking", "thinking"])
def test_after_the_background_prefill_a_turn_prefills_only_its_own_message(
        real_tokenizer_dir, tiny_model_dir, thinking):
    reply = ("<think>\nThe user wants a fox fact.\n</think>\n\nFoxes are quick." if thinking
             else "Foxes are quick.")
    session = real_template_session(real_tokenizer_dir, tiny_model_dir, thinking, reply)
    tokenizer, engine = session.tokenizer, session.engine
    run_turn(session, "Tell me about foxes.")
    for n in range(1, 5):
        # Right after a reply the cache holds the reply as generated, think block and all;
        # the template renders earlier replies without it.
        history = session.history_ids()
        assert engine.tokens[: len(history)] != history
        assert session.prepare_next_turn(threading.Event()) > 0
        assert engine.tokens == history
        text = f"And fact number {n}?"
        _, stats, _ = run_turn(session, text)
        sent = session.context_messages()[:-1]
        rendered = tokenizer.encode_chat(sent, thinking)
        # Only the new message and the template's own tokens around it were prefilled ...
        assert stats.reused_tokens == len(history)
        assert stats.prefill_tokens == stats.prompt_tokens - len(history)
        new = rendered[len(history):]
        assert tokenizer.decode(new, skip_special_tokens=False) == turn_header(thinking, text)
        # ... and the model saw, token for token, what the template renders for the history,
        assert engine.tokens[: len(rendered)] == rendered
        # which is what a fresh session given the same history sees.
        fresh = real_template_session(real_tokenizer_dir, tiny_model_dir, thinking, reply)
        fresh.messages = list(sent[1:-1])  # without the system prompt and the new message
        _, fresh_stats, _ = run_turn(fresh, text)
        assert fresh_stats.reused_tokens == 0
        assert fresh.engine.tokens[: len(rendered)] == rendered


def test_a_background_prefill_stopped_midway_is_resumed_by_the_next_turn(
        real_tokenizer_dir, tiny_model_dir):
    session = real_template_session(real_tokenizer_dir, tiny_model_dir, False,
                                    "A long answer about foxes. " * 40)
    run_turn(session, "Tell me about foxes.")
    history = session.history_ids()
    cancel = threading.Event()
    steps = []
    prefill = session.engine.prefill

    def one_step_then_cancel(ids):
        steps.append(len(ids))
        prefill(ids)
        cancel.set()  # the user sends while the first step runs

    session.engine.prefill = one_step_then_cancel
    done = session.prepare_next_turn(cancel)
    session.engine.prefill = prefill
    partial = session.engine.tokens
    assert len(steps) == 1 and done == steps[0]
    assert len(partial) < len(history) and partial == history[: len(partial)]
    _, stats, _ = run_turn(session, "More?")
    assert stats.reused_tokens == len(partial)  # the rest of the history is prefilled now
    rendered = session.tokenizer.encode_chat(session.context_messages()[:-1], False)
    assert session.engine.tokens[: len(rendered)] == rendered


def test_no_background_prefill_for_a_history_the_next_turn_must_shorten(tiny_model_dir):
    session = new_session(tiny_model_dir, ctx=96, max_tokens=8)
    for i in range(2):
        run_turn(session, f"Question number {i} about the fox and the dog")
    # A reply of up to 48 tokens leaves no room for this history: the next turn will drop
    # its oldest turns, so it will not start with the history as it stands.
    session.params.set(SamplingParams(temperature=0.0, max_tokens=48))
    assert len(session.history_ids()) + 48 > 96
    cached = session.engine.tokens
    assert session.prepare_next_turn(threading.Event()) == 0
    assert session.engine.tokens == cached


def test_an_empty_chat_leaves_the_cache_as_it_is(tiny_model_dir):
    session = new_session(tiny_model_dir, system=None)
    run_turn(session, "Hello")
    cached = session.engine.tokens
    session.clear()
    assert session.history_ids() == []
    assert session.prepare_next_turn(threading.Event()) == 0
    assert session.engine.tokens == cached


def test_the_shared_prefix_of_two_token_lists_is_found_exactly():
    from qwenchat.model.tokenizer import shared_prefix_length

    def by_hand(a, b):
        pairs = enumerate(zip(a, b, strict=False))
        return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))

    rng = np.random.default_rng(0)
    for _ in range(2000):
        a = rng.integers(0, 3, rng.integers(0, 40)).tolist()
        b = a[: rng.integers(0, len(a) + 1)] + rng.integers(0, 3, rng.integers(0, 6)).tolist()
        assert shared_prefix_length(a, b) == shared_prefix_length(b, a) == by_hand(a, b)


# ------------------------------------------------------------ a long prompt's prefill
def scripted_session(tiny_model_dir, **engine_options) -> ChatSession:
    from fake_engine import fake_model

    model = fake_model(tiny_model_dir, "Fine.", **engine_options)
    params = LiveParams(SamplingParams(temperature=0.0, max_tokens=8))
    return ChatSession(model.engine, model.tokenizer, model.eos_ids, params)


def test_a_long_prefill_reports_its_progress_in_the_engines_passes(tiny_model_dir, monkeypatch):
    monkeypatch.setattr("qwenchat.session.PREFILL_STEP_S", 0.0)  # (a pass a call)
    monkeypatch.setattr("qwenchat.session.PREFILL_REPORT_AFTER_S", 0.02)
    monkeypatch.setattr("qwenchat.session.PROGRESS_INTERVAL_S", 0.0)
    session = scripted_session(tiny_model_dir, capacity=8192)
    engine = session.engine
    engine.prefill_chunk, engine.prefill_s_per_token = 50, 2e-4  # 10 ms a pass
    calls = []
    real_prefill = engine.prefill
    monkeypatch.setattr(engine, "prefill", lambda ids: (calls.append(len(ids)), real_prefill(ids)))
    progress = []  # snapshots: the session keeps updating its one ReplyStats
    for event in session.send("word " * 300):
        if isinstance(event, Progress):
            progress.append(dataclasses.replace(event.stats))
    stats = progress[-1]
    during = [(s.prefill_done, s.generated_tokens) for s in progress[:-1]
              if s.generated_tokens == 0]
    total = stats.prefill_tokens
    # the prompt ran in the engine's passes, the last one shorter
    assert calls[:-1] == [50] * (len(calls) - 1) and sum(calls) == total > 300
    # reports began after the threshold, named tokens done so far, and rose pass by pass
    done = [d for d, _ in during]
    assert done and all(0 < d < total for d in done)
    assert done == sorted(set(done)) and all(d % 50 == 0 for d in done)
    first = next(s for s in progress if s.generated_tokens == 0)
    assert first.prefill_s >= 0.02  # not before the threshold
    assert stats.prefill_done == total and stats.generated_tokens > 0


def test_a_prefills_calls_take_as_many_passes_as_the_engine_ran_in_a_step_last_time(
        tiny_model_dir, monkeypatch):
    """One pass first; then calls of about PREFILL_STEP_S at the rate measured (whole passes),
    and the next prompt starts at that size: each call ends in a synchronization and the last
    position's logits, so a GPU's short prompt in one call answers sooner than in passes."""
    monkeypatch.setattr("qwenchat.session.PREFILL_STEP_S", 0.05)
    session = scripted_session(tiny_model_dir, capacity=8192)
    engine = session.engine
    engine.prefill_chunk, engine.prefill_s_per_token = 50, 2e-4  # 10 ms a pass: 5 in 50 ms
    calls = []
    real_prefill = engine.prefill
    monkeypatch.setattr(engine, "prefill", lambda ids: (calls.append(len(ids)), real_prefill(ids)))
    run_turn(session, "word " * 600)
    total = session.last_reply.stats.prefill_tokens
    assert calls[0] == 50 and sum(calls) == total > 600
    assert all(c % 50 == 0 for c in calls[:-1]) and 50 < calls[1] <= 250, calls
    calls.clear()
    run_turn(session, "more " * 300)
    assert 50 < calls[0] <= 250, calls  # (the rate is the engine's, not the turn's)


def test_a_short_prefill_reports_nothing_before_the_reply(tiny_model_dir):
    session = scripted_session(tiny_model_dir)
    before_reply = []
    for event in session.send("Hello"):
        if isinstance(event, Progress) and event.stats.generated_tokens == 0:
            before_reply.append(event)
    assert before_reply == []
    assert session.last_reply.stats.prefill_done == session.last_reply.stats.prefill_tokens > 0


def test_cancel_stops_a_long_prefill_between_passes_and_keeps_the_chat_consistent(
        tiny_model_dir, monkeypatch):
    monkeypatch.setattr("qwenchat.session.PREFILL_STEP_S", 0.0)  # (a pass a call)
    monkeypatch.setattr("qwenchat.session.PREFILL_REPORT_AFTER_S", 0.0)
    session = scripted_session(tiny_model_dir, capacity=8192)
    engine = session.engine
    engine.prefill_chunk, engine.prefill_s_per_token = 40, 1e-4
    cancel = threading.Event()
    events = []
    for event in session.send("word " * 400, cancel):
        events.append(event)
        if isinstance(event, Progress) and not event.final and event.stats.prefill_done >= 120:
            cancel.set()
    final = events[-1]
    assert isinstance(final, Progress) and final.final
    stats = final.stats
    # stopped after the pass under way: nothing generated, the prefix that ran stays cached
    assert stats.stop_reason == "cancelled" and stats.generated_tokens == 0
    assert 120 <= stats.prefill_done < stats.prefill_tokens
    assert engine.position == stats.prefill_done == stats.position
    assert not [e for e in events if isinstance(e, TextPiece)]
    assert session.messages[-1] == Message("assistant", "") and session.last_reply.stopped
    # the next turn reuses what ran and answers as a fresh session would
    answer, again, _ = run_turn(session, "Hello")
    assert again.reused_tokens >= stats.prefill_done - 1 and answer == "Fine."

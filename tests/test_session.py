"""The chat session: KV-cache reuse across turns, events, cancel, dropping turns to fit."""

from __future__ import annotations

import threading

import pytest

from qwenchat.engine.reference import ReferenceEngine
from qwenchat.errors import ContextFullError, UsageError
from qwenchat.model.loader import open_model_dir
from qwenchat.model.tokenizer import Message
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

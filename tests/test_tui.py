"""The chat UI, driven with Textual's Pilot on the tiny reference model and a scripted engine."""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from fake_engine import fake_model
from textual import events
from textual._xterm_parser import XTermParser
from textual.command import CommandPalette
from textual.geometry import Region
from textual.widgets import Footer, Input, Markdown, OptionList, Switch
from textual.widgets._toast import Toast

from qwenchat.engine.reference import ReferenceEngine
from qwenchat.errors import ModelError
from qwenchat.model import rope
from qwenchat.model.loader import open_model_dir
from qwenchat.model.tokenizer import Message
from qwenchat.sampling.params import LiveParams, SamplingParams
from qwenchat.session import ChatSession, TextPiece
from qwenchat.store import ChatStore
from qwenchat.tui.app import QwenchatApp
from qwenchat.tui.loader import LoadedModel, _engine_text
from qwenchat.tui.options import ChatOptions
from qwenchat.tui.quiet_gc import NEVER
from qwenchat.tui.screens.chat import ChatScreen
from qwenchat.tui.screens.chats import ChatListScreen
from qwenchat.tui.screens.error import ErrorScreen
from qwenchat.tui.screens.help import HelpScreen
from qwenchat.tui.screens.loading import LoadingScreen
from qwenchat.tui.stats import RateMeter, kv_level, rate_text
from qwenchat.tui.widgets.message import AssistantMessage, UserMessage
from qwenchat.tui.widgets.notice import ChatNotice
from qwenchat.tui.widgets.status import KVGauge
from qwenchat.tui.widgets.thinking import ThinkingBlock

SIZE = (100, 32)
REPLY = "The fox is **quick**.\n\n```python\nprint('fox')\n```\n\nThat is all."
THOUGHT_REPLY = "<think>\nThe user asks about foxes.\n</think>\n\nFoxes are quick."


# --------------------------------------------------------------------------------- helpers
def reference_model(model_dir: Path, ctx: int | None = None) -> LoadedModel:
    model = open_model_dir(model_dir, "tiny-qwen3")
    engine = ReferenceEngine(model.config, model.checkpoint, ctx)
    return LoadedModel(model.spec, model.directory, engine, model.tokenizer, model.eos_ids)


def make_app(tmp_path: Path, model: LoadedModel, **options) -> QwenchatApp:
    """The app on `model`, its history in tmp_path (never the user's data dir)."""
    return QwenchatApp(ChatOptions("tiny-qwen3", **options),
                       loader=lambda *reports: model, history=tmp_path / "history.sqlite3")


def chat_ready(app: QwenchatApp) -> bool:
    """The chat screen is up and takes keys: mounted, with the prompt focused.

    `app.screen` is the chat screen as soon as the switch to it begins, before its widgets
    are mounted and the prompt has the focus: a key pressed then is lost.
    """
    screen = app.screen
    return isinstance(screen, ChatScreen) and screen.is_mounted and app.focused is screen.prompt


def drive(app: QwenchatApp, scenario, size=SIZE, notifications: bool = False) -> None:
    """Run the app headless until the chat screen is up, then play `scenario(pilot, screen)`;
    `notifications` shows toasts, as a terminal does (headless runs leave them out)."""
    async def main() -> None:
        async with app.run_test(size=size, notifications=notifications) as pilot:
            await until(pilot, lambda: chat_ready(app))
            await scenario(pilot, app.screen)

    asyncio.run(main())


async def until(pilot, condition, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the UI")
        await pilot.pause(0.01)


async def send(pilot, screen: ChatScreen, text: str) -> None:
    """Type `text` in the prompt, press Enter and wait until the reply has ended."""
    screen.prompt.load_text(text)
    await press_and_wait_for_reply(pilot, screen, "enter")


async def press_and_wait_for_reply(pilot, screen: ChatScreen, key: str) -> None:
    before = screen.chat.session.last_reply
    await pilot.press(key)
    await until(pilot, lambda: screen.chat.session.last_reply is not before
                and not screen.generating)


async def settled(pilot, screen: ChatScreen) -> None:
    """Wait for the background prefill to end and the KV gauge to show the cache it left."""
    await until(pilot, lambda: not screen.chat.preparing)
    engine = screen.model.engine
    await until(pilot, lambda: screen.query_one(KVGauge).position == engine.position)


def replies(screen: ChatScreen) -> list[AssistantMessage]:
    return [t for t in screen.conversation.turns if isinstance(t, AssistantMessage)]


def stored(tmp_path: Path) -> list:
    with ChatStore(tmp_path / "history.sqlite3") as store:
        chats = store.list_chats()
        return [(chat, store.messages(chat.id)) for chat in chats]


def greedy_answer(model_dir: Path, turns: list[str], max_tokens: int) -> str:
    model = reference_model(model_dir)
    session = ChatSession(model.engine, model.tokenizer, model.eos_ids,
                          LiveParams(SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    answer = ""
    for text in turns:
        answer = "".join(e.text for e in session.send(text)
                         if isinstance(e, TextPiece) and e.kind == "answer")
    return answer


# ------------------------------------------------------------------------ send and stream
def test_send_streams_the_reply_as_markdown_and_saves_both_turns(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, reference_model(tiny_model_dir),
                   overrides={"temperature": 0.0, "max_tokens": 12})

    async def scenario(pilot, screen):
        await pilot.press(*"Hello")
        await press_and_wait_for_reply(pilot, screen, "enter")
        assert screen.prompt.text == ""
        [user, reply] = screen.conversation.turns
        assert isinstance(user, UserMessage) and user.text == "Hello"
        assert reply.answer == greedy_answer(tiny_model_dir, ["Hello"], 12)
        summary = str(reply.query_one(".summary").render())
        assert "12 tokens" in summary and "tok/s" in summary and "TTFT" in summary
        assert "stop: max tokens" in summary
        assert reply.query_one("Markdown").source == reply.answer

    drive(app, scenario)
    [(chat, messages)] = stored(tmp_path)
    assert chat.title == "Hello"
    assert [(m.role, m.stopped) for m in messages] == [("user", False), ("assistant", False)]
    assert messages[1].stats["generated_tokens"] == 12
    assert messages[1].stats["stop_reason"] == "max_tokens"


def test_prompt_lookup_in_the_chat_answers_as_without_it_and_counts_what_it_kept(
        tmp_path, tiny_model_dir):
    quote = "def add(a, b):\n    return a + b\n" * 3
    app = make_app(tmp_path, reference_model(tiny_model_dir), speculate="ngram",
                   overrides={"temperature": 0.0, "max_tokens": 40})

    async def scenario(pilot, screen):
        screen.prompt.text = f"Repeat this:\n{quote}"
        await press_and_wait_for_reply(pilot, screen, "enter")
        [_, reply] = screen.conversation.turns
        assert reply.answer == greedy_answer(tiny_model_dir, [f"Repeat this:\n{quote}"], 40)
        stats = screen.chat.session.last_reply.stats
        assert 0 < stats.spec_accepted <= stats.spec_proposed
        summary = str(reply.query_one(".summary").render())
        assert f"kept {stats.spec_accepted}/{stats.spec_proposed} proposed" in summary
        # The status bar: tokens a pass of the model gave, and the share of proposals kept.
        per_step = stats.generated_tokens / (stats.generated_tokens - stats.spec_accepted)
        numbers = str(screen.query_one("#numbers").render())
        assert f"{per_step:.2f} tok/step" in numbers and per_step > 1
        assert f"{stats.spec_accepted / stats.spec_proposed:.0%} kept" in numbers

    drive(app, scenario)


def test_second_turn_reuses_the_kv_cache_and_the_status_bar_says_so(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, reference_model(tiny_model_dir),
                   overrides={"temperature": 0.0, "max_tokens": 8})

    async def scenario(pilot, screen):
        await send(pilot, screen, "Hello")
        await send(pilot, screen, "And the dog?")
        assert replies(screen)[-1].answer == greedy_answer(
            tiny_model_dir, ["Hello", "And the dog?"], 8)
        stats = screen.chat.session.last_reply.stats
        assert stats.reused_tokens > 0
        numbers = str(screen.query_one("#numbers").render())
        assert f"{stats.reused_tokens} cached" in numbers and "TTFT" in numbers
        # (at 100 columns the engine label gives way to the numbers; hovering shows it whole)
        engine_label = screen.query_one("#engine")
        assert str(engine_label.render()) == "CPU · bf16"
        assert "reference (NumPy, CPU) · bf16 weights" in str(engine_label.tooltip)
        # Once the background prefill has brought the cache to the history, the gauge says so.
        await until(pilot, lambda: not screen.chat.preparing)
        history = screen.chat.session.history_ids()
        await until(pilot, lambda: screen.query_one(KVGauge).position == len(history))
        assert screen.model.engine.tokens == history

    drive(app, scenario)


def test_later_turns_prefill_only_the_new_message_after_the_background_prefill(
        tmp_path, tiny_model_dir):
    app = make_app(tmp_path, reference_model(tiny_model_dir),
                   overrides={"temperature": 0.0, "max_tokens": 8})

    async def scenario(pilot, screen):
        await send(pilot, screen, "Hello")
        await until(pilot, lambda: not screen.chat.preparing)
        history = screen.chat.session.history_ids()
        assert screen.chat.prepared_tokens > 0 and screen.model.engine.tokens == history
        await send(pilot, screen, "And the dog?")
        stats = screen.chat.session.last_reply.stats
        new_turn = screen.chat.session.tokenizer.encode_chat(
            screen.chat.session.context_messages()[:-1], enable_thinking=False)[len(history):]
        assert stats.reused_tokens == len(history)
        assert stats.prefill_tokens == len(new_turn)
        assert f"prompt {len(new_turn)} new + {len(history)} cached" in str(
            screen.query_one("#numbers").render())
        # The answer is the one a fresh engine gives to the whole conversation.
        assert replies(screen)[-1].answer == greedy_answer(
            tiny_model_dir, ["Hello", "And the dog?"], 8)

    drive(app, scenario)


def test_a_fast_long_reply_arrives_whole_in_order_and_its_stats_add_up(tmp_path,
                                                                        tiny_model_dir):
    # The fake engine delivers 2,000 tok/s in launches of 50, as the megakernel does. How much
    # of that rate the chat shows is a benchmark (tests/ui_rate.py), not asserted here.
    text = ("## Foxes\n\nThe fox is **quick** and the dog is *lazy*.\n\n```python\n"
            "def fox():\n    return 'quick'\n```\n\n- red\n- arctic\n\n")
    model = fake_model(tiny_model_dir, text, eos=False, rate=2000, launch_steps=50)
    script = model.engine.script
    tokens = 2000
    app = make_app(tmp_path, model, overrides={"max_tokens": tokens})
    thresholds = []
    begin_reply = model.engine._begin_reply

    def begin_reply_noting_the_gc(request):
        thresholds.append(gc.get_threshold())
        begin_reply(request)

    model.engine._begin_reply = begin_reply_noting_the_gc

    async def scenario(pilot, screen):
        screen.prompt.load_text("Foxes, at length.")
        await pilot.press("enter")
        await until(pilot, lambda: screen.chat.session.last_reply is not None
                    and not screen.generating, timeout=30)
        [reply] = replies(screen)
        expected = model.tokenizer.decode([script[i % len(script)] for i in range(tokens)])
        assert reply.answer == expected  # every token, in order
        stats = screen.chat.session.last_reply.stats
        assert stats.generated_tokens == tokens and stats.stop_reason == "max_tokens"
        assert stats.decode_tok_s == pytest.approx((tokens - 1) / stats.decode_s)
        assert stats.ttft_s >= stats.prefill_s >= 0
        assert stats.position == stats.prompt_tokens + tokens - 1
        shown = reply.query_one(".summary")
        await until(pilot, lambda: str(shown.render()) != "")  # written as the reply closes
        summary = str(shown.render())
        assert summary.startswith(f"{tokens:,} tokens · {rate_text(stats.decode_tok_s)} tok/s")
        thresholds.append(gc.get_threshold())

    before = gc.get_threshold()
    drive(app, scenario)
    # No full collection while the reply streamed; the usual thresholds once it ended.
    assert thresholds[0][2] == NEVER and thresholds[1] == before


def test_a_reply_follows_the_bottom_unless_the_user_scrolled_up(tmp_path, tiny_model_dir):
    model = fake_model(tiny_model_dir, "line\n\n" * 40, hold_at=60)
    app = make_app(tmp_path, model)

    async def scenario(pilot, screen):
        conversation = screen.conversation
        screen.prompt.load_text("Talk")
        await pilot.press("enter")
        await until(pilot, lambda: model.engine.holding.is_set())
        await pilot.pause(0.1)
        assert conversation.max_scroll_y > 0
        assert conversation.scroll_y == conversation.max_scroll_y
        for _ in range(3):  # the mouse wheel, as the user turns it
            conversation.post_message(events.MouseScrollUp(conversation, 1, 1, 0, -1, 0,
                                                           False, False, False))
        await pilot.pause(0.05)
        held = conversation.scroll_y
        assert held < conversation.max_scroll_y
        model.engine.release.set()
        await until(pilot, lambda: not screen.generating)
        await pilot.pause(0.05)
        assert conversation.scroll_y == held  # the user's place was kept

    drive(app, scenario)


# ------------------------------------------------------------------------------------ stop
def test_escape_stops_the_reply_keeping_the_partial_text_marked_stopped(tmp_path,
                                                                        tiny_model_dir):
    model = fake_model(tiny_model_dir, REPLY, hold_at=5)
    app = make_app(tmp_path, model)
    shown = model.tokenizer.decode(model.engine.script[:5])
    final = {}

    async def scenario(pilot, screen):
        screen.prompt.load_text("Tell me about the fox")
        await pilot.press("enter")
        await until(pilot, lambda: model.engine.holding.is_set())
        await until(pilot, lambda: replies(screen)[-1].answer == shown)
        await pilot.press("escape")
        await until(pilot, lambda: not screen.generating)
        reply = replies(screen)[-1]
        final["answer"] = reply.answer
        # the token in flight when Esc came may still land, as on a real engine
        assert reply.answer.startswith(shown) and len(reply.answer) < len(REPLY) // 2
        assert reply.has_class("-stopped")
        assert "■" in str(reply.query_one(".summary").render())
        engine = screen.model.engine
        assert engine.position == len(engine.tokens)
        assert screen.chat.session.messages[-1] == Message("assistant", reply.answer)
        # the next turn reuses the cache the stopped reply left behind
        model.engine.hold_at = None
        await send(pilot, screen, "Go on")
        assert screen.chat.session.last_reply.stats.reused_tokens > 0

    drive(app, scenario)
    [(_, messages)] = stored(tmp_path)
    assert (messages[1].content, messages[1].stopped) == (final["answer"], True)
    assert messages[1].stats["stop_reason"] == "cancelled"
    assert not messages[3].stopped


def test_a_long_prompt_shows_its_prefill_progress_and_escape_stops_it(tmp_path, tiny_model_dir,
                                                                      monkeypatch):
    monkeypatch.setattr("qwenchat.session.PREFILL_REPORT_AFTER_S", 0.05)
    model = fake_model(tiny_model_dir, REPLY)
    model.engine.prefill_chunk, model.engine.prefill_s_per_token = 50, 1e-3  # 50 ms a pass
    app = make_app(tmp_path, model)
    seen = {}

    async def scenario(pilot, screen):
        screen.prompt.load_text("word " * 1200)
        await pilot.press("enter")
        activity = screen.query_one("#activity")
        await until(pilot, lambda: "reading the prompt " in str(activity.render()))
        seen["activity"] = str(activity.render())
        seen["numbers"] = str(screen.query_one("#numbers").render())
        seen["footer_stop"] = any(
            active.binding.description == "Stop" and active.enabled
            for key, active in app.active_bindings.items() if key == "escape")
        await pilot.press("escape")
        await until(pilot, lambda: not screen.generating)
        reply = replies(screen)[-1]
        stats = screen.chat.session.last_reply.stats
        assert reply.answer == "" and reply.has_class("-stopped")
        assert stats.stop_reason == "cancelled" and stats.generated_tokens == 0
        assert 0 < stats.prefill_done < stats.prefill_tokens
        # the next turn runs as usual, reusing what the stopped prefill left in the cache
        await send(pilot, screen, "Hello")
        assert replies(screen)[-1].answer == REPLY
        assert screen.chat.session.last_reply.stats.reused_tokens > 0

    drive(app, scenario)
    done, total = seen["activity"].split("reading the prompt ")[1].split(" ")[0].split("/")
    assert 0 < int(done.replace(",", "")) < int(total.replace(",", ""))
    assert seen["footer_stop"]  # Esc's hint is the footer's, not the status bar's
    assert seen["numbers"].startswith("prefill ") and "tok/s" in seen["numbers"]
    [(_, messages)] = stored(tmp_path)
    assert (messages[1].content, messages[1].stopped) == ("", True)


def test_quitting_mid_reply_saves_it_as_stopped(tmp_path, tiny_model_dir):
    model = fake_model(tiny_model_dir, REPLY, hold_at=4)
    app = make_app(tmp_path, model)

    async def scenario(pilot, screen):
        screen.prompt.load_text("Hi")
        await pilot.press("enter")
        await until(pilot, lambda: model.engine.holding.is_set())
        await until(pilot, lambda: replies(screen)[-1].answer)
        await pilot.press("ctrl+q")

    drive(app, scenario)
    [(_, messages)] = stored(tmp_path)
    assert messages[1].stopped
    assert messages[1].content.startswith(model.tokenizer.decode(model.engine.script[:4]))


def test_a_crash_mid_reply_loses_nothing_already_on_screen(tmp_path, tiny_model_dir):
    model = fake_model(tiny_model_dir, REPLY, hold_at=6)
    app = make_app(tmp_path, model)
    on_screen = {}

    async def scenario(pilot, screen):
        screen.prompt.load_text("Hi")
        await pilot.press("enter")
        await until(pilot, lambda: model.engine.holding.is_set())
        await until(pilot, lambda: replies(screen)[-1].answer)
        on_screen["text"] = replies(screen)[-1].answer
        app.exit()  # torn down without the quit action, as an exception would

    drive(app, scenario)
    app.close_everything()  # what run_chat does on the way out, whatever happened
    [(_, messages)] = stored(tmp_path)
    assert messages[1].stopped and messages[1].content.startswith(on_screen["text"])


def test_quitting_closes_the_engine(tmp_path, tiny_model_dir):
    model = reference_model(tiny_model_dir)
    app = make_app(tmp_path, model, overrides={"max_tokens": 4})

    async def scenario(pilot, screen):
        await send(pilot, screen, "Hi")
        assert model.engine._k.size > 0
        await pilot.press("ctrl+q")

    drive(app, scenario)
    app.close_everything()  # what run_chat does once the app has exited
    assert model.engine._k.size == 0 and model.engine._v.size == 0  # the KV cache is freed
    app.close_everything()  # and again, harmlessly


def test_quitting_inside_a_step_that_ignores_cancel_neither_hangs_nor_frees_the_engine(
        tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr("qwenchat.tui.screens.chat.SHUTDOWN_WAIT_S", 0.2)
    model = fake_model(tiny_model_dir, REPLY, hold_at=3, stubborn=True)
    app = make_app(tmp_path, model)

    async def scenario(pilot, screen):
        screen.prompt.load_text("Hi")
        await pilot.press("enter")
        await until(pilot, lambda: model.engine.holding.is_set())
        app.exit()  # torn down while the generation thread is inside the engine

    try:
        started = time.monotonic()
        drive(app, scenario)
        app.close_everything()
        # The app's exit does not join the generation thread (the hold lasts 20 s)...
        assert time.monotonic() - started < 10
        assert not model.engine.closed  # ...nor frees the engine under it: the process's exit
    finally:
        model.engine.release.set()


# ------------------------------------------------------------------ regenerate, edit, clear
def test_regenerate_replaces_the_last_reply(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, reference_model(tiny_model_dir),
                   overrides={"temperature": 0.0, "max_tokens": 10})

    async def scenario(pilot, screen):
        await send(pilot, screen, "Hello")
        first = replies(screen)[-1].answer
        await press_and_wait_for_reply(pilot, screen, "ctrl+r")
        assert [type(t) for t in screen.conversation.turns] == [UserMessage, AssistantMessage]
        assert replies(screen)[-1].answer == first  # greedy: the same answer again
        assert screen.chat.session.last_reply.stats.reused_tokens > 0

    drive(app, scenario)
    [(_, messages)] = stored(tmp_path)
    assert [m.role for m in messages] == ["user", "assistant"]


def test_up_in_an_empty_prompt_edits_and_resends_the_last_message(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, reference_model(tiny_model_dir),
                   overrides={"temperature": 0.0, "max_tokens": 8})

    async def scenario(pilot, screen):
        await send(pilot, screen, "Hello")
        await send(pilot, screen, "Tell me about the fox")
        await pilot.press("up")
        assert screen.prompt.text == "Tell me about the fox"
        assert screen.prompt.has_class("-editing")
        await send(pilot, screen, "Tell me about the dog")
        texts = [t.text for t in screen.conversation.turns if isinstance(t, UserMessage)]
        assert texts == ["Hello", "Tell me about the dog"]
        assert len(screen.conversation.turns) == 4
        assert replies(screen)[-1].answer == greedy_answer(
            tiny_model_dir, ["Hello", "Tell me about the dog"], 8)
        assert not screen.prompt.has_class("-editing")

    drive(app, scenario)
    [(_, messages)] = stored(tmp_path)
    assert [m.content for m in messages if m.role == "user"] == ["Hello",
                                                                 "Tell me about the dog"]


def test_escape_cancels_an_edit(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def scenario(pilot, screen):
        await send(pilot, screen, "Hello")
        await pilot.press("up")
        assert screen.prompt.has_class("-editing")
        await pilot.press("escape")
        assert screen.prompt.text == "" and not screen.prompt.has_class("-editing")
        assert len(screen.conversation.turns) == 2

    drive(app, scenario)


def test_newline_keys_insert_a_line_and_enter_sends(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def scenario(pilot, screen):
        await pilot.press("a", "ctrl+j", "b", "alt+enter", "c", "shift+enter", "d")
        assert screen.prompt.text == "a\nb\nc\nd"
        await pilot.press("enter")
        await until(pilot, lambda: not screen.generating and len(replies(screen)) == 1)
        assert screen.conversation.turns[0].text == "a\nb\nc\nd"

    drive(app, scenario)


def terminal_keys(data: str) -> list[events.Key]:
    """`data` as Textual reads it from a terminal (the parser, not Pilot's key names)."""
    parser = XTermParser()
    return [e for e in [*parser.feed(data), *parser.feed("")] if isinstance(e, events.Key)]


def test_alt_enter_from_a_terminal_starts_a_new_line(tmp_path, tiny_model_dir):
    # Most terminals (and tmux) send Alt+Enter as ESC CR, which Textual reads as Enter.
    app = make_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def scenario(pilot, screen):
        keys = terminal_keys("a\x1b\rb")
        assert [k.key for k in keys] == ["a", "alt+enter", "b"]
        for key in keys:
            app._driver.send_message(key)
        await pilot.pause()
        assert screen.prompt.text == "a\nb" and not screen.conversation.turns

    drive(app, scenario)


def burst(app: QwenchatApp, keys: str) -> None:
    """Keys from a terminal arriving together, none waiting for the one before (fast typing,
    or keys typed while the UI is busy): Pilot's press waits after each key."""
    for key in terminal_keys(keys):
        app._driver.send_message(key)


def test_keys_arriving_together_keep_their_order(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def scenario(pilot, screen):
        burst(app, "ab\x7fc")  # Backspace is a binding; the letters are typed characters
        await pilot.pause()
        assert screen.prompt.text == "ac"
        burst(app, "\x15next")  # Ctrl+U: the line is deleted before "next", not after
        await pilot.pause()
        assert screen.prompt.text == "next"

    drive(app, scenario)


def test_text_typed_right_after_enter_stays_for_the_next_message(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def scenario(pilot, screen):
        burst(app, "first\rsecond")
        await until(pilot, lambda: not screen.generating and len(replies(screen)) == 1)
        assert screen.conversation.turns[0].text == "first"
        assert screen.prompt.text == "second"

    drive(app, scenario)


def test_a_message_that_fails_comes_back_before_what_was_typed_since(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def scenario(pilot, screen):
        burst(app, "/set top-p 5\r more")
        await until(pilot, lambda: screen.prompt_error.display)
        assert screen.prompt.text == "/set top-p 5 more"
        assert "top-p" in str(screen.prompt_error.render())

    drive(app, scenario)


def test_clear_and_new_chat(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def scenario(pilot, screen):
        await send(pilot, screen, "One")
        screen.prompt.load_text("/clear")
        await pilot.press("enter")
        await pilot.pause(0.05)
        assert screen.conversation.turns == [] and screen.chat.session.messages == []
        await send(pilot, screen, "Two")
        first = screen.chat.record.id
        await pilot.press("ctrl+n")
        await pilot.pause(0.05)
        assert screen.chat.record is None and screen.conversation.turns == []
        await send(pilot, screen, "Three")
        assert screen.chat.record.id != first

    drive(app, scenario)
    chats = stored(tmp_path)
    assert sorted(m.content for _, messages in chats for m in messages if m.role == "user") \
        == ["Three", "Two"]


# ------------------------------------------------------------------------ sampler controls
def test_set_command_changes_the_value_in_force_and_the_panel_shows_it(tmp_path,
                                                                       tiny_model_dir):
    app = make_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def scenario(pilot, screen):
        screen.prompt.load_text("/set temperature 0.3")
        await pilot.press("enter")
        await pilot.pause(0.05)
        assert screen.chat.session.params.current.temperature == 0.3
        assert screen.query_one("#param-temperature").value == "0.3"
        assert "•" in str(screen.query_one("#label-temperature").render())
        assert screen.prompt.text == ""
        screen.prompt.load_text("/show")
        await pilot.press("enter")
        await pilot.pause(0.05)
        notice = screen.conversation.query(ChatNotice).last()
        assert "temperature 0.3 •" in str(notice.render())

    drive(app, scenario)


def test_invalid_set_shows_an_inline_error_and_keeps_the_old_value(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def scenario(pilot, screen):
        screen.prompt.load_text("/set temperature 5")
        await pilot.press("enter")
        await pilot.pause(0.05)
        error = screen.query_one("#prompt-error")
        assert error.display
        assert str(error.render()) == "temperature must be 0 to 2 (0 = greedy); got 5.0"
        assert screen.chat.session.params.current.temperature == 0.7
        assert screen.prompt.text == "/set temperature 5"  # kept, to fix
        await pilot.press("end", "backspace")
        assert not error.display

    drive(app, scenario)


def test_invalid_panel_value_shows_an_error_beside_the_field(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def scenario(pilot, screen):
        await pilot.press("ctrl+s")
        field = screen.query_one("#param-top_p")
        field.focus()
        field.value = "1.5"
        await pilot.press("enter")
        await pilot.pause(0.05)
        error = screen.query_one("#error-top_p")
        assert error.display and "top-p must be greater than 0, at most 1" in str(error.render())
        assert field.value == "0.8" and screen.chat.session.params.current.top_p == 0.8

    drive(app, scenario)


def test_a_field_error_goes_once_the_value_in_force_changes_elsewhere(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def scenario(pilot, screen):
        await pilot.press("ctrl+s")
        error = screen.query_one("#error-top_p")
        for change in ("/think", "/set top-p 0.9"):
            field = screen.query_one("#param-top_p")
            field.focus()
            field.value = "5"
            await pilot.press("enter")
            await until(pilot, lambda: error.display)
            screen.prompt.focus()
            screen.prompt.load_text(change)
            await pilot.press("enter")
            await until(pilot, lambda: not error.display)  # no error beside the new value
        assert screen.query_one("#param-top_p").value == "0.9"

    drive(app, scenario)


def test_panel_edit_mid_reply_applies_to_the_following_tokens(tmp_path, tiny_model_dir):
    model = fake_model(tiny_model_dir, REPLY, hold_at=5)
    app = make_app(tmp_path, model)

    async def scenario(pilot, screen):
        await pilot.press("ctrl+s")
        screen.prompt.load_text("Hi")
        screen.prompt.focus()
        await pilot.press("enter")
        await until(pilot, lambda: model.engine.holding.is_set())
        field = screen.query_one("#param-temperature")
        field.focus()
        field.value = "1.3"
        await pilot.press("enter")
        await pilot.pause(0.05)
        assert field.value == "1.3"
        model.engine.release.set()
        await until(pilot, lambda: not screen.generating)

    drive(app, scenario)
    temperatures = [p.temperature for p in model.engine.seen]
    assert temperatures[:5] == [0.7] * 5
    assert set(temperatures[6:]) == {1.3} and len(temperatures) > 7


def test_switching_thinking_mode_takes_its_recommended_values(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def scenario(pilot, screen):
        for command in ("/set top-k 5", "/think"):
            screen.prompt.load_text(command)
            await pilot.press("enter")
        await pilot.pause(0.05)
        params = screen.chat.session.params.current
        assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 5)
        assert screen.chat.session.thinking and screen.query_one("#thinking").value
        await pilot.press("ctrl+t")
        params = screen.chat.session.params.current
        assert (params.temperature, params.top_p, params.top_k) == (0.7, 0.8, 5)
        assert not screen.chat.session.thinking

    drive(app, scenario)


def test_a_background_prefill_that_fails_costs_only_its_head_start(tmp_path, tiny_model_dir):
    model = fake_model(tiny_model_dir, "Yes.")
    engine = model.engine
    app = make_app(tmp_path, model)
    prefill = engine.prefill
    failures = []

    def failing_once(ids):
        if not failures:
            failures.append(len(ids))
            raise RuntimeError("a step that went wrong")
        prefill(ids)

    async def scenario(pilot, screen):
        await send(pilot, screen, "First")
        await until(pilot, lambda: not screen.chat.preparing)
        engine.truncate(0)  # the history to prefill again, as after opening this chat
        engine.prefill = failing_once
        screen.chat.start_preparing()  # its first step fails
        await until(pilot, lambda: not screen.chat.preparing)
        assert failures and screen.chat.prepared_tokens == 0
        await send(pilot, screen, "Second")
        assert [r.answer for r in replies(screen)] == ["Yes.", "Yes."]
        stats = screen.chat.session.last_reply.stats  # the turn prefilled it all itself
        assert stats.reused_tokens == 0 and stats.prefill_tokens == stats.prompt_tokens
        assert stats.stop_reason == "eos"

    drive(app, scenario)


def test_the_thinking_switch_and_ctrl_t_together_settle_on_the_last_choice(tmp_path,
                                                                           tiny_model_dir):
    # Found by hand: the switch clicked while Ctrl+T's change was still being shown flipped
    # the mode back and forth for ever, the UI thread at 100%.
    app = make_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def scenario(pilot, screen):
        await pilot.press("ctrl+s")
        switch = screen.query_one("#thinking")
        # The switch clicked, then Ctrl+T twice, all before the click's message is handled.
        switch.toggle()
        screen.action_toggle_thinking()
        screen.action_toggle_thinking()
        await pilot.pause(0.3)
        flips = len(screen.app._notifications)
        await pilot.pause(0.3)
        assert len(screen.app._notifications) == flips  # no switching by itself
        assert screen.chat.session.thinking == switch.value

    drive(app, scenario)


# ---------------------------------------------------------------------------------- thinking
def test_thinking_streams_dimmed_and_folds_away_when_the_answer_starts(tmp_path,
                                                                       tiny_model_dir):
    model = fake_model(tiny_model_dir, THOUGHT_REPLY)
    end_of_thinking = model.engine.script.index(model.tokenizer.think_end_id)
    model.engine.hold_at = end_of_thinking
    app = make_app(tmp_path, model, think=True)

    async def scenario(pilot, screen):
        screen.prompt.load_text("Foxes?")
        await pilot.press("enter")
        await until(pilot, lambda: model.engine.holding.is_set())
        await until(pilot, lambda: replies(screen) and replies(screen)[-1].thinking)
        block = replies(screen)[-1].query_one(ThinkingBlock)
        await until(pilot, lambda: "foxes." in block.text)
        assert not block.collapsed and replies(screen)[-1].answer == ""
        model.engine.release.set()
        await until(pilot, lambda: not screen.generating)
        assert block.collapsed and block.text == "The user asks about foxes."
        assert replies(screen)[-1].answer == "Foxes are quick."
        await pilot.click(block.query_one("CollapsibleTitle"))
        assert not block.collapsed

    drive(app, scenario)
    [(chat, messages)] = stored(tmp_path)
    assert chat.settings["thinking"] is True
    assert (messages[1].thinking, messages[1].content) == ("The user asks about foxes.",
                                                           "Foxes are quick.")


def test_a_reply_stopped_while_thinking_keeps_its_thinking_open(tmp_path, tiny_model_dir):
    model = fake_model(tiny_model_dir, THOUGHT_REPLY)
    model.engine.hold_at = model.engine.script.index(model.tokenizer.think_end_id)
    app = make_app(tmp_path, model, think=True)

    async def scenario(pilot, screen):
        screen.prompt.load_text("Foxes?")
        await pilot.press("enter")
        await until(pilot, lambda: model.engine.holding.is_set())
        await until(pilot, lambda: replies(screen) and "foxes." in replies(screen)[-1].thinking)
        await pilot.press("escape")
        await until(pilot, lambda: not screen.generating)
        reply = replies(screen)[-1]
        assert reply.answer == "" and reply.has_class("-stopped")
        assert not reply.query_one(ThinkingBlock).collapsed  # the thinking is all there is
        await pilot.press("ctrl+n")
        await until(pilot, lambda: not replies(screen))
        await screen.open_chat(app.store.list_chats()[0].id)  # and from the history
        await until(pilot, lambda: replies(screen))
        assert not replies(screen)[-1].query_one(ThinkingBlock).collapsed

    drive(app, scenario)


def test_folding_the_thinking_does_not_stop_following_the_reply(tmp_path, tiny_model_dir):
    model = fake_model(tiny_model_dir, "<think>\n" + "hmm\n\n" * 40 + "</think>\n\n"
                       + "word\n\n" * 40)
    app = make_app(tmp_path, model, think=True)

    async def scenario(pilot, screen):
        await send(pilot, screen, "Go")
        await pilot.pause(0.1)
        conversation = screen.conversation
        assert replies(screen)[-1].query_one(ThinkingBlock).collapsed
        assert 0 < conversation.max_scroll_y == conversation.scroll_y

    drive(app, scenario)


# --------------------------------------------------------------------------- chats, export
def test_chat_list_switches_renames_and_deletes_chats(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, reference_model(tiny_model_dir),
                   overrides={"temperature": 0.0, "max_tokens": 6})

    async def scenario(pilot, screen):
        await send(pilot, screen, "First chat")
        first_reply = replies(screen)[-1].answer
        screen.prompt.load_text("/set top-k 3")
        await pilot.press("enter")
        await pilot.press("ctrl+n")
        await send(pilot, screen, "Second chat")
        await pilot.press("ctrl+o")
        await until(pilot, lambda: isinstance(app.screen, ChatListScreen))
        await pilot.press("down", "enter")  # the list is most recent first
        await until(pilot, lambda: app.screen is screen)
        await pilot.pause(0.05)
        assert screen.chat.title == "First chat"
        first_id = screen.chat.record.id
        assert [t.text for t in screen.conversation.turns if isinstance(t, UserMessage)] == \
            ["First chat"]
        assert replies(screen)[-1].answer == first_reply
        assert screen.chat.session.messages == [Message("user", "First chat"),
                                                Message("assistant", first_reply)]
        assert screen.chat.settings.overrides["top_k"] == 3
        await pilot.press("ctrl+o")
        await until(pilot, lambda: isinstance(app.screen, ChatListScreen))
        options = app.screen.query_one(OptionList)
        options.highlighted = next(i for i in range(options.option_count)
                                   if options.get_option_at_index(i).id == str(first_id))
        await pilot.press("r")
        app.screen.query_one("#rename").value = "Renamed"
        await pilot.press("enter")
        await pilot.pause(0.05)
        assert "Renamed" in str(options.get_option_at_index(options.highlighted).prompt)
        await pilot.press("d", "y")  # delete it: the open chat
        await pilot.pause(0.05)
        assert options.option_count == 1
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is screen)
        await pilot.pause(0.05)
        assert screen.chat.record is None and screen.conversation.turns == []

    drive(app, scenario)
    assert [chat.title for chat, _ in stored(tmp_path)] == ["Second chat"]


def test_renaming_a_chat_with_keys_arriving_together(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def scenario(pilot, screen):
        await send(pilot, screen, "About foxes")
        await pilot.press("ctrl+o")
        await until(pilot, lambda: isinstance(app.screen, ChatListScreen))
        await pilot.press("r")
        burst(app, "\x15Foxes\r")  # Ctrl+U clears the old title first, then "Foxes"
        await until(pilot, lambda: not app.screen.query_one("#rename").display)
        assert app.store.list_chats()[0].title == "Foxes"

    drive(app, scenario)


def test_export_writes_markdown_and_json(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, fake_model(tiny_model_dir, REPLY))

    async def scenario(pilot, screen):
        await send(pilot, screen, "About the fox")
        for command in (f"/export md {tmp_path / 'fox.md'}",
                        f"/export json {tmp_path / 'fox.json'}"):
            screen.prompt.load_text(command)
            await pilot.press("enter")
        await pilot.pause(0.05)

    drive(app, scenario)
    markdown = (tmp_path / "fox.md").read_text()
    assert "# About the fox" in markdown and "print('fox')" in markdown
    exported = json.loads((tmp_path / "fox.json").read_text())
    assert [m["role"] for m in exported["messages"]] == ["user", "assistant"]
    assert exported["messages"][1]["content"] == REPLY


def test_export_by_default_goes_to_the_current_directory(tmp_path, tiny_model_dir,
                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = make_app(tmp_path, fake_model(tiny_model_dir, REPLY))

    async def scenario(pilot, screen):
        await send(pilot, screen, "About the fox!")
        await screen.run_action("export('md')")

    drive(app, scenario)
    [written] = tmp_path.glob("qwenchat-*-about-the-fox.md")
    assert "print('fox')" in written.read_text()


def test_export_never_overwrites_a_file(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "notes.md"
    mine.write_text("my own notes\n")
    app = make_app(tmp_path, fake_model(tiny_model_dir, REPLY))

    async def scenario(pilot, screen):
        await send(pilot, screen, "About the fox!")
        screen.prompt.load_text(f"/export md {mine}")
        await pilot.press("enter")
        await pilot.pause(0.05)
        error = str(screen.prompt_error.render())
        assert screen.prompt_error.display and "already exists" in error and str(mine) in error
        for _ in range(2):  # the default name twice: the second export gets a number
            await screen.run_action("export('md')")

    drive(app, scenario)
    assert mine.read_text() == "my own notes\n"
    first, second = sorted(tmp_path.glob("qwenchat-*-about-the-fox*.md"), key=lambda p: p.stem)
    assert first.name.endswith("about-the-fox.md") and second.name.endswith("about-the-fox-2.md")
    assert "print('fox')" in first.read_text() and "print('fox')" in second.read_text()


def test_copy_puts_the_reply_or_its_code_block_on_the_clipboard(tmp_path, tiny_model_dir,
                                                                 monkeypatch):
    monkeypatch.setenv("TERM_PROGRAM", "WezTerm")
    monkeypatch.delenv("TMUX", raising=False)  # tmux may ignore the request: not tested here
    app = make_app(tmp_path, fake_model(tiny_model_dir, REPLY))

    async def scenario(pilot, screen):
        await send(pilot, screen, "Fox code?")
        await pilot.press("f3")
        assert app.clipboard == REPLY
        await pilot.press("f4")
        assert app.clipboard == "print('fox')"
        monkeypatch.setenv("TERM_PROGRAM", "Apple_Terminal")
        screen.prompt.load_text("/copy")
        await pilot.press("enter")
        await pilot.pause(0.05)
        assert any("macOS Terminal" in n.message for n in app._notifications)

    drive(app, scenario)


# ------------------------------------------------------------------------------- context
def test_dropped_turns_show_a_notice_and_dim_the_old_turns(tmp_path, tiny_model_dir):
    model = fake_model(tiny_model_dir, "Short answer here.", capacity=128)
    app = make_app(tmp_path, model, overrides={"max_tokens": 8})

    async def scenario(pilot, screen):
        for i in range(6):
            await send(pilot, screen, f"Question number {i} about the fox and the dog")
        notices = [str(n.render()) for n in screen.conversation.query(ChatNotice)]
        assert any("dropped the" in n and "oldest turn" in n for n in notices)
        first = screen.chat.session.first_in_context
        assert first > 0
        turns = screen.conversation.turns
        assert all(t.has_class("-out-of-context") for t in turns[:first])
        assert not any(t.has_class("-out-of-context") for t in turns[first:])
        assert any("context is" in n.message for n in app._notifications)
        # The gauge follows the cache, also once the background prefill has reshaped it.
        await until(pilot, lambda: not screen.chat.preparing)
        engine, gauge = screen.model.engine, screen.query_one(KVGauge)
        await until(pilot, lambda: gauge.position == engine.position)
        level = kv_level(engine.position, engine.capacity)
        assert gauge.has_class("-warn") == (level == "warn")
        assert gauge.has_class("-full") == (level == "full")

    drive(app, scenario)


def test_the_context_warning_leaves_the_status_bar_and_footer_visible(tmp_path, tiny_model_dir):
    model = fake_model(tiny_model_dir, "Short answer here.", eos=False, capacity=128)
    app = make_app(tmp_path, model, overrides={"max_tokens": 110})

    async def scenario(pilot, screen):
        await send(pilot, screen, "Question about the fox")
        await until(pilot, lambda: any("context is" in str(t.render())
                                       for t in screen.query(Toast)))
        await pilot.pause()

        def shown_on_row(y: int) -> set[type]:
            return {type(app.screen.get_widget_at(x, y)[0]) for x in range(SIZE[0])}

        status_row, footer_row = screen.status.region.y, screen.query_one(Footer).region.y
        assert Toast in shown_on_row(status_row - 1)  # the notice is up, just above them
        assert Toast not in shown_on_row(status_row) | shown_on_row(footer_row)

    drive(app, scenario, notifications=True)


def test_a_prompt_too_long_for_the_context_goes_back_to_the_prompt(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, fake_model(tiny_model_dir, "Yes.", capacity=64))

    async def scenario(pilot, screen):
        long = "fox " * 100
        screen.prompt.load_text(long)
        await pilot.press("enter")
        await until(pilot, lambda: screen.query_one("#prompt-error").display)
        assert "context holds 64" in str(screen.query_one("#prompt-error").render())
        assert screen.prompt.text == long and screen.conversation.turns == []
        assert screen.chat.session.messages == []

    drive(app, scenario)
    assert all(messages == [] for _, messages in stored(tmp_path))


# --------------------------------------------------------------------------------- history
def test_corrupted_history_is_moved_aside_with_a_notice(tmp_path, tiny_model_dir):
    (tmp_path / "history.sqlite3").write_bytes(b"this is not a database" * 100)
    app = make_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def scenario(pilot, screen):
        assert any("moved it to" in n.message for n in app._notifications)
        await send(pilot, screen, "Still works")

    drive(app, scenario)
    assert list(tmp_path.glob("history.sqlite3.corrupt-*"))
    [(_, messages)] = stored(tmp_path)
    assert messages[0].content == "Still works"


def test_no_history_keeps_nothing_on_disk(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    app = QwenchatApp(ChatOptions("tiny-qwen3", history=False),
                      loader=lambda *reports: fake_model(tiny_model_dir, "Yes."))

    async def scenario(pilot, screen):
        assert app.store.path is None
        await send(pilot, screen, "Forget me")

    drive(app, scenario)
    assert not (tmp_path / "data").exists()


# --------------------------------------------------------------------------- responsiveness
def test_ui_keeps_up_with_a_3000_token_per_second_engine(tmp_path, tiny_model_dir):
    tokens = 4500
    model = fake_model(tiny_model_dir, "fox and dog " * 10 + "\n\n", eos=False, rate=3000,
                       capacity=8192)
    app = make_app(tmp_path, model, overrides={"max_tokens": tokens})
    gaps: list[float] = []
    drains: list[float] = []
    key_delays: list[float] = []

    async def scenario(pilot, screen):
        original = screen._drain

        async def counted() -> None:
            drains.append(time.perf_counter())
            await original()

        screen._drain = counted
        last = time.perf_counter()

        def beat() -> None:
            nonlocal last
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

        screen.set_interval(0.01, beat)
        screen.prompt.load_text("Go")
        # Keys go in as the terminal delivers them: Pilot.press would wait for the whole
        # reply, since the app is never idle while it streams.
        app.post_message(events.Key("enter", "\r"))
        await until(pilot, lambda: screen.generating and replies(screen)[-1].answer)
        for typed, key in enumerate("typing", start=1):
            sent = time.perf_counter()
            app.post_message(events.Key(key, key))
            await until(pilot, lambda n=typed: len(screen.prompt.text) == n)
            key_delays.append(time.perf_counter() - sent)
            await pilot.pause(0.05)
        assert screen.generating and screen.prompt.text == "typing"
        await until(pilot, lambda: not screen.generating, timeout=30)
        reply = replies(screen)[-1]
        stats = screen.chat.session.last_reply.stats
        assert stats.generated_tokens == tokens and stats.decode_tok_s > 2000
        assert reply.answer == screen.chat.session.last_reply.answer
        assert reply.query_one("Markdown").source == reply.answer

    # Earlier tests leave a large heap in this process; freezing it keeps their garbage
    # collection out of this app's timings.
    gc.collect()
    gc.freeze()
    try:
        drive(app, scenario)
    finally:
        gc.unfreeze()
    stream_s = drains[-1] - drains[0]
    assert stream_s > 1.0  # the reply really streamed over time, at about 3,000 tok/s
    assert len(drains) <= stream_s / 0.05 + 5  # batched: one render per tick, not per token
    # Keys typed during the stream show at once, and the UI loop (a 10 ms heartbeat) never
    # stalls; the bounds leave room for a busy two-core machine.
    assert sorted(key_delays)[len(key_delays) // 2] < 0.15, key_delays
    assert max(key_delays) < 0.5, key_delays
    assert max(gaps) < 0.5, f"the event loop stalled for {max(gaps):.2f} s"


# -------------------------------------------------------------------- startup and errors
def test_loading_screen_shows_each_step_while_it_runs(tmp_path, tiny_model_dir):
    release = threading.Event()
    model = fake_model(tiny_model_dir, "Yes.")

    def loader(step, notice, progress):
        step("finding tiny-qwen3")
        step("compiling kernels for sm_90")
        notice("context reduced to 4096 tokens")
        release.wait(10)
        return model

    app = QwenchatApp(ChatOptions("tiny-qwen3"), loader=loader, history=None)

    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: isinstance(app.screen, LoadingScreen))
            steps = app.screen.query_one("#loading-steps")
            await until(pilot, lambda: "context reduced" in str(steps.render()))
            text = str(steps.render())
            first, compiling, note = text.splitlines()
            assert first.startswith("✓") and first.endswith(" s  finding tiny-qwen3")
            assert compiling.endswith("compiling kernels for sm_90")
            assert not compiling.startswith("✓")  # still running
            assert note == "⚠ context reduced to 4096 tokens"
            release.set()
            await until(pilot, lambda: any("context reduced" in n.message
                                           for n in app._notifications))
            await until(pilot, lambda: chat_ready(app))

    asyncio.run(main())


def test_the_command_palette_open_while_loading_misses_no_step(tmp_path, tiny_model_dir):
    model = fake_model(tiny_model_dir, "Yes.")
    palette_open, release = threading.Event(), threading.Event()

    def loader(step, notice, progress):
        step("finding tiny-qwen3")
        palette_open.wait(10)
        step("compiling kernels for sm_90")
        release.wait(10)
        return model

    app = QwenchatApp(ChatOptions("tiny-qwen3"), loader=loader, history=None)

    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: isinstance(app.screen, LoadingScreen))
            loading = app.screen
            await pilot.press("ctrl+p")
            await until(pilot, lambda: isinstance(app.screen, CommandPalette))
            palette_open.set()
            await until(pilot, lambda: len(loading._steps) == 2)  # reached it underneath
            release.set()
            await until(pilot, lambda: chat_ready(app))  # the palette closed for the chat
            assert loading not in app.screen_stack and len(app.screen_stack) == 2
            assert all(end is not None for _, _, end in loading._steps)

    try:
        asyncio.run(main())
    finally:
        palette_open.set()
        release.set()


def test_the_loading_screen_shows_a_hub_download_as_it_runs(tmp_path, tiny_model_dir,
                                                            monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    halfway, release = threading.Event(), threading.Event()

    def fake_snapshot_download(repo_id, *, local_files_only=False, tqdm_class=None, **_):
        # As huggingface_hub does: a bar for the files, one for the bytes, from its threads.
        if local_files_only:
            raise LocalEntryNotFoundError(f"{repo_id} is not in the cache")
        files = tqdm_class(total=5, desc="Fetching 5 files")
        data = tqdm_class(total=1_500_000_000, unit="B", unit_scale=True, desc="Downloading")
        data.update(412_000_000)
        files.update(2)
        halfway.set()
        release.wait(10)
        data.update(1_088_000_000)
        files.update(3)
        data.close()
        files.close()
        return str(tiny_model_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    app = QwenchatApp(ChatOptions("Org/Name", backend="cpu"), history=None)

    def shown() -> str:
        return str(app.screen.query_one("#loading-steps").render())

    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: isinstance(app.screen, LoadingScreen)
                        and "2 of 5 files" in shown())
            finding, downloading, progress = shown().splitlines()
            assert finding.startswith("✓") and "finding Org/Name" in finding
            assert downloading.endswith("downloading Org/Name from the Hugging Face hub")
            assert not downloading.startswith("✓")
            assert progress.strip() == "412 MB of 1.50 GB · 2 of 5 files"
            release.set()
            await until(pilot, lambda: chat_ready(app))

    try:
        asyncio.run(main())
    finally:
        release.set()


def test_the_model_loader_opens_the_chat_on_the_reference_engine(tmp_path, tiny_model_dir):
    options = ChatOptions(str(tiny_model_dir), backend="cpu", system="Be brief.",
                          overrides={"temperature": 0.0, "max_tokens": 6})
    app = QwenchatApp(options, history=tmp_path / "history.sqlite3")

    async def scenario(pilot, screen):
        assert "reference" in str(screen.query_one("#engine").render())
        await send(pilot, screen, "Hello")
        assert screen.chat.session.system == "Be brief."
        assert screen.chat.session.last_reply.stats.generated_tokens == 6

    drive(app, scenario)


@pytest.mark.gpu
def test_the_chat_runs_on_the_cuda_engine_across_worker_threads(tmp_path, tiny_model_dir,
                                                               cuda_gpu):
    # The engine is built on the loading thread and each reply runs on a worker thread: the
    # CUDA context must follow.
    options = ChatOptions(str(tiny_model_dir), backend="cuda",
                          overrides={"temperature": 0.0, "max_tokens": 8})
    app = QwenchatApp(options, history=tmp_path / "history.sqlite3")

    async def scenario(pilot, screen):
        assert "cuda" in str(screen.query_one("#engine").render())
        await send(pilot, screen, "Hello")
        await send(pilot, screen, "And again?")
        stats = screen.chat.session.last_reply.stats
        assert stats.generated_tokens == 8 and stats.reused_tokens > 0
        await press_and_wait_for_reply(pilot, screen, "ctrl+r")
        assert screen.chat.session.last_reply.stats.generated_tokens == 8
        await pilot.press("ctrl+q")

    from qwenchat.engine.cuda import runtime

    before = runtime.allocated_bytes()
    drive(app, scenario)
    assert runtime.allocated_bytes() > before
    app.close_everything()  # on this thread, where no context was ever made current
    assert runtime.allocated_bytes() == before


@pytest.mark.parametrize(("error", "shown"), [
    (ModelError("Qwen/Qwen3-0.6B is not in the Hugging Face cache and cannot be downloaded "
                "now: connect to the network"), "connect to the network"),
    (RuntimeError("kaboom"), "RuntimeError: kaboom (rerun with --debug for the traceback)"),
])
def test_a_load_failure_is_a_readable_screen_then_one_line(tmp_path, error, shown):
    def loader(step, notice, progress):
        raise error

    app = QwenchatApp(ChatOptions("Qwen/Qwen3-0.6B"), loader=loader, history=None)

    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: isinstance(app.screen, ErrorScreen))
            assert shown in str(app.screen.query_one("#error-message").render())
            assert not app.screen.query("#error-details")  # no traceback without --debug
            await pilot.press("q")

    asyncio.run(main())
    assert app.return_code == 1 and shown in app.error_message


def test_debug_shows_the_traceback_on_the_error_screen(tmp_path):
    def loader(step, notice, progress):
        raise RuntimeError("kaboom")

    app = QwenchatApp(ChatOptions("x", debug=True), loader=loader, history=None)

    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: isinstance(app.screen, ErrorScreen))
            assert app.screen.query("#error-details")

    asyncio.run(main())


def test_an_engine_error_mid_reply_is_a_notice_not_a_crash(tmp_path, tiny_model_dir):
    model = fake_model(tiny_model_dir, REPLY)
    next_token = model.engine._next_token

    def failing(fed, params, seed, step):
        if step == 3:
            raise RuntimeError("device lost")
        return next_token(fed, params, seed, step)

    model.engine._next_token = failing
    app = make_app(tmp_path, model)

    async def scenario(pilot, screen):
        await send(pilot, screen, "Hi")
        notice = screen.conversation.query(ChatNotice).last()
        assert "RuntimeError: device lost" in str(notice.render())
        assert replies(screen)[-1].has_class("-stopped")

    drive(app, scenario)
    [(_, messages)] = stored(tmp_path)
    assert messages[1].stopped and messages[1].content


# ------------------------------------------------------------------------ help and palette
def test_help_lists_every_command_and_key(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def scenario(pilot, screen):
        screen.prompt.load_text("/help")
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen))
        source = app.screen.query_one("Markdown").source
        for needle in ("/set NAME VALUE", "/export md|json [FILE]", "Ctrl+J", "Esc", "Ctrl+Q",
                       "answer the last message again", "/regen", "Ctrl+P"):
            assert needle.lower() in source.lower()
        await pilot.press("escape")
        assert app.screen is screen

    drive(app, scenario)


def test_command_palette_lists_every_action_and_each_runs(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def scenario(pilot, screen):
        titles = [c.title for c in app.get_system_commands(screen)]
        for title in ("Stop the reply", "Regenerate the last reply", "Edit the last message",
                      "Clear this chat", "New chat", "Chats", "Copy the last reply",
                      "Copy the last code block", "Export to Markdown", "Export to JSON",
                      "Thinking on/off", "Sampler panel", "Help", "Quit"):
            assert title in titles
        await pilot.press("ctrl+p")
        await pilot.press(*"sampler panel")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await until(pilot, lambda: app.screen is screen and screen.sampler.display)

    drive(app, scenario)


# ------------------------------------------------------------------ narrow terminals
STREAMED = ("The fox is quick and the dog is lazy, so the fox jumps over the dog and runs off "
            "into the woods where the other foxes live.")
HELD_AT = 12  # tokens of STREAMED on screen while the reply is held


@pytest.fixture
def every_token_reported(monkeypatch):
    """The session reports progress after every token, not every 0.1 s: a reply held part
    way shows the numbers of its last token."""
    monkeypatch.setattr("qwenchat.session.PROGRESS_INTERVAL_S", 0.0)


async def hold_mid_reply(pilot, screen: ChatScreen) -> None:
    """Send a message, then wait until the reply is held after HELD_AT tokens, every one of
    them on screen and in the status bar."""
    engine = screen.model.engine
    await until(pilot, lambda: not screen.chat.preparing)
    screen.prompt.load_text("Tell me about the fox")
    await pilot.press("enter")
    shown = screen.model.tokenizer.decode(engine.script[:HELD_AT])
    await until(pilot, lambda: engine.holding.is_set())

    def all_shown() -> bool:
        reply = screen._reply
        return (reply is not None and reply.stats is not None
                and reply.stats.generated_tokens == HELD_AT
                and screen.query_one(KVGauge).position == reply.stats.position
                and replies(screen)[-1].query_one(Markdown).source == shown)

    await until(pilot, all_shown)
    await pilot.pause(0.1)


def screen_rows(app: QwenchatApp) -> list[str]:
    """The text on the terminal, row by row, as the user sees it (cut where it is cut)."""
    return [strip.text for strip in app.screen._compositor.render_strips()]


@pytest.mark.parametrize("width", [80, 60])
def test_while_a_reply_streams_the_status_bar_shows_live_speed_and_the_kv_position(
        tmp_path, tiny_model_dir, every_token_reported, width):
    model = fake_model(tiny_model_dir, STREAMED, hold_at=HELD_AT)
    app = make_app(tmp_path, model)

    async def scenario(pilot, screen):
        await hold_mid_reply(pilot, screen)
        bar = screen_rows(app)[screen.status.region.y]
        gauge = screen.query_one(KVGauge)
        assert "tok/s (avg " in bar and "● generating" in bar
        assert f" {gauge.position:,}/{gauge.capacity:,}" in bar
        assert "…" not in bar
        model.engine.release.set()

    drive(app, scenario, size=(width, 24))


def test_the_status_bar_refits_when_the_terminal_is_resized(tmp_path, tiny_model_dir,
                                                            every_token_reported):
    model = fake_model(tiny_model_dir, STREAMED, hold_at=HELD_AT)
    app = make_app(tmp_path, model)

    async def scenario(pilot, screen):
        await hold_mid_reply(pilot, screen)
        wide = screen_rows(app)[screen.status.region.y]
        assert "fake engine · Fake GPU 9000 · bf16 weights" in wide and "TTFT" in wide
        await pilot.resize_terminal(70, 24)
        await pilot.pause(0.1)
        narrow = screen_rows(app)[screen.status.region.y]
        assert "TTFT" not in narrow and "tok/s (avg " in narrow and "…" not in narrow
        await pilot.resize_terminal(160, 40)
        await pilot.pause(0.1)
        assert screen_rows(app)[screen.status.region.y] == wide.ljust(160)[:160]
        model.engine.release.set()

    drive(app, scenario, size=(160, 40))


def test_the_footer_shows_f1_help_at_80_columns_while_a_reply_streams(
        tmp_path, tiny_model_dir, every_token_reported):
    model = fake_model(tiny_model_dir, STREAMED, hold_at=HELD_AT)
    app = make_app(tmp_path, model)

    async def scenario(pilot, screen):
        await hold_mid_reply(pilot, screen)
        footer = screen_rows(app)[screen.query_one(Footer).region.y]
        assert "esc Stop" in footer and "f1 Help" in footer
        model.engine.release.set()

    drive(app, scenario, size=(80, 24))


def test_every_sampler_field_is_on_screen_at_80x24(tmp_path, tiny_model_dir):
    app = make_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def scenario(pilot, screen):
        await pilot.press("ctrl+s")
        await pilot.pause(0.1)
        panel = screen.sampler
        assert panel.max_scroll_y == 0  # nothing below the fold
        fields = list(panel.query(Input)) + list(panel.query(Switch))
        assert len(fields) == 11
        for field in fields:
            assert field.region.area and panel.region.contains_region(field.region), field.id
        assert Region(0, 0, 80, 24).contains_region(panel.region)

    drive(app, scenario, size=(80, 24))


# ---------------------------------------------------------------------- snapshot tests
def frozen_session_clock(monkeypatch) -> None:
    """Every reading of the session's clock moves 1 ms on, so timings are the same each run."""
    ticks = iter(range(10**9))
    monkeypatch.setattr("qwenchat.session.time",
                        SimpleNamespace(perf_counter=lambda: next(ticks) / 1000))


def snapshot_app(tmp_path, model, **options) -> QwenchatApp:
    return QwenchatApp(ChatOptions("tiny-qwen3", **options),
                       loader=lambda *reports: model, history=None, clock=lambda: 100.0)


async def wait_for_chat(pilot) -> ChatScreen:
    """The chat screen, ready, with the prompt's cursor shown for good: a blinking cursor
    is on or off at the moment of the screenshot depending on how fast the machine is."""
    await until(pilot, lambda: chat_ready(pilot.app))
    screen = pilot.app.screen
    screen.prompt.cursor_blink = False
    return screen


def test_snapshot_chat_with_thinking_markdown_and_code(snap_compare, tmp_path, tiny_model_dir,
                                                       monkeypatch):
    frozen_session_clock(monkeypatch)
    answer = ("Foxes are **quick**. Here is one:\n\n```python\ndef fox():\n"
              "    return 'quick'\n```\n\n- red\n- arctic")
    model = fake_model(tiny_model_dir, f"<think>\nThe user asks about foxes.\n</think>\n\n"
                                       f"{answer}")
    app = snapshot_app(tmp_path, model, think=True)

    async def run_before(pilot) -> None:
        screen = await wait_for_chat(pilot)
        await send(pilot, screen, "Tell me about foxes, with code.")
        await settled(pilot, screen)
        await pilot.pause(0.1)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


@pytest.mark.parametrize("size", [(80, 24), (100, 30), (120, 40)],
                         ids=["80x24", "100x30", "120x40"])
def test_snapshot_a_reply_streaming(snap_compare, tmp_path, tiny_model_dir, monkeypatch,
                                    every_token_reported, size):
    frozen_session_clock(monkeypatch)
    # The speed now is measured over the batches the UI happened to take: fixed here.
    monkeypatch.setattr(RateMeter, "rate", property(lambda meter: 987.0))
    model = fake_model(tiny_model_dir, STREAMED, hold_at=HELD_AT, capacity=256)
    app = snapshot_app(tmp_path, model)

    async def run_before(pilot) -> None:
        await hold_mid_reply(pilot, await wait_for_chat(pilot))

    try:
        assert snap_compare(app, terminal_size=size, run_before=run_before)
    finally:
        model.engine.release.set()


def test_snapshot_sampler_panel_with_an_inline_error(snap_compare, tmp_path, tiny_model_dir):
    app = snapshot_app(tmp_path, fake_model(tiny_model_dir, "Yes."),
                       overrides={"seed": 42})

    async def run_before(pilot) -> None:
        screen = await wait_for_chat(pilot)
        await pilot.press("ctrl+s")
        field = screen.query_one("#param-temperature")
        field.focus()
        field.value = "9"
        await pilot.press("enter")
        screen.prompt.focus()
        await pilot.pause(0.1)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_snapshot_help(snap_compare, tmp_path, tiny_model_dir):
    app = snapshot_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def run_before(pilot) -> None:
        await wait_for_chat(pilot)
        await pilot.press("f1")
        await pilot.pause(0.1)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_snapshot_chat_list(snap_compare, tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    monkeypatch.setattr("qwenchat.store._now", lambda: 1_767_225_600.0)  # 2026-01-01 00:00
    app = snapshot_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def run_before(pilot) -> None:
        screen = await wait_for_chat(pilot)
        for title in ("How fast is a fox?", "Write a haiku about dogs"):
            await send(pilot, screen, title)
            await pilot.press("ctrl+n")
            await settled(pilot, screen)
        await pilot.press("ctrl+o")
        await until(pilot, lambda: isinstance(pilot.app.screen, ChatListScreen))
        await pilot.pause(0.1)

    try:
        assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
    finally:
        monkeypatch.undo()
        time.tzset()


def test_snapshot_loading(snap_compare, tmp_path):
    release = threading.Event()

    def loader(step, notice, progress):
        step("finding Qwen/Qwen3-0.6B (downloading it if it is not in the cache)")
        step("loading 0.60 B parameters into the cuda engine")
        step("compiling decode.cu for sm_90")
        release.wait(30)
        raise ModelError("test over")

    app = QwenchatApp(ChatOptions("Qwen/Qwen3-0.6B"), loader=loader, history=None,
                      clock=lambda: 100.0)

    async def run_before(pilot) -> None:
        await until(pilot, lambda: isinstance(pilot.app.screen, LoadingScreen)
                    and "compiling" in str(pilot.app.screen.query_one("#loading-steps")
                                           .render()))

    try:
        assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
    finally:
        release.set()


def test_snapshot_error(snap_compare, tmp_path):
    def loader(step, notice, progress):
        raise ModelError("Qwen/Qwen3-0.6B is not in the Hugging Face cache and cannot be "
                         "downloaded now: connect to the network (and unset HF_HUB_OFFLINE) "
                         "to fetch it once, or pass --model DIR with a local copy")

    app = QwenchatApp(ChatOptions("Qwen/Qwen3-0.6B"), loader=loader, history=None,
                      clock=lambda: 100.0)

    async def run_before(pilot) -> None:
        await until(pilot, lambda: isinstance(pilot.app.screen, ErrorScreen))

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_the_ui_rate_benchmark_runs_and_counts_every_token():
    script = Path(__file__).parent / "ui_rate.py"
    result = subprocess.run([sys.executable, str(script), "--fake", "4000", "--tokens", "400",
                             "--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["alone_tokens"] == report["chat_tokens"] == 400
    assert report["chat_shows_tok_s"] > 0 and report["alone_tok_s"] > 0
    assert report["chat_summary"].startswith("400 tokens · ")


def test_speculation_asked_of_an_engine_that_cannot_verify_says_so_and_answers_plainly(
        tmp_path, tiny_model_dir):
    model = fake_model(tiny_model_dir, "Short answer here.")
    app = make_app(tmp_path, model, speculate="ngram")

    async def scenario(pilot, screen):
        await until(pilot, lambda: any("does not verify proposals" in str(t.render())
                                       for t in screen.query(Toast)))
        assert screen.speculate == 0 and screen.chat.session.speculate == 0
        await send(pilot, screen, "Question about the fox")
        assert "Short answer here." in replies(screen)[-1].answer

    drive(app, scenario, notifications=True)


def test_a_draft_model_in_the_chat_answers_as_without_it(tmp_path, tiny_model_dir):
    from qwenchat.engine.speculate import DraftProposer

    model = reference_model(tiny_model_dir)
    draft = reference_model(tiny_model_dir)  # (the model itself: every proposal is kept)
    model.proposer = DraftProposer(draft.engine, model.engine.config.vocab_size)
    model.draft_spec = "tiny-draft"
    app = make_app(tmp_path, model, draft="tiny-draft",
                   overrides={"temperature": 0.0, "max_tokens": 30})

    async def scenario(pilot, screen):
        await send(pilot, screen, "Hello")
        assert replies(screen)[-1].answer == greedy_answer(tiny_model_dir, ["Hello"], 30)
        stats = screen.chat.session.last_reply.stats
        assert stats.spec_passes > 0 and stats.spec_accepted == stats.spec_proposed
        summary = str(replies(screen)[-1].query_one(".summary").render())
        assert f"kept {stats.spec_accepted}/{stats.spec_proposed} proposed" in summary
        screen.prompt.load_text("/info")
        await pilot.press("enter")
        await pilot.pause(0.05)
        info = str(screen.conversation.query(ChatNotice).last().render())
        assert "draft tiny-draft: " in info and "KV cache of" in info

    drive(app, scenario)


def test_the_loader_loads_a_draft_of_the_same_tokenizer_and_refuses_another(
        tmp_path, tiny_model_dir, tiny_tokenizer):
    from tiny_model import train_tokenizer, write_tiny_model

    from qwenchat.errors import UsageError
    from qwenchat.tui.loader import model_loader

    steps: list[str] = []
    same = write_tiny_model(tmp_path / "same", tokenizer=tiny_tokenizer, seed=9)
    loaded = model_loader(ChatOptions(str(tiny_model_dir), backend="cpu", draft=str(same)))(
        steps.append, steps.append, lambda _: None)
    try:
        assert loaded.proposer is not None and loaded.proposer.engine.config.vocab_size == \
            loaded.engine.config.vocab_size
        assert any(s.startswith("loading the draft model") for s in steps)
        model_line, draft_line = loaded.describe().splitlines()
        assert model_line.startswith(f"model {tiny_model_dir}: ")
        assert draft_line.startswith(f"draft {same}: ") and "reference" in draft_line
    finally:
        loaded.close()
    other = write_tiny_model(tmp_path / "other", tokenizer=train_tokenizer(300))
    with pytest.raises(UsageError, match="its tokenizer is not the model's"):
        model_loader(ChatOptions(str(tiny_model_dir), backend="cpu", draft=str(other)))(
            steps.append, steps.append, lambda _: None)


def test_an_int8_kv_cache_is_named_in_the_status_bar_and_model_info(tmp_path, tiny_model_dir):
    from qwenchat.tui.loader import model_loader

    loaded = model_loader(ChatOptions(str(tiny_model_dir), backend="cpu", kv_cache="int8"))(
        lambda _: None, lambda _: None, lambda _: None)
    try:
        assert loaded.engine.kv_format == "int8"
        assert "int8 KV cache" in loaded.describe()
    finally:
        loaded.close()
    model = open_model_dir(tiny_model_dir, "tiny-qwen3")
    engine = ReferenceEngine(model.config, model.checkpoint, kv_cache="int8")
    app = make_app(tmp_path, LoadedModel(model.spec, model.directory, engine, model.tokenizer,
                                         model.eos_ids))

    async def scenario(pilot, screen):
        assert "int8 KV cache" in str(screen.query_one("#engine").render())

    drive(app, scenario)


def test_rope_scaling_reaches_the_model_and_shows_in_the_kv_gauge_and_model_info(
        tmp_path, tiny_model_dir):
    """--rope-scaling yarn:2 on the tiny model (trained for 512 positions): the engine runs
    YaRN with 1,024 positions, /info names the trained length and the scaling, the KV gauge
    says YaRN."""
    from qwenchat.tui.loader import model_loader

    loaded = model_loader(ChatOptions(str(tiny_model_dir), backend="cpu",
                                      rope_scaling="yarn:2"))(
        lambda _: None, lambda _: None, lambda _: None)
    try:
        assert loaded.engine.capacity == 1024
        assert "YaRN x2 over 512 trained positions, to 1,024" in loaded.describe()
    finally:
        loaded.close()
    model = open_model_dir(tiny_model_dir, "tiny-qwen3")
    plain = ReferenceEngine(model.config, model.checkpoint)
    assert "RoPE, trained for 512 positions" in _engine_text(plain)
    config = rope.with_flag(model.config, "yarn:2")
    app = make_app(tmp_path, LoadedModel(model.spec, model.directory,
                                         ReferenceEngine(config, model.checkpoint),
                                         model.tokenizer, model.eos_ids))

    async def scenario(pilot, screen):
        assert "/1,024 YaRN ×2" in str(screen.query_one(KVGauge).render())

    drive(app, scenario)


def test_the_speculation_switch_turns_prompt_lookup_on_and_off_live(tmp_path, tiny_model_dir):
    quote = "def add(a, b):\n    return a + b\n" * 3
    app = make_app(tmp_path, reference_model(tiny_model_dir),
                   overrides={"temperature": 0.0, "max_tokens": 40})

    async def scenario(pilot, screen):
        await pilot.press("ctrl+s")  # the sampler panel
        switch = screen.query_one("#speculation")
        assert not switch.value and screen.chat.session.speculate == 0
        switch.toggle()
        await until(pilot, lambda: screen.chat.session.speculate > 0)
        screen.prompt.text = f"Repeat this:\n{quote}"
        await press_and_wait_for_reply(pilot, screen, "enter")
        stats = screen.chat.session.last_reply.stats
        assert stats.spec_passes > 0
        assert replies(screen)[-1].answer == greedy_answer(
            tiny_model_dir, [f"Repeat this:\n{quote}"], 40)
        switch.toggle()
        await until(pilot, lambda: screen.chat.session.speculate == 0)
        await send(pilot, screen, "Hello")
        assert screen.chat.session.last_reply.stats.spec_passes == 0

    drive(app, scenario)


def test_the_speculation_switch_on_an_engine_that_cannot_verify_says_so_and_stays_off(
        tmp_path, tiny_model_dir):
    app = make_app(tmp_path, fake_model(tiny_model_dir, "Yes."))

    async def scenario(pilot, screen):
        await pilot.press("ctrl+s")
        switch = screen.query_one("#speculation")
        switch.toggle()
        await until(pilot, lambda: any("does not verify proposals" in str(t.render())
                                       for t in screen.query(Toast)))
        await until(pilot, lambda: not switch.value)
        assert screen.chat.session.speculate == 0

    drive(app, scenario, notifications=True)

"""The chat's non-UI parts: slash commands, sampler settings, the reply feed, stats, copy."""

from __future__ import annotations

import pytest

from qwenchat.errors import UsageError
from qwenchat.sampling.params import NON_THINKING, THINKING, check_value
from qwenchat.session import Progress, ReplyStats, TextPiece, TurnsDropped
from qwenchat.tui.clipboard import last_code_block, unsupported_reason
from qwenchat.tui.commands import HELP, Command, interpret
from qwenchat.tui.feed import ReplyFeed
from qwenchat.tui.settings import ChatSettings
from qwenchat.tui.stats import RateMeter, kv_level, reply_summary, stats_from_dict
from qwenchat.tui.status_layout import (
    DEGRADE,
    Piece,
    activity_piece,
    engine_piece,
    fit,
    gauge_piece,
    idle_numbers,
    line_width,
    live_numbers,
    short_device,
)


@pytest.mark.parametrize(("typed", "command"), [
    ("/set temperature 0.3", Command("set", "temperature", 0.3)),
    ("/set top-p 0.5", Command("set", "top_p", 0.5)),
    ("/set TOP_K 7", Command("set", "top_k", 7)),
    ("/set seed none", Command("set", "seed", None)),
    ("/set max-tokens 64", Command("set", "max_tokens", 64)),
    ("/set min-p default", Command("reset", "min_p")),
    ("/set thinking on", Command("think")),
    ("/set think off", Command("no_think")),
    ("/reset", Command("reset")),
    ("/reset top-k", Command("reset", "top_k")),
    ("/show", Command("show")),
    ("  /think  ", Command("think")),
    ("/no_think", Command("no_think")),
    ("/no-think", Command("no_think")),
    ("/retry", Command("regen")),
    ("/?", Command("help")),
    ("/system You are terse.\nAnswer in French.",
     Command("system", text="You are terse.\nAnswer in French.")),
    ("/system", Command("system")),
    ("/rename  My   chat ", Command("rename", text="My chat")),
    ("/copy", Command("copy")),
    ("/copy code", Command("copy", "code")),
    ("/export md", Command("export", "md")),
    ("/export markdown ~/notes/fox chat.md", Command("export", "md", text="~/notes/fox chat.md")),
    ("/export json out.json", Command("export", "json", text="out.json")),
])
def test_commands_parse_to_what_they_mean(typed, command):
    assert interpret(typed) == command


@pytest.mark.parametrize("typed", ["Hello", "what does /think do?", "  indented\ntext"])
def test_plain_text_is_a_message_sent_as_typed(typed):
    assert interpret(typed) == typed


def test_a_double_slash_sends_a_message_starting_with_a_slash():
    assert interpret("//usr/bin is where") == "/usr/bin is where"


@pytest.mark.parametrize(("typed", "needle"), [
    ("/set temperature 5", "temperature must be 0 to 2 (0 = greedy); got 5.0"),
    ("/set top-p 0", "top-p must be greater than 0, at most 1; got 0.0"),
    ("/set top-k 2.5", "top-k must be an integer from 0 to 1000000 (0 = off); got '2.5'"),
    ("/set warmth 1", "unknown sampling parameter 'warmth'"),
    ("/set temperature", "usage: /set NAME VALUE"),
    ("/set thinking maybe", "thinking must be on or off"),
    ("/reset warmth", "unknown sampling parameter"),
    ("/think harder", "/think takes nothing after it"),
    ("/rename", "usage: /rename TITLE"),
    ("/export pdf", "usage: /export md|json [FILE]"),
    ("/copy all", "usage: /copy [code]"),
    ("/frobnicate", "unknown command /frobnicate: /help lists them"),
])
def test_bad_commands_say_what_is_wrong(typed, needle):
    with pytest.raises(UsageError) as caught:
        interpret(typed)
    assert needle in str(caught.value)


def test_set_uses_the_cli_range_messages():
    with pytest.raises(UsageError) as from_cli:
        check_value("presence_penalty", 3.0)
    with pytest.raises(UsageError) as from_chat:
        interpret("/set presence-penalty 3")
    assert str(from_chat.value) == str(from_cli.value)


def test_every_command_has_help():
    for entry in HELP.values():
        assert entry.usage.startswith("/") and entry.summary


def test_switching_mode_takes_its_preset_but_keeps_what_the_user_set(tiny_model_dir):
    settings = ChatSettings(tiny_model_dir, thinking=False)
    assert settings.params == NON_THINKING
    settings.set("top_k", 5)
    settings.thinking = True
    assert settings.params == THINKING.with_updates(top_k=5)
    settings.thinking = False
    assert settings.params == NON_THINKING.with_updates(top_k=5)
    settings.reset("top_k")
    assert settings.params == NON_THINKING


def test_settings_round_trip_through_the_history_format(tiny_model_dir):
    settings = ChatSettings(tiny_model_dir, thinking=True, overrides={"seed": 7, "top_k": 20})
    stored = settings.as_dict()
    assert stored["thinking"] is True and stored["temperature"] == 0.6 and stored["seed"] == 7
    back = ChatSettings.from_dict(tiny_model_dir, stored)
    assert back.params == settings.params
    assert back.overrides == {"seed": 7}  # equal to the preset: followed the preset


def test_stored_settings_that_no_longer_validate_are_dropped(tiny_model_dir):
    back = ChatSettings.from_dict(tiny_model_dir, {"temperature": 9, "top_k": 3})
    assert back.overrides == {"top_k": 3}


def test_feed_merges_pieces_keeps_the_latest_stats_and_reports_the_end():
    feed = ReplyFeed()
    stats = ReplyStats(generated_tokens=1)
    feed.put(TurnsDropped(1, "dropped"))
    for text, kind in [("a", "thinking"), ("b", "thinking"), ("c", "answer"), ("d", "answer")]:
        feed.put(TextPiece(text, kind))
    feed.put(Progress(stats))
    stats.generated_tokens = 2  # the session mutates its stats after handing them over
    batch = feed.take()
    assert batch.pieces == [TextPiece("ab", "thinking"), TextPiece("cd", "answer")]
    assert batch.stats is not None and batch.stats.generated_tokens == 1
    assert [d.count for d in batch.dropped] == [1] and not batch.done
    assert feed.take().pieces == []
    feed.pump(iter([TextPiece("e", "answer")]))
    last = feed.take()
    assert last.done and last.error is None and last.pieces == [TextPiece("e", "answer")]


def test_feed_passes_on_a_failure():
    def failing():
        yield TextPiece("x", "answer")
        raise RuntimeError("boom")

    feed = ReplyFeed()
    feed.pump(failing())
    batch = feed.take()
    assert batch.done and isinstance(batch.error, RuntimeError)
    assert feed.wait_ended(0)


def test_rate_meter_measures_the_last_second_on_the_reply_clock():
    meter = RateMeter(window_s=1.0)
    assert meter.rate is None
    for second in range(5):  # 100 tok/s for 5 s, then 1000 tok/s
        meter.add(ReplyStats(generated_tokens=1 + 100 * second, decode_s=float(second)))
    assert meter.rate == pytest.approx(100)
    meter.add(ReplyStats(generated_tokens=1401, decode_s=5.0))
    meter.add(ReplyStats(generated_tokens=2401, decode_s=6.0))
    assert meter.rate == pytest.approx(1000)


def test_summary_line_has_tokens_speed_ttft_and_stop_reason():
    stats = ReplyStats(generated_tokens=101, decode_s=0.05, ttft_s=0.0123, stop_reason="eos")
    assert reply_summary(stats) == "101 tokens · 2,000 tok/s · TTFT 12 ms · stop: eos"
    stats.stop_reason = "cancelled"
    assert reply_summary(stats).endswith("· stopped")
    assert stats_from_dict({**stats.as_dict(), "unknown": 1}) == stats


@pytest.mark.parametrize(("position", "level"), [(0, "ok"), (74, "ok"), (75, "warn"),
                                                 (89, "warn"), (90, "full"), (100, "full")])
def test_kv_levels(position, level):
    assert kv_level(position, 100) == level


# A long reply streaming on an H100 with speculation on and YaRN: every piece the bar has.
STREAMING = ReplyStats(prompt_tokens=30_000, reused_tokens=28_811, prefill_tokens=1_189,
                       generated_tokens=1_543, ttft_s=0.356, decode_s=1.3, position=32_743,
                       capacity=40_960, spec_proposed=900, spec_accepted=600)


def streaming_bar() -> list[Piece]:
    return [engine_piece("cuda (NVIDIA H100 80GB HBM3)", "NVIDIA H100 80GB HBM3", "fp8", "int8"),
            activity_piece(STREAMING), *live_numbers(STREAMING, 1234.0),
            gauge_piece(STREAMING.position, STREAMING.capacity, "YaRN ×4")]


def shown(pieces: list[Piece], width: int) -> dict[str, str]:
    chosen = fit(pieces, width)
    return {piece.name: piece.forms[chosen[piece.name]] for piece in pieces}


def test_the_status_bar_keeps_live_speed_and_the_kv_position_from_60_columns_up():
    pieces = streaming_bar()
    for width in range(60, 240):
        texts = shown(pieces, width)
        assert line_width(pieces, fit(pieces, width)) <= width
        assert texts["rate"] == "1,234 tok/s (avg 1,186)"
        assert "32,743/40,960" in texts["kv"]
        assert texts["activity"] == "● generating"
    assert shown(pieces, 240) == {piece.name: piece.forms[0] for piece in pieces}


def test_the_status_bar_leaves_pieces_out_in_the_stated_order_and_for_good():
    pieces = streaming_bar()
    wide = line_width(pieces, fit(pieces, 10_000))
    assert shown(pieces, wide - 1)["engine"] == "H100 · fp8 · int8 KV"  # the first to give way
    left_out: list[str] = []
    for width in range(wide, 0, -1):
        out = [name for name, text in shown(pieces, width).items() if not text]
        assert set(left_out) <= set(out)  # once out, out at every narrower width
        left_out += [name for name in out if name not in left_out]
    assert left_out == ["prompt", "ttft", "speculation", "engine"]
    last_step = {name: i for i, name in enumerate(DEGRADE)}  # the step that leaves each out
    assert left_out == sorted(left_out, key=last_step.get)


def test_the_room_a_dropped_piece_frees_goes_to_the_pieces_still_shown():
    pieces = streaming_bar()
    assert shown(pieces, 100) == {
        "engine": "H100 · fp8 · int8 KV", "activity": "● generating",
        "rate": "1,234 tok/s (avg 1,186)", "ttft": "", "speculation": "", "prompt": "",
        "kv": "KV ████████░░ 32,743/40,960 YaRN ×4"}
    assert shown(pieces, 80) == {  # the engine label out: the gauge whole again
        "engine": "", "activity": "● generating", "rate": "1,234 tok/s (avg 1,186)",
        "ttft": "", "speculation": "", "prompt": "", "kv": "KV ████████░░ 32,743/40,960 YaRN ×4"}
    for width in range(30, 200):  # no piece shown could be wider and still fit
        chosen = fit(pieces, width)
        for piece in pieces:
            if chosen[piece.name] and piece.forms[chosen[piece.name]]:
                wider = {**chosen, piece.name: chosen[piece.name] - 1}
                assert line_width(pieces, wider) > width, (width, piece.name)


def test_a_status_bar_that_fits_is_shown_whole():
    pieces = [engine_piece("reference (NumPy, CPU)", "CPU", "bf16", "bf16"),
              activity_piece(None), *idle_numbers(None), gauge_piece(12, 4096, "")]
    width = line_width(pieces, fit(pieces, 10_000))
    assert width == len(" reference (NumPy, CPU) · bf16 weights  KV ░░░░░░░░░░ 12/4,096 ")
    assert shown(pieces, width)["engine"] == "reference (NumPy, CPU) · bf16 weights"
    assert shown(pieces, width - 1)["engine"] == "CPU · bf16"


@pytest.mark.parametrize(("device", "short"), [
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H100 PCIe", "H100"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ("NVIDIA H200 NVL", "H200"), ("CPU", "CPU")])
def test_the_short_engine_label_names_the_gpu_model(device, short):
    assert short_device(device) == short


def test_last_code_block_finds_the_last_fence_even_if_unclosed():
    reply = "Try:\n```python\nx = 1\n```\nor\n~~~\ny = 2\n~~~\n"
    assert last_code_block(reply) == "y = 2"
    assert last_code_block(reply + "```sh\nls -l\n") == "ls -l"
    assert last_code_block("no code") is None


@pytest.mark.parametrize(("env", "expected"), [
    ({"TERM_PROGRAM": "Apple_Terminal"}, "macOS Terminal"),
    ({"TERM": "linux"}, "Linux console"),
    ({"VTE_VERSION": "7600"}, "VTE"),
    ({"TERM_PROGRAM": "WezTerm"}, None),
    ({"VTE_VERSION": "7600", "TMUX": "/tmp/tmux"}, None),
])
def test_terminals_that_ignore_clipboard_requests_are_named(env, expected):
    reason = unsupported_reason(env, tmux=lambda name: "on")
    assert (reason is None) if expected is None else (expected in reason)


@pytest.mark.parametrize(("setting", "expected"), [
    ("external", "set-clipboard is external"),  # tmux's default: programs are ignored
    ("off", "set-clipboard is off"),
    ("on", None),
    (None, None),  # tmux could not be asked: nothing is known
])
def test_tmux_passes_clipboard_requests_on_only_with_set_clipboard_on(setting, expected):
    asked = []
    reason = unsupported_reason({"TMUX": "/tmp/tmux-0/default,1,0"},
                                tmux=lambda name: asked.append(name) or setting)
    assert asked == ["set-clipboard"]
    assert (reason is None) if expected is None else (expected in reason)
    assert reason is None or "tmux set -g set-clipboard on" in reason

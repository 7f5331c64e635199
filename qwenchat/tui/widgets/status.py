"""The status bar: engine and GPU, live speed and timings, prompt reuse, and the KV gauge,
fitted to its width by priority (qwenchat/tui/status_layout.py) as it changes."""

from __future__ import annotations

import sys

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Static

from qwenchat.session import ReplyStats
from qwenchat.tui.stats import kv_level
from qwenchat.tui.status_layout import (
    GAUGE_CELLS,
    GAUGE_FORMS,
    Piece,
    activity_piece,
    fit,
    gauge_piece,
    gauge_text,
    idle_numbers,
    joined,
    live_numbers,
)


class KVGauge(Widget):
    """How full the KV cache is: amber from 75 %, red from 90 %."""

    position: reactive[int] = reactive(0, layout=True)  # the text's width changes
    capacity: reactive[int] = reactive(1, layout=True)
    note: reactive[str] = reactive("", layout=True)  # the RoPE scaling in force (rope.py)
    cells: reactive[int] = reactive(GAUGE_CELLS, layout=True)  # fewer, or none, when narrow
    show_note: reactive[bool] = reactive(True, layout=True)
    unavailable: reactive[str] = reactive("", layout=True)  # not known: says so instead

    def render(self) -> Text:
        if self.unavailable:
            return Text(self.unavailable, style="dim")
        return gauge_text(self.position, self.capacity, self.cells,
                          self.note if self.show_note else "")

    def watch_position(self) -> None:
        self._set_level()

    def watch_capacity(self) -> None:
        self._set_level()

    def _set_level(self) -> None:
        level = kv_level(self.position, self.capacity)
        self.set_class(level == "warn", "-warn")
        self.set_class(level == "full", "-full")


class StatusBar(Horizontal):
    def __init__(self, engine: Piece, id: str | None = None, rope_note: str = "",
                 kv_unavailable: str = ""):
        """`engine`: the label (status_layout's engine_piece or remote_piece);
        `kv_unavailable`: what the gauge says where the KV cache is not known."""
        super().__init__(id=id)
        self._engine_piece = engine
        self._activity_piece = activity_piece(None)
        self._number_pieces: list[Piece] = []
        self._engine = Static(self._engine_piece.forms[0], id="engine", markup=False)
        self._engine.tooltip = self._engine_piece.forms[0]  # the whole label, however narrow
        self._activity = Static("", id="activity", markup=False)
        self._numbers = Static("", id="numbers", markup=False)
        self._gauge = KVGauge(id="kv")
        self._gauge.note = rope_note
        self._gauge.unavailable = kv_unavailable

    def compose(self) -> ComposeResult:
        yield self._engine
        yield self._activity
        yield self._numbers
        yield self._gauge

    def live(self, stats: ReplyStats, rate_now: float | None, stopping: bool) -> None:
        """While a reply streams: speed now and on average, TTFT, prompt reuse."""
        self._activity_piece = activity_piece(stats, stopping)
        self._number_pieces = live_numbers(stats, rate_now)
        self.gauge(stats.position or stats.prompt_tokens, stats.capacity)

    def idle(self, stats: ReplyStats | None, position: int, capacity: int) -> None:
        """Between replies: the last reply's numbers, and the cache as it is now."""
        self._activity_piece = activity_piece(None)
        self._number_pieces = idle_numbers(stats)
        self.gauge(position, capacity)

    def starting(self) -> None:
        self._activity_piece = activity_piece(ReplyStats())
        self._number_pieces = []
        self._refit()

    def gauge(self, position: int, capacity: int) -> None:
        self._gauge.capacity = max(capacity, 1)
        self._gauge.position = position
        self._refit()

    def on_resize(self, event: events.Resize) -> None:
        self._refit()

    def _refit(self) -> None:
        """Show every piece in the widest form the bar's width allows (before the first
        layout the width is unknown: all of them whole)."""
        gauge = self._gauge
        pieces = [self._engine_piece, self._activity_piece, *self._number_pieces,
                  gauge_piece(gauge.position, gauge.capacity, gauge.note, gauge.unavailable)]
        chosen = fit(pieces, self.size.width or sys.maxsize)
        for widget, static in (("engine", self._engine), ("activity", self._activity),
                               ("numbers", self._numbers)):
            text = joined(pieces, chosen, widget)
            static.update(text)
            if static is not self._numbers:
                static.display = bool(text)
        gauge.cells, gauge.show_note = GAUGE_FORMS[chosen["kv"]]

"""The status bar: engine and GPU, live speed and timings, prompt reuse, and the KV gauge."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Static

from qwenchat.session import ReplyStats
from qwenchat.tui.stats import kv_level, rate_text, speculation_text, ttft_text

GAUGE_CELLS = 10


class KVGauge(Widget):
    """How full the KV cache is: amber from 75 %, red from 90 %."""

    position: reactive[int] = reactive(0, layout=True)  # the text's width changes
    capacity: reactive[int] = reactive(1, layout=True)
    note: reactive[str] = reactive("", layout=True)  # the RoPE scaling in force (rope.py)

    def render(self) -> Text:
        used = min(1.0, self.position / self.capacity) if self.capacity else 0.0
        filled = round(used * GAUGE_CELLS)
        bar = Text("KV ")
        bar.append("█" * filled, style="bold")
        bar.append("░" * (GAUGE_CELLS - filled), style="dim")
        bar.append(f" {self.position:,}/{self.capacity:,}")
        if self.note:
            bar.append(f" {self.note}", style="dim")
        return bar

    def watch_position(self) -> None:
        self._set_level()

    def watch_capacity(self) -> None:
        self._set_level()

    def _set_level(self) -> None:
        level = kv_level(self.position, self.capacity)
        self.set_class(level == "warn", "-warn")
        self.set_class(level == "full", "-full")


class StatusBar(Horizontal):
    def __init__(self, engine: str, device: str, weights: str = "bf16", kv: str = "bf16",
                 id: str | None = None, rope_note: str = ""):
        super().__init__(id=id)
        label = f"{engine} · {device}" if device not in engine else engine
        label += f" · {weights} weights"
        if kv != "bf16":  # (the usual cache goes unsaid)
            label += f" · {kv} KV cache"
        self._engine = Static(label, id="engine", markup=False)
        self._activity = Static("", id="activity", markup=False)
        self._numbers = Static("", id="numbers", markup=False)
        self._gauge = KVGauge(id="kv")
        self._gauge.note = rope_note

    def compose(self) -> ComposeResult:
        yield self._engine
        yield self._activity
        yield self._numbers
        yield self._gauge

    def live(self, stats: ReplyStats, rate_now: float | None, stopping: bool) -> None:
        """While a reply streams: speed now and on average, TTFT, prompt reuse."""
        numbers = (f"{rate_text(rate_now)} tok/s (avg {rate_text(stats.decode_tok_s)})"
                   f" · {self._common(stats)}")
        if stopping:
            activity = "■ stopping"
        elif stats.generated_tokens:
            activity = "● generating"
        elif 0 < stats.prefill_done < stats.prefill_tokens:  # a long prompt, part way
            # (the footer already says Esc stops it: the bar keeps its room for the numbers)
            activity = f"● reading the prompt {stats.prefill_done:,}/{stats.prefill_tokens:,}"
            prefill_rate = stats.prefill_done / stats.prefill_s if stats.prefill_s > 0 else None
            numbers = f"prefill {rate_text(prefill_rate)} tok/s · {self._common(stats)}"
        else:
            activity = "● reading the prompt"
        self._show(activity, numbers)
        self.gauge(stats.position or stats.prompt_tokens, stats.capacity)

    def idle(self, stats: ReplyStats | None, position: int, capacity: int) -> None:
        """Between replies: the last reply's numbers, and the cache as it is now."""
        numbers = ""
        if stats is not None:
            numbers = f"{rate_text(stats.decode_tok_s)} tok/s · {self._common(stats)}"
        self._show("", numbers)
        self.gauge(position, capacity)

    def starting(self) -> None:
        self._show("● reading the prompt", "")

    def gauge(self, position: int, capacity: int) -> None:
        self._gauge.capacity = max(capacity, 1)
        self._gauge.position = position

    def _show(self, activity: str, numbers: str) -> None:
        self._activity.update(activity)
        self._activity.display = bool(activity)
        self._numbers.update(numbers)

    @staticmethod
    def _common(stats: ReplyStats) -> str:
        # (speculation's figures before the prompt's, which a narrow bar cuts first)
        speculation = speculation_text(stats)
        return (f"TTFT {ttft_text(stats)} · " + (f"{speculation} · " if speculation else "")
                + f"prompt {stats.prefill_tokens:,} new + {stats.reused_tokens:,} cached")

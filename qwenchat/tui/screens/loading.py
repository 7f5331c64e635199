"""Start-up: each loading step (finding, downloading, loading weights, compiling kernels) with
its time, ticking, so a slow step never looks like a frozen screen."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Static

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


class LoadingScreen(Screen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [("ctrl+q", "app.quit", "Quit")]

    def __init__(self, model: str, clock: Callable[[], float]):
        super().__init__()
        self._model = model
        self._clock = clock
        self._started = clock()
        self._steps: list[tuple[str, float, float | None]] = []  # text, start, end
        self._details: dict[int, str] = {}  # a step's progress (a download's bytes), by index
        self._notes: list[str] = []  # warnings that came up on the way

    def compose(self) -> ComposeResult:
        with Vertical(id="loading-box"):
            yield Static(f"qwenchat · starting {self._model}", id="loading-title",
                         markup=False)
            yield Static("", id="loading-steps", markup=False)
            yield Static("", id="loading-total", markup=False)

    def on_mount(self) -> None:
        self._render_steps()
        self.set_interval(0.1, self._render_steps)

    def step(self, text: str) -> None:
        """The loader moved on: the previous step is done."""
        now = self._clock()
        self._end_current(now)
        self._steps.append((text, now, None))
        self._render_steps()

    def progress(self, text: str) -> None:
        """How far the current step has got; shown under it (and kept once it is done)."""
        if self._steps:
            self._details[len(self._steps) - 1] = text
            self._render_steps()

    def note(self, text: str) -> None:
        self._notes.append(text)
        self._render_steps()

    def finish(self) -> None:
        self._end_current(self._clock())
        self._render_steps()

    def _end_current(self, now: float) -> None:
        if self._steps and self._steps[-1][2] is None:
            text, start, _ = self._steps[-1]
            self._steps[-1] = (text, start, now)

    def _render_steps(self) -> None:
        if not self.is_mounted:  # a step can arrive before the screen is composed
            return
        now = self._clock()
        lines = []
        for index, (text, start, end) in enumerate(self._steps):
            mark = "✓" if end is not None else SPINNER[int(now * 10) % len(SPINNER)]
            lines.append(f"{mark} {(end or now) - start:5.1f} s  {text}")
            if index in self._details:
                lines.append(f"{'':11}{self._details[index]}")
        lines += [f"⚠ {note}" for note in self._notes]
        self.query_one("#loading-steps", Static).update("\n".join(lines) or "…")
        self.query_one("#loading-total", Static).update(
            f"{now - self._started:.1f} s · Ctrl+Q quits")

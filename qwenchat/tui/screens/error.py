"""Why qwenchat could not start, with the fix, readable: never a traceback (unless --debug)."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Static


class ErrorScreen(Screen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [("q,escape,enter", "app.quit", "Quit")]

    def __init__(self, message: str, details: str | None = None):
        super().__init__()
        self._message = message
        self._details = details

    def compose(self) -> ComposeResult:
        with Vertical(id="error-box"):
            yield Static("qwenchat could not start", id="error-title")
            yield Static(self._message, id="error-message", markup=False)
            if self._details:
                with VerticalScroll(id="error-details"):
                    yield Static(self._details, markup=False)
            yield Static("Press q, Enter or Esc to quit.", id="error-hint")

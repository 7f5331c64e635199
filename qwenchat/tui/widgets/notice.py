"""A line in the conversation that is no message: turns dropped from context, errors."""

from __future__ import annotations

from textual.widgets import Static


class ChatNotice(Static):
    def __init__(self, text: str, level: str = "warning"):
        super().__init__(f"⚠ {text}" if level != "info" else text, markup=False,
                         classes=f"-{level}")

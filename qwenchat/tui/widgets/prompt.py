"""The message being written: Enter sends; Ctrl+J, Alt+Enter or Shift+Enter start a new line."""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import TextArea

from qwenchat.tui.keys import run_own_binding

# Ctrl+J and Alt+Enter reach us from every terminal; Shift+Enter only from terminals that
# report modifiers on Enter (kitty keyboard protocol: kitty, WezTerm, foot, Ghostty, ...).
NEWLINE_KEYS = ("ctrl+j", "alt+enter", "shift+enter")


class PromptInput(TextArea):
    class Submitted(Message):
        """Enter on a message: the prompt is already empty (`give_back` if it fails)."""

        def __init__(self, text: str):
            super().__init__()
            self.text = text

    class EditLast(Message):
        """Up in an empty prompt: bring the last message back to edit it."""

    def __init__(self, *, id: str | None = None, placeholder: str = ""):
        super().__init__(soft_wrap=True, tab_behavior="focus", compact=True,
                         highlight_cursor_line=False, id=id, placeholder=placeholder)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            self._claim(event)
            if self.text.strip():
                # Emptied now, not when the screen gets to the message: what the user types
                # in the meantime belongs to the next message and must stay.
                text = self.text
                self.clear()
                self.post_message(self.Submitted(text))
        elif event.key in NEWLINE_KEYS:
            self._claim(event)
            start, end = self.selection
            self.replace("\n", start, end, maintain_selection_offset=False)
        elif event.key == "up" and not self.text:
            self._claim(event)
            self.post_message(self.EditLast())
        elif not await run_own_binding(self, event):
            await super()._on_key(event)

    def give_back(self, text: str) -> None:
        """Put a message that could not be sent back, before anything typed since."""
        self.load_text(text + self.text)
        self.move_cursor(self.document.end)

    @staticmethod
    def _claim(event: events.Key) -> None:
        event.stop()
        event.prevent_default()

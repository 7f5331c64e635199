"""The message being written: Enter sends; Ctrl+J, Alt+Enter or Shift+Enter start a new line."""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import TextArea

# Ctrl+J and Alt+Enter reach us from every terminal; Shift+Enter only from terminals that
# report modifiers on Enter (kitty keyboard protocol: kitty, WezTerm, foot, Ghostty, ...).
NEWLINE_KEYS = ("ctrl+j", "alt+enter", "shift+enter")


class PromptInput(TextArea):
    class Submitted(Message):
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
            self.post_message(self.Submitted(self.text))
        elif event.key in NEWLINE_KEYS:
            self._claim(event)
            start, end = self.selection
            self.replace("\n", start, end, maintain_selection_offset=False)
        elif event.key == "up" and not self.text:
            self._claim(event)
            self.post_message(self.EditLast())
        else:
            await super()._on_key(event)

    @staticmethod
    def _claim(event: events.Key) -> None:
        event.stop()
        event.prevent_default()

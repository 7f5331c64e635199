"""Keys as terminals really send them, where Textual reads them otherwise."""

from __future__ import annotations

from enum import Enum

from textual import events
from textual.widget import Widget
from textual.widgets import Input


class _Key(str, Enum):
    ALT_ENTER = "alt+enter"


def read_alt_enter() -> None:
    """Make ESC CR arrive as Alt+Enter, not as a plain Enter.

    xterm, GNOME Terminal, tmux, Alacritty and most other terminals send Alt+Enter as ESC
    followed by CR. Textual drops the Alt of any key in its sequence table, Enter included,
    so Alt+Enter would send the message instead of starting a new line. Adding the pair to
    that table (Textual's own; kitty-protocol terminals report Alt+Enter without it) makes
    the parser report "alt+enter". Safe to call more than once; a Textual without the table
    leaves Ctrl+J as the new-line key that works everywhere.
    """
    try:
        from textual._ansi_sequences import ANSI_SEQUENCES_KEYS
    except ImportError:
        return
    if isinstance(ANSI_SEQUENCES_KEYS, dict):
        ANSI_SEQUENCES_KEYS.setdefault("\x1b\r", (_Key.ALT_ENTER,))


async def run_own_binding(widget: Widget, event: events.Key) -> bool:
    """Run `widget`'s own binding for the key now, in turn with the typed characters.

    Textual inserts typed characters as their key events reach an Input or a TextArea, but
    runs the widget's bound keys (Backspace, arrows, Ctrl+U...) only once the event has
    bubbled up to the app: keys that arrive together (fast typing, a busy moment while a
    reply streams, keys sent by a script) come out of order, so "ab⌫c" can end as "ac" and
    a cleared field as the text typed after Ctrl+U. The widget's bindings come first in the
    binding chain anyway, so running them here changes which binding wins for no key.
    (Textual issue #6605.)
    """
    for binding in widget._bindings.key_to_bindings.get(event.key, ()):
        if not binding.priority and await widget.app.run_action(binding.action, widget):
            event.stop()
            event.prevent_default()
            return True
    return False


class FieldInput(Input):
    """A one-line field whose bound keys keep their place among the typed characters."""

    async def _on_key(self, event: events.Key) -> None:
        if not await run_own_binding(self, event):
            await super()._on_key(event)

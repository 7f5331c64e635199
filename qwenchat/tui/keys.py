"""Keys as terminals really send them, where Textual reads them otherwise."""

from __future__ import annotations

from enum import Enum


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

"""What Copy puts on the clipboard, and the terminals known to ignore a program's request."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")


def last_code_block(markdown: str) -> str | None:
    """The body of the last fenced code block, or None when the text has none.

    A reply stopped inside a block has no closing fence: its block counts, up to the end.
    """
    blocks: list[list[str]] = []
    fence: str | None = None
    for line in markdown.splitlines():
        found = FENCE.match(line)
        if fence is None:
            if found:
                fence = found.group(1)
                blocks.append([])
        elif found and found.group(1).startswith(fence) and not line.strip().strip(fence[0]):
            fence = None
        else:
            blocks[-1].append(line)
    return "\n".join(blocks[-1]) if blocks else None


def unsupported_reason(env: Mapping[str, str] | None = None) -> str | None:
    """Why this terminal will not take text from a program (OSC 52), when that is known."""
    env = os.environ if env is None else env
    if env.get("TERM_PROGRAM") == "Apple_Terminal":
        return "macOS Terminal does not let programs set the clipboard"
    if env.get("TERM") == "linux":
        return "the Linux console has no clipboard"
    if env.get("VTE_VERSION") and not env.get("TMUX"):
        return "VTE terminals (GNOME Terminal, Tilix) ignore clipboard requests from programs"
    return None

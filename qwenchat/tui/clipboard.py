"""What Copy puts on the clipboard, and the terminals known to ignore a program's request."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Mapping

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


def tmux_option(name: str) -> str | None:
    """A global tmux option of the server this process runs under, or None if unknown."""
    try:
        done = subprocess.run(["tmux", "show-options", "-gv", name], capture_output=True,
                              text=True, timeout=2, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def unsupported_reason(env: Mapping[str, str] | None = None,
                       tmux: Callable[[str], str | None] = tmux_option) -> str | None:
    """Why this terminal will not take text from a program (OSC 52), when that is known."""
    env = os.environ if env is None else env
    if env.get("TERM_PROGRAM") == "Apple_Terminal":
        return "macOS Terminal does not let programs set the clipboard"
    if env.get("TERM") == "linux":
        return "the Linux console has no clipboard"
    if env.get("TMUX"):
        # tmux drops a program's clipboard request unless set-clipboard is "on"; its
        # default, "external", lets only tmux itself set the clipboard.
        setting = tmux("set-clipboard")
        if setting is not None and setting != "on":
            return (f"tmux ignores clipboard requests from programs while set-clipboard is "
                    f"{setting} (`tmux set -g set-clipboard on` lets them through)")
    if env.get("VTE_VERSION") and not env.get("TMUX"):
        return "VTE terminals (GNOME Terminal, Tilix) ignore clipboard requests from programs"
    return None

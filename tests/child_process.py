"""What the tests that start `qwenchat` as a child process share."""

from __future__ import annotations

import signal


def sigint_as_in_a_terminal() -> None:
    """A child's Ctrl+C as a terminal's foreground job has it (a `preexec_fn`): a job a script
    starts in the background (`pytest ... &`) runs with SIGINT ignored, and its children
    inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)

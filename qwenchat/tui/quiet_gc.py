"""Keeps Python's full garbage collections out of a streaming reply.

A full collection walks every object the chat has made (widgets, Markdown blocks, rendered
lines) while holding the GIL: measured at 0.1-0.23 s in a 20,000-token reply, long enough to
leave the reply's thread, and so the GPU, waiting (docs/perf.md). While a reply streams only
the young generations are collected, which stay short; the usual thresholds come back when it
ends, and the full collection runs while the user reads.
"""

from __future__ import annotations

import gc

NEVER = 1 << 30  # young collections before a full one: none while a reply streams


class FullCollectionsDeferred:
    def __init__(self) -> None:
        self._saved: tuple[int, int, int] | None = None

    def begin(self) -> None:
        if self._saved is None:
            self._saved = gc.get_threshold()
            young, middle, _ = self._saved
            gc.set_threshold(young, middle, NEVER)

    def end(self) -> None:
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None

    @property
    def active(self) -> bool:
        return self._saved is not None

"""Reply events handed from the generation thread to the UI in batches.

The engine may yield thousands of tokens a second; the UI takes whatever has arrived on its
own timer (about every 50 ms) as one batch, so the screen is redrawn at the UI's pace and
the generation thread never waits for it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from qwenchat.session import Event, Progress, ReplyStats, TextPiece, TurnsDropped


@dataclass
class Batch:
    pieces: list[TextPiece] = field(default_factory=list)  # adjacent pieces of a kind merged
    stats: ReplyStats | None = None  # the latest progress snapshot, if any arrived
    dropped: list[TurnsDropped] = field(default_factory=list)
    done: bool = False  # the generation has ended; nothing follows this batch
    error: BaseException | None = None  # what ended it, when it failed


class ReplyFeed:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: list[tuple[str, list[str]]] = []  # (kind, texts) in arrival order
        self._pending = Batch()
        self._ended = threading.Event()

    def put(self, event: Event) -> None:
        with self._lock:
            if isinstance(event, TextPiece):
                if self._runs and self._runs[-1][0] == event.kind:
                    self._runs[-1][1].append(event.text)
                else:
                    self._runs.append((event.kind, [event.text]))
            elif isinstance(event, Progress):
                self._pending.stats = replace(event.stats)  # the session keeps mutating its own
            elif isinstance(event, TurnsDropped):
                self._pending.dropped.append(event)

    def close(self, error: BaseException | None = None) -> None:
        with self._lock:
            self._pending.done = True
            self._pending.error = error
        self._ended.set()

    def take(self) -> Batch:
        """Everything that arrived since the last take."""
        with self._lock:
            batch, runs = self._pending, self._runs
            self._pending, self._runs = Batch(), []
        batch.pieces = [TextPiece("".join(texts), kind) for kind, texts in runs]
        return batch

    def wait_ended(self, timeout: float) -> bool:
        return self._ended.wait(timeout)

    @property
    def ended(self) -> bool:
        """The generation has returned: its thread no longer touches the engine."""
        return self._ended.is_set()

    def pump(self, events: Iterable[Event]) -> None:
        """Run in the generation thread: feed every event, then close with the outcome."""
        try:
            for event in events:
                self.put(event)
        except BaseException as exc:  # shown in the chat: the UI must outlive any failure
            self.close(exc)
        else:
            self.close()

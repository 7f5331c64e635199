"""The model's thinking: dimmed, apart from the answer, folded away once the answer starts."""

from __future__ import annotations

from typing import Any

from textual.widgets import Collapsible, Static


class ThinkingBlock(Collapsible):
    def __init__(self, text: str = "", streaming: bool = True, folded: bool = True):
        """`folded` is for a finished block: a reply that has no answer keeps it open."""
        self._thought = text
        self.streaming = streaming
        self._folding = False
        self._body = Static(text, markup=False, classes="thinking-text")
        super().__init__(self._body, title=self._heading(streaming),
                         collapsed=folded and not streaming)

    @property
    def text(self) -> str:
        return self._thought

    def append(self, text: str) -> None:
        self._thought += text
        self._body.update(self._thought)

    def finish(self, fold: bool = True) -> None:
        """The answer has begun: fold the thinking away (it stays one click or Enter away).
        A reply that ends with no answer (stopped, out of tokens) leaves it open: the
        thinking is all it has to show."""
        self.streaming = False
        self._thought = self._thought.rstrip("\n")
        self._body.update(self._thought)
        self.title = self._heading(streaming=False)
        if fold:
            self._folding = True
            self.collapsed = True

    def scroll_visible(self, *args: Any, **kwargs: Any) -> None:
        # Collapsible scrolls itself into view whenever it folds or opens. Folding as the
        # answer starts must not pull the conversation away from the reply it follows; a
        # user opening the block still gets it scrolled into view.
        if self._folding:
            self._folding = False
            return
        super().scroll_visible(*args, **kwargs)

    def _heading(self, streaming: bool) -> str:
        if streaming:
            return "Thinking…"
        return f"Thought for {len(self._thought.split()):,} words"

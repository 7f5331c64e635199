"""One turn of the conversation: the user's message, or a reply with its thinking and stats."""

from __future__ import annotations

from dataclasses import replace

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

from qwenchat.session import ReplyStats, TextPiece
from qwenchat.tui.stats import reply_summary
from qwenchat.tui.widgets.thinking import ThinkingBlock


class UserMessage(Static):
    def __init__(self, text: str):
        super().__init__(text, markup=False)
        self.text = text


class AssistantMessage(Vertical):
    """A reply: streamed as Markdown while it arrives, then closed with a summary line."""

    def __init__(self, answer: str = "", thinking: str = "", stats: ReplyStats | None = None,
                 stopped: bool = False, streaming: bool = False):
        super().__init__(classes="-streaming" if streaming else "")
        self._answer = answer
        self._thinking: ThinkingBlock | None = (
            ThinkingBlock(thinking, streaming=False) if thinking else None)
        self._markdown = Markdown(answer)
        self._summary = Static("", markup=False, classes="summary")
        self._stream: MarkdownStream | None = None
        self._final = (stats, stopped) if not streaming else None

    def compose(self) -> ComposeResult:
        if self._thinking is not None:
            yield self._thinking
        yield self._markdown
        yield self._summary

    def on_mount(self) -> None:
        if self._final is not None:
            self._show_summary(*self._final)

    @property
    def answer(self) -> str:
        return self._answer

    @property
    def thinking(self) -> str:
        return self._thinking.text if self._thinking is not None else ""

    async def add(self, piece: TextPiece) -> None:
        if piece.kind == "thinking":
            if self._thinking is None:
                self._thinking = ThinkingBlock()
                await self.mount(self._thinking, before=self._markdown)
            self._thinking.append(piece.text)
            return
        if self._thinking is not None and self._thinking.streaming:
            self._thinking.finish()
        self._answer += piece.text
        if self._stream is None:
            # MarkdownStream merges what arrives while the widget is still rendering the
            # previous fragment, so a fast engine never queues up redraws.
            self._stream = Markdown.get_stream(self._markdown)
        await self._stream.write(piece.text)

    async def finish(self, stats: ReplyStats, stopped: bool) -> None:
        if self._stream is not None:
            await self._stream.stop()
        if self._thinking is not None and self._thinking.streaming:
            self._thinking.finish()
        self.remove_class("-streaming")
        self._show_summary(stats, stopped)

    def _show_summary(self, stats: ReplyStats | None, stopped: bool) -> None:
        if stats is not None and stopped and stats.stop_reason is None:
            stats = replace(stats, stop_reason="cancelled")  # saved mid-reply, then cut short
        text = reply_summary(stats) if stats is not None else "stopped" if stopped else ""
        if stopped:
            self.add_class("-stopped")
            text = f"■ {text}"
        self._summary.update(text)

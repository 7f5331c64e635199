"""One turn of the conversation: the user's message, or a reply with its thinking and stats."""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress
from dataclasses import replace

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Markdown, Static

from qwenchat.session import ReplyStats, TextPiece
from qwenchat.tui.stats import reply_summary
from qwenchat.tui.widgets.thinking import ThinkingBlock

RENDER_PACE = 4.0  # after a Markdown update, pause four times as long as it took


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
            ThinkingBlock(thinking, streaming=False, folded=bool(answer)) if thinking else None)
        self._markdown = Markdown(answer)
        self._summary = Static("", markup=False, classes="summary")
        self._unshown = ""  # answer text not yet handed to the Markdown widget
        self._arrived = asyncio.Event()
        self._ending = asyncio.Event()
        self._appender: asyncio.Task[None] | None = None
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
        self._unshown += piece.text
        self._arrived.set()
        if self._appender is None:
            self._appender = asyncio.create_task(self._append_unshown())

    async def _append_unshown(self) -> None:
        """Append what arrived to the Markdown, in one piece per round, then pause for a
        multiple of what that round cost: a long code block is re-highlighted and
        re-rendered whole on every append, and the keyboard must get its turn."""
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            if self._unshown:
                text, self._unshown = self._unshown, ""
                started = time.perf_counter()
                await self._markdown.append(text)
                pause = RENDER_PACE * (time.perf_counter() - started)
                with suppress(asyncio.TimeoutError):  # the reply's end cuts the pause short
                    await asyncio.wait_for(self._ending.wait(), pause)
            if self._ending.is_set() and not self._unshown:
                return

    async def finish(self, stats: ReplyStats, stopped: bool) -> None:
        if self._appender is not None:
            self._ending.set()
            self._arrived.set()
            await self._appender
        if self._thinking is not None and self._thinking.streaming:
            self._thinking.finish(fold=False)  # still thinking: no answer to fold it for
        self.remove_class("-streaming")
        self._show_summary(stats, stopped)

    def on_unmount(self) -> None:
        if self._appender is not None:  # removed mid-reply: the app is closing
            self._appender.cancel()

    def _show_summary(self, stats: ReplyStats | None, stopped: bool) -> None:
        if stats is not None and stopped and stats.stop_reason is None:
            stats = replace(stats, stop_reason="cancelled")  # saved mid-reply, then cut short
        text = reply_summary(stats) if stats is not None else "stopped" if stopped else ""
        if stopped:
            self.add_class("-stopped")
            text = f"■ {text}"
        self._summary.update(text)

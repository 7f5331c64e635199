"""The open chat's turns, scrolling, following a streaming reply unless the user scrolls up."""

from __future__ import annotations

from textual.containers import VerticalScroll
from textual.widget import Widget

from qwenchat.store import StoredMessage
from qwenchat.tui.stats import stats_from_dict
from qwenchat.tui.widgets.message import AssistantMessage, UserMessage
from qwenchat.tui.widgets.notice import ChatNotice

Turn = UserMessage | AssistantMessage


class Conversation(VerticalScroll):
    def __init__(self, id: str | None = None):
        super().__init__(id=id)
        self.turns: list[Turn] = []  # one per session message, in the same order

    def on_mount(self) -> None:
        # Anchored: stays at the bottom as content grows, until the user scrolls away, and
        # again once they scroll back down.
        self.anchor()

    async def show(self, messages: list[StoredMessage]) -> None:
        await self.remove_children()
        self.turns = [self._stored_turn(m) for m in messages]
        if self.turns:
            await self.mount_all(self.turns)
        self.anchor()

    async def add_user(self, text: str) -> UserMessage:
        turn = UserMessage(text)
        await self._add(turn)
        return turn

    async def add_reply(self) -> AssistantMessage:
        turn = AssistantMessage(streaming=True)
        await self._add(turn)
        return turn

    async def add_notice(self, text: str, level: str = "warning",
                         before: Widget | None = None) -> ChatNotice:
        notice = ChatNotice(text, level)
        await self.mount(notice, before=before)
        return notice

    async def drop_turns_from(self, index: int) -> None:
        """Remove the turns from `index` on (regenerate, edit), and anything shown after them."""
        if index >= len(self.turns):
            return
        first = self.turns[index]
        later = list(self.children)[list(self.children).index(first):]
        del self.turns[index:]
        await self.remove_children(later)

    def mark_context(self, first_in_context: int) -> None:
        """Dim the turns the model no longer sees (dropped to fit the context)."""
        for index, turn in enumerate(self.turns):
            turn.set_class(index < first_in_context, "-out-of-context")

    async def _add(self, turn: Turn) -> None:
        self.turns.append(turn)
        await self.mount(turn)

    @staticmethod
    def _stored_turn(message: StoredMessage) -> Turn:
        if message.role == "user":
            return UserMessage(message.content)
        stats = stats_from_dict(message.stats) if message.stats else None
        return AssistantMessage(message.content, message.thinking, stats, message.stopped)

"""The chat list: open, rename or delete a saved chat, or start a new one."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, OptionList, Static
from textual.widgets.option_list import Option

from qwenchat.errors import QwenchatError
from qwenchat.store import ChatStore
from qwenchat.tui.keys import FieldInput
from qwenchat.tui.screens.confirm import ConfirmScreen


@dataclass
class ChatChoice:
    open_id: int | None = None
    new: bool = False
    deleted: set[int] = field(default_factory=set)
    renamed: dict[int, str] = field(default_factory=dict)


class ChatListScreen(ModalScreen[ChatChoice]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close"),
        Binding("n", "new", "New chat"),
        Binding("r", "rename", "Rename"),
        Binding("d,delete", "delete", "Delete"),
    ]

    def __init__(self, store: ChatStore, current: int | None):
        super().__init__()
        self._store = store
        self._current = current
        self._choice = ChatChoice()

    def compose(self) -> ComposeResult:
        with Vertical(id="chats-box"):
            yield Static("Chats", classes="panel-title")
            yield OptionList(id="chat-options")
            yield FieldInput(id="rename", placeholder="new title, Enter to save, Esc to cancel")
            yield Static("Enter open · n new · r rename · d delete · Esc close",
                         classes="hint")

    def on_mount(self) -> None:
        self.query_one("#rename", Input).display = False
        self._fill()

    def _fill(self, keep: int | None = None) -> None:
        """List the chats, highlighting `keep` (else the first)."""
        options = self.query_one(OptionList)
        options.clear_options()
        try:
            chats = self._store.list_chats()
        except QwenchatError as exc:
            self.notify(str(exc), severity="error")
            chats = []
        for chat in chats:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(chat.updated_at))
            mark = "● " if chat.id == self._current else "  "
            label = Text.assemble(f"{mark}{chat.title}", (f"  {when}", "dim"))
            options.add_option(Option(label, id=str(chat.id)))
        if chats:
            ids = [chat.id for chat in chats]
            options.highlighted = ids.index(keep) if keep in ids else 0
        else:
            options.add_option(Option("no saved chats yet", disabled=True))
        options.focus()

    def _selected(self) -> int | None:
        options = self.query_one(OptionList)
        if options.highlighted is None:
            return None
        option = options.get_option_at_index(options.highlighted)
        return int(option.id) if option.id else None

    @on(OptionList.OptionSelected)
    def _open(self, event: OptionList.OptionSelected) -> None:
        if event.option.id:
            self._choice.open_id = int(event.option.id)
            self.dismiss(self._choice)

    def action_close(self) -> None:
        rename = self.query_one("#rename", Input)
        if rename.display:
            rename.display = False
            self.query_one(OptionList).focus()
        else:
            self.dismiss(self._choice)

    def action_new(self) -> None:
        self._choice.new = True
        self.dismiss(self._choice)

    def action_rename(self) -> None:
        chat_id = self._selected()
        if chat_id is None:
            return
        rename = self.query_one("#rename", Input)
        rename.value = self._store.get_chat(chat_id).title
        rename.display = True
        rename.focus()

    @on(Input.Submitted, "#rename")
    def _renamed(self, event: Input.Submitted) -> None:
        chat_id, title = self._selected(), " ".join(event.value.split())
        event.input.display = False
        if chat_id is not None and title:
            try:
                self._store.rename_chat(chat_id, title)
            except QwenchatError as exc:
                self.notify(str(exc), severity="error")
            self._choice.renamed[chat_id] = title
        self._fill(keep=chat_id)

    def action_delete(self) -> None:
        chat_id = self._selected()
        if chat_id is None:
            return
        title = self._store.get_chat(chat_id).title

        def answered(yes: bool | None) -> None:
            if yes:
                try:
                    self._store.delete_chat(chat_id)
                except QwenchatError as exc:
                    self.notify(str(exc), severity="error")
                self._choice.deleted.add(chat_id)
                self._fill()

        self.app.push_screen(ConfirmScreen(f"Delete the chat “{title}” and all its messages?"),
                             answered)

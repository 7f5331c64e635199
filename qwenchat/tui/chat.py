"""One open conversation: its session (KV-cache reuse), its place in the history, its settings.

No Textual here: the chat screen drives this, and tests can too. Every history write goes
through `_save`, so a full disk or a locked file becomes a notice, never a crash.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

from qwenchat.errors import QwenchatError, UsageError
from qwenchat.model.tokenizer import Message
from qwenchat.sampling.params import LiveParams
from qwenchat.session import Event, Reply, ReplyStats
from qwenchat.store import ChatRecord, ChatStore, StoredMessage
from qwenchat.tui.loader import ChatModel
from qwenchat.tui.settings import ChatSettings

TITLE_CHARS = 60


class Chat:
    def __init__(
        self,
        store: ChatStore,
        model: ChatModel,
        settings: ChatSettings,
        system: str | None = None,
        record: ChatRecord | None = None,
        stored: list[StoredMessage] | None = None,
        warn: Callable[[str], None] = lambda _: None,
        speculate: int = 0,
    ):
        self.store = store
        self.settings = settings
        self.record = record  # None until the first message: empty chats are not kept
        self.stored = list(stored or [])  # the history's rows, one per session message
        self.session = model.new_session(LiveParams(settings.params), system,
                                         settings.thinking, speculate)
        self.session.messages = [Message(m.role, m.content) for m in self.stored]
        self._warn = warn
        self._last_warning = ""
        self._reply_row: StoredMessage | None = None
        self._reply_before: Reply | None = None
        self._preparing: tuple[threading.Thread, threading.Event] | None = None
        self.prepared_tokens = 0  # what the last background prefill added (reports, tests)

    @classmethod
    def open(cls, store: ChatStore, model: ChatModel, chat_id: int,
             warn: Callable[[str], None] = lambda _: None, speculate: int = 0) -> Chat:
        record = store.get_chat(chat_id)
        settings = ChatSettings.from_dict(model.directory, record.settings)
        return cls(store, model, settings, record.system_prompt, record,
                   store.messages(chat_id), warn, speculate)

    @property
    def title(self) -> str:
        return self.record.title if self.record else "New chat"

    @property
    def system(self) -> str | None:
        return self.session.system

    # ------------------------------------------------------------------ background prefill
    def start_preparing(self) -> None:
        """Prefill the conversation as the next turn will start, on a daemon thread, while the
        user reads and types (ChatSession.prepare_next_turn). Stop it before the session or
        the engine is used again: `stop_preparing`."""
        self.stop_preparing()
        cancel = threading.Event()
        thread = threading.Thread(target=self._prepare, args=(cancel,), daemon=True,
                                  name="qwenchat-prepare")
        self._preparing = (thread, cancel)
        thread.start()

    def stop_preparing(self, timeout: float | None = None) -> bool:
        """Stop the background prefill after its current step; False if it has not returned
        within `timeout` (it may still be inside the engine)."""
        if self._preparing is None:
            return True
        thread, cancel = self._preparing
        cancel.set()
        thread.join(timeout)
        if thread.is_alive():
            return False
        self._preparing = None
        return True

    @property
    def preparing(self) -> bool:
        """A background prefill has not returned yet (it may be inside the engine)."""
        return self._preparing is not None and self._preparing[0].is_alive()

    def _prepare(self, cancel: threading.Event) -> None:
        try:
            self.prepared_tokens = self.session.prepare_next_turn(cancel)
        except Exception:
            # Only a head start is lost: the next turn prefills what is missing itself, and
            # an engine that is really broken fails there, where the error is shown.
            self.prepared_tokens = 0

    # ------------------------------------------------------------------------------- turns
    def send(self, text: str, cancel: threading.Event,
             sent_at: float | None = None) -> Iterator[Event]:
        """Store the user's message and return the reply's events, to iterate in a worker;
        `sent_at` (a qwenchat.session.now() reading) is when the user sent it."""
        if not text.strip():
            raise UsageError("the message is empty: type something first")
        self.stop_preparing()
        if self.record is None:
            title = " ".join(text.split())[:TITLE_CHARS]
            self.record = self.store.create_chat(title, self.session.system,
                                                 self.settings.as_dict())
        self._add(StoredMessage("user", text))
        return self._begin_reply(self.session.send(text, cancel, sent_at))

    def regenerate(self, cancel: threading.Event) -> Iterator[Event]:
        self.stop_preparing()
        if self.stored and self.stored[-1].role == "assistant":
            self._forget_from(len(self.stored) - 1)
        if not self.stored:
            raise UsageError("nothing to regenerate: send a message first")
        return self._begin_reply(self.session.regenerate(cancel))

    def last_user_text(self) -> str:
        return self.stored[self.last_user_index()].content

    def edit_last(self, text: str, cancel: threading.Event,
                  sent_at: float | None = None) -> Iterator[Event]:
        """Replace the last user message (and its reply) with `text`, and answer it."""
        if not text.strip():
            raise UsageError("the message is empty: type something first")
        self.stop_preparing()
        self._forget_from(self.last_user_index())
        return self.send(text, cancel, sent_at)

    def save_partial(self, answer: str, thinking: str, stats: ReplyStats | None) -> None:
        """Save what the streaming reply has shown so far (it stays marked stopped)."""
        if self._reply_row is not None and self._reply_row.id is not None:
            self._save(self.store.update_message, self._reply_row.id, content=answer,
                       thinking=thinking, stats=stats.as_dict() if stats else None)

    def finish_reply(self) -> str | None:
        """Record how the reply ended, once its generation has returned.

        Returns the user's text when the turn failed before any reply (a prompt too long for
        the context, an engine error): the session has dropped the turn, so the history does
        too, and the text goes back to the prompt.
        """
        row, self._reply_row = self._reply_row, None
        reply = self.session.last_reply
        if reply is None or reply is self._reply_before:
            user = self.stored.pop()
            if self.record is not None and user.id is not None:
                self._save(self.store.delete_messages_from, self.record.id, user.id)
            return user.content
        assert row is not None
        row.content, row.thinking, row.stopped = reply.answer, reply.thinking, reply.stopped
        row.stats = reply.stats.as_dict()
        if row.id is not None:
            self._save(self.store.update_message, row.id, content=row.content,
                       thinking=row.thinking, stopped=row.stopped, stats=row.stats)
        self.stored.append(row)
        return None

    def clear(self) -> None:
        self.stop_preparing()
        if self.record is not None and self.stored and self.stored[0].id is not None:
            self._save(self.store.delete_messages_from, self.record.id, self.stored[0].id)
        self.stored.clear()
        self.session.clear()

    # ---------------------------------------------------------------------------- settings
    def set_param(self, name: str, value: Any) -> None:
        self.settings.set(name, value)
        self._apply_settings()

    def reset_params(self, name: str | None = None) -> None:
        self.settings.reset(name)
        self._apply_settings()

    def set_thinking(self, on: bool) -> None:
        """Switch mode: its recommended values apply, except the ones the user set."""
        self.stop_preparing()
        self.settings.thinking = on
        self.session.thinking = on  # the next turn's template and think-tag parsing
        self._apply_settings()

    def set_system(self, text: str | None) -> None:
        self.stop_preparing()
        self.session.system = text or None
        if self.record is not None:
            self._save(self.store.update_chat, self.record.id, system_prompt=self.session.system)

    def rename(self, title: str) -> None:
        if self.record is None:
            self.record = self.store.create_chat(title, self.session.system,
                                                 self.settings.as_dict())
        else:
            self._save(self.store.rename_chat, self.record.id, title)
            self.record.title = title

    # ------------------------------------------------------------------------------ export
    def export(self, kind: str) -> str:
        """The chat as Markdown or as JSON text."""
        if self.record is None:
            raise UsageError("nothing to export yet: send a message first")
        if kind == "json":
            return json.dumps(self.store.export_json(self.record.id), ensure_ascii=False,
                              indent=2) + "\n"
        return self.store.export_markdown(self.record.id)

    # --------------------------------------------------------------------------- internals
    def _apply_settings(self) -> None:
        self.session.params.set(self.settings.params)  # the running reply's next token
        if self.record is not None:
            self._save(self.store.update_chat, self.record.id, settings=self.settings.as_dict())

    def _begin_reply(self, events: Iterator[Event]) -> Iterator[Event]:
        # Saved as stopped until it ends well: if qwenchat dies mid-reply, the history
        # already says the reply was cut short.
        assert self.record is not None
        self._reply_before = self.session.last_reply
        self._reply_row = StoredMessage("assistant", "", stopped=True)
        self._save(self.store.add_message, self.record.id, self._reply_row)
        return events

    def _add(self, message: StoredMessage) -> None:
        assert self.record is not None
        self._save(self.store.add_message, self.record.id, message)
        self.stored.append(message)

    def last_user_index(self) -> int:
        for index in range(len(self.stored) - 1, -1, -1):
            if self.stored[index].role == "user":
                return index
        raise UsageError("no message to edit yet: send one first")

    def _forget_from(self, index: int) -> None:
        """Drop stored rows and session messages from `index` on (regenerate, edit)."""
        first = self.stored[index]
        if self.record is not None and first.id is not None:
            self._save(self.store.delete_messages_from, self.record.id, first.id)
        del self.stored[index:]
        del self.session.messages[index:]
        self.session.first_in_context = min(self.session.first_in_context,
                                            len(self.session.messages))

    def _save(self, write: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            write(*args, **kwargs)
        except QwenchatError as exc:
            if str(exc) != self._last_warning:  # a full disk fails every save: say it once
                self._last_warning = str(exc)
                self._warn(str(exc))

"""Chat history kept in SQLite: chats, their messages and settings, migrations, exports.

The UI saves through this module while a reply streams, so every write is one short
transaction: whatever was committed survives a crash or Ctrl+C. A file SQLite cannot use is
moved aside (never deleted) and a fresh database takes its place, so a damaged history never
stops the app from starting.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from types import EllipsisType
from typing import Any

from qwenchat import paths
from qwenchat.errors import QwenchatError

ROLES = ("user", "assistant", "system")

# Each step takes the schema from version i to i + 1 and is kept exactly as shipped: files
# written by earlier releases replay the steps they lack, in order, one transaction each.
# Plain CREATE TABLE (no IF NOT EXISTS): a foreign file that happens to hold a "chats" table
# must fail the upgrade and be moved aside, not be adopted.
MIGRATIONS: list[tuple[str, ...]] = [
    (  # 1: chats and their plain-text turns
        """CREATE TABLE chats (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            title TEXT NOT NULL,
            system_prompt TEXT,
            settings TEXT NOT NULL DEFAULT '{}',
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        )""",
        # AUTOINCREMENT: an id is never reused, so a stale id held by the UI (a reply still
        # streaming into a chat deleted meanwhile) can never hit another chat's message.
        """CREATE TABLE messages (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
            role TEXT NOT NULL CHECK (role IN ('user', 'assistant', 'system')),
            content TEXT NOT NULL,
            created_at REAL NOT NULL
        )""",
        "CREATE INDEX messages_by_chat ON messages(chat_id, id)",
        "CREATE INDEX chats_by_update ON chats(updated_at)",
    ),
    (  # 2: what a reply carries besides its text
        "ALTER TABLE messages ADD COLUMN thinking TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE messages ADD COLUMN stopped INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE messages ADD COLUMN stats TEXT",
    ),
]
SCHEMA_VERSION = len(MIGRATIONS)

# How long to wait for another process (a second qwenchat) to finish its write.
BUSY_TIMEOUT_S = 5.0

# SQLite result codes that describe the machine (permissions, disk, another process), not the
# file: moving a healthy history aside for them would split it in two for nothing.
_ENVIRONMENT_ERRORS = ("SQLITE_CANTOPEN", "SQLITE_PERM", "SQLITE_READONLY", "SQLITE_IOERR",
                       "SQLITE_FULL", "SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_NOMEM")


class HistoryError(QwenchatError):
    """The chat history could not be read or written (disk full, permissions, a lock)."""


class NotFoundError(QwenchatError, KeyError):
    """A chat or message id that is not (or no longer) in the history."""

    __str__ = Exception.__str__  # KeyError would print the message in quotes


@dataclass
class StoredMessage:
    role: str  # "user" | "assistant" | "system"
    content: str
    thinking: str = ""
    stopped: bool = False  # a reply cut short (Esc, Ctrl+C, crash) is kept, marked stopped
    stats: dict | None = None  # ReplyStats.as_dict() of the reply
    id: int | None = None
    created_at: float = 0.0


@dataclass
class ChatRecord:
    id: int
    title: str
    system_prompt: str | None
    settings: dict  # SamplingParams.as_dict() plus {"thinking": bool}
    created_at: float
    updated_at: float


class _Damaged(Exception):
    """The file is not a history this version can use: move it aside and start again."""


class _Unavailable(Exception):
    """The file cannot be opened at all here; keep it where it is and work in memory."""


def _now() -> float:
    return time.time()


class ChatStore:
    """All chats in one SQLite file (or in memory for --no-history), safe to share between
    the UI thread and a worker thread."""

    def __init__(self, path: Path | None, notice: Callable[[str], None] = lambda _: None):
        self.path = path
        self._notice = notice
        # One connection shared by threads; SQLite connections are not safe for concurrent
        # use, and two interleaved BEGINs would fail, so every use holds this lock.
        self._lock = threading.Lock()
        self._db = self._open()

    @staticmethod
    def default_path() -> Path:
        return paths.data_dir() / "history.sqlite3"

    # chats

    def create_chat(self, title: str, system_prompt: str | None, settings: dict) -> ChatRecord:
        now = _now()
        with self._write() as db:
            cursor = db.execute(
                "INSERT INTO chats (title, system_prompt, settings, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?)",
                (title, system_prompt, json.dumps(settings), now, now),
            )
        return ChatRecord(cursor.lastrowid, title, system_prompt, dict(settings), now, now)

    def list_chats(self) -> list[ChatRecord]:
        """Every chat, the most recently updated first."""
        with self._read() as db:
            rows = db.execute(
                f"SELECT {_CHAT_COLUMNS} FROM chats ORDER BY updated_at DESC, id DESC"
            ).fetchall()
        return [_chat(row) for row in rows]

    def get_chat(self, chat_id: int) -> ChatRecord:
        with self._read() as db:
            row = db.execute(f"SELECT {_CHAT_COLUMNS} FROM chats WHERE id = ?",
                             (chat_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"chat {chat_id} does not exist")
        return _chat(row)

    def rename_chat(self, chat_id: int, title: str) -> None:
        # Renaming leaves updated_at alone: the chat list should not reorder under the cursor
        # of the user who is renaming from it.
        with self._write() as db:
            cursor = db.execute("UPDATE chats SET title = ? WHERE id = ?", (title, chat_id))
            _require_chat(cursor, chat_id)

    def delete_chat(self, chat_id: int) -> None:
        """Delete the chat and its messages; deleting one already gone does nothing."""
        with self._write() as db:
            db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))  # messages cascade

    def update_chat(
        self,
        chat_id: int,
        *,
        system_prompt: str | EllipsisType | None = ...,
        settings: dict | None = None,
    ) -> None:
        """Change the system prompt (None clears it; ... leaves it) and/or the settings."""
        changes: dict[str, Any] = {}
        if system_prompt is not ...:
            changes["system_prompt"] = system_prompt
        if settings is not None:
            changes["settings"] = json.dumps(settings)
        if not changes:
            return
        changes["updated_at"] = _now()
        assignments = ", ".join(f"{column} = ?" for column in changes)
        with self._write() as db:
            cursor = db.execute(f"UPDATE chats SET {assignments} WHERE id = ?",
                                (*changes.values(), chat_id))
            _require_chat(cursor, chat_id)

    # messages

    def messages(self, chat_id: int) -> list[StoredMessage]:
        """The chat's messages in the order they were added."""
        with self._read() as db:
            if db.execute("SELECT 1 FROM chats WHERE id = ?", (chat_id,)).fetchone() is None:
                raise NotFoundError(f"chat {chat_id} does not exist")
            rows = db.execute(
                "SELECT role, content, thinking, stopped, stats, id, created_at FROM messages "
                "WHERE chat_id = ? ORDER BY id",
                (chat_id,),
            ).fetchall()
        return [
            StoredMessage(role, content, thinking, bool(stopped),
                          json.loads(stats) if stats is not None else None, id_, created_at)
            for role, content, thinking, stopped, stats, id_, created_at in rows
        ]

    def add_message(self, chat_id: int, message: StoredMessage) -> int:
        """Append `message` to the chat and return its id; fills in message.id and, when it
        is unset, message.created_at."""
        if message.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}; got {message.role!r}")
        created_at = message.created_at or _now()
        stats = json.dumps(message.stats) if message.stats is not None else None
        with self._write() as db:
            bumped = db.execute("UPDATE chats SET updated_at = ? WHERE id = ?",
                                (_now(), chat_id))
            _require_chat(bumped, chat_id)
            cursor = db.execute(
                "INSERT INTO messages (chat_id, role, content, thinking, stopped, stats, "
                "created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (chat_id, message.role, message.content, message.thinking,
                 int(message.stopped), stats, created_at),
            )
        message.id = cursor.lastrowid
        message.created_at = created_at
        return cursor.lastrowid

    def update_message(
        self,
        message_id: int,
        *,
        content: str | None = None,
        thinking: str | None = None,
        stopped: bool | None = None,
        stats: dict | None = None,
    ) -> None:
        """Overwrite the given fields of a message: one UPDATE by primary key, cheap enough to
        save a streaming reply every half second.

        A message that no longer exists is ignored: a reply may still be streaming into a
        chat the user has just deleted.
        """
        changes: dict[str, Any] = {}
        if content is not None:
            changes["content"] = content
        if thinking is not None:
            changes["thinking"] = thinking
        if stopped is not None:
            changes["stopped"] = int(stopped)
        if stats is not None:
            changes["stats"] = json.dumps(stats)
        if not changes:
            return
        assignments = ", ".join(f"{column} = ?" for column in changes)
        with self._write() as db:
            db.execute(f"UPDATE messages SET {assignments} WHERE id = ?",
                       (*changes.values(), message_id))

    def delete_messages_from(self, chat_id: int, message_id: int) -> None:
        """Delete this message and every later one in the chat (regenerate, edit-and-resend)."""
        with self._write() as db:
            found = db.execute("SELECT 1 FROM messages WHERE id = ? AND chat_id = ?",
                               (message_id, chat_id)).fetchone()
            if found is None:
                # Deleting "from" an unknown id would silently delete the wrong span.
                raise NotFoundError(f"message {message_id} is not in chat {chat_id}")
            db.execute("DELETE FROM messages WHERE chat_id = ? AND id >= ?",
                       (chat_id, message_id))
            db.execute("UPDATE chats SET updated_at = ? WHERE id = ?", (_now(), chat_id))

    # exports

    def export_markdown(self, chat_id: int) -> str:
        return chat_markdown(self.get_chat(chat_id), self.messages(chat_id))

    def export_json(self, chat_id: int) -> dict:
        """{"chat": {...}, "messages": [...]}, ready for json.dumps."""
        chat = self.get_chat(chat_id)
        return {"chat": asdict(chat), "messages": [asdict(m) for m in self.messages(chat_id)]}

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> ChatStore:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # transactions

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One transaction: all of it is committed, or none of it (also on Ctrl+C)."""
        with self._lock:
            db = self._db
            try:
                if db.in_transaction:  # an interrupt landed inside an earlier ROLLBACK
                    db.execute("ROLLBACK")
                # IMMEDIATE takes the write lock up front, so a second qwenchat process makes
                # this wait (busy timeout) instead of failing halfway through.
                db.execute("BEGIN IMMEDIATE")
                yield db
                db.execute("COMMIT")
            except BaseException as exc:
                _rollback(db)
                if isinstance(exc, sqlite3.Error):
                    raise HistoryError(f"could not save chat history to {self._where()}: "
                                       f"{exc}") from exc
                raise

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._db
            except sqlite3.Error as exc:
                raise HistoryError(f"could not read chat history from {self._where()}: "
                                   f"{exc}") from exc

    def _where(self) -> str:
        return str(self.path) if self.path is not None else "memory"

    # opening

    def _open(self) -> sqlite3.Connection:
        if self.path is None:
            return _prepare(_connect(":memory:"))
        try:
            return self._open_file()
        except _Unavailable as exc:
            return self._in_memory_instead(str(exc))
        except _Damaged as damaged:
            reason = str(damaged)
        try:
            aside = _move_aside(self.path)
        except OSError as exc:
            return self._in_memory_instead(f"{reason}; moving it aside failed: {exc}")
        self._notice(f"chat history at {self.path} was unreadable ({reason}); "
                     f"moved it to {aside} and started a new one")
        try:
            return self._open_file()
        except (_Unavailable, _Damaged) as exc:
            return self._in_memory_instead(str(exc))

    def _open_file(self) -> sqlite3.Connection:
        assert self.path is not None
        try:
            _make_private(self.path)
            db = _connect(str(self.path))
        except (OSError, sqlite3.Error) as exc:
            raise _Unavailable(str(exc)) from exc
        try:
            return _prepare(db)
        except BaseException:
            db.close()  # the file may be moved next; nothing may hold it open
            raise

    def _in_memory_instead(self, reason: str) -> sqlite3.Connection:
        self._notice(f"chat history at {self.path} cannot be opened ({reason}); "
                     "chats in this session will not be kept")
        return _prepare(_connect(":memory:"))


_CHAT_COLUMNS = "id, title, system_prompt, settings, created_at, updated_at"


def _chat(row: tuple) -> ChatRecord:
    id_, title, system_prompt, settings, created_at, updated_at = row
    return ChatRecord(id_, title, system_prompt, json.loads(settings), created_at, updated_at)


def _require_chat(cursor: sqlite3.Cursor, chat_id: int) -> None:
    if cursor.rowcount == 0:
        raise NotFoundError(f"chat {chat_id} does not exist")


PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def _make_private(path: Path) -> None:
    """Chats are private, as a shell's history is: the folder 0700 and the file 0600, created
    so (never readable by others for an instant) and tightened when an older qwenchat made them
    readable. SQLite gives its -wal and -shm files the database file's mode."""
    path.parent.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT, PRIVATE_FILE_MODE))
    for target, mode in ((path.parent, PRIVATE_DIR_MODE), (path, PRIVATE_FILE_MODE),
                         (path.with_name(path.name + "-wal"), PRIVATE_FILE_MODE),
                         (path.with_name(path.name + "-shm"), PRIVATE_FILE_MODE)):
        with suppress(OSError):  # not ours to change (or gone): SQLite says if it matters
            if target.exists() and target.stat().st_mode & 0o777 != mode:
                target.chmod(mode)


def _connect(target: str) -> sqlite3.Connection:
    # isolation_level=None: transactions are begun and ended explicitly, because Python's
    # implicit ones do not cover the DDL of a migration.
    return sqlite3.connect(target, check_same_thread=False, isolation_level=None,
                           timeout=BUSY_TIMEOUT_S)


def _prepare(db: sqlite3.Connection) -> sqlite3.Connection:
    """Check the file, switch on WAL and foreign keys, and bring the schema up to date."""
    try:
        version = _user_version(db)  # the first read: a file that is no database fails here
        if version > SCHEMA_VERSION:
            raise _Damaged(f"it was written by a newer qwenchat: schema version {version}, "
                           f"this one reads up to {SCHEMA_VERSION}")
        problems = [row[0] for row in db.execute("PRAGMA integrity_check")]
        if problems != ["ok"]:
            raise _Damaged(f"integrity check failed: {problems[0]}")
        db.execute("PRAGMA journal_mode = WAL")  # readers never block the writer
        db.execute("PRAGMA synchronous = FULL")  # a committed reply survives power loss too
        db.execute("PRAGMA foreign_keys = ON")  # deleting a chat deletes its messages
    except sqlite3.Error as exc:
        raise _classify(exc, str(exc)) from exc
    _migrate(db)
    return db


def _migrate(db: sqlite3.Connection) -> None:
    version = _user_version(db)
    if version == SCHEMA_VERSION:
        return
    while True:
        try:
            db.execute("BEGIN IMMEDIATE")
            # Read again under the write lock: another qwenchat may have just upgraded it.
            version = _user_version(db)
            if version >= SCHEMA_VERSION:
                db.execute("COMMIT")
                return
            for statement in MIGRATIONS[version]:
                db.execute(statement)
            db.execute(f"PRAGMA user_version = {version + 1}")
            db.execute("COMMIT")
        except BaseException as exc:
            _rollback(db)
            if isinstance(exc, sqlite3.Error):
                raise _classify(exc, f"upgrading it to schema version {version + 1} failed: "
                                     f"{exc}") from exc
            raise


def _user_version(db: sqlite3.Connection) -> int:
    return db.execute("PRAGMA user_version").fetchone()[0]


def _rollback(db: sqlite3.Connection) -> None:
    # SQLite has already rolled back after some errors (or the connection is closed); then
    # there is nothing left to undo, and the error that brought us here is the one to report.
    with suppress(sqlite3.Error):
        if db.in_transaction:
            db.execute("ROLLBACK")


def _classify(exc: sqlite3.Error, reason: str) -> Exception:
    # sqlite_errorname exists from Python 3.11; without it every failure counts as damage,
    # which still keeps the file (moved aside), only less precisely.
    name = getattr(exc, "sqlite_errorname", "SQLITE_ERROR")
    if name.startswith(_ENVIRONMENT_ERRORS):
        return _Unavailable(reason)
    return _Damaged(reason)


def _move_aside(path: Path) -> Path:
    """Rename a damaged database (and its WAL files) to <name>.corrupt-<time>; return it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
    path.rename(aside)
    # The WAL goes with its database: left behind, SQLite would replay its pages into the
    # fresh file.
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            side.rename(aside.with_name(aside.name + suffix))
    return aside


def chat_markdown(chat: ChatRecord, messages: list[StoredMessage]) -> str:
    """A chat as Markdown: title, settings, system prompt, then each turn under its role."""
    title = " ".join(chat.title.split()) or "Untitled chat"
    parts = [f"# {title}", f"*{_settings_line(chat)}*"]
    if chat.system_prompt:
        parts += ["## System prompt", chat.system_prompt]
    for message in messages:
        heading = f"## {message.role.capitalize()}"
        if message.stopped:
            heading += " (stopped)"
        parts.append(heading)
        if message.thinking:
            parts.append(f"<details>\n<summary>Thinking</summary>\n\n{message.thinking}\n\n"
                         "</details>")
        if message.content:
            parts.append(message.content)
        stats = _stats_line(message.stats or {})
        if stats:
            parts.append(f"*{stats}*")
    return "\n\n".join(parts) + "\n"


def _settings_line(chat: ChatRecord) -> str:
    items = [time.strftime("%Y-%m-%d %H:%M", time.localtime(chat.created_at))]
    if "thinking" in chat.settings:
        items.append("thinking on" if chat.settings["thinking"] else "thinking off")
    items += [f"{name.replace('_', '-')} {value}" for name, value in chat.settings.items()
              if name != "thinking" and value is not None]
    return " · ".join(items)


def _stats_line(stats: dict) -> str:
    items = []
    if stats.get("generated_tokens") is not None:
        items.append(f"{stats['generated_tokens']} tokens")
    if stats.get("decode_tok_s") is not None:
        items.append(f"{stats['decode_tok_s']:.1f} tok/s")
    if stats.get("ttft_s") is not None:
        items.append(f"first token after {stats['ttft_s']:.2f} s")
    if stats.get("stop_reason"):
        items.append(f"stop: {stats['stop_reason']}")
    if stats.get("seed") is not None:
        items.append(f"seed {stats['seed']}")
    return " · ".join(items)

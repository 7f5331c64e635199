"""Chat history in SQLite: chats and messages, crash safety, migrations, damaged files, exports."""

from __future__ import annotations

import json
import random
import sqlite3
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from qwenchat import store as store_module
from qwenchat.errors import QwenchatError
from qwenchat.store import (
    SCHEMA_VERSION,
    ChatStore,
    HistoryError,
    NotFoundError,
    StoredMessage,
)

SETTINGS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "seed": None,
            "max_tokens": None, "thinking": True}
STATS = {"prompt_tokens": 31, "reused_tokens": 12, "prefill_tokens": 19, "prefill_s": 0.05,
         "generated_tokens": 42, "ttft_s": 0.125, "decode_s": 1.0, "position": 73,
         "capacity": 4096, "stop_reason": "eos", "seed": 1234, "decode_tok_s": 41.0}

# The layout of schema version 1 exactly as that release wrote it: an upgrade must start from
# the real old file, so this copy must not follow later edits to store.MIGRATIONS.
V1_SCHEMA = """
CREATE TABLE chats (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    system_prompt TEXT,
    settings TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('user', 'assistant', 'system')),
    content TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX messages_by_chat ON messages(chat_id, id);
CREATE INDEX chats_by_update ON chats(updated_at);
PRAGMA user_version = 1;
"""


@pytest.fixture
def clock(monkeypatch):
    """A clock that moves one second per reading, so orderings never tie."""
    now = [1_700_000_000.0]

    def tick() -> float:
        now[0] += 1.0
        return now[0]

    monkeypatch.setattr(store_module, "_now", tick)
    return now


@pytest.fixture
def db_path(tmp_path) -> Path:
    return tmp_path / "data" / "history.sqlite3"


def _open(path: Path | None) -> tuple[ChatStore, list[str]]:
    notices: list[str] = []
    return ChatStore(path, notice=notices.append), notices


def _raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def test_chats_are_created_listed_by_last_update_renamed_and_deleted(db_path, clock):
    store, notices = _open(db_path)
    first = store.create_chat("first", None, SETTINGS)
    second = store.create_chat("second", "Be brief.", {"temperature": 0.7, "thinking": False})
    assert [c.id for c in store.list_chats()] == [second.id, first.id]

    store.add_message(first.id, StoredMessage("user", "hi"))
    assert [c.id for c in store.list_chats()] == [first.id, second.id]

    store.rename_chat(second.id, "renamed")
    assert store.get_chat(second.id).title == "renamed"
    assert [c.id for c in store.list_chats()] == [first.id, second.id]  # a rename keeps order

    store.update_chat(second.id, system_prompt=None, settings={"temperature": 0.1})
    updated = store.get_chat(second.id)
    assert (updated.system_prompt, updated.settings) == (None, {"temperature": 0.1})
    assert updated.updated_at > updated.created_at
    store.update_chat(second.id, system_prompt="Again.")
    assert store.get_chat(second.id).system_prompt == "Again."
    assert store.get_chat(second.id).settings == {"temperature": 0.1}  # left as it was

    store.delete_chat(first.id)
    assert [c.id for c in store.list_chats()] == [second.id]
    store.close()

    reopened, _ = _open(db_path)
    [chat] = reopened.list_chats()
    assert (chat.title, chat.system_prompt) == ("renamed", "Again.")
    assert first.settings == SETTINGS
    assert not notices


def test_missing_chats_raise_a_key_error_that_is_a_qwenchat_error(db_path):
    store, _ = _open(db_path)
    for call in (lambda: store.get_chat(99), lambda: store.rename_chat(99, "x"),
                 lambda: store.update_chat(99, settings={}), lambda: store.messages(99),
                 lambda: store.add_message(99, StoredMessage("user", "hi"))):
        with pytest.raises(NotFoundError, match="chat 99 does not exist") as caught:
            call()
        assert isinstance(caught.value, KeyError)
        assert isinstance(caught.value, QwenchatError)
    store.delete_chat(99)  # deleting what is gone is not an error


def test_deleting_a_chat_deletes_its_messages(db_path):
    store, _ = _open(db_path)
    doomed = store.create_chat("doomed", None, {})
    kept = store.create_chat("kept", None, {})
    store.add_message(doomed.id, StoredMessage("user", "bye"))
    store.add_message(kept.id, StoredMessage("user", "stay"))
    store.delete_chat(doomed.id)
    store.close()
    rows = _raw(db_path).execute("SELECT chat_id, content FROM messages").fetchall()
    assert rows == [(kept.id, "stay")]


def test_messages_round_trip_with_thinking_stopped_and_stats(db_path):
    store, _ = _open(db_path)
    chat = store.create_chat("t", None, SETTINGS)
    sent = [
        StoredMessage("system", "a note"),
        StoredMessage("user", "Why is the sky blue?"),
        StoredMessage("assistant", "Rayleigh scattering.", thinking="Short wavelengths…",
                      stats=STATS),
        StoredMessage("user", "And at sunset?"),
        StoredMessage("assistant", "Longer pa", thinking="", stopped=True,
                      stats={**STATS, "stop_reason": "cancelled", "decode_tok_s": None}),
    ]
    ids = [store.add_message(chat.id, m) for m in sent]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert [m.id for m in sent] == ids and all(m.created_at > 0 for m in sent)

    assert store.messages(chat.id) == sent
    store.close()
    reopened, _ = _open(db_path)
    assert reopened.messages(chat.id) == sent


def test_unknown_role_is_refused(db_path):
    store, _ = _open(db_path)
    chat = store.create_chat("t", None, {})
    with pytest.raises(ValueError, match="role"):
        store.add_message(chat.id, StoredMessage("tool", "x"))
    assert store.messages(chat.id) == []


def test_a_partial_reply_survives_a_crash_while_streaming(db_path):
    """A process killed mid-reply (no close, no checkpoint) leaves every saved part behind."""
    script = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from qwenchat.store import ChatStore, StoredMessage
        store = ChatStore(Path({str(db_path)!r}))
        chat = store.create_chat("crash", None, {{}})
        store.add_message(chat.id, StoredMessage("user", "Count to five."))
        reply = store.add_message(chat.id, StoredMessage("assistant", ""))
        for text in ["one", "one two", "one two three"]:
            store.update_message(reply, content=text, thinking="counting")
        print(chat.id, flush=True)
        os._exit(9)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 9, done.stderr
    assert db_path.with_name(db_path.name + "-wal").exists()  # really left uncheckpointed

    store, notices = _open(db_path)
    [user, reply] = store.messages(int(done.stdout))
    assert (user.content, reply.content, reply.thinking) == (
        "Count to five.", "one two three", "counting")
    assert not notices


def test_a_stopped_reply_saved_in_one_store_is_seen_by_a_second_one(db_path):
    store, _ = _open(db_path)
    chat = store.create_chat("t", None, {})
    reply = store.add_message(chat.id, StoredMessage("assistant", ""))
    store.update_message(reply, content="partial", thinking="hm")
    store.update_message(reply, stopped=True, stats={"stop_reason": "cancelled"})
    store.update_message(reply)  # nothing to change is fine
    # no close(): the second store must see what the first committed
    second, _ = _open(db_path)
    [saved] = second.messages(chat.id)
    assert (saved.content, saved.thinking, saved.stopped, saved.stats) == (
        "partial", "hm", True, {"stop_reason": "cancelled"})


def test_updating_a_message_of_a_deleted_chat_is_ignored(db_path):
    store, _ = _open(db_path)
    chat = store.create_chat("t", None, {})
    reply = store.add_message(chat.id, StoredMessage("assistant", ""))
    store.delete_chat(chat.id)
    store.update_message(reply, content="late")  # the streaming worker must not crash
    other = store.create_chat("u", None, {})
    store.add_message(other.id, StoredMessage("user", "new"))
    assert [m.content for m in store.messages(other.id)] == ["new"]


def test_an_interrupted_write_is_rolled_back_and_the_store_keeps_working(db_path):
    store, _ = _open(db_path)
    chat = store.create_chat("t", None, {})
    with pytest.raises(KeyboardInterrupt), store._write() as db:
        db.execute("UPDATE chats SET title = 'half' WHERE id = ?", (chat.id,))
        raise KeyboardInterrupt
    assert store.get_chat(chat.id).title == "t"
    store.rename_chat(chat.id, "whole")
    assert store.get_chat(chat.id).title == "whole"


def test_delete_messages_from_removes_that_message_and_every_later_one(db_path):
    store, _ = _open(db_path)
    chat = store.create_chat("t", None, {})
    other = store.create_chat("other", None, {})
    ids = [store.add_message(chat.id, StoredMessage(role, text))
           for role, text in [("user", "a"), ("assistant", "b"), ("user", "c"),
                              ("assistant", "d")]]
    store.add_message(other.id, StoredMessage("user", "elsewhere"))
    store.delete_messages_from(chat.id, ids[2])
    assert [m.content for m in store.messages(chat.id)] == ["a", "b"]
    assert [m.content for m in store.messages(other.id)] == ["elsewhere"]

    store.add_message(chat.id, StoredMessage("user", "c again"))
    assert [m.content for m in store.messages(chat.id)] == ["a", "b", "c again"]
    with pytest.raises(NotFoundError, match=f"message {ids[3]} is not in chat {chat.id}"):
        store.delete_messages_from(chat.id, ids[3])  # already gone: nothing else deleted
    assert len(store.messages(chat.id)) == 3


def test_a_new_database_is_at_the_current_schema_in_wal_mode(db_path):
    store, _ = _open(db_path)
    store.close()
    raw = _raw(db_path)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_version_1_database_is_upgraded_keeping_its_chats(db_path):
    db_path.parent.mkdir(parents=True)
    raw = _raw(db_path)
    raw.executescript(V1_SCHEMA)
    raw.execute("INSERT INTO chats VALUES (1, 'old', 'Be kind.', '{\"top_k\": 20}', 1.0, 2.0)")
    raw.execute("INSERT INTO messages VALUES (1, 1, 'user', 'hello', 1.5)")
    raw.execute("INSERT INTO messages VALUES (2, 1, 'assistant', 'hi there', 1.75)")
    raw.close()

    store, notices = _open(db_path)
    assert not notices
    chat = store.get_chat(1)
    assert (chat.title, chat.system_prompt, chat.settings) == ("old", "Be kind.", {"top_k": 20})
    assert store.messages(1) == [
        StoredMessage("user", "hello", id=1, created_at=1.5),
        StoredMessage("assistant", "hi there", id=2, created_at=1.75),
    ]
    store.add_message(1, StoredMessage("assistant", "more", thinking="t", stopped=True))
    assert store.messages(1)[-1].stopped
    store.close()
    assert _raw(db_path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_an_empty_file_becomes_a_working_database(db_path):
    db_path.parent.mkdir(parents=True)
    db_path.write_bytes(b"")
    store, notices = _open(db_path)
    chat = store.create_chat("t", None, {})
    assert store.list_chats() == [chat]
    assert not notices
    assert list(db_path.parent.glob("*.corrupt-*")) == []


def _assert_moved_aside(db_path: Path, notices: list[str], original: bytes | None) -> Path:
    [aside] = db_path.parent.glob("history.sqlite3.corrupt-*[0-9]")
    assert aside.name.startswith("history.sqlite3.corrupt-2")
    if original is not None:
        assert aside.read_bytes() == original  # kept byte for byte, never deleted
    [notice] = notices
    assert str(db_path) in notice and str(aside) in notice
    assert "unreadable" in notice and "started a new one" in notice
    return aside


def _assert_fresh_and_working(db_path: Path) -> None:
    store, notices = _open(db_path)
    assert store.list_chats() == []
    chat = store.create_chat("new", None, {})
    store.add_message(chat.id, StoredMessage("user", "works"))
    assert [m.content for m in store.messages(chat.id)] == ["works"]
    assert not notices


def test_a_garbage_file_is_moved_aside_and_a_fresh_store_starts(db_path):
    db_path.parent.mkdir(parents=True)
    garbage = random.Random(0).randbytes(8192)
    db_path.write_bytes(garbage)

    store, notices = _open(db_path)
    _assert_moved_aside(db_path, notices, garbage)
    assert "file is not a database" in notices[0]
    assert store.list_chats() == []
    store.close()
    _assert_fresh_and_working(db_path)


def test_moving_aside_takes_the_wal_along_and_never_overwrites(tmp_path):
    """A WAL left beside the fresh file would be replayed into it; an earlier copy is kept."""
    path = tmp_path / "history.sqlite3"
    first = store_module._move_aside(_write_files(path, b"one"))
    second = store_module._move_aside(_write_files(path, b"two"))
    assert first != second and first.parent == second.parent == tmp_path
    for aside, content in ((first, b"one"), (second, b"two")):
        assert aside.read_bytes() == content
        assert aside.with_name(aside.name + "-wal").read_bytes() == content + b" wal"
        assert aside.with_name(aside.name + "-shm").read_bytes() == content + b" shm"
    assert not any(p.name.startswith("history.sqlite3-") for p in tmp_path.iterdir())
    assert not path.exists()


def _write_files(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    path.with_name(path.name + "-wal").write_bytes(content + b" wal")
    path.with_name(path.name + "-shm").write_bytes(content + b" shm")
    return path


def test_a_truncated_database_is_moved_aside_and_a_fresh_store_starts(db_path):
    store, _ = _open(db_path)
    chat = store.create_chat("big", None, {})
    for i in range(300):
        store.add_message(chat.id, StoredMessage("user", f"message {i} " + "x" * 200))
    store.close()
    whole = db_path.read_bytes()
    db_path.write_bytes(whole[: len(whole) // 2])

    store, notices = _open(db_path)
    _assert_moved_aside(db_path, notices, whole[: len(whole) // 2])
    assert store.list_chats() == []
    store.close()
    _assert_fresh_and_working(db_path)


def test_a_database_with_a_damaged_page_is_moved_aside_at_start(db_path):
    """Damage that plain reads at start never touch is found by the integrity check, before
    the UI trips over it mid-chat."""
    store, _ = _open(db_path)
    chat = store.create_chat("t", None, {})
    store.add_message(chat.id, StoredMessage("user", "hello"))
    store.close()
    raw = _raw(db_path)
    page_size = raw.execute("PRAGMA page_size").fetchone()[0]
    [(root,)] = raw.execute("SELECT rootpage FROM sqlite_master WHERE name = 'messages_by_chat'")
    raw.close()
    damaged = bytearray(db_path.read_bytes())
    damaged[(root - 1) * page_size : root * page_size] = random.Random(1).randbytes(page_size)
    db_path.write_bytes(bytes(damaged))

    store, notices = _open(db_path)
    _assert_moved_aside(db_path, notices, bytes(damaged))
    assert "malformed" in notices[0]
    store.close()
    _assert_fresh_and_working(db_path)


def test_a_database_failing_the_integrity_check_is_moved_aside(db_path):
    """Every page readable, but an index that disagrees with its table."""
    store, _ = _open(db_path)
    chat = store.create_chat("t", None, {})
    store.add_message(chat.id, StoredMessage("user", "hello"))
    store.close()
    raw = _raw(db_path)
    raw.execute("PRAGMA writable_schema = ON")
    raw.execute("UPDATE sqlite_master SET sql = 'CREATE INDEX messages_by_chat ON "
                "messages(role, id)' WHERE name = 'messages_by_chat'")
    raw.close()

    store, notices = _open(db_path)
    _assert_moved_aside(db_path, notices, None)
    assert "integrity check failed: row 1 missing from index messages_by_chat" in notices[0]
    store.close()
    _assert_fresh_and_working(db_path)


def test_a_locked_database_is_left_in_place_and_the_session_runs_in_memory(db_path,
                                                                           monkeypatch):
    """A lock held by another process says nothing about the file: it must not be moved."""
    monkeypatch.setattr(store_module, "BUSY_TIMEOUT_S", 0.05)
    db_path.parent.mkdir(parents=True)
    holder = _raw(db_path)
    holder.executescript(V1_SCHEMA)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        store, notices = _open(db_path)
    finally:
        holder.execute("ROLLBACK")
    [notice] = notices
    assert str(db_path) in notice and "locked" in notice and "will not be kept" in notice
    assert list(db_path.parent.glob("*.corrupt-*")) == []
    chat = store.create_chat("t", None, {})
    assert store.list_chats() == [chat]
    assert holder.execute("PRAGMA user_version").fetchone()[0] == 1  # not upgraded either


def test_a_database_from_a_newer_schema_is_moved_aside(db_path):
    db_path.parent.mkdir(parents=True)
    raw = _raw(db_path)
    raw.execute("CREATE TABLE future (x)")
    raw.execute("PRAGMA user_version = 999")
    raw.close()

    store, notices = _open(db_path)
    aside = _assert_moved_aside(db_path, notices, None)
    assert "schema version 999" in notices[0]
    assert _raw(aside).execute("PRAGMA user_version").fetchone()[0] == 999
    store.close()
    _assert_fresh_and_working(db_path)


def test_a_database_whose_upgrade_fails_is_moved_aside(db_path):
    """Version 1 by its number but with no messages table: migration 2 cannot run."""
    db_path.parent.mkdir(parents=True)
    raw = _raw(db_path)
    raw.execute("CREATE TABLE chats (id INTEGER PRIMARY KEY, title TEXT)")
    raw.execute("INSERT INTO chats VALUES (1, 'precious')")
    raw.execute("PRAGMA user_version = 1")
    raw.close()

    store, notices = _open(db_path)
    aside = _assert_moved_aside(db_path, notices, None)
    assert "upgrading it to schema version 2 failed" in notices[0]
    moved = _raw(aside)  # the upgrade rolled back: the old file is as it was
    assert moved.execute("SELECT title FROM chats").fetchall() == [("precious",)]
    assert moved.execute("PRAGMA user_version").fetchone()[0] == 1
    store.close()
    _assert_fresh_and_working(db_path)


def test_a_path_that_cannot_be_opened_falls_back_to_memory_without_moving_it(tmp_path):
    path = tmp_path / "history.sqlite3"
    path.mkdir()  # a directory where the file should be
    store, notices = _open(path)
    [notice] = notices
    assert str(path) in notice and "will not be kept" in notice
    chat = store.create_chat("t", None, {})
    assert store.list_chats() == [chat]
    assert path.is_dir() and list(tmp_path.iterdir()) == [path]


def test_the_in_memory_store_writes_nothing_to_disk(tmp_path, isolated_home, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    store, notices = _open(None)
    chat = store.create_chat("t", "sys", SETTINGS)
    reply = store.add_message(chat.id, StoredMessage("assistant", "x", thinking="y"))
    store.update_message(reply, stopped=True)
    assert store.messages(chat.id)[0].stopped
    assert json.loads(json.dumps(store.export_json(chat.id)))["chat"]["title"] == "t"
    store.close()
    assert sorted(tmp_path.rglob("*")) == before
    assert not ChatStore.default_path().exists()
    assert not notices


def test_default_path_is_in_the_user_data_dir(isolated_home):
    assert ChatStore.default_path() == isolated_home / "data" / "qwenchat" / "history.sqlite3"


def test_writes_from_two_threads_all_land(db_path):
    store, _ = _open(db_path)
    chat = store.create_chat("t", None, {})
    errors: list[BaseException] = []

    def write(role: str) -> None:
        try:
            for i in range(100):
                message_id = store.add_message(chat.id, StoredMessage(role, ""))
                store.update_message(message_id, content=f"{role} {i}")
                store.list_chats()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(role,)) for role in ("user", "assistant")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    contents = [m.content for m in store.messages(chat.id)]
    assert sorted(contents) == sorted([f"{r} {i}" for r in ("user", "assistant")
                                       for i in range(100)])


def test_a_failed_write_is_a_readable_history_error(db_path):
    store, _ = _open(db_path)
    chat = store.create_chat("t", None, {})
    store.close()
    with pytest.raises(HistoryError, match=f"could not save chat history to {db_path}"):
        store.rename_chat(chat.id, "after close")


def _exported_chat(store: ChatStore) -> int:
    chat = store.create_chat("Sky  questions", "You are terse.",
                             {"temperature": 0.6, "seed": None, "thinking": True})
    store.add_message(chat.id, StoredMessage("user", "Why is the sky blue?"))
    store.add_message(chat.id, StoredMessage("assistant", "Rayleigh scattering.",
                                             thinking="Short wavelengths scatter more.",
                                             stats=STATS))
    store.add_message(chat.id, StoredMessage("user", "And at sunset?"))
    store.add_message(chat.id, StoredMessage("assistant", "Longer pa", stopped=True,
                                             stats={**STATS, "stop_reason": "cancelled"}))
    return chat.id


def test_markdown_export_has_headings_thinking_stopped_and_stats(db_path):
    store, _ = _open(db_path)
    text = store.export_markdown(_exported_chat(store))
    assert text.startswith("# Sky questions\n")
    assert "thinking on · temperature 0.6" in text and "seed None" not in text
    assert "## System prompt\n\nYou are terse." in text
    assert text.count("## User\n") == 2
    assert "## Assistant\n\n<details>\n<summary>Thinking</summary>\n\n" \
           "Short wavelengths scatter more.\n\n</details>\n\nRayleigh scattering." in text
    assert "## Assistant (stopped)\n\nLonger pa" in text
    assert "*42 tokens · 41.0 tok/s · first token after 0.12 s · stop: eos · seed 1234*" in text
    assert "stop: cancelled" in text
    assert text.index("Why is the sky blue?") < text.index("Rayleigh") < text.index("sunset")


def test_json_export_holds_the_chat_and_every_message(db_path):
    store, _ = _open(db_path)
    chat_id = _exported_chat(store)
    exported = json.loads(json.dumps(store.export_json(chat_id)))
    assert set(exported) == {"chat", "messages"}
    chat = exported["chat"]
    assert (chat["id"], chat["title"], chat["system_prompt"]) == (
        chat_id, "Sky  questions", "You are terse.")
    assert chat["settings"] == {"temperature": 0.6, "seed": None, "thinking": True}
    assert chat["created_at"] > 0 and chat["updated_at"] >= chat["created_at"]
    messages = exported["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[1]["thinking"] == "Short wavelengths scatter more."
    assert messages[1]["stats"] == STATS
    assert [m["stopped"] for m in messages] == [False, False, False, True]
    assert all(isinstance(m["id"], int) for m in messages)


def test_the_history_is_private_to_its_user(db_path):
    store = ChatStore(db_path)
    chat = store.create_chat("secret", None, {})
    store.add_message(chat.id, StoredMessage("user", "my secret"))
    assert stat.S_IMODE(db_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(db_path.parent.stat().st_mode) == 0o700
    wal = db_path.with_name(db_path.name + "-wal")
    assert wal.exists() and stat.S_IMODE(wal.stat().st_mode) == 0o600
    store.close()


def test_a_readable_history_from_before_is_made_private_when_opened(db_path):
    ChatStore(db_path).close()
    db_path.chmod(0o644)
    db_path.parent.chmod(0o755)
    store = ChatStore(db_path)
    assert stat.S_IMODE(db_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(db_path.parent.stat().st_mode) == 0o700
    store.close()

"""Conversations in SQLite, saved as they happen.

Every user message, every streamed chunk of a reply (text, token ids, per-token source tags) and every decode
cycle (phase times, acceptance) is saved when it arrives, so killing the app loses nothing typed or
generated. The unsent input of each conversation is kept too (``conversations.draft``).

Writes never run on the caller's thread: they go, in order, to one writer thread that owns its own connection
(``_Writer``), so a database locked by another program or a full disk never freezes the UI. A write that fails
is retried until it succeeds (the writes after it wait their turn: what is saved is always a prefix of what
was shown), and a finished reply whose saved text is shorter than what was appended is saved ``incomplete``,
never ``complete``. Reads use the caller's connection (WAL: a writer never blocks them) after waiting briefly
for this store's queued writes. Row ids are chosen here (time-ordered, with random low bits) so that a write
need not wait for SQLite to number its row, and two mtpchat processes on one folder never collide.

Each app instance owns the conversations it has open (an ``flock`` on ``locks/<id>.lock`` beside the
database, released when the process ends, however it ends): a second instance starts a conversation of its own
instead of writing into the first one's, and lists the other's as open elsewhere.

The schema is versioned with ``PRAGMA user_version``; ``MIGRATIONS[i]`` takes a database from version i to
i + 1. A database written by a newer mtpchat is refused with a clear error instead of being damaged. The
full-text index (FTS5, when this Python's SQLite has it) is kept outside the versions: it can be rebuilt from
the messages at any time, and a database made with it still opens where FTS5 is missing (search then uses LIKE).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

try:
    import fcntl
except ImportError:  # not POSIX: no ownership between processes (each instance owns what it opens)
    fcntl = None

from . import paths
from .reply_parts import ANSWER, REASONING, parts_or_answer
from .safe_text import terminal_safe

MIGRATIONS: list[str] = [
    # v0 -> v1: conversations and plain-text messages
    """
    CREATE TABLE conversations (
        id INTEGER PRIMARY KEY,
        title TEXT NOT NULL DEFAULT '',
        system_prompt TEXT NOT NULL DEFAULT '',
        model TEXT,
        draft TEXT NOT NULL DEFAULT '',
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
        content TEXT NOT NULL DEFAULT '',
        status TEXT NOT NULL DEFAULT 'complete',
        model TEXT,
        finish_reason TEXT,
        stats TEXT,
        error TEXT,
        created_at REAL NOT NULL
    );
    CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
    """,
    # v1 -> v2: per-token data of replies (ids, source tags, text pieces) and the per-cycle timing log
    """
    CREATE TABLE token_chunks (
        id INTEGER PRIMARY KEY,
        message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
        token_ids TEXT NOT NULL,
        sources TEXT NOT NULL,
        pieces TEXT NOT NULL
    );
    CREATE INDEX token_chunks_by_message ON token_chunks(message_id, id);
    CREATE TABLE cycles (
        id INTEGER PRIMARY KEY,
        message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
        idx INTEGER NOT NULL,
        depth INTEGER NOT NULL,
        drafted INTEGER NOT NULL,
        accepted INTEGER NOT NULL,
        accepted_mask TEXT NOT NULL,
        committed INTEGER NOT NULL,
        phase_ms TEXT NOT NULL,
        t_ms REAL NOT NULL
    );
    CREATE INDEX cycles_by_message ON cycles(message_id, id);
    ALTER TABLE messages ADD COLUMN fallbacks TEXT;
    """,
    # v2 -> v3: a thinking model's reply in two parts: messages.content is the answer, messages.reasoning the
    # reasoning; each token's part (one character per token, NULL: all answer) and each cycle's
    """
    ALTER TABLE messages ADD COLUMN reasoning TEXT NOT NULL DEFAULT '';
    ALTER TABLE token_chunks ADD COLUMN parts TEXT;
    ALTER TABLE cycles ADD COLUMN part TEXT;
    """,
    # v3 -> v4: a retried reply keeps the earlier ones as alternatives (hidden: not the one shown; the replies
    # after one user message are its alternatives); the generation settings of each reply (JSON)
    """
    ALTER TABLE messages ADD COLUMN hidden INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE messages ADD COLUMN settings TEXT;
    """,
    # v4 -> v5: under --depth auto, why each cycle ran at its depth (the chooser's expected rates, a probe, the
    # chain's stop); '' for a fixed depth
    """
    ALTER TABLE cycles ADD COLUMN why TEXT NOT NULL DEFAULT '';
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)

# per-token source tags are stored one character per token
SOURCE_CODE = {"draft": "d", "target": "t", "forced": "f"}  # forced: appended by the engine (thinking budget)
SOURCE_NAME = {code: name for name, code in SOURCE_CODE.items()}
PART_CODE = {REASONING: "r", ANSWER: "a"}
PART_NAME = {code: name for name, code in PART_CODE.items()}

log = logging.getLogger("mtpchat.store")


class StoreError(Exception):
    pass


def title_for(first_message: str) -> str:
    """A conversation's title: its first user message on one line, without control characters or escape
    sequences (titles are shown in the header and the conversation list), cut at 60 characters. The message
    itself is stored as written."""
    return " ".join(terminal_safe(first_message).split())[:60]


@dataclass
class Message:
    id: int
    role: str  # "user" | "assistant"
    content: str  # a reply's answer (without its reasoning)
    # complete | streaming | stopped | error | interrupted (the app died meanwhile) | incomplete (saved shorter
    # than it was shown: a chunk could not be written)
    status: str = "complete"
    model: str | None = None
    finish_reason: str | None = None
    stats: dict | None = None
    error: str | None = None
    fallbacks: list[dict] = field(default_factory=list)
    created_at: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # "draft" | "target" per token
    pieces: list[str] = field(default_factory=list)  # text of each token
    reasoning: str = ""  # a thinking model's reasoning (the text of the tokens whose part is "reasoning")
    parts: list[str] = field(default_factory=list)  # "reasoning" | "answer" per token
    hidden: bool = False  # an alternative of a reply that is not the one shown
    settings: dict | None = None  # a reply's generation settings (model, engine version, sampling, depth)


@dataclass
class Conversation:
    id: int
    title: str
    system_prompt: str
    draft: str
    model: str | None
    created_at: float
    updated_at: float
    messages: list[Message] = field(default_factory=list)  # the shown ones, in order
    # the replies to each user message (by its id), oldest first, the shown one among them: its alternatives
    branches: dict[int, list[Message]] = field(default_factory=dict)

    def add(self, message: Message) -> None:
        """Append a new message; a reply joins the alternatives of the user message it answers."""
        if message.role == "assistant":
            users = [m for m in self.messages if m.role == "user"]
            if users:
                self.branches.setdefault(users[-1].id, []).append(message)
        self.messages.append(message)

    def alternatives(self, message: Message) -> list[Message]:
        """The replies ``message`` is one of (itself alone when it has no alternative)."""
        for group in self.branches.values():
            if any(m.id == message.id for m in group):
                return group
        return [message]


@dataclass
class ConversationSummary:
    id: int
    title: str
    updated_at: float
    messages: int
    open_elsewhere: bool = False  # another mtpchat instance has it open
    snippet: str = ""  # a search's matching text


@dataclass
class CycleRow:
    message_id: int
    index: int
    depth: int
    drafted: int
    accepted: int
    accepted_per_position: list[bool]
    committed: int
    phase_ms: dict[str, float]
    t_ms: float  # milliseconds since the reply started (when the cycle reached the app)
    part: str = ANSWER  # the part of the reply the cycle decoded (its first token's)
    why: str = ""  # --depth auto: why this depth (the engine's Cycle.why)


def migrate(conn: sqlite3.Connection) -> int:
    """Bring the database to SCHEMA_VERSION; returns the version it had."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"the conversation database has schema version {version}, newer than this mtpchat "
            f"understands ({SCHEMA_VERSION}); upgrade mtpchat or move the file away"
        )
    for target in range(version + 1, SCHEMA_VERSION + 1):
        script = MIGRATIONS[target - 1]
        try:
            conn.executescript(f"BEGIN;\n{script}\nPRAGMA user_version = {target};\nCOMMIT;")
        except sqlite3.Error:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
    return version


def fts5_available() -> bool:
    """Whether this Python's SQLite has the FTS5 full-text module."""
    try:
        sqlite3.connect(":memory:").execute("CREATE VIRTUAL TABLE t USING fts5(x)")
        return True
    except sqlite3.Error:
        return False


def fts_query(text: str) -> str:
    """The user's search as an FTS5 query: every word, as a quoted prefix (so that FTS5's own syntax in what
    was typed is searched for, not obeyed)."""
    return " ".join('"' + word.replace('"', '""') + '"*' for word in text.split())


def _like(word: str) -> str:
    return "%" + word.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _snippet(text: str, words: list[str], width: int = 60) -> str:
    """The text around the first of ``words`` found in ``text``, on one line."""
    flat = " ".join(terminal_safe(text).split())
    lower = flat.lower()
    at = min((i for i in (lower.find(w.lower()) for w in words) if i >= 0), default=0)
    start = max(0, at - width // 3)
    return ("…" if start else "") + flat[start:start + width] + ("…" if start + width < len(flat) else "")


class _Claims:
    """The conversations this store has open, each held with an exclusive ``flock`` on its own lock file (held
    per open file, so two stores of one process exclude each other too, and let go when the process dies)."""

    def __init__(self, folder: Path | None):
        self.folder = folder if fcntl is not None else None  # None: nothing to coordinate with
        self.held: dict[int, int | None] = {}  # conversation id -> the lock's file descriptor

    def _file(self, conversation_id: int) -> Path:
        return self.folder / f"{conversation_id}.lock"

    def claim(self, conversation_id: int) -> bool:
        if conversation_id in self.held:
            return True
        fd = None
        if self.folder is not None:
            try:
                fd = os.open(self._file(conversation_id), os.O_RDWR | os.O_CREAT, 0o600)
            except OSError:  # no lock file possible (read-only folder): open it without ownership
                log.warning("cannot create the lock of conversation %s", conversation_id, exc_info=True)
            else:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    return False
        self.held[conversation_id] = fd
        return True

    def release(self, conversation_id: int) -> None:
        fd = self.held.pop(conversation_id, None)
        if fd is not None:
            os.close(fd)  # (the lock file stays: removing it would race with another process taking it)

    def held_elsewhere(self, conversation_id: int) -> bool:
        if conversation_id in self.held or self.folder is None:
            return False
        try:
            fd = os.open(self._file(conversation_id), os.O_RDWR)
        except OSError:  # no lock file: nobody ever opened it with ownership
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except OSError:
            return True
        finally:
            os.close(fd)  # (closing lets go of the lock just taken)

    def forget(self, conversation_id: int) -> None:
        """A deleted conversation's lock file goes too."""
        self.release(conversation_id)
        if self.folder is not None:
            try:
                self._file(conversation_id).unlink()
            except OSError:
                pass

    def close(self) -> None:
        for conversation_id in list(self.held):
            self.release(conversation_id)


@dataclass
class _Write:
    run: Callable[[sqlite3.Connection], None]  # the statements of one transaction
    key: tuple | None = None  # writes with the same key replace each other while queued (the draft)


class _Writer:
    """The thread that owns the writing connection: it runs the queued writes in order, each in its own
    transaction. A write that fails with an operational error (locked, busy, disk full, I/O) is retried, after
    a growing pause, until it succeeds or the store closes; one that can never succeed (a constraint) is logged
    and dropped. ``on_status(error)`` is called from this thread when a write has been failing for
    ``REPORT_AFTER_S`` and ``on_status(None)`` when writing works again."""

    PAUSES_S = (0.05, 0.1, 0.2, 0.5, 1.0)
    REPORT_AFTER_S = 1.0

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn
        self.queue: collections.deque[_Write] = collections.deque()
        self.current: _Write | None = None  # the write being run (or retried)
        self.error: str | None = None  # why the current write fails, while it fails
        self.on_status: Callable[[str | None], None] | None = None
        self._cond = threading.Condition()
        self._stop = False
        self._reported = False
        self.thread = threading.Thread(target=self._run, name="mtpchat-store", daemon=True)
        self.thread.start()

    def submit(self, write: _Write) -> None:
        with self._cond:
            if write.key is not None and self.queue and self.queue[-1].key == write.key:
                self.queue[-1] = write  # (only the last draft matters)
            else:
                self.queue.append(write)
            self._cond.notify_all()

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self.queue) + (self.current is not None)

    def flush(self, timeout: float | None) -> bool:
        """Wait until every queued write is done; False when ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self.queue and self.current is None, timeout)

    def close(self, timeout: float) -> bool:
        """Finish the queued writes (waiting at most ``timeout``), then stop; False when some were left."""
        drained = self.flush(timeout)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self.thread.join(2.0)
        if not drained:
            log.warning("closing the store with %d writes not saved (%s)", self.pending, self.error)
        try:
            self.conn.close()
        except sqlite3.Error:
            pass
        return drained

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self.queue or self._stop)
                if self._stop:
                    return
                self.current = self.queue.popleft()
            self._until_done(self.current)
            with self._cond:
                self.current = None
                self._cond.notify_all()

    def _until_done(self, write: _Write) -> None:
        failing_since = None
        attempt = 0
        while True:
            try:
                self._transaction(write)
            except sqlite3.OperationalError as exc:  # locked, busy, full, I/O: may work later
                now = time.monotonic()
                failing_since = failing_since or now
                self.error = str(exc)
                if not self._reported and now - failing_since >= self.REPORT_AFTER_S:
                    self._reported = True
                    self._say(self.error)
                pause = self.PAUSES_S[min(attempt, len(self.PAUSES_S) - 1)]
                attempt += 1
                with self._cond:
                    if self._cond.wait_for(lambda: self._stop, pause):
                        return
                continue
            except sqlite3.Error:  # never going to work: the writes after it still can
                log.exception("a conversation write failed and was dropped")
            self.error = None
            if self._reported:
                self._reported = False
                self._say(None)
            return

    def _transaction(self, write: _Write) -> None:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            write.run(self.conn)
            self.conn.execute("COMMIT")
        except BaseException:
            try:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            raise

    def _say(self, error: str | None) -> None:
        if self.on_status is not None:
            try:
                self.on_status(error)
            except Exception:  # the app may be gone already
                log.debug("store status callback failed", exc_info=True)


class Store:
    READ_WAIT_S = 0.5  # a read waits this long at most for this store's queued writes
    CLOSE_WAIT_S = 3.0  # closing waits this long at most for the queued writes to be saved

    def __init__(self, path: Path | str | None = None, *, timeout: float = 5.0):
        """Open (creating or migrating) the database; StoreError, never a traceback, when it cannot be used:
        a folder that cannot be made, a read-only or locked file, a newer schema. ``":memory:"``: a
        database of this session only (what the app falls back to)."""
        self.memory = path == ":memory:"
        self.path = None if self.memory else Path(path) if path is not None else paths.database_path()
        self._chars: dict[int, list[int]] = {}  # reply id -> [answer, reasoning] characters handed to the writer
        self._created: dict[int, Conversation] = {}  # conversations created here (shown before they are written)
        self._last_id = 0
        self._ids = threading.Lock()
        try:
            if self.memory:
                # one database both connections see: shared cache, by a name of its own
                target, uri, locks = f"file:mtpchat-{secrets.token_hex(8)}?mode=memory&cache=shared", True, None
            else:
                paths.private_file(self.path)  # created 0600 (SQLite gives its -wal / -shm files the same mode)
                for what in (self.path, self.path.parent):  # the folder too: the -wal and -shm files go there
                    if not os.access(what, os.W_OK):
                        raise StoreError(f"cannot save conversations: {what} is read-only")
                target, uri = str(self.path), False
                locks = paths.private_dir(self.path.parent / "locks")
            self.conn = sqlite3.connect(target, uri=uri, timeout=timeout, isolation_level=None,
                                        check_same_thread=False)
            if self.memory:
                self.conn.execute("PRAGMA read_uncommitted = ON")  # shared cache: reads take no table locks
            elif self.conn.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
                log.warning("the conversation database is not in WAL mode: reads may wait for writes")
            self.conn.execute("PRAGMA foreign_keys = ON")
            migrate(self.conn)
            self.conn.execute("PRAGMA busy_timeout = 200")  # reads: never long (WAL readers do not wait)
            writer = sqlite3.connect(target, uri=uri, timeout=0.25, isolation_level=None, check_same_thread=False)
            if not self.memory:
                writer.execute("PRAGMA synchronous = NORMAL")  # WAL: a killed process loses no commit
            writer.execute("PRAGMA foreign_keys = ON")
        except StoreError:
            raise
        except (sqlite3.Error, OSError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            raise StoreError(f"cannot open the conversation database {self.path or 'in memory'}: {reason}") from exc
        self.fts = fts5_available()
        self.claims = _Claims(locks)
        self.writer = _Writer(writer)
        self._write(self._at_start)

    # writing ---------------------------------------------------------------------------------------------
    def _write(self, run: Callable[[sqlite3.Connection], None], key: tuple | None = None) -> None:
        self.writer.submit(_Write(run, key))

    def _new_id(self) -> int:
        """A row id: milliseconds since 1970 times 1024 plus random low bits (unique between processes in
        practice, increasing within one; below 2**53, so exact in JSON)."""
        with self._ids:
            self._last_id = max(self._last_id + 1, time.time_ns() // 1_000_000 * 1024 + secrets.randbelow(1024))
            return self._last_id

    @property
    def on_write_status(self) -> Callable[[str | None], None] | None:
        """Called from the writer thread: an error when writes have been failing a while, None when they work
        again."""
        return self.writer.on_status

    @on_write_status.setter
    def on_write_status(self, callback: Callable[[str | None], None] | None) -> None:
        self.writer.on_status = callback

    @property
    def write_error(self) -> str | None:
        return self.writer.error

    @property
    def pending_writes(self) -> int:
        return self.writer.pending

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the queued writes; False when ``timeout`` passed first."""
        return self.writer.flush(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Save what is queued (waiting ``CLOSE_WAIT_S`` at most), close; False when writes were left unsaved
        (their reply stays 'streaming' and is found 'interrupted' at the next start: never 'complete')."""
        saved = self.writer.close(self.CLOSE_WAIT_S if timeout is None else timeout)
        self.claims.close()
        self.conn.close()
        return saved

    def _at_start(self, conn: sqlite3.Connection) -> None:
        """Replies that were streaming when their app died are interrupted (not those of a conversation another
        instance has open); empty chats nobody has open go; the full-text index is made where it is missing."""
        if self.fts and not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'messages_fts'").fetchone():
            conn.execute("CREATE VIRTUAL TABLE messages_fts USING fts5(content)")
            conn.execute("INSERT INTO messages_fts (rowid, content) SELECT id, content FROM messages")
        for message_id, conversation_id in conn.execute(
                "SELECT id, conversation_id FROM messages WHERE status = 'streaming'").fetchall():
            if not self.claims.held_elsewhere(conversation_id):
                conn.execute("UPDATE messages SET status = 'interrupted' WHERE id = ?", (message_id,))
                self._index(conn, message_id)
        for (conversation_id,) in conn.execute(
                """SELECT id FROM conversations c WHERE draft = '' AND NOT EXISTS
                   (SELECT 1 FROM messages m WHERE m.conversation_id = c.id)""").fetchall():
            if conversation_id not in self.claims.held and not self.claims.held_elsewhere(conversation_id):
                conn.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
                self.claims.forget(conversation_id)

    def _index(self, conn: sqlite3.Connection, message_id: int) -> None:
        if self.fts:
            conn.execute("DELETE FROM messages_fts WHERE rowid = ?", (message_id,))
            conn.execute("INSERT INTO messages_fts (rowid, content) SELECT id, content FROM messages WHERE id = ?",
                         (message_id,))

    def _unindex(self, conn: sqlite3.Connection, where: str, args: tuple) -> None:
        if self.fts:
            conn.execute(f"DELETE FROM messages_fts WHERE rowid IN (SELECT id FROM messages WHERE {where})", args)

    # ownership -------------------------------------------------------------------------------------------
    def claim(self, conversation_id: int) -> bool:
        """Own ``conversation_id`` (False: another mtpchat instance has it open)."""
        return self.claims.claim(conversation_id)

    def release(self, conversation_id: int) -> None:
        self.claims.release(conversation_id)

    def open_elsewhere(self, conversation_id: int) -> bool:
        return self.claims.held_elsewhere(conversation_id)

    def startup_conversation(self, system_prompt: str = "", model: str | None = None) -> int:
        """The conversation an app opens at start: the latest one, unless another instance has it open (then a
        new one), claimed."""
        latest = self.latest_conversation_id()
        if latest is not None and self.claim(latest):
            return latest
        return self.create_conversation(system_prompt, model)

    # conversations -------------------------------------------------------------------------------
    def create_conversation(self, system_prompt: str = "", model: str | None = None) -> int:
        """A new conversation, owned by this store."""
        conversation_id, now = self._new_id(), time.time()
        self.claim(conversation_id)
        self._created[conversation_id] = Conversation(conversation_id, "", system_prompt, "", model, now, now)
        self._write(lambda conn: conn.execute(
            "INSERT INTO conversations (id, system_prompt, model, created_at, updated_at) VALUES (?, ?, ?, ?, ?)",
            (conversation_id, system_prompt, model, now, now)))
        return conversation_id

    def _summaries(self, rows) -> list[ConversationSummary]:
        return [ConversationSummary(*row[:4], open_elsewhere=self.claims.held_elsewhere(row[0])) for row in rows]

    def list_conversations(self, include_empty: bool = False) -> list[ConversationSummary]:
        """Newest first; empty chats (no message) are left out unless asked for."""
        self.flush(self.READ_WAIT_S)
        rows = self.conn.execute(
            f"""SELECT c.id, c.title, c.updated_at, COUNT(m.id) FROM conversations c
               LEFT JOIN messages m ON m.conversation_id = c.id AND m.hidden = 0
               GROUP BY c.id {'' if include_empty else 'HAVING COUNT(m.id) > 0'}
               ORDER BY c.updated_at DESC, c.id DESC"""
        ).fetchall()
        return self._summaries(rows)

    def search(self, text: str) -> list[ConversationSummary]:
        """Conversations whose title or one of whose messages holds every word of ``text`` (prefixes too),
        newest first, each with the matching text: FTS5 where this SQLite has it, else LIKE."""
        words = text.split()
        if not words:
            return self.list_conversations()
        self.flush(self.READ_WAIT_S)
        hits: dict[int, str] = {}
        title_rows = self.conn.execute(
            "SELECT id, title FROM conversations WHERE " + " AND ".join(["title LIKE ? ESCAPE '\\'"] * len(words)),
            [_like(w) for w in words]).fetchall()
        for conversation_id, title in title_rows:
            hits[conversation_id] = _snippet(title, words)
        rows = None
        if self.fts:
            try:
                rows = self.conn.execute(
                    """SELECT m.conversation_id, snippet(messages_fts, 0, '', '', '…', 10) FROM messages_fts f
                       JOIN messages m ON m.id = f.rowid WHERE messages_fts MATCH ? ORDER BY f.rank""",
                    (fts_query(text),)).fetchall()
            except sqlite3.OperationalError:  # the index is not made yet (its write is queued): LIKE
                rows = None
        if rows is None:
            rows = [(cid, _snippet(content, words)) for cid, content in self.conn.execute(
                "SELECT conversation_id, content FROM messages WHERE "
                + " AND ".join(["content LIKE ? ESCAPE '\\'"] * len(words)) + " ORDER BY id DESC",
                [_like(w) for w in words]).fetchall()]
        for conversation_id, snippet in rows:
            hits.setdefault(conversation_id, " ".join(terminal_safe(snippet).split()))
        if not hits:
            return []
        summaries = [s for s in self.list_conversations(include_empty=True) if s.id in hits]
        for summary in summaries:
            summary.snippet = hits[summary.id]
        return summaries

    def recent_prompts(self, limit: int = 200) -> list[str]:
        """The user's messages over every conversation, newest first, each once (the input's up-arrow recall)."""
        self.flush(self.READ_WAIT_S)
        out: dict[str, None] = {}
        for (content,) in self.conn.execute(
                "SELECT content FROM messages WHERE role = 'user' ORDER BY id DESC LIMIT ?", (limit * 2,)):
            if content.strip():
                out.setdefault(content)
        return list(out)[:limit]

    def latest_conversation_id(self) -> int | None:
        self.flush(self.READ_WAIT_S)
        row = self.conn.execute(
            "SELECT id FROM conversations ORDER BY updated_at DESC, id DESC LIMIT 1"
        ).fetchone()
        return row[0] if row else None

    def load_conversation(self, conversation_id: int) -> Conversation:
        self.flush(self.READ_WAIT_S)
        row = self.conn.execute(
            "SELECT id, title, system_prompt, draft, model, created_at, updated_at FROM conversations WHERE id = ?",
            (conversation_id,),
        ).fetchone()
        if row is None:
            created = self._created.get(conversation_id)
            if created is None:
                raise StoreError(f"no conversation {conversation_id}")
            # created here, its write still queued (the database is locked): empty as it was made
            return Conversation(created.id, created.title, created.system_prompt, created.draft, created.model,
                                created.created_at, created.updated_at)
        conv = Conversation(*row)
        messages = {}
        last_user = None
        for r in self.conn.execute(
            """SELECT id, role, content, status, model, finish_reason, stats, error, fallbacks, created_at,
                      reasoning, hidden, settings
               FROM messages WHERE conversation_id = ? ORDER BY id""",
            (conversation_id,),
        ):
            msg = Message(
                id=r[0], role=r[1], content=r[2], status=r[3], model=r[4], finish_reason=r[5],
                stats=json.loads(r[6]) if r[6] else None, error=r[7],
                fallbacks=json.loads(r[8]) if r[8] else [], created_at=r[9], reasoning=r[10], hidden=bool(r[11]),
                settings=json.loads(r[12]) if r[12] else None,
            )
            messages[msg.id] = msg
            if msg.role == "user":
                last_user = msg.id
            elif last_user is not None:
                conv.branches.setdefault(last_user, []).append(msg)
        for group in conv.branches.values():  # every alternative hidden (the app died mid-retry): the last shown
            if all(m.hidden for m in group):
                group[-1].hidden = False
        conv.messages = [m for m in messages.values() if not m.hidden]
        for message_id, ids, sources, pieces, parts in self.conn.execute(
            """SELECT t.message_id, t.token_ids, t.sources, t.pieces, t.parts FROM token_chunks t
               JOIN messages m ON m.id = t.message_id WHERE m.conversation_id = ? ORDER BY t.id""",
            (conversation_id,),
        ):
            msg = messages[message_id]
            msg.token_ids.extend(json.loads(ids))
            msg.sources.extend(SOURCE_NAME[c] for c in sources)
            msg.pieces.extend(json.loads(pieces))
            msg.parts.extend([PART_NAME[c] for c in parts] if parts else [ANSWER] * len(sources))  # NULL: before v3
        return conv

    def delete_conversation(self, conversation_id: int) -> None:
        """StoreError when another instance has it open."""
        if self.claims.held_elsewhere(conversation_id):
            raise StoreError("that conversation is open in another mtpchat window")
        self.claims.forget(conversation_id)
        self._created.pop(conversation_id, None)

        def run(conn: sqlite3.Connection) -> None:
            self._unindex(conn, "conversation_id = ?", (conversation_id,))
            conn.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

        self._write(run)

    def rename_conversation(self, conversation_id: int, title: str) -> str:
        """Set the title (made one safe line, as titles are); returns it."""
        title = title_for(title)
        if conversation_id in self._created:
            self._created[conversation_id].title = title
        self._write(lambda conn: conn.execute("UPDATE conversations SET title = ? WHERE id = ?",
                                              (title, conversation_id)))
        return title

    def set_draft(self, conversation_id: int, text: str) -> None:
        self._write(lambda conn: conn.execute("UPDATE conversations SET draft = ? WHERE id = ?",
                                              (text, conversation_id)), key=("draft", conversation_id))

    def set_system_prompt(self, conversation_id: int, text: str) -> None:
        now = time.time()
        self._write(lambda conn: conn.execute(
            "UPDATE conversations SET system_prompt = ?, updated_at = ? WHERE id = ?", (text, now, conversation_id)))

    @staticmethod
    def _touch(conn: sqlite3.Connection, conversation_id: int, model: str | None = None) -> None:
        conn.execute(
            "UPDATE conversations SET updated_at = ?, model = COALESCE(?, model) WHERE id = ?",
            (time.time(), model, conversation_id),
        )

    # messages ------------------------------------------------------------------------------------
    def add_message(
        self, conversation_id: int, role: str, content: str = "", *, status: str = "complete",
        model: str | None = None, settings: dict | None = None,
    ) -> int:
        """A new message (its id at once, its row when the writer gets to it). ``settings``: a reply's
        generation settings, kept for exports."""
        message_id, now = self._new_id(), time.time()
        if role == "assistant":
            self._chars[message_id] = [len(content), 0]
        settings_json = json.dumps(settings) if settings is not None else None

        def run(conn: sqlite3.Connection) -> None:
            conn.execute(
                """INSERT INTO messages (id, conversation_id, role, content, status, model, settings, created_at)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?)""",
                (message_id, conversation_id, role, content, status, model, settings_json, now),
            )
            if role == "user":
                conn.execute("UPDATE conversations SET title = ? WHERE id = ? AND title = ''",
                             (title_for(content), conversation_id))
                self._index(conn, message_id)
            self._touch(conn, conversation_id, model)

        self._write(run)
        return message_id

    def append_reply(
        self, message_id: int, text: str, token_ids: list[int], sources: list[str], pieces: list[str],
        cycles: Iterable[tuple[Any, float]] = (), *, reasoning: str = "", parts: list[str] | None = None,
        cycle_parts: list[str] | None = None,
    ) -> None:
        """Persist one streamed chunk of a reply and the cycles that produced it, in one transaction.
        ``text`` is the chunk's answer text, ``reasoning`` its reasoning text, ``parts`` each token's part (None:
        all answer). ``cycles``: (cycle, t_ms) pairs, a cycle having CycleRow's fields but message_id and t_ms
        (the engine's ``Cycle``), t_ms when it reached the app, milliseconds after the reply started;
        ``cycle_parts`` the part each decoded (None: the answer)."""
        cycles = list(cycles)
        cycle_parts = cycle_parts if cycle_parts and len(cycle_parts) == len(cycles) else [ANSWER] * len(cycles)
        chars = self._chars.get(message_id)
        if chars is not None:
            chars[0] += len(text)
            chars[1] += len(reasoning)
        chunk = None
        if token_ids:
            chunk = (message_id, json.dumps(token_ids), "".join(SOURCE_CODE[s] for s in sources),
                     json.dumps(pieces, ensure_ascii=False),
                     "".join(PART_CODE[p] for p in parts_or_answer(parts, len(token_ids))))
        cycle_rows = [
            (message_id, c.index, c.depth, c.drafted, c.accepted,
             "".join("1" if a else "0" for a in c.accepted_per_position), c.committed,
             json.dumps(c.phase_ms), t_ms, part, c.why)
            for (c, t_ms), part in zip(cycles, cycle_parts)
        ]

        def run(conn: sqlite3.Connection) -> None:
            if text or reasoning:
                conn.execute("UPDATE messages SET content = content || ?, reasoning = reasoning || ? WHERE id = ?",
                             (text, reasoning, message_id))
            if chunk:
                conn.execute("INSERT INTO token_chunks (message_id, token_ids, sources, pieces, parts) "
                             "VALUES (?, ?, ?, ?, ?)", chunk)
            conn.executemany(
                """INSERT INTO cycles (message_id, idx, depth, drafted, accepted, accepted_mask, committed,
                   phase_ms, t_ms, part, why) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""", cycle_rows)

        self._write(run)

    def finish_message(
        self, message_id: int, status: str, *, finish_reason: str | None = None, stats: dict | None = None,
        error: str | None = None, fallbacks: list[dict] | None = None,
    ) -> None:
        """The reply's end. A reply saved shorter than what this store was given for it (a chunk could not be
        written) is saved 'incomplete' instead of complete or stopped."""
        chars = self._chars.pop(message_id, None)
        values = (finish_reason, json.dumps(stats) if stats is not None else None, error,
                  json.dumps(fallbacks) if fallbacks else None, message_id)

        def run(conn: sqlite3.Connection) -> None:
            saved = status
            if chars is not None and status in ("complete", "stopped"):
                # (counted here, not by SQLite: its length() stops at the first NUL, which a model's text may hold)
                row = conn.execute("SELECT content, reasoning FROM messages WHERE id = ?", (message_id,)).fetchone()
                lengths = None if row is None else [len(row[0] or ""), len(row[1] or "")]
                if lengths is not None and lengths != chars:
                    saved = "incomplete"
                    log.warning("reply %s saved shorter than it was shown: %s of %s characters",
                                message_id, lengths, chars)
            conn.execute("UPDATE messages SET status = ?, finish_reason = ?, stats = ?, error = ?, fallbacks = ? "
                         "WHERE id = ?", (saved, *values))
            self._index(conn, message_id)
            conv = conn.execute("SELECT conversation_id FROM messages WHERE id = ?", (message_id,)).fetchone()
            if conv:
                self._touch(conn, conv[0])

        self._write(run)

    def delete_message(self, message_id: int) -> None:
        self.delete_messages([message_id])

    def delete_messages(self, message_ids: Iterable[int]) -> None:
        ids = list(message_ids)
        marks = ",".join("?" * len(ids))

        def run(conn: sqlite3.Connection) -> None:
            self._unindex(conn, f"id IN ({marks})", tuple(ids))
            conn.execute(f"DELETE FROM messages WHERE id IN ({marks})", ids)

        if ids:
            self._write(run)

    def show_alternative(self, message_id: int, alternatives: Iterable[int]) -> None:
        """Of the replies ``alternatives`` (one user message's), show ``message_id`` and hide the others."""
        ids = list(alternatives)
        marks = ",".join("?" * len(ids))
        self._write(lambda conn: conn.execute(
            f"UPDATE messages SET hidden = (id != ?) WHERE id IN ({marks})", (message_id, *ids)))

    def hide_message(self, message_id: int) -> None:
        """A reply becomes an alternative that is not shown (a retry keeps it)."""
        self._write(lambda conn: conn.execute("UPDATE messages SET hidden = 1 WHERE id = ?", (message_id,)))

    def cycles(self, conversation_id: int) -> list[CycleRow]:
        self.flush(self.READ_WAIT_S)
        rows = self.conn.execute(
            """SELECT c.message_id, c.idx, c.depth, c.drafted, c.accepted, c.accepted_mask, c.committed,
                      c.phase_ms, c.t_ms, c.part, c.why
               FROM cycles c JOIN messages m ON m.id = c.message_id
               WHERE m.conversation_id = ? ORDER BY c.id""",
            (conversation_id,),
        ).fetchall()
        return [
            CycleRow(r[0], r[1], r[2], r[3], r[4], [ch == "1" for ch in r[5]], r[6], json.loads(r[7]), r[8],
                     r[9] or ANSWER, r[10])
            for r in rows
        ]

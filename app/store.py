"""Conversations in SQLite, saved as they happen.

Every user message, every streamed chunk of a reply (text, token ids, per-token source tags) and every decode
cycle (phase times, acceptance) is committed when it arrives, so killing the app loses nothing typed or
generated. The unsent input of each conversation is kept too (``conversations.draft``).

The schema is versioned with ``PRAGMA user_version``; ``MIGRATIONS[i]`` takes a database from version i to
i + 1. A database written by a newer mtpchat is refused with a clear error instead of being damaged.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

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
]
SCHEMA_VERSION = len(MIGRATIONS)

# per-token source tags are stored one character per token
SOURCE_CODE = {"draft": "d", "target": "t", "forced": "f"}  # forced: appended by the engine (thinking budget)
SOURCE_NAME = {code: name for name, code in SOURCE_CODE.items()}
PART_CODE = {REASONING: "r", ANSWER: "a"}
PART_NAME = {code: name for name, code in PART_CODE.items()}


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
    status: str = "complete"  # complete | streaming | stopped | error | interrupted
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


@dataclass
class Conversation:
    id: int
    title: str
    system_prompt: str
    draft: str
    model: str | None
    created_at: float
    updated_at: float
    messages: list[Message] = field(default_factory=list)


@dataclass
class ConversationSummary:
    id: int
    title: str
    updated_at: float
    messages: int


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


class Store:
    def __init__(self, path: Path | str | None = None):
        self.path = Path(path) if path is not None else paths.database_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=True)
            self.conn.execute("PRAGMA journal_mode = WAL")
            self.conn.execute("PRAGMA synchronous = NORMAL")  # WAL: a killed process loses no commit
            self.conn.execute("PRAGMA foreign_keys = ON")
            migrate(self.conn)
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"cannot open the conversation database {self.path}: {exc}") from exc
        # replies that were streaming when the previous run died
        self.conn.execute("UPDATE messages SET status = 'interrupted' WHERE status = 'streaming'")

    def close(self) -> None:
        self.conn.close()

    # conversations -------------------------------------------------------------------------------
    def create_conversation(self, system_prompt: str = "", model: str | None = None) -> int:
        now = time.time()
        cur = self.conn.execute(
            "INSERT INTO conversations (system_prompt, model, created_at, updated_at) VALUES (?, ?, ?, ?)",
            (system_prompt, model, now, now),
        )
        return cur.lastrowid

    def list_conversations(self) -> list[ConversationSummary]:
        rows = self.conn.execute(
            """SELECT c.id, c.title, c.updated_at, COUNT(m.id) FROM conversations c
               LEFT JOIN messages m ON m.conversation_id = c.id
               GROUP BY c.id ORDER BY c.updated_at DESC, c.id DESC"""
        ).fetchall()
        return [ConversationSummary(*row) for row in rows]

    def latest_conversation_id(self) -> int | None:
        row = self.conn.execute(
            "SELECT id FROM conversations ORDER BY updated_at DESC, id DESC LIMIT 1"
        ).fetchone()
        return row[0] if row else None

    def load_conversation(self, conversation_id: int) -> Conversation:
        row = self.conn.execute(
            "SELECT id, title, system_prompt, draft, model, created_at, updated_at FROM conversations WHERE id = ?",
            (conversation_id,),
        ).fetchone()
        if row is None:
            raise StoreError(f"no conversation {conversation_id}")
        conv = Conversation(*row)
        messages = {}
        for r in self.conn.execute(
            """SELECT id, role, content, status, model, finish_reason, stats, error, fallbacks, created_at,
                      reasoning
               FROM messages WHERE conversation_id = ? ORDER BY id""",
            (conversation_id,),
        ):
            msg = Message(
                id=r[0], role=r[1], content=r[2], status=r[3], model=r[4], finish_reason=r[5],
                stats=json.loads(r[6]) if r[6] else None, error=r[7],
                fallbacks=json.loads(r[8]) if r[8] else [], created_at=r[9], reasoning=r[10],
            )
            messages[msg.id] = msg
            conv.messages.append(msg)
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
        self.conn.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def set_draft(self, conversation_id: int, text: str) -> None:
        self.conn.execute("UPDATE conversations SET draft = ? WHERE id = ?", (text, conversation_id))

    def set_system_prompt(self, conversation_id: int, text: str) -> None:
        self.conn.execute(
            "UPDATE conversations SET system_prompt = ?, updated_at = ? WHERE id = ?",
            (text, time.time(), conversation_id),
        )

    def _touch(self, conversation_id: int, model: str | None = None) -> None:
        self.conn.execute(
            "UPDATE conversations SET updated_at = ?, model = COALESCE(?, model) WHERE id = ?",
            (time.time(), model, conversation_id),
        )

    # messages ------------------------------------------------------------------------------------
    def add_message(
        self, conversation_id: int, role: str, content: str = "", *, status: str = "complete",
        model: str | None = None,
    ) -> int:
        with self.conn:
            self.conn.execute("BEGIN")
            cur = self.conn.execute(
                """INSERT INTO messages (conversation_id, role, content, status, model, created_at)
                   VALUES (?, ?, ?, ?, ?, ?)""",
                (conversation_id, role, content, status, model, time.time()),
            )
            if role == "user":
                self.conn.execute(
                    "UPDATE conversations SET title = ? WHERE id = ? AND title = ''",
                    (title_for(content), conversation_id),
                )
            self._touch(conversation_id, model)
        return cur.lastrowid

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
        with self.conn:
            self.conn.execute("BEGIN")
            if text or reasoning:
                self.conn.execute("UPDATE messages SET content = content || ?, reasoning = reasoning || ? "
                                  "WHERE id = ?", (text, reasoning, message_id))
            if token_ids:
                self.conn.execute(
                    "INSERT INTO token_chunks (message_id, token_ids, sources, pieces, parts) VALUES (?, ?, ?, ?, ?)",
                    (message_id, json.dumps(token_ids), "".join(SOURCE_CODE[s] for s in sources),
                     json.dumps(pieces, ensure_ascii=False),
                     "".join(PART_CODE[p] for p in parts_or_answer(parts, len(token_ids)))),
                )
            self.conn.executemany(
                """INSERT INTO cycles (message_id, idx, depth, drafted, accepted, accepted_mask, committed,
                   phase_ms, t_ms, part) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                [
                    (message_id, c.index, c.depth, c.drafted, c.accepted,
                     "".join("1" if a else "0" for a in c.accepted_per_position), c.committed,
                     json.dumps(c.phase_ms), t_ms, part)
                    for (c, t_ms), part in zip(cycles, cycle_parts)
                ],
            )

    def finish_message(
        self, message_id: int, status: str, *, finish_reason: str | None = None, stats: dict | None = None,
        error: str | None = None, fallbacks: list[dict] | None = None,
    ) -> None:
        with self.conn:
            self.conn.execute("BEGIN")
            self.conn.execute(
                """UPDATE messages SET status = ?, finish_reason = ?, stats = ?, error = ?, fallbacks = ?
                   WHERE id = ?""",
                (status, finish_reason, json.dumps(stats) if stats is not None else None, error,
                 json.dumps(fallbacks) if fallbacks else None, message_id),
            )
            conv = self.conn.execute("SELECT conversation_id FROM messages WHERE id = ?", (message_id,)).fetchone()
            if conv:
                self._touch(conv[0])

    def delete_message(self, message_id: int) -> None:
        self.conn.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    def cycles(self, conversation_id: int) -> list[CycleRow]:
        rows = self.conn.execute(
            """SELECT c.message_id, c.idx, c.depth, c.drafted, c.accepted, c.accepted_mask, c.committed,
                      c.phase_ms, c.t_ms, c.part
               FROM cycles c JOIN messages m ON m.id = c.message_id
               WHERE m.conversation_id = ? ORDER BY c.id""",
            (conversation_id,),
        ).fetchall()
        return [
            CycleRow(r[0], r[1], r[2], r[3], r[4], [ch == "1" for ch in r[5]], r[6], json.loads(r[7]), r[8],
                     r[9] or ANSWER)
            for r in rows
        ]

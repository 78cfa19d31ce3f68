"""Export a conversation: transcript (Markdown, JSON with per-token source tags) and timing log (CSV, JSONL:
one row per decode cycle with its phase times and acceptance).

A thinking model's reply keeps its parts apart: Markdown puts the reasoning in a collapsed ``<details>`` block
above the answer; JSON gives ``reasoning`` and ``answer`` each with its text and tokens (id, text, source); the
timing log says which part each cycle decoded (acceptance usually differs between them)."""

from __future__ import annotations

import csv
import io
import json
import re
import time
from pathlib import Path

from .reply_parts import (ANSWER, REASONING, parts_or_answer, reasoning_ms, select, shown_answer,
                          shown_reasoning, thinking_title)
from .stats import stats_line
from .store import Conversation, CycleRow, Message, Store

FORMATS = {
    "md": "transcript (Markdown)",
    "json": "transcript (JSON, per-token sources)",
    "csv": "timing log (CSV)",
    "jsonl": "timing log (JSONL)",
}


class ExportError(Exception):
    pass


def _slug(text: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()
    return slug[:40] or "chat"


def transcript_markdown(conv: Conversation) -> str:
    out = [f"# {conv.title or 'Chat'}", ""]
    out.append(f"*mtpchat conversation {conv.id}, {time.strftime('%Y-%m-%d %H:%M', time.localtime(conv.created_at))}*")
    out.append("")
    if conv.system_prompt:
        out += ["## System", "", conv.system_prompt, ""]
    for msg in conv.messages:
        heading = "User" if msg.role == "user" else f"Assistant{f' ({msg.model})' if msg.model else ''}"
        out += [f"## {heading}", ""]
        if msg.reasoning.strip():  # GitHub and most renderers show <details> collapsed
            title = thinking_title(msg.parts.count(REASONING), reasoning_ms(msg.stats))
            out += [f"<details><summary>{title}</summary>", "", shown_reasoning(msg.reasoning), "", "</details>", ""]
        out += [shown_answer(msg.content) if msg.role == "assistant" else msg.content, ""]
        if msg.role == "assistant":
            notes = [n for n in (stats_line(msg.stats), msg.status if msg.status != "complete" else "",
                                 f"error: {msg.error}" if msg.error else "") if n]
            if notes:
                out += [f"*{' · '.join(notes)}*", ""]
    return "\n".join(out)


def transcript_json(conv: Conversation) -> dict:
    messages = []
    for msg in conv.messages:
        item = {"role": msg.role, "content": msg.content, "created_at": msg.created_at}
        if msg.role == "assistant":
            parts = parts_or_answer(msg.parts, len(msg.token_ids))
            item.update(
                status=msg.status, model=msg.model, finish_reason=msg.finish_reason, stats=msg.stats,
                error=msg.error, fallbacks=msg.fallbacks,
                tokens=[
                    {"id": tid, "text": piece, "source": source, "part": part}
                    for tid, piece, source, part in zip(msg.token_ids, msg.pieces, msg.sources, parts)
                ],
                reasoning=_part_json(msg, REASONING, parts),
                answer=_part_json(msg, ANSWER, parts),
            )
        messages.append(item)
    return {
        "format": "mtpchat-transcript",
        "version": 2,  # 2: a reply's reasoning and answer apart, each token's part
        "id": conv.id,
        "title": conv.title,
        "system_prompt": conv.system_prompt,
        "created_at": conv.created_at,
        "messages": messages,
    }


def _part_json(msg: Message, part: str, parts: list[str]) -> dict:
    """One part of a reply: its text and its tokens with their sources."""
    ids, pieces, sources = select(part, parts, msg.token_ids, msg.pieces, msg.sources)
    return {"text": msg.reasoning if part == REASONING else msg.content,
            "tokens": [{"id": t, "text": p, "source": s} for t, p, s in zip(ids, pieces, sources)]}


def _cycle_record(row: CycleRow) -> dict:
    return {
        "message_id": row.message_id,
        "cycle": row.index,
        "part": row.part,
        "depth": row.depth,
        "drafted": row.drafted,
        "accepted": row.accepted,
        "accepted_per_position": row.accepted_per_position,
        "committed": row.committed,
        "t_ms": round(row.t_ms, 3),
        "phase_ms": row.phase_ms,
    }


def timing_csv(rows: list[CycleRow]) -> str:
    from engine import PHASES  # here, not at import: importing the engine imports torch

    phases = list(PHASES)
    for row in rows:
        phases += [p for p in row.phase_ms if p not in phases]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(
        ["message_id", "cycle", "depth", "drafted", "accepted", "accepted_per_position", "committed", "t_ms", "part"]
        + [f"{p}_ms" for p in phases]
    )
    for row in rows:
        writer.writerow(
            [row.message_id, row.index, row.depth, row.drafted, row.accepted,
             "".join("1" if a else "0" for a in row.accepted_per_position), row.committed, f"{row.t_ms:.3f}",
             row.part]
            + [f"{row.phase_ms[p]:.4f}" if p in row.phase_ms else "" for p in phases]
        )
    return buf.getvalue()


def timing_jsonl(rows: list[CycleRow]) -> str:
    return "".join(json.dumps(_cycle_record(row)) + "\n" for row in rows)


def export_conversation(store: Store, conversation_id: int, directory: Path | str, formats: list[str]) -> list[Path]:
    """Write the chosen formats into ``directory`` (created if needed); returns the written paths."""
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ExportError(f"unknown export format: {', '.join(unknown)}" if unknown else "choose a format")
    directory = Path(directory).expanduser()
    conv = store.load_conversation(conversation_id)
    rows = store.cycles(conversation_id) if {"csv", "jsonl"} & set(formats) else []
    stem = f"mtpchat-{conv.id}-{_slug(conv.title)}"
    contents = {
        "md": (f"{stem}.md", lambda: transcript_markdown(conv)),
        "json": (f"{stem}.json", lambda: json.dumps(transcript_json(conv), indent=2, ensure_ascii=False) + "\n"),
        "csv": (f"{stem}-timing.csv", lambda: timing_csv(rows)),
        "jsonl": (f"{stem}-timing.jsonl", lambda: timing_jsonl(rows)),
    }
    try:
        directory.mkdir(parents=True, exist_ok=True)
        written = []
        for fmt in formats:
            name, render = contents[fmt]
            path = directory / name
            path.write_text(render(), encoding="utf-8")
            written.append(path)
    except OSError as exc:
        raise ExportError(f"cannot write to {directory}: {exc.strerror or exc}") from exc
    return written

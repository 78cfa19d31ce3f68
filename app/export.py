"""Export a conversation: transcript (Markdown, JSON with per-token source tags) and timing log (CSV, JSONL:
one row per decode cycle with its phase times and acceptance).

A thinking model's reply keeps its parts apart: Markdown puts the reasoning in a collapsed ``<details>`` block
above the answer; JSON gives ``reasoning`` and ``answer`` each with its text and tokens (id, text, source); the
timing log says which part each cycle decoded (acceptance usually differs between them).

Each reply records how it was made (``Message.settings``: model, mtpchat version, temperature, top-p, top-k,
seed, depth); a retried reply's alternatives are exported with it. Files are created 0600, folders 0700.
The CSV writes each cycle's per-position acceptance as letters ("AAR": the first two drafts accepted, the third
rejected), text that spreadsheets keep as it is (digits would lose their leading zeros, slashes become dates)."""

from __future__ import annotations

import csv
import io
import json
import re
import time
from importlib import metadata
from pathlib import Path

from . import paths
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


def mtpchat_version() -> str:
    """The installed mtpchat's version (the engine and the app ship together)."""
    try:
        return metadata.version("mtpchat")
    except metadata.PackageNotFoundError:
        return "unknown"


# what a reply records of the GenerationSettings it was made with, in this order
SETTINGS_KEYS = ("temperature", "top_p", "top_k", "seed", "depth", "max_new_tokens")
SETTING_LABELS = {"top_p": "top-p", "top_k": "top-k", "max_new_tokens": "max tokens"}


def reply_settings(model: str | None, settings: dict) -> dict:
    """What a reply keeps of how it was made: the model, the engine's version and the sampling settings."""
    out = {"model": model, "engine_version": mtpchat_version()}
    out.update({key: settings[key] for key in SETTINGS_KEYS if key in settings})
    return out


def settings_line(settings: dict | None) -> str:
    """'model x · mtpchat 0.1.0 · temperature 0.7 · top-p 0.9 · top-k 20 · seed 0 · depth 2'."""
    if not settings:
        return ""
    parts = [f"model {settings['model']}"] if settings.get("model") else []
    if settings.get("engine_version"):
        parts.append(f"mtpchat {settings['engine_version']}")
    parts += [f"{SETTING_LABELS.get(k, k)} {settings[k]}" for k in SETTINGS_KEYS
              if settings.get(k) is not None and k != "max_new_tokens"]
    return " · ".join(parts)


def acceptance_letters(accepted: list[bool]) -> str:
    """A cycle's per-position acceptance as spreadsheet-proof text: A accepted, R rejected."""
    return "".join("A" if a else "R" for a in accepted)


def _slug(text: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()
    return slug[:40] or "chat"


def transcript_markdown(conv: Conversation) -> str:
    out = [f"# {conv.title or 'Chat'}", ""]
    out.append(f"*mtpchat conversation {conv.id}, {time.strftime('%Y-%m-%d %H:%M', time.localtime(conv.created_at))}, "
               f"exported with mtpchat {mtpchat_version()}*")
    out.append("")
    if conv.system_prompt:
        out += ["## System", "", conv.system_prompt, ""]
    for msg in conv.messages:
        heading = "User" if msg.role == "user" else f"Assistant{f' ({msg.model})' if msg.model else ''}"
        alternatives = conv.alternatives(msg) if msg.role == "assistant" else [msg]
        if len(alternatives) > 1:
            heading += f" — reply {alternatives.index(msg) + 1} of {len(alternatives)}"
        out += [f"## {heading}", ""]
        out += _message_markdown(msg)
        for number, other in enumerate(alternatives, 1):  # the others, collapsed
            if other is not msg:
                out += [f"<details><summary>Alternative reply {number} of {len(alternatives)}</summary>", ""]
                out += _message_markdown(other) + ["</details>", ""]
    return "\n".join(out)


def _message_markdown(msg: Message) -> list[str]:
    out = []
    if msg.reasoning.strip():  # GitHub and most renderers show <details> collapsed
        title = thinking_title(msg.parts.count(REASONING), reasoning_ms(msg.stats))
        out += [f"<details><summary>{title}</summary>", "", shown_reasoning(msg.reasoning), "", "</details>", ""]
    out += [shown_answer(msg.content) if msg.role == "assistant" else msg.content, ""]
    if msg.role == "assistant":
        notes = [n for n in (stats_line(msg.stats), msg.status if msg.status != "complete" else "",
                             f"error: {msg.error}" if msg.error else "") if n]
        if notes:
            out += [f"*{' · '.join(notes)}*", ""]
        if msg.settings:
            out += [f"*{settings_line(msg.settings)}*", ""]
    return out


def transcript_json(conv: Conversation) -> dict:
    messages = []
    for msg in conv.messages:
        item = _message_json(msg)
        alternatives = conv.alternatives(msg) if msg.role == "assistant" else [msg]
        if len(alternatives) > 1:  # a retried reply: the shown one, with the others it was chosen from
            item["alternative"] = {"index": alternatives.index(msg), "of": len(alternatives)}
            item["alternatives"] = [{**_message_json(m), "index": k} for k, m in enumerate(alternatives)
                                    if m is not msg]
        messages.append(item)
    return {
        "format": "mtpchat-transcript",
        # 2: a reply's reasoning and answer apart, each token's part; 3: alternatives, each reply's settings
        "version": 3,
        "exported_by": {"mtpchat": mtpchat_version()},
        "id": conv.id,
        "title": conv.title,
        "system_prompt": conv.system_prompt,
        "created_at": conv.created_at,
        "messages": messages,
    }


def _message_json(msg: Message) -> dict:
    item = {"id": msg.id, "role": msg.role, "content": msg.content, "created_at": msg.created_at}
    if msg.role == "assistant":
        parts = parts_or_answer(msg.parts, len(msg.token_ids))
        item.update(
            status=msg.status, model=msg.model, settings=msg.settings, finish_reason=msg.finish_reason,
            stats=msg.stats, error=msg.error, fallbacks=msg.fallbacks,
            tokens=[
                {"id": tid, "text": piece, "source": source, "part": part}
                for tid, piece, source, part in zip(msg.token_ids, msg.pieces, msg.sources, parts)
            ],
            reasoning=_part_json(msg, REASONING, parts),
            answer=_part_json(msg, ANSWER, parts),
        )
    return item


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
        "why": row.why,
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
        + [f"{p}_ms" for p in phases] + ["why"]
    )
    for row in rows:
        writer.writerow(
            [row.message_id, row.index, row.depth, row.drafted, row.accepted,
             acceptance_letters(row.accepted_per_position), row.committed, f"{row.t_ms:.3f}",
             row.part]
            + [f"{row.phase_ms[p]:.4f}" if p in row.phase_ms else "" for p in phases] + [row.why]
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
        paths.private_dir(directory)
        written = []
        for fmt in formats:
            name, render = contents[fmt]
            path = directory / name
            paths.write_private(path, render())
            written.append(path)
    except OSError as exc:
        raise ExportError(f"cannot write to {directory}: {exc.strerror or exc}") from exc
    return written

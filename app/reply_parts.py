"""A reply's parts: the reasoning (a thinking model's `<think>` block) and the answer, and the tool calls in an
answer. Pure functions over the engine's per-token data, shared by the chat, the exports and `run`.

The engine labels every token "reasoning" or "answer" (``Tokens.parts``; its marker tokens belong to the reasoning
and their text is "", so they are never shown). A reply without labels (an older engine, a model without
reasoning, a reply saved before this existed) is all answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

REASONING, ANSWER = "reasoning", "answer"
# Qwen's markers: what earlier turns' reasoning is wrapped in when the loaded model does not say (they are what the
# Qwen3 / 3.5 / 3.6 templates split an assistant message's content on)
OPEN_MARKER, CLOSE_MARKER = "<think>", "</think>"


def parts_or_answer(parts: list[str] | None, count: int) -> list[str]:
    """Per-token parts, ``count`` of them: the engine's labels, or all answer when it gave none."""
    return list(parts) if parts and len(parts) == count else [ANSWER] * count


def split_pieces(pieces: list[str], parts: list[str]) -> tuple[str, str]:
    """(reasoning text, answer text) of tokens' pieces labelled with ``parts``."""
    reasoning = "".join(p for p, part in zip(pieces, parts) if part == REASONING)
    answer = "".join(p for p, part in zip(pieces, parts) if part != REASONING)
    return reasoning, answer


def select(part: str, parts: list[str], *columns: list) -> list[list]:
    """The entries of each column (pieces, sources, ids) whose token is in ``part``."""
    keep = [i for i, p in enumerate(parts) if (p == REASONING) == (part == REASONING)]
    return [[column[i] for i in keep if i < len(column)] for column in columns]


def shown_reasoning(text: str) -> str:
    """The reasoning as shown: the newlines the template puts around it are layout, not content."""
    return text.strip("\n")


def shown_answer(text: str) -> str:
    """The answer as shown: the blank line after `</think>` is layout."""
    return text.lstrip("\n")


def history_content(reasoning: str, answer: str, open_marker: str | None = None,
                    close_marker: str | None = None) -> str:
    """An assistant message's content as the chat template reads it back: with reasoning, the model's own form,
    ``<think>\\n...\\n</think>\\n\\n`` + answer, which Qwen's templates (and the test checkpoints') split on
    ``</think>`` (they drop earlier turns' reasoning: that is the template's choice, not the app's)."""
    reasoning = shown_reasoning(reasoning)
    if not reasoning.strip():
        return answer if not reasoning else shown_answer(answer)
    return (f"{open_marker or OPEN_MARKER}\n{reasoning}\n{close_marker or CLOSE_MARKER}\n\n"
            f"{shown_answer(answer)}")


def thinking_title(tokens: int, ms: float | None, running: bool = False) -> str:
    """'thinking · 312 tokens · 4.1 s' (the collapsible block's title; 'thinking…' while it runs)."""
    parts = ["thinking…" if running else "thinking", f"{tokens} token{'s' * (tokens != 1)}"]
    if ms is not None:
        parts.append(f"{ms / 1000:.1f} s")
    return " · ".join(parts)


def reasoning_ms(stats: dict | None) -> float | None:
    """The reasoning's time from a finished reply's stats (the engine's per-part numbers), if it says."""
    part = ((stats or {}).get("parts") or {}).get(REASONING) or {}
    ms = part.get("ms")
    return float(ms) if isinstance(ms, (int, float)) and not isinstance(ms, bool) else None


# tool calls --------------------------------------------------------------------------------------------------
# Qwen's XML form (Qwen3-Coder, Qwen3.5): <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>...
# </function>\n</tool_call>; Qwen3's JSON form: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>.
# Nothing is ever executed: a call is shown, formatted and collapsed.
TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|\Z)", re.S)
PARAMETER = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|\Z)", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: list[tuple[str, str]]  # (name, value as written)
    raw: str  # the whole block as the model wrote it
    complete: bool  # the closing tag came


def split_tool_calls(text: str) -> list[str | ToolCall]:
    """The answer's text cut into plain text and tool calls, in order."""
    out: list[str | ToolCall] = []
    at = 0
    for match in TOOL_CALL.finditer(text):
        if match.start() > at:
            out.append(text[at : match.start()])
        out.append(parse_tool_call(match.group(1), match.group(0)))
        at = match.end()
    if at < len(text):
        out.append(text[at:])
    return out


def parse_tool_call(body: str, raw: str) -> ToolCall:
    complete = raw.rstrip().endswith("</tool_call>")
    function = FUNCTION.search(body)
    if function:
        args = [(k.strip(), v) for k, v in PARAMETER.findall(function.group(2))]
        return ToolCall(function.group(1).strip() or "?", args, raw, complete)
    try:  # Qwen3's JSON form
        data = json.loads(body)
        arguments = data.get("arguments") or {}
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        args = [(str(k), v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))
                for k, v in arguments.items()]
        return ToolCall(str(data.get("name") or "?"), args, raw, complete)
    except (ValueError, AttributeError, TypeError):
        return ToolCall("?", [], raw, complete)


def tool_call_title(call: ToolCall) -> str:
    return f"tool call · {call.name}" + ("" if call.complete else " (incomplete)") + " · not run"


def tool_call_text(call: ToolCall) -> str:
    """A call's arguments one per line (multi-line values indented); the raw block when it could not be read."""
    if not call.arguments:
        return call.raw.strip() if call.name == "?" else "(no arguments)"
    lines = []
    for key, value in call.arguments:
        first, *rest = value.split("\n")
        lines.append(f"{key}: {first}")
        lines += [f"    {line}" for line in rest]
    return "\n".join(lines)

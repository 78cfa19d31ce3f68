"""Reasoning models: the chat template's thinking switch, and a reply split into reasoning and answer.

Qwen3.5 / 3.6 / Qwen3-Next-Thinking templates open `<think>` in the generation prompt (`enable_thinking=false`
renders an empty `<think>\\n\\n</think>\\n\\n` instead), and the reply's reasoning ends at `</think>`. The markers
are single tokens of the vocabulary (added tokens, not special ones: decoding would print them), so the split is
made on token ids: exact, and independent of how the text around a marker decodes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

REASONING, ANSWER = "reasoning", "answer"
OPEN, CLOSE = "<think>", "</think>"
# variables every chat template gets from transformers itself: not user settings
STANDARD_VARIABLES = {"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
                      "pad_token", "unk_token", "raise_exception", "strftime_now", "add_vision_id",
                      "continue_final_message", "enable_thinking"}


@dataclass
class ThinkingInfo:
    """What a model's template and vocabulary say about reasoning."""

    switch: bool  # the template reads enable_thinking
    reason: str | None  # why there is no switch (for the chat's disabled toggle)
    default: bool | None  # whether the generation prompt opens a reasoning block when the switch is unset
    variables: list[str] = field(default_factory=list)  # other template variables (e.g. preserve_thinking)
    open_marker: str | None = None
    close_marker: str | None = None
    open_id: int | None = None
    close_id: int | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.endswith("_id")}


def template_source(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # (named templates: the default one)
        template = template.get("default") or next(iter(template.values()), "")
    return template if isinstance(template, str) else ""


def template_variables(source: str) -> list[str]:
    """The variables a template reads that are not transformers' own (jinja2's own analysis of the source)."""
    try:
        import jinja2
        from jinja2 import meta

        names = meta.find_undeclared_variables(jinja2.Environment().parse(source))
    except Exception:  # a template jinja2 cannot parse fails in apply_chat_template, with its own message
        return []
    assigned = set(re.findall(r"\bset\s+(\w+)", source))  # (a loop's own `set` can read as undeclared)
    return sorted(n for n in names if n not in STANDARD_VARIABLES | assigned and not n.startswith("_"))


def single_token(tokenizer, text: str) -> int | None:
    """The id of `text` when the vocabulary has it as one token, else None."""
    ids = tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else []
    return ids[0] if len(ids) == 1 else None


def thinking_info(tokenizer) -> ThinkingInfo:
    source = template_source(tokenizer)
    open_id, close_id = single_token(tokenizer, OPEN), single_token(tokenizer, CLOSE)
    markers = open_id is not None and close_id is not None
    switch = bool(re.search(r"\benable_thinking\b", source))
    reason = None
    if not source:
        reason = "the model has no chat template"
    elif not switch:
        reason = "the chat template has no enable_thinking switch"
    elif not markers:
        reason = f"the vocabulary has no single {OPEN} / {CLOSE} tokens"
    default = None
    if source and markers:
        default = opens_reasoning(_render_probe(tokenizer), open_id, close_id)
    return ThinkingInfo(switch and markers, reason, default, [v for v in template_variables(source)],
                        OPEN if markers else None, CLOSE if markers else None, open_id, close_id)


def _render_probe(tokenizer) -> list[int]:
    """A one-message generation prompt with the switch unset: does the template open a reasoning block?"""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                             tokenize=False)
    except Exception:  # (the chat reports a broken template when it is used)
        return []
    return list(tokenizer.encode(text, add_special_tokens=False))


def opens_reasoning(prompt_ids: list[int], open_id: int | None, close_id: int | None) -> bool:
    """The prompt ends inside a reasoning block: its last marker is an opening one (the generation prompt opened
    it, and the reply starts as reasoning)."""
    if open_id is None:
        return False
    for t in reversed(prompt_ids):
        if t == close_id:
            return False
        if t == open_id:
            return True
    return False


def last_open(prompt_ids: list[int], open_id: int | None) -> int | None:
    """Where the prompt's opening marker sits when it opens the reply's reasoning: the prompt state before it
    is the one the next turn shares (templates drop earlier turns' reasoning), so reuse snapshots it."""
    if open_id is None:
        return None
    for i in range(len(prompt_ids) - 1, -1, -1):
        if prompt_ids[i] == open_id:
            return i
    return None


def reasoning_apart(message: dict) -> dict:
    """An assistant message whose content holds its reasoning inline (`<think>..</think>` + answer) as the
    fields Qwen's templates read: reasoning_content and the answer alone as content. The template then writes
    the markers itself (or drops the reasoning), and the message's text stays text: encode_chat never turns
    characters of a message into marker tokens."""
    content = message.get("content")
    if message.get("role") != "assistant" or not isinstance(content, str) or CLOSE not in content \
            or "reasoning_content" in message:
        return message
    reasoning, answer = content.split(CLOSE, 1)
    return {**message, "content": answer.lstrip("\n"), "reasoning_content": reasoning.split(OPEN)[-1].strip("\n")}


class PartTracker:
    """Labels a reply's tokens reasoning or answer as they are committed, and blanks the markers' text."""

    def __init__(self, info: ThinkingInfo | None, reasoning: bool):
        self.open_id = info.open_id if info is not None else None
        self.close_id = info.close_id if info is not None else None
        self.reasoning = reasoning
        self.tokens = {REASONING: 0, ANSWER: 0}

    @property
    def part(self) -> str:
        return REASONING if self.reasoning else ANSWER

    def label(self, ids: list[int], pieces: list[str]) -> list[str]:
        """Each token's part; marker tokens belong to the reasoning and their pieces become "" (in place)."""
        parts = []
        for i, t in enumerate(ids):
            if t == self.open_id and self.open_id is not None:
                self.reasoning = True
                pieces[i] = ""
            parts.append(self.part)
            self.tokens[self.part] += 1
            if t == self.close_id and self.close_id is not None and self.reasoning:
                self.reasoning = False
                pieces[i] = ""
        return parts


@dataclass
class PartStats:
    """Per part: tokens, drafts judged and accepted, and the wall time of the cycles that ran in it."""

    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    ms: float = 0.0

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0, "ms": self.ms,
                "tokens_per_s": self.tokens / self.ms * 1e3 if self.ms > 0 else 0.0}


class ReplyParts:
    """One reply's parts: the token labels (PartTracker), per-part stats, and the thinking budget, which ends the
    request's decoding where the budget does (Request.max_new) while the reply is in its reasoning, so that a
    speculative cycle never commits past it: every depth forces the close at the same token."""

    def __init__(self, info: ThinkingInfo | None, prompt_ids: list[int], budget: int | None):
        opens = info is not None and opens_reasoning(prompt_ids, info.open_id, info.close_id)
        self.tracker = PartTracker(info, opens)
        self.stats = {REASONING: PartStats(), ANSWER: PartStats()}
        self.budget = budget
        self.max_new: int | None = None  # the request's own cap (set by cap())

    @property
    def opened(self) -> bool:
        return self.tracker.reasoning

    def label(self, ids: list[int], pieces: list[str]) -> list[str]:
        parts = self.tracker.label(ids, pieces)
        for p in parts:
            self.stats[p].tokens += 1
        return parts

    def cycle(self, part: str, drafted: int, accepted: int, ms: float) -> None:
        """A cycle that started in `part` (its drafts are judged there)."""
        s = self.stats[part]
        s.drafted += drafted
        s.accepted += accepted
        s.ms += ms

    def cap(self, req) -> None:
        """req.max_new: the request's own cap, or the end of the thinking budget while in the reasoning."""
        if self.max_new is None:
            self.max_new = req.max_new
        left = self.budget - self.tracker.tokens[REASONING] if self.budget is not None else None
        if left is not None and self.tracker.reasoning:
            req.max_new = min(self.max_new, len(req.generated) + max(left, 0))
        else:
            req.max_new = self.max_new

    def over_budget(self, req) -> bool:
        """The reply is in its reasoning at the budget's end, with room left in the request: force the close."""
        return (self.budget is not None and self.tracker.reasoning and req.finish in (None, "length")
                and len(req.generated) < self.max_new and self.tracker.tokens[REASONING] >= self.budget)

    def resume(self, req) -> None:
        """A cycle stopped at the budget cap after the model closed its reasoning itself: decoding goes on."""
        if req.finish == "length" and len(req.generated) < self.max_new:
            req.finish = None
        self.cap(req)

    def to_json(self) -> dict:
        return {k: v.to_json() for k, v in self.stats.items()}

"""What the decode loop yields. Plain dataclasses: the app turns them into Textual messages."""

from __future__ import annotations

from dataclasses import dataclass, field

DRAFT = "draft"  # an accepted draft token
TARGET = "target"  # produced by the target model: first token, bonus, correction, or plain decoding
FORCED = "forced"  # appended by the engine: the close of a reasoning block whose thinking budget ran out


@dataclass(frozen=True)
class Fallback:
    feature: str  # e.g. "speculation", "fla", "cuda"
    reason: str


@dataclass
class Started:
    prompt_tokens: int
    reused_tokens: int = 0  # prompt tokens whose state was reused from the previous turn
    fallbacks: list[Fallback] = field(default_factory=list)
    reasoning: bool = False  # the reply opens inside a reasoning block (the generation prompt opened it)


@dataclass
class Tokens:
    """Tokens committed by one cycle, in order. `text` is the newly decodable text; pieces[i] is the text token i
    completes ("" inside a multi-byte character), so "".join(pieces) == text."""

    token_ids: list[int]
    sources: list[str]
    text: str
    pieces: list[str] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)  # per token: "reasoning" | "answer" (engine/reasoning.py)


@dataclass
class Cycle:
    index: int
    depth: int
    drafted: int
    accepted: int
    accepted_per_position: list[bool]  # one flag per drafted position
    phase_ms: dict[str, float]  # this cycle's phases
    committed: int  # tokens committed this cycle: accepted + 1, or accepted when an accepted draft was the EOS
    why: str = ""  # --depth auto: why this depth (the expected tokens per second of each)
    stopped: bool = False  # --depth auto on the CPU: the chain stopped short of its depth on a doubtful draft


@dataclass
class Finished:
    reason: str  # "eos" | "length" | "stop"
    stats: dict
    fallbacks: list[Fallback] = field(default_factory=list)

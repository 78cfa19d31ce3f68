"""Text that reaches a terminal: model output, model names and paths (folder names), error messages.

A terminal interprets control characters and escape sequences in what it is sent: an OSC 0 in generated text
renames the window (or a tmux pane), an OSC 52 writes the clipboard, a CSI moves the cursor or rewrites what is
on screen. `terminal_safe` removes all of them: whole ESC sequences (CSI, OSC, DCS, SOS, PM, APC and the short
ones), their 8-bit C1 forms, every other C0 control but newline and tab, DEL and the C1 controls; lone surrogates
(undecodable bytes of a file name, kept by Python's surrogateescape) become U+FFFD, so writing the text to a UTF-8
stream cannot fail. Everything else is kept as it is.

Import-light (the chat imports it on its first frame). JSON output does not need it: json.dumps escapes control
characters itself.
"""

from __future__ import annotations

import re

__all__ = ["TerminalSafeStream", "first_line", "single_line", "terminal_safe"]

# A string terminator: BEL, ESC \ (7-bit ST) or the 8-bit ST.
_ST = r"(?:\x07|\x1b\\|\x9c)"
_SEQUENCE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: ESC [ parameters intermediates final
    r"|\x9b[0-?]*[ -/]*[@-~]"  # 8-bit CSI
    rf"|\x1b[\]PX^_].*?{_ST}"  # OSC, DCS, SOS, PM, APC ... terminator
    rf"|[\x90\x98\x9d\x9e\x9f].*?{_ST}"  # their 8-bit forms
    r"|\x1b[ -/]*[0-~]",  # the rest: ESC intermediates final (charset selection, ESC c, ESC 7, ...)
    re.S,
)
# Anything else a terminal acts on: C0 but \t and \n, DEL, C1 (and a lone ESC or introducer left above).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
# The start of an escape sequence that is not finished yet (at the end of a chunk of streamed text).
_UNFINISHED = re.compile(
    r"(?:\x1b(?:\[[0-?]*[ -/]*|[\]PX^_](?:[^\x07\x9c\x1b]|\x1b(?!\\))*\x1b?|[ -/]*)?"
    r"|\x9b[0-?]*[ -/]*"
    r"|[\x90\x98\x9d\x9e\x9f](?:[^\x07\x9c\x1b]|\x1b(?!\\))*\x1b?)\Z",
    re.S,
)


def terminal_safe(text: str) -> str:
    """`text` without anything a terminal would interpret: escape sequences and control characters are removed
    (newline and tab stay), lone surrogates become U+FFFD."""
    if not isinstance(text, str):
        text = str(text)
    if text.isprintable():  # the common case: nothing to do (newline and tab make it "unprintable")
        return text
    text = _SEQUENCE.sub("", text)
    text = _CONTROL.sub("", text)
    return _SURROGATE.sub("\ufffd", text)


def first_line(text: str) -> str:
    """The first non-empty line of `text`, terminal-safe, tabs as spaces, trimmed ('' when there is none):
    one line of a message, whatever the message holds."""
    for line in terminal_safe(text).splitlines():
        line = line.replace("\t", " ").strip()
        if line:
            return line
    return ""


def single_line(text: str) -> str:
    """`text` terminal-safe and on one line (newlines and tabs become spaces): a table cell, a name, a path."""
    return " ".join(terminal_safe(text).replace("\t", " ").splitlines())


class TerminalSafeStream:
    """`terminal_safe` for text that arrives in pieces (streamed tokens): an escape sequence split over two pieces
    is removed whole. An unfinished sequence is held back, at most `hold` characters, until the next piece or
    `flush()`."""

    def __init__(self, hold: int = 256):
        self.hold, self._pending = hold, ""

    def feed(self, text: str) -> str:
        s = self._pending + text
        self._pending = ""
        m = _UNFINISHED.search(s, max(0, len(s) - self.hold))
        if m is not None and m.start() < len(s):
            s, self._pending = s[: m.start()], s[m.start() :]
        return terminal_safe(s)

    def flush(self) -> str:
        s, self._pending = self._pending, ""
        return terminal_safe(s)

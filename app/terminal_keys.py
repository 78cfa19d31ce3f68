"""alt+digit, alt+- and alt+= in terminals that send ESC followed by the key (xterm, gnome-terminal, konsole,
tmux, ssh).

Textual 8 reads ESC+1..ESC+0, ESC+- and ESC+= with a table made for WezTerm on macOS: it turns them into the
characters Option types there ("¡", "¢", "º", "–", "≠", ...), so in every other terminal alt+4 typed "¢" into the
prompt. ESC++ has no entry and Textual's own ESC+key handling keeps alt only for letters and digits, so ESC+- /
ESC+= / ESC++ would arrive as a plain "-" / "=" / "+". Here those sequences mean the alt key names the app binds,
and they carry no character, so nothing is typed even where no binding takes them. A character typed directly
("¢" on a layout that has it, "º" on a Spanish keyboard) is one byte without ESC and still types itself.
"""

from __future__ import annotations

from typing import NamedTuple


class AltKey(NamedTuple):
    """What Textual's sequence table holds for a key: something with a ``value``, the key's name."""

    value: str


def esc_sequences() -> dict[str, tuple[AltKey]]:
    """ESC + key -> the alt key name, for the keys whose ESC form Textual misreads."""
    names = {str(d): str(d) for d in range(10)} | {"-": "minus", "=": "equals_sign", "+": "plus"}
    return {f"\x1b{char}": (AltKey(f"alt+{name}"),) for char, name in names.items()}


def install() -> None:
    """Put the sequences in Textual's table (read by its input parser when the terminal sends bytes);
    idempotent."""
    from textual._ansi_sequences import ANSI_SEQUENCES_KEYS

    ANSI_SEQUENCES_KEYS.update(esc_sequences())

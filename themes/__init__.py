"""mtpchat themes: one TOML file per theme (Textual ``Theme`` fields, custom colours under ``[variables]``)
and ``highlights.tcss``, the rules that use those variables.

Custom variables (all optional in a theme file; the app falls back to
``variable_defaults(theme)``):
``draft-token`` / ``draft-token-text`` (an accepted-draft token), ``target-token-text`` (a target token),
``user-message`` / ``assistant-message`` (message backgrounds).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from textual.color import Color
from textual.theme import Theme

THEMES_DIR = Path(__file__).parent
CSS_PATH = THEMES_DIR / "highlights.tcss"
DEFAULT_THEME = "mtp-dusk"



def variable_defaults(theme: Theme) -> dict[str, str]:
    """Concrete values of the custom variables for a theme that does not define them (e.g. Textual's
    built-in themes): accepted-draft tokens get the theme's success colour blended into the background."""
    generated = theme.to_color_system().generate()
    background = Color.parse(generated["background"])
    foreground = Color.parse(generated["foreground"])
    return {
        "draft-token": background.blend(Color.parse(generated["success"]), 0.35).hex,
        "draft-token-text": foreground.hex,
        "target-token-text": foreground.hex,
        "user-message": Color.parse(generated["surface"]).hex,
        "assistant-message": background.hex,
    }


_THEME_FIELDS = {
    "name", "primary", "secondary", "warning", "error", "success", "accent", "foreground", "background",
    "surface", "panel", "boost", "dark", "luminosity_spread", "text_alpha", "variables",
}


def load_theme(path: Path) -> Theme:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    unknown = set(data) - _THEME_FIELDS
    if unknown:
        raise ValueError(f"{path.name}: unknown theme fields {sorted(unknown)}")
    return Theme(**data)


def load_themes(directory: Path = THEMES_DIR) -> list[Theme]:
    """The themes shipped in ``directory`` (sorted by file name)."""
    return [load_theme(path) for path in sorted(directory.glob("*.toml"))]

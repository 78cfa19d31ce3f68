"""User settings: a small JSON file in the config folder, written atomically on every change."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from engine import AUTO, MAX_DEPTH  # settings and + / - go up to what the engine accepts (engine/limits.py: no torch)

from . import paths

DEPTH_KEYS = 4  # the keys 0..4 (and the palette) pick a depth directly
DEPTH_ORDER = [AUTO] + list(range(MAX_DEPTH + 1))  # what depth - / + step through


def parse_depth(text: str) -> int | str:
    """A depth typed in the settings: auto or a number (ValueError otherwise)."""
    text = text.strip().lower()
    return AUTO if text == AUTO else int(text)


@dataclass
class Settings:
    theme: str = "mtp-dusk"
    highlight: bool = True  # show accepted-draft tokens highlighted
    markdown: bool = True  # render replies as Markdown (the highlights inside it); off: their plain text
    side_panel: bool = True
    depth: int | str = AUTO  # drafts per cycle, or auto (the engine picks each cycle's)
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False  # keep generating past the end-of-sequence token (benchmarking)
    think: bool | None = None  # a thinking model's enable_thinking: None follows the chat template's default
    think_budget: int | None = None  # at most this many reasoning tokens, then the engine closes the block
    # other variables the chat template reads (engine.thinking.variables, e.g. preserve_thinking): name -> value
    template_vars: dict[str, bool | int | float | str] = field(default_factory=dict)
    system_prompt: str = ""  # default system prompt of new chats
    model: str | None = None  # the model last picked in the model picker
    keymap: dict[str, str] = field(default_factory=dict)  # binding id -> keys, e.g. {"export": "ctrl+e"}
    warnings: list[str] = field(default_factory=list, repr=False, compare=False)

    def problems(self) -> dict[str, str]:
        """Invalid values: field name -> what is wrong (empty when all is well)."""
        checks = {
            "depth": (self.depth == AUTO or (isinstance(self.depth, int) and 0 <= self.depth <= MAX_DEPTH),
                      f"depth must be auto or between 0 and {MAX_DEPTH}"),
            "max_new_tokens": (self.max_new_tokens >= 1, "max tokens must be at least 1"),
            "temperature": (self.temperature >= 0, "temperature must be >= 0"),
            "top_p": (0 < self.top_p <= 1, "top-p must be in (0, 1]"),
            "top_k": (self.top_k >= 0, "top-k must be >= 0"),
            "think_budget": (self.think_budget is None or self.think_budget >= 1,
                             "the thinking budget must be at least 1 token (blank: none)"),
        }
        return {name: message for name, (ok, message) in checks.items() if not ok}

    def to_dict(self) -> dict:
        data = asdict(self)
        data.pop("warnings")
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Settings":
        """Build settings from parsed JSON; bad or unknown values fall back to defaults with a warning."""
        settings = cls()
        for f in fields(cls):
            if f.name == "warnings" or f.name not in data:
                continue
            value = data[f.name]
            default = getattr(settings, f.name)
            try:
                value = _coerce(value, default, f.name)
            except (TypeError, ValueError):
                settings.warnings.append(f"settings: ignored bad value for {f.name!r}: {value!r}")
                continue
            setattr(settings, f.name, value)
        defaults = cls()
        for name, problem in settings.problems().items():
            settings.warnings.append(f"settings: {problem}; using the default")
            setattr(settings, name, getattr(defaults, name))
        return settings


def _coerce(value, default, name: str):
    if name == "depth":
        return AUTO if value == AUTO else _coerce(value, 0, "depth as a number")
    if name in ("seed", "model", "think", "think_budget"):  # the settings that may be unset (None)
        if value is None:
            return None
        if name == "think":
            if not isinstance(value, bool):
                raise TypeError(name)
            return value
        if name in ("seed", "think_budget") and (isinstance(value, bool) or int(value) != value):
            raise ValueError(name)
        return int(value) if name != "model" else str(value)
    if name == "template_vars":
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, (bool, int, float, str))
                                                  for k, v in value.items()):
            raise TypeError(name)
        return dict(value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise TypeError(name)
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or int(value) != value:
            raise ValueError(name)
        return int(value)
    if isinstance(default, float):
        if isinstance(value, bool):
            raise TypeError(name)
        return float(value)
    if isinstance(default, dict):
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise TypeError(name)
        return dict(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise TypeError(name)
        return value
    return value


def load_settings(path: Path | None = None) -> Settings:
    path = path or paths.settings_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Settings()
    except OSError as exc:
        settings = Settings()
        settings.warnings.append(f"settings: cannot read {path}: {exc.strerror}")
        return settings
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        settings = Settings()
        settings.warnings.append(f"settings: {path} is not valid JSON ({exc}); using defaults")
        return settings
    return Settings.from_dict(data)


def save_settings(settings: Settings, path: Path | None = None) -> None:
    """Write atomically (temp file + rename) so a kill never leaves half a file."""
    path = path or paths.settings_path()
    paths.private_dir(path.parent)  # 0700, as the data folder (mkstemp makes the file 0600)
    fd, tmp = tempfile.mkstemp(prefix=".settings-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(settings.to_dict(), fh, indent=2, sort_keys=True)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def parse_template_vars(text: str) -> dict[str, bool | int | float | str]:
    """'preserve_thinking=true, style=short' -> {"preserve_thinking": True, "style": "short"} (the settings
    screen's editor of template variables): true / false are booleans, numbers are numbers, the rest text.
    ValueError for an entry that is not name=value."""
    out: dict[str, bool | int | float | str] = {}
    for entry in filter(None, (e.strip() for e in text.replace("\n", ",").split(","))):
        name, sep, value = entry.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name.isidentifier():
            raise ValueError(f"{entry!r} is not name=value")
        out[name] = template_value(value)
    return out


def template_value(text: str) -> bool | int | float | str:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def format_template_vars(values: dict) -> str:
    """The inverse of parse_template_vars."""
    return ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items())

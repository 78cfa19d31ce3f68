"""The app's keys: the bindings of the chat screen, and the depth keys' actions.

Depth applies to the running reply from its next cycle; the choice is saved in the settings."""

from __future__ import annotations

from textual.binding import Binding

from .settings import AUTO, DEPTH_KEYS, DEPTH_ORDER, MAX_DEPTH
from .worker import SetDepth

# priority: the prompt (a TextArea) has its own uses for some of these keys (f6, f7)
APP_BINDINGS = [
    Binding("f1", "help", "Help", priority=True, id="help"),
    Binding("question_mark", "help", "Help", show=False, id="help-question"),
    Binding("escape", "stop", "Stop", id="stop"),
    Binding("f2", "toggle_highlight", "Highlights", priority=True, id="highlight"),
    Binding("f3", "pane('timing')", "Timing", priority=True, id="timing"),
    Binding("f4", "pane('diagnostics')", "Diagnostics", show=False, priority=True, id="diagnostics"),
    Binding("f5", "models", "Models", priority=True, id="models"),
    Binding("f6", "settings", "Settings", priority=True, id="settings"),
    Binding("f7", "export", "Export", priority=True, id="export"),
    Binding("ctrl+n", "new_chat", "New chat", id="new-chat"),
    Binding("ctrl+o", "conversations", "Open", show=False, id="conversations"),
    Binding("ctrl+r", "retry", "Retry", show=False, id="retry"),
    Binding("alt+c", "copy_last", "Copy reply", show=False, priority=True, id="copy-last"),
    Binding("alt+k", "copy_code", "Copy code block", show=False, priority=True, id="copy-code"),
    Binding("alt+t", "toggle_thinking", "Thinking", show=False, priority=True, id="thinking"),
    *[
        Binding(f"alt+{d}", f"depth({d})", f"Depth {d}", show=False, priority=True, id=f"depth-{d}")
        for d in range(DEPTH_KEYS + 1)
    ],
    Binding("alt+a", "depth('auto')", "Depth auto", show=False, priority=True, id="depth-auto"),
    Binding("alt+minus", "depth_step(-1)", "Depth -", show=False, priority=True, id="depth-down"),
    Binding("alt+equals_sign,alt+plus", "depth_step(1)", "Depth +", show=False, priority=True, id="depth-up"),
    # plain keys work when the prompt is not focused (the prompt types them); they hand the focus back to the
    # prompt, so what is typed next is the message again (not "?" opening the help)
    *[Binding(str(d), f"depth({d}, True)", show=False) for d in range(DEPTH_KEYS + 1)],
    Binding("minus", "depth_step(-1, True)", show=False),
    Binding("plus,equals_sign", "depth_step(1, True)", show=False),
]


class DepthKeys:
    """alt+0..alt+4, alt+a, alt+- / alt+= (and the plain keys when the prompt is not focused)."""

    def action_depth(self, depth: int | str, refocus: bool = False) -> None:
        if refocus and self.screen is self.chat_screen:
            self.ui("#prompt").focus()
        depth = depth if depth == AUTO else max(0, min(MAX_DEPTH, depth))
        self.depth = depth
        self.worker.submit(SetDepth(depth))  # applies to the running reply from its next cycle
        if self.request is not None:
            self.request.stats.depth = depth
        self.settings.depth = depth
        self._save_settings()
        self._show_stats()
        self._update_status()

    def action_depth_step(self, step: int, refocus: bool = False) -> None:
        """Along auto, 0, 1, .. MAX_DEPTH."""
        at = DEPTH_ORDER.index(self.depth) if self.depth in DEPTH_ORDER else 0
        self.action_depth(DEPTH_ORDER[max(0, min(len(DEPTH_ORDER) - 1, at + step))], refocus)

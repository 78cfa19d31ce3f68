"""Copying a reply, a message or a code block (alt+c, alt+k; c / k on a focused message).

Textual copies with OSC 52, which many terminals ignore (and tmux passes on only with set-clipboard on), with no
way to know. So a clipboard tool of the desktop is tried first (wl-copy under Wayland, xclip or xsel under X,
pbcopy on macOS): when one takes the text the notice says so; otherwise the notice says the text was only sent to
the terminal, and what to install if nothing pastes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

# (tool, arguments, what it needs): the first one present that takes the text wins
TOOLS = [
    ("wl-copy", [], "WAYLAND_DISPLAY"),
    ("xclip", ["-selection", "clipboard"], "DISPLAY"),
    ("xsel", ["--clipboard", "--input"], "DISPLAY"),
    ("pbcopy", [], "darwin"),
]
TOOL_TIMEOUT_S = 2.0


def copy_with_tool(text: str) -> str | None:
    """Give ``text`` to the first clipboard tool that can run here (its display is set, or it is macOS); returns
    the tool's name, or None when none took it."""
    for name, args, needs in TOOLS:
        if not (sys.platform == needs if needs == "darwin" else os.environ.get(needs)):
            continue
        path = shutil.which(name)
        if path is None:
            continue
        try:  # no pipes on stdout / stderr: xclip and wl-copy leave a child holding the selection
            subprocess.run([path, *args], input=text.encode(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=TOOL_TIMEOUT_S, check=True)
        except (OSError, subprocess.SubprocessError):
            continue
        return name
    return None


class Clipboard:
    """alt+c / alt+k, and ``copy_text`` for every copy the app makes."""

    def copy_text(self, text: str, what: str) -> None:
        """Copy, and say plainly how: '{what} copied (xclip)' or sent to the terminal only (OSC 52)."""
        tool = copy_with_tool(text)
        self.copy_to_clipboard(text)  # OSC 52 as well: the clipboard of the machine the terminal runs on (ssh)
        if tool:
            self.notify(f"Copied {what} to the clipboard ({tool})", timeout=3)
        else:
            self.notify(f"Sent {what} to the terminal's clipboard (OSC 52). If nothing pastes, the terminal ignores "
                        f"it: install wl-copy or xclip (or in tmux: set -g set-clipboard on).", timeout=8)

    def action_copy_last(self) -> None:
        for message in reversed(self.conversation.messages):
            if message.role == "assistant" and message.content:
                self.copy_text(message.content, f"the last reply ({len(message.content)} characters)")
                return
        self.notify("No reply to copy yet", severity="warning")

    def action_copy_code(self) -> None:
        """Copy the last fenced code block of the conversation (what people usually want from a reply)."""
        for message in reversed(self.conversation.messages):
            blocks = re.findall(r"```[^\n]*\n(.*?)```", message.content or "", flags=re.S)
            if message.role == "assistant" and blocks:
                self.copy_text(blocks[-1], f"a code block ({len(blocks[-1])} characters)")
                return
        self.notify("No code block to copy", severity="warning")

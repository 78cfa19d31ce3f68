"""The command palette's entries (ctrl+p): every action of the app, depth and thinking included."""

from __future__ import annotations

from typing import Iterable

from textual.app import SystemCommand
from textual.screen import Screen

from .settings import AUTO, DEPTH_KEYS


class Palette:
    """ctrl+p: the app's actions, by name."""

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Depth auto", "Speculation depth chosen per cycle (expected tokens per second)",
                            lambda: self.action_depth(AUTO))
        for depth in range(DEPTH_KEYS + 1):
            label = "plain decoding" if depth == 0 else f"{depth} MTP draft token{'s' * (depth > 1)} per cycle"
            yield SystemCommand(f"Depth {depth}", f"Speculation depth {depth}: {label}",
                                lambda d=depth: self.action_depth(d))
        switch, reason = self.thinking_switch()
        yield SystemCommand("Toggle thinking", "Reasoning on / off from the next reply (alt+t)" if switch
                            else f"Unavailable: {reason}", self.action_toggle_thinking)
        yield SystemCommand("Toggle acceptance highlights", "Mark tokens that came from accepted MTP drafts",
                            self.action_toggle_highlight)
        yield SystemCommand("Toggle Markdown", "Render replies as Markdown, or show their plain text",
                            self.action_toggle_markdown)
        yield SystemCommand("Timing pane", "Per-phase times, tokens/s, acceptance",
                            lambda: self.action_pane("timing"))
        yield SystemCommand("Diagnostics pane", "Device, dtype, backends, fallbacks",
                            lambda: self.action_pane("diagnostics"))
        yield SystemCommand("Models", "Pick and load another model", self.action_models)
        yield SystemCommand("Settings", "System prompt, sampling, max tokens", self.action_settings)
        yield SystemCommand("Export", "Transcript (Markdown, JSON) and timing log (CSV, JSONL)",
                            self.action_export)
        yield SystemCommand("New chat", "Start a new conversation", self.action_new_chat)
        yield SystemCommand("Open conversation", "Past conversations: open, search, rename, delete",
                            self.action_conversations)
        yield SystemCommand("Retry", "Generate the last reply again (the previous one is kept as an alternative)",
                            self.action_retry)
        yield SystemCommand("Previous alternative", "Show the previous alternative of the last reply (alt+left)",
                            lambda: self.action_alternative(-1))
        yield SystemCommand("Next alternative", "Show the next alternative of the last reply (alt+right)",
                            lambda: self.action_alternative(1))
        yield SystemCommand("Edit last message", "Edit the last message and send it again in its place (alt+e)",
                            self.action_edit_last)
        yield SystemCommand("Copy last reply", "Copy the last reply to the clipboard", self.action_copy_last)
        yield SystemCommand("Copy last code block", "Copy the last fenced code block", self.action_copy_code)
        yield SystemCommand("Stop", "Stop generating", self.action_stop)
        yield SystemCommand("Help", "Keys and what they do", self.action_help)

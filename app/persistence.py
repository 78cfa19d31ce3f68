"""The glue between the app and its store and settings files: opening a conversation, what the model sees of it,
writes that report their failure once, new chat / open / export."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from textual.containers import VerticalScroll
from textual.widgets import Static

from . import paths
from .export import export_conversation
from .conversations import ConversationsScreen
from .screens import ExportScreen
from .settings import save_settings
from .reply_parts import history_content
from .store import Message
from .transcript import MessageView, PromptInput
from .welcome import EMPTY_HINT
from .worker import Stop


class Persistence:
    """The open conversation and its store (``self.store``), the settings file."""

    async def open_conversation(self, conv_id: int) -> None:
        assert self.store is not None
        if not self.store.claim(conv_id):  # each instance owns the conversations it has open (app/store.py)
            self.notify("That chat is open in another mtpchat window", severity="warning")
            return
        if self.conversation is not None and self.conversation.id != conv_id:
            self.store.release(self.conversation.id)
        if self.request is not None:
            self.request.view = None  # keeps saving, no longer shown
        self.conversation = self.store.load_conversation(conv_id)
        transcript = self.ui("#transcript", VerticalScroll)
        await transcript.remove_children()
        views = [MessageView(m, highlight=self.settings.highlight, markdown=self.settings.markdown)
                 for m in self.conversation.messages]
        await transcript.mount_all(views or [Static(EMPTY_HINT, id="empty-hint")])
        self._show_welcome()
        prompt = self.ui("#prompt", PromptInput)
        with prompt.prevent(PromptInput.Changed):
            prompt.load_text(self.conversation.draft)
        prompt.move_cursor(prompt.document.end)
        self.sub_title = self._subtitle()
        self.context_used, self.context_dropped = conversation_tokens(self.conversation.messages), 0
        self._update_status()
        transcript.anchor()

    def _subtitle(self) -> str:
        title = self.conversation.title if self.conversation else ""
        model = self.model_name or ("loading…" if self.engine_state == "loading" else "no model")
        return f"{model} — {title}" if title else model

    def history(self) -> list[dict]:
        """What the model sees: the system prompt, then the turns (failed or empty replies left out)."""
        conv = self.conversation
        messages = [{"role": "system", "content": conv.system_prompt}] if conv.system_prompt.strip() else []
        markers = (getattr(self.thinking, "open_marker", None), getattr(self.thinking, "close_marker", None))
        for m in conv.messages:
            if m.role == "assistant" and (m.status in ("streaming", "error") or not m.content.strip()):
                continue
            # a reply's reasoning goes back in the model's own form; the template drops it from earlier turns
            content = history_content(m.reasoning, m.content, *markers) if m.role == "assistant" else m.content
            messages.append({"role": m.role, "content": content})
        return messages

    def _saved(self, write, *args, **kwargs) -> bool:
        """Run a store write; a failure (disk full, file removed) is reported once and the app keeps going."""
        try:
            write(*args, **kwargs)
            return True
        except sqlite3.Error as exc:
            if not self._save_error_shown:
                self._save_error_shown = True
                self.notify(f"Could not save the conversation: {exc}", severity="error", timeout=15)
            return False

    def _add_message(self, role: str, content: str = "", **kwargs) -> Message:
        message_id = self.store.add_message(self.conversation.id, role, content, **kwargs)
        message = Message(id=message_id, role=role, content=content, status=kwargs.get("status", "complete"),
                          model=kwargs.get("model"), settings=kwargs.get("settings"))
        self.conversation.add(message)  # (a reply joins its user message's alternatives)
        return message

    def _save_settings(self) -> None:
        try:
            save_settings(self.settings)
        except OSError as exc:
            self.notify(f"Could not save settings: {exc}", severity="error")

    def action_export(self) -> None:
        conv_id = self.conversation.id

        def do_export(directory: Path, formats: list[str]) -> list[Path]:
            return export_conversation(self.store, conv_id, directory, formats)

        def done(written: list[Path] | None) -> None:
            if written:
                names = "\n".join(str(p) for p in written)
                self.notify(f"Exported:\n{names}", timeout=8)

        self.push_screen(ExportScreen(paths.exports_dir(), do_export), done)

    async def action_new_chat(self) -> None:
        if self.request is not None:
            self.worker.submit(Stop())
        if self.conversation is not None and not self.conversation.messages:
            self.notify("This chat is already empty", timeout=2)
            return
        conv_id = self.store.create_conversation(self.settings.system_prompt, self.model_name)
        await self.open_conversation(conv_id)
        self._show_stats()

    def action_conversations(self) -> None:
        async def chosen(conv_id: int | None) -> None:
            if conv_id is None or conv_id == self.conversation.id:
                return
            if self.request is not None:
                self.worker.submit(Stop())
            await self.open_conversation(conv_id)

        self.push_screen(ConversationsScreen(self.store, self.conversation.id), chosen)


def conversation_tokens(messages) -> int | None:
    """The tokens a conversation took when its last reply was made (its prompt and the reply, from the reply's
    stats): 0 for an empty one, None when no finished reply says."""
    if not messages:
        return 0
    for m in reversed(messages):
        if m.role == "assistant" and m.stats:
            prompt, generated = m.stats.get("prompt_tokens"), m.stats.get("generated_tokens")
            if isinstance(prompt, int) and isinstance(generated, int):
                return prompt + generated
    return None

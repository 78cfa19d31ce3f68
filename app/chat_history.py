"""What the chat keeps beyond the transcript: a retried reply's alternatives (ctrl+r keeps the earlier ones,
alt+left / alt+right go through them), editing the last message (alt+e, then enter resends it in place of the
old one), recalling earlier prompts (up / down in an empty input, over every conversation), and the store's
write troubles said in notices (the store retries on its own thread: app/store.py)."""

from __future__ import annotations

from dataclasses import dataclass

from textual.actions import SkipAction
from textual.binding import Binding
from textual.message import Message as TextualMessage

from .export import reply_settings
from .transcript import MessageView, PromptInput

HISTORY_BINDINGS = [
    Binding("alt+left", "alternative(-1)", "Previous reply", show=False, priority=True, id="alternative-previous"),
    Binding("alt+right", "alternative(1)", "Next reply", show=False, priority=True, id="alternative-next"),
    Binding("alt+e", "edit_last", "Edit last message", show=False, priority=True, id="edit-last"),
    # priority, or the prompt (a TextArea) would move its cursor; the action passes the key on when it does
    # not recall (SkipAction): text typed, the cursor not on the first / last line, another widget focused
    Binding("up", "recall(-1)", show=False, priority=True),
    Binding("down", "recall(1)", show=False, priority=True),
]


@dataclass
class StoreWriteStatus(TextualMessage):
    """From the store's writer thread: writes have been failing (error), or work again (None)."""

    error: str | None


class ChatHistory:
    editing: int | None = None  # the id of the user message being edited (alt+e), until enter or esc
    _draft_before_edit = ""
    _recall: list[str] | None = None  # earlier prompts while recalling, newest first
    _recall_at = -1

    # the store's writes ------------------------------------------------------------------------------------
    def watch_store_writes(self) -> None:
        """Notices when the store's writes fail a while (locked, disk full) and when they work again; from the
        writer thread as a message (post_message is thread-safe and never waits for the UI)."""
        self.store.on_write_status = lambda error: self.post_message(StoreWriteStatus(error))

    def on_store_write_status(self, message: StoreWriteStatus) -> None:
        if message.error:
            self.notify(f"Saving the conversation is failing ({message.error}); it is retried, and nothing is "
                        f"lost while mtpchat runs.", severity="warning", timeout=10)
        else:
            self.notify("Saving works again: the conversation is saved", timeout=4)

    def conversation_renamed(self, title: str) -> None:
        """The conversations screen renamed the open conversation."""
        self.conversation.title = title
        self.sub_title = self._subtitle()

    def reply_settings(self, generation: dict) -> dict:
        """What a new reply records of how it is made (exports show it)."""
        return reply_settings(self.model_name, generation)

    # alternatives (retry, alternative and edit_last are chat-screen actions: Dialogs.check_action) ------------
    async def action_retry(self) -> None:
        """Generate the last reply again; the one it replaces stays as an alternative (alt+left shows it)."""
        if self.request is not None:
            self.notify("Still generating — esc stops it", severity="warning")
            return
        if self.engine_state == "failed":
            self.notify("No model is loaded — pick one with f5", severity="error")
            return
        messages = self.conversation.messages
        if not messages:
            return
        if messages[-1].role == "assistant":
            last = messages.pop()
            if last.content.strip() or last.reasoning.strip():
                last.hidden = True
                self._saved(self.store.hide_message, last.id)
            else:  # an empty or failed reply is not worth keeping
                for group in self.conversation.branches.values():
                    if last in group:
                        group.remove(last)
                self._saved(self.store.delete_message, last.id)
            await self._remove_view(last.id)
        if messages and messages[-1].role == "user":
            await self.generate()

    async def _remove_view(self, message_id: int) -> None:
        for view in self.chat_screen.query(MessageView):
            if view.message.id == message_id:
                await view.remove()

    async def action_alternative(self, step: int) -> None:
        """Show the previous (-1) / next (1) alternative of the last reply."""
        if self.request is not None:
            self.notify("Still generating — esc stops it", severity="warning")
            return
        conv = self.conversation
        last = conv.messages[-1] if conv.messages else None
        group = conv.alternatives(last) if last is not None and last.role == "assistant" else []
        if len(group) < 2:
            self.notify("The last reply has no alternatives: ctrl+r generates one", timeout=3)
            return
        at = next(i for i, m in enumerate(group) if m.id == last.id)
        to = max(0, min(len(group) - 1, at + step))
        if to != at:
            chosen = group[to]
            self._saved(self.store.show_alternative, chosen.id, [m.id for m in group])
            last.hidden, chosen.hidden = True, False
            conv.messages[-1] = chosen
            await self._remove_view(last.id)
            await self._mount_message(chosen)
        self.notify(f"Reply {to + 1} of {len(group)}" + (" (the first)" if to == 0 and step < 0 else
                    " (the last)" if to == len(group) - 1 and step > 0 and to == at else ""), timeout=2)

    # editing the last message --------------------------------------------------------------------------------
    def action_edit_last(self) -> None:
        if self.request is not None:
            self.notify("Still generating — esc stops it", severity="warning")
            return
        users = [m for m in self.conversation.messages if m.role == "user"]
        if not users:
            self.notify("No message to edit yet", timeout=3)
            return
        prompt = self.ui("#prompt", PromptInput)
        if self.editing is None:
            self._draft_before_edit = prompt.text
        self.editing = users[-1].id
        prompt.load_text(users[-1].content)
        prompt.move_cursor(prompt.document.end)
        prompt.focus()
        self.notify("Editing your last message: enter sends it in place of the old one and its reply, esc cancels",
                    timeout=6)

    def cancel_edit(self) -> bool:
        """esc while editing: the input gets back what it had; False when nothing was being edited."""
        if self.editing is None:
            return False
        self.editing = None
        prompt = self.ui("#prompt", PromptInput)
        prompt.load_text(self._draft_before_edit)
        prompt.move_cursor(prompt.document.end)
        self.notify("Edit cancelled", timeout=2)
        return True

    async def drop_edited(self) -> None:
        """Before an edited message is sent: the message it replaces goes, with what came after it (its reply
        and that reply's alternatives), from the store and the transcript."""
        if self.editing is None:
            return
        edited, self.editing = self.editing, None
        conv = self.conversation
        at = next((i for i, m in enumerate(conv.messages) if m.id == edited), None)
        if at is None:
            return
        gone = {m.id for m in conv.messages[at:]}
        gone |= {m.id for m in conv.branches.pop(edited, [])}
        del conv.messages[at:]
        self._saved(self.store.delete_messages, sorted(gone))
        for view in list(self.chat_screen.query(MessageView)):
            if view.message.id in gone:
                await view.remove()

    # recalling earlier prompts -------------------------------------------------------------------------------
    def action_recall(self, step: int) -> None:
        """up: the previous prompt (from an empty input, or one recalled and not changed); down: the next one,
        and past the newest the empty input again. Any other time the key moves the cursor as usual."""
        prompt = self.focused
        if not isinstance(prompt, PromptInput):
            raise SkipAction()
        shown = self._recall[self._recall_at] if self._recall is not None and self._recall_at >= 0 else None
        if shown is None or prompt.text != shown:  # not recalling (or the recalled text was changed)
            self._recall = None
            if step > 0 or prompt.text:
                raise SkipAction()
            self._recall, self._recall_at = self.store.recent_prompts(), -1
        row = prompt.cursor_location[0]
        if shown is not None and prompt.text == shown and (
                (step < 0 and row > 0) or (step > 0 and row < prompt.document.line_count - 1)):
            raise SkipAction()  # inside a recalled prompt of several lines: move through it first
        at = self._recall_at - step  # up (-1): older
        if at >= len(self._recall):
            return  # the oldest: stays
        if at < 0:
            self._recall = None
            prompt.clear()
            return
        self._recall_at = at
        prompt.load_text(self._recall[at])
        prompt.move_cursor((0, 0) if step > 0 else prompt.document.end)

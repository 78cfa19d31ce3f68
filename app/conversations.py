"""The conversations screen (ctrl+o): past chats newest first, empty ones left out; a full-text search over
titles and messages, rename, delete. Returns the id of the one to open through ``dismiss``.

It works on the store directly: reads are quick, writes are queued (app/store.py). A chat another mtpchat
instance has open is listed (marked) but neither opened nor deleted here: that instance owns it."""

from __future__ import annotations

import time

from rich.text import Text
from textual import on
from textual.actions import SkipAction
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import DataTable, Footer, Input, Label

from .safe_text import terminal_safe
from .screens import Dialog
from .store import Store, StoreError

CURRENT, ELSEWHERE = "● ", "◆ "  # marks: the open chat; one open in another mtpchat window


def _cell(text: str) -> Text:
    """Titles and message text are the user's and the model's: shown as they are, never read as markup."""
    return Text(terminal_safe(text))


class ConversationsScreen(Dialog):
    """enter opens, / searches, r renames, d deletes (pressed twice), escape closes (or leaves the search or the
    rename first)."""

    BINDINGS = [
        Binding("escape", "cancel", "Close"),
        # priority, or the table's own enter (shown nowhere) would be the one the footer lists
        Binding("enter", "open", "Open", priority=True),
        Binding("slash", "search", "Search"),
        Binding("r", "rename", "Rename"),
        Binding("d", "delete", "Delete"),
    ]

    def __init__(self, store: Store, current: int | None):
        super().__init__()
        self.store = store
        self.current = current
        self._delete_armed: int | None = None  # the chat a first d asked to delete
        self._renaming: int | None = None
        self._open_elsewhere: set[int] = set()

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="conversations-dialog"):
            yield Label("Conversations", classes="dialog-title")
            yield Input(placeholder="search titles and messages (/)", id="conversations-search")
            table = DataTable(id="conversations-table", cursor_type="row", zebra_stripes=True)
            table.add_columns("title", "messages", "updated", "match")
            yield table
            rename = Input(id="conversations-rename", placeholder="new title (enter saves, escape cancels)")
            rename.display = False
            yield rename
            yield Label(f"{CURRENT.strip()} this chat · {ELSEWHERE.strip()} open in another mtpchat window",
                        id="conversations-hint", classes="dialog-hint", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self._fill()
        self.query_one(DataTable).focus()

    # the list ------------------------------------------------------------------------------------------
    def _fill(self) -> None:
        query = self.query_one("#conversations-search", Input).value
        try:
            found = self.store.search(query) if query.strip() else self.store.list_conversations()
        except Exception as exc:  # a broken database must not break the screen: say it
            found = []
            self._say(f"cannot read the conversations: {exc}")
        table = self.query_one(DataTable)
        table.clear()
        for conv in found:
            marker = CURRENT if conv.id == self.current else ELSEWHERE if conv.open_elsewhere else ""
            updated = time.strftime("%Y-%m-%d %H:%M", time.localtime(conv.updated_at))
            table.add_row(_cell(marker + (conv.title or "(untitled)")), str(conv.messages), updated,
                          _cell(conv.snippet), key=str(conv.id))
        if found:
            self._say(f"{CURRENT.strip()} this chat · {ELSEWHERE.strip()} open in another mtpchat window")
        else:
            self._say("nothing matches" if query.strip() else "no conversations yet")
        self._open_elsewhere = {c.id for c in found if c.open_elsewhere}

    def _say(self, text: str) -> None:
        self.query_one("#conversations-hint", Label).update(Text(terminal_safe(text)))

    def _highlighted(self) -> int | None:
        table = self.query_one(DataTable)
        if table.row_count == 0:
            return None
        row_key, _ = table.coordinate_to_cell_key(table.cursor_coordinate)
        return int(row_key.value)

    def _refuse_elsewhere(self, conv_id: int, what: str) -> bool:
        if conv_id in self._open_elsewhere or self.store.open_elsewhere(conv_id):
            self.notify(f"That chat is open in another mtpchat window: {what} it there", severity="warning")
            return True
        return False

    # opening -------------------------------------------------------------------------------------------
    @on(DataTable.RowSelected)
    def _selected(self, event: DataTable.RowSelected) -> None:
        self._open(int(event.row_key.value))

    def action_open(self) -> None:
        if isinstance(self.focused, Input):  # enter in the search or rename field is theirs
            raise SkipAction()
        conv_id = self._highlighted()
        if conv_id is not None:
            self._open(conv_id)

    def _open(self, conv_id: int) -> None:
        if conv_id != self.current and self._refuse_elsewhere(conv_id, "continue"):
            return
        self.dismiss(conv_id)

    # search --------------------------------------------------------------------------------------------
    def action_search(self) -> None:
        self.query_one("#conversations-search", Input).focus()

    @on(Input.Changed, "#conversations-search")
    def _search_changed(self) -> None:
        self._delete_armed = None
        self._fill()

    @on(Input.Submitted, "#conversations-search")
    def _search_done(self) -> None:
        self.query_one(DataTable).focus()

    # rename --------------------------------------------------------------------------------------------
    def action_rename(self) -> None:
        conv_id = self._highlighted()
        if conv_id is None or self._refuse_elsewhere(conv_id, "rename"):
            return
        self._renaming = conv_id
        title = next((c.title for c in self.store.list_conversations() if c.id == conv_id), "")
        field = self.query_one("#conversations-rename", Input)
        field.value = title
        field.display = True
        field.focus()

    @on(Input.Submitted, "#conversations-rename")
    def _rename_done(self, event: Input.Submitted) -> None:
        conv_id, self._renaming = self._renaming, None
        event.input.display = False
        if conv_id is not None and event.value.strip():
            title = self.store.rename_conversation(conv_id, event.value)
            if conv_id == self.current and hasattr(self.app, "conversation_renamed"):
                self.app.conversation_renamed(title)
            self._fill()
            self._say(f"renamed to {title}")
        self.query_one(DataTable).focus()

    def action_cancel(self) -> None:
        """escape: out of the rename or the search first, then closes."""
        field = self.query_one("#conversations-rename", Input)
        if field.display:
            self._renaming = None
            field.display = False
            self.query_one(DataTable).focus()
            return
        search = self.query_one("#conversations-search", Input)
        if search.has_focus:
            if search.value:
                search.value = ""
            self.query_one(DataTable).focus()
            return
        self.dismiss(None)

    # delete --------------------------------------------------------------------------------------------
    def action_delete(self) -> None:
        conv_id = self._highlighted()
        if conv_id is None:
            return
        if conv_id == self.current:
            self.notify("That is the open conversation; open another one first", severity="warning")
            return
        if self._refuse_elsewhere(conv_id, "close"):
            return
        if self._delete_armed != conv_id:  # a second d deletes: one key press must not lose a chat
            self._delete_armed = conv_id
            self._say("press d again to delete this conversation")
            return
        self._delete_armed = None
        try:
            self.store.delete_conversation(conv_id)
        except StoreError as exc:
            self.notify(str(exc), severity="warning")
            return
        self._fill()
        self._say("conversation deleted")
        self.notify("Conversation deleted")

"""The side panel (timing, diagnostics) beside the chat in a wide terminal; in a narrower one a one-line summary
under the transcript, and f3 / f4 show the panel in the chat's place until pressed again."""

from __future__ import annotations

from textual.widgets import TabbedContent

WIDE_COLUMNS = 120  # the panel is 46 columns: below this it would leave the chat too little


class SidePane:
    """``settings.side_panel``: whether the panel sits beside the chat when there is room (f3 / f4 there); the
    narrow layout's full-width panel (``_side_full``) is not saved."""

    _side_full = False

    def _fit_side(self, width: int | None = None) -> None:
        if getattr(self, "chat_screen", None) is None:
            return
        width = self.size.width if width is None else width
        narrow = width < WIDE_COLUMNS
        self._side_full = self._side_full and narrow
        side, chat = self.ui("#side"), self.ui("#chat")
        side.display = self._side_full if narrow else self.settings.side_panel
        side.set_class(self._side_full, "-full")
        chat.display = not self._side_full
        self.ui("#side-summary").display = not side.display
        self._show_stats()

    def side_beside_chat(self) -> bool:
        return self.ui("#side").display and not self._side_full

    def action_pane(self, tab: str) -> None:
        side = self.ui("#side", TabbedContent)
        showing = side.display and side.active == tab
        if not showing:
            side.active = tab
        if self.size.width < WIDE_COLUMNS:
            self._side_full = not showing
            if showing and self.screen is self.chat_screen:
                self.ui("#prompt").focus()  # back to the chat
        else:
            self.settings.side_panel = not showing
            self._save_settings()
        self._fit_side()

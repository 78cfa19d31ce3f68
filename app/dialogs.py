"""The dialogs the chat opens (help, model picker with its downloads, settings) and what their results do."""

from __future__ import annotations

import os

from textual.screen import ModalScreen

from .downloads import DownloadJob
from .screens import HelpScreen, ModelPickerScreen, SettingsScreen
from .settings import Settings
from .worker import DRAFT_ENV, Stop, SwitchModel


class Dialogs:
    """Help (f1), the model picker and its downloads (f5), settings (f6)."""

    MAIN_SCREEN_ACTIONS = {"help", "models", "settings", "export", "new_chat", "conversations", "retry", "pane",
                           "alternative", "edit_last"}

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        # dialogs open from the chat screen only (the keys pass through to an open dialog instead)
        if action in self.MAIN_SCREEN_ACTIONS and isinstance(self.screen, ModalScreen):
            return False
        return True

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_models(self) -> None:
        picker = ModelPickerScreen(self.model_path or self.model_name, device=self.device,
                                   draft=os.environ.get(DRAFT_ENV) or None)

        def chosen(path: str | None) -> None:
            if path is None:
                return
            if self.request is not None:
                self.worker.submit(Stop())
            self._picked_model = path  # remembered in the settings once it has loaded
            # none (""): the model's MTP head, or plain decoding
            self.worker.submit(SwitchModel(path, draft=picker.draft or ""))

        self.push_screen(picker, chosen)

    def start_download(self, ref: str, yes: bool = False) -> DownloadJob | None:
        """A model download (F5 → Download) in a child process: the chat, and a reply in progress, go on."""
        if self.download is not None and self.download.running:
            self.notify(f"Already downloading {self.download.ref}", severity="warning")
            return None
        self.download = DownloadJob(ref, yes=yes, device=self.device)
        try:
            self.download.start(self._download_ended, self.call_from_thread)
        except OSError as e:
            self.download.state, self.download.error = "failed", f"could not start the download: {e.strerror}"
        return self.download

    def _download_ended(self, job: DownloadJob) -> None:
        """Done: switched to, when the picker is open (the user is choosing a model); else offered."""
        if job.state == "done" and job.path:
            if isinstance(self.screen, ModelPickerScreen):
                self.screen.draft = None  # (the draft list is the highlighted model's, not the download's)
                self.screen.dismiss(job.path)  # the picker's own path: SwitchModel
            else:
                self.notify(f"Downloaded {job.ref}: f5 switches to it")
        elif job.state == "failed" and not isinstance(self.screen, ModelPickerScreen):
            self.notify(f"Download of {job.ref} failed: {job.error}", severity="error")

    def action_settings(self) -> None:
        def chosen(new: Settings | None) -> None:
            if new is None:
                return
            depth_changed = new.depth != self.settings.depth
            markdown_changed = new.markdown != self.settings.markdown
            if new.think != self.settings.think:
                self.think = new.think
            self.settings = new
            if depth_changed:
                self.action_depth(new.depth)
            if markdown_changed:
                self.call_later(self.show_markdown)
            self._update_status()
            self._save_settings()
            if new.system_prompt != self.conversation.system_prompt:
                self.conversation.system_prompt = new.system_prompt
                self.store.set_system_prompt(self.conversation.id, new.system_prompt)
            self.notify("Settings saved", timeout=2)

        self.push_screen(SettingsScreen(self.settings, self.conversation.system_prompt, self.thinking), chosen)

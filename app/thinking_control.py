"""Thinking on / off for the loaded model: what its chat template allows and what the next reply asks for."""

from __future__ import annotations


class ThinkingControl:
    """The app's ``thinking`` (the loaded engine's switch, default and variables) against the user's ``think``."""

    def thinking_switch(self) -> tuple[bool, str | None]:
        """Can thinking be switched for the loaded model, and if not, why not."""
        info = self.thinking
        if info is None:
            return False, "no model is loaded yet"
        return bool(info.switch), None if info.switch else (info.reason or "the model has no thinking switch")

    def thinking_on(self) -> bool | None:
        """Whether the next reply thinks: the user's choice, else the template's default (None: not known)."""
        if not self.thinking_switch()[0]:
            return None
        return self.think if self.think is not None else self.thinking.default

    def thinking_settings(self) -> dict:
        """The GenerationSettings of thinking: enable_thinking only where the template has the switch (and the
        user chose), the budget, the template variables the user set that the template reads."""
        out = {}
        if self.thinking_switch()[0] and self.think is not None:
            out["think"] = self.think
        if self.settings.think_budget is not None:
            out["think_budget"] = self.settings.think_budget
        known = set(getattr(self.thinking, "variables", None) or [])
        variables = {k: v for k, v in self.settings.template_vars.items() if k in known}
        if variables:
            out["template_vars"] = variables
        return out

    def action_toggle_thinking(self) -> None:
        """Thinking on / off from the next reply (the template's enable_thinking); a model without the switch
        says why it has none."""
        switch, reason = self.thinking_switch()
        if not switch:
            self.notify(f"Thinking cannot be switched: {reason}", severity="warning", timeout=5)
            return
        self.think = self.settings.think = not self.thinking_on()
        self._save_settings()
        self._update_status()
        self.notify(f"Thinking {'on' if self.think else 'off'} from the next reply", timeout=2)

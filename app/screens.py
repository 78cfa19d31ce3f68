"""Modal screens: help, settings, export, model picker (the conversations screen is app/conversations.py). Each
returns its result through ``dismiss`` (the oterm pattern); none touches the engine."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import (Button, Checkbox, DataTable, Input, Label, ProgressBar, Select, Static, TabbedContent,
                             TabPane, TextArea)

from engine import fit_text, format_bytes, format_tokens

from .downloads import CONFIRM
from .export import FORMATS, ExportError
from .panes import human_count
from .safe_text import first_line, terminal_safe
from .settings import MAX_DEPTH, Settings, format_template_vars, parse_depth, parse_template_vars


class Dialog(ModalScreen):
    BINDINGS = [Binding("escape", "cancel", "Close")]

    def action_cancel(self) -> None:
        self.dismiss(None)


# help ------------------------------------------------------------------------------------------------
KEYS: list[tuple[str, str]] = [
    ("enter", "send the message"),
    ("ctrl+j", "new line in the message (shift+enter too, where the terminal reports it)"),
    ("escape", "stop generating"),
    ("alt+0 … alt+4", "speculation depth 0 (plain decoding) … 4, also mid-reply"),
    ("alt+a", "speculation depth auto: the engine picks each cycle's depth"),
    ("alt+- / alt+=", f"depth down / up along auto, 0, 1, … {MAX_DEPTH} (run --depth's range too; +/- when the "
                      "input is not focused)"),
    ("f2", "toggle acceptance highlights (accepted MTP drafts marked)"),
    ("f3 / f4", "timing pane / diagnostics pane (again: hide)"),
    ("f5", "model picker (switch without restarting); f9 there: its Download tab fetches a model, f8 cancels"),
    ("f6", "settings: system prompt, sampling, max tokens"),
    ("f7", "export transcript (Markdown, JSON) and timing log (CSV, JSONL)"),
    ("ctrl+n", "new chat"),
    ("ctrl+o", "conversations: open, / search, r rename, d delete"),
    ("ctrl+r", "retry: a new reply, the previous ones kept as alternatives"),
    ("alt+← / alt+→", "previous / next alternative of the last reply"),
    ("alt+e", "edit the last message (enter resends it in its place, esc cancels)"),
    ("↑ / ↓", "in an empty input: earlier prompts"),
    ("alt+c / alt+k", "copy the last reply / the last code block"),
    ("alt+t", "thinking on / off from the next reply (models whose template has the switch)"),
    ("c / k", "on a focused message: copy it / copy its next code block (click a code block to copy it)"),
    ("ctrl+p", "command palette: depth, themes, every action above"),
    ("f1 / ?", "this help"),
    ("ctrl+q", "quit"),
]


class HelpScreen(Dialog):
    BINDINGS = [Binding("escape,q,f1,question_mark", "cancel", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="help-dialog"):
            yield Label("mtpchat — keys", classes="dialog-title")
            table = Text()
            width = max(len(k) for k, _ in KEYS)
            for key, what in KEYS:
                table.append(f"{key:>{width}}  ", style="bold")
                table.append(f"{what}\n")
            legend = Text("\nIn highlight mode, ")
            legend.append("marked tokens", style="reverse")
            legend.append(" came from MTP drafts the model accepted; the others from the target model.")
            table.append_text(legend)
            yield VerticalScroll(Static(table, id="help-keys"))
            yield Label("escape closes", classes="dialog-hint")


# settings --------------------------------------------------------------------------------------------
class SettingsScreen(Dialog):
    """Edit the system prompt of the current chat (also the default of new chats), sampling and max tokens, and a
    thinking model's switch, budget and template variables (``thinking``: the loaded engine's ``thinking``)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save", priority=True)]
    THINK_VALUES = {"default": None, "on": True, "off": False}

    def __init__(self, settings: Settings, system_prompt: str, thinking=None):
        super().__init__()
        self.settings = settings
        self.system_prompt = system_prompt
        self.thinking = thinking

    def compose(self) -> ComposeResult:
        s = self.settings
        with Vertical(classes="dialog", id="settings-dialog"):
            yield Label("Settings", classes="dialog-title")
            yield Label("system prompt (this chat, and the default for new chats)")
            yield TextArea(self.system_prompt, id="set-system", soft_wrap=True)
            with Horizontal(classes="fields"):
                yield self._field("max tokens", "set-max", str(s.max_new_tokens), "integer")
                yield self._field(f"depth (auto or 0-{MAX_DEPTH})", "set-depth", str(s.depth), "text")
                yield self._field("seed (blank: random)", "set-seed", "" if s.seed is None else str(s.seed), "integer")
            with Horizontal(classes="fields"):
                yield self._field("temperature (0: greedy)", "set-temperature", str(s.temperature), "number")
                yield self._field("top-p", "set-top-p", str(s.top_p), "number")
                yield self._field("top-k (0: off)", "set-top-k", str(s.top_k), "integer")
            yield Checkbox("ignore end-of-sequence (keep generating to max tokens: for benchmarking)",
                           s.ignore_eos, id="set-ignore-eos")
            yield Checkbox("render replies as Markdown (off: their plain text)", s.markdown, id="set-markdown")
            yield from self._thinking_fields()
            yield Label("", id="settings-error", classes="dialog-error")
            with Horizontal(classes="buttons"):
                yield Button("Save (ctrl+s)", id="save", variant="primary")
                yield Button("Cancel", id="cancel")

    def _thinking_fields(self) -> ComposeResult:
        """Thinking on / off / the template's default (disabled, with the reason, for a model without the
        switch), the thinking budget, and the template's other variables as name=value."""
        s, info = self.settings, self.thinking
        switch = bool(getattr(info, "switch", False))
        default = getattr(info, "default", None)
        shown_default = "template default" + ("" if default is None else f" ({'on' if default else 'off'})")
        current = next(k for k, v in self.THINK_VALUES.items() if v == s.think)
        select = Select([(shown_default, "default"), ("on", "on"), ("off", "off")], value=current,
                        allow_blank=False, id="set-think", disabled=not switch)
        names = ", ".join(getattr(info, "variables", None) or []) or "none"
        with Horizontal(classes="fields"):
            yield Vertical(Label("thinking"), select, classes="field")
            yield self._field("thinking budget (blank: none)", "set-think-budget",
                              "" if s.think_budget is None else str(s.think_budget), "integer")
        yield Label(terminal_safe(f"template variables (name=value, ...; this template reads: {names})"),
                    markup=False)
        yield Input(format_template_vars(s.template_vars), id="set-template-vars")
        if not switch:
            reason = getattr(info, "reason", None) or "no model is loaded yet"
            yield Label(terminal_safe(f"thinking cannot be switched: {reason}"), id="think-reason",
                        classes="dialog-hint", markup=False)

    @staticmethod
    def _field(label: str, id: str, value: str, type: str) -> Vertical:
        return Vertical(Label(label), Input(value, id=id, type=type), classes="field")

    def _value(self, id: str, kind):
        raw = self.query_one(f"#{id}", Input).value.strip()
        if raw == "" and id in ("set-seed", "set-think-budget"):
            return None
        return kind(raw)

    def action_save(self) -> None:
        error = self.query_one("#settings-error", Label)
        try:
            template_vars = parse_template_vars(self.query_one("#set-template-vars", Input).value)
        except ValueError as exc:
            error.update(Text(terminal_safe(f"template variables: {exc}")))  # the user's text: not markup
            return
        try:
            new = replace(
                self.settings,
                max_new_tokens=self._value("set-max", int),
                depth=self._value("set-depth", parse_depth),
                seed=self._value("set-seed", int),
                temperature=self._value("set-temperature", float),
                top_p=self._value("set-top-p", float),
                top_k=self._value("set-top-k", int),
                system_prompt=self.query_one("#set-system", TextArea).text,
                ignore_eos=self.query_one("#set-ignore-eos", Checkbox).value,
                markdown=self.query_one("#set-markdown", Checkbox).value,
                think=self.THINK_VALUES[self.query_one("#set-think", Select).value],
                think_budget=self._value("set-think-budget", int),
                template_vars=template_vars,
                warnings=[],
            )
        except ValueError as exc:
            error.update(f"not a number: {exc}")
            return
        problems = new.problems()
        if problems:
            error.update("; ".join(problems.values()))
            return
        self.dismiss(new)

    @on(Button.Pressed, "#save")
    def _save(self) -> None:
        self.action_save()

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


# export ----------------------------------------------------------------------------------------------
class ExportScreen(Dialog):
    """Choose a folder and formats; errors (an unwritable folder) stay visible in the dialog."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, default_dir: Path, do_export: Callable[[Path, list[str]], list[Path]]):
        super().__init__()
        self.default_dir = default_dir
        self.do_export = do_export

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="export-dialog"):
            yield Label("Export this conversation", classes="dialog-title")
            yield Label("folder")
            yield Input(str(self.default_dir), id="export-dir")
            for fmt, label in FORMATS.items():
                yield Checkbox(f"{label}  .{fmt}", True, id=f"export-{fmt}")
            yield Label("", id="export-error", classes="dialog-error")
            with Horizontal(classes="buttons"):
                yield Button("Export", id="export", variant="primary")
                yield Button("Cancel", id="cancel")

    @on(Input.Submitted, "#export-dir")
    @on(Button.Pressed, "#export")
    def action_export(self) -> None:
        directory = Path(self.query_one("#export-dir", Input).value.strip() or self.default_dir)
        formats = [fmt for fmt in FORMATS if self.query_one(f"#export-{fmt}", Checkbox).value]
        try:
            written = self.do_export(directory, formats)
        except ExportError as exc:
            self.query_one("#export-error", Label).update(Text(terminal_safe(f"export failed: {exc}")))
            self.notify(f"Export failed: {exc}", severity="error", markup=False)
            return
        self.dismiss(written)

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


# model picker ----------------------------------------------------------------------------------------
def _yes(value) -> str:
    return "—" if value is None else ("yes" if value else "no")


def _cell(value) -> Text:
    """A table cell from text found on disk (a folder's name, a config's field): shown as it is, never read as
    markup nor passed to the terminal with its control characters."""
    return Text(terminal_safe(str(value)))


MODEL_COLUMNS = ("name", "family", "params", "MTP", "fits", "context fits", "status")
CATALOGUE_COLUMNS = ("name", "size", "fits here", "MTP", "context", "status")


def fill_table(table: DataTable, labels: tuple[str, ...], rows: list[tuple]) -> None:
    """Replace a table's rows (keyed by their index), each column as wide as its widest cell. Textual measures
    new rows on idle and keeps a header line it rendered before that: left to it, the header fell out of line
    with the rows whenever a frame was drawn between the two (on a loaded machine)."""
    cells = [[_cell(v) for v in row] for row in rows]
    table.clear(columns=True)
    for i, label in enumerate(labels):
        table.add_column(label, width=max([len(label)] + [row[i].cell_len for row in cells]))
    for index, row in enumerate(cells):
        table.add_row(*row, key=str(index))


NO_DRAFT = "none"  # the draft list's first entry: no draft model (the model's MTP head, or plain decoding)


class ModelPickerScreen(Dialog):
    """Discovered models (``engine.discover``) plus a path field; returns the chosen path. The Download tab
    lists the catalogue and runs the app's download (app/downloads.py); a finished one is returned the same way.
    The draft list offers the highlighted model's draft models (discovery's pairs, ``Candidate.drafts``) or none;
    the pick is ``self.draft`` (a path or None) beside the returned path."""

    # f9 / ctrl+page keys switch the tabs: keys no widget here uses and the app does not bind (its f1-f7 are
    # priority bindings; f5 again once raced with them)
    BINDINGS = [Binding("escape", "cancel", "Cancel"),
                Binding("f8", "cancel_download", "Cancel download", priority=True),  # Input keeps ctrl+x: cut
                Binding("f9,ctrl+pagedown,ctrl+pageup", "switch_tab", "Installed / Download", priority=True)]

    def __init__(self, current: str | None = None, discover: Callable[[], list] | None = None,
                 device: str | None = None, draft: str | None = None):
        super().__init__()
        self.current = current
        self.draft_loaded = draft  # the loaded draft model's path: preselected where the highlighted model pairs with it
        self.draft: str | None = None
        self._discover = discover
        self._device = device
        self.candidates: list = []
        self.catalogue: list = []  # catalogue.Fit per row of the Download tab
        self._confirm: str | None = None  # a ref whose finding the user may accept by asking again
        self._bars: dict[str, tuple[ProgressBar, Label]] = {}

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="models-dialog"):
            yield Label("Models", classes="dialog-title")
            yield Label(f"loaded: {terminal_safe(self.current or '—')}", id="models-current", markup=False)
            yield Label("f9 switches Installed / Download · escape closes", classes="dialog-hint", id="models-keys")
            with TabbedContent(id="models-tabs"):
                with TabPane("Installed", id="tab-installed"):
                    table = DataTable(id="models-table", cursor_type="row", zebra_stripes=True)
                    table.add_columns(*MODEL_COLUMNS)
                    yield table
                    yield Label("searching…", id="models-status")
                    with Horizontal(id="models-draft-row"):
                        yield Label("draft model:")
                        yield Select([(NO_DRAFT, NO_DRAFT)], value=NO_DRAFT, allow_blank=False, id="models-draft")
                    yield Label("or a model folder (HF layout):")
                    yield Input(placeholder="/path/to/checkpoint", id="models-path")
                    with Horizontal(classes="buttons"):
                        yield Button("Load", id="load", variant="primary")
                        yield Button("Cancel", id="cancel")
                with TabPane("Download", id="tab-download"):
                    table = DataTable(id="catalogue-table", cursor_type="row", zebra_stripes=True)
                    table.add_columns(*CATALOGUE_COLUMNS)
                    yield table
                    yield Label("or a repository id (ORG/NAME[@REVISION]):")
                    yield Input(placeholder="Qwen/Qwen3.5-9B", id="download-ref")
                    yield Label("enter downloads the highlighted model · f8 cancels", id="download-status",
                                markup=False)
                    yield Vertical(id="download-files")

    def on_mount(self) -> None:
        self.query_one("#models-table", DataTable).focus()
        self.discover_models()
        self.size_catalogue()
        self.set_interval(0.2, self._show_download)
        self._show_download()

    @work(thread=True, exclusive=True)
    def discover_models(self) -> None:
        try:
            discover = self._discover
            if discover is None:
                from engine import discover
            candidates = list(discover())
            error = None
        except Exception as exc:  # discovery problems must not break the picker
            candidates, error = [], f"{type(exc).__name__}: {exc}"
        self.app.call_from_thread(self._show, candidates, error)

    def _show(self, candidates: list, error: str | None) -> None:
        self.candidates = candidates
        rows = []
        for c in candidates:
            supported = getattr(c, "supported", True)
            status = "ok" if supported else f"unsupported: {getattr(c, 'reason', '') or '?'}"
            if supported and getattr(c, "reason", None):
                status = getattr(c, "reason")
            rows.append((getattr(c, "name", "?"), getattr(c, "family", "?") or "?",
                         human_count(getattr(c, "params", None)), str(getattr(c, "mtp_layers", "—")),
                         _yes(getattr(c, "fits_device", None)),
                         fit_text(getattr(c, "context_fits", None), getattr(c, "context_limit", None)), status))
        fill_table(self.query_one("#models-table", DataTable), MODEL_COLUMNS, rows)
        status = self.query_one("#models-status", Label)
        if error:
            status.update(Text(terminal_safe(f"discovery failed: {error}")))
        else:
            status.update(f"{len(candidates)} model(s) found — enter loads the highlighted one")

    @on(DataTable.RowHighlighted, "#models-table")
    def _offer_drafts(self, event: DataTable.RowHighlighted) -> None:
        """The draft list follows the highlighted model: none, then its drafts (smallest first)."""
        candidate = self.candidates[int(event.row_key.value)]
        drafts = [str(d) for d in getattr(candidate, "drafts", None) or []]
        select = self.query_one("#models-draft", Select)
        select.set_options([(NO_DRAFT, NO_DRAFT)] + [(terminal_safe(Path(d).name), d) for d in drafts])
        select.value = self.draft_loaded if self.draft_loaded in drafts else NO_DRAFT
        self.draft = None if select.value == NO_DRAFT else select.value

    @on(Select.Changed, "#models-draft")
    def _draft_chosen(self, event: Select.Changed) -> None:
        self.draft = None if event.value in (NO_DRAFT, Select.BLANK) else str(event.value)

    @on(DataTable.RowSelected, "#models-table")
    def _pick(self, event: DataTable.RowSelected) -> None:
        candidate = self.candidates[int(event.row_key.value)]
        if not getattr(candidate, "supported", True):
            self.notify(f"{candidate.name} is not supported: {getattr(candidate, 'reason', '')}", severity="warning",
                        markup=False)
            return
        self.dismiss(str(candidate.path))

    @on(Input.Submitted, "#models-path")
    @on(Button.Pressed, "#load")
    def _load(self) -> None:
        path = self.query_one("#models-path", Input).value.strip()
        if path:
            self.draft = None  # (the draft list is the highlighted model's, not a typed folder's)
            self.dismiss(path)
            return
        table = self.query_one("#models-table", DataTable)
        if self.candidates and table.cursor_row is not None and table.cursor_row < len(self.candidates):
            candidate = self.candidates[table.cursor_row]
            if getattr(candidate, "supported", True):
                self.dismiss(str(candidate.path))
                return
        self.notify("Pick a model or type a path", severity="warning")

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


    def action_switch_tab(self) -> None:
        # by focus: TabbedContent shows the pane of the focused widget (setting `active` while the focus stays
        # in the other pane switches straight back)
        to_download = self.query_one("#models-tabs", TabbedContent).active != "tab-download"
        self.query_one("#catalogue-table" if to_download else "#models-table", DataTable).focus()

    @on(TabbedContent.TabActivated, "#models-tabs")
    def _tab_activated(self, event: TabbedContent.TabActivated) -> None:
        # into the tab's table: TabbedContent shows the tab of the focused widget, so focus left in the other
        # tab would switch straight back to it
        table = "#catalogue-table" if event.pane.id == "tab-download" else "#models-table"
        self.query_one(table, DataTable).focus()

    # the Download tab ----------------------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="catalogue")
    def size_catalogue(self) -> None:
        """The catalogue sized for this machine's device (a probe: a thread, as discovery is)."""
        try:
            from engine import catalogue, probe_device

            device = probe_device(self._device)
            fits, error = [catalogue.fit(e, device) for e in catalogue.entries()], None
        except Exception as exc:  # a broken device probe must not break the picker
            fits, error = [], f"{type(exc).__name__}: {exc}"
        self.app.call_from_thread(self._show_catalogue, fits, error)

    def _show_catalogue(self, fits: list, error: str | None) -> None:
        self.catalogue = fits
        rows = []
        for f in fits:
            e = f.entry
            refused = e.unsupported()
            status = f"not yet: {e.format} not supported" if refused else ("ok" if f.fits else f.reason)
            rows.append((e.name, f"{e.approx('download_gb')}{e.download_gb:g} GB", _yes(f.fits), _yes(e.mtp),
                         format_tokens(e.context), status))
        fill_table(self.query_one("#catalogue-table", DataTable), CATALOGUE_COLUMNS, rows)
        if error:
            self._say(f"could not size the catalogue: {error}")

    @on(DataTable.RowSelected, "#catalogue-table")
    def _pick_download(self, event: DataTable.RowSelected) -> None:
        entry = self.catalogue[int(event.row_key.value)].entry
        if entry.unsupported():  # refused before any request, as `pull` refuses it
            self._say(f"{entry.name}: {entry.unsupported()}")
            return
        self._start(entry.name)

    @on(Input.Submitted, "#download-ref")
    def _download_ref(self, event: Input.Submitted) -> None:
        if event.value.strip():
            self._start(event.value.strip())

    def _start(self, ref: str) -> None:
        """Check, then download (the child does both); a finding that only needs a yes is accepted by asking
        for the same model again."""
        start = getattr(self.app, "start_download", None)
        if start is None:
            return
        job = start(ref, yes=self._confirm == ref)
        self._confirm = None
        if job is not None:
            self._reset_bars()
            self._show_download()

    def action_cancel_download(self) -> None:
        job = getattr(self.app, "download", None)
        if job is not None and job.running:
            job.cancel()
            self._say(f"cancelling {job.ref}…")

    def _say(self, text: str) -> None:
        self.query_one("#download-status", Label).update(Text(terminal_safe(first_line(text))))

    def _reset_bars(self) -> None:
        self._bars.clear()
        self.query_one("#download-files", Vertical).remove_children()

    def _show_download(self) -> None:
        """The app's download as it is now: a line for its state, a bar per file (bytes and the hub's totals)."""
        job = getattr(self.app, "download", None)
        if job is None:
            return
        if job.state == "checking":
            self._say(f"checking {job.ref} on the hub…")
        elif job.state == "downloading":
            self._say(f"downloading {job.plan} · f8 cancels")
        elif job.state == "done":
            self._say(f"downloaded {job.ref}: {job.path}")
        elif job.state == "cancelled":
            self._say(f"cancelled {job.ref}: nothing was added (run it again to continue)")
        elif job.state == "failed":
            if job.needs_yes:
                self._confirm = job.ref
                self._say(f"{job.error.removesuffix(CONFIRM)}; enter again downloads it anyway")
            else:
                self._say(f"download failed: {job.error}")
        box = self.query_one("#download-files", Vertical)
        for name, progress in list(job.files.items()):
            if name not in self._bars:
                bar, label = ProgressBar(show_eta=False, id=None), Label(markup=False)
                self._bars[name] = (bar, label)
                box.mount(Horizontal(Label(Text(terminal_safe(name)), classes="download-name"), bar, label,
                                     classes="download-file"))
            bar, label = self._bars[name]
            bar.update(total=progress.total or None, progress=progress.done)
            total = format_bytes(progress.total) if progress.total else "?"
            label.update(f"{format_bytes(progress.done)} / {total}")

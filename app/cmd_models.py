"""`mtpchat models [--json] [--device D] [PATH ...]`: the discovered models, their family, size, MTP support and
whether they fit the device; the one `mtpchat` would pick is marked."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .safe_text import single_line

PROG = "mtpchat models"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "models",
        help="list discovered models (family, size, MTP support, fits device)",
        description="List the models mtpchat can see: the Hugging Face cache, $MTPCHAT_MODELS, the given folders "
                    "and the embedded demo model. The one that would be picked is marked with '*'.",
    )
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="more folders to look in: a model folder or a folder of model folders")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.add_argument("--device", default=None, metavar="D",
                   help="size the models for this device: auto (default), cpu, cuda or cuda:N")
    p.add_argument("--available", action="store_true",
                   help="list the download catalogue instead (what `mtpchat pull NAME` fetches), with fits / does "
                        "not fit this device")
    return p


def settings_model() -> str | None:
    """The model pinned in the user's settings (the model picker's last pick), if any."""
    try:
        from .settings import load_settings

        return load_settings().model
    except Exception:  # settings are a convenience here; a broken file must not break listing
        return None


def _error(msg: str) -> None:
    from .cli import print_error

    print_error(msg, PROG)


def run(args: argparse.Namespace) -> int:
    from .cli import one_line_errors

    return one_line_errors(_run, args, PROG)


def _run(args: argparse.Namespace) -> int:
    from engine import DeviceUnavailable, choose, discover, probe_device, visible_gpus

    from .cli import write_out

    paths = list(getattr(args, "paths", None) or [])
    for p in paths:
        if not Path(p).expanduser().exists():
            _error(f"{p}: no such file or folder")
            return 2
    try:
        device = probe_device(getattr(args, "device", None))
    except DeviceUnavailable as e:
        _error(str(e))
        return 2
    if getattr(args, "available", False):
        return _available(args, device)
    candidates = discover(paths, device=device)
    choice = choose(candidates, device, pinned=settings_model(), gpus=visible_gpus(device))
    picked = choice.candidate.path if choice.candidate else None

    if getattr(args, "json", False):
        rows = []
        for c in candidates:
            row = c.to_json()
            row["picked"] = c.path == picked
            rows.append(row)
        write_out(json.dumps(rows, indent=2) + "\n")
        return 0
    pick = ("* " if choice.candidate else "") + f"pick: {single_line(choice.reason)}"
    write_out(f"{render_table(candidates, picked, device)}\n\n{pick}\n")
    return 0


def render_table(candidates, picked: str | None, device) -> str:
    """The table, every name, path and reason made terminal-safe and one line (they come from folder names and
    config files)."""
    from engine import fit_text, format_bytes, format_params

    if not candidates:
        return f"no models found (device {single_line(device.describe())})"
    header = ("", "NAME", "FAMILY", "PARAMS", "DTYPE", "MTP", "MEMORY", "FITS", "CONTEXT FITS", "SOURCE", "STATUS")
    rows = []
    for c in candidates:
        rows.append((
            "*" if c.path == picked else "",
            single_line(c.name),
            single_line(c.family or "?"),
            format_params(c.params),
            single_line(c.dtype or "?"),
            str(c.mtp_layers) if c.mtp_layers else "-",
            format_bytes(c.mem_bytes) if c.mem_bytes is not None else "?",
            "yes" if c.fits_device else "no",
            fit_text(c.context_fits, c.context_limit),  # context that fits in free memory, of the model's
            single_line(c.source),
            "ok" if c.supported else f"unsupported: {single_line(c.reason)}",
        ))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = [f"models for {single_line(device.describe())}", ""]

    def fmt(r):
        return "  ".join(v.ljust(w) for v, w in zip(r[:-1], widths)) + "  " + r[-1]

    lines.append(fmt(header).rstrip())
    for r, c in zip(rows, candidates):
        lines.append(fmt(r).rstrip())
        lines.append(" " * (widths[0] + 2) + single_line(c.path))
        for note in c.notes:
            lines.append(" " * (widths[0] + 2) + f"note: {single_line(note)}")
    return "\n".join(lines)


def _available(args: argparse.Namespace, device) -> int:
    """The catalogue (engine/assets/catalogue.json) sized for `device`, and what `pull SERIES` would pick."""
    from engine import catalogue, format_tokens

    from .cli import write_out

    fits = [catalogue.fit(e, device) for e in catalogue.entries()]
    picks = {s: catalogue.pick([e for e in catalogue.entries() if e.series == s], device)
             for s in catalogue.series_names()}
    if getattr(args, "json", False):
        rows = [{**f.to_json(), "picked": picks[f.entry.series][0] == f.entry} for f in fits]
        write_out(json.dumps(rows, indent=2) + "\n")
        return 0
    header = ("", "NAME", "REPO", "FORMAT", "PARAMS", "DOWNLOAD", "MTP", "CONTEXT", "FITS")
    rows = []
    for f in fits:
        e = f.entry
        status = ("yes" if f.fits else "no") if e.unsupported() is None else f"no: {e.format} not supported yet"
        rows.append(("*" if picks[e.series][0] == e else "", e.name, e.repo, e.format,
                     f"{e.approx('params_b')}{e.params_b:g}B", f"{e.approx('download_gb')}{e.download_gb:g} GB",
                     "yes" if e.mtp else "-", format_tokens(e.context), status))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [f"download catalogue for {single_line(device.describe())} (~: approximate)", ""]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.append("")
    for series, (entry, why) in picks.items():
        lines.append(f"{'* ' if entry else ''}mtpchat pull {series}: {single_line(why)}")
    write_out("\n".join(lines) + "\n")
    return 0

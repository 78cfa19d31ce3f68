"""`mtpchat models [--json] [--device D] [PATH ...]`: the discovered models, their family, size, MTP support and
whether they fit the device; the one `mtpchat` would pick is marked."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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
    return p


def settings_model() -> str | None:
    """The model pinned in the user's settings (the model picker's last pick), if any."""
    try:
        from .settings import load_settings

        return load_settings().model
    except Exception:  # settings are a convenience here; a broken file must not break listing
        return None


def _error(msg: str) -> None:
    print(f"{PROG}: error: {msg}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from .cli import one_line_errors

    return one_line_errors(_run, args, PROG)


def _run(args: argparse.Namespace) -> int:
    from engine.discovery import choose, discover
    from engine.environment import DeviceUnavailable, probe_device, visible_gpus

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
    candidates = discover(paths, device=device)
    choice = choose(candidates, device, pinned=settings_model(), gpus=visible_gpus(device))
    picked = choice.candidate.path if choice.candidate else None

    if getattr(args, "json", False):
        rows = []
        for c in candidates:
            row = c.to_json()
            row["picked"] = c.path == picked
            rows.append(row)
        print(json.dumps(rows, indent=2))
        return 0
    print(render_table(candidates, picked, device))
    print()
    print(("* " if choice.candidate else "") + f"pick: {choice.reason}")
    return 0


def render_table(candidates, picked: str | None, device) -> str:
    from engine.discovery import format_params
    from engine.environment import format_bytes

    if not candidates:
        return f"no models found (device {device.describe()})"
    header = ("", "NAME", "FAMILY", "PARAMS", "DTYPE", "MTP", "MEMORY", "FITS", "SOURCE", "STATUS")
    rows = []
    for c in candidates:
        rows.append((
            "*" if c.path == picked else "",
            c.name,
            c.family or "?",
            format_params(c.params),
            c.dtype or "?",
            str(c.mtp_layers) if c.mtp_layers else "-",
            format_bytes(c.mem_bytes) if c.mem_bytes is not None else "?",
            "yes" if c.fits_device else "no",
            c.source,
            "ok" if c.supported else f"unsupported: {c.reason}",
        ))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = [f"models for {device.describe()}", ""]

    def fmt(r):
        return "  ".join(v.ljust(w) for v, w in zip(r[:-1], widths)) + "  " + r[-1]

    lines.append(fmt(header).rstrip())
    for r, c in zip(rows, candidates):
        lines.append(fmt(r).rstrip())
        lines.append(" " * (widths[0] + 2) + c.path)
        for note in c.notes:
            lines.append(" " * (widths[0] + 2) + f"note: {note}")
    return "\n".join(lines)

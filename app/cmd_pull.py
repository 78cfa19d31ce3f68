"""`mtpchat pull REPO[@REVISION] | NAME [--yes] [--quiet] [--dry-run] [--device D]`: download a model into the
Hugging Face cache, checked first (engine/hub.py says what is checked).

NAME is a catalogue name (`qwen3.5-9b`) or a series (`qwen3.5`, `qwen3.6`, `qwen3-next`): a series picks its
largest variant that fits this machine with room for a useful context, and says why. Progress and findings go
to stderr (the library's own progress bars, off with --quiet); stdout gets the snapshot folder only, so
`mtpchat chat --model "$(mtpchat pull -q qwen3.5)"` works.
"""

from __future__ import annotations

import argparse
import os
import sys

PROG = "mtpchat pull"

# The user's own offline setting, read when app.cli first imports this module: before app.cli makes
# HF_HUB_OFFLINE=1 the default for every other command (read once: `python -m app.cli` runs that code twice).
USER_HF_OFFLINE = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "pull",
        help="download a model into the Hugging Face cache (safetensors only), checked before download",
        description="Download a model into the Hugging Face cache after checking, from the repository's metadata "
                    "and small files, that the engine runs it and this machine holds it. NAME: a catalogue name "
                    "or series (`mtpchat models --available` lists them). HF_TOKEN, HF_ENDPOINT, HF_HOME and "
                    "HF_HUB_OFFLINE apply as for every Hugging Face tool.",
    )
    p.add_argument("model", metavar="REPO[@REVISION]|NAME",
                   help="a repository id such as Qwen/Qwen3.5-9B (optionally @branch, @tag or @commit), or a "
                        "catalogue name or series such as qwen3.5")
    p.add_argument("--yes", "-y", action="store_true",
                   help="download even when the model has no MTP head or is larger than this machine's memory")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars or findings: only errors, and "
                   "the downloaded folder on stdout")
    p.add_argument("--dry-run", action="store_true", help="run the checks and say what would be downloaded; "
                   "download nothing")
    p.add_argument("--device", default=None, metavar="D",
                   help="size the model for this device: auto (default), cpu, cuda or cuda:N")
    # For the chat's download tab (app/downloads.py), which runs the pull as a child process: JSON lines on
    # stdout (the plan, each file's progress, the folder) instead of the library's bars; errors stay on stderr.
    p.add_argument("--progress-json", action="store_true", help=argparse.SUPPRESS)
    return p


def allow_network() -> None:
    """The CLI defaults HF_HUB_OFFLINE to 1 so that nothing else reaches the network; pull puts back the user's own
    setting before huggingface_hub reads it (at its import)."""
    os.environ["HF_HUB_OFFLINE"] = USER_HF_OFFLINE or "0"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:  # imported already (in-process callers): its switch was read from the old value
        constants.HF_HUB_OFFLINE = constants._is_true(os.environ["HF_HUB_OFFLINE"])


def run(args: argparse.Namespace) -> int:
    from .cli import one_line_errors

    allow_network()
    return one_line_errors(_run, args, PROG)


def _run(args: argparse.Namespace) -> int:
    from engine import DeviceUnavailable, catalogue, hub, probe_device

    from .cli import print_error, print_line, write_out

    def say(text: str) -> None:
        if not args.quiet:
            print_line(text, PROG)

    try:
        device = probe_device(args.device)
    except DeviceUnavailable as e:
        print_error(e, PROG)
        return 2
    target = args.model
    found = catalogue.find(target)
    if isinstance(found, list):  # a series: the largest variant that fits here
        entry, why = catalogue.pick(found, device)
        if entry is None:
            print_error(why, PROG)
            return 1
        say(f"{target}: {why}")
        target = entry.repo
    elif found is not None:
        if found.unsupported():
            print_error(f"{found.name}: {found.unsupported()}", PROG)
            return 1
        target = found.repo

    repo, revision = hub.parse_ref(target)
    plan = hub.check(repo, revision, device)
    if plan.concerns and not args.yes:  # a refusal is its one line; the summary is for a pull that goes ahead
        print_error(f"{plan.concerns[0]}; --yes downloads it anyway", PROG)
        return 1
    for note in plan.notes:
        say(f"note: {note}")
    say(plan.summary())
    for concern in plan.concerns:
        say(f"warning: {concern}")
    if args.dry_run:
        say("dry run: nothing downloaded")
        return 0
    before = len(plan.notes)
    if args.progress_json:
        path = _download_reporting(hub, plan)
    else:
        path = hub.download(plan, quiet=args.quiet)
    for note in plan.notes[before:]:
        say(f"note: {note}")
    if args.progress_json:
        _event(path=path)
        return 0
    write_out(f"{path}\n")
    say(f"done: `mtpchat models` lists it; `mtpchat chat --model {path}` opens it")
    return 0


def _event(**fields) -> None:
    import json

    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _download_reporting(hub, plan) -> str:
    """hub.download with each file's progress as JSON lines, at most ~10 a second per file (and always the
    first and last), so the reader is not flooded by the library's chunk-sized updates."""
    import time

    _event(plan=plan.summary(), files=plan.files, snapshot=str(hub.snapshot_dir(plan)))
    last: dict[str, float] = {}

    def progress(name: str, done: int, total: int | None) -> None:
        now = time.monotonic()
        if done in (0, total) or now - last.get(name, 0.0) >= 0.1:
            last[name] = now
            _event(file=name, done=done, total=total)

    return hub.download(plan, quiet=True, progress=progress)

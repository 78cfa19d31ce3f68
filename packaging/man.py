"""Generate the man page packaging/mtpchat.1 from the CLI's own argparse parser: `python packaging/man.py`."""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from app.cli import build_parser


def roff(text: str) -> str:
    return text.replace("\\", "\\\\").replace("-", "\\-")


def options(parser: argparse.ArgumentParser) -> list[str]:
    out = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        flags = ", ".join(action.option_strings) or action.dest
        meta = "" if action.nargs == 0 else f" {action.metavar or action.dest.upper()}"
        out += [".TP", f"\\fB{roff(flags)}\\fR{roff(meta)}", roff(action.help or "")]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="write the man page from the CLI's own parser")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("mtpchat.1"))
    out = ap.parse_args(argv).out
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    lines = [f'.TH MTPCHAT 1 "{datetime.date.today():%Y-%m}" "mtpchat" "User Commands"', ".SH NAME",
             "mtpchat \\- terminal chat with lossless MTP speculative decoding for Qwen3-Next / Qwen3.5 models",
             ".SH SYNOPSIS", "\\fBmtpchat\\fR [\\fICOMMAND\\fR] [\\fIOPTIONS\\fR]", ".SH DESCRIPTION",
             roff("Without a command, mtpchat opens the terminal chat on the best model it finds (the embedded "
                  "demo model when nothing better is installed). Speculation changes speed, never the text."),
             ".SH COMMANDS"]
    helps = {c.dest: c.help for c in sub._choices_actions}
    for name, p in sub.choices.items():
        lines += [".SS " + name, roff(helps.get(name) or ""), *options(p)]
    lines += [".SH FILES", roff("Settings in the user config dir (mtpchat/settings.json); conversations in a SQLite "
                                "file in the user data dir; exports in its exports/ folder. MTPCHAT_HOME overrides "
                                "both roots."),
              ".SH ENVIRONMENT", roff("MTPCHAT_MODELS: extra model folders (path list). MTPCHAT_DISABLE_FLA=1: torch "
                                      "kernels only. MTPCHAT_CUDA_GRAPHS=0: eager steps, no CUDA graphs. "
                                      "MTPCHAT_COMPILE=1: as --compile. HF_HOME / HF_HUB_CACHE: the Hugging Face "
                                      "cache scanned for models.")]
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

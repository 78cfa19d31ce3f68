"""Generate the shell completions packaging/completions/{mtpchat.bash,_mtpchat} from the CLI's own argparse parser
(`python packaging/completions.py`), as packaging/man.py does the man page: every option of every command,
the choices of those that have them, files and folders for the path options, the catalogue's names for pull."""

from __future__ import annotations

import argparse
from pathlib import Path

from app.cli import build_parser
from engine.catalogue import entries, series_names
from engine.presets import PRESETS

OUT = Path(__file__).with_name("completions")
FOLDER_OPTIONS = {"--model", "--mtp-from", "--draft-model"}  # completed with folders
FILE_OPTIONS = {"--out", "--prompt-file"}  # completed with files
# values worth offering for options the parser leaves open (--device also takes cuda:1, --random-weights a preset)
HINTS = {"--device": ["cpu", "cuda"], "--random-weights": list(PRESETS)}


def values(option: str, action: argparse.Action) -> list[str] | None:
    if action.choices:
        return [str(c) for c in action.choices]
    return HINTS.get(option)


def commands(parser: argparse.ArgumentParser) -> tuple[dict[str, argparse.ArgumentParser], dict[str, str]]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help or "" for c in sub._choices_actions}
    return dict(sub.choices), helps


def visible(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options a user types (internal ones, help=SUPPRESS, left out)."""
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS]


def catalogue_names() -> list[str]:
    return series_names() + [e.name for e in entries()]


def long_options(action: argparse.Action) -> list[str]:
    return [o for o in action.option_strings if o.startswith("--")]


def bash(parser: argparse.ArgumentParser) -> str:
    subs, _ = commands(parser)
    names = " ".join(subs)
    offered: dict[str, list[str] | None] = {}  # option -> the values offered after it (None: none, type them)
    for p in subs.values():
        for a in visible(p):
            for o in long_options(a):
                if a.nargs != 0 and offered.get(o) is None:  # (bench's --drafter is open, run's has choices)
                    offered[o] = values(o, a)
    value_cases: dict[str, list[str]] = {}  # the completion after an option -> the options
    for o, offer in offered.items():
        if o in FOLDER_OPTIONS:
            how = 'COMPREPLY=($(compgen -d -- "$cur")); return ;;'
        elif o in FILE_OPTIONS:
            how = 'COMPREPLY=($(compgen -f -- "$cur")); return ;;'
        elif offer:
            how = f'COMPREPLY=($(compgen -W "{" ".join(offer)}" -- "$cur")); return ;;'
        else:
            how = "return ;;"  # a number or a text: nothing to offer
        value_cases.setdefault(how, []).append(o)
    lines = ["# bash completion for mtpchat, generated from its argument parser by packaging/completions.py.",
             "# Install: copy to /usr/share/bash-completion/completions/mtpchat",
             "# (or ~/.local/share/bash-completion/completions/mtpchat), or `source` it from ~/.bashrc.",
             "_mtpchat() {", "    local cur prev sub i", "    COMPREPLY=()", '    cur="${COMP_WORDS[COMP_CWORD]}"',
             '    prev="${COMP_WORDS[COMP_CWORD-1]}"', f'    local commands="{names}"', '    sub=""',
             "    for ((i = 1; i < COMP_CWORD; i++)); do", '        case "${COMP_WORDS[i]}" in',
             f'            {"|".join(subs)}) sub="${{COMP_WORDS[i]}}"; break ;;', "        esac", "    done", "",
             '    case "$prev" in']
    lines += [f"        {'|'.join(opts)}) {how}" for how, opts in value_cases.items()]
    lines += ["    esac", "", "    local opts", '    case "$sub" in',
              f'        "") opts="$commands {" ".join(o for a in visible(parser) for o in long_options(a))}" ;;']
    for name, p in subs.items():
        opts = [o for a in visible(p) for o in long_options(a)]
        extra = ""
        if name == "pull":
            opts += catalogue_names()
        if any(a.dest == "paths" for a in p._actions):
            extra = '; COMPREPLY=($(compgen -d -- "$cur"))'
        lines.append(f'        {name}) opts="{" ".join(opts)}"{extra} ;;')
    lines += ["    esac", '    COMPREPLY+=($(compgen -W "$opts" -- "$cur"))', "}", "complete -F _mtpchat mtpchat", ""]
    return "\n".join(lines)


def zsh_quote(text: str) -> str:
    return text.replace("'", "'\"'\"'").replace("[", "(").replace("]", ")").replace(":", " -")


def zsh_spec(action: argparse.Action) -> list[str]:
    summary = zsh_quote((action.help or "").split(";")[0].split(" (")[0].strip() or action.dest)
    if action.nargs == 0:
        value = ""
    elif long_options(action)[0] in FOLDER_OPTIONS:
        value = ":path:_files -/"
    elif long_options(action)[0] in FILE_OPTIONS:
        value = ":file:_files"
    elif values(long_options(action)[0], action):
        value = f":value:({' '.join(values(long_options(action)[0], action))})"
    else:
        value = ":value:"
    return [f"'{o}[{summary}]{value}'" for o in long_options(action)]


def zsh(parser: argparse.ArgumentParser) -> str:
    subs, helps = commands(parser)
    lines = ["#compdef mtpchat",
             "# zsh completion for mtpchat, generated from its argument parser by packaging/completions.py.",
             "# Install: put this file (named _mtpchat) in a folder on $fpath, e.g. ~/.zfunc (with",
             "# `fpath=(~/.zfunc $fpath)` before `compinit` in ~/.zshrc).", "", "_mtpchat() {",
             "    local -a commands", "    commands=("]
    lines += [f"        '{name}:{zsh_quote(helps.get(name, ''))}'" for name in subs]
    top = " ".join(s for a in visible(parser) for s in zsh_spec(a))
    lines += ["    )", "", f"    _arguments -C {top} '1:command:->command' '*::arg:->args' && return",
              "    case $state in", "        command) _describe -t commands 'mtpchat command' commands ;;",
              "        args)", "            case $words[1] in"]
    for name, p in subs.items():
        specs = [s for a in visible(p) for s in zsh_spec(a)]
        if name == "pull":
            specs.append(f"'1:model:({' '.join(catalogue_names())})'")
        if any(a.dest == "paths" for a in p._actions):
            specs.append("'*:folder:_files -/'")
        body = " \\\n                        ".join(specs)
        lines += [f"                {name})", f"                    _arguments {body} ;;"]
    lines += ["            esac ;;", "    esac", "}", "", '_mtpchat "$@"', ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="write the shell completions from the CLI's own parser")
    ap.add_argument("--out", type=Path, default=OUT, help="folder to write mtpchat.bash and _mtpchat into")
    out = ap.parse_args(argv).out
    parser = build_parser()
    out.mkdir(parents=True, exist_ok=True)
    (out / "mtpchat.bash").write_text(bash(parser))
    (out / "_mtpchat").write_text(zsh(parser))


if __name__ == "__main__":
    main()

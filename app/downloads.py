"""A model download for the chat's model picker (F5 → Download): `mtpchat pull` run as a child process.

Why a process and not a thread: huggingface_hub has no way to stop a download once started (its retries and
Xet's own threads included), and a pull must turn the network on (HF_HUB_OFFLINE off) while the chat keeps it
off for everything else. A child process gets its own setting, and cancelling is ending it; the UI and a reply
in progress never wait on it. It reports on stdout as JSON lines (`pull --progress-json`: the plan, each
file's bytes, the folder); a failure is its one stderr line, as `mtpchat pull` prints it.

The job is the app's, not the picker's: closing the picker leaves it running and reopening shows it again.
Its state is read by the picker on a timer; `on_end` is called on the UI thread once it is over.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
ERROR_PREFIX = "mtpchat pull: error: "
CONFIRM = "; --yes downloads it anyway"  # how pull says a finding needs the user's yes


@dataclass
class FileProgress:
    done: int = 0
    total: int | None = None


@dataclass
class DownloadJob:
    ref: str  # what was asked: a catalogue name or ORG/NAME[@REVISION]
    yes: bool = False
    device: str | None = None
    state: str = "checking"  # checking | downloading | done | failed | cancelled
    plan: str = ""  # the checked plan's summary line
    files: dict[str, FileProgress] = field(default_factory=dict)
    path: str | None = None  # the snapshot folder, once done
    error: str | None = None  # the one line, once failed
    needs_yes: bool = False  # failed only for a finding the user may accept
    _snapshot: str | None = None
    _proc: subprocess.Popen | None = None
    _cancelled: bool = False

    @property
    def running(self) -> bool:
        return self.state in ("checking", "downloading")

    def start(self, on_end: Callable[["DownloadJob"], None], call_from_thread: Callable) -> None:
        args = [sys.executable, "-m", "app.cli", "pull", self.ref, "--progress-json", "--quiet"]
        if self.yes:
            args.append("--yes")
        if self.device:
            args += ["--device", self.device]
        self._proc = subprocess.Popen(args, cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._follow, args=(on_end, call_from_thread), daemon=True,
                         name="mtpchat-download").start()

    def cancel(self) -> None:
        """End the child (it holds no lock the cache needs: the library writes each file to .incomplete and
        renames it when whole); the follower then removes a half-linked snapshot."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        self._cancelled = True
        proc.terminate()

    def _follow(self, on_end, call_from_thread) -> None:
        proc = self._proc
        assert proc is not None and proc.stdout is not None and proc.stderr is not None
        errors: list[str] = []
        drain = threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)
        drain.start()  # stderr read beside stdout, so neither pipe fills and blocks the child
        for line in proc.stdout:
            self._event(line)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        drain.join(timeout=2)
        self._finish(proc.returncode, errors)
        try:
            call_from_thread(on_end, self)
        except RuntimeError:  # the app has quit meanwhile (it cancelled this download): nobody to tell
            pass

    def _event(self, line: str) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return  # not ours (a library's stray print): ignored
        if "plan" in event:
            self.state, self.plan, self._snapshot = "downloading", event["plan"], event.get("snapshot")
            self.files = {name: FileProgress(0, size) for name, size in (event.get("files") or {}).items()}
        elif "file" in event:
            self.files[event["file"]] = FileProgress(int(event.get("done") or 0), event.get("total"))
        elif "path" in event:
            self.path = event["path"]

    def _finish(self, returncode: int, errors: list[str]) -> None:
        if self._cancelled:
            self.state = "cancelled"
            if self._snapshot:
                from engine import hub

                hub.discard_partial(self._snapshot, list(self.files))
        elif returncode == 0 and self.path:
            self.state = "done"
        else:
            self.state = "failed"
            self.error = last_error(errors) or f"the download ended with exit status {returncode}"
            self.needs_yes = self.error.endswith(CONFIRM)


def last_error(lines: list[str]) -> str | None:
    """pull's one error line, without its prefix."""
    said = [line.strip() for line in lines if line.strip()]
    if not said:
        return None
    return said[-1].removeprefix(ERROR_PREFIX)


def child_env() -> dict[str, str]:
    """The chat's environment for the child, with the user's own offline setting back (the chat turns
    HF_HUB_OFFLINE on for itself; the pull child must see what the user set, if anything)."""
    from .cmd_pull import USER_HF_OFFLINE

    env = dict(os.environ)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(var, None)
    if USER_HF_OFFLINE:
        env["HF_HUB_OFFLINE"] = USER_HF_OFFLINE
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env

"""The real app in a real terminal, on the embedded demo model: the bytes terminals send for alt+key (through
tmux, as xterm, gnome-terminal, konsole and ssh send them: ESC then the key) and what the app writes to the
terminal when a signal ends it (through a pty)."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from fcntl import ioctl
from pathlib import Path

import pytest

from engine import EMBEDDED_DIR

ROOT = Path(__file__).resolve().parent.parent
CHAT = [sys.executable, "-m", "app.cli", "chat", "--model", str(EMBEDDED_DIR)]
TMUX = shutil.which("tmux")
# what Textual 8 made of ESC+digit before (a macOS table): none of these may reach the prompt
MISREAD = "¡™£¢∞§¶•ªº–≠"


def app_env(home: Path) -> dict:
    """The app's environment: its own home, offline, and no COLUMNS / LINES (pytest sets them to 80x24, and
    Textual would take them over the terminal's real size)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return {**env, "MTPCHAT_HOME": str(home), "HF_HUB_OFFLINE": "1", "TERM": "xterm-256color",
            "PYTHONPATH": str(ROOT)}


class Tmux:
    """One tmux server (its own socket) running the chat in a window of the given size."""

    def __init__(self, tmp_path: Path, width: int = 120, height: int = 32):
        self.socket = f"mtpchat-test-{os.getpid()}-{tmp_path.name}"
        self.home = tmp_path / "home"
        self.marker = tmp_path / "exit-status"
        self.env = app_env(self.home)  # the server's, so the window's shell's and the app's
        command = " ".join(f"'{c}'" for c in CHAT) + f"; echo $? > '{self.marker}'; sleep 60"
        self.tmux("new-session", "-d", "-s", "chat", "-x", str(width), "-y", str(height), "-c", str(ROOT), command)

    def tmux(self, *args: str) -> str:
        return subprocess.run([TMUX, "-L", self.socket, *args], check=True, capture_output=True, text=True,
                              timeout=10, env=self.env).stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "chat")

    def send_bytes(self, *hex_bytes: str) -> None:
        self.tmux("send-keys", "-t", "chat", "-H", *hex_bytes)

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-t", "chat", "-l", text)

    def wait_for(self, predicate, what: str, timeout: float = 15.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if predicate(screen):
                return screen
            if time.monotonic() > deadline:
                size = self.tmux("display", "-p", "-t", "chat", "#{pane_width}x#{pane_height}").strip()
                raise AssertionError(f"timed out waiting for {what}; the screen ({size}):\n{screen}")
            time.sleep(0.1)

    def exit_status(self, timeout: float = 10.0) -> str:
        """The chat's exit status once it has ended; what the window shows then (stderr) if it is not 0."""
        deadline = time.monotonic() + timeout
        while not self.marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        status = self.marker.read_text().strip() if self.marker.exists() else "(still running)"
        return status if status == "0" else f"{status}\n{self.screen()}"

    def close(self) -> None:
        subprocess.run([TMUX, "-L", self.socket, "kill-server"], capture_output=True, timeout=10, env=self.env)


@pytest.fixture
def tmux(tmp_path):
    if TMUX is None:
        pytest.skip("tmux is not installed")
    session = Tmux(tmp_path)
    yield session
    session.close()


def status_line(screen: str) -> str:
    """The chat's status line ('demo · depth 3 · ready · ...'), not the timing pane's 'speculation depth'."""
    return next((line for line in screen.splitlines() if "· depth " in line), "")


def prompt_line(screen: str) -> str:
    """The prompt's text row: the one under the prompt's top border."""
    lines = screen.splitlines()
    top = next(i for i, line in enumerate(lines) if line.lstrip().startswith("▊▔"))
    return lines[top + 1]


def test_alt_keys_sent_as_escape_bytes_set_the_depth_and_type_nothing(tmux):
    tmux.wait_for(lambda s: "depth auto" in status_line(s), "the first frame")
    tmux.type("hi")
    tmux.wait_for(lambda s: " hi " in prompt_line(s), "the typed text")
    # (the byte after ESC, what the status line then says): alt+3, alt+-, alt+=, alt++, alt+0, alt+4, alt+a
    for key, depth in [("33", "3"), ("2d", "2"), ("3d", "3"), ("2b", "4"), ("30", "0"), ("34", "4"), ("61", "auto")]:
        tmux.send_bytes("1b", key)
        screen = tmux.wait_for(lambda s: f"depth {depth} " in status_line(s) + " ", f"depth {depth} after ESC {key}")
        assert prompt_line(screen).split()[1] == "hi", prompt_line(screen)  # nothing typed
        assert not set(MISREAD) & set(screen), screen
    tmux.send_bytes("1b", "74")  # alt+t: the demo model has no thinking switch, and says so; types nothing
    screen = tmux.wait_for(lambda s: "Thinking cannot be switched" in s, "the thinking notice")
    assert prompt_line(screen).split()[1] == "hi"
    assert json.loads((tmux.home / "config" / "settings.json").read_text())["depth"] == "auto"

    # Tab leaves the prompt, where a plain digit sets the depth: the focus comes back, so "?" is typed, not help
    footer = tmux.screen().splitlines()[-1]
    tmux.send_bytes("09")
    # the footer lists the focused widget's keys first: it changes when the focus has moved
    tmux.wait_for(lambda s: s.splitlines()[-1] != footer, "the focus to leave the prompt")
    tmux.type("2")
    tmux.wait_for(lambda s: "depth 2 " in status_line(s), "depth 2 from the plain key")
    tmux.type("?")
    screen = tmux.wait_for(lambda s: " hi? " in prompt_line(s), "'?' in the prompt")
    assert "mtpchat — keys" not in screen

    tmux.send_bytes("11")  # ctrl+q
    assert tmux.exit_status() == "0"


def test_quit_while_the_model_loads_exits_cleanly(tmux):
    # the engine thread is still importing torch and loading when ctrl+q comes: the process must not finalize
    # under it (that aborted in torch's teardown, exit status 134, on a loaded machine)
    tmux.wait_for(lambda s: "loading model" in status_line(s), "the loading frame")
    tmux.send_bytes("11")
    assert tmux.exit_status() == "0"


def run_in_pty(home: Path, columns: int = 100, rows: int = 30):
    """The chat on a pty of that size; returns the process and the pty's master side."""
    master, slave = pty.openpty()
    ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    process = subprocess.Popen(CHAT, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, env=app_env(home),
                               start_new_session=True)
    os.close(slave)
    return process, master


def read_until(master: int, done, timeout: float) -> bytes:
    """Read the pty until done(output) or EOF (the process closed it) or the timeout."""
    output = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not done(output):
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the other side is closed
                break
            if not chunk:
                break
            output += chunk
    return output


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_restores_the_terminal_and_exits(tmp_path, signum):
    process, master = run_in_pty(tmp_path / "home")
    try:
        started = read_until(master, lambda out: b"Message  (enter sends" in out, 20)  # the prompt's placeholder
        assert b"\x1b[?1049h" in started and b"Message  (enter sends" in started  # the alternate screen, a frame
        process.send_signal(signum)
        after = read_until(master, lambda out: False, 10)
        assert process.wait(10) == 128 + signum
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)
    for restore in (b"\x1b[?1049l", b"\x1b[?1000l", b"\x1b[?1003l", b"\x1b[?1006l", b"\x1b[?25h", b"\x1b[?2004l"):
        assert restore in after, (restore, after[-400:])  # alternate screen, mouse, cursor, bracketed paste
    assert b"Traceback" not in started + after


def test_quitting_a_loaded_chat_leaves_nothing_under_the_prompt(tmp_path):
    """ctrl+q once the model is loaded (its heap frozen, settle_heap): the terminal is restored and nothing is
    written after it. Triton's nanobind module printed "nanobind: leaked 514 functions!" and ~40 more lines there
    when the interpreter's teardown ran with the loaded engine's objects frozen (launch.run_tui now ends the
    process without it)."""
    process, master = run_in_pty(tmp_path / "home")
    try:
        read_until(master, lambda out: b"ready" in out, 60)
        time.sleep(0.5)
        os.write(master, b"\x11")  # ctrl+q
        after = read_until(master, lambda out: False, 20)
        assert process.wait(20) == 0
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)
    assert b"\x1b[?1049l" in after, after[-400:]
    tail = after.rsplit(b"\x1b[?1049l", 1)[1]
    text = re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][0-9A-Za-z]|\x1b[=>]", b"", tail)
    assert text.strip() == b"", tail[-400:]


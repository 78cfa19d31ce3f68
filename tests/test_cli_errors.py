"""A user mistake at the command line is exactly one line on stderr (`mtpchat: error: ...`) and a non-zero exit
status: never a traceback, never a hang. Most checks run the real command line (`python -m app.cli`) in a
subprocess; output that reaches a terminal is terminal-safe; tensor-parallel workers die with their parent."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "engine" / "assets" / "demo")
CONTROL = [chr(c) for c in range(32) if chr(c) not in "\n\t"] + ["\x7f"] + [chr(c) for c in range(0x80, 0xa0)]


@pytest.fixture
def env(tmp_path):
    """The subprocess environment: an empty HF cache and MTPCHAT_HOME (nothing of the machine's is listed)."""
    e = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_CACHE=str(tmp_path / "hub"), MTPCHAT_HOME=str(tmp_path / "h"),
             MTPCHAT_DISABLE_FLA="1")
    e.pop("MTPCHAT_MODELS", None)
    e.pop("MTPCHAT_DEBUG", None)
    return e


def cli(env, *args, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """`python -m app.cli ARGS` (bytes in ARGS reach argv as they are); stdout and stderr as bytes."""
    kw.setdefault("stdout", subprocess.PIPE)
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=ROOT, env=env, stderr=subprocess.PIPE,
                          timeout=timeout, **kw)


def one_line(p, starts: str = "mtpchat: error: ") -> str:
    """The failure's single stderr line (asserting: exit status != 0, one non-empty line, no traceback)."""
    err = p.stderr.decode(errors="replace")
    lines = [line for line in err.splitlines() if line.strip()]
    assert p.returncode != 0, err
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(starts), lines
    assert not any(c in lines[0] for c in CONTROL), repr(lines[0])
    return lines[0]


# --- 1, 2, 11: flag values are checked by the parser, before anything slow ----------------------------------------


@pytest.mark.parametrize("args, says", [
    (["run", "--prompt", "hi", "--seed", "99999999999999999999999"], "argument --seed: must be between -2**63"),
    (["run", "--prompt", "hi", "--max-new-tokens", "10000000000000"],
     "argument --max-new-tokens: must be between 1 and 1000000"),
    (["run", "--prompt", "hi", "--max-new-tokens", "0"], "argument --max-new-tokens: must be between 1"),
    (["run", "--prompt", "hi", "--depth", "17"], "argument --depth: must be between 0 and 16, got 17"),
    (["chat", "--depth", "17"], "argument --depth: must be between 0 and 16, got 17"),
    (["chat", "--depth", "-1"], "argument --depth: must be between 0 and 16, got -1"),
    (["bench", "--depths", "0,2,40"], "argument --depths: must be between 0 and 16, got 40"),
    (["bench", "--max-new-tokens", "1"], "argument --max-new-tokens: must be between 2"),
    (["bench", "--repeat", "0"], "argument --repeat: must be between 1"),
    (["run", "--prompt", "hi", "--temperature", "nan"], "argument --temperature: must be a finite number"),
    (["run", "--prompt", "hi", "--temperature", "-1"], "argument --temperature: must be >= 0"),
    (["run", "--prompt", "hi", "--top-p", "inf"], "argument --top-p: must be a finite number"),
    (["run", "--prompt", "hi", "--top-p", "0"], "argument --top-p: must be in (0, 1]"),
    (["bench", "--temperature", "inf"], "argument --temperature: must be a finite number"),
    (["run", "--prompt", "hi", "--tp", "0"], "argument --tp: must be at least 1"),
    (["run", "--prompt", "hi", "--max-context", "0"], "argument --max-context: must be at least 128, got 0"),
    (["run", "--prompt", "hi", "--max-context", "64k"], "argument --max-context: expected a whole number, got '64k'"),
    (["chat", "--max-context", "-1"], "argument --max-context: must be at least 128, got -1"),
    (["bench", "--max-context", "100"], "argument --max-context: must be at least 128, got 100"),
    (["run"], "one of the arguments --prompt --prompt-file is required"),
    (["run", "--prompt", "hi", "--kv-cache-dtype", "int2"], "argument --kv-cache-dtype: invalid choice: 'int2'"),
])
def test_bad_flag_values_are_one_line(env, args, says):
    t0 = time.monotonic()
    p = cli(env, *args, timeout=120)
    assert p.returncode == 2
    assert one_line(p).startswith(f"mtpchat: error: {says}")
    assert p.stdout == b""
    assert time.monotonic() - t0 < 60  # refused by the parser: no model was loaded


def test_max_new_tokens_beyond_the_models_context(env):
    p = cli(env, "run", "--model", DEMO, "--prompt", "hi", "--max-new-tokens", "5000", "--device", "cpu")
    line = one_line(p)
    assert "--max-new-tokens 5000" in line and "context of 4,096 tokens" in line, line
    assert p.returncode == 2 and p.stdout == b""


def test_a_prompt_past_the_context_is_refused(env, tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("hello world " * 200)
    p = cli(env, "run", "--model", DEMO, "--prompt-file", str(long), "--max-context", "256", "--device", "cpu")
    line = one_line(p)
    assert p.returncode == 2 and p.stdout == b""
    assert line.startswith("mtpchat: error: the prompt is ") and \
        line.endswith(" tokens; the context is 256 (--max-context 256; the model's is 4,096)"), line
    # --max-context bounds --max-new-tokens too (a reply is clipped only in the chat; `run` says so)
    p = cli(env, "run", "--model", DEMO, "--prompt", "hi", "--max-context", "256", "--max-new-tokens", "300",
            "--device", "cpu")
    assert "exceeds the context of 256 tokens (--max-context 256" in one_line(p)


# --- 3: text that is not UTF-8 --------------------------------------------------------------------------------


def test_prompt_file_that_is_not_utf8(env, tmp_path):
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"\xff\xfe")
    for extra in ([], ["--raw"]):
        p = cli(env, "run", *extra, "--prompt-file", str(bad), timeout=200)
        assert one_line(p) == f"mtpchat: error: --prompt-file {bad}: not valid UTF-8 text (byte 0xff at offset 0)"


def test_prompt_file_missing_or_a_folder(env, tmp_path):
    assert one_line(cli(env, "run", "--prompt-file", str(tmp_path / "nope"))).endswith("no such file")
    assert one_line(cli(env, "run", "--prompt-file", str(tmp_path))).endswith("is a folder, not a file")


def test_argv_that_is_not_utf8(env):
    # Python keeps the undecodable bytes of argv as lone surrogates (surrogateescape)
    for flag in (b"--prompt", b"--system"):
        args = [b"run", b"--raw", flag, b"\xff\xfe"] + ([b"--prompt", b"hi"] if flag == b"--system" else [])
        p = cli(env, *args, timeout=120)
        assert p.returncode == 2
        assert one_line(p) == (f"mtpchat: error: argument {flag.decode()}: not valid UTF-8 text "
                               f"(byte 0xff at character 0)")


def test_prompt_file_reads_utf8_and_stdin(env, tmp_path):
    good = tmp_path / "p.txt"
    good.write_text("\ufeffWhat is the capital of France?", encoding="utf-8")  # a leading BOM is dropped
    a = cli(env, "run", "--prompt-file", str(good), "--max-new-tokens", "4", "--json", "--device", "cpu")
    b = cli(env, "run", "--prompt-file", "-", "--max-new-tokens", "4", "--json", "--device", "cpu",
            input=b"What is the capital of France?")
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    assert json.loads(a.stdout)["prompt_token_ids"] == json.loads(b.stdout)["prompt_token_ids"]


# --- 4: a stdout that cannot be written -----------------------------------------------------------------------


def _close_stdout():
    os.close(1)


@pytest.mark.parametrize("args", [["run", "--prompt", "hi", "--max-new-tokens", "4", "--device", "cpu"],
                                  ["run", "--prompt", "hi", "--max-new-tokens", "4", "--device", "cpu", "--json"],
                                  ["models"], ["doctor"], ["--help"]])
def test_stdout_full(env, args):
    with open("/dev/full", "wb") as full:
        p = cli(env, *args, stdout=full)
    assert one_line(p) == "mtpchat: error: cannot write to standard output: No space left on device"
    assert p.returncode == 1


@pytest.mark.parametrize("args", [["run", "--prompt", "hi"], ["models"], ["doctor"]])
def test_stdout_closed(env, args):
    p = cli(env, *args, stdout=None, preexec_fn=_close_stdout, timeout=120)
    assert one_line(p) == "mtpchat: error: standard output is closed"


@pytest.mark.parametrize("args", [["run", "--prompt", "hi", "--max-new-tokens", "64", "--ignore-eos",
                                   "--device", "cpu"], ["doctor"]])
def test_reader_going_away_is_quiet(env, args):
    """`mtpchat ... | head -c1`: the pipe closes after one byte; mtpchat stops without a word."""
    p = subprocess.Popen([sys.executable, "-m", "app.cli", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert p.stdout.read(1)
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(120) == 0 and err == b"", err


# --- 5: ctrl+c ------------------------------------------------------------------------------------------------


def _importing_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("when", ["torch import", 1.0, 3.0])
def test_ctrl_c_during_start_up(env, when):
    """SIGINT while Python imports torch and transformers (and loads the model): one line, exit status 130."""
    p = subprocess.Popen([sys.executable, "-m", "app.cli", "run", "--prompt", "hi", "--max-new-tokens", "64"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if when == "torch import":  # the moment torch's shared libraries are mapped: deep inside `import torch`
        deadline = time.monotonic() + 60
        while not _importing_torch(p.pid) and time.monotonic() < deadline:
            time.sleep(0.005)
    else:
        time.sleep(when)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err == b"mtpchat: interrupted\n", err


def test_ctrl_c_while_generating(env):
    p = subprocess.Popen([sys.executable, "-m", "app.cli", "run", "--prompt", "hi", "--max-new-tokens", "2000",
                          "--ignore-eos", "--device", "cpu"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert p.stdout.read(1)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err == b"mtpchat: interrupted\n", err


# --- 6: bench --out ---------------------------------------------------------------------------------------------


def test_bench_out_is_checked_first(env, tmp_path):
    for out, says in ((tmp_path, "is a folder; give a file name"),
                      (tmp_path / "missing" / "folder" / "x.json", "does not exist")):
        t0 = time.monotonic()
        p = cli(env, "bench", "--random-weights", "tiny", "--device", "cpu", "--out", str(out))
        assert one_line(p).endswith(says) and time.monotonic() - t0 < 90


def test_bench_keeps_the_rows_measured_before_a_late_failure(ckpt, tmp_path, capsys, monkeypatch):
    import engine.presets

    from app.cli import main

    def late(*a, **k):
        raise RuntimeError("late failure\nwith a second line")

    monkeypatch.setattr(engine.presets, "weight_bytes_per_token", late)  # runs after every row is measured
    out, model = tmp_path / "bench.json", str(ckpt("next"))
    capsys.readouterr()  # writing the fixture is not the command's output
    code = main(["bench", "--model", model, "--device", "cpu", "--depths", "0,2", "--drafter", "oracle",
                 "--acceptance", "1", "--max-new-tokens", "4", "--repeat", "1", "--no-hf", "--out", str(out)])
    err = capsys.readouterr().err.splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("mtpchat: error: internal error (RuntimeError: late "
                                                             "failure)"), err
    saved = json.loads(out.read_text())
    assert saved["complete"] is False
    assert [(r["depth"], r["drafter"]) for r in saved["results"]] == [(0, "none"), (2, "oracle@1")]
    assert all(r["tokens_per_s"] > 0 and "tokens" not in r for r in saved["results"])
    assert not list(tmp_path.glob(".*.tmp"))


# --- 7: one line, whatever the message holds ----------------------------------------------------------------


def test_every_error_is_one_line(capsys, monkeypatch):
    import app.cmd_run
    from app.cli import main
    from engine import EngineError

    def fail(args):
        raise EngineError("\n  first line \x1b[31mred\x1b[0m\x07\nsecond line\nthird")

    monkeypatch.setattr(app.cmd_run, "run", fail)
    assert main(["run", "--prompt", "x"]) == 2
    assert capsys.readouterr().err == "mtpchat: error: first line red\n"

    def bug(args):
        raise KeyError("k\nmore")

    monkeypatch.setattr(app.cmd_run, "run", bug)
    assert main(["run", "--prompt", "x"]) == 1
    assert capsys.readouterr().err == ("mtpchat: error: internal error (KeyError: 'k\\nmore'); MTPCHAT_DEBUG=1 "
                                       "shows the traceback\n")


def test_a_model_path_with_escapes_is_one_clean_line(env, tmp_path):
    bad = str(tmp_path / "x\x1b]0;pwned\x07y\x9b2J")
    line = one_line(cli(env, "run", "--model", bad, "--prompt", "hi"))
    assert line == f"mtpchat: error: {tmp_path}/xy: no such model folder"


# --- 8: terminal injection --------------------------------------------------------------------------------------


def test_terminal_safe():
    from app.safe_text import TerminalSafeStream, first_line, single_line, terminal_safe

    assert terminal_safe("a\x1b]0;pwned\x07b") == "ab"  # OSC 0: window / pane title
    assert terminal_safe("a\x1b]52;c;SGVsbG8=\x1b\\b") == "ab"  # OSC 52: clipboard
    assert terminal_safe("\x1b[2J\x1b[31mred\x1b[0m \x9b31mc1\x9d0;t\x9c.") == "red c1."
    assert terminal_safe("keep\nnew\tlines, not \r\x08\x00\x7f\x85\x1bc") == "keep\nnew\tlines, not "
    assert terminal_safe("caf\u00e9 \u4e2d\u6587 \U0001f600") == "caf\u00e9 \u4e2d\u6587 \U0001f600"
    assert terminal_safe("name\udcff") == "name\ufffd"  # an undecodable byte of a folder name
    assert first_line("\n  \x1b[1mfirst\x1b[0m\tline \nsecond") == "first line"
    assert single_line("a\nb\tc") == "a b c"
    s = TerminalSafeStream()  # sequences split over streamed pieces are removed whole
    pieces = ["one \x1b", "]0;ti", "tle\x07 two \x1b[3", "1m three \x9d", "52;c;x\x1b", "\\ four\x1b"]
    assert "".join(s.feed(p) for p in pieces) + s.flush() == "one  two  three  four"
    assert all(not any(c in terminal_safe("".join(map(chr, range(0x1b, 0xa0)))) for c in CONTROL) for _ in [0])


class FakeEngine:
    """What cmd_run needs of an engine, generating text with escape sequences in it."""

    PIECES = ["Hi \x1b]0;pwned\x07there", " \x1b]52;c;SGVsbG8=\x1b", "\\copied\x1b[2", "J\x9b31m!"]

    def __init__(self):
        from engine import ModelInfo

        self.info = ModelInfo("fake", "/fake", "qwen3_next", "qwen3_next", 1, 1, "cpu", "float32")

    def encode_chat(self, messages, think=None, template_vars=None):
        return [1, 2, 3]

    def check_context(self, prompt_tokens, max_new_tokens=None):
        pass  # (the real engine's check: test_max_new_tokens_beyond_the_models_context)

    def generate(self, prompt, settings, control=None):
        from engine import Finished, Started, Tokens

        yield Started(len(prompt))
        for i, piece in enumerate(self.PIECES):
            yield Tokens([10 + i], ["target"], piece)
        yield Finished("length", {"tokens_per_s": 1.0, "depth": 0, "acceptance_rate": 0.0})

    def diagnostics(self):
        return {}


def _run_args(**kw):
    base = dict(prompt="hi", system=None, raw=False, max_new_tokens=8, depth=0, temperature=0.0, top_p=1.0, top_k=0,
                seed=None, ignore_eos=True, json=False)
    return argparse.Namespace(**{**base, **kw})


def test_run_streams_terminal_safe_text(capsys):
    from app.cmd_run import _run

    assert _run(_run_args(), FakeEngine()) == 0
    out, err = capsys.readouterr()
    assert out == "Hi there copied!\n"
    assert not any(c in out + err for c in CONTROL)


def test_run_json_keeps_the_text_lossless(capsys):
    from app.cmd_run import _run

    assert _run(_run_args(json=True), FakeEngine()) == 0
    out = capsys.readouterr().out
    assert out.isascii() and "\x1b" not in out  # json.dumps escapes control characters (ensure_ascii)
    assert json.loads(out)["text"] == "".join(FakeEngine.PIECES)


def test_models_and_doctor_lists_are_terminal_safe(env, ckpt, tmp_path):
    folders = tmp_path / "models"
    folders.mkdir()
    evil = folders / "evil\x1b]0;pwned\x07\x1b]52;c;SGk=\x07name"
    shutil.copytree(ckpt("next"), evil)
    p = cli(env, "models", str(folders))
    assert p.returncode == 0, p.stderr
    text = p.stdout.decode()
    assert "evilname" in text and not any(c in text for c in CONTROL), text
    rows = json.loads(cli(env, "models", str(folders), "--json").stdout)  # --json: the name as it is
    assert any(r["path"] == str(evil) for r in rows)
    p = cli(dict(env, MTPCHAT_MODELS=str(folders)), "doctor")
    assert p.returncode == 0, p.stderr
    text = p.stdout.decode()
    assert "evilname" in text and not any(c in text for c in CONTROL), text


# --- 9: tensor parallelism: checked before spawning, workers die with their parent --------------------------------


def _children(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            out += [int(d)] + _children(int(d))
    return out


def _alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.append(pid)
        except OSError:
            pass
    return alive


def _gone(workers, seconds: float = 5.0) -> bool:
    """Whether every worker has ended within `seconds`."""
    deadline = time.monotonic() + seconds
    while _alive(workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(workers)


def _reap(p) -> None:
    """Kill what a test left running: the parent and any worker of it still alive."""
    for pid in _alive(_children(p.pid)):
        os.kill(pid, signal.SIGKILL)
    if p.poll() is None:
        p.kill()


def test_tp_more_ranks_than_the_machine_has(env, ckpt):
    p = subprocess.Popen([sys.executable, "-m", "app.cli", "run", "--model", str(ckpt("next")), "--prompt", "hi",
                          "--device", "cpu", "--tp", "64"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    spawned = set()
    while p.poll() is None:
        spawned.update(_children(p.pid))
        time.sleep(0.05)
    line = one_line(subprocess.CompletedProcess(p.args, p.returncode, p.stdout.read(), p.stderr.read()))
    # 2 cores here: too few cores; on a machine of 64 cores or more: 4 attention heads do not split 64 ways
    assert line.startswith("mtpchat: error: --tp 64: only 2 CPU cores here") or "--tp 64: 4 attention heads" in line
    assert not spawned  # refused before any worker process started


def test_chat_tp_more_ranks_than_the_machine_has(env):
    line = one_line(cli(env, "chat", "--tp", "64", "--device", "cpu", timeout=120))  # before the UI starts
    assert line.startswith("mtpchat: error: --tp 64: only ") and "CPU core" in line, line


def test_tp_heads_that_do_not_split(env, ckpt, tmp_path):
    cfg = json.loads((ckpt("next") / "config.json").read_text())
    cfg["num_attention_heads"], cfg["num_key_value_heads"] = 3, 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    p = cli(env, "run", "--model", str(tmp_path), "--prompt", "hi", "--device", "cpu", "--tp", "2")
    where = tmp_path / "config.json"
    assert one_line(p) == f"mtpchat: error: {where}: --tp 2: 3 attention heads are not divisible by 2"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_tp_workers_die_with_their_parent(env, ckpt, sig):
    p = subprocess.Popen([sys.executable, "-m", "app.cli", "run", "--model", str(ckpt("next")), "--prompt",
                          "Tell me a story about a cat.", "--max-new-tokens", "3000", "--ignore-eos", "--device", "cpu",
                          "--tp", "2"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.read(1), p.stderr.read()  # rank 0 is generating
        workers = _children(p.pid)
        assert len(workers) >= 2
        p.send_signal(sig)
        assert p.wait(30) in (128 + sig, -sig)
        assert _gone(workers), "tensor-parallel workers outlived their parent"
        assert sig == signal.SIGKILL or b"Traceback" not in p.stderr.read()
    finally:
        _reap(p)


def test_tp_ctrl_c_stops_every_rank(env, ckpt):
    """ctrl+c in the terminal reaches the whole process group: the parent answers it (one line, 130), the workers
    (which ignore SIGINT) end with it."""
    p = subprocess.Popen([sys.executable, "-m", "app.cli", "run", "--model", str(ckpt("next")), "--prompt",
                          "Tell me a story about a cat.", "--max-new-tokens", "3000", "--ignore-eos", "--device", "cpu",
                          "--tp", "2"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)
    try:
        assert p.stdout.read(1), p.stderr.read()
        workers = _children(p.pid)
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=30)
        assert p.returncode == 130 and err == b"mtpchat: interrupted\n", err
        assert _gone(workers)
    finally:
        _reap(p)


def test_tp_reader_going_away_is_quiet(env, ckpt):
    """`mtpchat run --tp 2 | head -c1`: rank 0's BrokenPipeError ends the group at once, without a word."""
    p = subprocess.Popen([sys.executable, "-m", "app.cli", "run", "--model", str(ckpt("next")), "--prompt",
                          "Tell me a story about a cat.", "--max-new-tokens", "3000", "--ignore-eos", "--device", "cpu",
                          "--tp", "2"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.read(1), p.stderr.read()
        workers = _children(p.pid)
        p.stdout.close()
        t0 = time.monotonic()
        err = p.stderr.read()
        assert p.wait(30) == 0 and err == b"", err
        assert time.monotonic() - t0 < 4  # not after the grace period a failing rank gives its peers
        assert _gone(workers)
    finally:
        _reap(p)


def _chat_leader(model, conn):
    from engine.tp_session import TPLeader

    leader = TPLeader(model, "cpu", None, 2)
    conn.send([p.pid for p in leader.followers])
    time.sleep(600)


def test_chat_followers_die_with_the_chat(ckpt):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    leader = ctx.Process(target=_chat_leader, args=(str(ckpt("next")), send))
    leader.start()
    try:
        assert recv.poll(200), "the tensor-parallel chat session did not start"
        followers = recv.recv()
        os.kill(leader.pid, signal.SIGKILL)  # nothing of the leader's runs: only the kernel and the watchdog
        leader.join(30)
        deadline = time.monotonic() + 5
        while _alive(followers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(followers), "a chat follower outlived the chat"
    finally:
        if leader.is_alive():
            leader.kill()


# --- 10: a broken command module ----------------------------------------------------------------------------------


def test_a_broken_command_module_is_named(env):
    code = ("import sys; sys.modules['app.cmd_doctor'] = None\n"  # importing it now raises ImportError
            "from app.cli import main; raise SystemExit(main(['models']))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, timeout=120)
    assert one_line(p).startswith("mtpchat: error: app.cmd_doctor does not import (ModuleNotFoundError: ")


# --- 12, 13: one random_model; the app uses the engine's public API only -------------------------------------------


def test_the_app_imports_only_the_public_api():
    mine = ["cli.py", "cmd_run.py", "cmd_bench.py", "cmd_models.py", "cmd_doctor.py", "safe_text.py"]
    for name in mine:
        text = (ROOT / "app" / name).read_text()
        assert "from engine." not in text and "import engine." not in text, name
    import engine
    import engine.tp

    assert not hasattr(engine.tp, "random_model")  # one random_model: engine.presets' (group= for a shard)
    for name in engine.__all__:
        assert getattr(engine, name) is not None, name
    names = {"Cycle", "Finished", "Started", "Tokens", "Fallback", "EngineError", "discover", "tp_loader", "PHASES"}
    assert names <= set(engine.__all__)


def test_importing_the_engine_does_not_import_torch():
    code = "import sys, engine, app.cli, app.safe_text; from engine import EngineError; print('torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "False", p.stderr

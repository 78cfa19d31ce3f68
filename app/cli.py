"""`mtpchat` command line: the TUI by default, and run / bench / doctor / models for scripts.

User mistakes end with exactly one line on stderr (`mtpchat: error: ...`) and a non-zero exit status, never a
traceback and never a hang: flag values are checked by the argparse types below before anything slow starts,
every error is printed by `print_error` (one line, terminal-safe), a stdout that cannot be written is one line
too (a reader that goes away, `| head`, is quiet), and ctrl+c at any point, even inside torch's import, is
"mtpchat: interrupted" with exit status 130.
"""

from __future__ import annotations

import os
import signal
import sys


def _exit_interrupted(signum, frame) -> None:
    """ctrl+c (SIGINT) while a command starts or runs: one line and exit status 130, at once. Not an exception:
    a KeyboardInterrupt raised inside an import (torch's, transformers' lazy modules) surfaces as a traceback or
    as another error. Nothing is left half-done by exiting here: stdout is flushed as it is written, bench's
    --out is replaced whole, and tensor-parallel workers die with their parent (engine/tp.py)."""
    try:
        os.write(2, b"mtpchat: interrupted\n")
    except OSError:
        pass
    os._exit(130)


if __name__ == "__main__":  # python -m app.cli: from the first line on (the console script: first thing in main)
    signal.signal(signal.SIGINT, _exit_interrupted)

import argparse  # noqa: E402
import importlib  # noqa: E402
import math  # noqa: E402

from engine import (AUTO, MAX_DEPTH, MAX_NEW_TOKENS, MIN_CONTEXT, SEED_MAX, SEED_MIN,  # noqa: E402  # light: no torch yet
                    EngineError)

from . import paths  # noqa: E402
from .safe_text import first_line  # noqa: E402

from . import cmd_pull  # noqa: E402,F401  # before the default below: pull keeps the user's own HF_HUB_OFFLINE

# Nothing touches the network at run time; keep library chatter off the terminal.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROG = "mtpchat"
COMMANDS = {"run": "cmd_run", "bench": "cmd_bench", "pull": "cmd_pull", "models": "cmd_models",
            "doctor": "cmd_doctor"}


# --- one line on stderr -------------------------------------------------------------------------------------


def one_line(message) -> str:
    """What an error line says about `message` (a string or an exception): its first non-empty line, trimmed,
    control characters and escape sequences removed; an exception without a message is named by its type."""
    text = first_line(str(message))
    if not text and isinstance(message, BaseException):
        text = type(message).__name__
    return text


def print_line(message, prog: str = PROG) -> None:
    """`prog: message` as exactly one line on stderr (nothing when stderr itself cannot be written)."""
    try:
        sys.stderr.write(f"{prog}: {one_line(message)}\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass


def print_error(message, prog: str = PROG) -> None:
    """`prog: error: message`, one line: the only way the CLI reports an error."""
    print_line(f"error: {one_line(message) or 'unknown error'}", prog)


# --- stdout ---------------------------------------------------------------------------------------------------


class OutputError(EngineError):
    """Standard output cannot be written (closed, /dev/full, an I/O error). An EngineError: a tensor-parallel
    worker reports it like any user-facing failure."""


def write_out(text: str, flush: bool = False) -> None:
    """Write to stdout; a failure is an OutputError (one line), except a reader that went away (BrokenPipeError,
    left to the caller: quiet)."""
    out = sys.stdout
    if out is None:
        raise OutputError("standard output is closed")
    try:
        out.write(text)
        if flush:
            out.flush()
    except BrokenPipeError:
        raise
    except (OSError, ValueError) as e:  # ValueError: the file object was closed
        raise OutputError(f"cannot write to standard output: {getattr(e, 'strerror', None) or e}") from None


def flush_out() -> None:
    write_out("", flush=True)


def _discard_stdout() -> None:
    """After stdout failed: point it at /dev/null, so the interpreter's own flush at exit finds nothing to
    complain about (a second message, "Exception ignored ..."). Only for the real stdout (not a test's)."""
    if sys.stdout is None or sys.stdout is not sys.__stdout__:
        return
    try:
        fd = sys.stdout.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except (OSError, ValueError):
        pass


def _stdout_broken() -> bool:
    try:
        flush_out()
    except (OutputError, BrokenPipeError):
        return True
    return False


# --- flag values ------------------------------------------------------------------------------------------------


def _shown(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:40] + "...")


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {_shown(text)}") from None


def int_in(lo: int | None, hi: int | None, shown: str | None = None):
    """An argparse type: a whole number in [lo, hi] (None: unbounded); `shown` names the range in the error."""

    def parse(text: str) -> int:
        n = _whole(text)
        if (lo is not None and n < lo) or (hi is not None and n > hi):
            if shown:
                raise argparse.ArgumentTypeError(f"must be {shown}, got {_shown(text.strip())[1:-1]}")
            if hi is None:
                raise argparse.ArgumentTypeError(f"must be at least {lo}, got {n}")
            if lo is None:
                raise argparse.ArgumentTypeError(f"must be at most {hi}, got {n}")
            raise argparse.ArgumentTypeError(f"must be between {lo} and {hi}, got {n}")
        return n

    return parse


def float_in(lo: float, hi: float | None = None, lo_open: bool = False):
    """An argparse type: a finite number >= lo (> lo when lo_open) and <= hi. NaN and infinities are refused."""

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {_shown(text)}") from None
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text.strip()}")
        if (x <= lo if lo_open else x < lo) or (hi is not None and x > hi):
            left = "(" if lo_open else "["
            raise argparse.ArgumentTypeError(
                f"must be in {left}{lo:g}, {hi:g}], got {x:g}" if hi is not None
                else f"must be {'>' if lo_open else '>='} {lo:g}, got {x:g}")
        return x

    return parse


tp_size = int_in(1, None)
fixed_depth = int_in(0, MAX_DEPTH)


def depth(text: str):
    """--depth: 0 .. MAX_DEPTH, or auto (the engine picks each cycle's depth)."""
    return AUTO if text.strip().lower() == AUTO else fixed_depth(text)


seed = int_in(SEED_MIN, SEED_MAX, "between -2**63 and 2**64 - 1 (the seeds torch accepts)")
temperature = float_in(0.0)
top_p = float_in(0.0, 1.0, lo_open=True)
top_k = int_in(0, None)
max_context = int_in(MIN_CONTEXT, None)


def max_new_tokens(lo: int = 1):
    return int_in(lo, MAX_NEW_TOKENS)


def depth_list(text: str) -> list[int]:
    """--depths: comma-separated depths, each 0 .. MAX_DEPTH or auto."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected comma-separated depths, e.g. 0,1,2")
    return [depth(p) for p in parts]


def utf8_text(text: str) -> str:
    """Text from the command line must be UTF-8: Python keeps undecodable bytes of argv as lone surrogates
    (surrogateescape), which no tokenizer can encode."""
    return check_utf8(text, argparse.ArgumentTypeError)


def check_utf8(text: str, error=EngineError, where: str = "") -> str:
    for i, ch in enumerate(text):
        if "\udc80" <= ch <= "\udcff":
            raise error(f"{where}not valid UTF-8 text (byte 0x{ord(ch) - 0xdc00:02x} at character {i})")
        if "\ud800" <= ch <= "\udfff":
            raise error(f"{where}not valid UTF-8 text (a lone surrogate at character {i})")
    return text


def positive_int_list(text: str) -> list[int]:
    """Comma-separated whole numbers, each at least 1, duplicates dropped (order kept): bench's --prompt-tokens."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected comma-separated whole numbers, e.g. 200,2048")
    return list(dict.fromkeys(int_in(1, None)(p) for p in parts))


# --- the parser -----------------------------------------------------------------------------------------------


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help says each option's default where it has one and its help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not unset and action.option_strings and "default" not in text and action.nargs != 0:
            text += " (default: %(default)s)"
        return text


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("mtpchat")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


class ArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # one clear line, exit 2
        print_error(message)
        raise SystemExit(2)


class CommandModuleError(RuntimeError):
    """A command's module does not import (a broken install or a bug): said as such, not as 'invalid choice'."""


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder (Hugging Face layout); default: the best model found")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on CUDA; on the CPU float32, or bfloat16 when the model does not fit in "
                        "float32 (half the memory)")
    p.add_argument("--max-context", type=max_context, metavar="N",
                   help=f"cap the context at N tokens (at least {MIN_CONTEXT}; default: the model's "
                        f"max_position_embeddings): the KV cache, and so memory, stays within N positions")
    p.add_argument("--compile", action="store_true",
                   help="CUDA: torch.compile each layer kind inside the CUDA graphs (faster steps; the first reply "
                        "at each new depth waits for compilation). Also MTPCHAT_COMPILE=1")
    p.add_argument("--embed-on-host", choices=["auto", "on", "off"],
                   help="CUDA: keep the input embedding table (2.5 GB for 27B) in page-locked host memory, read over "
                        "PCIe for the step's few tokens, not in GPU memory; auto (the default): for quantized "
                        "checkpoints and models over 60 percent of the GPU. Also MTPCHAT_EMBED_ON_HOST")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"],
                   help="the attention KV cache's storage: auto (the model's dtype) or fp8 (e4m3, a scale per head "
                        "and position: half a 16-bit cache's memory, so twice the context; lossy: replies can "
                        "differ from auto's, speculation stays exact). Also MTPCHAT_KV_CACHE_DTYPE")
    p.add_argument("--mtp-from", metavar="PATH",
                   help="take the MTP head (mtp.* tensors, bf16, FP8 or 4-bit) from another release of the same model, "
                        "for a checkpoint shipped without one; shapes must match. Also MTPCHAT_MTP_FROM")


def check_model_folder(args) -> None:
    """A bad --model fails before anything slow starts (a model load, tensor-parallel workers)."""
    if getattr(args, "model", None):
        from engine import model_dir

        model_dir(args.model)
    if getattr(args, "mtp_from", None):
        from engine import model_dir

        try:
            model_dir(args.mtp_from)
        except EngineError as e:
            raise EngineError(f"--mtp-from {e}") from None
    if getattr(args, "draft_model", None) and not args.draft_model.startswith("random:"):  # (bench's presets)
        from engine import model_dir

        try:
            model_dir(args.draft_model)
        except EngineError as e:
            raise EngineError(f"--draft-model {e}") from None


def check_tp_args(args, preset: str | None = None, layers: int | None = None) -> None:
    """--tp N > 1: N ranks fit this machine (devices, CPU cores) and the model's heads split N ways, checked
    before any worker process starts. Under torchrun the ranks are torchrun's: nothing to check here."""
    tp = getattr(args, "tp", 1)
    if tp <= 1:
        return
    from engine import check_tp, under_torchrun

    if under_torchrun():
        return
    check_tp(tp, getattr(args, "device", None), getattr(args, "model", None), preset, layers)


def add_think_arg(p: argparse.ArgumentParser) -> None:
    """--think / --no-think: a thinking model's enable_thinking (unset: what its chat template does)."""
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                   help="a thinking model reasons before it answers (--no-think: it answers at once); default: "
                        "what its chat template does; no effect on a model whose template has no such switch")


def add_draft_args(p: argparse.ArgumentParser, drafter: bool = True) -> None:
    """--draft-model D (a separate, smaller model of the same tokenizer drafts) and --drafter mtp|draft|auto."""
    p.add_argument("--draft-model", metavar="D",
                   help="a smaller model of the same tokenizer (e.g. Qwen3-0.6B for Qwen3-Next) drafts the tokens "
                        "the model verifies; also MTPCHAT_DRAFT_MODEL")
    if drafter:
        p.add_argument("--drafter", choices=["mtp", "draft", "auto"],
                       help="with both an MTP head and --draft-model: which drafts; auto (the default): each "
                            "cycle the one with the higher measured tokens/s")


def add_tp_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=tp_size, default=1, metavar="N",
                   help="tensor parallelism: shard the model over N worker processes (one GPU each on CUDA, "
                        "gloo on CPU); under torchrun the ranks are torchrun's")


def build_parser() -> argparse.ArgumentParser:
    modules = {}
    for name in COMMANDS.values():
        try:
            modules[name] = importlib.import_module(f"app.{name}")
        except Exception as e:  # ImportError, SyntaxError, ...: the module is broken, say which
            raise CommandModuleError(f"app.{name} does not import ({type(e).__name__}: {one_line(e)})") from e

    parser = ArgumentParser(prog="mtpchat", description="Terminal chat for local Qwen3-Next / Qwen3.5 models with "
                            "lossless MTP self-speculative decoding. Without a command: the chat.")
    parser.add_argument("--version", action="version", version=f"mtpchat {version()}")
    sub = parser.add_subparsers(dest="command", parser_class=ArgumentParser)
    chat = sub.add_parser("chat", help="open the terminal chat (the default)")
    add_model_args(chat)
    chat.add_argument("--depth", type=depth, help=f"speculation depth, 0 .. {MAX_DEPTH} (0 = plain decoding), or auto")
    add_think_arg(chat)
    add_draft_args(chat)
    add_tp_arg(chat)
    for name in COMMANDS.values():
        modules[name].add_parser(sub)
    return parser


def one_line_errors(run, args, prog: str = "mtpchat") -> int:
    """Run a read-only command (models, doctor): whatever fails is one line on stderr and exit status 1."""
    try:
        return run(args)
    except (BrokenPipeError, OutputError):
        raise  # main() says it (or, for a reader that went away, stays quiet); ctrl+c too
    except Exception as e:
        print_error(e, prog)
        return 1


# --- main -------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    # ctrl+c at any moment, in the imports of torch and Textual too, is one line (see _exit_interrupted); every
    # failure a user can cause is one line through the handlers below.
    try:
        previous = signal.signal(signal.SIGINT, _exit_interrupted)
    except ValueError:  # not the main thread: signals are not ours to handle
        previous = None
    try:
        return _guarded(argv)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _guarded(argv: list[str] | None) -> int:
    try:
        code = _main(argv)
        flush_out()  # a buffered stdout fails here (/dev/full): one line, not a message at interpreter exit
        return code
    except SystemExit as e:  # argparse (--help: 0, a bad flag: 2, already said); SIGTERM under --tp (143)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if _stdout_broken():  # --help into /dev/full
            return _output_failed()
        return code
    except KeyboardInterrupt:
        return _interrupted()
    except BrokenPipeError:  # the reader went away (`| head`): quiet
        _discard_stdout()
        return 0
    except OutputError as e:
        return _output_failed(e)
    except (EngineError, CommandModuleError) as e:
        print_error(e)
        return 2 if isinstance(e, EngineError) else 1
    except OSError as e:
        if _stdout_broken():
            return _output_failed()
        print_error(e)
        return 1
    except Exception as e:  # a bug, not a user mistake: still one line, with the way to see more
        if os.environ.get("MTPCHAT_DEBUG") == "1":
            raise
        print_error(f"internal error ({type(e).__name__}: {one_line(e)}); MTPCHAT_DEBUG=1 shows the traceback")
        return 1


def _interrupts_raise() -> None:
    try:
        if signal.getsignal(signal.SIGINT) is _exit_interrupted:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:
        pass


def _interrupted() -> int:
    import signal

    try:  # a second ctrl+c while saying so must not become a traceback
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        previous = None
    print_line("interrupted")
    if previous is not None:
        signal.signal(signal.SIGINT, previous)
    return 130


def _output_failed(e: OutputError | None = None) -> int:
    if e is None:
        try:
            flush_out()
            e = OutputError("cannot write to standard output")
        except OutputError as failure:
            e = failure
        except BrokenPipeError:
            _discard_stdout()
            return 0
    print_error(e)
    _discard_stdout()
    return 1


def _main(argv: list[str] | None) -> int:
    paths.use_kernel_cache()  # before anything imports torch (the commands' modules and the engine import it late)
    argv = sys.argv[1:] if argv is None else list(argv)
    if sys.stdout is None:  # started with stdout closed (`>&-`): a later open() could even take its place
        raise OutputError("standard output is closed")
    parser = build_parser()
    args = parser.parse_args(argv if argv else ["chat"])
    args.argv = list(argv)  # what reports record as their command line
    if getattr(args, "compile", False):  # read where engines are built (the chat builds them on its worker thread)
        os.environ["MTPCHAT_COMPILE"] = "1"
    if getattr(args, "mtp_from", None):  # read where engines are built, as MTPCHAT_COMPILE
        os.environ["MTPCHAT_MTP_FROM"] = args.mtp_from
    if getattr(args, "embed_on_host", None):  # (load_engine and model.load read it: a draft model's load too)
        os.environ["MTPCHAT_EMBED_ON_HOST"] = args.embed_on_host
    if getattr(args, "kv_cache_dtype", None):  # (every trunk reads it as it is built: model.choose_kv_cache)
        os.environ["MTPCHAT_KV_CACHE_DTYPE"] = args.kv_cache_dtype
    if args.command in (None, "chat"):  # the chat's engine thread: load_engine reads them (--draft-model)
        for flag, var in (("draft_model", "MTPCHAT_DRAFT_MODEL"), ("drafter", "MTPCHAT_DRAFTER")):
            if getattr(args, flag, None):
                os.environ[var] = getattr(args, flag)
    if args.command in (None, "chat"):  # the TUI reports its own errors; torch loads on its engine thread
        check_tp_args(args)  # --tp N: before the UI starts (a missing --model is the UI's to report otherwise)
        from .launch import run_tui

        _interrupts_raise()  # the UI must restore the terminal: from here on ctrl+c is a KeyboardInterrupt
        return run_tui(getattr(args, "model", None), getattr(args, "depth", None),
                       getattr(args, "device", None), getattr(args, "dtype", None), tp=getattr(args, "tp", 1),
                       max_context=getattr(args, "max_context", None), think=getattr(args, "think", None))
    return importlib.import_module(f"app.{COMMANDS[args.command]}").run(args)


if __name__ == "__main__":  # python -m app.cli: run the one app.cli module (the commands import it by that name)
    from app.cli import main as _cli_main

    raise SystemExit(_cli_main())

"""`mtpchat` command line: the TUI by default, and run / bench / doctor / models for scripts.

User mistakes end with one line on stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

# Nothing touches the network at run time; keep library chatter off the terminal.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line, exit 2
        sys.stderr.write(f"mtpchat: error: {message}\n")
        raise SystemExit(2)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder (Hugging Face layout); default: the best model found")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--compile", action="store_true",
                   help="CUDA: torch.compile each layer kind inside the CUDA graphs (faster steps; the first reply "
                        "at each new depth waits for compilation). Also MTPCHAT_COMPILE=1")


def _tp_size(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of ranks, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def check_model_folder(args) -> None:
    """A bad --model fails before anything slow starts (a model load, tensor-parallel workers)."""
    if getattr(args, "model", None):
        from engine.checkpoint import model_dir

        model_dir(args.model)


def add_tp_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=_tp_size, default=1, metavar="N",
                   help="tensor parallelism: shard the model over N worker processes (one GPU each on CUDA, "
                        "gloo on CPU); under torchrun the ranks are torchrun's")


def build_parser() -> argparse.ArgumentParser:
    from . import cmd_bench, cmd_run

    parser = ArgumentParser(prog="mtpchat", description="Terminal chat for local Qwen3-Next / Qwen3.5 models with "
                            "lossless MTP self-speculative decoding. Without a command: the chat.")
    sub = parser.add_subparsers(dest="command", parser_class=ArgumentParser)
    chat = sub.add_parser("chat", help="open the terminal chat (the default)")
    add_model_args(chat)
    chat.add_argument("--depth", type=int, help="speculation depth (0 = plain decoding)")
    add_tp_arg(chat)
    cmd_run.add_parser(sub)
    cmd_bench.add_parser(sub)
    for name in ("cmd_models", "cmd_doctor"):
        try:
            mod = __import__(f"app.{name}", fromlist=["add_parser"])
        except ImportError:
            continue
        mod.add_parser(sub)
    return parser


def one_line_errors(run, args, prog: str = "mtpchat") -> int:
    """Run a read-only command (models, doctor): whatever fails is one line on stderr and exit status 1."""
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        text = str(e).strip()
        sys.stderr.write(f"{prog}: error: {text.splitlines()[0] if text else type(e).__name__}\n")
        return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv if argv else ["chat"])
    args.argv = list(argv)  # what reports record as their command line
    if getattr(args, "compile", False):  # read where engines are built (the chat builds them on its worker thread)
        os.environ["MTPCHAT_COMPILE"] = "1"
    if args.command in (None, "chat"):  # the TUI reports its own errors; torch loads on its engine thread
        from .tui import run_tui

        return run_tui(getattr(args, "model", None), getattr(args, "depth", None),
                       getattr(args, "device", None), getattr(args, "dtype", None), tp=getattr(args, "tp", 1))
    from engine.errors import EngineError

    try:
        module = {"run": "cmd_run", "bench": "cmd_bench", "models": "cmd_models", "doctor": "cmd_doctor"}[args.command]
        return __import__(f"app.{module}", fromlist=["run"]).run(args)
    except EngineError as e:
        sys.stderr.write(f"mtpchat: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("mtpchat: interrupted\n")
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())

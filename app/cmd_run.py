"""`mtpchat run`: one prompt, streamed to stdout, or one JSON object with --json.

The streamed text is terminal-safe (escape sequences and control characters in the model's output are removed,
app/safe_text.py); --json is the lossless form (json.dumps escapes every control character).

A thinking model's reply has two parts: stdout gets the answer only (what a script pipes on, as with ollama's
--hidethinking or llama.cpp's --reasoning-format: the reasoning apart); --show-thinking streams the reasoning to
stderr, dimmed on a terminal. --json gives both: "text" (the answer) and "reasoning" ("" when none).

A fallback that concerns this run (no MTP head, --think without the template's switch, bfloat16 on the CPU, the
depth lowered after running out of memory, another model picked) is a note line on stderr; --json lists every
one, the machine's too ("no CUDA device", FLA), which `mtpchat doctor` reports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .reply_parts import REASONING, parts_or_answer, shown_answer, split_pieces
from .safe_text import terminal_safe

DIM, RESET = "\x1b[2m", "\x1b[0m"  # the app's own styling of the reasoning on a terminal (never model text)
MACHINE_FALLBACKS = ("cuda", "fla")  # the same on every run here: doctor's, not a note each time


def add_parser(sub) -> None:
    from .cli import (MAX_DEPTH, MAX_NEW_TOKENS, SEED_MAX, SEED_MIN, add_draft_args, add_model_args, add_tp_arg,
                      add_think_arg, depth, int_in, max_new_tokens, seed, temperature, top_k, top_p, utf8_text)

    p = sub.add_parser("run", help="generate a reply to one prompt")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", type=utf8_text, help="the user message (or raw text with --raw)")
    source.add_argument("--prompt-file", metavar="F", help="read the prompt from file F (UTF-8; - for stdin)")
    add_model_args(p)
    p.add_argument("--system", type=utf8_text, help="system prompt")
    p.add_argument("--raw", action="store_true", help="feed the prompt text without the chat template")
    p.add_argument("--max-new-tokens", type=max_new_tokens(1), default=256, metavar="N",
                   help=f"at most N new tokens (1 .. {MAX_NEW_TOKENS:,}, and within the model's context)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token, to --max-new-tokens (benchmarking)")
    p.add_argument("--depth", type=depth, default=2,
                   help=f"speculation depth, 0 .. {MAX_DEPTH} (0 = plain decoding), or auto")
    p.add_argument("--temperature", type=temperature, default=0.0, metavar="T",
                   help="sampling temperature, >= 0 (0 = greedy: the model's most likely token)")
    p.add_argument("--top-p", type=top_p, default=1.0, metavar="P",
                   help="nucleus sampling: keep the likeliest tokens up to probability P, in (0, 1] (1 = off)")
    p.add_argument("--top-k", type=top_k, default=0, metavar="K",
                   help="keep the K likeliest tokens, >= 0 (0 = off)")
    p.add_argument("--seed", type=seed, metavar="S",
                   help=f"random seed of sampling, {SEED_MIN} .. {SEED_MAX} (default: a fresh one each run)")
    add_think_arg(p)
    p.add_argument("--think-budget", type=int_in(1, MAX_NEW_TOKENS), metavar="N",
                   help="at most N reasoning tokens: then the engine closes the reasoning and the answer follows")
    p.add_argument("--show-thinking", action="store_true",
                   help="stream a thinking model's reasoning to stderr (stdout gets the answer only)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_draft_args(p)
    add_tp_arg(p)


def settings_from(args):
    from engine import GenerationSettings

    s = GenerationSettings(max_new_tokens=args.max_new_tokens, depth=args.depth, temperature=args.temperature,
                           top_p=args.top_p, top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos,
                           think=getattr(args, "think", None), think_budget=getattr(args, "think_budget", None))
    s.validate()  # before the (slow) model load: a bad flag fails at once
    return s


def read_prompt_file(path: str) -> str:
    """The text of --prompt-file (a UTF-8 file, a leading byte-order mark dropped; '-' = stdin)."""
    from engine import EngineError

    try:
        if path == "-":
            if sys.stdin is None:
                raise EngineError("--prompt-file -: standard input is closed")
            data = sys.stdin.buffer.read()
        else:
            data = Path(path).expanduser().read_bytes()
    except IsADirectoryError:
        raise EngineError(f"--prompt-file {path}: is a folder, not a file") from None
    except FileNotFoundError:
        raise EngineError(f"--prompt-file {path}: no such file") from None
    except OSError as e:
        raise EngineError(f"--prompt-file {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise EngineError(f"--prompt-file {path}: not valid UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                          f"{e.start})") from None


def run(args) -> int:
    from engine import default_model_path, launch_tp, load_engine, under_torchrun

    from .cli import check_model_folder, check_tp_args

    settings_from(args)  # a bad flag fails before the slow model load
    if args.prompt_file is not None:  # read once, here: the tensor-parallel workers get the text
        args.prompt, args.prompt_file = read_prompt_file(args.prompt_file), None
    check_model_folder(args)

    tp = getattr(args, "tp", 1)
    if tp > 1 or under_torchrun():  # N ranks run the same loop; rank 0 owns the output
        if args.draft_model or args.drafter:
            from engine import EngineError

            raise EngineError("--draft-model / --drafter: not with tensor parallelism (--tp) yet")
        if tp > 1 and not under_torchrun() and not args.model:
            args.model = default_model_path()  # every rank loads the same checkpoint
        check_tp_args(args)  # devices, cores, heads: before any worker starts
        return launch_tp(_run_rank, args, tp, args.device)
    return _run(args, load_engine(args.model, args.device, args.dtype, max_context=args.max_context,
                                  draft_model=args.draft_model, drafter=args.drafter))


def _run_rank(args, group) -> int:
    """One rank of `run --tp N` (a spawned worker, or a torchrun process)."""
    from engine import load_engine

    return _run(args, load_engine(args.model, None, args.dtype, tp=group, max_context=args.max_context), group)


class ReplyText:
    """A reply's tokens as `run` reports them: ids, sources, parts, and the reasoning and answer text apart."""

    def __init__(self):
        self.ids, self.sources, self.parts = [], [], []
        self.reasoning, self.answer = [], []

    def add(self, tokens) -> tuple[str, str]:
        """One Tokens event; returns its (reasoning, answer) text."""
        parts = parts_or_answer(getattr(tokens, "parts", None), len(tokens.token_ids))
        if len(tokens.pieces) == len(tokens.token_ids):
            reasoning, answer = split_pieces(tokens.pieces, parts)
        else:  # (an engine that gives no pieces: all answer)
            reasoning, answer = "", tokens.text
        self.ids += tokens.token_ids
        self.sources += tokens.sources
        self.parts += parts
        self.reasoning.append(reasoning)
        self.answer.append(answer)
        return reasoning, answer


class StreamedReply:
    """`run`'s text output: the answer to stdout (the blank line the template puts after the reasoning left
    out), the reasoning to stderr with --show-thinking, each terminal-safe."""

    def __init__(self, show_thinking: bool):
        from .safe_text import TerminalSafeStream

        self.show_thinking = show_thinking
        self.out, self.err = TerminalSafeStream(), TerminalSafeStream()
        self.answer_started = self.reasoning_shown = False
        self.err_at_line_start = True
        self.dim = show_thinking and _is_terminal(sys.stderr)

    def feed(self, reasoning: str, answer: str) -> None:
        from .cli import write_out

        if reasoning and self.show_thinking:
            text = self.err.feed(reasoning if self.reasoning_shown else reasoning.lstrip("\n"))
            if text:
                self._write_reasoning(text)
        if answer:
            if not self.answer_started:
                answer = shown_answer(answer)
                if self.reasoning_shown:  # the reasoning ends before the answer starts
                    self.end_reasoning()
            self.answer_started = self.answer_started or bool(answer)
            write_out(self.out.feed(answer), flush=True)

    def _write_reasoning(self, text: str) -> None:
        _write_err(DIM + text + RESET if self.dim else text)
        self.reasoning_shown, self.err_at_line_start = True, text.endswith("\n")

    def end_reasoning(self) -> None:
        """The reasoning is over: what it held back, and the end of its line (the answer goes to another stream,
        but on a terminal both show)."""
        if self.reasoning_shown:
            rest = self.err.flush()
            if rest:
                self._write_reasoning(rest)
            if not self.err_at_line_start:
                _write_err("\n")
            self.reasoning_shown = False

    def finish(self) -> None:
        from .cli import write_out

        self.end_reasoning()
        write_out(self.out.flush() + "\n", flush=True)


def _is_terminal(stream) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (OSError, ValueError):
        return False


def _write_err(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # stderr closed: the answer still goes out
        pass


def encode_prompt(engine, args) -> list[int]:
    if args.raw:
        return engine.encode_raw(args.prompt)
    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    return engine.encode_chat(messages + [{"role": "user", "content": args.prompt}],
                              think=getattr(args, "think", None))


def _run(args, engine, group=None) -> int:
    from engine import DecodeControl, Finished, Started, Tokens

    from .cli import write_out

    settings = settings_from(args)
    prompt = encode_prompt(engine, args)
    # an explicit --max-new-tokens past the context is refused, not clipped (a chat reply is clipped instead)
    engine.check_context(len(prompt), settings.max_new_tokens)
    lead = group is None or group.rank == 0
    streamed = StreamedReply(getattr(args, "show_thinking", False)) if not args.json and lead else None
    reply, finished, fallbacks, noted = ReplyText(), None, [], set()
    for ev in engine.generate(prompt, settings, DecodeControl(settings.depth)):
        if isinstance(ev, Started):
            fallbacks = ev.fallbacks
        elif isinstance(ev, Tokens):
            reasoning, answer = reply.add(ev)
            if streamed is not None:
                streamed.feed(reasoning, answer)
        elif isinstance(ev, Finished):
            finished = ev
        if isinstance(ev, (Started, Finished)) and streamed is not None:  # (before the reply, or after it)
            note(ev.fallbacks, noted)
    if args.json:
        out = {
            "model": engine.info.path,
            "text": "".join(reply.answer),
            "reasoning": "".join(reply.reasoning),
            "prompt_token_ids": prompt,
            "token_ids": reply.ids,
            "sources": reply.sources,
            "parts": reply.parts,
            "finish_reason": finished.reason,
            "stats": finished.stats,
            "fallbacks": [{"feature": f.feature, "reason": f.reason} for f in fallbacks],
            "diagnostics": engine.diagnostics(),
        }
        if group is not None:
            out["diagnostics"]["tensor_parallel"] = {**group.describe(), "shard": group.plan.describe()}
        write_out(json.dumps(out) + "\n", flush=True)
    elif lead:
        streamed.finish()
        ids = reply.ids
        st = finished.stats
        try:
            sys.stderr.write(f"[{len(ids)} tokens, {st['tokens_per_s']:.1f} tok/s, depth {st['depth']}, "
                             f"acceptance {st['acceptance_rate']:.2f}{parts_summary(st)}, finish {finished.reason}]\n")
        except (OSError, ValueError):
            pass
    return 0


def note(fallbacks, noted: set) -> None:
    """Each fallback of this run not noted yet, a line on stderr."""
    for f in fallbacks:
        if f.feature not in MACHINE_FALLBACKS and f.reason not in noted:
            noted.add(f.reason)
            _write_err(f"mtpchat: note: {terminal_safe(f.reason)}\n")


def parts_summary(stats: dict) -> str:
    """', reasoning 312 tokens 41.2 tok/s 0.62, answer ...' when the reply had reasoning, else ''."""
    parts = stats.get("parts") or {}
    if not (parts.get(REASONING) or {}).get("tokens"):
        return ""
    return "".join(f", {name} {p.get('tokens', 0)} tokens {p.get('tokens_per_s', 0.0):.1f} tok/s "
                   f"acceptance {p.get('acceptance_rate', 0.0):.2f}" for name, p in parts.items())

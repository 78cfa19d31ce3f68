"""`mtpchat run`: one prompt, streamed to stdout, or one JSON object with --json.

The streamed text is terminal-safe (escape sequences and control characters in the model's output are removed,
app/safe_text.py); --json is the lossless form (json.dumps escapes every control character)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def add_parser(sub) -> None:
    from .cli import (MAX_DEPTH, MAX_NEW_TOKENS, add_model_args, add_tp_arg, depth, max_new_tokens, seed,
                      temperature, top_k, top_p, utf8_text)

    p = sub.add_parser("run", help="generate a reply to one prompt")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", type=utf8_text, help="the user message (or raw text with --raw)")
    source.add_argument("--prompt-file", metavar="F", help="read the prompt from file F (UTF-8; - for stdin)")
    add_model_args(p)
    p.add_argument("--system", type=utf8_text, help="system prompt")
    p.add_argument("--raw", action="store_true", help="feed the prompt text without the chat template")
    p.add_argument("--max-new-tokens", type=max_new_tokens(1), default=256, metavar="N",
                   help=f"at most N new tokens (1 .. {MAX_NEW_TOKENS:,}, and within the model's context)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--depth", type=depth, default=2,
                   help=f"speculation depth, 0 .. {MAX_DEPTH} (0 = plain decoding)")
    p.add_argument("--temperature", type=temperature, default=0.0)
    p.add_argument("--top-p", type=top_p, default=1.0)
    p.add_argument("--top-k", type=top_k, default=0)
    p.add_argument("--seed", type=seed)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_tp_arg(p)


def settings_from(args):
    from engine import GenerationSettings

    s = GenerationSettings(max_new_tokens=args.max_new_tokens, depth=args.depth, temperature=args.temperature,
                           top_p=args.top_p, top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
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
        if tp > 1 and not under_torchrun() and not args.model:
            args.model = default_model_path()  # every rank loads the same checkpoint
        check_tp_args(args)  # devices, cores, heads: before any worker starts
        return launch_tp(_run_rank, args, tp, args.device)
    return _run(args, load_engine(args.model, args.device, args.dtype))


def _run_rank(args, group) -> int:
    """One rank of `run --tp N` (a spawned worker, or a torchrun process)."""
    from engine import load_engine

    return _run(args, load_engine(args.model, None, args.dtype, tp=group), group)


def check_context(engine, prompt: list[int], n: int) -> None:
    """The prompt and --max-new-tokens must fit the model's context (max_position_embeddings), when it says."""
    from engine import EngineError

    ctx = getattr(engine.trunk.config, "max_position_embeddings", None)
    if isinstance(ctx, int) and ctx > 0 and len(prompt) + n > ctx:
        room = max(ctx - len(prompt), 0)
        raise EngineError(f"--max-new-tokens {n}: with the prompt's {len(prompt)} tokens it exceeds the model's "
                          f"context of {ctx} tokens (at most {room} new tokens here)")


def _run(args, engine, group=None) -> int:
    from engine import DecodeControl, Finished, Started, Tokens

    from .cli import write_out
    from .safe_text import TerminalSafeStream

    settings = settings_from(args)
    if args.raw:
        prompt = engine.encode_raw(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = engine.encode_chat(messages + [{"role": "user", "content": args.prompt}])
    check_context(engine, prompt, settings.max_new_tokens)
    lead = group is None or group.rank == 0
    stream = TerminalSafeStream()
    ids, sources, text, finished, fallbacks = [], [], [], None, []
    for ev in engine.generate(prompt, settings, DecodeControl(settings.depth)):
        if isinstance(ev, Started):
            fallbacks = ev.fallbacks
        elif isinstance(ev, Tokens):
            ids += ev.token_ids
            sources += ev.sources
            text.append(ev.text)
            if not args.json and lead:
                write_out(stream.feed(ev.text), flush=True)
        elif isinstance(ev, Finished):
            finished = ev
    if args.json:
        out = {
            "model": engine.info.path,
            "text": "".join(text),
            "prompt_token_ids": prompt,
            "token_ids": ids,
            "sources": sources,
            "finish_reason": finished.reason,
            "stats": finished.stats,
            "fallbacks": [{"feature": f.feature, "reason": f.reason} for f in fallbacks],
            "diagnostics": engine.diagnostics(),
        }
        if group is not None:
            out["diagnostics"]["tensor_parallel"] = {**group.describe(), "shard": group.plan.describe()}
        write_out(json.dumps(out) + "\n", flush=True)
    elif lead:
        write_out(stream.flush() + "\n", flush=True)
        st = finished.stats
        try:
            sys.stderr.write(f"[{len(ids)} tokens, {st['tokens_per_s']:.1f} tok/s, depth {st['depth']}, "
                             f"acceptance {st['acceptance_rate']:.2f}, finish {finished.reason}]\n")
        except (OSError, ValueError):
            pass
    return 0

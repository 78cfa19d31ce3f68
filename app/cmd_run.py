"""`mtpchat run`: one prompt, streamed to stdout, or one JSON object with --json."""

from __future__ import annotations

import json
import sys



def add_parser(sub) -> None:
    from .cli import add_model_args, add_tp_arg

    p = sub.add_parser("run", help="generate a reply to one prompt")
    p.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    add_model_args(p)
    p.add_argument("--system", help="system prompt")
    p.add_argument("--raw", action="store_true", help="feed the prompt text without the chat template")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--depth", type=int, default=2, help="speculation depth (0 = plain decoding)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_tp_arg(p)


def settings_from(args):
    from engine import GenerationSettings

    s = GenerationSettings(max_new_tokens=args.max_new_tokens, depth=args.depth, temperature=args.temperature,
                           top_p=args.top_p, top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    s.validate()  # before the (slow) model load: a bad flag fails at once
    return s


def run(args) -> int:
    from engine import load_engine
    from engine.tp import launch, under_torchrun

    from .cli import check_model_folder

    settings_from(args)  # a bad flag fails before the slow model load
    check_model_folder(args)

    tp = getattr(args, "tp", 1)
    if tp > 1 or under_torchrun():  # N ranks run the same loop; rank 0 owns the output
        return launch(_run_rank, args, tp, args.device)
    return _run(args, load_engine(args.model, args.device, args.dtype))


def _run_rank(args, group) -> int:
    """One rank of `run --tp N` (a spawned worker, or a torchrun process)."""
    from engine import load_engine

    return _run(args, load_engine(args.model, None, args.dtype, tp=group), group)


def _run(args, engine, group=None) -> int:
    from engine import DecodeControl
    from engine.events import Finished, Started, Tokens

    settings = settings_from(args)
    if args.raw:
        prompt = engine.encode_raw(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = engine.encode_chat(messages + [{"role": "user", "content": args.prompt}])
    ids, sources, text, finished, fallbacks = [], [], [], None, []
    for ev in engine.generate(prompt, settings, DecodeControl(settings.depth)):
        if isinstance(ev, Started):
            fallbacks = ev.fallbacks
        elif isinstance(ev, Tokens):
            ids += ev.token_ids
            sources += ev.sources
            text.append(ev.text)
            if not args.json:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
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
        sys.stdout.write(json.dumps(out) + "\n")
    elif group is None or group.rank == 0:
        sys.stdout.write("\n")
        st = finished.stats
        sys.stderr.write(f"[{len(ids)} tokens, {st['tokens_per_s']:.1f} tok/s, depth {st['depth']}, "
                         f"acceptance {st['acceptance_rate']:.2f}, finish {finished.reason}]\n")
    return 0

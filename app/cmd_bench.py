"""`mtpchat bench`: plain vs speculative decoding, MTP and oracle drafters, and transformers generate(), in one run.

Every row decodes the same prompt for the same number of tokens (EOS ignored), after a warm-up, and reports the
median of --repeat runs, each from an empty state (its prefill included); the rows run in rounds, one run of each
per round, so that a machine's drift over the run falls on them alike. With --prompt-tokens N,N2,... every row
is measured at each prompt length, with prefill tok/s, time to first token and peak memory beside the decode
numbers. Compare ratios within one run, not numbers across machines.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine import Engine

# torch and the engine are imported inside the functions: building the CLI parser must not load torch
# (the chat's first frame waits for it).

HBM_PEAK = {"H200": 4.8e12, "H100": 3.35e12}


REPEAT_MAX = 1000


def add_parser(sub) -> None:
    from .cli import (MAX_DEPTH, add_model_args, add_tp_arg, depth_list, int_in, max_new_tokens,
                      positive_int_list, temperature, top_k, top_p, utf8_text)

    p = sub.add_parser("bench", help="measure decoding speed: plain vs speculative vs transformers")
    add_model_args(p)
    p.add_argument("--random-weights", metavar="PRESET", help="a real shape with random weights "
                   "(qwen3.5-27b, qwen3-next-80b-a3b, tiny)")
    p.add_argument("--layers", type=int_in(1, None), help="with --random-weights: keep only the first N layers")
    p.add_argument("--quant", choices=["bf16", "fp8", "int4"], default="bf16",
                   help="with --random-weights: fp8 quantizes the linears Qwen's FP8 releases quantize (block-128 "
                        "e4m3), int4 the same linears to 4 bits (GPTQ's symmetric grid, groups of 128) (default "
                        "bf16; a checkpoint's format is its own, except with --precision: a 16-bit checkpoint "
                        "against its twin quantized at load)")
    p.add_argument("--depths", type=depth_list, default=[0, 1, 2, 3, 4],
                   help=f"comma-separated speculation depths, each 0 .. {MAX_DEPTH} (default 0,1,2,3,4)")
    p.add_argument("--drafter", default="mtp,oracle",
                   help="mtp, oracle, draft, auto (comma-separated; draft: the --draft-model, added when it is "
                        "given; auto: both, chosen per cycle)")
    p.add_argument("--draft-model", metavar="D", help="a separate draft model of the same tokenizer: its rows beside "
                                                      "the MTP head's and the oracle's; random:qwen3-0.6b or "
                                                      "random:qwen3.5-0.8b: that shape with random weights and the "
                                                      "target's vocabulary (its cost, at acceptance ~0)")
    p.add_argument("--draft-layers", type=int_in(1, None),
                   help="with --draft-model random:PRESET: keep only the draft's first N layers")
    p.add_argument("--acceptance", default="1.0,0.5,0", help="oracle acceptance rates (comma-separated)")
    p.add_argument("--acceptance-profile", metavar="P1,P2,..|changing[;...]",
                   help="also an oracle drafting as real MTP heads do: draft position i accepted with probability "
                        "Pi given position i-1 was (e.g. 0.92,0.84,0.65,0.54); 'changing': an easy profile for "
                        f"the first half of the reply, a hard one after ({CHANGING}); several profiles separated "
                        "by ';' are rows of one run (one model load)")
    p.add_argument("--max-new-tokens", type=max_new_tokens(2), default=128)
    p.add_argument("--prompt", type=utf8_text, default="Write a short story about a lighthouse keeper.")
    p.add_argument("--prompt-tokens", type=positive_int_list, metavar="N[,N...]",
                   help="instead of --prompt: prompts of exactly N tokens, every row at each length (random "
                        "weights: synthetic ids; a model: a long text it is asked to summarise). Adds prefill "
                        "tok/s, time to first token and peak memory per length")
    p.add_argument("--repeat", type=int_in(1, REPEAT_MAX), default=3)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers generate() baseline")
    p.add_argument("--no-graphs", action="store_true", help="eager verify steps only (no CUDA graphs)")
    p.add_argument("--temperature", type=temperature, default=0.0,
                   help="sample (speculative sampling) instead of greedy")
    p.add_argument("--top-p", type=top_p, default=1.0)
    p.add_argument("--top-k", type=top_k, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="also write the JSON result to this file (checked first; rewritten after every "
                                 "measured row, so a run that fails late keeps what it measured)")
    p.add_argument("--precision", action="store_true",
                   help="instead of speed: speculative vs plain greedy agreement in float32 and bfloat16 over a "
                        "prompt set (share identical, first divergence position)")
    add_tp_arg(p)


EASY, HARD = [0.95, 0.9, 0.85, 0.8], [0.3, 0.1, 0.05, 0.0]
CHANGING = f"{','.join(map(str, EASY))} then {','.join(map(str, HARD))}"


def acceptance_profiles(args, n: int) -> list[tuple[str, dict]]:
    """(label, OracleDrafter keyword arguments) of each --acceptance-profile (';'-separated). n: the reply's
    length."""
    from engine import EngineError

    out = []
    for text in args.acceptance_profile.split(";") if args.acceptance_profile else []:
        if text.strip() == "changing":
            out.append(("oracle@changing", {"profile": EASY, "later": (n // 2, HARD)}))
            continue
        values = _floats(text, "--acceptance-profile")
        if not values:
            raise EngineError(f"--acceptance-profile {text!r}: expected comma-separated rates or 'changing'")
        out.append((f"oracle@{'/'.join(f'{v:g}' for v in values)}", {"profile": values}))
    return out


def _floats(text: str, flag: str) -> list[float]:
    from engine import EngineError

    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise EngineError(f"{flag} {text!r}: expected comma-separated numbers") from None
    if any(not 0 <= v <= 1 for v in vals):
        raise EngineError(f"{flag} {text!r}: rates must be between 0 and 1")
    return vals


def _sync(dev):
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


ONCE_PER_REQUEST = ("prefill", "priming")  # phases that do not recur each cycle: reported whole, not per cycle


@dataclass
class Plan:
    """A row to measure: its depth and drafter label, and make(reference) -> the drafter for one run (None:
    the engine's default), given the plain row's tokens of the same round (an oracle replays them)."""
    depth: object
    drafter: str
    make: Callable | None = None


def measure(engine: Engine, prompt, plans: list[Plan], n: int, repeat: int, sampling=None) -> list[dict]:
    """The plans' rows, measured in rounds: repeat + 1 rounds (the first warms up: allocations, autotuning) of
    one run of every row, each a request from scratch (no state reused from the run before: its prefill is
    measured too). Rounds, not one row after another, because a machine's speed drifts over the minutes a bench
    takes (on a shared 2-core CPU rows minutes apart moved 20-40%): in rounds the drift falls on every row alike
    and their ratios keep. The first plan is the plain row: every run's text is checked against its run of the
    same round (the same seed). Speeds, prefill and time to first token are the runs' medians."""
    from engine import Finished, GenerationSettings, Tokens

    dev = engine.trunk.device
    runs: list[list[tuple[dict, list[int]]]] = [[] for _ in plans]
    memory = [{} for _ in plans]
    same = [True] * len(plans)
    for i in range(repeat + 1):
        reference = None
        for j, plan in enumerate(plans):
            settings = GenerationSettings(max_new_tokens=n, depth=plan.depth, ignore_eos=True, **(sampling or {}),
                                          seed=i, reuse=False)
            drafter = plan.make(reference) if plan.make else None
            before = start_peak_memory(dev)
            tokens, fin = [], None
            for ev in engine.generate(prompt, settings, drafter=drafter):
                if isinstance(ev, Tokens):
                    tokens += ev.token_ids
                elif isinstance(ev, Finished):
                    fin = ev
            memory[j] = add_peak_memory(memory[j], peak_memory(dev, before))
            if j == 0:
                reference = tokens
            same[j] = same[j] and tokens == reference
            if i:
                runs[j].append((fin.stats, tokens))
    return [summary(prompt, r, mem, ok) for r, mem, ok in zip(runs, memory, same)]


def summary(prompt, runs: list[tuple[dict, list[int]]], memory: dict, same: bool) -> dict:
    """One row from its runs' stats and texts: medians of the speeds, the last run's acceptance, phases, text."""
    stats = [s for s, _ in runs]
    last = stats[-1]
    prefill_ms = statistics.median(s["phase_ms"].get("prefill", 0.0) for s in stats)
    return {"prompt_tokens": len(prompt), "tokens_per_s": statistics.median(s["tokens_per_s"] for s in stats),
            "runs_tokens_per_s": [s["tokens_per_s"] for s in stats],  # round by round (paired ratios between rows)
            "acceptance_rate": last["acceptance_rate"],
            "mean_accepted_length": last["mean_accepted_length"],
            "per_position_acceptance": last["per_position_acceptance"],
            "phase_ms": {k: v / max(last["cycles"], 1) for k, v in last["phase_ms"].items()
                         if k not in ONCE_PER_REQUEST},
            "phase_ms_total": last["phase_ms"], "cycles": last["cycles"],
            "prefilled_tokens": last["prefilled_tokens"], "prefill_ms": prefill_ms,
            "prefill_tokens_per_s": last["prefilled_tokens"] / (prefill_ms / 1e3) if prefill_ms else None,
            "ttft_ms": statistics.median(s["ttft_ms"] for s in stats),
            # the MTP head over the whole prompt, once per request: its attention cost at this context
            "priming_ms": last["phase_ms"].get("priming"),
            **({"auto_depths": last["auto_depths"]} if last.get("auto_depths") else {}),  # --depth auto's picks
            **memory, "same_text": same, "tokens": runs[-1][1]}


def add_peak_memory(row: dict, run: dict) -> dict:
    """A row's peak memory over its runs: the highest peak, and (on the CPU) the growth each of its runs caused."""
    if not row:
        return run
    out = {**row, "peak_memory_bytes": max(row["peak_memory_bytes"], run["peak_memory_bytes"])}
    if "peak_rss_growth_bytes" in run:
        out["peak_rss_growth_bytes"] = row["peak_rss_growth_bytes"] + run["peak_rss_growth_bytes"]
    return out


def start_peak_memory(dev) -> int:
    """Before a row: CUDA's peak counter is reset; on the CPU the process's peak RSS so far is noted (the kernel's
    high-water mark cannot be reset)."""
    import torch

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        return 0
    return _max_rss_bytes()


def peak_memory(dev, before: int) -> dict:
    """After a row: on CUDA the most memory torch allocated during it; on the CPU the process's peak RSS and how
    far this row raised it (0 when it stayed under an earlier row's peak)."""
    import torch

    if dev.type == "cuda":
        return {"peak_memory_bytes": torch.cuda.max_memory_allocated(dev), "peak_memory_of": "cuda max allocated"}
    peak = _max_rss_bytes()
    return {"peak_memory_bytes": peak, "peak_memory_of": "process max rss", "peak_rss_growth_bytes": peak - before}


def loaded_memory(dev) -> dict:
    """Right after the load, before any prompt: what the model holds (on CUDA torch's allocated bytes: the weights,
    which the rows' peak_memory_bytes add their caches and activations to); on the CPU the process's peak RSS so far,
    the measure the rows' peaks use there."""
    import torch

    if dev.type == "cuda":
        return {"loaded_memory_bytes": torch.cuda.memory_allocated(dev), "loaded_memory_of": "cuda allocated"}
    return {"loaded_memory_bytes": _max_rss_bytes(), "loaded_memory_of": "process max rss"}


def _max_rss_bytes() -> int:
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # (bytes on macOS, kilobytes on Linux)


DEFAULT_SYNTHETIC_TOKENS = 32
SUMMARISE = "Summarise the following text in a few sentences.\n\n"


def synthetic_ids(n: int, vocab: int) -> list[int]:
    """n prompt ids for random weights: 1, 2, 3, ... wrapping inside the vocabulary (0 left out: a pad id)."""
    return [1 + i % (vocab - 1) for i in range(n)]


def template_tail(engine: Engine) -> int:
    """How many tokens the chat template puts after a user message's content (end of turn, the assistant's
    start): the common suffix of two one-message chats."""
    a, b = (engine.encode_chat([{"role": "user", "content": c}]) for c in ("1", "2"))
    tail = 0
    while tail < min(len(a), len(b)) and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    return tail


def long_text_prompt(engine: Engine, n: int) -> tuple[list[int], int]:
    """(exactly n ids, copies of the text used): the chat template around a user message asking to summarise
    app/bench_text.py's prose, repeated as often as n needs, cut inside the text so that the template's ending
    stays (the model answers, as it would after a long paste)."""
    from .bench_text import TEXT

    tail = template_tail(engine)
    copies = max(1, -(-n // len(engine.encode_raw(TEXT))))
    while True:
        ids = engine.encode_chat([{"role": "user", "content": SUMMARISE + "\n\n".join([TEXT] * copies)}])
        if len(ids) >= n:
            break
        copies += 1
    keep = max(n - tail, 0)
    return ids[:keep] + ids[len(ids) - (n - keep):], copies


def context_limit(engine: Engine) -> int | None:
    """The most positions a request may use: the engine's own limit (the model's, capped by --max-context) where
    it has one, else the config's max_position_embeddings; None when neither says."""
    limit = getattr(engine, "context_limit", None)
    if not isinstance(limit, int):
        limit = getattr(engine.trunk.config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def check_prompt_lengths(lengths: list[int], n: int, limit: int | None) -> None:
    """Every --prompt-tokens length plus --max-new-tokens fits the model's context, before anything is measured."""
    from engine import EngineError

    too_long = [x for x in lengths if limit is not None and x + n > limit]
    if too_long:
        raise EngineError(f"--prompt-tokens {too_long[0]}: with --max-new-tokens {n} it exceeds the context of "
                          f"{limit} tokens (at most {max(limit - n, 0)} prompt tokens here)")


def bench_prompts(engine: Engine, args) -> list[tuple[list[int], dict]]:
    """The prompts every row is measured on, each with what it is (for the JSON): --prompt (a model) or 32
    synthetic ids (random weights), or one per --prompt-tokens length."""
    vocab = engine.trunk.config.vocab_size
    if not args.prompt_tokens:
        if args.random_weights:
            return [(synthetic_ids(DEFAULT_SYNTHETIC_TOKENS, vocab), {"source": "synthetic ids"})]
        return [(engine.encode_chat([{"role": "user", "content": args.prompt}]), {"source": "--prompt"})]
    check_prompt_lengths(args.prompt_tokens, args.max_new_tokens, context_limit(engine))
    if args.random_weights:
        return [(synthetic_ids(n, vocab), {"source": "synthetic ids", "tokens": n}) for n in args.prompt_tokens]
    prompts = []
    for n in args.prompt_tokens:
        ids, copies = long_text_prompt(engine, n)
        prompts.append((ids, {"source": "app/bench_text.py, asked to summarise through the chat template",
                              "tokens": n, "text_copies": copies}))
    return prompts


def collective_share(engine: Engine, prompt, n: int) -> dict:
    """Under tensor parallelism: the share of this rank's GPU kernel time spent in NCCL kernels while decoding
    plainly, after the first token (the prompt's prefill is not profiled; the profiler sees the kernels inside
    graph replays too). A collective's time includes waiting for the slower rank."""
    import torch

    from engine import GenerationSettings, Tokens

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    seen = 0
    for ev in engine.generate(prompt, GenerationSettings(max_new_tokens=n + 1, ignore_eos=True, reuse=False)):
        if isinstance(ev, Tokens):
            if not seen:  # the first token ends the prefill: decoding from here on
                torch.cuda.synchronize()
                prof.start()
            seen += len(ev.token_ids)
    torch.cuda.synchronize()
    prof.stop()
    n = seen - 1
    total = nccl = 0.0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total += ev.device_time_total
            nccl += ev.device_time_total if "nccl" in ev.name.lower() else 0.0
    return {"tokens": n, "kernel_ms_per_token": total / 1e3 / n, "collective_ms_per_token": nccl / 1e3 / n,
            "collective_share": nccl / total if total else None}


def commit_refresh_share(row: dict) -> float | None:
    """The speculative transaction's own cost, commit (GDN replay) + the MTP head's refresh, as a share of a
    cycle's time; None for plain rows."""
    if not row["depth"] or not row["tokens_per_s"]:
        return None
    cycle_ms = 1e3 * row["mean_accepted_length"] / row["tokens_per_s"]
    return (row["phase_ms"].get("commit", 0.0) + row["phase_ms"].get("refresh", 0.0)) / cycle_ms


def hf_generate(engine: Engine, prompt, n: int, repeat: int) -> list[float]:
    """transformers' generate() on the engine's own model and prompt: tokens/s of each warm run ([] when it
    cannot run). Its speed is the host's (a Python loop over the layers), so the runs are all kept."""
    import torch

    from engine import stock_forward

    from .cli import one_line, print_line

    lm, dev = engine.trunk.lm, engine.trunk.device
    ids = torch.tensor([prompt], device=dev)
    times = []
    try:
        with torch.inference_mode(), stock_forward(lm.modules()):  # transformers' own norms, not our kernel
            for i in range(repeat + 1):
                _sync(dev)
                t0 = time.perf_counter()
                lm.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
                _sync(dev)
                if i:
                    times.append(time.perf_counter() - t0)
    except Exception as e:  # a baseline that cannot run is reported, not fatal
        print_line(f"transformers generate() baseline failed: {one_line(e)[:200]}")
        return []
    return [n / t for t in times]


def run(args) -> int:
    from engine import default_model_path, launch_tp, under_torchrun

    from .cli import check_tp_args

    _check_args(args)
    if args.precision:
        return precision_report(args)
    tp = getattr(args, "tp", 1)
    if tp > 1 or under_torchrun():  # N ranks run the same measurements; rank 0 reports
        if tp > 1 and not under_torchrun() and not args.model and not args.random_weights:
            args.model = default_model_path()  # every rank measures the same checkpoint
        check_tp_args(args, args.random_weights, args.layers)  # devices, cores, heads: before any worker starts
        return launch_tp(_bench_rank, args, tp, args.device)
    return _bench(args)


PRECISION_PROMPTS = ["Write a short story about a lighthouse keeper.", "What is a list in Python?",
                     "Explain the word river.", "Tell me about the sea.", "Who wrote Hamlet?",
                     "How do I open a file?", "Describe a winter morning.", "What is the capital of France?"]


def precision_report(args) -> int:
    """Greedy speculative vs plain output per dtype: float32 must agree exactly; bfloat16 verify passes of
    several tokens round differently from one-token steps, and this measures how often that changes the text.
    With --quant and a 16-bit --model, the model is also quantized at load as the quantized releases are, and its
    twin's plain text and MTP acceptance are set beside the checkpoint's (vLLM saw MTP acceptance collapse on FP8
    weights: this measures it)."""
    from engine import Cycle, Engine, GenerationSettings, OracleDrafter, Tokens, load_engine, random_model

    depth = max(spec_depths(args.depths, expand=True) or [0])

    def decode(engine, prompt, d, drafter=None) -> tuple[list[int], int, int]:
        """(tokens, drafted, accepted)"""
        s = GenerationSettings(max_new_tokens=args.max_new_tokens, depth=d, ignore_eos=True, reuse=False)
        tokens, drafted, accepted = [], 0, 0
        for e in engine.generate(prompt, s, drafter=drafter):
            tokens += e.token_ids if isinstance(e, Tokens) else []
            drafted += e.drafted if isinstance(e, Cycle) else 0
            accepted += e.accepted if isinstance(e, Cycle) else 0
        return tokens, drafted, accepted

    def build(dtype: str, quant: str):
        if args.random_weights:
            return Engine(random_model(args.random_weights, args.layers, args.device, dtype, quant=quant), None,
                          set(), **flags)
        return load_engine(args.model, args.device, dtype, quantize=None if quant == "bf16" else quant, **flags)

    def prompts(engine) -> list[list[int]]:
        if args.random_weights:
            return [[(7 * i + j) % 1000 + 1 for j in range(32)] for i in range(len(PRECISION_PROMPTS))]
        return [engine.encode_chat([{"role": "user", "content": q}]) for q in PRECISION_PROMPTS]

    def runs(engine) -> dict:
        """Per prompt: plain tokens, then each drafter's run at `depth` against them."""
        rows, plains = [], []
        for prompt in prompts(engine):
            plain = decode(engine, prompt, 0)[0]
            plains.append(plain)
            drafters = {"oracle@1": OracleDrafter(plain, len(prompt), 0.0, engine.trunk.config.vocab_size)}
            if engine.mtp_drafter is not None:
                drafters["mtp"] = None
            for name, drafter in drafters.items():
                spec, drafted, accepted = decode(engine, prompt, depth, drafter)
                first = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
                rows.append({"drafter": name, "identical": spec == plain, "first_divergence": first,
                             "drafted": drafted, "accepted": accepted})
        mtp = [r for r in rows if r["drafter"] == "mtp"]
        drafted = sum(r["drafted"] for r in mtp)
        return {"rows": rows, "plain": plains,
                "mtp_acceptance": sum(r["accepted"] for r in mtp) / drafted if drafted else None}

    twin = args.quant != "bf16" and not args.random_weights  # (random builds differ between formats)
    report, flags = {}, _engine_flags(args)
    head = {"model": args.random_weights or args.model, "device": args.device, "depth": depth, "quant": args.quant,
            "compiled": bool(args.compile), "max_new_tokens": args.max_new_tokens, "command": command_line(args)}
    for dtype in ("float32", "bfloat16"):
        checkpoint = None
        if twin:  # the checkpoint as it is first, freed before its quantized twin loads
            engine = build(dtype, "bf16")
            checkpoint = runs(engine)
            del engine
        engine = build(dtype, args.quant)
        measured = runs(engine)
        del engine
        rows = measured["rows"]
        diverged = [r["first_divergence"] for r in rows if not r["identical"]]
        report[dtype] = {"runs": len(rows), "identical_share": sum(r["identical"] for r in rows) / len(rows),
                         "first_divergence": diverged, "mtp_acceptance": measured["mtp_acceptance"], "rows": rows}
        if checkpoint is not None:
            pairs = list(zip(checkpoint["plain"], measured["plain"]))
            firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in pairs]
            report[dtype]["vs_checkpoint"] = {
                "plain_identical_share": sum(x == y for x, y in pairs) / len(pairs),
                "first_divergence": [f for f in firsts if f is not None],
                "mtp_acceptance": checkpoint["mtp_acceptance"],
                "speculative_identical_share": sum(r["identical"] for r in checkpoint["rows"])
                / len(checkpoint["rows"])}
        if args.out:  # what is measured so far survives a failure of the next dtype
            write_json(args.out, {**head, "complete": False, "precision": report})
    result = {**head, "complete": True, "precision": report}
    return emit(result, args, "\n".join(_precision_lines(dtype, r, depth, args.quant) for dtype, r in report.items()))


def _precision_lines(dtype: str, r: dict, depth: int, quant: str) -> str:
    def share(x):
        return f"{100 * x:.0f}%"

    def rate(x):
        return "-" if x is None else f"{x:.2f}"

    line = (f"{dtype:>9}: {share(r['identical_share'])} of {r['runs']} speculative runs (depth {depth}) identical to "
            f"plain; first divergence at {r['first_divergence'] or '-'}; MTP acceptance {rate(r['mtp_acceptance'])}")
    twin = r.get("vs_checkpoint")
    if twin:
        line += (f"\n{'':>9}  {quant} plain text identical to the checkpoint's in "
                 f"{share(twin['plain_identical_share'])} of prompts (first divergence at "
                 f"{twin['first_divergence'] or '-'}); MTP acceptance {rate(r['mtp_acceptance'])} against the "
                 f"checkpoint's {rate(twin['mtp_acceptance'])}")
    return line


def command_line(args) -> str:
    return shlex.join(["mtpchat", *getattr(args, "argv", sys.argv[1:])])


def check_out(path: str | None) -> None:
    """--out is checked before anything is measured: a file name in a folder that exists and can be written."""
    from engine import EngineError

    if not path:
        return
    p = Path(path).expanduser()
    if p.is_dir():
        raise EngineError(f"--out {path}: is a folder; give a file name")
    parent = p.parent
    if not parent.exists():
        raise EngineError(f"--out {path}: folder {parent} does not exist")
    if not parent.is_dir():
        raise EngineError(f"--out {path}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise EngineError(f"--out {path}: not writable")


def write_json(path: str, result: dict) -> None:
    """Write (or rewrite) --out whole: into a temporary file beside it, then renamed over it (never half a file)."""
    from engine import EngineError

    p = Path(path).expanduser()
    tmp = p.with_name(f".{p.name}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(result, f, indent=2)
        os.replace(tmp, p)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise EngineError(f"--out {path}: {e.strerror or e}") from None


def emit(result: dict, args, text: str) -> int:
    """--out FILE gets the JSON; stdout gets the JSON (--json) or the human-readable text (terminal-safe: the
    model path is a folder name)."""
    from .cli import write_out
    from .safe_text import terminal_safe

    if args.out:
        write_json(args.out, result)
    write_out((json.dumps(result) if args.json else terminal_safe(text)) + "\n")
    return 0


def _bench_rank(args, group) -> int:
    """One rank of `bench --tp N`: the same rows as rank 0, on its shard."""
    return _bench(args, group)


def _engine_flags(args) -> dict:
    return {"cuda_graphs": False if args.no_graphs else None, "compile": args.compile or None,
            "max_context": getattr(args, "max_context", None)}


def _engine(args, group=None) -> Engine:
    """What bench measures: a checkpoint, or random weights in a preset's shape; under --tp this rank's shard
    (CUDA graphs as on one GPU: the collectives are captured inside them)."""
    from engine import RANDOM_DRAFT, Engine, load_engine, random_draft, random_model

    flags = _engine_flags(args)
    device = None if group else args.device  # under --tp each rank's device is the group's
    is_random_draft = (args.draft_model or "").startswith(RANDOM_DRAFT)
    if not args.random_weights:
        engine = load_engine(args.model, device, args.dtype, tp=group,
                             draft_model=None if is_random_draft else args.draft_model, **flags)
    else:
        engine = Engine(random_model(args.random_weights, args.layers, device, args.dtype, group=group,
                                     quant=args.quant), None, set(), **flags)
        if args.draft_model and not is_random_draft:
            engine.attach_draft(args.draft_model)
    if is_random_draft:
        engine.draft_drafter = random_draft(args.draft_model, engine, args.draft_layers)
        engine.attach_draft(None)  # (with an MTP head: both, for --drafter auto)
    return engine


def spec_depths(depths: list, expand: bool = False) -> list:
    """The speculative entries of --depths (auto included); expand: auto as the depths it may pick."""
    from engine import AUTO, AUTO_MAX_DEPTH

    out = [d for d in depths if d == AUTO or d > 0]
    if expand and AUTO in out:
        out = sorted({d for d in out if d != AUTO} | set(range(1, AUTO_MAX_DEPTH + 1)))
    return out


def _drafters(args) -> list[str]:
    out = [d.strip() for d in args.drafter.split(",") if d.strip()]
    return out + ["draft"] if getattr(args, "draft_model", None) and "draft" not in out else out


def _check_args(args) -> None:
    """Every flag, before anything slow (the model load, the workers, the measurements)."""
    from engine import DRAFT_PRESETS, PRESETS, RANDOM_DRAFT, EngineError

    from .cli import check_model_folder

    _floats(args.acceptance, "--acceptance")
    acceptance_profiles(args, args.max_new_tokens)
    if any(d not in ("mtp", "oracle", "draft", "auto") for d in _drafters(args)):
        raise EngineError(f"--drafter {args.drafter!r}: expected mtp, oracle, draft, auto (comma-separated)")
    for d in ("draft", "auto"):
        if d in _drafters(args) and not args.draft_model:
            raise EngineError(f"--drafter {d}: no draft model (pass --draft-model D)")
    if args.draft_model and args.tp and args.tp > 1:
        raise EngineError("--draft-model with --tp: not with tensor parallelism yet")
    if args.draft_model and args.draft_model.startswith(RANDOM_DRAFT):
        if args.draft_model[len(RANDOM_DRAFT):] not in DRAFT_PRESETS:
            raise EngineError(f"--draft-model {args.draft_model!r}: random draft presets are "
                              f"{', '.join(RANDOM_DRAFT + d for d in DRAFT_PRESETS)}")
    elif args.draft_layers:
        raise EngineError("--draft-layers: only with --draft-model random:PRESET (a checkpoint's layers are its own)")
    if args.model and args.random_weights:
        raise EngineError("--model and --random-weights: give one or the other")
    if args.quant != "bf16" and not args.random_weights and not args.precision:
        raise EngineError(f"--quant {args.quant}: only with --random-weights or --precision (a checkpoint's format "
                          f"is its own)")
    if args.quant == "fp8" and args.tp and args.tp > 1:  # (int4: each rank quantizes its own shard)
        raise EngineError("--quant fp8 with --tp: FP8 under tensor parallelism is not supported yet")
    if args.random_weights and args.random_weights not in PRESETS:
        raise EngineError(f"--random-weights {args.random_weights!r}: presets are {', '.join(PRESETS)}")
    check_model_folder(args)
    if args.random_weights and args.prompt_tokens:  # a preset's context is known before its (slow) build
        limits = [x for x in (PRESETS[args.random_weights][1].get("max_position_embeddings"),
                              getattr(args, "max_context", None)) if x]
        check_prompt_lengths(args.prompt_tokens, args.max_new_tokens, min(limits, default=None))
    check_out(args.out)


def load_to_ready(args, group=None) -> tuple[Engine, dict]:
    """The engine, and what a chat waits for before its first reply: the load, then on CUDA the warm-up (kernel
    compilation and autotuning, the CUDA graphs of --depths) that the chat runs at load. Under --tp every rank
    warms up (each runs the same steps: their collectives match)."""
    t0 = time.perf_counter()
    engine = _engine(args, group)
    ready = {"load_s": time.perf_counter() - t0, "warm_up_s": None, **loaded_memory(engine.trunk.device)}
    if engine.trunk.device.type == "cuda":
        ready["warm_up_s"] = engine.warm_up(depths=[0, *spec_depths(args.depths, expand=True)])["seconds"]
    return engine, ready


def ready_line(res: dict) -> str:
    load, warm = res["load_s"], res["warm_up_s"]
    if warm is None:
        return f"load {load:.1f} s (no warm-up on the CPU)"
    return f"load {load:.1f} s, warm-up {warm:.1f} s (kernels, CUDA graphs): ready in {load + warm:.1f} s"


def _bench(args, group=None) -> int:
    import torch

    from engine import nvidia_driver, versions, weight_bytes_per_token

    from .cli import print_line

    engine, ready = load_to_ready(args, group)
    prompts = bench_prompts(engine, args)
    n, trunk = args.max_new_tokens, engine.trunk
    if "mtp" in _drafters(args) and engine.mtp_drafter is None and (group is None or group.rank == 0):
        print_line(f"{engine.info.name} has no usable MTP head: no mtp rows")
    rows = []
    lead = group is None or group.rank == 0
    head = {"model": engine.info.path, "params": engine.info.params, "device": str(trunk.device),
            "dtype": engine.info.dtype, "max_new_tokens": n, "repeat": args.repeat,
            "prompts": [about for _, about in prompts], **ready, "command": command_line(args)}

    def add(row: dict) -> None:
        """A measured row: --out is rewritten with every row so far (a failure at a later prompt keeps them)."""
        rows.append(row)
        if args.out and lead:
            write_json(args.out, {**head, "complete": False, "results": rows})

    plains = [prompt_rows(engine, args, prompt, add, with_modes=i == 0) for i, (prompt, _) in enumerate(prompts)]
    plain, first = plains[0], prompts[0][0]  # the first prompt's plain row: what the baselines below compare with

    # transformers' generate() cannot run one shard of a tensor-parallel model: no baseline under --tp
    hf_runs = [] if args.no_hf or group is not None else hf_generate(engine, first, n, args.repeat)
    hf = statistics.median(hf_runs) if hf_runs else None
    wbytes = weight_bytes_per_token(trunk)
    gpu = torch.cuda.get_device_name(trunk.device) if trunk.device.type == "cuda" else None
    peak = next((v for k, v in HBM_PEAK.items() if gpu and k in gpu), None)
    bw = wbytes * plain["tokens_per_s"]
    result = {
        **head, "gpu": gpu, "complete": True,
        "results": rows,
        "hf_generate_tokens_per_s": hf,
        "hf_generate_runs_tokens_per_s": hf_runs,
        "hf_generate_prompt_tokens": len(first) if hf_runs else None,
        "plain_vs_hf": plain["tokens_per_s"] / hf if hf else None,
        "weight_bytes_per_token": wbytes,
        "plain_bandwidth_bytes_per_s": bw,
        "hbm_peak_bytes_per_s": peak,
        "plain_fraction_of_hbm_peak": bw / peak if peak else None,
        "backends": {op: b for op, (b, _) in trunk.backends.choice.items()},
        "cuda_graphs": engine.graph_runner.report() if engine.graph_runner else None,
    }
    result["versions"] = {**versions(), "nvidia_driver": nvidia_driver()}
    if group is not None:  # params, weight bytes and bandwidth above are per rank (rank 0's shard)
        result["tensor_parallel"] = {**group.describe(), "shard": group.plan.describe()}
        if trunk.device.type == "cuda":
            result["tensor_parallel"]["profile"] = collective_share(engine, first, min(n, 32))
        if group.rank != 0:
            return 0
    return emit(result, args, format_table(result))


def prompt_rows(engine: Engine, args, prompt: list[int], add, with_modes: bool) -> dict:
    """Every row of one prompt, each passed to add(): plain, then each depth with each drafter; with_modes
    (the first prompt only: what graphs and compilation buy does not depend on the prompt's length) also the
    plain decode without graph replay and without compilation. Returns the plain row."""
    from engine import OracleDrafter

    n, trunk, runner = args.max_new_tokens, engine.trunk, engine.graph_runner
    rates, drafters = _floats(args.acceptance, "--acceptance"), _drafters(args)  # checked by _check_args
    # sampled rows use seed = run index: every depth samples with the same seeds (texts differ across depths:
    # the random stream is consumed per cycle; the distribution does not)
    sampling = ({"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
                if args.temperature > 0 else None)
    compiled = runner is not None and trunk.compiled_block is not None
    mode = ("graphs+compile" if compiled else "graphs") if runner else "eager"

    def rows_of(plans: list[Plan], mode: str) -> list[dict]:
        return [{"depth": p.depth, "drafter": p.drafter, "mode": mode, **r}
                for p, r in zip(plans, measure(engine, prompt, plans, n, args.repeat, sampling))]

    rows = []
    if runner and with_modes:  # the same plain decode without graph replay (and without compilation)
        trunk.graphs = None
        rows += rows_of([Plan(0, "none")], "eager")
        trunk.graphs = runner
        if compiled:
            block, trunk.compiled_block = trunk.compiled_block, None
            runner.reset()
            rows += rows_of([Plan(0, "none")], "graphs")
            trunk.compiled_block = block
            runner.reset()
    plans = [Plan(0, "none")]
    profiles = acceptance_profiles(args, n)
    for depth in spec_depths(args.depths):
        if "mtp" in drafters and engine.mtp_drafter is not None:
            plans.append(Plan(depth, "mtp", lambda _: engine.mtp_drafter))
        if "draft" in drafters and engine.draft_drafter is not None:  # (its "draft" phase: its share of a cycle)
            plans.append(Plan(depth, engine.draft_drafter.name, lambda _: engine.draft_drafter))
        if "oracle" in drafters:
            # (one seed for every depth: the rows' draws are common random numbers, see OracleDrafter.correct)
            for rate in rates:
                plans.append(Plan(depth, f"oracle@{rate:g}", lambda ref, rate=rate: OracleDrafter(
                    ref, len(prompt), 1.0 - rate, trunk.config.vocab_size)))
            for label, kwargs in profiles:
                plans.append(Plan(depth, label, lambda ref, kwargs=kwargs: OracleDrafter(
                    ref, len(prompt), 0.0, trunk.config.vocab_size, **kwargs)))
        if "auto" in drafters and engine.auto_drafter is not None:  # (its estimates carry over from run to run)
            plans.append(Plan(depth, engine.auto_drafter.name, lambda _: engine.auto_drafter))
    rows += rows_of(plans, mode)
    plain = rows[-len(plans)]
    reference = plain["tokens"]
    for r in rows:  # (the rows of other modes are checked against the plain row's last run)
        same = r.pop("same_text") & (r.pop("tokens") == reference)
        r["identical_to_plain"] = same if sampling is None else None  # sampled texts differ by design
        r["speedup"] = r["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else None
        r["commit_refresh_share"] = commit_refresh_share(r)
        if r["drafter"].startswith("draft:"):
            r["draft_cost"] = draft_cost(r, plain)
        add(r)
    return plain


def break_even_acceptance(k: int, cycle_ms: float, plain_step_ms: float) -> float | None:
    """The per-position acceptance a at which a depth-k cycle (expected tokens (1 - a^(k+1)) / (1 - a), i.e.
    1 + a + ... + a^k) of cycle_ms matches plain decoding's rate, 1 / plain_step_ms: 0 when a cycle costs no
    more than a plain step, None when even a = 1 (k + 1 tokens a cycle) loses. Bisection: the expected tokens
    grow with a."""
    from engine import expected_tokens

    need = cycle_ms / plain_step_ms  # tokens a cycle must commit to break even
    if need <= 1.0:
        return 0.0
    if need > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens([mid] * k, k) < need else (lo, mid)
    return (lo + hi) / 2


def draft_cost(r: dict, plain: dict) -> dict | None:
    """A draft model's row (random weights draft at acceptance ~0, so its speed says little): its time per cycle
    and share of the cycle (phase "draft" against the rest, "verify" first), a draft step against the target's
    plain step, and the break-even acceptance. A cycle's wall time comes from the row's own rate (tokens per
    cycle / tokens per second: every phase, the host's too), as plain's step does from plain's."""
    k, ph = r["depth"], r["phase_ms"]
    if not isinstance(k, int) or not k or not r["tokens_per_s"] or not plain["tokens_per_s"]:
        return None  # (--depth auto: no one k to solve for)
    cycle_ms = 1e3 * r["mean_accepted_length"] / r["tokens_per_s"]
    plain_step = 1e3 / plain["tokens_per_s"]
    draft_ms = ph.get("draft", 0.0)
    step = draft_ms / k
    # cycle = k draft steps + verify_k (the verify pass and the accept / commit around it)
    return {"draft_ms_per_cycle": draft_ms, "verify_ms_per_cycle": ph.get("verify", 0.0), "cycle_ms": cycle_ms,
            "draft_share_of_cycle": draft_ms / cycle_ms if cycle_ms else None, "draft_step_ms": step,
            "plain_step_ms": plain_step, "draft_step_vs_plain_step": step / plain_step,
            "break_even_acceptance": break_even_acceptance(k, cycle_ms, plain_step)}


def format_table(res: dict) -> str:
    rows = res["results"]
    memory = rows[0]["peak_memory_of"] if rows else ""
    lines = [f"model {res['model']}  device {res['device']} {res['gpu'] or ''}  dtype {res['dtype']}  "
             f"{res['max_new_tokens']} tokens x {res['repeat']}  peak MB: {memory}",
             f"{'prompt':>7} {'depth':>5} {'drafter':<12} {'mode':<6} {'prefill/s':>9} {'TTFT ms':>8} {'tok/s':>9} "
             f"{'speedup':>8} {'accept':>7} {'mean len':>8} {'same':>5} {'peak MB':>8}  "
             f"per-position acceptance / ms per cycle / MTP head's priming"]
    lines.insert(1, ready_line(res))
    for r in rows:
        pos = " ".join(f"{a:.2f}" for a in r["per_position_acceptance"])
        ph = " ".join(f"{k}={v:.2f}" for k, v in sorted(r["phase_ms"].items()))
        if r.get("commit_refresh_share") is not None:
            ph += f"  commit+refresh {100 * r['commit_refresh_share']:.0f}% of the cycle"
        if r.get("priming_ms"):
            ph += f"  priming {r['priming_ms']:.1f} ms"
        cost = r.get("draft_cost")
        if cost:
            even = cost["break_even_acceptance"]
            ph += (f"  draft {cost['draft_ms_per_cycle']:.2f} ms = {100 * cost['draft_share_of_cycle']:.0f}% of the "
                   f"{cost['cycle_ms']:.2f} ms cycle, a step {cost['draft_step_vs_plain_step']:.2f}x plain's; "
                   f"break-even acceptance {'never' if even is None else f'{even:.2f}'}")
        lines.append(f"{r['prompt_tokens']:>7} {r['depth']:>5} {r['drafter']:<12} {r.get('mode', ''):<6} "
                     f"{r['prefill_tokens_per_s'] or 0:>9.0f} {r['ttft_ms']:>8.1f} {r['tokens_per_s']:>9.1f} "
                     f"{r['speedup'] or 0:>7.2f}x {r['acceptance_rate']:>7.2f} {r['mean_accepted_length']:>8.2f} "
                     f"{ {True: 'yes', False: 'NO', None: '-'}[r['identical_to_plain']]:>5} "
                     f"{r['peak_memory_bytes'] / 2**20:>8.0f}  [{pos}] {ph}")
    if res["hf_generate_tokens_per_s"]:
        lines.append(f"transformers generate(): {res['hf_generate_tokens_per_s']:.1f} tok/s on the "
                     f"{res['hf_generate_prompt_tokens']}-token prompt (plain engine {res['plain_vs_hf']:.2f}x)")
    prof = (res.get("tensor_parallel") or {}).get("profile")
    if prof:
        lines.append(f"tensor parallel x{res['tensor_parallel']['world']}: {prof['collective_ms_per_token']:.2f} of "
                     f"{prof['kernel_ms_per_token']:.2f} GPU ms per token in collectives "
                     f"({100 * prof['collective_share']:.0f}%)")
    if res["plain_fraction_of_hbm_peak"]:
        lines.append(f"plain decode reads {res['weight_bytes_per_token'] / 1e9:.2f} GB/token: "
                     f"{res['plain_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s = "
                     f"{100 * res['plain_fraction_of_hbm_peak']:.1f}% of HBM peak")
    return "\n".join(lines)

"""Render the benchmark tables of docs/benchmarks.md from the committed `mtpchat bench --out` JSON files:
`python packaging/bench/table.py` prints Markdown (docs/benchmarks.md holds this output)."""

from __future__ import annotations

import json
from pathlib import Path

from app.cmd_bench import commit_refresh_share

HERE = Path(__file__).parent


def own_share(x: dict) -> str:
    """commit + the MTP head's refresh per cycle, as a share of the cycle's time (computed again: older JSON
    predates the field)."""
    share = commit_refresh_share(x)
    return "-" if share is None else f"{100 * share:.1f}%"


def table(path: Path) -> str:
    r = json.loads(path.read_text())
    v = r.get("versions", {})
    head = (f"**{r['model']}** on {r.get('gpu') or r['device']}, {r['dtype']}, {r['max_new_tokens']} tokens "
            f"(median of {r['repeat']} warm runs); torch {v.get('torch')}, transformers {v.get('transformers')}, "
            f"FLA {v.get('flash-linear-attention') or '-'}, GDN kernels {r.get('backends', {}).get('gdn_recurrent', '?')}; "
            f"`{r.get('command', '')}` (`{path.name}`)")
    lengths = any("tokens" in p for p in r.get("prompts", []))  # `bench --prompt-tokens`: a row per length
    rows = [("| prompt tokens | prefill tok/s | TTFT ms " if lengths else "")
            + "| depth | drafter | mode | tok/s | vs plain | acceptance | mean accepted length | commit + refresh | "
            "same text |" + (" per-position acceptance | MTP head ms: priming / draft / refresh per cycle | "
                             "peak GB |" if lengths else ""),
            ("|---:|---:|---:" if lengths else "") + "|---:|---|---|---:|---:|---:|---:|---:|---|"
            + ("---|---|---:|" if lengths else "")]
    failed = (r.get("cuda_graphs") or {}).get("failure")
    for x in r["results"]:
        mode = x.get("mode", "eager")
        mode = "eager (graph capture failed)" if failed and mode == "graphs" else mode
        row = (f"| {x['depth']} | {x['drafter']} | {mode} | {x['tokens_per_s']:.1f} | "
               f"{(x.get('speedup') or 0):.2f}x | {x['acceptance_rate']:.2f} | {x['mean_accepted_length']:.2f} | "
               f"{own_share(x)} | { {True: 'yes', False: 'no', None: 'sampled'}[x['identical_to_plain']]} |")
        if lengths:
            ph = x["phase_ms"]
            head_ms = ("-" if not x["depth"] else f"{x.get('priming_ms') or 0:.1f} / {ph.get('draft', 0):.2f} / "
                                                 f"{ph.get('refresh', 0):.2f}")
            row = (f"| {x['prompt_tokens']} | {x['prefill_tokens_per_s'] or 0:.0f} | {x['ttft_ms']:.1f} " + row
                   + f" {' '.join(f'{a:.2f}' for a in x['per_position_acceptance']) or '-'} | {head_ms} | "
                   f"{x['peak_memory_bytes'] / 1e9:.2f} |")
        rows.append(row)
    tail = [f"CUDA graphs: {failed}"] if failed else []
    if r.get("hf_generate_tokens_per_s"):
        runs = r.get("hf_generate_runs_tokens_per_s") or []
        spread = f", runs {min(runs):.1f}-{max(runs):.1f}" if len(runs) > 1 else ""
        tail.append(f"transformers `generate()`: {r['hf_generate_tokens_per_s']:.1f} tok/s{spread} "
                    f"(plain engine {r['plain_vs_hf']:.2f}x).")
    if lengths:
        copies = [f"{p['tokens']}: {p['text_copies']}" for p in r["prompts"] if "text_copies" in p]
        tail.append(f"Prompts: {r['prompts'][0]['source']}"
                    + (f" (copies of the text per length: {', '.join(copies)})" if copies else "")
                    + f"; peak memory: {r['results'][0]['peak_memory_of']}"
                    + (" (the process's high-water mark up to that row)." if "rss" in r["results"][0]["peak_memory_of"]
                       else " during the row."))
    tp = r.get("tensor_parallel")
    per = " per GPU" if tp else ""
    if r.get("plain_fraction_of_hbm_peak"):
        tail.append(f"Plain decode: {r['weight_bytes_per_token'] / 1e9:.1f} GB of weights per token{per}, "
                    f"{100 * r['plain_fraction_of_hbm_peak']:.1f}% of the HBM peak{per}.")
    if tp:
        prof = tp.get("profile") or {}
        line = f"Tensor parallel: {tp['world']} rank(s) over {tp['backend']} (one process per GPU)"
        if prof.get("collective_share") is not None:
            line += (f"; {prof['collective_ms_per_token']:.2f} of {prof['kernel_ms_per_token']:.2f} GPU ms per token "
                     f"in collectives ({100 * prof['collective_share']:.0f}%, profiled on rank 0)")
        tail.append(line + ".")
    return "\n".join([head, "", *rows, "", *tail])


def turns(path: Path) -> str:
    r = json.loads(path.read_text())
    pick = {(x["turn"], x["reuse"]): x for x in r["rows"]}
    shown = [t for t in (1, 5, 10) if (t, True) in pick]

    def side(reuse: bool) -> str:
        ms = " / ".join(f"{pick[t, reuse]['ttft_ms']:.0f}" for t in shown)
        pre = " / ".join(str(pick[t, reuse]["prefilled_tokens"]) for t in shown)
        return f"{ms} ms ({pre} tokens prefilled)"

    return (f"Multi-turn time to first token, **{r['model']}** on {r['device']} (`packaging/bench/turns.py`, "
            f"`{path.name}`): turns {' / '.join(map(str, shown))} take {side(True)} with reuse and {side(False)} "
            f"without.")


def precision(path: Path) -> str:
    r = json.loads(path.read_text())
    parts = []
    for dtype, x in r["precision"].items():
        div = x["first_divergence"]
        part = (f"{dtype} {100 * x['identical_share']:.0f}% of {x['runs']} identical to plain"
                + (f" (first divergences at tokens {', '.join(map(str, div))})" if div else ""))
        twin = x.get("vs_checkpoint")
        if x.get("mtp_acceptance") is not None:
            part += f", MTP acceptance {x['mtp_acceptance']:.2f}"
            if twin and twin["mtp_acceptance"] is not None:
                part += f" against the 16-bit checkpoint's {twin['mtp_acceptance']:.2f}"
        if twin:
            part += (f", plain text identical to the checkpoint's in {100 * twin['plain_identical_share']:.0f}% of "
                     f"prompts")
        parts.append(part)
    return (f"Precision report, **{r['model']}**, depth {r['depth']}, {r['max_new_tokens']} tokens "
            f"(`{r['command']}`): {'; '.join(parts)}.")


def profile(path: Path) -> str:
    r = json.loads(path.read_text())
    top = ", ".join(f"{k['kernel'][:40]} {k['ms_per_step']:.2f} ms" for k in r["top_kernels"][:4])
    return (f"One plain decode step, **{r['model']}** on {r['gpu']} (`packaging/bench/profile_step.py`, "
            f"`{path.name}`): eager {r['eager_step_ms']:.1f} ms, graph replay {r['graph_replay_ms']:.1f} ms "
            f"({100 * r['replay_fraction_of_4_8TBps']:.0f}% of 4.8 TB/s{', compiled layers' if r.get('compiled') else ''}); "
            f"profiled {r.get('profiled', 'eager step')}: {r['kernels_per_step']:.0f} kernels taking "
            f"{r['kernel_ms_per_step']:.1f} ms; the largest: {top}.")


def cycle_profile(path: Path) -> str:
    r = json.loads(path.read_text())
    rows = "; ".join(f"depth {x['depth']} {x['wall_ms_per_cycle']:.2f} ms a cycle, GPU busy "
                     f"{100 * x['gpu_busy_fraction']:.0f}%, {x['kernels_per_cycle']:.0f} kernels"
                     for x in r["depths"])
    return (f"Decoding cycles, **{r['model']}** on {r['gpu']} (`packaging/bench/profile_cycle.py`, a 32-token "
            f"prompt, `{path.name}`): {rows}.")


def main() -> None:
    for path in sorted(HERE.glob("*.json")):
        r = json.loads(path.read_text())
        if "results" in r:
            print(table(path) + "\n")
    for path in sorted(HERE.glob("*.json")):
        r = json.loads(path.read_text())
        render = turns if "rows" in r else precision if "precision" in r else profile if "top_kernels" in r else \
            cycle_profile if "depths" in r else None
        if render:
            print(render(path) + "\n")


if __name__ == "__main__":
    main()

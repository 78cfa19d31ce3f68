"""Render the README's benchmark tables from the committed `mtpchat bench --out` JSON files:
`python packaging/bench/table.py` prints Markdown (README.md's "Benchmarks" section is this output)."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent


def table(path: Path) -> str:
    r = json.loads(path.read_text())
    v = r.get("versions", {})
    head = (f"**{r['model']}** on {r.get('gpu') or r['device']}, {r['dtype']}, {r['max_new_tokens']} tokens "
            f"(median of {r['repeat']} warm runs); torch {v.get('torch')}, transformers {v.get('transformers')}, "
            f"FLA {v.get('flash-linear-attention') or '-'}; `{r.get('command', '')}` (`{path.name}`)")
    rows = ["| depth | drafter | mode | tok/s | vs plain | acceptance | mean accepted length | same text |",
            "|---:|---|---|---:|---:|---:|---:|---|"]
    failed = (r.get("cuda_graphs") or {}).get("failure")
    for x in r["results"]:
        mode = x.get("mode", "eager")
        mode = "eager (graph capture failed)" if failed and mode == "graphs" else mode
        rows.append(f"| {x['depth']} | {x['drafter']} | {mode} | {x['tokens_per_s']:.1f} | "
                    f"{(x.get('speedup') or 0):.2f}x | {x['acceptance_rate']:.2f} | {x['mean_accepted_length']:.2f} | "
                    f"{ {True: 'yes', False: 'no', None: 'sampled'}[x['identical_to_plain']]} |")
    tail = [f"CUDA graphs: {failed}"] if failed else []
    if r.get("hf_generate_tokens_per_s"):
        tail.append(f"transformers `generate()`: {r['hf_generate_tokens_per_s']:.1f} tok/s "
                    f"(plain engine {r['plain_vs_hf']:.2f}x).")
    if r.get("plain_fraction_of_hbm_peak"):
        tail.append(f"Plain decode: {r['weight_bytes_per_token'] / 1e9:.1f} GB of weights per token, "
                    f"{100 * r['plain_fraction_of_hbm_peak']:.1f}% of the HBM peak.")
    return "\n".join([head, "", *rows, "", *tail])


def main() -> None:
    for path in sorted(HERE.glob("*.json")):
        if "results" in json.loads(path.read_text()):
            print(table(path) + "\n")


if __name__ == "__main__":
    main()

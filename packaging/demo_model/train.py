"""Train the demo model: a small Qwen3-Next (GDN + full attention hybrid) with its own MTP head, jointly.

Self-contained on purpose: it runs on the GPU machine with nothing but torch, transformers (5.17 or newer),
numpy and safetensors (flash-linear-attention optional, used by transformers when importable).

    python3 train.py --data DIR --out DIR [--minutes 7] [--preset demo|tiny] [--device cuda|cpu]

DIR holds tokens.bin / starts.bin (uint16 ids / uint32 conversation starts) and val.bin / val_starts.bin,
as written by `recipe.py tokenize`. The loop is time-based: it stops itself at --minutes, keeps the weights with
the best held-out loss, and writes config.json, loss.csv, train_log.json and bf16 safetensors shards
(each under 16 MiB) of the whole state dict, `mtp.*` included, to --out.

MTP (DESIGN.md, "The speculative engine", rule 1): at position p the head computes
    x = fc(cat([norm_e(embed(t_{p+1})), norm_h(h_p)]))      embedding first, h_p after the trunk's final norm
then one full-attention decoder layer (causal, rotary position p), mtp.norm and the trunk's lm_head; it
predicts t_{p+2}. Loss = CE(next token) + w * CE(t_{p+2}), over all tokens, gradients flowing into the trunk.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_next import modeling_qwen3_next as mq

# ---------------------------------------------------------------------------------------------------------
# model

PRESETS = {
    # ~18.5M parameters with the MTP head: 8 layers, 3 GDN : 1 full attention like Qwen3-Next.
    "demo": dict(hidden_size=384, intermediate_size=768, num_hidden_layers=8, full_attention_interval=4,
                 num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                 linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64),
    # for CPU smoke tests
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, full_attention_interval=4,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
}

SPECIAL_IDS = {"endoftext": 0, "im_start": 1, "im_end": 2}


def make_config(vocab_size: int, preset: str = "demo") -> Qwen3NextConfig:
    p = dict(PRESETS[preset])
    n, every = p.pop("num_hidden_layers"), p.pop("full_attention_interval")
    cfg = Qwen3NextConfig(
        vocab_size=vocab_size,
        num_hidden_layers=n,
        layer_types=["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)],
        # dense MLP in every layer (no MoE): num_experts=0 and every layer listed as mlp-only
        num_experts=0, mlp_only_layers=list(range(n)), decoder_sparse_step=1,
        moe_intermediate_size=p["intermediate_size"], shared_expert_intermediate_size=p["intermediate_size"],
        num_experts_per_tok=1,
        linear_conv_kernel_dim=4,
        hidden_act="silu",
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=False,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=SPECIAL_IDS["im_end"],
        pad_token_id=SPECIAL_IDS["endoftext"],
        **p,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def mtp_layer_config(cfg: Qwen3NextConfig) -> Qwen3NextConfig:
    """A copy of the trunk config whose layer 0 is full attention with a dense MLP (for the MTP layer)."""
    d = cfg.to_dict()
    for k in ("model_type", "transformers_version", "architectures"):
        d.pop(k, None)
    d.update(num_hidden_layers=1, layer_types=["full_attention"], mlp_only_layers=[0])
    c = Qwen3NextConfig(**d)
    c._attn_implementation = "sdpa"
    return c


class MTPHead(nn.Module):
    """Parameter names give exactly the released layout: mtp.fc, mtp.pre_fc_norm_{embedding,hidden},
    mtp.layers.0.*, mtp.norm (no embedding, no lm_head: both are the trunk's)."""

    def __init__(self, cfg: Qwen3NextConfig):
        super().__init__()
        H = cfg.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = mq.Qwen3NextRMSNorm(H, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = mq.Qwen3NextRMSNorm(H, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList([mq.Qwen3NextDecoderLayer(mtp_layer_config(cfg), 0)])
        self.norm = mq.Qwen3NextRMSNorm(H, eps=cfg.rms_norm_eps)
        std = cfg.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, std)
            elif isinstance(m, mq.Qwen3NextRMSNorm):
                nn.init.zeros_(m.weight)  # zero-centred: scale = 1 + w

    def forward(self, emb_next: torch.Tensor, hidden: torch.Tensor, position_embeddings) -> torch.Tensor:
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb_next), self.pre_fc_norm_hidden(hidden)], dim=-1))
        # attention_mask=None with sdpa means causal (is_causal) for more than one query position
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=None)
        if isinstance(x, tuple):
            x = x[0]
        return self.norm(x)


def build_model(cfg: Qwen3NextConfig, seed: int) -> Qwen3NextForCausalLM:
    torch.manual_seed(seed)
    lm = Qwen3NextForCausalLM(cfg)
    lm.mtp = MTPHead(cfg)  # state-dict keys mtp.*
    return lm


def mtp_hidden(lm, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """MTP outputs (post mtp.norm) for positions p = 0..T-2, given the trunk's post-norm hidden h [B, T, H]."""
    T = input_ids.shape[1]
    emb = lm.model.embed_tokens(input_ids[:, 1:])
    hp = h[:, :-1]
    pos = torch.arange(T - 1, device=input_ids.device).unsqueeze(0)
    pe = lm.model.rotary_emb(hp, pos)
    return lm.mtp(emb, hp, pe)


def losses(lm, x: torch.Tensor, with_stats: bool = False):
    """x: [B, T+1] token ids. Returns (trunk CE, MTP CE[, stats])."""
    inp, tgt = x[:, :-1], x[:, 1:]
    h = lm.model(input_ids=inp, use_cache=False).last_hidden_state  # after the final norm
    logits = lm.lm_head(h)
    V = logits.shape[-1]
    l_main = F.cross_entropy(logits.float().reshape(-1, V), tgt.reshape(-1))
    m = mtp_hidden(lm, inp, h)
    mlogits = lm.lm_head(m)
    l_mtp = F.cross_entropy(mlogits.float().reshape(-1, V), tgt[:, 1:].reshape(-1))
    if not with_stats:
        return l_main, l_mtp
    with torch.no_grad():
        trunk_arg = logits.argmax(-1)  # trunk prediction for position p+1
        mtp_arg = mlogits.argmax(-1)   # MTP prediction for position p+2
        stats = {
            "trunk_acc": (trunk_arg == tgt).float().mean().item(),
            "mtp_acc": (mtp_arg == tgt[:, 1:]).float().mean().item(),
            # teacher-forced acceptance proxy: MTP draft for p+2 == trunk's greedy token for p+2
            "agree": (mtp_arg == trunk_arg[:, 1:]).float().mean().item(),
        }
    return l_main, l_mtp, stats


def use_torch_gdn_kernels() -> None:
    """Fallback: route transformers' GDN calls to its torch reference functions (if FLA misbehaves)."""
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        f = getattr(mq, name, None)
        if f is not None and hasattr(f, "__wrapped__"):
            setattr(mq, name, f.__wrapped__)


# ---------------------------------------------------------------------------------------------------------
# checks that must hold before spending GPU time

def check_causality(lm, vocab: int, device: str, amp) -> tuple[float, float]:
    """Trunk and MTP outputs at positions < k must not depend on tokens >= k.

    The trunk runs under `amp` (FLA's GDN kernels take bf16 only), so its check is loose; the MTP part runs in
    float32 on the same trunk hiddens and must match to float32 precision."""
    lm.eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(3, vocab, (1, 48), generator=g).to(device)
    with torch.no_grad():
        with amp:
            h = lm.model(input_ids=x, use_cache=False).last_hidden_state.float()
            h2 = lm.model(input_ids=x[:, :24], use_cache=False).last_hidden_state.float()
        m = mtp_hidden(lm, x, h).float()
        m2 = mtp_hidden(lm, x[:, :24], h[:, :24]).float()
    lm.train()
    return (h[:, :24] - h2).abs().max().item(), (m[:, :23] - m2).abs().max().item()


# ---------------------------------------------------------------------------------------------------------
# data

class Data:
    def __init__(self, tokens: Path, starts: Path, T: int, device: str):
        tok = np.fromfile(tokens, dtype=np.uint16).astype(np.int32)
        st = np.fromfile(starts, dtype=np.uint32).astype(np.int64)
        st = st[st + T + 1 <= tok.size]
        self.tokens = torch.from_numpy(tok).to(device)
        self.starts = torch.from_numpy(st).to(device)
        self.ar = torch.arange(T + 1, device=device)
        self.n_tokens = int(tok.size)

    def batch(self, B: int, gen: torch.Generator) -> torch.Tensor:
        i = torch.randint(len(self.starts), (B,), generator=gen, device="cpu").to(self.starts.device)
        return self.tokens[self.starts[i][:, None] + self.ar[None]].long()

    def windows(self, T: int, max_windows: int) -> torch.Tensor:
        n = min(max_windows, (self.n_tokens - 1) // T)
        idx = torch.arange(n, device=self.tokens.device)[:, None] * T + self.ar[None]
        return self.tokens[idx].long()


# ---------------------------------------------------------------------------------------------------------

def save_outputs(lm, out: Path, shard_bytes: int = 12 * 2**20) -> list[str]:
    from safetensors.torch import save_file

    sd = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in lm.state_dict().items()}
    if lm.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    names, shard, size, k = [], {}, 0, 0
    for key in sorted(sd):
        nb = sd[key].numel() * 2
        if shard and size + nb > shard_bytes:
            names.append(f"weights-{k}.safetensors")
            save_file(shard, str(out / names[-1]), metadata={"format": "pt"})
            shard, size, k = {}, 0, k + 1
        shard[key] = sd[key]
        size += nb
    if shard:
        names.append(f"weights-{k}.safetensors")
        save_file(shard, str(out / names[-1]), metadata={"format": "pt"})
    cfg = lm.config.to_dict()
    cfg["architectures"] = ["Qwen3NextForCausalLM"]
    cfg["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return names


def seed_and_describe(seed: int, dev: str) -> dict:
    """Seed every generator; return the run's environment for the logs (versions, GPU, FLA importable)."""
    import transformers

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    info = {"torch": torch.__version__, "transformers": transformers.__version__, "device": dev,
            "gpu": torch.cuda.get_device_name(0) if dev == "cuda" else None}
    try:
        from transformers.utils.import_utils import is_flash_linear_attention_available

        info["fla_available"] = bool(is_flash_linear_attention_available())
    except Exception as e:  # older/newer names
        info["fla_available"] = f"unknown ({e})"
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--minutes", type=float, default=7.2, help="training time budget, from process start")
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--mtp-weight", type=float, default=0.7)
    ap.add_argument("--eval-every-s", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    t_start = time.time()
    budget_s = args.minutes * 60
    args.out.mkdir(parents=True, exist_ok=True)
    dev = args.device
    info = seed_and_describe(args.seed, dev)
    print("env:", json.dumps(info), flush=True)
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    cfg = make_config(args.vocab_size, args.preset)
    lm = build_model(cfg, args.seed).to(dev)
    n_params = sum(p.numel() for p in lm.parameters())
    n_mtp = sum(p.numel() for p in lm.mtp.parameters())
    print(f"params: total {n_params/1e6:.2f}M (mtp {n_mtp/1e6:.2f}M), tied embeddings: "
          f"{lm.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr()}", flush=True)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev == "cuda" else torch.autocast("cpu", enabled=False)
    fell_back = False
    try:
        e_trunk, e_mtp = check_causality(lm, args.vocab_size, dev, amp)
    except Exception:
        traceback.print_exc()
        print("trunk forward failed: falling back to transformers' torch GDN kernels", flush=True)
        use_torch_gdn_kernels()
        fell_back = True
        e_trunk, e_mtp = check_causality(lm, args.vocab_size, dev, amp)
    print(f"causality check: trunk max |diff| {e_trunk:.2e}, mtp max |diff| {e_mtp:.2e}", flush=True)
    if e_mtp > 1e-3 or e_trunk > (1e-3 if dev == "cpu" else 0.25):
        print("causality check failed", file=sys.stderr)
        return 2

    data = Data(args.data / "tokens.bin", args.data / "starts.bin", args.seq, dev)
    val = Data(args.data / "val.bin", args.data / "val_starts.bin", args.seq, dev)
    val_x = val.windows(args.seq, 48)
    print(f"data: {data.n_tokens} train tokens, {len(data.starts)} starts; val windows {tuple(val_x.shape)}", flush=True)

    decay, no_decay = [], []
    for n, p in lm.named_parameters():
        (decay if p.ndim == 2 else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=(dev == "cuda"))
    gen = torch.Generator().manual_seed(args.seed)

    def evaluate():
        lm.eval()
        tot = {"val_loss": 0.0, "val_mtp_loss": 0.0, "val_trunk_acc": 0.0, "val_mtp_acc": 0.0, "val_agree": 0.0}
        nb = 0
        with torch.no_grad(), amp:
            for i in range(0, len(val_x), 16):
                a, b, s = losses(lm, val_x[i:i + 16], with_stats=True)
                tot["val_loss"] += a.item()
                tot["val_mtp_loss"] += b.item()
                for k in ("trunk_acc", "mtp_acc", "agree"):
                    tot["val_" + k] += s[k]
                nb += 1
        lm.train()
        return {k: v / nb for k, v in tot.items()}

    rows, best, best_state = [], None, None
    csv_path = args.out / "loss.csv"
    fields = ["step", "elapsed_s", "tokens", "lr", "train_loss", "train_mtp_loss",
              "val_loss", "val_mtp_loss", "val_trunk_acc", "val_mtp_acc", "val_agree"]
    fcsv = open(csv_path, "w", newline="")
    wcsv = csv.DictWriter(fcsv, fieldnames=fields)
    wcsv.writeheader()

    step, tokens_seen = 0, 0
    t_loop = time.time()
    train_end = t_start + budget_s
    last_eval = 0.0
    acc_main = acc_mtp = 0.0
    acc_n = 0
    status = "ok"
    try:
        while True:
            now = time.time()
            if now >= train_end or (args.max_steps and step >= args.max_steps):
                break
            frac = (now - t_loop) / max(1.0, train_end - t_loop)
            lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
            for gparam in opt.param_groups:
                gparam["lr"] = lr
            x = data.batch(args.batch, gen)
            try:
                with amp:
                    l_main, l_mtp = losses(lm, x)
                    loss = l_main + args.mtp_weight * l_mtp
                loss.backward()
            except Exception:
                if fell_back or step > 0:
                    raise
                traceback.print_exc()
                print("first step failed: falling back to transformers' torch GDN kernels", flush=True)
                use_torch_gdn_kernels()
                fell_back = True
                opt.zero_grad(set_to_none=True)
                continue
            if not torch.isfinite(loss):
                print(f"non-finite loss at step {step}; skipping", flush=True)
                opt.zero_grad(set_to_none=True)
                step += 1
                continue
            torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += x.numel() - x.shape[0]
            acc_main = acc_main + l_main.detach()
            acc_mtp = acc_mtp + l_mtp.detach()
            acc_n += 1
            if step == 1:
                print(f"first step done at {time.time() - t_start:.1f}s: loss {l_main.item():.3f} mtp {l_mtp.item():.3f}", flush=True)
            el = time.time() - t_loop
            if el - last_eval >= args.eval_every_s or step == 20:
                ev = evaluate()
                last_eval = time.time() - t_loop
                row = {"step": step, "elapsed_s": round(time.time() - t_start, 1), "tokens": tokens_seen, "lr": f"{lr:.3e}",
                       "train_loss": f"{float(acc_main) / max(1, acc_n):.4f}", "train_mtp_loss": f"{float(acc_mtp) / max(1, acc_n):.4f}",
                       **{k: f"{v:.4f}" for k, v in ev.items()}}
                acc_main = acc_mtp = 0.0
                acc_n = 0
                rows.append(row)
                wcsv.writerow(row)
                fcsv.flush()
                print(json.dumps(row), f"tok/s {tokens_seen / el:.0f}", flush=True)
                score = ev["val_loss"] + ev["val_mtp_loss"]
                if best is None or score < best:
                    best = score
                    best_state = {k: v.detach().clone() for k, v in lm.state_dict().items()}
    except Exception:
        traceback.print_exc()
        status = "error (weights with the best held-out loss so far are saved)"
    finally:
        train_s = time.time() - t_loop
        ev = evaluate() if status == "ok" else {}
        if ev:
            row = {"step": step, "elapsed_s": round(time.time() - t_start, 1), "tokens": tokens_seen, "lr": "0",
                   "train_loss": f"{float(acc_main) / acc_n:.4f}" if acc_n else "", "train_mtp_loss": f"{float(acc_mtp) / acc_n:.4f}" if acc_n else "",
                   **{k: f"{v:.4f}" for k, v in ev.items()}}
            rows.append(row)
            wcsv.writerow(row)
            fcsv.close()
            if best is None or ev["val_loss"] + ev["val_mtp_loss"] < best:
                best_state = None  # the final weights are the best
        if best_state is not None:
            lm.load_state_dict(best_state)
            ev = evaluate()
        names = save_outputs(lm, args.out)
        log = {**info, "status": status, "fell_back_to_torch_gdn": fell_back, "steps": step, "tokens_seen": tokens_seen,
               "train_seconds": round(train_s, 1), "tokens_per_s": round(tokens_seen / max(train_s, 1e-9)),
               "params": n_params, "mtp_params": n_mtp, "batch": args.batch, "seq": args.seq, "lr": args.lr,
               "mtp_weight": args.mtp_weight, "seed": args.seed, "final_eval": ev, "files": names,
               "train_tokens": data.n_tokens, "epochs": tokens_seen / max(1, data.n_tokens)}
        (args.out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
        print("done:", json.dumps(log), flush=True)
    return 0 if status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())

"""Tiny real checkpoints for tests, written by transformers' own save_pretrained in the released key layouts,
with `mtp.*` tensors added and a real byte-level BPE tokenizer with a ChatML template.

Weights are random but scaled so argmax margins are clear (a wrong norm convention or a wrong cache changes
the tokens), and every norm weight is non-zero (a missing `1 + w` shows). The trunk is random; the MTP head is
then trained for a few seconds to predict the trunk's own next-next token (`_mtp_tensors`), so that it drafts
like a real one: often accepted, often not, at every depth.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import load_engine
from engine.context import KV_DTYPE_ENV
from engine.events import Tokens
from engine.fp8 import NOT_CONVERTED as FP8_NOT_CONVERTED
from engine.fp8 import eligible as fp8_eligible

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_MARKERS = ["<think>", "</think>"]  # added tokens, not special (as in Qwen's tokenizers): decoding keeps them
# Qwen3.5's thinking template in miniature (the released one's logic for these cases): an assistant turn's
# reasoning is its reasoning_content, or the text up to </think>; earlier turns lose it unless they come after the
# last user message; the generation
# prompt opens a reasoning block, or, with enable_thinking=false, renders an empty one.
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}"
    "{%- set content = m['content'] %}"
    "{%- if m['reasoning_content'] is string %}{%- set reasoning = m['reasoning_content'] %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- else %}{%- set reasoning = '' %}{%- endif %}"
    "{%- if loop.index0 > ns.last_user and reasoning %}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}"
    "{%- else %}{{- '<think>\n' }}{%- endif %}{%- endif %}"
)
TEXT = """The quick brown fox jumps over the lazy dog. A speculative decoder drafts tokens and the target verifies
them. Gated delta networks keep a recurrent state; attention layers keep keys and values. Hello, how are you today?
I am fine, thank you. What is the capital of France? Paris is the capital of France. Tell me a story about a cat.
Once upon a time there was a cat who liked to sleep in the sun. def main(): print('hello world') return 0
"""
VOCAB = 384


@lru_cache(maxsize=2)
def memo(make):
    """get(name) -> make(name), made once per name: the fixtures' checkpoint writers and engine caches."""
    made = {}

    def get(name):
        if name not in made:
            made[name] = make(name)
        return made[name]

    return get


def greedy_reference(hf, prompt: list[int], n: int, **kw) -> list[int]:
    """transformers' greedy continuation of `prompt`, exactly n tokens: the oracle for the engine's ignore_eos
    decoding. eos_token_id=None neither stops at EOS nor masks it; min_new_tokens would mask it, so a fixture whose
    greedy path reaches EOS would differ at that token for no fault of the engine's."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, **kw)
    return out[0, len(prompt):].tolist()


def damaged_copy(src: Path, dest: Path, edit_tensors=None, edit_config=None) -> Path:
    """A copy of the single-file checkpoint `src` at `dest` with its tensors (edit_tensors(dict)) and / or its
    quantization_config (edit_config(dict)) edited in place: the quantized loaders' bad-input tests."""
    shutil.copytree(src, dest)
    if edit_tensors:
        f = dest / "model.safetensors"
        tensors = load_file(f)
        edit_tensors(tensors)
        save_file(tensors, f, metadata={"format": "pt"})
    if edit_config:
        conf = json.loads((dest / "config.json").read_text())
        edit_config(conf["quantization_config"])
        (dest / "config.json").write_text(json.dumps(conf))
    return dest


def tokenizer_files(thinking: bool = False) -> dict[str, str]:
    """Train a small byte-level BPE once per process; return file name -> content. thinking: with Qwen's <think>
    markers as added (non-special) tokens and a Qwen3.5-style thinking template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS + (THINK_MARKERS if thinking else []),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 4, trainer)
    data = json.loads(tok.to_str())
    for added in data["added_tokens"]:
        if added["content"] in THINK_MARKERS:
            added["special"] = False
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": THINKING_TEMPLATE if thinking else CHATML,
        "model_max_length": 4096,
    }
    return {"tokenizer.json": json.dumps(data), "tokenizer_config.json": json.dumps(config)}


def special_id(name: str) -> int:
    return json.loads(tokenizer_files()["tokenizer.json"])["added_tokens"][SPECIALS.index(name)]["id"]


def text_kwargs(moe: bool = False, layer_types=None, **over) -> dict:
    layer_types = layer_types or ["linear_attention", "full_attention", "linear_attention", "linear_attention",
                                  "full_attention"]
    kw = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, layer_types=layer_types,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096,
        tie_word_embeddings=False, pad_token_id=special_id("<|endoftext|>"), eos_token_id=special_id("<|im_end|>"),
        bos_token_id=None,
    )
    if moe:
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    kw.update(over)
    return kw


def _scale_weights(model: torch.nn.Module, seed: int) -> None:
    """Clear margins: big embeddings / lm_head, non-zero norm weights everywhere, a spread of A_log."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or "norm_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.4 + (1.0 if "linear_attn.norm" in name else 0.0))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (0.6 / p.shape[-1] ** 0.5))


def _text_parts(model):
    """(the text trunk's base model, whose last_hidden_state is after the final norm; its lm_head)."""
    base = model.model
    return getattr(base, "language_model", base), model.lm_head


def _prompt_pool(n: int, g: torch.Generator) -> list[list[int]]:
    """n chat prompts of one length (one batch, no padding): a user turn, or a system turn and a user turn,
    whose contents are windows of the tokenized TEXT, as the tests' prompts are."""
    tok = _tokenizer()
    ids = tok.encode(TEXT.replace("\n", " ")).ids
    user, system = tok.encode("<|im_start|>user\n").ids, tok.encode("<|im_start|>system\n").ids
    end, reply = tok.encode("<|im_end|>\n").ids, tok.encode("<|im_start|>assistant\n").ids
    length, with_system = int(torch.randint(3, 10, (1,), generator=g)), bool(torch.rand((), generator=g) < 0.3)
    out = []
    for _ in range(n):
        s = int(torch.randint(0, len(ids) - 2 * length, (1,), generator=g))
        a, b = ids[s : s + length], ids[s + length : s + 2 * length]
        out.append((system + a + end + user + b if with_system else user + a + b) + end + reply)
    return out


@lru_cache(maxsize=1)
def _tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_files()["tokenizer.json"])


def _trunk_data(model, seed: int, groups=((32, False), (32, False), (32, True)), new: int = 32):
    """Sequences the trunk itself produces from chat prompts, greedy and sampled (temperature 1.5, top-k 3), one
    batch per group (its prompts have one length), with the trunk's post-norm hiddens h_p and its logits at every
    position. (Generating costs more than the training: the trunk's greedy continuations are what drafts meet.)"""
    base, lm_head = _text_parts(model)
    g = torch.Generator().manual_seed(seed)
    # where flash-linear-attention is installed transformers runs its Triton kernels, which need CUDA tensors
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    data = []
    try:
        with torch.no_grad():
            for i, (n, sampled) in enumerate(groups):
                prompts = torch.tensor(_prompt_pool(n, g), device=device)
                torch.manual_seed(seed + i)
                seq = model.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=sampled,
                                     temperature=1.5 if sampled else None, top_k=3 if sampled else None,
                                     top_p=None, pad_token_id=0)
                hidden = base(input_ids=seq).last_hidden_state
                data.append((seq.cpu(), hidden.cpu(), lm_head(hidden).cpu()))
    finally:
        model.to("cpu")
    return data


def _head_forward(head, embed, lm_head, rotary, hidden, tokens):
    """MTPHead.forward over a batch of whole sequences from position 0 (the engine's is batch 1, with a cache):
    fc([norm_e(embed(t_{p+1})); norm_h(h_p)]) -> gated full attention -> MLP -> mtp.norm -> lm_head."""
    import torch.nn.functional as F

    from engine.model import apply_rope, dense_mlp

    B, T, _ = hidden.shape
    h = head.fc(torch.cat([head.pre_fc_norm_embedding(embed(tokens)), head.pre_fc_norm_hidden(hidden)], -1))
    layer = head.layers[0]
    attn, x = layer.self_attn, layer.input_layernorm(h)
    hd = attn.head_dim
    q, gate = attn.q_proj(x).reshape(B, T, -1, 2 * hd).chunk(2, dim=-1)
    q = attn.q_norm(q).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(x).reshape(B, T, -1, hd)).transpose(1, 2)
    v = attn.v_proj(x).reshape(B, T, -1, hd).transpose(1, 2)
    q, k = apply_rope(q, k, *rotary(torch.arange(T).unsqueeze(0), h.dtype))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=True)
    h = h + attn.o_proj((torch.sigmoid(gate) * o.transpose(1, 2)).reshape(B, T, -1))
    x = layer.post_attention_layernorm(h)
    h = h + (dense_mlp(layer.mlp, x) if hasattr(layer.mlp, "gate_proj") else _moe_every_expert(layer.mlp, x))
    return lm_head(head.norm(h))


def _moe_every_expert(block, x):
    """engine.model.moe_rowwise's sum, with every expert run over every row and weighted 0 where it was not
    routed: the same function, whose backward is a few small matmuls instead of a scatter over gathered weights."""
    from engine.model import dense_mlp, route

    h = x.reshape(-1, x.shape[-1])
    weights, idx = route(block, h)
    dense = torch.zeros(h.shape[0], block.experts.gate_up_proj.shape[0]).scatter(1, idx, weights)
    experts = block.experts
    gate, up = torch.einsum("nh,eoh->neo", h, experts.gate_up_proj).chunk(2, dim=-1)
    y = torch.einsum("nei,ehi->neh", experts.act_fn(gate) * up, experts.down_proj)
    y = (y * dense.unsqueeze(-1)).sum(1)
    shared = dense_mlp(block.shared_expert, h) * torch.sigmoid(block.shared_expert_gate(h))
    return (y + shared).view(x.shape)


def _train_head(head, model, text_config, seed: int, steps: int) -> None:
    """Distil the trunk's own next-next token into the head: at position p, inputs (h_p, t_{p+1}), target the
    trunk's distribution at p + 1 (what it predicts for t_{p+2}), on sequences the trunk generated."""
    from engine.model import Rotary

    data = _trunk_data(model, seed)
    base, lm_head = _text_parts(model)
    rotary = Rotary(text_config, torch.device("cpu"))
    for p in list(base.parameters()) + list(lm_head.parameters()):
        p.requires_grad_(False)
    opt = torch.optim.Adam(head.parameters(), lr=LR)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        seq, hidden, logits = data[step % len(data)]
        rows = torch.randperm(seq.shape[0], generator=g)[:12]
        out = _head_forward(head, base.embed_tokens, lm_head, rotary, hidden[rows, :-1], seq[rows, 1:])
        target = torch.softmax(logits[rows, 1:], -1)
        loss = -(target * torch.log_softmax(out, -1)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


LR = 5e-3
MTP_STEPS = 120  # ~3-4 s a family on one CPU thread; 0: the untrained (random) head
_TRAINED: dict[tuple, dict[str, torch.Tensor]] = {}  # (family, seed, steps, trunk digest) -> mtp.* tensors


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _mtp_tensors(family_name: str, model, text_config, seed: int, steps: int | None = None) -> dict:
    """The MTP head, trained for a few seconds on the CPU to predict the trunk's own next-next token: it drafts
    well but not perfectly (depth-1 acceptance about 0.45-0.8 on greedy chat prompts), so speculation sees
    accepted and rejected drafts in every family. Deterministic; one training per trunk and process."""
    steps = MTP_STEPS if steps is None else steps
    key = (family_name, seed, steps, _digest(model))
    if key not in _TRAINED:
        _TRAINED[key] = _new_mtp_tensors(family_name, model, text_config, seed, steps)
    return dict(_TRAINED[key])


def _new_mtp_tensors(family_name: str, model, text_config, seed: int, steps: int) -> dict[str, torch.Tensor]:
    from engine.families import SUPPORTED
    from engine.mtp import MTPHead

    family = SUPPORTED[family_name]
    has_experts = bool(getattr(text_config, "num_experts", 0))
    torch.manual_seed(seed)
    head = MTPHead(MTPHead.layer_config(text_config, has_experts), family, 1)
    _scale_weights(head, seed + 1)
    if steps:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # small ops: on CPU cores shared with other work, one thread is much faster
        try:
            _train_head(head, model, text_config, seed, steps)
        finally:
            torch.set_num_threads(threads)
    return {f"mtp.{k}": v.detach().contiguous() for k, v in head.state_dict().items()}


def write_checkpoint(
    path: Path,
    family: str = "qwen3_next",
    moe: bool = False,
    mtp: bool = True,
    wrapped: bool | None = None,
    seed: int = 0,
    shards: bool = False,
    per_expert: bool = False,
    thinking: bool = False,
    **config_over,
) -> Path:
    """Write a tiny checkpoint. family: qwen3_next | qwen3_5 | qwen3_5_moe; wrapped defaults to the release layout."""
    import transformers as tf

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if family == "qwen3_next":
        kw = text_kwargs(moe=moe, **config_over)
        if moe:
            kw.setdefault("mlp_only_layers", [0])  # one dense layer among MoE layers
            kw.setdefault("decoder_sparse_step", 1)
        else:
            kw["num_experts"] = 0
        cfg = tf.Qwen3NextConfig(**kw)
        model = tf.Qwen3NextForCausalLM(cfg)
        text_cfg = cfg
    else:
        moe = family == "qwen3_5_moe"
        wrapped = True if wrapped is None else wrapped
        kw = text_kwargs(moe=moe, **config_over)
        kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                          "mrope_section": [1, 1, 0], "mrope_interleaved": True})
        text_cls = tf.Qwen3_5MoeTextConfig if moe else tf.Qwen3_5TextConfig
        if wrapped:
            vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                          patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
            cfg_cls = tf.Qwen3_5MoeConfig if moe else tf.Qwen3_5Config
            cfg = cfg_cls(text_config=kw, vision_config=vision, tie_word_embeddings=False)
            model_cls = tf.Qwen3_5MoeForConditionalGeneration if moe else tf.Qwen3_5ForConditionalGeneration
            model = model_cls(cfg)
            text_cfg = cfg.text_config
        else:
            cfg = text_cls(**kw)
            model = (tf.Qwen3_5MoeForCausalLM if moe else tf.Qwen3_5ForCausalLM)(cfg)
            text_cfg = cfg
    _scale_weights(model, seed)
    model.save_pretrained(path, max_shard_size="40KB" if shards else "10GB")
    if per_expert:
        _split_experts(path)
    if mtp:
        extra = _mtp_tensors(family, model, text_cfg, seed + 7)
        _add_tensors(path, extra)
        conf = json.loads((path / "config.json").read_text())
        target = conf.get("text_config", conf) if family != "qwen3_next" else conf
        target["num_nextn_predict_layers" if family == "qwen3_next" else "mtp_num_hidden_layers"] = 1
        (path / "config.json").write_text(json.dumps(conf, indent=2))
    for name, content in tokenizer_files(thinking).items():
        (path / name).write_text(content)
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": special_id("<|im_end|>"), "pad_token_id": special_id("<|endoftext|>")}))
    return path


def _files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def _add_tensors(path: Path, extra: dict[str, torch.Tensor]) -> None:
    """Put extra tensors into the (last) safetensors file, updating the shard index when there is one."""
    last = _files(path)[-1]
    tensors = load_file(last)
    tensors.update(extra)
    save_file(tensors, last, metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({k: last.name for k in extra})
        index.write_text(json.dumps(data, indent=2))


def _split_experts(path: Path) -> None:
    """Rewrite fused expert tensors as one tensor per expert (the other released MoE layout)."""
    for f in _files(path):
        tensors = load_file(f)
        out = {}
        for k, v in tensors.items():
            if k.endswith("mlp.experts.gate_up_proj"):
                base = k[: -len("gate_up_proj")]
                for e in range(v.shape[0]):
                    gate, up = v[e].chunk(2, dim=0)
                    out[f"{base}{e}.gate_proj.weight"] = gate.contiguous()
                    out[f"{base}{e}.up_proj.weight"] = up.contiguous()
            elif k.endswith("mlp.experts.down_proj"):
                base = k[: -len("down_proj")]
                for e in range(v.shape[0]):
                    out[f"{base}{e}.down_proj.weight"] = v[e].contiguous()
            else:
                out[k] = v
        save_file(out, f, metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.exists():
        wm = {}
        for f in _files(path):
            for k in load_file(f):
                wm[k] = f.name
        data = json.loads(index.read_text())
        data["weight_map"] = wm
        index.write_text(json.dumps(data, indent=2))


def to_hf_cache(src: Path, cache: Path, repo_id: str, rev: str = "a" * 40) -> Path:
    """Move a model folder into the Hub cache layout: blobs named by hash, snapshot files as relative symlinks."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.move(str(f), blob)
        (snap / f.name).symlink_to(Path("..", "..", "blobs", digest))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    shutil.rmtree(src)
    return snap


def tokens_of(events) -> list[int]:
    """The token ids a request's events handed out, in order."""
    return [t for e in events if isinstance(e, Tokens) for t in e.token_ids]


def oom(*a, **k):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def oom_on_the_second_verify(forward):
    """forward, except that its third call runs out of memory when it is a verify pass of several tokens (the
    second cycle of a speculative reply: prefill, first verify, then this one)."""
    calls = {"n": 0}

    def flaky(tokens, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3 and tokens.shape[1] > 1:
            oom()
        return forward(tokens, *a, **k)

    return flaky


# --- FP8 (Qwen's official block-128 layout) ------------------------------------------------------------------

# What Qwen's FP8 releases leave unquantized: engine.fp8.NOT_CONVERTED (FP8_NOT_CONVERTED here; the bench's
# random-weight FP8 models use the same list).

def rewrite_index(folder: Path) -> None:
    """A sharded checkpoint's index, after its shards were rewritten: each tensor's file, as the shards now hold."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: f.name for f in _files(folder) for k in load_file(f)}
        index.write_text(json.dumps(data, indent=2))


def write_fp8_checkpoint(src: Path, dst: Path, twin: Path) -> tuple[Path, Path]:
    """Convert the checkpoint at src into Qwen's FP8 layout at dst (each eligible linear weight quantized per
    128x128 block: `*.weight` float8_e4m3fn, `*.weight_scale_inv` float32, and the quantization_config), and
    write at twin the same model with those weights exactly dequantized, in float32: the oracle's checkpoint."""
    from engine.fp8 import dequantize, quantize

    for out in (dst, twin):
        shutil.copytree(src, out)
    for f in _files(src):
        fp8, plain = {}, {}
        for k, v in load_file(f).items():
            if fp8_eligible(k, v):
                q, s = quantize(v)
                fp8[k], fp8[k[: -len(".weight")] + ".weight_scale_inv"] = q, s
                plain[k] = dequantize(q, s, torch.float32)
            else:
                fp8[k] = plain[k] = v
        save_file(fp8, dst / f.name, metadata={"format": "pt"})
        save_file(plain, twin / f.name, metadata={"format": "pt"})
    rewrite_index(dst)
    conf = json.loads((dst / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128], "modules_to_not_convert": FP8_NOT_CONVERTED}
    (dst / "config.json").write_text(json.dumps(conf, indent=2))
    return dst, twin


def load_with_kv_cache(kv_cache: str, path: str, **kw):
    """load_engine with --kv-cache-dtype `kv_cache`: the environment variable every trunk reads as it is built
    (model.choose_kv_cache), set for the load only."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KV_DTYPE_ENV, kv_cache)
        return load_engine(path, **kw)

"""Loading every released layout, the MTP head against a hand-written reference, and bad input."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from app.cli import main
from engine import load_engine
from engine.model import load

RELEASED_MTP_KEYS = {
    "mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
    "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.post_attention_layernorm.weight",
    "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.self_attn.k_proj.weight",
    "mtp.layers.0.self_attn.v_proj.weight", "mtp.layers.0.self_attn.o_proj.weight",
    "mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.self_attn.k_norm.weight",
}


def all_tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("name,family,gdn_key", [
    ("next", "qwen3_next", "in_proj_qkvz"), ("next_moe", "qwen3_next", "in_proj_qkvz"),
    ("q35", "qwen3_5", "in_proj_qkv"), ("q35_moe", "qwen3_5_moe", "in_proj_qkv"),
    ("q35_text", "qwen3_5", "in_proj_qkv"), ("next_sharded_experts", "qwen3_next", "in_proj_qkvz"),
])
def test_released_layouts_load(name, family, gdn_key, ckpt):
    path = ckpt(name)
    keys = set(all_tensors(path))
    assert RELEASED_MTP_KEYS <= keys
    assert any(gdn_key in k for k in keys)
    if family in ("qwen3_5", "qwen3_5_moe") and name != "q35_text":
        assert any(k.startswith("model.language_model.") for k in keys)
        assert any(k.startswith("model.visual.") for k in keys)  # ignored for text
    if name == "next_sharded_experts":
        assert (path / "model.safetensors.index.json").exists() and len(list(path.glob("*.safetensors"))) > 1
        assert any(".experts.0.gate_proj.weight" in k for k in keys)
    loaded = load(path)
    assert loaded.trunk.family.name == family and loaded.mtp_layers == 1
    kinds = loaded.trunk.kinds
    assert kinds.count("full_attention") == 2 and kinds.index("full_attention") == 1  # not every 4th


def test_gdn_layout_conversion_round_trips(ckpt):
    """A Qwen3-Next checkpoint converted to the split Qwen3.5 projection layout still loads and decodes alike."""
    from engine.families import convert_gdn_layout

    path = ckpt("next")
    loaded = load(path)
    sd = {k: v for k, v in loaded.trunk.lm.state_dict().items()}
    split_keys = {k.replace("in_proj_qkvz", "in_proj_qkv").replace("in_proj_ba", "in_proj_b") for k in sd}
    split_keys |= {k.replace("in_proj_qkvz", "in_proj_z").replace("in_proj_ba", "in_proj_a") for k in sd}
    split = convert_gdn_layout(sd, split_keys, loaded.trunk.config)
    back = convert_gdn_layout(split, set(sd), loaded.trunk.config)
    assert any("in_proj_qkv.weight" in k for k in split) and not any("in_proj_qkvz" in k for k in split)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


def rms(x, w, eps=1e-6, centred=True):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * ((1 + w) if centred else w)


def reference_mtp(t, hidden, tokens, cfg):
    """The MTP head written out from the raw checkpoint tensors: embedding first, 1 + w norms, gated attention."""
    p = lambda n: t[f"mtp.{n}"]  # noqa: E731
    e = rms(F.embedding(tokens, t["model.embed_tokens.weight"]), p("pre_fc_norm_embedding.weight"))
    h = rms(hidden, p("pre_fc_norm_hidden.weight"))
    x = F.linear(torch.cat([e, h], -1), p("fc.weight"))
    T, hd = x.shape[0], cfg["head_dim"]
    a = rms(x, p("layers.0.input_layernorm.weight"))
    q, gate = F.linear(a, p("layers.0.self_attn.q_proj.weight")).view(T, -1, 2 * hd).chunk(2, -1)
    q = rms(q, p("layers.0.self_attn.q_norm.weight"))
    k = rms(F.linear(a, p("layers.0.self_attn.k_proj.weight")).view(T, -1, hd), p("layers.0.self_attn.k_norm.weight"))
    v = F.linear(a, p("layers.0.self_attn.v_proj.weight")).view(T, -1, hd)
    rd = int(hd * cfg.get("partial_rotary_factor", cfg.get("rope_parameters", {}).get("partial_rotary_factor", 1)))
    theta = cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    inv = 1.0 / theta ** (torch.arange(0, rd, 2).float() / rd)
    ang = torch.arange(T).float()[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

    def rope(z):
        r, rest = z[..., :rd], z[..., rd:]
        r1, r2 = r.chunk(2, -1)
        return torch.cat([r * cos + torch.cat([-r2, r1], -1) * sin, rest], -1)

    q, k = rope(q), rope(k)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
    x = x + F.linear(o, p("layers.0.self_attn.o_proj.weight"))
    m = rms(x, p("layers.0.post_attention_layernorm.weight"))
    y = F.linear(F.silu(F.linear(m, p("layers.0.mlp.gate_proj.weight"))) * F.linear(m, p("layers.0.mlp.up_proj.weight")),
                 p("layers.0.mlp.down_proj.weight"))
    out = rms(x + y, p("norm.weight"))
    return F.linear(out, t["lm_head.weight"]), out


def test_mtp_head_matches_reference_from_checkpoint_tensors(ckpt):
    path = ckpt("next")
    loaded = load(path)
    t = all_tensors(path)
    cfg = json.loads((path / "config.json").read_text())
    torch.manual_seed(0)
    T = 6
    hidden = torch.randn(1, T, cfg["hidden_size"])
    tokens = torch.randint(0, cfg["vocab_size"], (1, T))
    head = loaded.mtp
    cache = head.new_cache()
    cache.reserve(T)
    with torch.inference_mode():
        logits, out = head(hidden, tokens, 0, cache)
        # the same, one position at a time through the KV cache
        cache2 = head.new_cache()
        cache2.reserve(T)
        steps = [head(hidden[:, i : i + 1], tokens[:, i : i + 1], i, cache2)[0] for i in range(T)]
    ref_logits, ref_out = reference_mtp(t, hidden[0], tokens[0], cfg)
    torch.testing.assert_close(logits[0], ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[0], ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(steps, 1)[0], ref_logits, rtol=1e-4, atol=1e-4)
    # a wrong convention must show: swapped concatenation order, or plain-w norms, give other logits
    swapped = dict(t)
    swapped["mtp.pre_fc_norm_embedding.weight"], swapped["mtp.pre_fc_norm_hidden.weight"] = (
        t["mtp.pre_fc_norm_hidden.weight"], t["mtp.pre_fc_norm_embedding.weight"])
    assert not torch.allclose(reference_mtp(swapped, hidden[0], tokens[0], cfg)[0], ref_logits, atol=1e-2)


# --- bad input: one clear line on stderr, non-zero exit, no traceback ---------------------------------------------


def run_cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


def broken_copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_bad_inputs(ckpt, tmp_path, capsys):
    good = ckpt("next")
    cases = []
    cases.append((["--model", str(tmp_path / "nope")], "no such model folder"))
    (tmp_path / "empty").mkdir()
    cases.append((["--model", str(tmp_path / "empty")], "no config.json"))

    trunc = broken_copy(good, tmp_path / "trunc")
    f = trunc / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    cases.append((["--model", str(trunc)], "model.safetensors"))

    garbage = broken_copy(good, tmp_path / "garbage")
    (garbage / "model.safetensors").write_bytes(b"\xff" * 64)
    cases.append((["--model", str(garbage)], "corrupt or truncated"))

    badjson = broken_copy(good, tmp_path / "badjson")
    (badjson / "config.json").write_text("{ not json")
    cases.append((["--model", str(badjson)], "config.json: config is not valid JSON"))

    shapes = broken_copy(good, tmp_path / "shapes")
    conf = json.loads((shapes / "config.json").read_text())
    conf["intermediate_size"] = 100
    (shapes / "config.json").write_text(json.dumps(conf))
    cases.append((["--model", str(shapes)], "mlp.gate_proj.weight' has shape"))

    llama = broken_copy(good, tmp_path / "llama")
    conf = json.loads((llama / "config.json").read_text())
    conf["model_type"] = "llama"
    (llama / "config.json").write_text(json.dumps(conf))
    cases.append((["--model", str(llama)], "unsupported model_type 'llama'; supported: qwen3, qwen3_5"))

    mlx = broken_copy(good, tmp_path / "mlx")
    t = load_file(mlx / "model.safetensors")
    key = next(k for k in t if k.endswith("linear_attn.conv1d.weight"))
    t[key] = t[key].transpose(1, 2).contiguous()  # MLX layout [C, K, 1]
    save_file(t, mlx / "model.safetensors", metadata={"format": "pt"})
    cases.append((["--model", str(mlx)], "MLX-converted checkpoint"))

    pickle_only = tmp_path / "pickle"
    pickle_only.mkdir()
    shutil.copy(good / "config.json", pickle_only / "config.json")
    (pickle_only / "pytorch_model.bin").write_bytes(b"not loaded")
    cases.append((["--model", str(pickle_only)], "pickle weights are never loaded"))

    base = ["run", "--prompt", "hi", "--max-new-tokens", "2"]
    capsys.readouterr()  # drop what writing the fixture printed
    for extra, needle in cases:
        code, err = run_cli(capsys, *base, *extra)
        assert code != 0, extra
        assert needle in err, (needle, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err

    for flags, needle in [(["--depth", "-1"], "argument --depth: must be between 0 and 16, got -1"),
                          (["--temperature", "-2"], "--temperature"), (["--top-p", "0"], "--top-p"),
                          (["--max-new-tokens", "0"], "--max-new-tokens"), (["--device", "tpu"], "--device 'tpu'")]:
        code, err = run_cli(capsys, *base, "--model", str(good), *flags)
        assert code != 0 and needle in err and "Traceback" not in err, err
    code, err = run_cli(capsys, *base, "--dtype", "float8")
    assert code == 2 and "--dtype" in err and len(err.strip().splitlines()) == 1


def test_a_partial_mtp_head_means_plain_decoding_with_the_reason(ckpt, tmp_path, capsys):
    """The trunk is whole, its MTP head is not: the model still chats, plainly, and says why (as `models` does)."""
    partial = broken_copy(ckpt("next"), tmp_path / "partial")
    t = load_file(partial / "model.safetensors")
    del t["mtp.layers.0.self_attn.k_proj.weight"]
    save_file(t, partial / "model.safetensors", metadata={"format": "pt"})
    code = main(["run", "--model", str(partial), "--prompt", "hi", "--max-new-tokens", "4", "--depth", "2",
                 "--ignore-eos", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and len(out["token_ids"]) == 4 and out["stats"]["drafted"] == 0
    reasons = [f["reason"] for f in out["fallbacks"] if f["feature"] == "speculation"]
    assert any("partial MTP head: tensor 'mtp.layers.0.self_attn.k_proj.weight' is missing" in r for r in reasons)
    # as text: a note line on stderr for each fallback of this run, once; the machine's are doctor's
    code = main(["run", "--model", str(partial), "--prompt", "hi", "--max-new-tokens", "4", "--depth", "2",
                 "--ignore-eos", "--think"])
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mtpchat: note: ")]
    assert code == 0 and len(notes) == len(set(notes)) == 2, notes
    assert "'mtp.layers.0.self_attn.k_proj.weight' is missing" in notes[0] and "--think / --no-think" in notes[1]


def test_bad_input_from_a_real_process_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "app.cli", "run", "--prompt", "x", "--model", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("mtpchat: error:") and "Traceback" not in proc.stderr


def test_run_json_contract(ckpt, capsys):
    code = main(["run", "--model", str(ckpt("next")), "--prompt", "Tell me a story about a cat.", "--depth", "2",
                 "--max-new-tokens", "12", "--ignore-eos", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert set(out) >= {"model", "text", "prompt_token_ids", "token_ids", "sources", "finish_reason", "stats",
                        "fallbacks", "diagnostics"}
    assert len(out["token_ids"]) == len(out["sources"]) == 12 and out["finish_reason"] == "length"
    assert set(out["sources"]) <= {"draft", "target"}
    for key in ("depth", "cycles", "drafted", "accepted", "acceptance_rate", "mean_accepted_length", "tokens_per_s",
                "phase_ms"):
        assert key in out["stats"]
    assert out["stats"]["drafted"] > 0 and {"prefill", "verify", "draft", "commit"} <= set(out["stats"]["phase_ms"])
    assert out["diagnostics"]["backends"]["gdn_recurrent"]["backend"] == "torch"
    # --raw skips the chat template: fewer prompt tokens, no <|im_start|>
    main(["run", "--model", str(ckpt("next")), "--prompt", "Tell me a story about a cat.", "--raw",
          "--max-new-tokens", "3", "--json"])
    raw = json.loads(capsys.readouterr().out)
    assert len(raw["prompt_token_ids"]) < len(out["prompt_token_ids"])


def test_engine_defaults_and_overrides(ckpt):
    engine = load_engine(str(ckpt("next")))
    assert engine.info.device == "cpu" and engine.info.dtype == "float32"  # no CUDA here
    engine16 = load_engine(str(ckpt("next")), device="cpu", dtype="bfloat16")
    assert engine16.trunk.dtype == torch.bfloat16


def test_run_json_states_fallbacks_with_reasons(ckpt, capsys, monkeypatch):
    monkeypatch.setenv("MTPCHAT_DISABLE_FLA", "1")
    code = main(["run", "--model", str(ckpt("next_nomtp")), "--prompt", "Hello", "--depth", "3",
                 "--max-new-tokens", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["stats"]["drafted"] == 0 and set(out["sources"]) == {"target"}
    reasons = {f["feature"]: f["reason"] for f in out["fallbacks"]}
    assert "no mtp.* tensors" in reasons["speculation"] and "plain decoding" in reasons["speculation"]
    if not torch.cuda.is_available():
        assert "CPU" in reasons["cuda"]
    assert "MTPCHAT_DISABLE_FLA" in out["diagnostics"]["backends"]["gdn_recurrent"]["reason"]


def test_qwen3_next_projection_rows_are_put_in_order_at_load(ckpt):
    """Qwen3-Next's interleaved GDN projections get their output rows in [q | k | v | z] and [b | a] order at load
    (gdn.keep_constants: no gather in a pass), and the modules' own forward (transformers' code: the bench's
    baseline runs it on the engine's model) still gives transformers' logits."""
    import transformers as tf

    from engine import stock_forward

    path = ckpt("next")
    loaded = load(path)
    mixers = [layer.linear_attn for layer in loaded.trunk.layers if hasattr(layer, "linear_attn")]
    assert mixers and not any(hasattr(m, "qkvz_order") for m in mixers)
    hf = tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert not torch.equal(hf.model.layers[0].linear_attn.in_proj_qkvz.weight, mixers[0].in_proj_qkvz.weight)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])
    with torch.inference_mode(), stock_forward(loaded.trunk.lm.modules()):
        # (not bit for bit: a matmul over rows in another order may tile them differently; 9e-6 here)
        torch.testing.assert_close(loaded.trunk.lm(ids).logits, hf(ids).logits)

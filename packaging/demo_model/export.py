"""Assemble the trained weights into an ordinary HF Qwen3-Next checkpoint with an MTP head.

Input: the training output folder (config.json + weights-*.safetensors shards, bf16) and the tokenizer folder.
Output (engine/assets/demo/): config.json, generation_config.json, model.safetensors (trunk + mtp.*),
tokenizer.json, tokenizer_config.json. The model card (README.md) is written by `recipe.py card`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# config keys that PretrainedConfig writes but that mean nothing for a causal LM checkpoint
_DROP = {"id2label", "label2id", "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward",
         "is_encoder_decoder", "problem_type", "_name_or_path", "torchscript", "use_return_dict"}


def export(trained: Path, tok_dir: Path, dest: Path) -> dict:
    from transformers import GenerationConfig, Qwen3NextConfig, Qwen3NextForCausalLM

    from train import MTPHead  # same module definition the weights were trained with

    raw = json.loads((trained / "config.json").read_text())
    params = {k: v for k, v in raw.items() if k not in _DROP and k not in ("transformers_version", "architectures", "model_type", "dtype", "num_nextn_predict_layers")}
    cfg = Qwen3NextConfig(**params)

    sd: dict[str, torch.Tensor] = {}
    for f in sorted(trained.glob("weights-*.safetensors")):
        sd.update(load_file(str(f)))

    # the key layout must be exactly the released one: the trunk of Qwen3NextForCausalLM + mtp.*
    with torch.device("meta"):
        ref = Qwen3NextForCausalLM(cfg)
        ref.mtp = MTPHead(cfg)
    expected = set(ref.state_dict())
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = expected - set(sd), set(sd) - expected
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")
    for k, v in ref.state_dict().items():
        if k in sd and tuple(sd[k].shape) != tuple(v.shape):
            raise SystemExit(f"shape mismatch for {k}: {tuple(sd[k].shape)} vs {tuple(v.shape)}")

    dest.mkdir(parents=True, exist_ok=True)
    for stale in dest.glob("*.safetensors*"):
        stale.unlink()
    sd = {k: sd[k].to(torch.bfloat16).contiguous() for k in sorted(sd)}
    save_file(sd, str(dest / "model.safetensors"), metadata={"format": "pt"})

    cfg_d = cfg.to_dict()
    out = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}
    for k, v in cfg_d.items():
        if k in _DROP or k in out or k == "transformers_version":
            continue
        out[k] = v
    out["dtype"] = "bfloat16"
    out["num_nextn_predict_layers"] = 1  # read by vLLM/SGLang and by mtpchat's engine; transformers ignores it
    import transformers

    out["transformers_version"] = transformers.__version__
    (dest / "config.json").write_text(json.dumps(out, indent=2) + "\n")

    GenerationConfig(bos_token_id=None, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
                     do_sample=False).save_pretrained(dest)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, dest / name)

    n_params = sum(v.numel() for v in sd.values())
    n_mtp = sum(v.numel() for k, v in sd.items() if k.startswith("mtp."))
    return {"params": n_params, "mtp_params": n_mtp, "mtp_keys": sorted(k for k in sd if k.startswith("mtp.")),
            "bytes": sum(f.stat().st_size for f in dest.iterdir() if f.is_file())}

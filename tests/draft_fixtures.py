"""Tiny checkpoints for draft-model speculation and sliding-window attention, written by transformers'
save_pretrained with the tokenizer and the weight scaling of fixtures.py.

- qwen3 (dense, Qwen3ForCausalLM's layout), optionally with sliding-window layers (use_sliding_window,
  sliding_window, max_window_layers: the layers from max_window_layers on slide);
- drafts that are a target's trunk with perturbed weights: they propose what the target would, mostly, so that
  drafts are accepted and rejected in every cycle mix (a random draft would almost never be accepted).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fixtures import _files, _scale_weights, special_id, text_kwargs, tokenizer_files, write_checkpoint


def qwen3_kwargs(layers: int = 4, window: int | None = None, max_window_layers: int = 1, **over) -> dict:
    kw = {k: v for k, v in text_kwargs().items() if not k.startswith("linear_") and k != "layer_types"}
    kw.update(num_hidden_layers=layers, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if window is not None:
        kw.update(use_sliding_window=True, sliding_window=window, max_window_layers=max_window_layers)
    kw.update(over)
    return kw


def write_qwen3(path: Path, seed: int = 0, layers: int = 4, window: int | None = None, max_window_layers: int = 1,
                tokenizer: bool = True, **over) -> Path:
    """A dense Qwen3 checkpoint; window: sliding-window layers from max_window_layers on."""
    import transformers as tf

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**qwen3_kwargs(layers, window, max_window_layers, **over)))
    _scale_weights(model, seed)
    model.save_pretrained(path)
    if tokenizer:
        write_tokenizer(path)
    return path


def write_tokenizer(path: Path, vocab_shift: bool = False) -> None:
    """fixtures.py's tokenizer; vocab_shift: the same size with two token strings swapped (another tokenizer:
    the same vocabulary size, different ids)."""
    files = dict(tokenizer_files())
    if vocab_shift:
        data = json.loads(files["tokenizer.json"])
        vocab = data["model"]["vocab"]
        a, b = sorted((t for t in vocab if len(t) > 1 and t.isalpha()), key=vocab.get)[:2]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        files["tokenizer.json"] = json.dumps(data)
    for name, content in files.items():
        (path / name).write_text(content)
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": special_id("<|im_end|>"), "pad_token_id": special_id("<|endoftext|>")}))


def write_perturbed_draft(target: Path, path: Path, noise: float, seed: int = 1) -> Path:
    """The target's text trunk with every weight w -> w + noise * std(w) * N(0, 1), as a text-only checkpoint of
    its family (a wrapped Qwen3.5 target gives a qwen3_5_text draft: no vision tower, no MTP head)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    conf = json.loads((target / "config.json").read_text())
    text = dict(conf.get("text_config", conf))
    if "text_config" in conf:
        text["model_type"] = conf["model_type"] + "_text"
        text.setdefault("tie_word_embeddings", conf.get("tie_word_embeddings", False))
        text["architectures"] = ["Qwen3_5ForCausalLM"]
    for k in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        text.pop(k, None)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for f in _files(target):
        for k, v in load_file(f).items():
            if k.startswith("mtp.") or ".visual." in k or k.startswith("visual."):
                continue
            k = k.replace("model.language_model.", "model.")
            if v.is_floating_point() and v.numel() > 1:
                v = v + noise * v.float().std() * torch.randn(v.shape, generator=g)
            out[k] = v.contiguous()
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(text, indent=2))
    write_tokenizer(path)
    return path


def write_qwen35_pair(root: Path, noise: float) -> tuple[Path, Path]:
    """A wrapped Qwen3.5 target (with its MTP head) and a text-only Qwen3.5 draft, its perturbed trunk."""
    target = write_checkpoint(Path(root) / "q35_target", "qwen3_5", seed=21)
    return target, write_perturbed_draft(target, Path(root) / "q35_draft", noise)



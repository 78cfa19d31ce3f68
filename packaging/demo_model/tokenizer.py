"""Byte-level BPE tokenizer (Qwen-style pre-tokenisation) with ChatML special tokens, and corpus tokenisation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# The ChatML template of the Qwen instruct models, reduced to plain messages (no tools, no thinking blocks).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2's pre-tokenisation pattern: contractions, letter runs, single digits, punctuation runs, newlines, spaces.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def render(messages: list[dict]) -> str:
    """Python twin of CHAT_TEMPLATE (without the generation prompt)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def iter_texts(corpus: Path):
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            yield render(json.loads(line)["messages"])


def train_tokenizer(corpus: Path, out_dir: Path, vocab_size: int = 8192) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in SPECIALS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_texts(corpus), trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    added = {
        str(ids[s]): {"content": s, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
        for s in SPECIALS
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "split_special_tokens": False,
        "errors": "replace",
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def tokenize_corpus(corpus: Path, tok_dir: Path, out_bin: Path, jsonl_out_starts: Path) -> dict:
    """Encode every conversation; write uint16 token ids and uint32 conversation start offsets."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert tok.get_vocab_size() <= 65535
    texts = list(iter_texts(corpus))
    ids, starts, pos = [], [], 0
    B = 4096
    for i in range(0, len(texts), B):
        for enc in tok.encode_batch(texts[i:i + B], add_special_tokens=False):
            starts.append(pos)
            ids.append(np.asarray(enc.ids, dtype=np.uint16))
            pos += len(enc.ids)
    arr = np.concatenate(ids)
    arr.tofile(out_bin)
    np.asarray(starts, dtype=np.uint32).tofile(jsonl_out_starts)
    chars = sum(len(t) for t in texts)
    return {"tokens": int(arr.size), "conversations": len(texts), "chars": chars, "chars_per_token": chars / arr.size}

"""The embedded demo model: loads by the same path as any checkpoint, chats, and speculates for real."""

import pytest

from engine import GenerationSettings, load_engine
from engine.api import EMBEDDED
from engine.events import Tokens


@pytest.fixture(scope="module")
def demo():
    return load_engine(str(EMBEDDED))


def run(engine, prompt, depth, **kw):
    events = list(engine.generate(prompt, GenerationSettings(depth=depth, **kw)))
    ids = [t for e in events if isinstance(e, Tokens) for t in e.token_ids]
    return ids, events[-1]


def test_demo_is_a_qwen3_next_checkpoint_with_mtp(demo):
    assert demo.info.family == "qwen3_next" and demo.info.mtp_layers == 1
    assert sum(p.stat().st_size for p in EMBEDDED.iterdir()) <= 40 * 2**20


def test_chat_reply_ends_with_im_end(demo):
    prompt = demo.encode_chat([{"role": "user", "content": "What is a list in Python?"}])
    ids, fin = run(demo, prompt, 2, max_new_tokens=200)
    im_end = demo.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert fin.reason == "eos" and ids[-1] == im_end and len(ids) > 3
    assert demo.tokenizer.decode(ids, skip_special_tokens=True).strip()


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_speculation_is_lossless_and_accepts(demo, depth):
    prompt = demo.encode_chat([{"role": "user", "content": "Explain the word river."}])
    plain, _ = run(demo, prompt, 0, max_new_tokens=48, ignore_eos=True)
    spec, fin = run(demo, prompt, depth, max_new_tokens=48, ignore_eos=True)
    assert spec == plain
    assert fin.stats["drafted"] > 0 and fin.stats["accepted"] > 0


def test_chat_template_round_trips(demo):
    tok = demo.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    for m in messages:
        assert f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>" in text
    ids = demo.encode_chat(messages)
    assert tok.decode(ids) == text

"""Reasoning models (engine side): the template's switch, the reply's parts, the thinking budget's forced close,
and state reuse across a turn whose reasoning the template drops. The q35_think fixture has a Qwen3.5-style
thinking template and <think> / </think> as single added tokens."""

import pytest
import torch
import transformers as tf

from engine import GenerationSettings, load_engine
from engine.events import Started, Tokens
from engine.reasoning import PartTracker, thinking_info
from test_exactness import assert_mtp_drafts_accepted_and_rejected

MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def think(engines):
    return engines("q35_think")


@pytest.fixture(scope="module")
def hf(ckpt):
    return tf.AutoModelForCausalLM.from_pretrained(str(ckpt("q35_think")), dtype=torch.float32).eval()


def reply(engine, prompt, **kw):
    kw.setdefault("ignore_eos", True)
    kw.setdefault("max_new_tokens", 30)
    events = list(engine.generate(prompt, GenerationSettings(**kw)))
    toks = [e for e in events if isinstance(e, Tokens)]
    flat = lambda attr: [x for e in toks for x in getattr(e, attr)]
    return events, flat("token_ids"), flat("parts"), flat("sources"), "".join(e.text for e in toks)


def test_the_switch_renders_as_the_template_does(think):
    tok = think.tokenizer
    info = think.thinking
    assert info.switch and info.default is True and info.reason is None
    assert (info.open_marker, info.close_marker) == ("<think>", "</think>")
    for flag in (None, True, False):
        kw = {} if flag is None else {"enable_thinking": flag}
        want = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, **kw),
                          add_special_tokens=False)
        assert think.encode_chat(MESSAGES, think=flag) == want
    assert think.encode_chat(MESSAGES, think=False) != think.encode_chat(MESSAGES, think=True)


def test_a_template_without_the_switch_says_why(engines):
    plain = engines("q35")
    assert not plain.thinking.switch and "enable_thinking" in plain.thinking.reason
    prompt = plain.encode_chat(MESSAGES, think=False)
    assert prompt == plain.encode_chat(MESSAGES)  # (nothing to switch: the same prompt)
    events = list(plain.chat(MESSAGES, GenerationSettings(max_new_tokens=2, think=False)))
    assert any(f.feature == "thinking" for f in events[-1].fallbacks)


def test_parts_are_split_at_the_markers_and_the_markers_never_show():
    class Tok:  # the two markers as ids 3 and 4 of some vocabulary
        chat_template = "{{ enable_thinking }}"

        def encode(self, text, add_special_tokens=False):
            return {"<think>": [3], "</think>": [4]}.get(text, [9, 9])

        def apply_chat_template(self, *a, **k):
            return "<think>"

    info = thinking_info(Tok())
    tracker = PartTracker(info, reasoning=True)  # the generation prompt opened the block
    pieces = ["a", "b", "</think>", "\n", "c", "<think>", "d"]
    parts = tracker.label([7, 8, 4, 5, 6, 3, 7], pieces)
    assert parts == ["reasoning", "reasoning", "reasoning", "answer", "answer", "reasoning", "reasoning"]
    assert pieces == ["a", "b", "", "\n", "c", "", "d"]


def test_no_think_replies_are_all_answer(think):
    events, ids, parts, _, _ = reply(think, think.encode_chat(MESSAGES, think=False), max_new_tokens=8)
    assert isinstance(events[0], Started) and not events[0].reasoning
    assert set(parts) == {"answer"}
    assert events[-1].stats["parts"]["answer"]["tokens"] == len(ids)


def test_the_budget_closes_the_reasoning_at_the_same_token_at_every_depth(think, hf):
    """After N reasoning tokens the engine commits </think> and a blank line like a prompt's tokens; greedy
    decoding then goes on as transformers does from that prefix, and every depth gives the same reply."""
    prompt = think.encode_chat(MESSAGES)
    budget = 9
    events, plain, parts, sources, _ = reply(think, prompt, depth=0, think_budget=budget, reuse=False)
    assert events[0].reasoning
    close = think.thinking.close_id
    forced = [close] + think.encode_raw("\n\n")
    assert plain[budget : budget + len(forced)] == forced
    assert sources[budget : budget + len(forced)] == ["forced"] * len(forced)
    assert parts[: budget + 1] == ["reasoning"] * (budget + 1) and set(parts[budget + 1 :]) == {"answer"}
    # transformers: greedy up to the budget, then greedy again from the prompt plus the forced close
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=budget, min_new_tokens=budget, do_sample=False)
    assert plain[:budget] == ref[0, len(prompt):].tolist()
    head = prompt + plain[: budget + len(forced)]
    rest = len(plain) - budget - len(forced)
    ref = hf.generate(torch.tensor([head]), max_new_tokens=rest, min_new_tokens=rest, do_sample=False)
    assert plain[budget + len(forced):] == ref[0, len(head):].tolist()
    for depth in (1, 3):
        events, tokens, _, _, _ = reply(think, prompt, depth=depth, think_budget=budget, reuse=False)
        assert tokens == plain
        assert_mtp_drafts_accepted_and_rejected(events[-1])
        stats = events[-1].stats["parts"]
        assert stats["reasoning"]["tokens"] + stats["answer"]["tokens"] == len(tokens)
        assert stats["reasoning"]["drafted"] > 0 and stats["answer"]["drafted"] > 0


def test_the_budget_within_max_new_tokens_cuts_the_forced_close(think):
    prompt = think.encode_chat(MESSAGES)
    _, ids, _, sources, _ = reply(think, prompt, depth=2, think_budget=4, max_new_tokens=5, reuse=False)
    assert len(ids) == 5 and sources[4] == "forced" and ids[4] == think.thinking.close_id


def test_reuse_across_a_thinking_turn_is_exact(think, ckpt, hf):
    """The template drops the first turn's reasoning from the second prompt: the committed state holds tokens
    the new prompt does not. Reuse restarts from the snapshot taken before the reply's <think>, and the second
    reply equals a fresh engine's."""
    first = think.encode_chat(MESSAGES)
    _, ids, parts, _, _ = reply(think, first, depth=2, think_budget=6, max_new_tokens=16, reuse=False)
    tok = think.tokenizer
    reasoning = tok.decode([t for t, p in zip(ids, parts) if p == "reasoning"])
    answer = tok.decode([t for t, p in zip(ids, parts) if p == "answer"])
    messages = MESSAGES + [{"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\n{answer}"},
                           {"role": "user", "content": "And then?"}]
    second = think.encode_chat(messages)
    opened_at = len(first) - 2  # the generation prompt ends "<think>" "\n"
    assert first[opened_at] == think.thinking.open_id and second[:opened_at] == first[:opened_at]
    assert second[: len(first)] != first  # the reasoning is gone: the live state is stale for this prompt
    events, again, _, _, _ = reply(think, second, depth=2)
    assert events[0].reused_tokens == opened_at
    fresh = load_engine(str(ckpt("q35_think")))
    assert again == reply(fresh, second, depth=0, reuse=False)[1]
    ref = hf.generate(torch.tensor([second]), max_new_tokens=30, min_new_tokens=30, do_sample=False)
    assert again == ref[0, len(second):].tolist()


def test_a_users_marker_text_stays_text(think):
    """User text never becomes control tokens: a typed <think> is characters; only the template's own opens."""
    ids = think.encode_chat([{"role": "user", "content": "what does <think> mean? </think>"}])
    assert ids.count(think.thinking.open_id) == 1 and ids[-2] == think.thinking.open_id
    assert think.thinking.close_id not in ids

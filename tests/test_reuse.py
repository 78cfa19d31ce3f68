"""Multi-turn reuse: the same tokens with reuse on and off, strictly fewer prefilled tokens with it on."""

import json

import pytest

from engine import GenerationSettings, load_engine
from engine.errors import EngineError
from engine.events import Finished, Started, Tokens

QUESTIONS = ["Hello, how are you today?", "Tell me a story about a cat.", "What is the capital of France?",
             "def main(): print('hello world')", "The quick brown fox jumps over the lazy dog."]


def reply(engine, messages, depth, reuse, max_new=12):
    settings = GenerationSettings(max_new_tokens=max_new, depth=depth, reuse=reuse)
    events = list(engine.chat(messages, settings))
    ids = [t for e in events if isinstance(e, Tokens) for t in e.token_ids]
    text = "".join(e.text for e in events if isinstance(e, Tokens))
    return ids, text, events[-1].stats, next(e for e in events if isinstance(e, Started))


def conversation(engine, depth, reuse):
    messages, out, prefilled = [], [], []
    for q in QUESTIONS:
        messages.append({"role": "user", "content": q})
        ids, text, stats, started = reply(engine, messages, depth, reuse)
        assert started.reused_tokens == stats["reused_tokens"]
        out.append(ids)
        prefilled.append(stats["prefilled_tokens"])
        messages.append({"role": "assistant", "content": text})
    return out, prefilled


@pytest.mark.parametrize("depth", [0, 2])
def test_multi_turn_reuse_is_exact_and_prefills_less(depth, engines):
    engine = engines("next")
    with_reuse, pre_on = conversation(engine, depth, True)
    without, pre_off = conversation(engine, depth, False)
    assert with_reuse == without
    assert sum(pre_on) < sum(pre_off)
    reuse = engine.diagnostics()["reuse"]  # snapshot memory is bounded and stated
    assert reuse["snapshots"] <= reuse["max_snapshots"] and reuse["snapshot_bytes"] > 0
    assert all(a <= b for a, b in zip(pre_on, pre_off)) and pre_on[-1] < pre_off[-1]


def test_regenerate_and_edit_restart_from_a_snapshot(engines, ckpt):
    engine, scratch = engines("next"), load_engine(str(ckpt("next")))
    history = [{"role": "user", "content": QUESTIONS[0]}]
    _, text, _, _ = reply(engine, history, 2, True)
    history += [{"role": "assistant", "content": text}, {"role": "user", "content": QUESTIONS[1]}]
    first, _, _, _ = reply(engine, history, 2, True)
    # regenerate: the same prompt again -> the prompt-end snapshot, no prefill at all
    again, _, stats, _ = reply(engine, history, 2, True)
    fresh, _, _, _ = reply(scratch, history, 2, False)
    assert again == first == fresh and stats["prefilled_tokens"] == 0
    # edit the last user message: restart from the snapshot at the end of the previous prompt
    edited = history[:-1] + [{"role": "user", "content": QUESTIONS[2]}]
    ids, _, stats, _ = reply(engine, edited, 2, True)
    ref, _, _, _ = reply(scratch, edited, 2, False)
    assert ids == ref and 0 < stats["reused_tokens"] < stats["prompt_tokens"]


def test_template_that_drops_thinking_blocks(tmp_path):
    """A template that rewrites earlier assistant turns (drops <think> blocks): reuse still equals from-scratch."""
    from fixtures import write_checkpoint

    path = write_checkpoint(tmp_path / "m", "qwen3_next")
    conf = json.loads((path / "tokenizer_config.json").read_text())
    conf["chat_template"] = (
        "{% for m in messages %}{% set c = m['content'] %}"
        "{% if m['role'] == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1] %}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps(conf))
    engine = load_engine(str(path))
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    outs = {True: [], False: []}
    for reuse in (True, False):
        msgs = list(messages)
        for q in QUESTIONS[1:4]:
            ids, text, stats, _ = reply(engine, msgs, 2, reuse)
            outs[reuse].append(ids)
            msgs += [{"role": "assistant", "content": "<think>pondering</think>" + text}, {"role": "user", "content": q}]
    assert outs[True] == outs[False]


def test_failure_mid_turn_drops_cached_state(engines, monkeypatch):
    engine = engines("next")
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    reply(engine, messages, 2, True)
    assert engine.turns.history

    def boom(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(engine.caches, "commit", boom)  # (inside commit's apply: the state is dropped, said so)
    with pytest.raises(EngineError, match="injected.*state was dropped"):
        reply(engine, messages + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}], 2, True)
    monkeypatch.undo()
    assert engine.turns.history == [] and engine.turns.snapshots == []
    ids, _, stats, _ = reply(engine, messages, 2, True)
    assert stats["reused_tokens"] == 0 and ids == reply(engine, messages, 2, False)[0]

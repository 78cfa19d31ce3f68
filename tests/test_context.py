"""The model's context is enforced: its limit (max_position_embeddings; YaRN read right), a prompt past it refused,
a reply stopped at it, a chat that outgrows it loses its oldest turns with exact reuse, and what fits in memory."""

from __future__ import annotations

import json
import queue
import shutil
import time
from functools import partial

import pytest
import torch
import transformers as tf
from app_support import home  # noqa: F401 (a fixture)
from app_support import run_async, send, wait_loaded, wait_reply, wait_until, write_settings
from fixtures import write_checkpoint

from app.worker import (EngineLoaded, EngineLoadFailed, EngineWorker, Generate, HistoryTrimmed, ReplyFailed,
                        ReplyFinished, ReplyProgress, ReplyStarted, default_loader)
from engine import EngineError, GenerationSettings, fit_text, format_tokens, load_engine, tokens_that_fit
from engine.context import context_info, fit_messages
from engine.events import Tokens

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "factor": 4.0,
        "original_max_position_embeddings": 1024}
QUESTIONS = ["Hello, how are you today?", "Tell me a story about a cat.", "What is the capital of France?",
             "def main(): print('hello world')", "The quick brown fox jumps over the lazy dog."]
PROMPTS = [
    [{"role": "user", "content": "Tell me a story about a cat."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France? "
                                                                                   "Hello, how are you today?"}],
]


def decode(engine, prompt, **kw):
    events = list(engine.generate(prompt, GenerationSettings(**kw)))
    return [t for e in events if isinstance(e, Tokens) for t in e.token_ids], events[-1]


# --- the limit and what a token costs ------------------------------------------------------------------------


def test_context_info_from_a_config_dict_and_from_the_loaded_model(engines):
    # a wrapped Qwen3.5 config as released: text fields nested, the RoPE scaling under its older name
    text = {"max_position_embeddings": 262144, "num_hidden_layers": 8, "num_attention_heads": 16,
            "num_key_value_heads": 2, "head_dim": 256, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                                        "original_max_position_embeddings": 65536}}
    info = context_info(text, mtp_layers=1)
    assert info.max_position_embeddings == 262144  # the usable context: YaRN's stretch is already in it
    assert (info.rope_type, info.rope_factor, info.original_max_position_embeddings) == ("yarn", 4.0, 65536)
    assert info.attention_layers == 2 + 1  # every 4th of 8 layers (the default interval), and the MTP head's
    assert info.kv_bytes_per_token("bfloat16") == 3 * 2 * 2 * 256 * 2
    assert info.kv_bytes_per_token("bfloat16", "fp8") == 3 * 2 * 2 * (256 + 4)  # a byte a value, a scale a vector
    engine = engines("next")  # fixtures: 2 full-attention layers of 5, 2 KV heads of 16 dims, one MTP layer
    assert engine.context_limit == 4096 and engine.kv_bytes_per_token == 3 * 2 * 2 * 16 * 4  # float32 on CPU
    ctx = engine.diagnostics()["context"]
    assert ctx["limit"] == ctx["max_position_embeddings"] == 4096 and ctx["max_context"] is None


def test_what_fits_in_memory_and_how_it_is_written():
    assert tokens_that_fit(10_000, 2_000, 100, None) == 80
    assert tokens_that_fit(10_000, 2_000, 100, 50) == 50  # never more than the model's context
    assert tokens_that_fit(1_000, 2_000, 100, 50) == 0  # the weights alone do not fit
    assert tokens_that_fit(None, 2_000, 100, 50) is None
    assert [format_tokens(n) for n in (512, 12_345, 131_072, 262_144, 1_048_576)] == \
        ["512", "12.3k", "131k", "262k", "1.0M"]
    assert fit_text(131_072, 262_144) == "131k of 262k"


def test_doctor_and_models_show_the_context_that_fits(env_cli):
    from engine import discover, probe_device

    device = probe_device("cpu")
    demo = next(c for c in discover(device=device, include_hf_cache=False, include_env=False)
                if c.source == "embedded")
    assert demo.context_limit == 4096 and demo.kv_bytes_per_token == 3 * 2 * 2 * 64 * 4  # float32 on the CPU
    assert demo.context_fits == tokens_that_fit(device.available_bytes, demo.mem_bytes, demo.kv_bytes_per_token,
                                                4096)
    models = env_cli("models", "--device", "cpu")
    doctor = env_cli("doctor", "--device", "cpu")
    shown = fit_text(demo.context_fits, 4096)
    assert "CONTEXT FITS" in models and shown in models
    assert f"context fits: {shown}" in doctor


@pytest.fixture
def env_cli(tmp_path, monkeypatch):
    """`mtpchat ARGS` in this process (stdout as text), with an empty HF cache and MTPCHAT_HOME."""
    from app.cli import main

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("MTPCHAT_HOME", str(tmp_path / "h"))
    monkeypatch.setenv("MTPCHAT_DISABLE_FLA", "1")
    monkeypatch.delenv("MTPCHAT_MODELS", raising=False)

    def run(*args) -> str:
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(list(args)) == 0
        return out.getvalue()

    return run


# --- YaRN: the engine's rotary embedding is transformers' ------------------------------------------------------


@pytest.fixture(scope="module")
def yarn_ckpt(tmp_path_factory):
    made = {}

    def get(family: str, mtp: bool):
        if family not in made:
            rope = dict(YARN) if family == "qwen3_next" else {**YARN, "mrope_section": [1, 1, 0],
                                                              "mrope_interleaved": True}
            made[family] = write_checkpoint(tmp_path_factory.mktemp(f"yarn_{family}"), family, mtp=mtp,
                                            rope_parameters=rope)
        return made[family]

    return get


@pytest.mark.parametrize("family, mtp, depth", [("qwen3_next", True, 2), ("qwen3_5", False, 0)])
def test_yarn_greedy_equals_transformers_generate(yarn_ckpt, tmp_path, family, mtp, depth):
    path = yarn_ckpt(family, mtp)
    engine = load_engine(str(path), "cpu")
    assert (engine.context.rope_type, engine.context.rope_factor) == ("yarn", 4.0)
    assert engine.diagnostics()["context"]["original_max_position_embeddings"] == 1024
    hf = tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    # the same weights with the default RoPE: it must decode differently, or this test could not see YaRN
    plain = tmp_path / "plain"
    shutil.copytree(path, plain)
    config = json.loads((plain / "config.json").read_text())
    rope = config.get("text_config", config)["rope_parameters"]
    for key in ("factor", "original_max_position_embeddings"):
        rope.pop(key)
    rope["rope_type"] = "default"
    (plain / "config.json").write_text(json.dumps(config))
    hf_plain = tf.AutoModelForCausalLM.from_pretrained(str(plain), dtype=torch.float32).eval()
    differs = False
    for messages in PROMPTS:
        prompt = engine.encode_chat(messages)
        # (eos is not ignored on either side: transformers' min_new_tokens would mask it, the engine's
        # ignore_eos does not)
        ours, _ = decode(engine, prompt, max_new_tokens=32, depth=depth)
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
        assert ours == ref
        differs |= hf_plain.generate(ids, max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist() != ref
    assert differs


# --- a prompt past the limit; a reply at the limit -------------------------------------------------------------


@pytest.fixture(scope="module")
def capped(ckpt):
    """The tiny checkpoint with --max-context 128."""
    return load_engine(str(ckpt("next")), "cpu", max_context=128)


def test_a_prompt_past_the_context_is_refused_in_one_line(capped):
    assert capped.context_limit == 128 and capped.diagnostics()["context"]["max_context"] == 128
    with pytest.raises(EngineError) as err:
        decode(capped, [5] * 128, max_new_tokens=4)
    assert str(err.value) == "the prompt is 128 tokens; the context is 128 (--max-context 128; the model's is 4,096)"
    ids, fin = decode(capped, [5] * 127, max_new_tokens=4)  # room for exactly one new token
    assert len(ids) == 1 and fin.reason == "length"


@pytest.mark.parametrize("depth", [0, 3])
def test_a_reply_stops_at_the_end_of_the_context(capped, engines, depth):
    prompt = capped.encode_chat(PROMPTS[0])
    ids, fin = decode(capped, prompt, max_new_tokens=500, depth=depth, ignore_eos=True)
    assert len(prompt) + len(ids) == 128 and fin.reason == "length"
    uncapped, _ = decode(engines("next"), prompt, max_new_tokens=128 - len(prompt), depth=depth, ignore_eos=True)
    assert ids == uncapped  # the same tokens, cut at the limit


def test_a_bad_max_context_in_the_api():
    with pytest.raises(EngineError, match="--max-context 5: must be a whole number of tokens, at least 128"):
        load_engine(None, max_context=5)


# --- the chat: the oldest turns dropped, exact reuse ------------------------------------------------------------


def test_fit_messages_keeps_the_system_prompt_and_the_latest_turns():
    def encode(messages):  # a token per character, and a few per message (the template's markers)
        return [0] * sum(len(m["content"]) + 3 for m in messages)

    chat = [{"role": "system", "content": "s" * 7}]
    for i in range(6):
        chat += [{"role": "user", "content": f"q{i}" * 5}, {"role": "assistant", "content": f"a{i}" * 5}]
    whole = fit_messages(encode, chat, limit=1000, reserve=20)
    assert whole.messages == chat and whole.dropped == 0
    fitted = fit_messages(encode, chat, limit=80, reserve=20)  # 10 + 26 a turn: the system prompt and 1 turn fit
    assert fitted.messages == chat[:1] + chat[-2:] and fitted.dropped == 10 and fitted.tokens == 36
    assert fit_messages(encode, chat, limit=120, reserve=20).messages == chat[:1] + chat[-6:]  # 3 turns
    alone = fit_messages(encode, chat, limit=30, reserve=20)  # not even the last turn: it is kept, generate refuses
    assert alone.messages == chat[:1] + chat[-2:]


def worker_chat(path: str, max_context: int, turns: int, max_new: int = 12):
    """A conversation of `turns` questions through the chat's decode thread (EngineWorker, the real engine):
    per request, the messages sent, what the worker posted and the reply's token ids."""
    posted = queue.Queue()
    worker = EngineWorker(posted.put, path, "cpu", None, loader=partial(default_loader, max_context=max_context))
    worker.start()

    def until(kind, rid=None, timeout=60):
        seen, deadline = [], time.monotonic() + timeout
        while True:
            msg = posted.get(timeout=max(deadline - time.monotonic(), 0.01))
            seen.append(msg)
            if isinstance(msg, (EngineLoadFailed, ReplyFailed)):
                raise AssertionError(msg.error)
            if isinstance(msg, kind) and (rid is None or msg.request_id == rid):
                return seen

    try:
        until(EngineLoaded)
        messages, requests = [{"role": "system", "content": "You are terse."}], []
        for rid in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[rid % len(QUESTIONS)]})
            worker.submit(Generate(rid, list(messages), dict(max_new_tokens=max_new, depth=2)))
            seen = until(ReplyFinished, rid)
            ids = [t for m in seen if isinstance(m, ReplyProgress) for t in m.token_ids]
            requests.append((list(messages), seen, ids))
            text = "".join(m.text for m in seen if isinstance(m, ReplyProgress))
            messages.append({"role": "assistant", "content": text})
    finally:
        worker.shutdown(timeout=10)
    return requests


def test_a_chat_past_the_context_drops_its_oldest_turns_with_exact_reuse(ckpt):
    path, limit, max_new = str(ckpt("next")), 160, 12
    requests = worker_chat(path, limit, turns=9, max_new=max_new)
    fresh = load_engine(path, "cpu", max_context=limit)
    trimmed = 0
    for messages, seen, ids in requests:
        started = next(m for m in seen if isinstance(m, ReplyStarted))
        notice = [m for m in seen if isinstance(m, HistoryTrimmed)]
        kept = messages
        if notice:
            trimmed += 1
            kept = messages[:1] + messages[1 + notice[0].dropped:]
            assert kept[0]["role"] == "system" and kept[1]["role"] == "user" and notice[0].limit == limit
            assert notice[0].tokens == started.prompt_tokens == len(fresh.encode_chat(kept))
        assert started.prompt_tokens + max_new <= limit
        # the reply equals a fresh engine's on the messages that were kept: no state of a dropped turn was reused
        ref = [t for e in fresh.chat(kept, GenerationSettings(max_new_tokens=max_new, depth=2, reuse=False))
               if isinstance(e, Tokens) for t in e.token_ids]
        assert ids == ref
    assert trimmed >= 3  # the conversation outgrew the context early, and kept outgrowing it
    assert any(next(m for m in seen if isinstance(m, ReplyStarted)).reused_tokens > 0
               for _, seen, _ in requests[:2])  # (and before that, turns did reuse the committed state)


@run_async
async def test_the_chat_shows_the_context_meter_and_a_notice_when_turns_are_dropped(home, ckpt):
    from app.live import LiveStatic
    from app.tui import MtpChatApp

    write_settings(max_new_tokens=12, depth=2)
    app = MtpChatApp(model=str(ckpt("next")), loader=partial(default_loader, max_context=128))
    async with app.run_test(size=(140, 36)) as pilot:
        await wait_loaded(pilot, app)
        status = lambda: app.ui("#status", LiveStatic).visual.plain  # noqa: E731
        assert "context 0 / 128" in status()
        await send(pilot, app, QUESTIONS[0])
        reply = await wait_reply(pilot, app)
        used = reply.stats["prompt_tokens"] + reply.stats["generated_tokens"]
        assert f"context {format_tokens(used)} / 128" in status()
        for q in QUESTIONS[1:] * 2:
            await send(pilot, app, q)
            await wait_reply(pilot, app)
            if app.context_dropped:
                break
        await wait_until(pilot, lambda: "oldest not sent" in status(), 5, "the meter's note")
        notices = [n.message for n in app._notifications if "longer than the model's context" in n.message]
        assert notices and "oldest message" in notices[0] and "the system prompt is kept" in notices[0]


def capped_leader_main(model, conn):
    """Rank 0 of a two-rank chat session with --max-context 128, in a spawned process: one reply asked for far
    more tokens than fit."""
    from engine.tp_session import TPLeader

    leader = TPLeader(model, "cpu", None, 2, max_context=128)
    try:
        settings = GenerationSettings(max_new_tokens=500, depth=2, ignore_eos=True)
        events = list(leader.chat(PROMPTS[0], settings))
        conn.send({"tokens": [t for e in events if isinstance(e, Tokens) for t in e.token_ids],
                   "reason": events[-1].reason, "limit": leader.context_limit})
    finally:
        leader.close()


def test_tensor_parallel_ranks_share_the_context_limit(ckpt, capped):
    # the follower must stop at the same cycle as rank 0: with another limit it would wait in a collective forever
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=capped_leader_main, args=(str(ckpt("next")), send))
    p.start()
    assert recv.poll(150), "the tensor-parallel session did not answer"
    out = recv.recv()
    p.join(60)
    assert p.exitcode == 0 and out["limit"] == 128 and out["reason"] == "length"
    prompt = capped.encode_chat(PROMPTS[0])
    assert len(prompt) + len(out["tokens"]) == 128
    single, _ = decode(capped, prompt, max_new_tokens=500, depth=2, ignore_eos=True)
    assert out["tokens"] == single

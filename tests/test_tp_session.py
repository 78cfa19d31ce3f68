"""The chat's tensor-parallel session: rank 0 leads, a follower process runs the same cycles (the warm-up's too);
a depth change and a stop decided on rank 0 mid-reply reach every rank at the same cycle."""

import multiprocessing as mp

import pytest

from engine import DecodeControl, GenerationSettings, load_engine
from engine.events import Cycle, Tokens

MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]


def leader_main(model, conn):
    from engine.tp_session import TPLeader

    leader = TPLeader(model, "cpu", None, 2)
    try:
        out = {}
        steps = []  # the chat's warm-up, on every rank (a rank-0-only one would hang in its first collective)
        out["warm_up"] = leader.warm_up(depths=[0, 2], progress=lambda done, total, what: steps.append(done))
        out["progress"] = steps
        control = DecodeControl(3)
        tokens, depths = [], []
        for ev in leader.chat(MESSAGES, GenerationSettings(max_new_tokens=24, depth=3, ignore_eos=True), control):
            if isinstance(ev, Tokens):
                tokens += ev.token_ids
            elif isinstance(ev, Cycle):
                depths.append(ev.depth)
                if ev.index == 2:
                    control.depth = 1  # mid-reply, on rank 0 only
        out["tokens"], out["depths"] = tokens, depths
        control = DecodeControl(2)
        n = 0
        for ev in leader.chat(MESSAGES, GenerationSettings(max_new_tokens=24, depth=2, ignore_eos=True), control):
            if isinstance(ev, Cycle):
                n += 1
                if n == 2:
                    control.stop()
        out["stopped_after"] = n
        conn.send(out)
    finally:
        leader.close()


def test_leader_and_follower_decode_the_same_reply(ckpt):
    model = str(ckpt("next"))
    single = load_engine(model)
    plain = [t for e in single.chat(MESSAGES, GenerationSettings(max_new_tokens=24, depth=0, ignore_eos=True))
             if isinstance(e, Tokens) for t in e.token_ids]
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=leader_main, args=(model, send))
    p.start()
    assert recv.poll(150), "the tensor-parallel session did not answer"
    out = recv.recv()
    p.join(60)
    assert p.exitcode == 0
    assert out["tokens"] == plain  # after the warm-up: the state it used is gone, the reply is exact
    assert out["warm_up"]["steps"] > 1 and out["progress"][-1] == out["warm_up"]["steps"]
    later = out["depths"][2:]  # from the next cycle on (the very last may be capped by max_new_tokens)
    assert out["depths"][:2] == [3, 3] and 1 in later and max(later) == 1
    assert out["stopped_after"] == 2  # the stop decided on rank 0 ended the reply on every rank

"""Time to first token across a long conversation, with committed-state reuse on and off.

    python packaging/bench/turns.py [--model M | --random-weights PRESET [--layers N]] [--turns 10]
                                    [--history-tokens 2000] [--json OUT]

With random weights there is no tokenizer: each turn appends the reply's token ids and 16 new "user" ids.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine import Finished, GenerationSettings, Tokens, load_engine

FILLER = ("Tell me more about rivers, mountains and the sea, and how the water moves between them over the "
          "seasons of the year. ")


def turn(events, turn_no: int, reuse: bool) -> tuple[list[int], str, dict]:
    """Consume one reply: its token ids, its text, and the row this script reports."""
    ids, text, fin = [], "", None
    for ev in events:
        if isinstance(ev, Tokens):
            ids += ev.token_ids
            text += ev.text
        elif isinstance(ev, Finished):
            fin = ev
    row = {"turn": turn_no, "reuse": reuse, "prompt_tokens": fin.stats["prompt_tokens"],
           "prefilled_tokens": fin.stats["prefilled_tokens"], "ttft_ms": fin.stats["ttft_ms"]}
    return ids, text, row


def conversation(engine, turns: int, history_tokens: int, reuse: bool) -> list[dict]:
    # a long first message so that the history is about `history_tokens` long from the first turn on
    first = FILLER * max(1, history_tokens // max(1, len(engine.encode_raw(FILLER))))
    messages, rows = [], []
    for n in range(1, turns + 1):
        messages.append({"role": "user", "content": first if n == 1 else f"And what about question {n}?"})
        settings = GenerationSettings(max_new_tokens=24, depth=2, reuse=reuse)
        _, text, row = turn(engine.chat(messages, settings), n, reuse)
        rows.append(row)
        messages.append({"role": "assistant", "content": text})
    return rows


def token_conversation(engine, turns: int, history_tokens: int, reuse: bool) -> list[dict]:
    """The same growth in token ids, for random-weight models: prompt + reply + a new user turn each time."""
    prompt, rows = [(11 * i) % 997 + 1 for i in range(history_tokens)], []
    for n in range(1, turns + 1):
        settings = GenerationSettings(max_new_tokens=24, depth=2, reuse=reuse, ignore_eos=True)
        reply, _, row = turn(engine.generate(prompt, settings), n, reuse)
        rows.append(row)
        prompt = prompt + reply + [(13 * n + j) % 997 + 1 for j in range(16)]
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    p.add_argument("--random-weights", metavar="PRESET")
    p.add_argument("--layers", type=int)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--history-tokens", type=int, default=2000)
    p.add_argument("--json")
    a = p.parse_args()
    if a.random_weights:
        from engine import Engine, random_model

        engine = Engine(random_model(a.random_weights, a.layers, None, None), None, set())
        run = token_conversation
    else:
        engine = load_engine(a.model)
        run = conversation
    # warm-up, not reported: first-use costs (kernel autotuning, JIT, graph capture) would land on whichever
    # conversation ran first (on the H200 they made the first reuse-on turn 41 s)
    run(engine, 2, a.history_tokens, False)
    rows = run(engine, a.turns, a.history_tokens, True) + run(engine, a.turns, a.history_tokens, False)
    for r in rows:
        if r["turn"] in (1, 5, 10):
            print(f"turn {r['turn']:>2} reuse {'on ' if r['reuse'] else 'off'} prompt {r['prompt_tokens']:>5} "
                  f"prefilled {r['prefilled_tokens']:>5} ttft {r['ttft_ms']:8.1f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": engine.info.path, "device": engine.info.device, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`mtpchat bench` on the CPU: the JSON contract of the speed report (its numbers are measured on the H200,
packaging/bench/), the oracle drafter's controlled acceptance, and the flags it refuses."""

from __future__ import annotations

import json

import pytest

from fixtures import write_checkpoint

from app.cli import main
from app.cmd_bench import ready_line

ROW_KEYS = {"depth", "drafter", "mode", "tokens_per_s", "speedup", "acceptance_rate", "mean_accepted_length",
            "per_position_acceptance", "phase_ms", "identical_to_plain"}


def test_bench_json_rows_and_baseline(ckpt, capsys):
    code = main(["bench", "--model", str(ckpt("next")), "--device", "cpu", "--depths", "0,2", "--drafter", "mtp,oracle",
                 "--acceptance", "1.0,0", "--max-new-tokens", "8", "--repeat", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    rows = {(r["depth"], r["drafter"]): r for r in out["results"]}
    assert set(rows) == {(0, "none"), (2, "mtp"), (2, "oracle@1"), (2, "oracle@0")}
    for r in rows.values():
        assert ROW_KEYS <= set(r) and r["tokens_per_s"] > 0 and r["identical_to_plain"] is True, r
        assert r["runs_tokens_per_s"] == [r["tokens_per_s"]]  # the one warm round's, kept for paired ratios
    full, none = rows[2, "oracle@1"], rows[2, "oracle@0"]
    assert full["acceptance_rate"] == 1.0 and full["per_position_acceptance"] == [1.0, 1.0]
    assert full["mean_accepted_length"] > 2.0  # 3 tokens per verify pass, the clipped last cycle aside
    assert none["acceptance_rate"] == 0.0 and none["mean_accepted_length"] == 1.0
    assert "verify" in rows[0, "none"]["phase_ms"] and "draft" in full["phase_ms"]
    # commit + the MTP head's refresh as a share of the cycle: the mtp row has both, the oracle rows only commit
    assert rows[0, "none"]["commit_refresh_share"] is None
    assert 0 < rows[2, "mtp"]["commit_refresh_share"] < 1 and "refresh" in rows[2, "mtp"]["phase_ms"]
    assert 0 < none["commit_refresh_share"] < 1 and "refresh" not in none["phase_ms"]
    assert out["hf_generate_tokens_per_s"] > 0 and out["plain_vs_hf"] > 0
    assert len(out["hf_generate_runs_tokens_per_s"]) == out["repeat"]  # every warm run kept: its spread is reported
    assert min(out["hf_generate_runs_tokens_per_s"]) <= out["hf_generate_tokens_per_s"]
    assert out["versions"]["torch"] and out["command"].startswith("mtpchat bench")
    assert out["load_s"] > 0 and out["warm_up_s"] is None  # load-to-ready: no warm-up on the CPU


def test_bench_says_when_a_model_has_no_mtp_head(tmp_path, capsys):
    plain = write_checkpoint(tmp_path / "no_mtp", mtp=False)
    code = main(["bench", "--model", str(plain), "--device", "cpu", "--depths", "0,1", "--drafter", "mtp",
                 "--max-new-tokens", "4", "--repeat", "1", "--no-hf", "--json"])
    captured = capsys.readouterr()
    assert code == 0 and "has no usable MTP head: no mtp rows" in captured.err
    assert [r["drafter"] for r in json.loads(captured.out)["results"]] == ["none"]


def test_bench_refuses_a_model_and_random_weights_together(ckpt, capsys):
    path = str(ckpt("next"))
    capsys.readouterr()  # (writing the fixture may print transformers' progress bars)
    code = main(["bench", "--model", path, "--random-weights", "tiny"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["mtpchat: error: --model and --random-weights: give one or the other"]


# --- bench --prompt-tokens: prefill, time to first token, memory and acceptance against the prompt's length ------


def test_bench_prompt_tokens_measures_every_length(ckpt, capsys):
    code = main(["bench", "--model", str(ckpt("next")), "--device", "cpu", "--prompt-tokens", "64,300", "--depths",
                 "0,2", "--drafter", "mtp", "--max-new-tokens", "6", "--repeat", "1", "--no-hf", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    rows = {(r["prompt_tokens"], r["depth"]): r for r in out["results"]}
    assert list(rows) == [(64, 0), (64, 2), (300, 0), (300, 2)]  # every row at each length, shortest first
    assert [p["tokens"] for p in out["prompts"]] == [64, 300] and all(p["text_copies"] >= 1 for p in out["prompts"])
    for (n, depth), r in rows.items():
        assert r["prefilled_tokens"] == n, r  # each run prefills the whole prompt: nothing reused from the last
        assert r["prefill_ms"] > 0 and abs(r["prefill_tokens_per_s"] - n / (r["prefill_ms"] / 1e3)) < 1e-6 * n
        assert r["ttft_ms"] >= r["prefill_ms"]  # the first token waits for the prefill
        assert r["peak_memory_bytes"] > 0 and r["peak_memory_of"] == "process max rss"
        assert "prefill" not in r["phase_ms"] and "priming" not in r["phase_ms"]  # once per request, not per cycle
        assert r["identical_to_plain"] is True
    for n in (64, 300):
        mtp = rows[n, 2]
        assert mtp["drafter"] == "mtp" and 0 <= mtp["acceptance_rate"] <= 1
        assert len(mtp["per_position_acceptance"]) == 2 and mtp["priming_ms"] > 0
        assert mtp["phase_ms"]["draft"] > 0 and mtp["phase_ms"]["refresh"] > 0


def test_bench_prompt_tokens_with_random_weights(capsys):
    code = main(["bench", "--random-weights", "tiny", "--device", "cpu", "--prompt-tokens", "64,300", "--depths", "0",
                 "--max-new-tokens", "4", "--repeat", "1", "--no-hf", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["prompts"] == [{"source": "synthetic ids", "tokens": 64},
                                            {"source": "synthetic ids", "tokens": 300}]
    assert [(r["prompt_tokens"], r["prefilled_tokens"]) for r in out["results"]] == [(64, 64), (300, 300)]


def test_the_ready_line_says_the_load_and_the_warm_up():
    assert ready_line({"load_s": 2.04, "warm_up_s": 10.26}) == (
        "load 2.0 s, warm-up 10.3 s (kernels, CUDA graphs): ready in 12.3 s")
    assert ready_line({"load_s": 0.44, "warm_up_s": None}) == "load 0.4 s (no warm-up on the CPU)"


def test_synthetic_ids_stay_inside_the_vocabulary():
    from app.cmd_bench import synthetic_ids

    ids = synthetic_ids(10_000, 4096)
    assert len(ids) == 10_000 and 1 <= min(ids) and max(ids) == 4095 and synthetic_ids(10_000, 4096) == ids
    assert synthetic_ids(32, 4096) == list(range(1, 33))  # the 32-token prompt bench always used


def test_long_text_prompt_is_exactly_n_tokens_and_ends_the_users_turn(engines):
    from app.bench_text import TEXT
    from app.cmd_bench import long_text_prompt, template_tail

    engine = engines("next")
    two_copies = 2 * len(engine.encode_raw(TEXT))
    tail = template_tail(engine)
    ending = engine.encode_chat([{"role": "user", "content": "x"}])[-tail:]
    assert tail >= 2  # end of the user's turn, the assistant's start
    for n in (1, tail, 64, two_copies):
        ids, copies = long_text_prompt(engine, n)
        assert len(ids) == n and ids[-min(n, tail):] == ending[-min(n, tail):], n
    text = engine.tokenizer.decode(long_text_prompt(engine, 64)[0])
    assert "Summarise the following text" in text and "Wenlow" in text
    assert long_text_prompt(engine, two_copies)[1] == 2  # the fewest copies of the text that reach the length


def test_bench_refuses_prompt_tokens_past_the_context(ckpt, capsys):
    code = main(["bench", "--model", str(ckpt("next")), "--device", "cpu", "--prompt-tokens", "64,4090",
                 "--max-new-tokens", "8", "--no-hf"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["mtpchat: error: --prompt-tokens 4090: with --max-new-tokens 8 it exceeds the "
                                 "context of 4096 tokens (at most 4088 prompt tokens here)"]
    # --max-context caps it: the engine's limit, not the config's
    code = main(["bench", "--model", str(ckpt("next")), "--device", "cpu", "--max-context", "256", "--prompt-tokens",
                 "64,300", "--max-new-tokens", "8", "--no-hf"])
    assert code == 2 and capsys.readouterr().err.strip().endswith("exceeds the context of 256 tokens (at most 248 "
                                                                 "prompt tokens here)")


def test_bench_refuses_a_presets_context_before_building_it(capsys, monkeypatch):
    import engine

    def never(*a, **k):
        raise AssertionError("the preset was built before its context was checked")

    monkeypatch.setattr(engine, "random_model", never)
    code = main(["bench", "--random-weights", "qwen3.5-27b", "--prompt-tokens", "200,262144"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["mtpchat: error: --prompt-tokens 262144: with --max-new-tokens 128 it exceeds the "
                                 "context of 262144 tokens (at most 262016 prompt tokens here)"]


@pytest.mark.parametrize("value, says", [("0", "must be at least 1, got 0"), ("-1", "must be at least 1, got -1"),
                                         ("abc", "expected a whole number, got 'abc'"),
                                         (",", "expected comma-separated whole numbers, e.g. 200,2048")])
def test_bench_refuses_bad_prompt_tokens(value, says, capsys):
    code = main(["bench", f"--prompt-tokens={value}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("mtpchat: error: argument --prompt-tokens: ")
    assert err[0].endswith(says), err


def test_bench_acceptance_profiles_are_rows_of_one_run(capsys):
    """Two --acceptance-profile values, ';'-separated: one row each per depth beside the flat rates; a profile of
    1.0 then 0 accepts exactly the first draft of each cycle, 'changing' drops from its easy to its hard half."""
    code = main(["bench", "--random-weights", "tiny", "--device", "cpu", "--depths", "0,3", "--drafter", "oracle",
                 "--acceptance", "1.0", "--acceptance-profile", "1,0,0;changing", "--max-new-tokens", "24",
                 "--repeat", "1", "--no-hf", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    rows = {(r["depth"], r["drafter"]): r for r in out["results"]}
    assert set(rows) == {(0, "none"), (3, "oracle@1"), (3, "oracle@1/0/0"), (3, "oracle@changing")}
    first = rows[3, "oracle@1/0/0"]
    assert first["per_position_acceptance"][0] == 1.0 and first["per_position_acceptance"][1] == 0.0
    changing = rows[3, "oracle@changing"]
    assert 0 < changing["acceptance_rate"] < rows[3, "oracle@1"]["acceptance_rate"]
    assert all(r["identical_to_plain"] for r in rows.values())


def test_bench_refuses_a_bad_acceptance_profile(capsys):
    code = main(["bench", "--random-weights", "tiny", "--acceptance-profile", "0.9,0.8;hard"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "--acceptance-profile 'hard'" in err[0], err


def test_the_oracles_draws_do_not_depend_on_the_draws_before_them():
    """Common random numbers: whether position i of a cycle starting at token j is accepted depends on (seed, j,
    i) only, so bench rows at different depths (and auto) meet the same luck; different seeds, other draws."""
    from engine.drafters import OracleDrafter

    def draws(order, seed=0):
        o = OracleDrafter([1] * 64, 0, 0.0, 100, seed=seed, profile=[0.9, 0.7, 0.5, 0.3])
        return {(j, i): o.correct(i, j, True) for j, i in order}

    keys = [(j, i) for j in range(40) for i in range(4)]
    forward, backward = draws(keys), draws(keys[::-1])
    assert forward == backward
    assert 0.75 < sum(forward[j, 0] for j in range(40)) / 40 <= 1.0  # about 0.9 at the first position
    assert draws(keys, seed=1) != forward

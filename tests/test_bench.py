"""`mtpchat bench` on the CPU: the JSON contract of the speed report (its numbers are measured on the H200,
packaging/bench/), the oracle drafter's controlled acceptance, and the flags it refuses."""

from __future__ import annotations

import json

from fixtures import write_checkpoint

from app.cli import main

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


def test_bench_says_when_a_model_has_no_mtp_head(tmp_path, capsys):
    plain = write_checkpoint(tmp_path / "no_mtp", mtp=False)
    code = main(["bench", "--model", str(plain), "--device", "cpu", "--depths", "0,1", "--drafter", "mtp",
                 "--max-new-tokens", "4", "--repeat", "1", "--no-hf", "--json"])
    captured = capsys.readouterr()
    assert code == 0 and "has no usable MTP head: no mtp rows" in captured.err
    assert [r["drafter"] for r in json.loads(captured.out)["results"]] == ["none"]


def test_bench_refuses_a_model_and_random_weights_together(ckpt, capsys):
    code = main(["bench", "--model", str(ckpt("next")), "--random-weights", "tiny"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["mtpchat: error: --model and --random-weights: give one or the other"]

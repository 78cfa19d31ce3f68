"""Tensor parallelism on the CPU (gloo, float32): --tp 2 and --tp 4 decode exactly what one device decodes.

One spawn of 4 worker processes runs everything multi-process: first two --tp 2 groups side by side (ranks 0-1
and 2-3, each on half of the fixtures), then --tp 4 over all four. The tiny fixtures have 4 query / 2 KV heads and
2 GDN key / 4 value heads, so --tp 4 exercises KV-head and GDN key-head replication; the `next_wide` variant
(8 / 4 / 4 / 8 heads) exercises several head groups per rank (the interleaved in_proj_qkvz) at --tp 2.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from engine import GenerationSettings, load_engine
from engine.drafters import OracleDrafter
from engine.errors import EngineError
from engine.events import Tokens
from engine.tp import ShardPlan, TPError, TPGroup, launch
from fixtures import write_checkpoint

PROMPT = [{"role": "user", "content": "Tell me a story about a cat."}]
WIDE = dict(num_attention_heads=8, num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=8)
VARIANTS = {"next_wide": ("qwen3_next", {"moe": True, "seed": 11, **WIDE})}
TP2 = [["next", "next_moe", "next_wide"], ["q35", "q35_moe"]]  # pair 0 (ranks 0-1), pair 1 (ranks 2-3)
TP4 = ["next", "next_moe", "q35", "q35_moe"]
N2, N4 = 12, 8  # new tokens per run at --tp 2 / --tp 4
CORRUPT = 0.4  # oracle drafts: partial acceptance
# (label, depth, drafter, extra settings); the same runs on one device give the references
RUNS2 = [("plain", 0, None, {})] + [(f"mtp{d}", d, "mtp", {}) for d in (1, 2, 3)] + \
        [(f"oracle{d}", d, "oracle", {}) for d in (1, 2, 3)] + \
        [("sampled", 2, "mtp", {"temperature": 0.8, "top_p": 0.9, "seed": 7})]
RUNS4 = [("plain", 0, None, {}), ("mtp1", 1, "mtp", {}), ("mtp3", 3, "mtp", {}), ("oracle2", 2, "oracle", {}),
         ("oracle3", 3, "oracle", {})]
UNSEEDED = ("unseeded", 2, "mtp", {"temperature": 1.0})  # no seed: ranks agree through a broadcast seed


class Recording:
    """The MTP drafter, recording what it proposes (drafts equal on N ranks and on one device = the sharded
    MTP head computes what the whole one does)."""

    name = "mtp"

    def __init__(self, inner):
        self.inner, self.drafts = inner, []

    def reset(self):
        self.inner.reset()

    def observe(self, hidden):
        self.inner.observe(hidden)

    def keep(self, hidden):
        return self.inner.keep(hidden)

    def observe_kept(self, kept):
        self.inner.observe_kept(kept)

    def prime(self, seq, upto):
        self.inner.prime(seq, upto)

    def rollback(self):
        self.inner.rollback()

    def propose(self, seq, k, timer, req=None):
        d, q = self.inner.propose(seq, k, timer, req)
        self.drafts.append(d.tolist())
        return d, q


def decode_runs(engine, runs, n, reference):
    """{label: {tokens, drafts, drafted, accepted}} for each run; `reference` feeds the oracle drafter."""
    prompt = engine.encode_chat(PROMPT)
    vocab = engine.trunk.config.vocab_size
    out = {}
    for label, depth, kind, extra in runs:
        drafter = None
        if kind == "mtp":
            drafter = Recording(engine.mtp_drafter)
        elif kind == "oracle":
            drafter = OracleDrafter(reference, len(prompt), CORRUPT, vocab, seed=depth)
        s = GenerationSettings(max_new_tokens=n, depth=depth, ignore_eos=True, reuse=False, **extra)
        events = list(engine.generate(prompt, s, drafter=drafter))
        st = events[-1].stats
        out[label] = {"tokens": [t for e in events if isinstance(e, Tokens) for t in e.token_ids],
                      "drafts": getattr(drafter, "drafts", None), "drafted": st["drafted"],
                      "accepted": st["accepted"]}
    return out


def weight_bytes(engine) -> int:
    """Parameter bytes of the trunk and the MTP head, without the (replicated) embedding."""
    mods = [engine.trunk.lm] + ([engine.loaded.mtp] if engine.loaded.mtp is not None else [])
    return sum(p.numel() * p.element_size() for m in mods for n, p in m.named_parameters() if "embed_tokens" not in n)


def _suite(args, group: TPGroup) -> int:
    """Every rank of the 4-process world: --tp 2 in two pairs, then --tp 4. Each rank writes what it saw."""
    import torch.distributed as dist

    rank = group.rank
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in order
    pair = TPGroup(rank % 2, 2, pairs[rank // 2], group.device)
    got = {"tp2": {}, "tp4": {}, "bytes2": {}, "bytes4": {}, "graphs4": {}}
    for name in TP2[rank // 2]:
        engine = load_engine(args["paths"][name], tp=pair)
        got["tp2"][name] = decode_runs(engine, RUNS2, N2, args["refs"][name])
        got["bytes2"][name] = weight_bytes(engine)
    for name in TP4:  # --tp 4 through the graph path (on the CPU a re-run stands in for each captured graph)
        engine = load_engine(args["paths"][name], tp=group, cuda_graphs=True)
        got["tp4"][name] = decode_runs(engine, RUNS4 + ([UNSEEDED] if name == "next_moe" else []), N4,
                                       args["refs"][name])
        got["bytes4"][name] = weight_bytes(engine)
        got["graphs4"][name] = [engine.graph_runner.report(), engine.mtp_drafter.graphs.report()]
    Path(args["out"], f"rank{rank}.json").write_text(json.dumps(got))
    return 0


@pytest.fixture(scope="module")
def paths(ckpt, tmp_path_factory):
    out = {name: str(ckpt(name)) for name in ("next", "next_moe", "q35", "q35_moe")}
    for name, (family, opts) in VARIANTS.items():
        out[name] = str(write_checkpoint(tmp_path_factory.mktemp(name), family, **opts))
    return out


@pytest.fixture(scope="module")
def single(paths, engines):
    """One device: the references (plain tokens, MTP drafts, parameter bytes)."""
    out = {}
    for name, path in paths.items():
        engine = engines(name) if name in ("next", "next_moe", "q35", "q35_moe") else load_engine(path)
        ref = decode_runs(engine, RUNS2[:1], N2, None)["plain"]["tokens"]
        out[name] = {"ref": ref, "runs2": decode_runs(engine, RUNS2, N2, ref),
                     "runs4": decode_runs(engine, RUNS4, N4, ref) if name in TP4 else None,
                     "bytes": weight_bytes(engine)}
    return out


@pytest.fixture(scope="module")
def multi(paths, single, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_out")
    t0 = time.perf_counter()
    rc = launch(_suite, {"paths": paths, "refs": {n: s["ref"] for n, s in single.items()}, "out": str(out)}, 4,
                "cpu", timeout_s=120)
    assert rc == 0
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    return ranks, time.perf_counter() - t0


def _check(got, want, label, n):
    assert got["tokens"] == want["tokens"], label
    assert len(got["tokens"]) == n


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_decodes_what_one_device_decodes(tp, multi, single):
    ranks, _ = multi
    runs, n = (RUNS2, N2) if tp == 2 else (RUNS4, N4)
    names = TP2[0] + TP2[1] if tp == 2 else TP4
    for name in names:
        leader = 0 if tp == 4 or name in TP2[0] else 2
        got, want = ranks[leader][f"tp{tp}"][name], single[name][f"runs{tp}"]
        for label, depth, kind, extra in runs:
            g, w = got[label], want[label]
            where = f"--tp {tp} {name} {label}"
            _check(g, w, where, n)
            if not extra:  # greedy: speculation at any depth decodes the plain greedy text
                assert g["tokens"] == single[name]["ref"][:n], where
            if kind == "mtp":  # the sharded MTP head proposes what the whole one proposes
                assert g["drafts"] == w["drafts"] and g["drafted"] > 0, where
            if kind == "oracle":  # partial acceptance: commit(m) with 0 < m < k happened
                assert 0 < g["accepted"] < g["drafted"], where
        # every rank of the group decoded the same tokens
        members = range(4) if tp == 4 else ((0, 1) if name in TP2[0] else (2, 3))
        for r in members:
            assert ranks[r][f"tp{tp}"][name] == got, f"rank {r} of --tp {tp} {name} diverged"


def test_tp_runs_its_steps_through_graphs(multi):
    """--tp 4 ran the trunk's verify steps and the MTP head's steps as (stand-in) graphs, collectives inside,
    with no capture failure on any rank."""
    ranks, _ = multi
    for r in ranks:
        for name, reports in r["graphs4"].items():
            for report in reports:
                # (how often the head's own graphs replay depends on how much its drafts are accepted)
                assert report["failure"] is None and sum(report["replays"].values()) >= 3, (name, report)


def test_unseeded_sampling_agrees_across_ranks(multi):
    ranks, _ = multi
    runs = [r["tp4"]["next_moe"]["unseeded"] for r in ranks]
    assert all(r == runs[0] for r in runs) and len(runs[0]["tokens"]) == N4


def test_per_rank_weights_are_a_shard(multi, single):
    ranks, _ = multi
    for name in TP2[0] + TP2[1]:
        members = (0, 1) if name in TP2[0] else (2, 3)
        for r in members:
            assert ranks[r]["bytes2"][name] < 0.7 * single[name]["bytes"], (name, r)
    for name in TP4:
        for r in range(4):  # KV and GDN key heads are replicated in the narrow fixtures
            assert ranks[r]["bytes4"][name] < 0.45 * single[name]["bytes"], (name, r)


# --- the shard plan, without processes ----------------------------------------------------------------------


def _meta_shapes(family, cfg):
    from engine.mtp import MTPHead

    with torch.device("meta"):
        lm = family.causal_lm_class()(cfg)
        head = MTPHead(MTPHead.layer_config(cfg, bool(getattr(cfg, "num_experts", 0))), family, 1)
    shapes = {k: tuple(v.shape) for k, v in lm.state_dict().items()}
    shapes.update({f"mtp.{k}": tuple(v.shape) for k, v in head.state_dict().items()})
    return shapes


@pytest.mark.parametrize("preset", ["qwen3.5-27b", "qwen3-next-80b-a3b"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_shard_plan_covers_real_shapes(preset, world):
    """At the released shapes: every rank's slice of every tensor has its local module's shape, and the ranks'
    slices together cover each sharded tensor."""
    from engine.families import SUPPORTED
    from engine.presets import PRESETS

    model_type, kw = PRESETS[preset]
    kw = dict(kw, num_hidden_layers=4, vocab_size=1000 + world // 2)  # uneven vocab: the last rank pads
    kw["layer_types"] = ["linear_attention"] * 3 + ["full_attention"]
    if kw.get("num_experts"):
        kw["num_experts"] = 8
    family = SUPPORTED[model_type]
    cfg = family.text_config({"model_type": model_type, **kw})
    full = _meta_shapes(family, cfg)
    covered: dict[str, set] = {}
    for rank in range(world):
        plan = ShardPlan(cfg, rank, world)
        local = _meta_shapes(family, plan.local_config)
        local["lm_head.weight"] = (plan.vrows, cfg.hidden_size)
        assert set(local) == set(full)
        for key, shape in full.items():
            sel = plan.selection(key, shape)
            if sel is None:
                assert local[key] == shape, key
                continue
            assert sel.shape(shape) == local[key], (key, rank)
            for a, b in sel.ranges:
                covered.setdefault(key, set()).update(range(a, b))
    for key, rows in covered.items():
        sel = ShardPlan(cfg, 0, world).selection(key, full[key])
        assert rows == set(range(full[key][sel.dim])), key


def test_shard_plan_refuses_what_does_not_split():
    from engine.families import SUPPORTED
    from engine.presets import PRESETS

    model_type, kw = PRESETS["qwen3-next-80b-a3b"]
    cfg = SUPPORTED[model_type].text_config({"model_type": model_type, **kw})
    with pytest.raises(EngineError, match="--tp 3: 16 attention heads are not divisible by 3"):
        ShardPlan(cfg, 0, 3)
    plan = ShardPlan(cfg, 5, 8)  # 2 KV heads over 8 ranks: replicated, rank 5 reads KV head 1
    assert plan.kv_heads == (1, 2) and plan.kv_replicated and plan.local_config.num_key_value_heads == 1


# --- launch: output, errors, a dying worker -----------------------------------------------------------------


def test_cli_run_tp2_json(paths, single, capfd):
    from app.cli import main

    argv = ["run", "--model", paths["next_moe"], "--prompt", PROMPT[0]["content"], "--max-new-tokens", "8",
            "--depth", "2", "--ignore-eos", "--device", "cpu", "--json", "--tp", "2"]
    assert main(argv) == 0
    lines = [line for line in capfd.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1  # rank 0 alone prints
    got = json.loads(lines[0])
    assert got["token_ids"] == single["next_moe"]["ref"][:8]
    tp = got["diagnostics"]["tensor_parallel"]
    assert tp["world"] == 2 and tp["backend"] == "gloo" and tp["shard"]["attention_heads"] == [0, 2]


def test_cli_error_is_one_line(capfd, paths, tmp_path):
    import shutil

    from app.cli import main

    # a missing folder is refused before any worker starts
    assert main(["run", "--model", "/nonexistent/model", "--prompt", "x", "--tp", "2", "--device", "cpu"]) == 2
    assert capfd.readouterr().err.strip().splitlines() == ["mtpchat: error: /nonexistent/model: no such model folder"]
    # a folder that every rank fails to load: the same error on each rank, said once
    shutil.copy(Path(paths["next"]) / "config.json", tmp_path / "config.json")
    assert main(["run", "--model", str(tmp_path), "--prompt", "x", "--tp", "2", "--device", "cpu"]) == 2
    err = [line for line in capfd.readouterr().err.strip().splitlines() if line.startswith("mtpchat")]
    assert len(err) == 1 and err[0].startswith(f"mtpchat: error: {tmp_path}"), err


def _die(args, group: TPGroup) -> int:
    group.barrier()
    if group.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    x = torch.ones(4)
    while True:  # rank 0 keeps reducing with a peer that is gone
        group.all_reduce(x)


def test_dying_worker_takes_the_group_down():
    t0 = time.perf_counter()
    with pytest.raises(TPError, match="rank 1 was killed by signal 9"):
        launch(_die, None, 2, "cpu", timeout_s=30)
    assert time.perf_counter() - t0 < 30

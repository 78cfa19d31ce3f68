"""Tensor parallelism on the CPU (gloo, float32): --tp 2 and --tp 4 decode exactly what one device decodes.

One spawn of 4 worker processes runs everything multi-process: first two --tp 2 groups side by side (ranks 0-1
and 2-3, each on half of the fixtures), then --tp 4 over all four. The tiny fixtures have 4 query / 2 KV heads and
2 GDN key / 4 value heads, so --tp 4 exercises KV-head and GDN key-head replication; the `next_wide` variant
(8 / 4 / 4 / 8 heads) exercises several head groups per rank (the interleaved in_proj_qkvz) at --tp 2.
"""

from __future__ import annotations

import json
import os
import re
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
from fixtures import _split_experts, write_checkpoint
from int4_fixtures import (awq_config, gptq_config, pack_along_k, pack_along_n, quantizable, quantize,
                           write_int4_checkpoint)

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


# --- 4-bit checkpoints (GPTQ / AWQ): each rank reads the packed words, groups and g_idx of its rows / columns ---

MOE_DYNAMIC = {"-:.*attn.*": {}, "-:.*shared_expert.*": {}, "-:.*visual.*": {}}
# name -> (source, quantization_config, modules left in bf16). At the fixtures' dims --tp 2 splits o_proj / out_proj's
# K = 64 into 32s, down_proj's 96 into 48s and the experts' 32 into 16s: whole groups of 16
INT4_TP = {
    "gptq_g16": ("q35", gptq_config(16), ()),  # Qwen's v1 layout, symmetric; GDN's [q | k | v] in sections
    # GPTQModel's v2, asymmetric, one group (every rank reads its scales and zeros whole), desc_act on
    "gptq_one_group": ("next", gptq_config(-1, sym=False, desc_act=True, fmt="gptq_v2"), ()),
    # MoE as Qwen3.5's MoE releases: 4-bit experts (int4.Int4Experts), each rank a slice of every expert
    "gptq_moe": ("q35_moe_split", gptq_config(16, sym=False, fmt="gptq_v2", dynamic=MOE_DYNAMIC),
                 ("attn", "shared_expert")),
}
# act-order over the whole K: the rows of o_proj's groups lie on both ranks
INT4_ACT = ("q35", gptq_config(16, desc_act=True), ())
# an AWQ release of the same model: its MTP head (--mtp-from) on gptq_g16's trunk, sliced in its own layout
INT4_AWQ = ("q35", awq_config(16, not_converted=["visual"]), ())
INT4_ENGINES = {name: (name, None) for name in INT4_TP} | {"gptq_g16+awq_head": ("gptq_g16", "awq")}
RUNS_INT4 = [("plain", 0, None, {}), ("mtp2", 2, "mtp", {}), ("oracle2", 2, "oracle", {})]
N_INT4 = 12


@pytest.fixture(scope="module")
def int4_paths(ckpt, tmp_path_factory):
    def source(name):
        if name != "q35_moe_split":
            return ckpt(name)
        path = write_checkpoint(tmp_path_factory.mktemp("q35_moe_split") / "src", "qwen3_5_moe", per_expert=True,
                                seed=3)
        _split_experts(path)  # the MTP head's experts too
        return path

    out = {}
    for name, (src, config, skip) in {**INT4_TP, "gptq_act": INT4_ACT, "awq": INT4_AWQ}.items():
        root = tmp_path_factory.mktemp(f"int4_{name}")
        out[name] = str(write_int4_checkpoint(source(src), root / "q", root / "twin", json.loads(json.dumps(config)),
                                              skip=skip, seed=1)[0])
    return out


def _int4_held(engine) -> list:
    """[packed bytes, how many 4-bit Linears, how many 4-bit experts modules] of the trunk and the MTP head."""
    from engine import int4

    mods = [m for m in (engine.trunk.lm, engine.loaded.mtp) if m is not None]
    kinds = [sum(isinstance(x, kind) for m in mods for x in m.modules())
             for kind in (int4.Int4Linear, int4.Int4Experts)]
    return [sum(int4.packed_bytes(m) for m in mods), *kinds]


def _int4_rank(args, group: TPGroup) -> int:
    got = {"runs": {}, "held": {}}
    for name, (path, head) in INT4_ENGINES.items():
        engine = load_engine(args["paths"][path], tp=group, mtp_from=head and args["paths"][head])
        got["runs"][name] = decode_runs(engine, RUNS_INT4, N_INT4, args["refs"][name])
        got["held"][name] = _int4_held(engine)
    try:
        load_engine(args["paths"]["gptq_act"], tp=group)
    except EngineError as e:
        got["act"] = str(e)
    Path(args["out"], f"rank{group.rank}.json").write_text(json.dumps(got))
    return 0


def test_tp2_over_4_bit_checkpoints_decodes_what_one_device_decodes(int4_paths, tmp_path):
    single = {}
    for name, (path, head) in INT4_ENGINES.items():
        engine = load_engine(int4_paths[path], mtp_from=head and int4_paths[head])
        ref = decode_runs(engine, RUNS_INT4[:1], N_INT4, None)["plain"]["tokens"]
        single[name] = {"ref": ref, "runs": decode_runs(engine, RUNS_INT4, N_INT4, ref), "held": _int4_held(engine)}
    assert launch(_int4_rank, {"paths": int4_paths, "refs": {n: s["ref"] for n, s in single.items()},
                               "out": str(tmp_path)}, 2, "cpu", timeout_s=120) == 0
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name, want in single.items():
        for label, _, kind, _ in RUNS_INT4:
            g, w = ranks[0]["runs"][name][label], want["runs"][label]
            where = f"--tp 2 {name} {label}"
            _check(g, w, where, N_INT4)
            assert g["tokens"] == want["ref"][:N_INT4], where  # speculation decodes the plain greedy text
            if kind == "mtp":  # the sharded 4-bit MTP head proposes what the whole one proposes
                assert g["drafts"] == w["drafts"] and g["drafted"] > 0, where
            if kind == "oracle":  # drafts accepted and rejected
                assert 0 < g["accepted"] < g["drafted"], where
        assert ranks[1]["runs"][name] == ranks[0]["runs"][name], f"rank 1 of {name} diverged"
        for r in ranks:  # each rank holds a shard of the packed tensors, in as many 4-bit modules (none dequantized)
            (got_bytes, *got_kinds), (want_bytes, *want_kinds) = r["held"][name], want["held"]
            assert 0 < got_bytes < 0.7 * want_bytes and got_kinds == want_kinds, (name, r["held"][name], want["held"])
    assert single["gptq_moe"]["held"][2] > 0  # (its experts stay 4-bit)
    for r in ranks:  # one line naming a row-parallel 4-bit weight (o_proj / out_proj / down_proj)
        assert re.fullmatch(r"--tp: 4-bit weight 'model\.language_model\.layers\.\d\.[a-z_]+\.(o|out|down)_proj': "
                            r"act-order \(desc_act\) put some of this rank's columns \[\d+, \d+\) of \d+ in groups "
                            r"other ranks hold, so its scales and zeros do not cover them; try another --tp or one "
                            r"device", r["act"]), r["act"]


def _tiny_plan(rank: int, world: int = 2, **over):
    from engine.families import SUPPORTED
    from fixtures import text_kwargs

    cfg = SUPPORTED["qwen3_5_text"].text_config({"model_type": "qwen3_5_text", **text_kwargs(**over)})
    return ShardPlan(cfg, rank, world)


def _packed(config: dict, name: str, w: torch.Tensor, perm=None) -> dict:
    """A module's checkpoint tensors in config's layout (int4_fixtures' packers)."""
    v1 = config["quant_method"] == "gptq" and config.get("checkpoint_format", "gptq") == "gptq"
    q, zeros, scales, g_idx = quantize(w, config["group_size"], config.get("sym", False), perm, min_zero=int(v1))
    if config["quant_method"] == "awq":
        parts = {"qweight": pack_along_n(q.T, awq=True), "qzeros": pack_along_n(zeros, awq=True)}
    else:
        parts = {"qweight": pack_along_k(q), "qzeros": pack_along_n(zeros - 1 if v1 else zeros), "g_idx": g_idx}
    return {f"{name}.{p}": t for p, t in {**parts, "scales": scales}.items()}


SLICED = [  # (module, [N, K]): column-parallel in sections (GDN's [q | k | v]), column- and row-parallel
    ("model.layers.0.linear_attn.in_proj_qkv", (128, 64)), ("model.layers.1.self_attn.q_proj", (128, 64)),
    ("model.layers.1.self_attn.o_proj", (64, 64)), ("model.layers.0.mlp.down_proj", (64, 96))]


@pytest.mark.parametrize("config", [gptq_config(16), gptq_config(-1, sym=False, desc_act=True, fmt="gptq_v2"),
                                    gptq_config(16, sym=False, desc_act=True, fmt="gptq_v2"), awq_config(16),
                                    awq_config(-1)],
                         ids=["gptq-v1-16", "gptq-v2-one-group-act", "gptq-v2-asym-16-act", "awq-16", "awq-one-group"])
def test_a_ranks_packed_slices_are_its_slice_of_the_weight(config):
    """Without processes: for each rank, the packed tensors read through int4.tp_slicer, converted as the loader
    converts them (int4.read_packed), dequantize to exactly the rank's rows / columns of the dequantized weight.
    Act-order permutes K at random (one group), or within each half of K (groups of 16: each rank's columns stay in
    its own groups, so its g_idx is renumbered, not refused)."""
    from engine import int4

    sch = int4.scheme(config)
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in SLICED:
        perm = None
        if config.get("desc_act"):
            halves = 1 if config["group_size"] == -1 else 2
            perm = torch.cat([h * (k // halves) + torch.randperm(k // halves, generator=g) for h in range(halves)])
        full = _packed(config, name, torch.randn(n, k, generator=g), perm)
        whole = int4.read_packed(sch, name, {key.rpartition(".")[2]: t for key, t in full.items()}, str).dequantized(
            torch.float32)
        rows = set()
        for rank in range(2):
            plan = _tiny_plan(rank)
            slicer = int4.tp_slicer(plan.selection, {key: tuple(t.shape) for key, t in full.items()}, sch)
            parts = {}
            for key, t in full.items():
                sel = slicer(key, tuple(t.shape))
                parts[key.rpartition(".")[2]] = t if sel is None else sel.read(t, tuple(t.shape))
            got = int4.read_packed(sch, name, parts, str).dequantized(torch.float32)
            sel = plan.selection(name + ".weight", (n, k))
            assert torch.equal(got, sel.read(whole, (n, k))), (name, rank)
            rows |= {(sel.dim, i) for a, b in sel.ranges for i in range(a, b)}
        assert len(rows) == (n if sel.dim == 0 else k), name  # (the plan splits the module)


def test_4_bit_splits_that_are_not_whole_groups_or_words_are_one_line():
    from engine import int4

    def select(config, name, n, k, rank=1, perm=None, **over):
        full = _packed(config, name, torch.randn(n, k), perm)
        slicer = int4.tp_slicer(_tiny_plan(rank, **over).selection, {key: tuple(t.shape) for key, t in full.items()},
                                int4.scheme(config))
        return {key.rpartition(".")[2]: slicer(key, tuple(t.shape)) for key, t in full.items()}, full

    down = "model.layers.0.mlp.down_proj"
    with pytest.raises(EngineError, match=r"^--tp: 4-bit weight 'model\.layers\.0\.mlp\.down_proj': this rank's "
                                          r"columns \[48, 96\) of 96 are not whole groups of 32, so its scales and "
                                          r"zeros cannot be split; try another --tp or one device$"):
        select(gptq_config(32), down, 64, 96)
    gate = "model.layers.0.mlp.gate_proj"  # intermediate 88: [44, 88) splits a word of 8 packed columns
    for config in (gptq_config(-1), awq_config(-1)):
        with pytest.raises(EngineError, match=r"^--tp: 4-bit weight 'model\.layers\.0\.mlp\.gate_proj': this rank's "
                                              r"rows \[44, 88\) of 88 are not multiples of 8, so its packed words "
                                              r"cannot be split; try another --tp or one device$"):
            select(config, gate, 88, 64, intermediate_size=88)
    # act-order: refused when g_idx is read, only where the rank's columns fall in other ranks' groups
    o_proj = "model.layers.1.self_attn.o_proj"
    scattered = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    sels, full = select(gptq_config(16, desc_act=True), o_proj, 64, 64, perm=scattered)
    with pytest.raises(EngineError, match=r"act-order \(desc_act\) put some of this rank's columns \[32, 64\) of 64"):
        sels["g_idx"].read(full[o_proj + ".g_idx"], (64,))
    within = torch.cat([torch.randperm(32), 32 + torch.randperm(32)])  # each rank's columns in its own groups
    sels, full = select(gptq_config(16, desc_act=True), o_proj, 64, 64, perm=within)
    local = sels["g_idx"].read(full[o_proj + ".g_idx"], (64,))  # renumbered to the rank's own groups 0 and 1
    assert sorted(local.tolist()) == [0] * 16 + [1] * 16 and not torch.equal(local, local.sort().values)


def test_bench_random_int4_weights_at_tp2(capfd):
    """bench --quant int4 --tp 2: each rank quantizes its own random shard (int4.quantize_linears), and the ranks
    decode together what they decode plainly."""
    from app.cli import main

    code = main(["bench", "--random-weights", "tiny", "--quant", "int4", "--tp", "2", "--device", "cpu", "--depths",
                 "0,2", "--drafter", "oracle", "--acceptance", "1.0", "--max-new-tokens", "6", "--repeat", "1",
                 "--no-hf", "--json"])
    lines = [line for line in capfd.readouterr().out.splitlines() if line.strip()]
    assert code == 0 and len(lines) == 1
    out = json.loads(lines[0])
    rows = {(r["depth"], r["drafter"]): r for r in out["results"]}
    assert rows[2, "oracle@1"]["identical_to_plain"] is True and rows[2, "oracle@1"]["acceptance_rate"] == 1.0
    assert out["backends"]["int4_linear"] == "dequantize" and out["tensor_parallel"]["world"] == 2


@pytest.mark.parametrize("preset", ["qwen3.5-27b", "qwen3-next-80b-a3b"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_4_bit_slices_fit_the_local_modules_at_real_shapes(preset, world):
    """At the released shapes in GPTQ's layout with groups of 128 (Qwen's -GPTQ-Int4): every packed tensor's slice
    has the shape the rank's local module packs to, or the split is refused in one line (80B-A3B's 512-wide experts
    at --tp 8: 64 columns a rank, half a group)."""
    from engine import int4
    from engine.families import SUPPORTED
    from engine.presets import PRESETS

    def packed(shapes):
        out = {}
        for key, (n, k) in shapes.items():
            base, g = key.removesuffix(".weight"), int4.n_groups(k, 128)
            out.update({base + ".qweight": (k // 8, n), base + ".qzeros": (g, n // 8), base + ".scales": (g, n),
                        base + ".g_idx": (k,)})
        return out

    model_type, kw = PRESETS[preset]
    kw = dict(kw, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
    if kw.get("num_experts"):
        kw["num_experts"] = 2
    family = SUPPORTED[model_type]
    cfg = family.text_config({"model_type": model_type, **kw})
    sch = int4.scheme(gptq_config(128))

    def linears(c):  # the weights a GPTQ release quantizes, by name
        return {k: s for k, s in _meta_shapes(family, c).items() if quantizable(k, torch.empty(s, device="meta"))}

    full = packed(linears(cfg))
    refused = preset == "qwen3-next-80b-a3b" and world == 8
    for rank in range(world):
        plan = ShardPlan(cfg, rank, world)
        local = packed(linears(plan.local_config))
        slicer = int4.tp_slicer(plan.selection, full, sch)
        try:
            for key, shape in full.items():
                sel = slicer(key, shape)
                assert (shape if sel is None else sel.shape(shape)) == local[key], (key, rank)
        except EngineError as e:
            assert refused and "are not whole groups of 128" in str(e) and "\n" not in str(e), str(e)
            continue
        assert not refused

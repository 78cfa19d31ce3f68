"""The cycle graphs' bookkeeping in Triton kernels (engine/cycle_triton.py) against its torch form (graphs.settle,
gdn.keep_first's first_rows and window_at, sampling.accept_greedy): the count of tokens kept, the position and
last token, the stash's rows from n on made no-ops and the conv windows moved, then the recurrence over them; the
packed greedy acceptance; equal, not close, since the kernels only compare, select and copy. They run on CUDA with Triton, or on the CPU through Triton's interpreter
under TRITON_INTERPRET=1; the compile for sm_90 runs without either."""

import itertools
import random

import pytest
import torch

from engine import cycle_triton
from engine.gdn import VerifyStash, keep_first
from engine.graphs import STOPS, Ahead, settle
from engine.kernels import Backends


@pytest.fixture(scope="module")
def device(triton_device):  # conftest.py: CUDA, or the interpreter on the CPU
    return triton_device


DIMS = {"nk": 2, "dk": 8, "nv": 4, "dv": 8, "conv": 48, "kernel": 4}  # (a small stash beside the settle)


def pending(device, width: int, m: int, targets: list[int], stop_ids) -> Ahead:
    a = Ahead(8, 16, torch.bfloat16, device)
    a.pos.fill_(100)
    a.last.fill_(7)
    a.prev[: 1 + width] = torch.tensor([m, *targets], device=device)
    a.set_stops(frozenset(stop_ids))
    return a


@pytest.mark.parametrize("width", [1, 2, 4, 5, 8])
def test_settle_is_the_torch_form(device, width):
    """Every m from nothing pending (-1) to all accepted, with no stop id, one in an accepted row, one in a
    rejected row, two in accepted rows, and a full set of stop ids."""
    rng = random.Random(width)
    cuts = 0
    for m, case in itertools.product(range(-1, width), range(5)):
        targets = [rng.randrange(3, 50) for _ in range(width)]
        accepted = targets[: m + 1] or [999]
        stop_ids = [(), (rng.choice(accepted),), (targets[-1] if m < width - 1 else 998,),
                    tuple(accepted[:2]), tuple(range(60, 60 + STOPS - 1)) + (accepted[-1],)][case]
        want, got = pending(device, width, m, targets, stop_ids), pending(device, width, m, targets, stop_ids)
        n_want = settle(want, width)
        cycle_triton.first_rows_(got.n, VerifyStash(2, width, DIMS, torch.bfloat16, device), width,
                                 torch.zeros(2, DIMS["conv"], DIMS["kernel"] - 1, dtype=torch.bfloat16, device=device),
                                 (got.prev, got.stops, got.pos, got.last))
        n_got = got.n
        assert n_got.dtype == n_want.dtype == torch.long
        assert (n_got.item(), got.pos.item(), got.last.item()) == (n_want.item(), want.pos.item(), want.last.item())
        cuts += 0 < n_want.item() < m + 1
        if m == -1:
            assert n_got.item() == 0 and got.pos.item() == 100 and got.last.item() == 7
    assert cuts > 0 or width < 3  # (some cases cut the accepted run after an EOS)


@pytest.mark.parametrize("width, stashed", [(4, 4), (5, 8)])
def test_keep_first_with_the_kernel_is_the_torch_form(device, width, stashed):
    """The whole commit (rows made no-ops, the recurrence, the conv window) at every n, over a stash as wide as
    the commit and one wider; the rows' old values are large, so that one left in would show."""
    from engine.cache import GDNState

    dims = {"nk": 2, "dk": 16, "nv": 4, "dv": 16, "conv": 2 * 32 + 64, "kernel": 4}
    torch_form, kernel = Backends(), Backends()
    kernel.cycle = "triton"
    gen = torch.Generator(device=device).manual_seed(width)
    for n in range(width + 1):
        stash = VerifyStash(3, stashed, dims, torch.float32, device)
        for t in (stash.q, stash.k, stash.v, stash.window):
            t.copy_(torch.randn(t.shape, generator=gen, device=device))
        stash.k.div_(stash.k.norm(dim=-1, keepdim=True))  # (the kernel's inputs after their L2 norm)
        stash.q.div_(stash.q.norm(dim=-1, keepdim=True))
        stash.g.copy_(-torch.rand(stash.g.shape, generator=gen, device=device))
        stash.beta.copy_(torch.rand(stash.beta.shape, generator=gen, device=device))
        states = []
        for backends in (torch_form, kernel):
            state = GDNState(3, dims["conv"], dims["kernel"], dims["nv"], dims["dk"], dims["dv"], torch.float32,
                             device)
            state.conv.copy_(torch.randn(state.conv.shape, generator=torch.Generator(device=device).manual_seed(1),
                                         device=device))
            state.recurrent.copy_(torch.randn(state.recurrent.shape,
                                              generator=torch.Generator(device=device).manual_seed(2), device=device))
            before = state.recurrent.clone()
            keep_first(state, stash, torch.tensor(n, device=device), width, backends)
            states.append((state.conv.clone(), state.recurrent.clone()))
            assert torch.equal(state.recurrent, before) == (n == 0)
        assert torch.equal(states[0][0], states[1][0]) and torch.equal(states[0][1], states[1][1])
        if n < width:  # the kernel zeroed the rows from n on in place
            assert not stash.beta[:, n:width].any() and not stash.v[:, n:width].any()


@pytest.mark.parametrize("T", [1, 2, 4, 5, 8])
def test_accept_is_the_torch_form(device, T):
    """Every count of accepted drafts, 0 to all, and drafts equal to a later target (only the prefix counts), with
    the rows' argmax in the kernel and torch's."""
    from types import SimpleNamespace

    from engine.sampling import accept_greedy

    gen = torch.Generator(device=device).manual_seed(T)
    for m in range(T):
        logits = torch.randn(T, 300, generator=gen, device=device)
        targets = logits.argmax(-1)
        drafts = targets[: T - 1].clone()
        if m < T - 1:
            drafts[m] = (drafts[m] + 1) % 300  # the first rejection
            drafts[m + 1 :] = targets[m + 1 : T - 1]  # (later drafts that match count for nothing)
        tokens = torch.cat([torch.tensor([7], device=device), drafts]).view(1, T)
        want = accept_greedy(logits, tokens)
        for argmax in ("triton", "torch"):  # (the argmax in the packing's launch; torch's, then the packing)
            got = cycle_triton.accept(logits, tokens, SimpleNamespace(argmax=argmax))
            assert got.dtype == want.dtype == torch.long and torch.equal(got, want) and got[0].item() == min(m, T - 1)


def test_the_self_check_passes(device):
    assert cycle_triton._self_check(device)


def test_argmax_is_torchs_into_its_place_and_torchs_where_not_chosen(device):
    """The kernel (ties: the first column, in a block and across blocks; float32 and bf16) and the dispatch: into a
    given place of a row of tokens, torch's form where the backend is torch or the place is not contiguous."""
    from types import SimpleNamespace

    assert cycle_triton.argmax_is_torchs(device)
    x = torch.randn(1, 5000, device=device).to(torch.bfloat16)
    row = torch.zeros(1, 6, dtype=torch.long, device=device)
    for backend in ("triton", "torch"):
        row.zero_()
        cycle_triton.argmax(x, SimpleNamespace(argmax=backend), out=row[0, 2:3])
        assert row[0, 2] == x.argmax() and not row[0, :2].any() and not row[0, 3:].any()
    cols = torch.zeros(6, 2, dtype=torch.long, device=device)  # (a column: not contiguous)
    cycle_triton.argmax(x.expand(6, -1).contiguous(), SimpleNamespace(argmax="triton"), out=cols[:, 1])
    assert bool((cols[:, 1] == x.argmax()).all()) and not cols[:, 0].any()


def test_the_torch_form_stays_without_cuda():
    backends = Backends()
    cycle_triton.install(backends, torch.device("cpu"), 300)
    assert backends.cycle == "torch" and backends.choice["cycle"][0] == "torch" and backends.argmax == "torch"
    assert "not CUDA" in backends.choice["cycle"][1] or "triton not installed" in backends.choice["cycle"][1]


def test_the_kernels_compile_for_a_gpu():
    """Triton's interpreter never type-checks or lowers a kernel as the compiler does (tests/triton_front.py)."""
    pytest.importorskip("triton")
    from triton_front import compile_for_gpu

    for fused, logits in ((False, "*fp32"), (True, "*fp32"), (True, "*bf16")):
        compile_for_gpu("engine.cycle_triton", "_accept_kernel",
                        {"targets_ptr": "*i64", "tokens_ptr": "*i64", "out_ptr": "*i64", "also_ptr": "*i64",
                         "x_ptr": logits, "lock_ptr": "*i32", "stride": "i64"},
                        {"T": 5, "BT": 8, "ALSO": True, "ARGMAX": fused, "BLOCK": cycle_triton.ARGMAX_BLOCK,
                         "PDL": True}, num_warps=8 if fused else 1)
    for dtype in ("*fp32", "*bf16"):
        compile_for_gpu("engine.cycle_triton", "_argmax_kernel", {"x_ptr": dtype, "out_ptr": "*i64", "stride": "i64"},
                        {"BLOCK": cycle_triton.ARGMAX_BLOCK, "PDL": True}, num_warps=8)
    types = {"n_ptr": "*i64", "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*bf16",
             "window_ptr": "*bf16", "conv_ptr": "*bf16", "prev_ptr": "*i64", "stops_ptr": "*i64", "pos_ptr": "*i64",
             "last_ptr": "*i64"}
    for settling in (True, False):  # (the cycle graph's commit with its settle; the rows alone)
        compile_for_gpu("engine.cycle_triton", "_first_rows_kernel", types,
                        {"W": 8, "K1": 3, "BLOCK": cycle_triton.BLOCK, "SETTLE": settling, "BW": 8, "S": STOPS,
                         "PDL": True}, num_warps=4)


def test_cycle_graphs_with_the_kernels_decode_exactly(device):
    """The demo model's cycle graphs (on the CPU, graphs.Rerun's re-runs) with the kernels' commit, acceptance and
    argmax: greedy depth 1 and 3 equal plain decoding, with drafts accepted and rejected and cycle graphs replayed,
    and cuts after an EOS (a reply that ends mid-cycle); the plain step's graph with the argmax kernel too."""
    from engine import load_engine
    from test_exactness import decode
    from test_graphs import DEMO

    # (float32 on CUDA too: in 16 bits eager passes and graph steps run other kernels and round apart)
    eager = load_engine(DEMO, device=str(device), dtype="float32")
    graphs = load_engine(DEMO, device=str(device), dtype="float32", cuda_graphs=True)
    graphs.trunk.backends.cycle = graphs.trunk.backends.argmax = "triton"
    prompt = graphs.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    plain = decode(eager, prompt, None, depth=0, max_new_tokens=40)[0]
    assert decode(graphs, prompt, None, depth=0, max_new_tokens=40)[0] == plain
    for depth in (1, 3):
        tokens, _, fin = decode(graphs, prompt, None, depth=depth, max_new_tokens=40)
        assert tokens == plain
        assert fin.stats["drafted"] > fin.stats["accepted"] > 0
        cycles = graphs.diagnostics()["compile"]["cuda_graphs"]["cycle"]
        assert cycles["failure"] is None and cycles["replays"][str(depth + 1)] > 2
    # a stop id the reply reaches: the cycle graph after it cuts there, as plain decoding stops there
    for at in (12, 25):
        graphs.stop_ids = frozenset({plain[at]})
        tokens, _, fin = decode(graphs, prompt, None, depth=3, max_new_tokens=40, ignore_eos=False)
        assert tokens == plain[: plain.index(plain[at]) + 1] and fin.reason == "eos"

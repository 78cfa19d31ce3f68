"""The cycle graphs' bookkeeping (graphs.GraphRunner.cycle, .verified) in Triton launches instead of about
thirty-five torch ops, each a graph node of ~2 us on a small model (the demo's depth-3 cycle held ~300):

- `first_rows_`, with `settling`: from the pending acceptance [m, targets] and the stop ids, the count n of
  tokens to keep (cut after an EOS, as speculative.finish cuts), the committed position moved by n and the last
  committed token updated (graphs.settle's torch form: arange, comparisons, any, argmax, where, index_select,
  copies), and in the same launch (two until stop 70) the verify stash's rows from n on made no-ops in place
  (gdn.first_rows' g = beta = k = v = 0) and each GDN layer's conv window moved to the one ending at token n
  (gdn.window_at), for all layers at once; the recurrence over the stash is then FLA's one launch, as before
  (gdn.keep_first);
- `accept`: greedy acceptance packed from the target's argmax (sampling.accept_greedy's comparison, cast,
  cumprod, sum and cat), in the argmax's launch where the argmax kernel is chosen (its last row program packs);
- `argmax`: greedy decoding's token, a program a row (torch's reduction took 4.9-5.4 us a call at the demo's
  8,192-token vocabulary on the H100, cycle_demo_gdn68_h100.json: about four calls a depth-3 cycle, one a plain
  step); chosen where it is timed faster than torch's at load, for the model's vocabulary (a long one loops).

They only compare, select and copy: they equal the torch forms exactly, which the self-check at load asserts.
Zeroing the stash in place is safe because the graph's verify pass writes it again before anything reads it.
"""

from __future__ import annotations

import torch

from .kernels import self_checked
from .splitk import counters, pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the module still imports, install() says why not
    triton = None

BLOCK = 1024  # columns a program: the 27B shape's 10,240 conv channels in 10 programs a layer
ARGMAX_BLOCK = 8192  # logits a step of argmax's loop (the demo's whole vocabulary in one)


if triton is not None:
    from .splitk import after_previous

    @triton.jit
    def _settled(prev_ptr, stops_ptr, W: tl.constexpr, BW: tl.constexpr, S: tl.constexpr):
        """(n, targets, rows): n = the first accepted row holding a stop id, plus one, else m + 1 (m = -1: nothing
        pending, n = 0)."""
        rows = tl.arange(0, BW)
        m = tl.load(prev_ptr)
        targets = tl.load(prev_ptr + 1 + rows, mask=rows < W, other=-2)
        stops = tl.load(stops_ptr + tl.arange(0, S))
        hit = tl.max((targets[:, None] == stops[None, :]).to(tl.int32), axis=1) > 0
        stop = hit & (rows <= m) & (rows < W)
        first = tl.min(tl.where(stop, rows, BW), axis=0)
        return tl.where(first < BW, (first + 1).to(tl.int64), m + 1), targets, rows

    @triton.jit
    def _settle_into(prev_ptr, stops_ptr, pos_ptr, last_ptr, n_ptr, W: tl.constexpr, BW: tl.constexpr,
                     S: tl.constexpr):
        """n (stored, and returned); pos += n; last = targets[n - 1] where n > 0."""
        n, targets, rows = _settled(prev_ptr, stops_ptr, W, BW, S)
        tl.store(n_ptr, n)
        tl.store(pos_ptr, tl.load(pos_ptr) + n)
        token = tl.sum(tl.where(rows == n - 1, targets, 0), axis=0)
        tl.store(last_ptr, tl.where(n > 0, token, tl.load(last_ptr)))
        return n

    @triton.jit
    def _zero_rows(base, row_stride, R, n, W: tl.constexpr, cols):
        """Rows n .. W-1 of one layer's [W, R] block (unit stride along R): columns `cols` set to zero."""
        for r in range(n, W):
            tl.store(base + r * row_stride + cols, tl.zeros(cols.shape, tl.float32), mask=cols < R)

    @triton.jit
    def _first_rows_kernel(n_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, window_ptr, conv_ptr, sk_l, sk_t, RK, sv_l, sv_t,
                           RV, sg_l, sg_t, sb_l, sb_t, RG, sw_l, sw_c, sc_l, sc_c, C, prev_ptr, stops_ptr, pos_ptr,
                           last_ptr, W: tl.constexpr, K1: tl.constexpr, BLOCK: tl.constexpr, SETTLE: tl.constexpr,
                           BW: tl.constexpr, S: tl.constexpr, PDL: tl.constexpr = False):
        """Program (layer, part, column block): part 0-3 zero rows n.. of k, v, g, beta; part 4 copies the conv
        window's columns n .. n + K1 - 1 into the conv state (nothing where n = 0: the state is kept). SETTLE:
        every program finds n from the pending acceptance as _settle_kernel does, the first one stores it and
        moves pos and last (the settle's launch folded into this one); else n is read from n_ptr."""
        after_previous(PDL)
        layer = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
        if SETTLE:
            if (tl.program_id(0) == 0) & (part == 0) & (tl.program_id(2) == 0):
                n = _settle_into(prev_ptr, stops_ptr, pos_ptr, last_ptr, n_ptr, W, BW, S)
            else:
                n = _settled(prev_ptr, stops_ptr, W, BW, S)[0]
        else:
            n = tl.load(n_ptr)
        if part == 0:
            _zero_rows(k_ptr + layer * sk_l, sk_t, RK, n, W, cols)
        elif part == 1:
            _zero_rows(v_ptr + layer * sv_l, sv_t, RV, n, W, cols)
        elif part == 2:
            _zero_rows(g_ptr + layer * sg_l, sg_t, RG, n, W, cols)
        elif part == 3:
            _zero_rows(beta_ptr + layer * sb_l, sb_t, RG, n, W, cols)
        elif n > 0:
            src = window_ptr + layer * sw_l + cols * sw_c + n
            dst = conv_ptr + layer * sc_l + cols * sc_c
            for j in tl.static_range(K1):
                tl.store(dst + j, tl.load(src + j, mask=cols < C), mask=cols < C)


    @triton.jit
    def _accept_kernel(targets_ptr, tokens_ptr, out_ptr, also_ptr, x_ptr, lock_ptr, V, stride, T: tl.constexpr,
                       BT: tl.constexpr, ALSO: tl.constexpr, ARGMAX: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
        """out = [m, targets (T), drafts (T - 1)]: m = the drafts (tokens 1..T-1) equal to the targets before the
        first that is not; ALSO: [m, targets] into also_ptr too. ARGMAX: a program per row of the logits x_ptr
        [T, V] writes its row's target (_row_argmax) and the last to arrive (lock_ptr counts them, as
        splitk.store_tile's tiles) packs the acceptance: the target's argmax and the acceptance in one launch;
        else one program over targets_ptr [T]."""
        after_previous(PDL)
        if ARGMAX:
            row = tl.program_id(0)
            tl.store(out_ptr + 1 + row, _row_argmax(x_ptr + row.to(tl.int64) * stride, V, BLOCK).to(tl.int64))
            tl.debug_barrier()  # the row's target is written before the count is released
            last = tl.atomic_add(lock_ptr, 1, sem="acq_rel") == T - 1
        else:
            last = tl.program_id(0) == 0
        if last:
            i = tl.arange(0, BT)
            if ARGMAX:  # (from L2, where the other programs' targets are)
                targets = tl.load(out_ptr + 1 + i, mask=i < T, other=-1, cache_modifier=".cg")
            else:
                targets = tl.load(targets_ptr + i, mask=i < T, other=-1)
            drafts = tl.load(tokens_ptr + 1 + i, mask=i < T - 1, other=-1)
            m = tl.min(tl.where((targets != drafts) | (i >= T - 1), i, T - 1), axis=0).to(tl.int64)
            tl.store(out_ptr, m)
            tl.store(out_ptr + 1 + i, targets, mask=i < T)
            tl.store(out_ptr + 1 + T + i, drafts, mask=i < T - 1)
            if ALSO:
                tl.store(also_ptr, m)
                tl.store(also_ptr + 1 + i, targets, mask=i < T)
            if ARGMAX:
                tl.atomic_xchg(lock_ptr, 0)

    @triton.jit
    def _row_argmax(x_ptr, V, BLOCK: tl.constexpr):
        """The first column of the row's largest value (torch.argmax's choice among ties), int32."""
        cols = tl.arange(0, BLOCK)
        best = tl.full((), float("-inf"), tl.float32)
        at = tl.full((), 0, tl.int32)
        for start in range(0, V, BLOCK):
            x = tl.load(x_ptr + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            top = tl.max(x, 0)
            where = start + tl.argmax(x, 0, tie_break_left=True).to(tl.int32)
            at = tl.where(top > best, where, at)  # (a later block's tie keeps the earlier column)
            best = tl.maximum(best, top)
        return at

    @triton.jit
    def _argmax_kernel(x_ptr, out_ptr, V, stride, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """out[row] = _row_argmax of x's row."""
        after_previous(PDL)
        row = tl.program_id(0).to(tl.int64)
        tl.store(out_ptr + row, _row_argmax(x_ptr + row * stride, V, BLOCK).to(tl.int64))


def argmax(x: torch.Tensor, backends, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.argmax(x, -1) [...] (written into out, of as many elements, where given), by the kernel where
    backends.argmax is "triton" (x's rows contiguous)."""
    if (backends is None or backends.argmax != "triton" or x.stride(-1) != 1
            or (out is not None and not out.is_contiguous())):
        return torch.argmax(x, -1) if out is None else torch.argmax(x, -1, out=out.view(x.shape[:-1]))
    return _argmax_rows(x, out)


def _argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's launch: argmax over the last dim of x (rows of unit stride) into out (contiguous) or a new
    tensor."""
    V = x.shape[-1]
    rows = x.reshape(-1, V)
    out = torch.empty(x.shape[:-1], dtype=torch.long, device=x.device) if out is None else out
    _argmax_kernel[(rows.shape[0],)](rows, out, V, rows.stride(0), BLOCK=ARGMAX_BLOCK, num_warps=8, **pdl(rows))
    return out


def accept(logits: torch.Tensor, tokens: torch.Tensor, backends, also: torch.Tensor | None = None) -> torch.Tensor:
    """sampling.accept_greedy from the target's logits [T, V] and the verified tokens [1, T] (t_n, then the T - 1
    drafts; contiguous): [m, targets, drafts] [2T] (long), its first 1 + T written into `also` too where given (a
    cycle graph's Ahead.prev: no copy after). One launch where backends.argmax is "triton" (the rows' argmax in
    it), else torch's argmax and the packing's launch."""
    T = logits.shape[0]
    out = torch.empty(2 * T, dtype=torch.long, device=logits.device)
    fused = backends.argmax == "triton" and logits.stride(-1) == 1
    targets = out if fused else torch.argmax(logits, -1)
    lock = counters(logits.device) if fused else out  # (a counter only where the rows' programs arrive)
    _accept_kernel[(T if fused else 1,)](targets, tokens, out, out if also is None else also, logits, lock,
                                         logits.shape[-1], logits.stride(0), T=T, BT=triton.next_power_of_2(T),
                                         ALSO=also is not None, ARGMAX=fused, BLOCK=ARGMAX_BLOCK,
                                         num_warps=8 if fused else 1, **pdl(out))
    return out


def first_rows_(n: torch.Tensor, stash, width: int, conv: torch.Tensor, settling=None) -> None:
    """gdn.first_rows over the stash's first `width` rows, in place, and conv [L, C, K1] = gdn.window_at's window,
    where n > 0, in one launch. settling = (prev, stops, pos, last): settle's too, in the same launch (n written
    by it: a cycle graph's commit in one launch where it took two)."""
    prev, stops, pos, last = (n, n, n, n) if settling is None else settling  # (pointers never read without it)
    k, v, g, beta, window = stash.k, stash.v, stash.g, stash.beta, stash.window
    L, C, K1 = conv.shape
    assert conv.stride(-1) == 1 and window.stride(-1) == 1  # (the buffers are allocated contiguous)
    rk, rv, rg = k[0, 0].numel(), v[0, 0].numel(), g.shape[-1]
    grid = (L, 5, triton.cdiv(max(rk, rv, C), BLOCK))
    _first_rows_kernel[grid](n, k, v, g, beta, window, conv, k.stride(0), k.stride(1), rk, v.stride(0), v.stride(1),
                             rv, g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), rg, window.stride(0),
                             window.stride(1), conv.stride(0), conv.stride(1), C, prev, stops, pos, last, W=width,
                             K1=K1, BLOCK=BLOCK, SETTLE=settling is not None, BW=triton.next_power_of_2(width),
                             S=stops.shape[0] if settling is not None else 1, num_warps=4, **pdl(conv))


def why_not(device: torch.device) -> str | None:
    """Why the bookkeeping keeps its torch form here (None: the kernels may run): graphs are CUDA's alone."""
    if triton is None:
        return "triton not installed"
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not CUDA"
    return None


def _self_check(device) -> bool:
    """The kernels against the torch forms (graphs.settle, gdn.keep_first's first_rows and window_at,
    sampling.accept_greedy), over a small stash of two layers: nothing pending, every draft accepted, a cut after
    an EOS, a rejection; acceptance of none, some and all drafts."""
    from types import SimpleNamespace

    from .gdn import VerifyStash, first_rows, window_at
    from .graphs import Ahead, settle as settle_torch
    from .sampling import accept_greedy

    width, dims = 4, {"nk": 2, "dk": 8, "nv": 4, "dv": 8, "conv": 48, "kernel": 4}
    gen = torch.Generator(device=device).manual_seed(0)
    for m, targets, stop_ids in ((-1, [5, 6, 7, 8], ()), (3, [5, 6, 7, 8], (2,)), (3, [5, 2, 7, 8], (2, 9)),
                                 (1, [5, 6, 7, 8], (6,)), (0, [9, 6, 7, 8], ())):
        a, b = (Ahead(width, 8, torch.bfloat16, device) for _ in range(2))
        for x in (a, b):
            x.pos.fill_(40)
            x.last.fill_(3)
            x.prev[: 1 + width] = torch.tensor([m, *targets], device=device)
            x.set_stops(frozenset(stop_ids))
        want = settle_torch(a, width)
        stash = VerifyStash(2, width, dims, torch.bfloat16, device)
        for t in (stash.k, stash.v, stash.g, stash.beta, stash.window):
            t.copy_(torch.randn(t.shape, generator=gen, device=device))
        conv = torch.randn(2, dims["conv"], dims["kernel"] - 1, generator=gen, device=device).to(torch.bfloat16)
        keep = first_rows(want, width, stash.k, stash.v, stash.g, stash.beta)
        conv_want = torch.where(want > 0, window_at(stash.window, want, conv.shape[-1]), conv)
        first_rows_(b.n, stash, width, conv, (b.prev, b.stops, b.pos, b.last))
        if not (torch.equal(b.n, want) and torch.equal(a.pos, b.pos) and torch.equal(a.last, b.last)):
            return False
        if not all(torch.equal(x, y) for x, y in zip(keep + (conv_want,), (stash.k, stash.v, stash.g, stash.beta,
                                                                          conv))):
            return False
    for T, drafts in ((1, []), (2, [4]), (4, [5, 6, 1]), (5, [5, 6, 7, 8])):
        logits = torch.nn.functional.one_hot(torch.tensor([5, 6, 7, 8, 9][:T], device=device), 10).float()
        tokens = torch.tensor([[3, *drafts]], device=device)
        want = accept_greedy(logits, tokens)
        for argmax in ("torch", "triton"):
            also = torch.full((8,), -7, dtype=torch.long, device=device)
            got = accept(logits, tokens, SimpleNamespace(argmax=argmax), also)
            if not (torch.equal(got, want) and torch.equal(also[: 1 + T], want[: 1 + T])
                    and bool((also[1 + T:] == -7).all())):
                return False
    return True


def argmax_is_torchs(device) -> bool:
    """The argmax kernel against torch.argmax: float32 and bf16 rows, ties (the first column wins) inside a block
    and across two of them."""
    gen = torch.Generator(device=device).manual_seed(1)
    for V in (300, ARGMAX_BLOCK + 300):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(5, V, generator=gen, device=device).to(dtype)
            x[1, 250] = x[1, 20] = x[1].max() + 1  # a tie in one block
            x[2, V - 3] = x[2, 7] = x[2].max() + 1  # across blocks where V is past one
            out = torch.full((5,), -1, dtype=torch.long, device=device)
            if not (torch.equal(_argmax_rows(x), x.argmax(-1)) and torch.equal(_argmax_rows(x, out), x.argmax(-1))):
                return False
    return True


def install(backends, device: torch.device, vocab: int | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
    """backends.cycle = "triton" where the kernels may run and equal the torch forms at load (error 0; anything
    else is inf); the reason in backends.choice["cycle"] either way. Then backends.argmax = "triton" where the
    argmax kernel, timed in a CUDA graph over a row of `vocab` logits in dtype, beats torch's."""
    from .splitk import fastest

    why, _ = self_checked(why_not(torch.device(device)), "cycle", "MTPCHAT_CYCLE_KERNELS",
                          lambda: 0.0 if _self_check(device) else float("inf"))
    if why is None:
        backends.cycle = "triton"
        backends.choice["cycle"] = ("triton", "graphs' greedy acceptance and cycle graphs' commit of the cycle "
                                              "before them in Triton kernels (self-check: equal to the torch form)")
    else:
        backends.choice["cycle"] = ("torch", f"graphs' acceptance and commit as torch ops ({why})")
        return
    if vocab is None:
        return
    pick, why = "torch", "the kernel's self-check failed"
    try:  # (its own verdict: a failure here leaves the bookkeeping's kernels on)
        if argmax_is_torchs(device):
            x = torch.randn(1, vocab, device=device).to(dtype)
            pick = fastest(["torch", "triton"], lambda c: _argmax_rows(x) if c == "triton" else x.argmax(-1))
            why = f"the faster over {vocab} logits in a CUDA graph"
    except Exception as e:
        pick, why = "torch", f"Triton argmax failed: {type(e).__name__}: {str(e)[:120]}"
    backends.argmax = pick
    backends.choice["argmax"] = (pick, f"greedy tokens by {'a Triton kernel' if pick == 'triton' else 'torch'}"
                                       f" ({why})")

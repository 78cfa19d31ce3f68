"""The Gated DeltaNet mixer at run time: prefill, verify with a stash, and the accepted-prefix replay.

Prefill writes the committed state directly (chunked kernel); a graph's prefill pass padded past the prompt
(graphs.GraphRunner.prefill) makes its padding rows exact no-ops, so it needs no stash either. Verify (any width,
depth 0 included) reads the committed state, writes nothing to it, and stashes the exact kernel inputs (q, k, v,
g, beta after the short convolution) plus the conv-input window. commit(m) then rebuilds the state after m + 1
processed tokens by replaying the recurrence from the pre-verify state over the first m + 1 stashed rows — all
GDN layers in one batched kernel call — and slices the conv window. Rows of a recurrence never depend on later
rows, so the result is independent of the rejected tail, bit for bit.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F

from .cache import GDNState, new_serial
from . import fp8
from .conv_triton import MAX_WIDTH, conv_gates
from .fusion import linears, whole
from .int4 import Int4Linear
from .kernels import split_qkv, store_conv_state


class VerifyStash:
    """Reusable storage for one verify pass over all GDN layers (no allocation per cycle)."""

    def __init__(self, layers: int, width: int, dims: dict, dtype, device):
        L, T = layers, width
        self.key = (layers, width, dtype, device)
        self.serial = new_serial()
        self.q = torch.empty(L, T, dims["nk"], dims["dk"], dtype=dtype, device=device)
        self.k = torch.empty_like(self.q)
        self.v = torch.empty(L, T, dims["nv"], dims["dv"], dtype=dtype, device=device)
        self.g = torch.empty(L, T, dims["nv"], dtype=torch.float32, device=device)
        self.beta = torch.empty(L, T, dims["nv"], dtype=dtype, device=device)
        self.window = torch.empty(L, dims["conv"], dims["kernel"] - 1 + T, dtype=dtype, device=device)
        self.final = torch.empty(L, dims["nv"], dims["dk"], dims["dv"], dtype=torch.float32, device=device)
        self.width = 0  # tokens stashed by the current verify pass; 0 = nothing to commit

    def rows(self, i: int) -> tuple:
        """GDN layer i's stash rows (q, k, v, g, beta, window, final): views, like the caches' layer views."""
        return self.q[i], self.k[i], self.v[i], self.g[i], self.beta[i], self.window[i], self.final[i]

    def fits(self, layers: int, width: int, dtype, device) -> bool:
        """Buffers are dropped when the state dtype or device changes, or a wider verify is needed."""
        L, T, dt, dev = self.key
        return L == layers and width <= T and dt == dtype and dev == device


def project(mixer, x: torch.Tensor):
    """Input projections in either checkpoint layout -> conv input [1, C, T], z [1, T, Hv, Dv], b, a [1, T, Hv]."""
    if hasattr(mixer, "in_proj_qkvz"):  # (outputs in [q | k | v | z] and [b | a] order: keep_constants)
        names, (nk, dk, nv, dv) = ("in_proj_qkvz", "in_proj_ba"), heads(mixer)
        parts = [2 * nk * dk + nv * dv, nv * dv, nv, nv]
        order = getattr(mixer, "qkvzba_order", None)  # None: the weights' rows are in that order already
        both = whole(mixer, names, x)
        if both is not None:  # one matmul
            mixed, z, b, a = (both if order is None else both.index_select(-1, order)).split(parts, -1)
        else:
            qkvz, ba = linears(mixer, names, x)
            if order is not None:
                qkvz, ba = qkvz.index_select(-1, mixer.qkvz_order), ba.index_select(-1, mixer.ba_order)
            (mixed, z), (b, a) = qkvz.split(parts[:2], -1), ba.split(parts[2:], -1)
        z = z.view(x.shape[0], x.shape[1], nv, dv)
    else:
        mixed, z, b, a = linears(mixer, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), x)
        z = z.reshape(x.shape[0], x.shape[1], -1, mixer.head_v_dim)
    return mixed.transpose(1, 2), z, b, a


# Decode and verify widths run the short conv as products summed over the kernel: on the CPU mkldnn's depthwise
# conv costs 127 us a call at one token (10% of the demo model's decode step), and compiled code fuses the
# products with their neighbours where F.conv1d stays an extern kernel (4.4 us against 1.3 us a layer on the
# H200, 27B shape). Prefill keeps F.conv1d: the products would materialise C x T x K values.
SHORT_CONV_AS_PRODUCTS = 64


def heads(mixer) -> list[int]:
    return [mixer.num_k_heads, mixer.head_k_dim, mixer.num_v_heads, mixer.head_v_dim]


def keep_constants(layers) -> None:
    """What each GDN mixer's steps would otherwise compute anew, kept once at load (before fusion.fuse_all):
    - the decay rate -exp(A_log) and dt_bias in float32: every step computed the first and converted the gate input
      to float32 apart, three launches a layer; the same float32 values as transformers' -A_log.float().exp() *
      softplus(a.float() + dt_bias);
    - Qwen3-Next's projection order: in_proj_qkvz and in_proj_ba interleave [q | k | v | z] and [b | a] per key-head
      group, which transformers' fix_query_key_value_ordering and the concatenation of q, k, v undo with seven
      copies a layer each pass (six strided, one cat). The weights' output rows are put in [q | k | v | z] and
      [b | a] order here instead, so a pass copies nothing: each output column is the same dot product as before
      (equal up to the matmul's tiling, which may differ with the rows' order), and the mixer's
      fix_query_key_value_ordering only splits (the module's own forward, the bench's transformers baseline,
      still works). Where a layout cannot move its rows (an FP8 projection whose parts are not whole 128-row
      scale blocks) the column indices are kept instead and `project` gathers with them: a launch of 2-6 us a
      projection at the demo model's widths on an H100, 17% of its plain step's kernel time for the two
      (packaging/bench/cycle_demo_63_h100.json)."""
    for layer in layers:
        mixer = getattr(layer, "linear_attn", None)
        if mixer is None:
            continue
        mixer.register_buffer("decay_rate", -mixer.A_log.float().exp(), persistent=False)
        mixer.register_buffer("dt_bias_f32", mixer.dt_bias.float(), persistent=False)
        if hasattr(mixer, "in_proj_qkvz"):
            nk, dk, nv, dv = heads(mixer)
            r, device = nv // nk, mixer.A_log.device
            qkvz = _group_columns(nk, [dk, dk, r * dv, r * dv]).to(device)
            ba = _group_columns(nk, [r, r]).to(device)
            if movable(mixer.in_proj_qkvz, qkvz) and movable(mixer.in_proj_ba, ba):
                reorder_rows(mixer.in_proj_qkvz, qkvz)
                reorder_rows(mixer.in_proj_ba, ba)
                mixer.fix_query_key_value_ordering = functools.partial(split_in_order, mixer)
                continue
            mixer.register_buffer("qkvz_order", qkvz, persistent=False)
            mixer.register_buffer("ba_order", ba, persistent=False)
            mixer.register_buffer("qkvzba_order", torch.cat([qkvz, ba + qkvz.shape[0]]), persistent=False)


def movable(linear, order: torch.Tensor) -> bool:
    """Whether reorder_rows can put linear's outputs in `order`: a 16-bit or float32 Linear, a 4-bit one, an FP8 one
    where `order` moves whole 128-row blocks (each has one scale row)."""
    if isinstance(linear, fp8.FP8Linear):
        return _block_starts(order) is not None
    return isinstance(linear, Int4Linear) or type(linear) is torch.nn.Linear


def reorder_rows(linear, order: torch.Tensor) -> None:
    """linear's output features put in `order` (output j becomes the old output order[j]), in place, in its own
    format (movable): a weight's rows (and bias), an FP8 weight's rows with its scale rows, a 4-bit weight's
    columns with their zeros and scales."""
    if isinstance(linear, fp8.FP8Linear):
        _take(linear.weight.data, 0, order)
        _take(linear.weight_scale_inv, 0, _block_starts(order) // fp8.BLOCK)
    elif isinstance(linear, Int4Linear):  # (qweight [K/8, N], zeros [G, N], scales [G, N]: N is the columns)
        for t in (linear.qweight, linear.zeros, linear.scales):
            _take(t, 1, order)
    else:
        _take(linear.weight.data, 0, order)
        if linear.bias is not None:
            _take(linear.bias.data, 0, order)


def _block_starts(order: torch.Tensor) -> torch.Tensor | None:
    """The first index of each 128 in `order` where it moves whole, aligned 128-row blocks; else None."""
    if order.shape[0] % fp8.BLOCK:
        return None
    blocks = order.view(-1, fp8.BLOCK)
    whole = (blocks[:, 0] % fp8.BLOCK == 0).all() and (blocks == blocks[:, :1] + torch.arange(
        fp8.BLOCK, device=order.device)).all()
    return blocks[:, 0] if bool(whole) else None


def _take(t: torch.Tensor, dim: int, index: torch.Tensor) -> None:
    """t <- t.index_select(dim, index), in place (FP8 bytes moved as bytes: index_select has no FP8 kernels)."""
    raw = t.view(torch.uint8) if t.element_size() == 1 else t
    raw.copy_(raw.index_select(dim, index))


def split_in_order(mixer, qkvz: torch.Tensor, ba: torch.Tensor) -> tuple:
    """transformers' fix_query_key_value_ordering for outputs keep_constants put in order: (query, key [.., Hk, Dk],
    value, z [.., Hv, Dv], b, a [.., Hv]), splits only."""
    nk, dk, nv, dv = heads(mixer)
    q, k, v, z = qkvz.split([nk * dk, nk * dk, nv * dv, nv * dv], -1)
    b, a = ba.split([nv, nv], -1)
    lead = qkvz.shape[:-1]
    return q.reshape(*lead, nk, dk), k.reshape(*lead, nk, dk), v.reshape(*lead, nv, dv), z.reshape(*lead, nv, dv), b, a


def _group_columns(groups: int, parts: list[int]) -> torch.Tensor:
    """Columns of a per-group interleaved layout [g0: p0 | p1 | .. , g1: p0 | p1 | ..] in part-major order
    [p0 of every group | p1 of every group | ..]."""
    starts = torch.arange(groups).view(groups, 1) * sum(parts)
    offsets = [0] + list(itertools.accumulate(parts))[:-1]
    return torch.cat([(starts + o + torch.arange(p)).reshape(-1) for o, p in zip(offsets, parts)])


def kernel_inputs(mixer, window: torch.Tensor, T: int, b, a, out: tuple = (None, None)):
    """Short causal conv over [K-1 past inputs | T new inputs] -> qkv [1, T, C] (split_qkv), g, beta. out: where
    g and beta go ([1, T, Hv] each: a verify pass's stash rows), None for new tensors."""
    w, bias = mixer.conv1d.weight, mixer.conv1d.bias  # [C, 1, K]
    if T <= SHORT_CONV_AS_PRODUCTS:
        conv = (window.unfold(-1, w.shape[-1], 1) * w[:, None, 0]).sum(-1)
        conv = F.silu(conv if bias is None else conv + bias[:, None])
    else:
        conv = F.silu(F.conv1d(window, w, bias, groups=w.shape[0]))  # [1, C, T]
    beta = torch.sigmoid(b, out=out[1])
    # (a + the float32 dt_bias: a is promoted to float32 inside the one kernel, exactly as a.float() would)
    g = torch.mul(mixer.decay_rate, F.softplus(a + mixer.dt_bias_f32), out=out[0])
    return conv.transpose(1, 2), g, beta


def fused(backends, T: int) -> bool:
    """Whether a pass of T tokens takes conv_triton's one launch for its short conv and gates: decode and verify
    widths where the self-check passed at load, and not while torch.compile traces (inductor fuses the torch form
    with its neighbours)."""
    return backends.short_conv == "triton" and T <= MAX_WIDTH and not torch.compiler.is_compiling()


def output(mixer, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    shape = z.shape
    y = mixer.norm(core.reshape(-1, core.shape[-1]), z.reshape(-1, z.shape[-1]))  # gated norm: plain w·x
    return mixer.out_proj(y.reshape(shape[0], shape[1], -1))


def first_rows(n: torch.Tensor, width: int, *tensors) -> tuple:
    """Kernel inputs [*, width, ...] with the rows from n on (n: a tensor on the device) zeroed: g = 0 (no decay),
    beta = k = v = 0 (nothing added), so those rows leave the recurrent state exactly as it was, whatever they
    held. Rows of a recurrence never depend on later rows: the rows below n are unchanged too."""
    keep = torch.arange(width, device=n.device) < n
    return tuple(torch.where(keep.view(width, *[1] * (t.dim() - 2)), t, 0) for t in tensors)


def window_at(window: torch.Tensor, n: torch.Tensor, k1: int) -> torch.Tensor:
    """The conv state after the first n tokens of a conv-input window [..., K-1 + T]: its columns n .. n+K-2."""
    return window.index_select(-1, n + torch.arange(k1, device=n.device))


def prefill(mixer, x, backends, conv, recurrent, real: torch.Tensor | None = None) -> torch.Tensor:
    """conv [C, K-1], recurrent [1, Hv, Dk, Dv]: this layer's committed state, written here. real: a padded pass
    (a prefill graph's): how many of its rows are the prompt's, a tensor on the device; the state is left where
    those rows end (the padding's rows made no-ops: first_rows)."""
    T = x.shape[1]
    mixed, z, b, a = project(mixer, x)
    kernel = backends.gdn_chunk if T > 1 else backends.gdn_recurrent
    if real is None and fused(backends, T):  # plain decoding: the conv cache updated by the same launch
        qkv = mixed.new_empty(1, T, mixed.shape[1])
        g, beta = b.new_empty(b.shape, dtype=torch.float32), torch.empty_like(b, memory_format=torch.contiguous_format)
        dims = heads(mixer)
        conv_gates(mixer, mixed[0], conv, b[0], a[0], *(t[0] for t in split_qkv(qkv, dims)), g[0], beta[0],
                   store_state=True)
        return output(mixer, kernel.update(qkv, g, beta, recurrent, dims), z)
    window = torch.cat([conv.unsqueeze(0), mixed.to(conv.dtype)], -1)
    qkv, g, beta = kernel_inputs(mixer, window, T, b, a)
    if real is not None:
        qkv, g, beta = first_rows(real, T, qkv, g, beta)
    core = kernel.update(qkv, g, beta, recurrent, heads(mixer))
    if real is None:
        store_conv_state(conv, window)
    else:
        conv.copy_(window_at(window[0], real, conv.shape[-1]))
    return output(mixer, core, z)


def verify(mixer, x, conv, recurrent, backends, rows: tuple) -> torch.Tensor:
    """Reads the committed state (conv, recurrent), writes only this layer's stash rows (VerifyStash.rows)."""
    T = x.shape[1]
    K1 = conv.shape[-1]
    sq, sk, sv, sg, sbeta, swindow, sfinal = rows
    mixed, z, b, a = project(mixer, x)
    window = swindow[:, : K1 + T]
    if fused(backends, T):  # window, stash rows and gates in one launch
        conv_gates(mixer, mixed[0], conv, b[0], a[0], sq[:T], sk[:T], sv[:T], sg[:T], sbeta[:T], window=window)
        g, beta = sg[:T].unsqueeze(0), sbeta[:T].unsqueeze(0)
    else:
        window[:, :K1] = conv
        window[:, K1:] = mixed[0]
        qkv, g, beta = kernel_inputs(mixer, window.unsqueeze(0), T, b, a, (sg[:T].unsqueeze(0),
                                                                          sbeta[:T].unsqueeze(0)))
        q, k, v = split_qkv(qkv, heads(mixer))
        for buf, t in zip((sq, sk, sv), (q, k, v)):
            buf[:T] = t[0]
    # The kernel reads q, k, v from the stash: contiguous rows, where they are strided views of the conv output
    # that the FLA kernel would copy again (three launches a layer). (Verify widths are a few tokens,
    # limits.MAX_DEPTH + 1 at most: the recurrent kernel; prefill takes the chunked.)
    core = backends.gdn_recurrent.verify(*(buf[:T].unsqueeze(0) for buf in (sq, sk, sv)), g, beta, recurrent,
                                         sfinal.unsqueeze(0))
    return output(mixer, core, z)


def keep_rows(state: GDNState, stash: VerifyStash, n: int, backends) -> None:
    """state <- the state after the first n stashed tokens: the recurrence replayed from the committed state (all
    GDN layers share one shape, dtype and device: they live in one tensor, so one grouped kernel call, with the
    layers as the batch dimension), and the conv window that ends at token n. Nothing is replayed when the
    whole verify pass is kept: its final state is copied."""
    if n == stash.width:
        state.recurrent.copy_(stash.final)
    else:
        backends.gdn_recurrent.update_rows(
            stash.q[:, :n], stash.k[:, :n], stash.v[:, :n], stash.g[:, :n], stash.beta[:, :n], state.recurrent
        )
    state.conv.copy_(stash.window[:, :, n : n + state.conv.shape[-1]])


def keep_first(state: GDNState, stash: VerifyStash, n: torch.Tensor, width: int, backends, settling=None) -> None:
    """keep_rows with n on the device (a tensor [], 0 <= n <= width; 0 keeps the state as it is), for a graph that
    commits without the host (graphs.GraphRunner.cycle): the recurrence replayed over the first `width` stashed
    rows, those from n on made no-ops (g = 0: no decay; beta = k = v = 0: nothing added, exactly, whatever the
    rows held), and the conv window that ends at token n. backends.cycle == "triton": the rows zeroed and the
    window moved in place by one launch (cycle_triton.first_rows_; the graph's verify rewrites the stash after),
    which with `settling` (cycle_triton.first_rows_'s) also settles n (graphs.settle's launch folded into it)."""
    rows = tuple(t[:, :width] for t in (stash.k, stash.v, stash.g, stash.beta))
    if backends.cycle == "triton":
        from .cycle_triton import first_rows_

        first_rows_(n, stash, width, state.conv, settling)
    else:
        rows = first_rows(n, width, *rows)
        state.conv.copy_(torch.where(n > 0, window_at(stash.window, n, state.conv.shape[-1]), state.conv))
    backends.gdn_recurrent.update_rows(stash.q[:, :width], *rows, state.recurrent)


def commit(state: GDNState, stash: VerifyStash, m: int, backends, keep_rows=keep_rows) -> None:
    """Keep the first m + 1 verified tokens. keep_rows: `keep_rows` or a stand-in with its signature
    (GraphRunner.keep_rows: the same, as a graph per n)."""
    n, T = m + 1, stash.width
    if not 0 < n <= T:  # a caller's bug: replaying rows no verify pass wrote would silently corrupt the state
        raise RuntimeError(f"commit of {n} token(s) after a verify pass of {T}")
    keep_rows(state, stash, n, backends)
    stash.width = 0

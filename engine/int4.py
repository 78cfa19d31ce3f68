"""4-bit weight-only checkpoints (W4A16): GPTQ and AWQ (GEMM layout), with their per-group scales and zeros.

The layouts, as checked against public sources (AutoGPTQ's / GPTQModel's packers and `dynamic` rules, vLLM's
gptq / gptq_marlin / awq loaders and get_dynamic_override, AutoAWQ's WQLinear_GEMM packer as GPTQModel and lmdeploy
unpack it, model cards of the community Qwen3.5 / 3.6 GPTQ releases) — a Linear [N out, K in] is stored as:

- GPTQ: `qweight` int32 [K/8, N], packed along K: input row 8i+j is bits 4j..4j+3 of qweight[i] (low nibble
  first); `qzeros` int32 [G, N/8], packed along N the same way; `scales` float16 [G, N]; `g_idx` int32 [K], the
  group of each input row (k // group_size without act-order; with desc_act the rows were quantized in a
  permuted order, and g_idx says which group each one fell in). G = ceil(K / group_size), one group when
  group_size is -1. The weight is (q - zero) * scale. checkpoint_format "gptq" (v1, AutoGPTQ) stores zero - 1
  (so a stored nibble n means zero n + 1, 1..16, as every v1 runtime reads it); "gptq_v2" (GPTQModel) stores the
  zero itself. sym: zero 8 (v1 stores 7, 0x77777777 per int32).
- AWQ GEMM: `qweight` int32 [K, N/8] and `qzeros` int32 [G, N/8], both packed along N in AWQ's interleaved order
  (nibble i of a word holds column [0, 2, 4, 6, 1, 3, 5, 7][i] of its 8; so column j is nibble
  [0, 4, 1, 5, 2, 6, 3, 7][j]); `scales` float16 [G, N]; zero_point true (zeros stored as they are); no g_idx.
- config.json quantization_config: {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": true,
  "desc_act": false, "checkpoint_format": "gptq", ...} (Qwen's -GPTQ-Int4 releases; GPTQModel may add `dynamic`,
  regexes over module names, "-:" excluding a module, "+:" or none overriding settings, the first match wins, as
  vLLM reads them; Qwen3.5's MoE releases exclude .*attn.*, .*shared_expert.*, .*mtp.*, .*visual.*), or
  {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm",
  "modules_to_not_convert": [...]} (names of modules, matched here as whole dotted components).

Which modules are quantized is what the tensors say (a `.qweight` beside the others, or a plain `.weight`); a
quantized tensor in a module the config excludes is refused (config and weights disagree).

At load every quantized Linear becomes an Int4Linear holding one layout for both formats: `qweight` int32
[K/8, N] packed along K (GPTQ's; a GPTQ tensor without act-order is kept as stored), zeros unpacked as uint8
[G, N] (0..16: v1's 16 does not fit a nibble), scales as stored. With act-order the rows are sorted by group at load
(`perm`: sorted row i is input row perm[i]), so each group is contiguous, as a kernel reads it. The forward
dequantizes in float32 — exact: (q - zero) is a small integer and the float16 scale has 11 significant bits — then
runs F.linear in the activation's dtype, rows back in the input's order, so on the CPU in float32 the engine
computes what transformers computes on the exactly-dequantized twin. Per-expert MoE weights
(experts.J.{gate,up,down}_proj) stay 4-bit too: their fused experts module becomes an Int4Experts holding every
expert's tensors in the same layout, stacked (gate and up side by side in columns), act-order rows sorted per expert
and projection; each routed expert is dequantized (exactly, in float32) when it runs, as fp8.FP8Experts does. Only
where one stacked tensor cannot hold them (an experts module mixing plain and 4-bit experts, or group sizes / scale
dtypes that differ between experts) are they dequantized at load to the model dtype, as are quantized tensors of
other modules that are not a plain Linear (GDN projections whose packing the loader converts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .errors import EngineError
from .modules import DequantizingExperts, child, plain_linear

METHODS = ("gptq", "awq")
BITS = 4
PACK = 32 // BITS  # 4-bit values per int32
PARTS = ("qweight", "qzeros", "scales", "g_idx")
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its 8
AWQ_COLUMN_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)  # column j is nibble AWQ_COLUMN_NIBBLE[j] (its inverse)
_SHIFTS = tuple(range(0, 32, BITS))


@dataclass(frozen=True)
class Scheme:
    """What config.json's quantization_config says about the 4-bit tensors."""

    method: str  # "gptq" | "awq"
    group_size: int  # -1: one group over all of K
    sym: bool
    desc_act: bool
    v1_zeros: bool  # GPTQ checkpoint_format "gptq": stored zero = zero - 1
    not_converted: tuple[str, ...] = ()  # modules_to_not_convert
    dynamic: tuple[tuple[str, dict], ...] = ()  # GPTQModel's (pattern, overrides), in order

    def excluded(self, module: str) -> str | None:
        """Why config.json says `module` (a checkpoint name) is not quantized, or None."""
        for pattern, _ in self.dynamic:
            negative = pattern.startswith("-:")
            if re.match(pattern[2:] if pattern[:2] in ("-:", "+:") else pattern, module):
                return f"dynamic {pattern!r}" if negative else None
        hit = next((n for n in self.not_converted if n and _names_part(n, module)), None)
        return f"modules_to_not_convert {hit!r}" if hit else None

    def group_size_of(self, module: str) -> int:
        for pattern, over in self.dynamic:
            if not pattern.startswith("-:") and re.match(pattern.removeprefix("+:"), module):
                return int(over.get("group_size", self.group_size))
        return self.group_size


def _names_part(name: str, module: str) -> bool:
    """`name` is whole dotted components of `module` ('mlp.gate' names 'x.mlp.gate', not 'x.mlp.gate_proj')."""
    return module == name or module.endswith("." + name) or module.startswith(name + ".") or f".{name}." in module


def _flag(q: dict, key: str, default: bool) -> bool | str:
    v = q.get(key, default)
    return v if isinstance(v, bool) else f"quantization_config {q.get('quant_method')} {key} {v!r} is not true/false"


def _group_problem(method: str, g) -> str | None:
    if isinstance(g, bool) or not isinstance(g, int) or not (g == -1 or (g >= 8 and g % 8 == 0)):
        return f"quantization_config {method} group_size {g!r} is not supported (-1 or a multiple of 8 such as " \
               f"32, 64, 128)"
    return None


def config_problem(q: dict) -> str | None:
    """Why a gptq / awq quantization_config is not one this module reads; None when it is."""
    method = str(q.get("quant_method") or "").lower()
    bits = q.get("bits", q.get("w_bit"))
    if bits is None:
        return f"quantization_config {method} has no bits (4-bit releases say bits 4)"
    if bits != BITS:
        return f"quantization_config {method} bits {bits!r} is not supported (only 4-bit)"
    why = _group_problem(method, q.get("group_size", q.get("q_group_size", 128)))
    if why:
        return why
    if method == "gptq":
        fmt = q.get("checkpoint_format", q.get("format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            return f"quantization_config gptq checkpoint_format {fmt!r} is not supported (only 'gptq' or 'gptq_v2')"
        for key, default in (("sym", True), ("desc_act", False)):
            flag = _flag(q, key, default)
            if isinstance(flag, str):
                return flag
        dynamic = q.get("dynamic") or {}
        if not isinstance(dynamic, dict):
            return "quantization_config gptq dynamic is not an object"
        for pattern, over in dynamic.items():
            try:
                re.compile(pattern.removeprefix("-:").removeprefix("+:"))
            except re.error:
                return f"quantization_config gptq dynamic pattern {pattern!r} is not a regular expression"
            if not isinstance(over, dict):
                return f"quantization_config gptq dynamic {pattern!r} is not an object"
            if over.get("bits", BITS) != BITS:
                return f"quantization_config gptq dynamic {pattern!r} sets bits {over['bits']!r} (only 4-bit)"
            why = _group_problem("gptq dynamic", over.get("group_size", 128))
            if why:
                return why
    elif method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            return f"quantization_config awq version {q.get('version')!r} is not supported (only the GEMM layout)"
        zp = _flag(q, "zero_point", True)
        if isinstance(zp, str):
            return zp
        if not zp:
            return "quantization_config awq zero_point false is not supported (only AWQ with zero points)"
    else:
        return f"quantization_config quant_method {method!r} is not a 4-bit format"
    names = q.get("modules_to_not_convert") or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return f"quantization_config {method} modules_to_not_convert is not a list of names"
    return None


def scheme(q: dict) -> Scheme:
    """The Scheme of a quantization_config that config_problem accepts."""
    method = str(q["quant_method"]).lower()
    group = q.get("group_size", q.get("q_group_size", 128))
    gptq = method == "gptq"
    return Scheme(method=method, group_size=group, sym=bool(q.get("sym", True)) if gptq else False,
                  desc_act=bool(q.get("desc_act", False)) if gptq else False,
                  v1_zeros=gptq and q.get("checkpoint_format", q.get("format", "gptq")) == "gptq",
                  not_converted=tuple(q.get("modules_to_not_convert") or ()),
                  dynamic=tuple((q.get("dynamic") or {}).items()) if gptq else ())


def part_of(key: str) -> tuple[str, str] | None:
    """(module, part) for a packed tensor's key such as 'x.q_proj.qweight'; None for any other key."""
    base, _, part = key.rpartition(".")
    return (base, part) if part in PARTS and base else None


def check_exclusions(sch: Scheme, keys, where) -> None:
    """EngineError for a quantized tensor (a `.qweight`) in a module config.json leaves unquantized. keys: the
    checkpoint's names; where(key): its file."""
    for key in keys:
        if key.endswith(".qweight"):
            why = sch.excluded(key.removesuffix(".qweight"))
            if why:
                raise EngineError(f"{where(key)}: tensor {key!r} is 4-bit but config.json's {why} says the module "
                                  f"is not quantized")


# --- packing ---------------------------------------------------------------------------------------------------

def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> its 8 nibbles [..., W, 8], nibble i = bits 4i..4i+3 (masking undoes the sign shift)."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=words.device)
    return (words.unsqueeze(-1) >> shifts) & 0xF


def unpack_rows(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ's qweight [..., K/8, N] (packed along K) -> the 4-bit values [..., K, N] as uint8 (leading dims:
    stacked experts)."""
    *lead, k8, n = qweight.shape
    return _nibbles(qweight).transpose(-1, -2).reshape(*lead, k8 * PACK, n).to(torch.uint8)


def unpack_columns(words: torch.Tensor, awq: bool = False) -> torch.Tensor:
    """[R, N/8] packed along N (GPTQ's sequential nibbles, or AWQ's interleaved order) -> [R, N] uint8."""
    nib = _nibbles(words)
    if awq:
        nib = nib[..., list(AWQ_COLUMN_NIBBLE)]
    return nib.reshape(words.shape[0], -1).to(torch.uint8)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[K, N] values 0..15 -> int32 [K/8, N] packed along K (unpack_rows' inverse): two nibbles a byte, four
    bytes a little-endian int32 (no shift into the sign bit)."""
    k, n = q.shape
    b = q.to(torch.uint8).reshape(k // PACK, PACK // 2, 2, n)
    byte = b[:, :, 0] | (b[:, :, 1] << 4)  # [K/8, 4, N]: byte j of each word
    return byte.permute(0, 2, 1).contiguous().reshape(-1, 4).view(torch.int32).reshape(k // PACK, n)


def group_rows(k: int, group_size: int, device=None) -> torch.Tensor:
    """The group of each (sorted) input row."""
    return torch.arange(k, device=device) // (k if group_size == -1 else group_size)


def n_groups(k: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-k // group_size)


def dequantize_sorted(qweight, zeros, scales, group_size: int) -> torch.Tensor:
    """float32 [..., K, N] (rows in the stored, group-sorted order): (q - zero) * scale, exact in float32.
    Leading dims (stacked experts) pass through."""
    q = unpack_rows(qweight)
    k = q.shape[-2]
    rows = k if group_size == -1 else group_size  # groups are contiguous: repeat each group's row (no gather)
    z = zeros.float().repeat_interleave(rows, -2)[..., :k, :]
    s = scales.float().repeat_interleave(rows, -2)[..., :k, :]
    return (q.float() - z) * s


class Int4Linear(nn.Module):
    """A bias-free Linear with 4-bit weights (the layout in the module docstring). Its tensors are non-persistent
    buffers, installed at load already filled: they are not in the state dict (the loader's strict checks judge
    the plain tensors), module.to(device) moves them, and no dtype cast of the model touches them."""

    def __init__(self, in_features: int, out_features: int, qweight: torch.Tensor, zeros: torch.Tensor,
                 scales: torch.Tensor, group_size: int, perm: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("qweight", qweight, persistent=False)
        self.register_buffer("zeros", zeros, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("perm", perm, persistent=False)
        self.kernel = None  # int4_triton.forward where install() chose it (CUDA, 16-bit)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] in the input's row order, in `dtype` (computed in float32)."""
        w = dequantize_sorted(self.qweight, self.zeros, self.scales, self.group_size)
        if self.perm is not None:  # sorted row i is input row perm[i]
            w = torch.empty_like(w).index_copy_(0, self.perm, w)
        return w.t().contiguous().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(self, x)
        return F.linear(x, self.dequantized(x.dtype))

    def packed_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.zeros, self.scales))

    def extra_repr(self) -> str:
        act = ", act-order" if self.perm is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.group_size}{act}"


class Int4Experts(DequantizingExperts):
    """MoE experts kept 4-bit: each expert's gate / up / down Linear in the one layout (Int4Linear's), stacked as
    transformers' fused experts module stacks them. gate_up: the gate's N columns, then the up's (one [H/8, 2I]
    qweight per expert, as int4.fuse concatenates), so qweight int32 [E, H/8, 2I], zeros uint8 [E, G_H, 2I],
    scales [E, G_H, 2I]; down: qweight [E, I/8, H], zeros [E, G_I, H], scales [E, G_I, H]. With act-order
    (a g_idx that permutes rows in any expert) the rows are sorted by group per expert and projection at load, and
    gate_up_perm int32 [E, 2, H] (gate's, then up's: nothing promises they share one) and down_perm [E, I] say
    where each sorted row came from; None when every expert keeps the input order. Non-persistent buffers, as
    Int4Linear's: installed filled at load, outside the state dict, moved by module.to(device).

    It stands in for transformers' experts module as fp8.FP8Experts does: forward (the block's own forward: long
    prefills) dequantizes each routed expert before its matmuls; moe_rowwise takes `dense`; on CUDA in 16-bit
    decode and verify widths go through int4_moe_triton's kernels, which read these buffers as they are, after
    moe_check's self-check."""

    def __init__(self, act_fn, group_sizes: tuple[int, int], gate_up: tuple, down: tuple,
                 gate_up_perm: torch.Tensor | None = None, down_perm: torch.Tensor | None = None):
        super().__init__()
        n_experts, _, two_i = gate_up[0].shape
        self.num_experts, self.hidden_dim, self.intermediate_dim = n_experts, down[0].shape[-1], two_i // 2
        self.act_fn = act_fn
        self.group_sizes = group_sizes  # (gate / up's over H, down's over I)
        for proj, (qweight, zeros, scales), perm in (("gate_up", gate_up, gate_up_perm), ("down", down, down_perm)):
            self.register_buffer(proj + "_qweight", qweight, persistent=False)
            self.register_buffer(proj + "_zeros", zeros, persistent=False)
            self.register_buffer(proj + "_scales", scales, persistent=False)
            self.register_buffer(proj + "_perm", perm, persistent=False)
        self.kernel = None  # dequantize_experts where choose() gave it (CUDA, 16-bit)

    @classmethod
    def stack(cls, act_fn, gates: list, ups: list, downs: list) -> "Int4Experts":
        """From each expert's Packed gate, up and down (read_packed's), in expert order."""
        def perms(*projs):
            if all(p.perm is None for ps in projs for p in ps):
                return None
            rows = lambda p: p.perm if p.perm is not None else torch.arange(p.k, device=p.qweight.device)
            return torch.stack([torch.stack([rows(p) for p in ps]) for ps in zip(*projs)]).to(torch.int32)

        def parts(*projs):
            return tuple(torch.stack([torch.cat([getattr(p, attr) for p in ps], 1) for ps in zip(*projs)])
                         for attr in ("qweight", "zeros", "scales"))

        gate_up_perm = perms(gates, ups)
        down_perm = perms(downs)
        return cls(act_fn, (gates[0].group_size, downs[0].group_size), parts(gates, ups), parts(downs),
                   gate_up_perm, down_perm[:, 0] if down_perm is not None else None)

    def _dense(self, proj: str, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Experts ids' weights [P, N, K] of `proj`, rows in the input's order, in dtype (computed in float32, or by
        the dequantizing kernel, which rounds the same float32 products once)."""
        qweight, zeros, scales = (getattr(self, f"{proj}_{part}")[ids] for part in ("qweight", "zeros", "scales"))
        group = self.group_sizes[proj == "down"]
        perm = getattr(self, proj + "_perm")
        if self.kernel is not None and dtype in (torch.float16, torch.bfloat16):
            w = self.kernel(qweight, zeros, scales, group, dtype)
        else:
            w = dequantize_sorted(qweight, zeros, scales, group).to(dtype).transpose(-1, -2).contiguous()  # [P, N, K]
        if perm is None:
            return w
        perm = perm[ids].long()  # sorted row i of an expert is its input row perm[i]
        if proj == "gate_up":  # the gate's columns and the up's each have their own order
            inter = self.intermediate_dim
            halves = w.unflatten(-2, (2, inter))  # [P, 2, I, H]
            index = perm[:, :, None, :].expand_as(halves)
            return torch.empty_like(halves).scatter_(-1, index, halves).flatten(-3, -2)
        return torch.empty_like(w).scatter_(-1, perm[:, None, :].expand_as(w), w)

    def dense(self, ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [P, 2I, H], down [P, H, I]) of experts `ids` [P], dequantized exactly (in float32) to dtype."""
        return self._dense("gate_up", ids, dtype), self._dense("down", ids, dtype)

    def weights(self) -> int:
        """How many weights the packed tensors stand for (gate, up and down of every expert)."""
        return self.num_experts * 3 * self.hidden_dim * self.intermediate_dim

    def packed_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for proj in ("gate_up", "down")
                   for t in (getattr(self, f"{proj}_{part}") for part in ("qweight", "zeros", "scales")))

    def extra_repr(self) -> str:
        act = ", act-order" if self.gate_up_perm is not None or self.down_perm is not None else ""
        return f"experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, " \
               f"int4 groups {self.group_sizes}{act}"


@torch.library.custom_op("mtpchat::int4_dequantize_experts", mutates_args=())
def dequantize_experts(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """Gathered experts' packed tensors [P, K/8, N], [P, G, N], [P, G, N] -> their 16-bit weights [P, N, K], rows in
    the sorted order: int4_triton's dequantizing kernel once per expert, behind one custom op (opaque to
    torch.compile, replayable in CUDA graphs: the loop runs over the static P, no host sync)."""
    from .int4_triton import dequantize

    return torch.stack([dequantize(qweight[p], zeros[p], scales[p], group, dtype) for p in range(qweight.shape[0])])


@dequantize_experts.register_fake
def _(qweight, zeros, scales, group, dtype):
    return qweight.new_empty(qweight.shape[0], qweight.shape[2], qweight.shape[1] * PACK, dtype=dtype)


def choose(backends, modules, device, dtype) -> None:
    """Int4Linear's forward: the Triton W4A16 kernels where they run and pass their self-check (int4_triton.py),
    else dequantize-then-matmul; recorded in backends.choice (None: the MTP head's, which follows the trunk's).
    Nothing is recorded for a model without 4-bit weights."""
    from .int4_triton import install

    modules = list(modules)
    why = install(modules, device, dtype)
    if why is not None and backends is not None:
        backends.choice["int4_linear"] = ("triton" if why.startswith("Triton") else "dequantize", why)
    experts = [m for m in modules if isinstance(m, Int4Experts)]
    if experts:
        why = _choose_experts(experts, device, dtype)
        if backends is not None:
            backends.choice["int4_experts"] = ("triton" if why.startswith("Triton") else "dequantize", why)


def _choose_experts(experts: list, device, dtype) -> str:
    """Int4Experts.dense: int4_triton's dequantizing kernel per routed expert where it runs and matches the
    float32 dequantization on expert 0 of each shape, else the float32 dequantization (the CPU's exact path)."""
    from .int4_triton import usable
    from .kernels import relative_error

    why = usable(torch.device(device), dtype,
                 [gk for m in experts for gk in zip(m.group_sizes, (m.hidden_dim, m.intermediate_dim))])
    worst, checked = 0.0, set()
    if why is None:
        try:
            for m in experts:
                key = (m.hidden_dim, m.intermediate_dim, m.group_sizes)
                if key in checked:
                    continue
                checked.add(key)
                ids = torch.zeros(1, dtype=torch.long, device=m.gate_up_qweight.device)
                ref = m.dense(ids, torch.float32)
                m.kernel = dequantize_experts
                got = m.dense(ids, dtype)
                m.kernel = None
                worst = max(worst, *(relative_error(g, r) for g, r in zip(got, ref)))
        except Exception as e:  # an architecture or Triton version the kernel does not compile for
            why = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        if why is None and not worst <= 2e-2:  # NaN too
            why = f"self-check mismatch {worst:.2g}"
    for m in experts:
        m.kernel = None if why else dequantize_experts
    if why:
        return f"dequantize each routed expert in float32, then matmul ({why})"
    return f"Triton dequantizing kernel per routed expert, then matmul (self-check {worst:.1e})"


@torch.no_grad()
def quantize_linears(model: nn.Module, group_size: int = 128) -> int:
    """Turn each bias-free nn.Linear that Qwen's quantized releases quantize (fp8.eligible: the same modules stay
    bf16) into an Int4Linear holding its weight rounded to nearest on GPTQ's symmetric grid (zero 8, scale
    2 * amax / 15 per group of `group_size` input rows, float16): the bench's random-weight 4-bit models. Returns
    how many. One Linear at a time: the peak is the model plus one weight in float32."""
    from .fp8 import eligible

    count = 0
    for name, lin in list(model.named_modules()):
        if type(lin) is not nn.Linear or lin.bias is not None or not eligible(name + ".weight", lin.weight):
            continue
        n, k = lin.weight.shape
        if n % PACK or k % group_size:
            continue
        w = lin.weight.float().view(n, k // group_size, group_size)
        scales = (w.abs().amax(-1) * (2 / 15)).clamp_min(1e-8).half()  # [N, G]
        q = (w / scales.float().unsqueeze(-1)).round().add_(8).clamp_(0, 15).to(torch.uint8).view(n, k)
        zeros = torch.full((k // group_size, n), 8, dtype=torch.uint8, device=w.device)
        owner, attr, _ = child(model, name)
        setattr(owner, attr, Int4Linear(k, n, pack_rows(q.T), zeros, scales.T.contiguous(), group_size))
        count += 1
    return count


def param_count(model: nn.Module) -> int:
    """The weights the Int4Linear and Int4Experts modules stand for (model.parameters() does not see their
    buffers); a fused projection's (fuse) are its parts'."""
    return sum(m.in_features * m.out_features for m in model.modules()
               if isinstance(m, Int4Linear) and not getattr(m, "is_fusion", False)) \
        + sum(m.weights() for m in model.modules() if isinstance(m, Int4Experts))


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the Int4Linear and Int4Experts modules' packed tensors (qweight, zeros, scales), a fused
    projection's once."""
    return sum(m.packed_bytes() for m in model.modules()
               if isinstance(m, Int4Experts) or (isinstance(m, Int4Linear) and not getattr(m, "is_fusion", False)))


@torch.no_grad()
def fuse(module: nn.Module, names: tuple[str, ...], linears: list) -> bool:
    """fusion.py's concatenation along N for 4-bit projections that read the same input: qweight, zeros and scales
    side by side in columns ([K/8, N], [G, N], [G, N]), one kernel launch for all; each part's tensors become
    column views of the fused ones (no copy kept). Only when every part is an Int4Linear of the same K, group
    size, scale dtype and act-order permutation (GPTQ's desc_act orders rows by their input's Hessian, shared by
    q / k / v and gate / up, but nothing in the format promises it). module.int4_fused: the fused Int4Linear."""
    first = linears[0]
    if not all(isinstance(lin, Int4Linear) for lin in linears):
        return False
    same = all(lin.in_features == first.in_features and lin.group_size == first.group_size
               and lin.scales.dtype == first.scales.dtype and (lin.perm is None) == (first.perm is None)
               and (lin.perm is None or torch.equal(lin.perm, first.perm)) for lin in linears)
    if not same:
        return False
    cat = {attr: torch.cat([getattr(lin, attr) for lin in linears], 1) for attr in ("qweight", "zeros", "scales")}
    fused = Int4Linear(first.in_features, sum(lin.out_features for lin in linears), cat["qweight"], cat["zeros"],
                       cat["scales"], first.group_size, first.perm)
    fused.is_fusion = True
    start = 0
    for lin in linears:
        for attr, t in cat.items():
            setattr(lin, attr, t[:, start : start + lin.out_features])
        start += lin.out_features
    # (attributes of their own: fused_names / fused_weight mean a plain or FP8 weight to their readers)
    module.int4_fused, module.int4_fused_names = fused, names
    module.int4_fused_sizes = [lin.out_features for lin in linears]
    return True


# --- loading ---------------------------------------------------------------------------------------------------

@dataclass
class Packed:
    """One quantized Linear in the engine's layout (Int4Linear's tensors), read from either format."""

    n: int
    k: int
    qweight: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    group_size: int
    perm: torch.Tensor | None

    def dequantized(self, dtype) -> torch.Tensor:
        return Int4Linear(self.k, self.n, self.qweight, self.zeros, self.scales, self.group_size,
                          self.perm).dequantized(dtype)


def _shape(t) -> tuple:
    return tuple(t.shape)


def read_packed(sch: Scheme, name: str, parts: dict, file_of) -> Packed:
    """Check and convert one module's packed tensors; EngineError naming the file and tensor otherwise.
    name: the module's checkpoint name; parts: part ("qweight", ...) -> tensor; file_of(part): its file."""

    def bad(part, why):
        return EngineError(f"{file_of(part)}: tensor {name + '.' + part!r} {why}")

    need = ("qweight", "qzeros", "scales") + (("g_idx",) if sch.method == "gptq" and sch.desc_act else ())
    for part in need:
        if parts.get(part) is None:
            raise EngineError(f"{file_of('qweight')}: 4-bit tensor {name + '.qweight'!r} has no "
                              f"{name + '.' + part!r} beside it")
    if sch.method == "awq" and parts.get("g_idx") is not None:
        raise bad("g_idx", "is a GPTQ tensor; config.json says awq")
    for part in ("qweight", "qzeros", "g_idx"):
        t = parts.get(part)
        if t is not None and t.dtype != torch.int32 and not (part == "g_idx" and t.dtype == torch.int64):
            raise bad(part, f"is {t.dtype}; a packed 4-bit tensor is int32")
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    if scales.dtype not in SCALE_DTYPES:
        raise bad("scales", f"is {scales.dtype}; scales are float16 (or bfloat16 / float32)")
    if qweight.dim() != 2:
        raise bad("qweight", f"has shape {_shape(qweight)}; a packed 4-bit weight is 2-D")
    awq = sch.method == "awq"
    k, n = (qweight.shape[0], qweight.shape[1] * PACK) if awq else (qweight.shape[0] * PACK, qweight.shape[1])
    gs = sch.group_size_of(name)
    groups = n_groups(k, gs)
    for part, t, want in (("scales", scales, (groups, n)), ("qzeros", qzeros, (groups, n // PACK))):
        if _shape(t) != want or n % PACK:
            layout = f"[K, N/8] = {_shape(qweight)}" if awq else f"[K/8, N] = {_shape(qweight)}"
            raise bad(part, f"has shape {_shape(t)}; qweight {layout} with group_size {gs} needs {want}"
                            + (" (N must be a multiple of 8)" if n % PACK else ""))
    zeros = unpack_columns(qzeros, awq=awq)
    if sch.v1_zeros:
        zeros = zeros + 1  # v1 stores zero - 1 (a stored 15 reads as 16, as every v1 runtime reads it)
    perm = None
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        if _shape(g_idx) != (k,):
            raise bad("g_idx", f"has shape {_shape(g_idx)}; qweight holds K = {k} input rows")
        g_idx = g_idx.long()
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise bad("g_idx", f"names groups outside 0..{groups - 1}")
        order = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[order], group_rows(k, gs, g_idx.device)):
            raise bad("g_idx", f"does not split the {k} input rows into groups of {gs}")
        if not torch.equal(order, torch.arange(k, device=order.device)):
            perm = order
    if perm is not None or awq:
        values = unpack_columns(qweight, awq=True) if awq else unpack_rows(qweight)  # [K, N]
        qweight = pack_rows(values[perm] if perm is not None else values)
    return Packed(n, k, qweight.contiguous(), zeros.contiguous(), scales, gs, perm)


def adopt(model: nn.Module, sd: dict[str, torch.Tensor], sch: Scheme, dtype: torch.dtype, where,
          named=None) -> dict[str, torch.Tensor]:
    """Prepare state dict `sd` (the model's key names) for `model`, built on the meta device, as fp8.adopt does:
    each module with packed tensors that is a bias-free nn.Linear of their shape becomes an Int4Linear holding
    them (and its keys leave the state dict); per-expert ones (experts.J.{gate,up,down}_proj) turn their fused
    experts module into an Int4Experts holding them stacked (_install_experts says when); any other packed
    module's weight is dequantized here into `<module>.weight` in `dtype`. where(key): the file that holds tensor
    `key`; named(key): the checkpoint's name of a key, for messages and the config's per-module settings (default:
    the key itself)."""
    named = named or (lambda k: k)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, Packed]]] = {}  # experts module -> expert -> projection
    for key, t in sd.items():
        hit = part_of(key)
        if hit:
            modules.setdefault(hit[0], {})[hit[1]] = t
        else:
            out[key] = t
    for module, parts in modules.items():
        if "qweight" not in parts:
            orphan = next(iter(parts))
            shown = named(module + "." + orphan)
            raise EngineError(f"{where(module + '.' + orphan)}: tensor {shown!r} has no "
                              f"{shown.removesuffix(orphan) + 'qweight'!r} beside it")
        if module + ".weight" in out:
            raise EngineError(f"{where(module + '.weight')}: module {named(module + '.qweight')[:-8]!r} has both a "
                              f"plain weight and 4-bit tensors")
        packed = read_packed(sch, named(module + ".qweight").removesuffix(".qweight"), parts,
                             lambda part: where(module + "." + part))
        expert = _PER_EXPERT.match(module)
        if expert:  # gathered per experts module, stacked below
            experts.setdefault(expert.group(1), {}).setdefault(int(expert.group(2)), {})[expert.group(3)] = packed
        elif not _install(model, module, packed):
            out[module + ".weight"] = packed.dequantized(dtype)
    for prefix, by_id in experts.items():
        if _install_experts(model, prefix, by_id, out):
            continue
        for i, projs in by_id.items():  # per-expert Linears, or dequantized for fuse_experts to stack and judge
            for proj, packed in projs.items():
                if not _install(model, f"{prefix}.{i}.{proj}", packed):
                    out[f"{prefix}.{i}.{proj}.weight"] = packed.dequantized(dtype)
    return out


_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")
_PROJS = ("gate_proj", "up_proj", "down_proj")


def _install_experts(model: nn.Module, prefix: str, by_id: dict[int, dict[str, Packed]], out: dict) -> bool:
    """Replace transformers' fused experts module at `prefix` (on the meta device) by an Int4Experts holding
    by_id's packed tensors (expert -> projection -> Packed); False, leaving the caller to dequantize, unless every
    expert has all three 4-bit projections of the module's shapes with one group size per projection kind and
    one scale dtype (what one stacked tensor can hold), and none of its experts has a plain weight."""
    from .fp8 import stacked_experts

    owner, name, fused = child(model, prefix)
    if fused is None or not stacked_experts(fused):
        return False
    n_experts, two_i, hidden = fused.gate_up_proj.shape
    shapes = {"gate_proj": (two_i // 2, hidden), "up_proj": (two_i // 2, hidden), "down_proj": (hidden, two_i // 2)}
    if set(by_id) != set(range(n_experts)) or any(set(projs) != set(_PROJS) for projs in by_id.values()):
        return False
    if any(k.startswith(prefix + ".") for k in out):  # plain per-expert weights beside the 4-bit ones
        return False
    ps = [by_id[i][proj] for i in range(n_experts) for proj in _PROJS]
    if any((p.n, p.k) != shapes[proj] for p, proj in zip(ps, _PROJS * n_experts)):
        return False
    kinds = {(proj == "down_proj", p.group_size) for p, proj in zip(ps, _PROJS * n_experts)}
    if len(kinds) != 2 or len({p.scales.dtype for p in ps}) != 1:
        return False
    gates, ups, downs = ([by_id[i][proj] for i in range(n_experts)] for proj in _PROJS)
    # Held on the CPU until the model moves to its device: the checkpoint's per-expert tensors (read straight onto
    # the device) are freed only after the state dict loads, so stacks built there would hold every expert twice
    # at the load's peak (2 x 18 GB for Qwen3.5-35B-A3B's experts); this way one layer's stack at most.
    setattr(owner, name, Int4Experts.stack(fused.act_fn, gates, ups, downs).to("cpu"))
    return True


def _install(model: nn.Module, base: str, p: Packed) -> bool:
    """Replace the meta nn.Linear at `base` by an Int4Linear holding p; False where `base` is not a bias-free
    Linear of p's shape (the caller dequantizes, and the state-dict checks judge the result)."""
    owner, name, lin = child(model, base)
    if not plain_linear(lin, (p.n, p.k)):
        return False
    setattr(owner, name, Int4Linear(p.k, p.n, p.qweight, p.zeros, p.scales, p.group_size, p.perm))
    return True


# --- tensor parallelism ------------------------------------------------------------------------------------------

def tp_slicer(slicer, shape_of: dict, sch: Scheme):
    """Tensor parallelism over a GPTQ / AWQ checkpoint. `slicer` (tp.ShardPlan.selection) knows only the logical
    `X.weight` [N, K]: each of X's packed tensors takes the part of it that holds the rank's rows (N: column-parallel)
    or columns (K: row-parallel) of that weight (_packed_selection). shape_of: the checkpoint's shapes (the qweight's
    gives N and K). Every other tensor goes to `slicer` as it is."""

    def select(key: str, shape: tuple[int, ...]):
        hit = part_of(key)
        if hit is None:
            return slicer(key, shape)
        module, part = hit
        nk = _logical_shape(sch, shape_of.get(module + ".qweight"))
        if nk is None:  # no (2-D) qweight beside it: read whole, and read_packed / adopt refuse it in one line
            return None
        sel = slicer(module + ".weight", nk)
        return None if sel is None else _packed_selection(sch, module, part, sel, *nk)

    return select


def _logical_shape(sch: Scheme, qweight_shape) -> tuple[int, int] | None:
    """(N, K) of the weight a qweight of this shape packs (GPTQ [K/8, N], AWQ [K, N/8]); None if it is not 2-D."""
    if qweight_shape is None or len(qweight_shape) != 2:
        return None
    rows, cols = qweight_shape
    return (cols * PACK, rows) if sch.method == "awq" else (cols, rows * PACK)


def _packed_selection(sch: Scheme, module: str, part: str, sel, n: int, k: int):
    """The part of `module`'s packed tensor `part` that holds selection `sel` of its weight [N, K].

    Column-parallel (sel.dim 0, ranges of N): GPTQ's qweight and both formats' scales take the same columns;
    qzeros (both) and AWQ's qweight, packed 8 columns a word, take the words (ranges must be multiples of 8); g_idx
    is whole. Row-parallel (sel.dim 1, ranges of K): GPTQ's qweight, packed 8 rows a word, takes rows / 8, AWQ's
    the rows; scales and qzeros the ranges' groups (ranges must be whole groups: a group's scale cannot be halved),
    or all of the one group when group_size is -1; g_idx the same rows, its group numbers made the rank's own
    (_GroupIndex: refused when act-order scattered them over other ranks' groups)."""
    from .tp import Selection

    gs = sch.group_size_of(module)
    awq = sch.method == "awq"
    side, total = ("rows", n) if sel.dim == 0 else ("columns", k)

    def refuse(a, b, why):
        raise EngineError(f"--tp: 4-bit weight {module!r}: this rank's {side} [{a}, {b}) of {total} {why}; try "
                          f"another --tp or one device")

    if sel.zero or sel.size is not None:  # lm_head's padded vocab rows (a 4-bit lm_head): words are not padded here
        refuse(*(sel.ranges[0] if sel.ranges else (0, 0)), f"are padded to {sel.size}, which packed 4-bit tensors "
                                                            f"cannot be")
    unit = PACK if sel.dim == 0 or gs == -1 else gs  # (group sizes are multiples of 8)
    for a, b in sel.ranges:
        if a % unit or (b % unit and b != total):
            refuse(a, b, f"are not multiples of {PACK}, so its packed words cannot be split" if unit == PACK else
                   f"are not whole groups of {gs}, so its scales and zeros cannot be split")
    words = [(a // PACK, b // PACK) for a, b in sel.ranges]  # (K and N are multiples of 8)
    if sel.dim == 0:
        if part == "g_idx":
            return None
        return Selection(1, words if part == "qzeros" or (awq and part == "qweight") else list(sel.ranges))
    if part == "qweight":
        return Selection(0, list(sel.ranges) if awq else words)
    groups = [(0, 1) if gs == -1 else (a // gs, -(-b // gs)) for a, b in sel.ranges]
    if part == "g_idx":
        return _GroupIndex(Selection(0, list(sel.ranges)), module, groups, n_groups(k, gs))
    return None if gs == -1 else Selection(0, groups)


@dataclass
class _GroupIndex:
    """g_idx's rows for a row-parallel rank (`rows`, a tp.Selection), each range's group numbers renumbered to the
    rank's own groups (it holds groups[i] of the checkpoint's `total` for range i). Exact when every row of a range
    lies in that range's groups, as without act-order; act-order (desc_act) that put a row in a group another rank
    holds is refused, since this rank's scales and zeros do not cover it. Values outside all groups pass as they
    are: read_packed refuses them in its own words."""

    rows: object
    module: str
    groups: list
    total: int

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        return self.rows.shape(full)

    def read(self, sl, full: tuple[int, ...], dtype=None) -> torch.Tensor:
        t = self.rows.read(sl, full, dtype)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.total):
            return t
        out, start, local = [], 0, 0
        for (a, b), (g0, g1) in zip(self.rows.ranges, self.groups):
            rows = t[start : start + b - a]
            if rows.numel() and (int(rows.min()) < g0 or int(rows.max()) >= g1):
                raise EngineError(f"--tp: 4-bit weight {self.module!r}: act-order (desc_act) put some of this rank's "
                                  f"columns [{a}, {b}) of {full[0]} in groups other ranks hold, so its scales and "
                                  f"zeros do not cover them; try another --tp or one device")
            out.append(rows - g0 + local)
            start, local = start + b - a, local + g1 - g0
        return torch.cat(out) if len(out) != 1 else out[0]

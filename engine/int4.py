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
computes what transformers computes on the exactly-dequantized twin. Quantized tensors of modules that are not a
plain Linear (per-expert MoE weights that fuse_experts stacks, GDN projections whose packing the loader converts)
are dequantized at load to the model dtype, as engine/fp8.py does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .errors import EngineError
from .modules import child, plain_linear

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
    """GPTQ's qweight [K/8, N] (packed along K) -> the 4-bit values [K, N] as uint8."""
    k8, n = qweight.shape
    return _nibbles(qweight).transpose(1, 2).reshape(k8 * PACK, n).to(torch.uint8)


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
    """float32 [K, N] (rows in the stored, group-sorted order): (q - zero) * scale, exact in float32."""
    q = unpack_rows(qweight)
    k = q.shape[0]
    rows = k if group_size == -1 else group_size  # groups are contiguous: repeat each group's row (no gather)
    z = zeros.float().repeat_interleave(rows, 0)[:k]
    s = scales.float().repeat_interleave(rows, 0)[:k]
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


def choose(backends, modules, device, dtype) -> None:
    """Int4Linear's forward: the Triton W4A16 kernels where they run and pass their self-check (int4_triton.py),
    else dequantize-then-matmul; recorded in backends.choice (None: the MTP head's, which follows the trunk's).
    Nothing is recorded for a model without 4-bit weights."""
    from .int4_triton import install

    why = install(modules, device, dtype)
    if why is not None and backends is not None:
        backends.choice["int4_linear"] = ("triton" if why.startswith("Triton") else "dequantize", why)


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
    """The weights the Int4Linear modules stand for (model.parameters() does not see their buffers); a fused
    projection's (fuse) are its parts'."""
    return sum(m.in_features * m.out_features for m in model.modules()
               if isinstance(m, Int4Linear) and not getattr(m, "is_fusion", False))


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the Int4Linear modules' packed tensors (qweight, zeros, scales), a fused projection's once."""
    return sum(m.packed_bytes() for m in model.modules()
               if isinstance(m, Int4Linear) and not getattr(m, "is_fusion", False))


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
    them (and its keys leave the state dict); any other packed module's weight is dequantized here into
    `<module>.weight` in `dtype`. where(key): the file that holds tensor `key`; named(key): the checkpoint's name
    of a key, for messages and the config's per-module settings (default: the key itself)."""
    named = named or (lambda k: k)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
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
        if not _install(model, module, packed):
            out[module + ".weight"] = packed.dequantized(dtype)
    return out


def _install(model: nn.Module, base: str, p: Packed) -> bool:
    """Replace the meta nn.Linear at `base` by an Int4Linear holding p; False where `base` is not a bias-free
    Linear of p's shape (the caller dequantizes, and the state-dict checks judge the result)."""
    owner, name, lin = child(model, base)
    if not plain_linear(lin, (p.n, p.k)):
        return False
    setattr(owner, name, Int4Linear(p.k, p.n, p.qweight, p.zeros, p.scales, p.group_size, p.perm))
    return True

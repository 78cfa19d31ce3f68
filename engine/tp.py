"""Tensor parallelism over torch.distributed: the process group, the shard plan, sharded loading, and launch.

Every rank builds the family's transformers modules from a *local* config (its share of the attention heads, KV
heads, GDN key / value heads and MLP / expert intermediate dims), so the engine's forward, its KV cache and its
GDN state are the same code on one device and on N, and automatically hold only the rank's heads. The engine calls
`trunk.reduce(x)` after every mixer and every MLP (the row-parallel projections o_proj / out_proj / down_proj
leave partial sums) and `trunk.logits()` gathers the vocab-parallel lm_head's slices:

    attention   q_proj / k_proj / v_proj column-parallel by heads (q rows are [query | gate] per head), q/k norms
                replicated, o_proj row-parallel -> 1 all-reduce. KV heads that N does not divide are replicated
                (each rank keeps the one KV head its query heads read).
    GDN         in_proj rows of the rank's key-head groups (Qwen3-Next's interleaved in_proj_qkvz / in_proj_ba:
                contiguous groups; Qwen3.5's [q | k | v] in_proj_qkv: a range per section; in_proj_z / b / a by value
                head), conv1d channels [q | k | v] likewise, A_log / dt_bias by value head, the gated norm is per
                head (replicated weight), recurrent state and conv window local, out_proj row-parallel
                -> 1 all-reduce. Key heads that N does not divide are replicated (one key head per rank).
    dense MLP   gate / up column-parallel, down row-parallel -> 1 all-reduce.
    MoE         every expert's intermediate dim sharded (fused gate_up_proj: both halves; per-expert tensors), router
                and shared_expert_gate replicated (routing computed identically on every rank, on the device),
                shared expert sharded like a dense MLP -> 1 all-reduce for routed + shared together.
    lm_head     vocab-parallel (ceil(V / N) rows per rank, the last padded); logits all_gather'ed, so argmax and
                sampling see identical full logits on every rank.
    embedding   replicated (full), as are the final norm and the MTP's fc and norms.
    MTP head    its attention and MLP / MoE sharded exactly like the trunk's; it reuses the trunk's hooks.

Speculation needs no extra collective: all ranks run the same cycle on identical gathered logits, so greedy
acceptance is identical, and sampled decoding uses a generator seeded identically on every rank (a seed chosen by
rank 0 and broadcast when the request has none). Commit, replay and refresh are local to each shard.

Only each rank's slice of every tensor is read from safetensors (`get_slice(name)[a:b]`); the full embedding is
the one tensor every rank holds whole. The plan names logical `X.weight` tensors only: quantized checkpoints map
its rows / columns onto their own tensors (fp8.tp_slicer: the 128-block scales; int4.tp_slicer: GPTQ / AWQ packed
words, group scales and zeros, g_idx renumbered), refusing in one line a split that would cut a block, a group or
a packed word.
"""

from __future__ import annotations

import copy
import os
import random
import re
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import EngineError

DEFAULT_TIMEOUT_S = float(os.environ.get("MTPCHAT_TP_TIMEOUT", "300"))  # a hung peer fails a collective after this
GATHER_SUM_MAX = 1 << 16  # gloo: all-reduce small tensors as all-gather + local sum (fewer dependent hops)
# NVLink multicast (NVLS) stays off: nothing here needs it, and on shared hosts it can take the GPUs out of service
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
GRACE_S = 5.0  # after one rank fails, how long the others get to notice before they are terminated


class TPError(EngineError):
    """The tensor-parallel group went down (a worker died or a collective failed)."""


# --- the process group --------------------------------------------------------------------------------------


class TPGroup:
    """The engine's view of a tensor-parallel group: all_reduce for row-parallel outputs, gather_vocab for the
    vocab-parallel lm_head. `pg` is a torch.distributed process group (None = the default, whole world)."""

    def __init__(self, rank: int, world: int, pg=None, device: torch.device | str = "cpu"):
        self.rank, self.world, self.pg = rank, world, pg
        self.device = torch.device(device)
        self.vocab_size: int | None = None  # set by the loader: gathered logits are cut back to it
        self.plan: ShardPlan | None = None  # what this rank holds (set by the loader)
        self.src = dist.get_global_rank(pg, 0) if pg is not None else 0  # global rank of this group's rank 0
        self.gather_sum = dist.is_initialized() and dist.get_backend(pg) == "gloo"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if self.gather_sum and x.numel() * self.world <= GATHER_SUM_MAX:
            # gloo's ring all-reduce takes 2 (N - 1) dependent hops; for decode-sized rows an all-gather takes
            # N - 1, and every rank then sums the same parts in the same order (bitwise-identical results)
            parts = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(parts, x, group=self.pg)
            return torch.stack(parts).sum(0)
        dist.all_reduce(x, group=self.pg)
        return x

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """[..., V/N] slices of every rank -> [..., V] full logits (identical on every rank)."""
        x = x.contiguous()
        if self.gather_sum:  # gloo
            parts = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(parts, x, group=self.pg)
            full = torch.cat(parts, dim=-1)
        else:  # one collective into one preallocated tensor: capturable in a CUDA graph
            stacked = x.new_empty((self.world, *x.shape))
            dist.all_gather_into_tensor(stacked, x, group=self.pg)
            full = stacked.movedim(0, -2).reshape(*x.shape[:-1], -1)
        return full if self.vocab_size is None else full[..., : self.vocab_size]

    def all_ok(self, ok: bool) -> bool:
        """True on every rank when `ok` is true on every rank."""
        t = torch.tensor([int(ok)], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.pg)
        return bool(t.item())

    def broadcast_(self, t: torch.Tensor) -> torch.Tensor:
        """Overwrite t with rank 0's t (in place)."""
        dist.broadcast(t, src=self.src, group=self.pg)
        return t

    def shared_seed(self) -> int:
        """One random seed, drawn by rank 0, the same on every rank."""
        t = torch.tensor([random.getrandbits(62) if self.rank == 0 else 0], dtype=torch.long, device=self.device)
        return int(self.broadcast_(t).item())

    def barrier(self) -> None:
        dist.barrier(group=self.pg)

    def describe(self) -> dict:
        backend = dist.get_backend(self.pg) if dist.is_initialized() else None
        return {"world": self.world, "rank": self.rank, "backend": backend, "device": str(self.device)}


# --- the shard plan -----------------------------------------------------------------------------------------


def _part(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank's contiguous share of n, balanced (sizes differ by at most one)."""
    q, r = divmod(n, world)
    start = rank * q + min(rank, r)
    return start, start + q + (1 if rank < r else 0)


@dataclass
class Selection:
    """Which part of a checkpoint tensor a rank reads: ranges along one dim, concatenated, zero-padded to `size`
    along that dim; `zero` = a row-parallel bias that only rank 0 adds (nothing is read)."""

    dim: int
    ranges: list[tuple[int, int]]
    size: int | None = None
    zero: bool = False

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        if self.zero:
            return tuple(full)
        n = self.size if self.size is not None else sum(b - a for a, b in self.ranges)
        return tuple(full[: self.dim]) + (n,) + tuple(full[self.dim + 1 :])

    def read(self, sl, full: tuple[int, ...], dtype=None) -> torch.Tensor:
        """Read the selection from a safetensors slice (only these bytes are read)."""
        if self.zero:
            return torch.zeros(full, dtype=dtype or torch.float32)
        lead = (slice(None),) * self.dim
        parts = [sl[lead + (slice(a, b),)] for a, b in self.ranges if b > a]
        t = torch.cat(parts, dim=self.dim) if len(parts) != 1 else parts[0]
        n = t.shape[self.dim]
        if self.size is not None and n < self.size:
            pad = list(t.shape)
            pad[self.dim] = self.size - n
            t = torch.cat([t, t.new_zeros(pad)], dim=self.dim)
        return t


def _merge(ranges):
    out = []
    for a, b in ranges:
        if b <= a:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


_PER_EXPERT = re.compile(r"^experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")


class ShardPlan:
    """What rank `rank` of `world` holds of a model with (full) text config `cfg`."""

    def __init__(self, cfg, rank: int, world: int, where: str = "config.json"):
        self.cfg, self.rank, self.world = cfg, rank, world
        W, R = world, rank

        def need(cond, msg):
            if not cond:
                raise EngineError(f"{where}: --tp {W}: {msg}")

        # the q_proj slices below are [query | gate] per head: dense Qwen3's ungated attention is not laid out so
        need(getattr(cfg, "model_type", "") != "qwen3", "dense Qwen3 models are not sharded yet (run them on one "
                                                        "device)")
        # full attention: query heads split evenly; KV heads split, or replicated when N > KV heads
        nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = cfg.head_dim
        need(nh % W == 0, f"{nh} attention heads are not divisible by {W}")
        self.heads = (R * nh // W, (R + 1) * nh // W)
        if nkv % W == 0:
            self.kv_heads = (R * nkv // W, (R + 1) * nkv // W)
        else:
            need(W % nkv == 0, f"{nkv} KV heads: {W} is neither a divisor nor a multiple of them "
                               f"(KV heads are split or replicated)")
            kv = R // (W // nkv)
            self.kv_heads = (kv, kv + 1)
        group = nh // nkv  # query heads per KV head
        need(self.heads[0] // group >= self.kv_heads[0] and (self.heads[1] - 1) // group < self.kv_heads[1],
             "the rank's query heads do not share its KV heads")
        self.kv_replicated = nkv % W != 0

        # GDN: value heads split evenly; key heads split, or replicated (one per rank) when N > key heads
        self.gdn = hasattr(cfg, "linear_num_key_heads") and "linear_attention" in (cfg.layer_types or [])
        if self.gdn:
            nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
            self.dk, self.dv, self.nk, self.nv = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nk, nv
            need(nv % nk == 0, f"{nv} GDN value heads are not a multiple of {nk} key heads")
            need(nv % W == 0, f"{nv} GDN value heads are not divisible by {W}")
            self.r = nv // nk
            self.v_heads = (R * nv // W, (R + 1) * nv // W)
            if nk % W == 0:
                self.k_heads = (R * nk // W, (R + 1) * nk // W)
            else:
                need(W % nk == 0, f"{nk} GDN key heads: {W} is neither a divisor nor a multiple of them")
                k = self.v_heads[0] // self.r
                self.k_heads = (k, k + 1)
            need(self.v_heads[0] // self.r == self.k_heads[0] and (self.v_heads[1] - 1) // self.r == self.k_heads[1] - 1,
                 "the rank's GDN value heads do not share its key heads")

        # MLP intermediate dims (balanced; uneven splits are fine: every rank builds its own modules)
        self.inter = {}
        for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
            n = getattr(cfg, name, None)
            if isinstance(n, int) and n > 0:
                need(n >= W, f"{name}={n} is smaller than {W}")
                self.inter[name] = (n, _part(n, W, R))

        self.vocab = cfg.vocab_size
        self.vrows = -(-self.vocab // W)  # rows per rank (the last rank's are zero-padded)
        self.vrange = (min(R * self.vrows, self.vocab), min((R + 1) * self.vrows, self.vocab))
        self.local_config = self._local_config()

    def _local_config(self):
        c = copy.deepcopy(self.cfg)
        c.head_dim = self.cfg.head_dim
        c.num_attention_heads = self.heads[1] - self.heads[0]
        c.num_key_value_heads = self.kv_heads[1] - self.kv_heads[0]
        if self.gdn:
            c.linear_num_key_heads = self.k_heads[1] - self.k_heads[0]
            c.linear_num_value_heads = self.v_heads[1] - self.v_heads[0]
        for name, (_, (a, b)) in self.inter.items():
            setattr(c, name, b - a)
        return c  # vocab_size stays full: the embedding is replicated; lm_head is replaced by adapt()

    def adapt(self, lm: torch.nn.Module) -> None:
        """Replace the (meta) lm_head by this rank's vocab slice."""
        old = lm.lm_head
        lm.lm_head = torch.nn.Linear(old.in_features, self.vrows, bias=False, device=old.weight.device,
                                     dtype=old.weight.dtype)

    def vocab_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full [V, H] tensor (tied embeddings), zero-padded."""
        a, b = self.vrange
        t = full[a:b]
        if t.shape[0] < self.vrows:
            t = torch.cat([t, t.new_zeros(self.vrows - t.shape[0], *t.shape[1:])])
        return t.clone()

    # -- which slice of which tensor -----------------------------------------------------------------------------

    def selection(self, key: str, shape: tuple[int, ...]) -> Selection | None:
        """The slice of checkpoint tensor `key` (any prefix: model., model.language_model., mtp.) this rank reads;
        None = the whole tensor (replicated)."""
        if key == "lm_head.weight":
            return Selection(0, [self.vrange], size=self.vrows)
        first = self.rank == 0
        if ".self_attn." in key:
            proj, _, kind = key.split(".self_attn.")[1].partition(".")
            h0, h1 = self.heads
            hd = self.hd
            if proj == "q_proj":
                return Selection(0, [(h0 * 2 * hd, h1 * 2 * hd)])
            if proj in ("k_proj", "v_proj"):
                k0, k1 = self.kv_heads
                return Selection(0, [(k0 * hd, k1 * hd)])
            if proj == "o_proj":
                return Selection(1, [(h0 * hd, h1 * hd)]) if kind == "weight" else (None if first else Selection(0, [], zero=True))
            return None  # q_norm, k_norm: per head_dim, replicated
        if ".linear_attn." in key:
            return self._gdn(key.split(".linear_attn.")[1])
        if ".mlp." in key:
            tail = key.split(".mlp.")[1]
            if tail in ("gate.weight", "shared_expert_gate.weight"):
                return None  # router / shared-expert gate: replicated
            if tail.startswith("experts."):
                I, (a, b) = self.inter["moe_intermediate_size"]
                if tail == "experts.gate_up_proj":  # [E, 2I, H]: gate rows then up rows
                    return Selection(1, [(a, b), (I + a, I + b)])
                if tail == "experts.down_proj":  # [E, H, I]
                    return Selection(2, [(a, b)])
                m = _PER_EXPERT.match(tail)
                if m:
                    return Selection(1 if m.group(1) == "down_proj" else 0, [(a, b)])
                return None
            name = "shared_expert_intermediate_size" if tail.startswith("shared_expert.") else "intermediate_size"
            parts = tail.split(".")  # [shared_expert.]{gate,up,down}_proj.{weight,bias}
            if len(parts) < 2 or name not in self.inter:
                return None
            proj, kind = parts[-2], parts[-1]
            _, (a, b) = self.inter[name]
            if proj in ("gate_proj", "up_proj"):
                return Selection(0, [(a, b)])
            if proj == "down_proj":
                return Selection(1, [(a, b)]) if kind == "weight" else (None if first else Selection(0, [], zero=True))
        return None

    def _gdn(self, tail: str) -> Selection | None:
        proj, _, kind = tail.partition(".")
        dk, dv, nk, r = self.dk, self.dv, self.nk, self.r
        k0, k1 = self.k_heads
        v0, v1 = self.v_heads
        qkv = [(k0 * dk, k1 * dk), (nk * dk + k0 * dk, nk * dk + k1 * dk), (2 * nk * dk + v0 * dv, 2 * nk * dk + v1 * dv)]
        if proj == "in_proj_qkvz":  # per key-head group g: [q dk | k dk | v r*dv | z r*dv]
            G, out = 2 * dk + 2 * r * dv, []
            for g in range(k0, k1):
                lo, hi = max(v0, g * r) - g * r, min(v1, (g + 1) * r) - g * r  # the group's value heads we hold
                base = g * G
                out += [(base, base + 2 * dk), (base + 2 * dk + lo * dv, base + 2 * dk + hi * dv),
                        (base + 2 * dk + r * dv + lo * dv, base + 2 * dk + r * dv + hi * dv)]
            return Selection(0, _merge(out))
        if proj == "in_proj_ba":  # per key-head group g: [b r | a r]
            out = []
            for g in range(k0, k1):
                lo, hi = max(v0, g * r) - g * r, min(v1, (g + 1) * r) - g * r
                out += [(g * 2 * r + lo, g * 2 * r + hi), (g * 2 * r + r + lo, g * 2 * r + r + hi)]
            return Selection(0, _merge(out))
        if proj in ("in_proj_qkv", "conv1d"):  # [q | k | v] sections (conv channels too)
            return Selection(0, _merge(qkv))
        if proj == "in_proj_z":
            return Selection(0, [(v0 * dv, v1 * dv)])
        if proj in ("in_proj_b", "in_proj_a", "A_log", "dt_bias"):
            return Selection(0, [(v0, v1)])
        if proj == "out_proj":
            return Selection(1, [(v0 * dv, v1 * dv)]) if kind == "weight" else (
                None if self.rank == 0 else Selection(0, [], zero=True))
        return None  # the gated norm: per value-head dim, replicated

    def describe(self) -> dict:
        d = {"attention_heads": list(self.heads), "kv_heads": list(self.kv_heads),
             "kv_heads_replicated": self.kv_replicated, "vocab_rows": list(self.vrange)}
        if self.gdn:
            d.update(gdn_key_heads=list(self.k_heads), gdn_value_heads=list(self.v_heads))
        d.update({k: list(v[1]) for k, v in self.inter.items()})
        return d


# --- launch -------------------------------------------------------------------------------------------------


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend_and_devices(device: str | None, world: int) -> str:
    """'cpu' or 'cuda' for the whole group, checked before anything is spawned."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise EngineError("--device cuda: no CUDA device is available (use --device cpu)")
        if device not in ("cuda",):
            raise EngineError(f"--device {device!r} with --tp: give plain 'cuda' (rank r uses cuda:r)")
        n = torch.cuda.device_count()
        if n < world:
            raise EngineError(f"--tp {world}: only {n} CUDA device{'' if n == 1 else 's'} visible")
        return "cuda"
    if device != "cpu":
        raise EngineError(f"--device {device!r}: expected cpu or cuda")
    return "cpu"


def cpu_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_split(world: int, model: str | None = None, preset: str | None = None, layers: int | None = None) -> None:
    """The model's heads split `world` ways (every rank's ShardPlan can be made), read from config.json (or a
    random-weights preset) alone: nothing is loaded. Raises EngineError naming what does not split."""
    if preset is not None:
        from .presets import preset_config

        _, cfg, _ = preset_config(preset, layers)
        where = f"preset {preset}"
    else:
        from .checkpoint import model_dir, read_json
        from .families import family_for

        root = model_dir(model)
        where = str(root / "config.json")
        raw = read_json(root / "config.json", "config.json")
        family = family_for(raw, where)
        try:
            cfg = family.text_config(raw)
        except Exception as e:
            raise EngineError(f"{where}: invalid {family.name} config ({str(e)[:200]})") from None
    for rank in range(world):
        ShardPlan(cfg, rank, world, where=where)


def check_tp(world: int, device: str | None = None, model: str | None = None, preset: str | None = None,
             layers: int | None = None) -> str:
    """Before anything is spawned: `world` ranks fit this machine (a CUDA device each, or on the CPU at most one
    rank per core) and the model (a folder, or a random-weights preset; none: not checked) splits `world` ways.
    Returns the group's device kind, 'cpu' or 'cuda'. Raises EngineError with the reason."""
    if world < 1:
        raise EngineError(f"--tp {world}: must be at least 1")
    kind = _backend_and_devices(device, world)
    if kind == "cpu" and world > 1:
        cores = cpu_cores()
        if world > cores:
            raise EngineError(f"--tp {world}: only {cores} CPU core{'' if cores == 1 else 's'} here "
                              f"(on the CPU each rank needs a core of its own)")
    if world > 1 and (model is not None or preset is not None):
        check_split(world, model, preset, layers)
    return kind


PR_SET_PDEATHSIG = 1  # linux/prctl.h
WATCH_S = 0.5  # how often a worker checks that its parent is still there


def die_with_parent(parent_pid: int) -> None:
    """Called first thing in a spawned worker: it must not outlive the process that started it (a parent killed
    with SIGTERM or SIGKILL cannot stop its workers itself). On Linux the kernel sends the worker SIGKILL when
    its parent goes (prctl PR_SET_PDEATHSIG; strictly, when the parent *thread* that spawned it ends: launch()
    spawns from the main thread, the chat from its engine thread, which lives as long as the engine). Everywhere,
    a watchdog thread also ends the worker once it has been reparented (its parent pid changed)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog below still ends this worker
    if os.getppid() != parent_pid:  # the parent went before the death signal was armed
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ctrl+c is the parent's to answer; this worker ends with it

    def watch() -> None:
        while True:
            time.sleep(WATCH_S)
            if os.getppid() != parent_pid:
                os._exit(1)

    import threading

    threading.Thread(target=watch, name="mtpchat-parent-watch", daemon=True).start()


def init_group(rank: int, world: int, kind: str, local_rank: int | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    """Join the default process group (env:// rendezvous) and return the whole world as a TPGroup."""
    local_rank = rank if local_rank is None else local_rank
    if kind == "cuda":
        for var, value in NO_MULTICAST.items():
            os.environ.setdefault(var, value)
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kwargs)
    return TPGroup(rank, world, None, device)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def _worker(fn, args, rank: int, world: int, port: int, kind: str, conn, timeout_s: float, parent: int) -> None:
    die_with_parent(parent)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if kind == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if rank != 0:  # rank 0 owns the terminal; the others report through the pipe
        sys.stdout = open(os.devnull, "w")
        sys.stderr = open(os.devnull, "w")
    code = 1
    try:
        group = init_group(rank, world, kind, timeout_s=timeout_s)
        code = int(fn(args, group) or 0)
    except EngineError as e:
        conn.send(("error", str(e)))
        code = 2
    except BrokenPipeError:  # rank 0's reader went away (`| head`): not a failure to report
        conn.send(("pipe", ""))
        code = 1
    except KeyboardInterrupt:
        code = 130
    except BaseException as e:  # noqa: BLE001 - everything else ends the group with a reason
        conn.send(("crash", _short(e)))
        code = 1
    finally:
        try:
            sys.stdout.flush()
            if dist.is_initialized():
                if code == 0:
                    dist.destroy_process_group()
                # after a failure, a collective-free exit: destroying a group whose peers are gone can hang
        except Exception:
            pass
        conn.close()
    os._exit(code)  # no atexit hooks that could block on a dead peer


def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through launch(), which stops the workers


def _stop(procs) -> None:
    """Terminate the workers still running, then kill those that do not go."""
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    for p in procs:
        p.join(5)
        if p.exitcode is None:
            p.kill()
            p.join()


def launch(fn, args, world: int, device: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """Run fn(args, group) on `world` ranks and return rank 0's exit status.

    Under torchrun (RANK / WORLD_SIZE in the environment) this process is one rank: it joins the group and runs
    fn itself; torchrun supervises. Otherwise `world` worker processes are spawned (torch.multiprocessing, spawn
    context; gloo on CPU, NCCL with NVLS off on CUDA) and this process supervises them: when one dies, the others
    get GRACE_S seconds, are terminated, and a TPError names the rank and its exit code. A user mistake
    (EngineError on the ranks, e.g. a bad model path) is re-raised as that error, once. The workers do not
    outlive this process (die_with_parent); SIGTERM here stops them, then exits 143.
    """
    if under_torchrun():
        env_world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world > 1 and world != env_world:
            raise EngineError(f"--tp {world}: torchrun started {env_world} processes (WORLD_SIZE)")
        kind = _backend_and_devices(device, int(os.environ.get("LOCAL_WORLD_SIZE", env_world)))
        group = init_group(rank, env_world, kind, int(os.environ.get("LOCAL_RANK", rank)), timeout_s)
        if rank != 0:
            sys.stdout = open(os.devnull, "w")
        try:
            return int(fn(args, group) or 0)
        finally:
            if rank != 0:
                sys.stdout.close()
                sys.stdout = sys.__stdout__
    if world < 1:
        raise EngineError(f"--tp {world}: must be at least 1")
    kind = _backend_and_devices(device, world)
    if kind == "cuda":
        os.environ.update(NO_MULTICAST)  # inherited by the workers
    import threading

    import torch.multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("spawn")
    port = _free_port()
    procs, conns = [], []
    messages: dict[int, tuple[str, str]] = {}
    failed: list[tuple[int, int]] = []

    def drain(r: int) -> None:
        try:
            while conns[r].poll():
                messages[r] = conns[r].recv()
        except (EOFError, OSError):
            pass

    on_main = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    old_term = signal.signal(signal.SIGTERM, _on_sigterm) if on_main else None
    sys.stdout.flush()
    try:
        # The workers ignore SIGINT, from their first instruction on (an ignored signal stays ignored across exec):
        # ctrl+c reaches the whole process group, and this process alone answers it; its workers end with it.
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN) if on_main else None
        try:
            for rank in range(world):
                recv, send = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_worker, args=(fn, args, rank, world, port, kind, send, timeout_s,
                                                      os.getpid()), name=f"mtpchat-tp{rank}", daemon=True)
                p.start()
                send.close()
                procs.append(p)
                conns.append(recv)
        finally:
            if on_main:
                signal.signal(signal.SIGINT, old_int if old_int is not None else signal.default_int_handler)
        alive = {p.sentinel: r for r, p in enumerate(procs)}
        deadline = None
        while alive:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(alive), left)
            batch = []
            for s in ready:
                r = alive.pop(s)
                procs[r].join()
                drain(r)
                if procs[r].exitcode != 0:
                    batch.append((r, procs[r].exitcode))
            # a worker killed by a signal is the cause; its peers' errors are the consequence
            failed += sorted(batch, key=lambda rc: (rc[1] >= 0, rc[0]))
            if failed and deadline is None:
                # rank 0's reader went away: nothing left to wait for; otherwise the others may still report why
                pipe = messages.get(0, ("",))[0] == "pipe"
                deadline = time.monotonic() + (0.0 if pipe else GRACE_S)
            if deadline is not None and time.monotonic() >= deadline and alive:
                _stop([procs[r] for r in alive.values()])
                alive = {}
    except BaseException:  # KeyboardInterrupt, SIGTERM (SystemExit), a failure to spawn: no worker stays behind
        _stop(procs)
        raise
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, old_term if old_term is not None else signal.SIG_DFL)
        for r, c in enumerate(conns):
            drain(r)
            c.close()
    if not failed:
        return 0
    if messages.get(0, ("",))[0] == "pipe":
        raise BrokenPipeError("standard output was closed by its reader")
    errors = {r: m for r, (kind_, m) in messages.items() if kind_ == "error"}
    if errors:  # the same user mistake on every rank: say it once
        raise EngineError(errors.get(0) or errors[min(errors)])
    r, code = failed[0]
    if code == 130 or code == -signal.SIGINT:
        raise KeyboardInterrupt
    what = f"exited with code {code}" if code > 0 else f"was killed by signal {-code}"
    detail = messages.get(r, (None, ""))[1]
    raise TPError(f"tensor-parallel worker rank {r} {what}{f' ({detail})' if detail else ''}; "
                  f"stopped the group of {world}")

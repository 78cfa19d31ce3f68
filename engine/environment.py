"""The machine we run on: the device and its memory, package versions, and whether FLA kernels are usable.

Import-light on purpose: torch is imported only inside the functions that need it, and FLA / triton only inside
`fla_status` on a CUDA device (their versions come from `importlib.metadata`, which imports nothing).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
from dataclasses import asdict, dataclass

DISABLE_FLA_ENV = "MTPCHAT_DISABLE_FLA"

# The ops whose backend the engine chooses (see engine.kernels). FLA provides the first four.
OPS = ("gdn_chunk", "gdn_recurrent", "conv1d", "gated_rmsnorm", "attention", "moe")
FLA_OPS = ("gdn_chunk", "gdn_recurrent", "conv1d", "gated_rmsnorm")


class DeviceUnavailable(RuntimeError):
    """The requested device does not exist here (e.g. `--device cuda` on a machine without CUDA)."""


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cuda" | "cpu"
    name: str
    total_bytes: int
    free_bytes: int
    index: int | None = None  # CUDA ordinal
    capability: str | None = None  # CUDA compute capability, e.g. "9.0"

    @property
    def torch_device(self) -> str:
        return f"cuda:{self.index or 0}" if self.kind == "cuda" else "cpu"

    @property
    def available_bytes(self) -> int:
        """Memory a model may take now: free memory when known, else the total."""
        return self.free_bytes if self.free_bytes > 0 else self.total_bytes

    def describe(self) -> str:
        mem = f"{format_bytes(self.available_bytes)} free of {format_bytes(self.total_bytes)}"
        return f"{self.torch_device} ({self.name}, {mem})"

    def to_json(self) -> dict:
        d = asdict(self)
        d["device"] = self.torch_device
        return d


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "?"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


# ---------------------------------------------------------------------------------------------------------------
# Memory and devices


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _cgroup_limit() -> tuple[int | None, int | None]:
    """(limit, usage) of this process's memory cgroup, when a limit is set (containers)."""
    # cgroup v2
    limit = _read_int("/sys/fs/cgroup/memory.max")
    if limit is not None:
        return limit, _read_int("/sys/fs/cgroup/memory.current")
    # cgroup v1: "no limit" reads as a huge number
    limit = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")
    if limit is not None and limit < (1 << 60):
        return limit, _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes")
    return None, None


def cpu_memory() -> tuple[int, int]:
    """(total, available) bytes of host RAM, capped by a cgroup memory limit when one is set."""
    total = avail = 0
    try:
        with open("/proc/meminfo") as f:
            info = {}
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    info[key] = int(parts[0]) * 1024  # kB
        total = info.get("MemTotal", 0)
        avail = info.get("MemAvailable", info.get("MemFree", 0))
    except (OSError, ValueError):
        pass
    if not total:
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            total = page * os.sysconf("SC_PHYS_PAGES")
            avail = page * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = avail = 0
    limit, usage = _cgroup_limit()
    if limit is not None and limit > 0:
        total = min(total, limit) if total else limit
        if usage is not None:
            avail = min(avail, max(0, limit - usage)) if avail else max(0, limit - usage)
    return total, avail


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def cpu_device() -> DeviceInfo:
    total, avail = cpu_memory()
    return DeviceInfo(kind="cpu", name=f"{_cpu_name()} ({os.cpu_count() or '?'} threads)", total_bytes=total,
                      free_bytes=avail)


def cuda_device(index: int = 0) -> DeviceInfo:
    import torch

    free, total = torch.cuda.mem_get_info(index)
    major, minor = torch.cuda.get_device_capability(index)
    return DeviceInfo(kind="cuda", name=torch.cuda.get_device_name(index), total_bytes=int(total),
                      free_bytes=int(free), index=index, capability=f"{major}.{minor}")


def _cuda_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver reads as "no CUDA"
        return 0


def cuda_unavailable_reason() -> str | None:
    """Why there is no usable CUDA device; None when there is one."""
    if _cuda_count():
        return None
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return "torch reports no usable CUDA device"


def probe_device(requested: str | None = None) -> DeviceInfo:
    """The device to run on. `requested`: None / "auto" (CUDA when available, else CPU), "cpu", "cuda", "cuda:N".

    Raises DeviceUnavailable when CUDA is asked for explicitly and is not there."""
    req = (requested or "auto").strip().lower()
    if req == "cpu":
        return cpu_device()
    if req == "auto":
        return cuda_device(0) if _cuda_count() else cpu_device()
    if req == "cuda" or req.startswith("cuda:"):
        try:
            index = int(req.split(":", 1)[1]) if ":" in req else 0
        except ValueError:
            raise DeviceUnavailable(f"bad device {requested!r}: expected cpu, cuda or cuda:N") from None
        count = _cuda_count()
        if not count:
            raise DeviceUnavailable(f"CUDA was requested but is not available: {cuda_unavailable_reason()}")
        if index >= count:
            raise DeviceUnavailable(f"{requested} requested but only {count} CUDA device(s) exist")
        return cuda_device(index)
    raise DeviceUnavailable(f"bad device {requested!r}: expected cpu, cuda, cuda:N or auto")


def visible_gpus(device: DeviceInfo) -> list[DeviceInfo]:
    """Every CUDA device when running on CUDA (what tensor parallelism could use), else none."""
    return [d for d in list_devices() if d.kind == "cuda"] if device.kind == "cuda" else []


def list_devices() -> list[DeviceInfo]:
    """Every CUDA device, then the CPU."""
    devices = []
    for i in range(_cuda_count()):
        try:
            devices.append(cuda_device(i))
        except Exception:  # a device we cannot query is left out rather than breaking diagnostics
            continue
    devices.append(cpu_device())
    return devices


# ---------------------------------------------------------------------------------------------------------------
# Packages


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def package_versions() -> dict:
    """Versions of what the engine depends on; None for a package that is not installed. Imports torch (for its
    CUDA version) but never FLA or triton."""
    versions = {
        "python": platform.python_version(),
        "torch": _dist_version("torch"),
        "cuda": None,
        "transformers": _dist_version("transformers"),
        "fla": _dist_version("flash-linear-attention", "fla-core"),
        "triton": _dist_version("triton", "pytorch-triton", "triton-nightly"),
        "textual": _dist_version("textual"),
        "huggingface_hub": _dist_version("huggingface-hub", "huggingface_hub"),
        "safetensors": _dist_version("safetensors"),
    }
    try:
        import torch

        versions["torch"] = torch.__version__
        versions["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return versions


def nvidia_driver() -> str | None:
    """The NVIDIA driver's version as nvidia-smi reports it; None where there is none."""
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().split("\n")[0].strip() or None


def compile_capability(device: DeviceInfo | None = None) -> dict:
    """What torch offers for compilation and graph capture here. Capability only: whether capture actually works
    is certified at run time by the engine's diagnostics (replay counters), not assumed here."""
    import importlib.util

    try:
        import torch
    except ImportError:
        return {"cuda_available": False, "torch_compile": False, "triton": False, "cuda_graphs": False}
    cuda = _cuda_count() > 0
    return {
        "cuda_available": cuda,
        "torch_compile": hasattr(torch, "compile"),
        "triton": importlib.util.find_spec("triton") is not None,
        "cuda_graphs": bool(cuda and hasattr(torch.cuda, "CUDAGraph")
                            and (device is None or device.kind == "cuda")),
    }


# ---------------------------------------------------------------------------------------------------------------
# FLA


def fla_disabled_by_env() -> bool:
    return os.environ.get(DISABLE_FLA_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def fla_status(device: DeviceInfo | None) -> tuple[bool, str]:
    """Whether the flash-linear-attention Triton kernels can be used on `device`, and why (not).

    Order: the MTPCHAT_DISABLE_FLA switch, then the device, then the import, then a tiny numerical self-check of
    `fused_recurrent_gated_delta_rule` against a torch reference (once per device and process)."""
    if fla_disabled_by_env():
        return False, f"disabled by {DISABLE_FLA_ENV}"
    if device is None or device.kind != "cuda":
        return False, "no CUDA device"
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule  # noqa: F401
    except Exception as e:  # ImportError, or a triton / driver error raised while importing
        return False, f"flash-linear-attention is not importable: {type(e).__name__}: {e}".rstrip(": ")
    return _fla_self_check(device.index or 0)


def _recurrent_error(index: int, kernel, B: int, T: int, seed: int) -> float:
    """Max abs error of kernel(q, k, v, g, beta, h0) -> (output, final state) on CUDA device `index` against the
    engine's torch reference, on a small random case with grouped value heads (HV = 2 H, as in the released
    models: the head mapping is checked too)."""
    import torch
    import torch.nn.functional as F

    from .kernels import torch_recurrent

    dev = torch.device("cuda", index)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    H, HV, K, V = 2, 4, 16, 16
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, HV, generator=gen))
    beta = torch.rand(B, T, HV, generator=gen)
    h0 = torch.randn(B, HV, K, V, generator=gen) * 0.1
    ref_o, ref_h = torch_recurrent(q, k, v, g, beta, h0)
    o, ht = kernel(*(x.to(dev) for x in (q, k, v, g, beta, h0)))
    torch.cuda.synchronize(dev)
    return max((o.float().cpu() - ref_o).abs().max().item(), (ht.float().cpu() - ref_h).abs().max().item())


@functools.lru_cache(maxsize=None)
def _fla_self_check(index: int) -> tuple[bool, str]:
    try:
        from .kernels import fla_recurrent

        err = _recurrent_error(index, fla_recurrent, B=1, T=5, seed=0)  # the FLA call the engine makes
    except Exception as e:
        return False, f"FLA self-check failed: {type(e).__name__}: {e}"
    if not err < 1e-3:  # also catches NaN
        return False, f"FLA self-check mismatch: max abs error {err:.3g} vs torch reference"
    return True, f"FLA self-check passed (max abs error {err:.1e})"


@functools.lru_cache(maxsize=None)
def fla_inplace_status(index: int) -> tuple[bool, str]:
    """Whether FLA's recurrent kernel, launched directly with its final state aliasing its initial state
    (kernels.fla_recurrent_into, as decoding runs it), matches the torch reference here: a check of the launch's
    arguments against the installed FLA version as much as of the aliasing. Decoding and verify passes copy the
    final state from FLA's own when it fails."""
    try:
        from .kernels import fla_recurrent_into

        def inplace(q, k, v, g, beta, state):
            return fla_recurrent_into(q, k, v, g, beta, state, state), state

        # a batch (commit's replay runs the layers as one) and T > 1
        err = _recurrent_error(index, inplace, B=2, T=3, seed=1)
    except Exception as e:
        return False, f"in-place launch failed: {type(e).__name__}: {str(e)[:160]}"
    if not err < 1e-3:
        return False, f"in-place launch mismatch: max abs error {err:.3g} vs torch reference"
    return True, f"in-place launch matches the torch reference (max abs error {err:.1e})"


def backend_plan(device: DeviceInfo | None) -> dict[str, dict]:
    """The backend each op would use on `device` and why: FLA for the GDN ops when usable, else torch."""
    usable, why = fla_status(device)
    plan: dict[str, dict] = {}
    for op in FLA_OPS:
        if usable:
            plan[op] = {"backend": "fla", "reason": why}
        else:
            plan[op] = {"backend": "torch", "reason": f"torch reference kernel: FLA unusable ({why})"}
    on_cuda = device is not None and device.kind == "cuda"
    sdpa = ("flash / memory-efficient backends on CUDA; decode steps inside CUDA graphs use matmuls + softmax"
            if on_cuda else "math backend on CPU")
    plan["attention"] = {"backend": "torch", "reason": f"torch scaled_dot_product_attention ({sdpa})"}
    plan["moe"] = {"backend": "torch", "reason": "device-side routing; decode widths through Triton kernels, else "
                   "grouped GEMMs, on CUDA in 16-bit (the first to pass a self-check at load), row-wise batched "
                   "matmuls elsewhere"}
    return plan


def run_dtype(device: DeviceInfo | None, disk_dtype: str | None = None) -> str:
    """The dtype a model runs in by default: float32 on CPU (bfloat16 when the model does not fit in float32:
    discovery.assess); on CUDA the checkpoint's half type (bfloat16 unless the checkpoint is float16)."""
    if device is None or device.kind != "cuda":
        return "float32"
    return "float16" if disk_dtype == "float16" else "bfloat16"

"""The input embedding table in page-locked host memory, read by the GPU over PCIe (issue #29).

A decode step reads 1-5 rows of the table (vocab x hidden: 2.54 GB in bf16 for Qwen3.5-27B), yet the whole table
would hold GPU memory. Page-locked host memory is, under CUDA's unified virtual addressing, also a device address:
a CUDA tensor over it is an ordinary CUDA tensor whose reads cross PCIe, so F.embedding stays one kernel, inside
CUDA graphs and torch.compile too (llama.cpp keeps token embeddings on the host likewise; vLLM's UVA offload). The
lm_head reads every row each step: it stays on the GPU, and so does a table tied to it.

The table is page-locked where it lies (cuMemHostRegister) rather than copied into torch's pinned allocator, which
rounds every block up to a power of two (2.54 GB would lock 4 GiB). The driver API is called through ctypes: its
calls leave the CUDA runtime's last-error state alone, which a failed runtime call would leave for torch's next
kernel-launch check to report as its own.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
from dataclasses import dataclass

import torch

from .errors import EngineError

MODES = ("auto", "on", "off")
ENV = "MTPCHAT_EMBED_ON_HOST"  # `--embed-on-host` sets it: read where engines are built (the chat's engine thread)
AUTO_WEIGHT_FRACTION = 0.6  # auto: also for unquantized models whose weights take more of the GPU than this

_PORTABLE, _DEVICEMAP = 0x01, 0x02  # CU_MEMHOSTREGISTER_*: visible to every context, mapped into the device's space
_CAN_USE_HOST_POINTER = 91  # CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM


@dataclass(frozen=True)
class Placement:
    host: bool
    reason: str


def check_mode(mode: str | None, where: str = "--embed-on-host") -> str:
    """mode, else MTPCHAT_EMBED_ON_HOST, else auto; anything else is refused in one line."""
    source = where if mode is not None else ENV
    mode = mode if mode is not None else (os.environ.get(ENV) or "auto")
    if mode not in MODES:
        raise EngineError(f"{source} {mode!r}: expected one of {', '.join(MODES)}")
    return mode


def resolve(mode: str, device_type: str, tied: bool, quantized: bool, tp: bool, weight_bytes: int,
            gpu_bytes: int) -> Placement:
    """Where the table goes. auto: on the host where memory is what the user is short of (a quantized checkpoint,
    or weights over AUTO_WEIGHT_FRACTION of the GPU); on: wherever it can. Either way never tied to the lm_head
    nor under tensor parallelism (each rank's lookup would read over PCIe for a table each rank holds whole)."""
    if mode == "off":
        return Placement(False, "--embed-on-host off")
    if device_type != "cuda":
        return Placement(False, "on the CPU every tensor is in host memory already")
    if tied:
        return Placement(False, "tied embeddings: the lm_head reads the same table for every token")
    if tp:
        return Placement(False, "not under tensor parallelism")
    if mode == "on":
        return Placement(True, "--embed-on-host on")
    if quantized:
        return Placement(True, "auto: a quantized checkpoint")
    share = weight_bytes / gpu_bytes if gpu_bytes else 0.0
    if share > AUTO_WEIGHT_FRACTION:
        return Placement(True, f"auto: the weights take {share:.0%} of the GPU's memory")
    return Placement(False, f"auto: the weights take {share:.0%} of the GPU's memory (host placement from "
                            f"{AUTO_WEIGHT_FRACTION:.0%}, or for a quantized checkpoint)")


class _HostTable:
    """A page-locked host tensor as __cuda_array_interface__: torch.as_tensor makes the CUDA view, checking the
    pointer with cudaPointerGetAttributes (registered memory passes, pageable memory is refused). The view's storage
    holds this object, and it the host tensor and the registration, for as long as the view lives."""

    def __init__(self, host: torch.Tensor, device: torch.device, driver):
        self.host, self.device, self.driver = host, device, driver
        # (no bfloat16 typestr: the bits as integers of the same width, viewed as the dtype after)
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": f"<i{host.element_size()}",
                                         "data": (host.data_ptr(), False), "version": 2}

    def __del__(self):
        try:
            if torch.cuda.is_current_stream_capturing():  # (a collection mid-capture) a sync would spoil it: later
                _PENDING.append((self.host, self.device, self.driver))
                return
        except Exception:  # interpreter exit: the process's pages go with it
            return
        _release(self.host, self.device, self.driver)


_PENDING: list = []  # registrations whose release fell inside a CUDA graph capture: released by the next place()


def _release(host: torch.Tensor, device: torch.device, driver) -> None:
    try:  # no kernel may still read the pages; the synchronize also makes the device's context current
        torch.cuda.synchronize(device)
        driver.cuMemHostUnregister(ctypes.c_void_p(host.data_ptr()))
    except Exception:  # interpreter exit
        pass


def _driver():
    """The CUDA driver library (Linux's name; torch's CUDA runtime has loaded it already), or why not."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None, "the CUDA driver library (libcuda.so.1) does not load"
    cuda.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    cuda.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    cuda.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return cuda, None


def _error(cuda, code: int) -> str:
    text = ctypes.c_char_p()
    cuda.cuGetErrorString(code, ctypes.byref(text))
    return (text.value or b"").decode(errors="replace") or f"CUDA driver error {code}"


def _host_address_usable(cuda, index: int) -> str | None:
    """Why the GPU cannot read registered host memory at the host's own address (the address the view carries);
    None when it can (every GPU under Linux's unified addressing)."""
    dev, value = ctypes.c_int(), ctypes.c_int()
    code = cuda.cuDeviceGet(ctypes.byref(dev), index) or \
        cuda.cuDeviceGetAttribute(ctypes.byref(value), _CAN_USE_HOST_POINTER, dev)
    if code:
        return f"cannot ask the driver whether the GPU reads host memory at its address ({_error(cuda, code)})"
    return None if value.value else "this GPU reads registered host memory only at another address"


def _own_pages(like: torch.Tensor) -> tuple[torch.Tensor, int]:
    """An empty host tensor shaped as `like` that starts a page and whose whole pages (span bytes) lie in its own
    allocation: the driver locks whole pages, and a page shared with another registered table (a draft model's, a
    second engine's) would refuse the second registration. (Not a checkpoint's mapped pages either.)"""
    page = mmap.PAGESIZE
    nbytes = like.numel() * like.element_size()
    span = -(-nbytes // page) * page
    raw = torch.empty(span + page, dtype=torch.uint8)
    start = -raw.data_ptr() % page
    return raw[start:start + nbytes].view(like.dtype).view(like.shape), span


def place(embedding: torch.nn.Embedding, device: torch.device) -> str | None:
    """Move embedding.weight (on any device) to page-locked host memory and make it a CUDA view over that memory;
    None when done, else why not (the weight is then unchanged: the caller's .to(device) puts it on the GPU)."""
    while _PENDING:
        _release(*_PENDING.pop())
    cuda, why = _driver()
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)
    torch.cuda.synchronize(device)  # the device's primary context current on this thread, for the driver calls
    why = why or _host_address_usable(cuda, index)
    if why:
        return why
    weight = embedding.weight.detach()
    host, span = _own_pages(weight)
    host.copy_(weight)
    code = cuda.cuMemHostRegister_v2(ctypes.c_void_p(host.data_ptr()), span, _PORTABLE | _DEVICEMAP)
    if code:
        return f"host memory could not be page-locked ({_error(cuda, code)})"
    table = _HostTable(host, device, cuda)  # from here on its __del__ unregisters
    try:
        view = torch.as_tensor(table, device=device).view(weight.dtype)
    except Exception as e:  # (torch without NumPy has no __cuda_array_interface__ import)
        return f"no CUDA view of host memory ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    if view.data_ptr() != host.data_ptr():  # torch copied it (the pointer said another GPU): no view
        return f"the page-locked table is not addressable as {device}"
    embedding.weight = torch.nn.Parameter(view, requires_grad=False)
    return None


def plan(mode: str, device: torch.device, files, names: list[str], family,
         tp: bool) -> tuple[Placement | None, str | None]:
    """For model.load, from the checkpoint's headers before any tensor is read: the placement (None on the CPU:
    nothing to decide or report) and, when it is the host, the table's checkpoint key, which load then reads into
    host memory (the table never passes through the GPU)."""
    from .discovery import SAFETENSORS_DTYPES

    if device.type != "cuda":
        return None, None
    key = untied_table_key(names, family)
    weight_bytes = sum(math.prod(files.shape_of[k]) * SAFETENSORS_DTYPES.get(files.dtype_of[k], (None, 2))[1]
                       for k in names)  # (as stored: what the quantized formats keep)
    total = torch.cuda.get_device_properties(device).total_memory
    placement = resolve(mode, "cuda", key is None, bool(files.fp8) or files.int4 is not None, tp, weight_bytes,
                        total)
    return placement, key if placement.host else None


def untied_table_key(keys, family) -> str | None:
    """The checkpoint key of the input embedding table when the checkpoint has an lm_head of its own (a quantized
    one counts: lm_head.qweight, ...), else None: tied, the table is the lm_head's (model.load, discovery)."""
    key_of = {family.trunk_key(k): k for k in keys}
    if not any((k or "").startswith("lm_head.") for k in key_of):
        return None
    return key_of.get("model.embed_tokens.weight")


def settle(placement: Placement | None, embedding: torch.nn.Embedding, device: torch.device, mode: str):
    """Carry out the plan on the loaded module (before the model moves to the device): the backends' entry
    ("host" | "gpu", why) and, where --embed-on-host on could not be honoured, the Fallback saying why."""
    from .environment import format_bytes
    from .events import Fallback

    if placement is None:
        return None, None
    why = place(embedding, device) if placement.host else placement.reason
    if why is None:
        size = embedding.weight.numel() * embedding.weight.element_size()
        return ("host", f"page-locked host memory read over PCIe (UVA): {format_bytes(size)} off the GPU "
                        f"({placement.reason})"), None
    refused = Fallback("embed_on_host", f"{why}: the embedding table stays on the GPU") if mode == "on" else None
    return ("gpu", why), refused

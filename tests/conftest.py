import gc
import importlib
import inspect
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from fixtures import memo, write_checkpoint  # noqa: E402

# One intra-op thread: the tiny models' ops are small, and on CPU cores shared with other work torch's threads
# busy-wait for each other (measured here: a sampled 6-token reply 31 ms with 1 thread, 610 ms with 2).
torch.set_num_threads(1)


def cpu_oracle_takes_the_torch_path() -> None:
    """transformers binds its GDN functions to FLA's kernels at import when FLA is installed, whatever the device:
    on a CUDA machine its CPU float32 oracle then hands CPU tensors to Triton and fails ("cannot be accessed from
    Triton (cpu tensor?)"). CPU tensors go to its own torch reference (the function it wraps); CUDA ones still to
    what it chose."""
    for family in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            chosen = getattr(module, name)
            reference = inspect.unwrap(chosen)
            if reference is not chosen:
                setattr(module, name, by_device(chosen, reference))


def by_device(chosen, reference):
    """chosen for tensors on a GPU, reference (given only the keywords it takes, as transformers' wrapper does)
    on the CPU."""
    params = inspect.signature(reference).parameters

    def run(*args, **kwargs):
        query = args[0] if args else kwargs["query"]
        if query.device.type != "cpu":
            return chosen(*args, **kwargs)
        return reference(*args, **{k: v for k, v in kwargs.items() if k in params})

    return run


cpu_oracle_takes_the_torch_path()


@pytest.fixture(autouse=True)
def unfrozen_heap():
    """The chat's worker freezes the heap after each load (app/worker.settle_heap): what a test leaves must not
    stay frozen, out of the collector's reach, for the rest of the session."""
    yield
    gc.unfreeze()


# name -> (family, options): every released layout the loader must read
FIXTURES = {
    "next": ("qwen3_next", {}),
    "next_moe": ("qwen3_next", {"moe": True}),
    "q35": ("qwen3_5", {}),
    "q35_moe": ("qwen3_5_moe", {}),
}
EXTRA = {
    "q35_text": ("qwen3_5", {"wrapped": False}),
    "next_sharded_experts": ("qwen3_next", {"moe": True, "shards": True, "per_expert": True, "seed": 3}),
    "next_nomtp": ("qwen3_next", {"mtp": False, "seed": 5}),
    "q35_think": ("qwen3_5", {"thinking": True, "seed": 11}),  # a thinking template, <think> markers as tokens
}


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """ckpt(name) -> path of a tiny checkpoint, written once per session."""
    def write(name):
        family, opts = {**FIXTURES, **EXTRA}[name]
        return write_checkpoint(tmp_path_factory.mktemp(name), family, **opts)

    return memo(write)


@pytest.fixture(autouse=True)
def engines_default_to_the_cpu(request, monkeypatch):
    """On a CUDA machine an engine loaded without a device runs on the GPU in bf16, where transformers' CPU float32
    oracle and speculation == plain are not bit for bit (there the next_moe fixture's greedy reply left the
    oracle's at token 21 of 24). Tests not marked gpu load on the CPU in float32 there too, as CI runs them; the
    gpu-marked ones name their device. (A CPU-only machine: nothing changes.)"""
    if not torch.cuda.is_available() or request.node.get_closest_marker("gpu"):
        return
    from engine import model, presets

    chosen = model.default_device_dtype

    def cpu_default(device, dtype, root=None):
        return chosen(device or "cpu", dtype, root)

    monkeypatch.setattr(model, "default_device_dtype", cpu_default)
    monkeypatch.setattr(presets, "default_device_dtype", cpu_default)


@pytest.fixture(scope="session")
def engines(ckpt):
    from engine import load_engine

    return memo(lambda name: load_engine(str(ckpt(name)), device="cpu"))


@pytest.fixture(scope="session")
def triton_device():
    """Where the Triton kernel tests run: CUDA with Triton; the CPU through Triton's interpreter under
    TRITON_INTERPRET=1 with Triton importable (slow); else they skip (CI runs without TRITON_INTERPRET; the kernels
    still compile for sm_90 there: tests/triton_front.py)."""
    from engine import moe_triton

    if moe_triton.available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1" and moe_triton.triton is not None:
        return torch.device("cpu")
    pytest.skip("needs CUDA and Triton (or TRITON_INTERPRET=1 with Triton installed)")

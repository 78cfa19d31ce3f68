"""A Triton kernel compiled for an sm_90 GPU (Triton's whole pipeline: TTIR, TTGIR, LLVM IR, PTX and, with the
ptxas Triton ships, the cubin) on a machine without a GPU.

Triton's interpreter (TRITON_INTERPRET=1) runs a kernel as numpy and never type-checks or lowers it as the
compiler does: a loop-carried name whose type changes inside a loop runs there and fails to compile on a GPU
(stop 60's short conv kernel did, found on the H100 in stop 61). Compiling here catches that class before device
time is spent. Under TRITON_INTERPRET=1 every @triton.jit function is the interpreter's, so there the compile runs
in a child process without it; otherwise (CI) in this one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def compile_for_gpu(module: str, kernel: str, types: dict, constants: dict, **options) -> None:
    """Fails the test with the compiler's message where `module.kernel` does not compile for sm_90 with these
    constants (the other arguments: types' entry, else i32) and launch options (num_warps, num_stages); skips
    where this Triton cannot compile for CUDA."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        try:
            compile_kernel(module, kernel, types, constants, options)
        except ImportError as e:
            pytest.skip(f"Triton cannot compile for CUDA here: {e}")
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    args = [module, kernel, json.dumps(types), json.dumps(constants), json.dumps(options)]
    run = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, timeout=300)
    if run.returncode == 3:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stderr[-3000:]


def compile_kernel(module: str, kernel: str, types: dict, constants: dict, options: dict):
    """`module.kernel` compiled for sm_90 (Triton's CompiledKernel: asm["ttir" .. "cubin"]); ImportError where
    this Triton cannot compile for CUDA. Constexpr arguments not given take their defaults; an autotuned kernel
    is compiled as its JIT function (a configuration's values among the constants)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(module), kernel)
    while not hasattr(fn, "params"):
        fn = fn.fn
    constants = {p.name: p.default for p in fn.params if p.is_constexpr and p.name not in constants} | constants
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in fn.arg_names}
    try:
        return triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32), options=options)
    except (FileNotFoundError, RuntimeError) as e:  # (no ptxas or no CUDA backend in this Triton build)
        if "ptxas" in str(e) or "backend" in str(e).lower():
            raise ImportError(str(e)) from e
        raise


def _main(module: str, kernel: str, types: dict, constants: dict, options: dict) -> int:
    try:
        compile_kernel(module, kernel, types, constants, options)
    except ImportError as e:
        print(f"Triton cannot compile for CUDA here: {e}")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]), json.loads(sys.argv[5])))

"""Triton's front end (Python AST -> TTIR) for an sm_90 target, on a machine without a GPU.

Triton's interpreter (TRITON_INTERPRET=1) runs a kernel as numpy and never type-checks it as the compiler does:
a loop-carried name whose type changes inside a loop runs there and fails to compile on a GPU (stop 60's short
conv kernel did). The front end needs Triton's CUDA backend package, not a GPU or ptxas. It runs in a child
process without TRITON_INTERPRET, since under it every @triton.jit function is the interpreter's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def compile_front(module: str, kernel: str, types: dict, constants: dict) -> None:
    """Fails the test with the compiler's message where `module.kernel` does not compile for sm_90 with these
    constants (the other arguments: types' entry, else i32); skips where this Triton has no such front end."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, __file__, module, kernel, json.dumps(types), json.dumps(constants)],
                         capture_output=True, text=True, env=env, timeout=300)
    if run.returncode == 3:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stderr[-3000:]


def _main(module: str, kernel: str, types: dict, constants: dict) -> int:
    import importlib

    try:
        from triton._C.libtriton import ir
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.compiler import ASTSource
    except ImportError as e:
        print(f"Triton's CUDA front end is not importable here: {e}")
        return 3
    fn = getattr(importlib.import_module(module), kernel)
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in fn.arg_names}
    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    ASTSource(fn, signature, constants).make_ir(target, options, backend.get_codegen_implementation(options),
                                               backend.get_module_map(), context)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])))

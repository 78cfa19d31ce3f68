"""A Triton kernel's sm_90 SASS counted by opcode, on a machine without a GPU: what a form costs in instructions
(the W4A16 row form's shifts, LOP3s and FMAs a nibble; the FP8 forms' conversions) before device time is spent.
Compiles as tests/triton_front.py does (Triton's pipeline and the ptxas it ships), then disassembles the cubin
with the cuobjdump it ships.

    python packaging/bench/sass_census.py engine.int4_triton _w4a16_row \\
        '{"X": "*bf16", "QW": "*i32", "Z": "*u8", "S": "*bf16", "Y": "*bf16", "P": "*fp32", "LOCKS": "*i32"}' \\
        '{"KS": 4, "BLOCK_N": 64, "BLOCK_K": 128, "EVEN": true, "STAGES": 1, "PDL": true}' --warps 2 --stages 1
"""

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.pop("TRITON_INTERPRET", None)  # (the interpreter's kernels cannot be compiled)

from triton_front import compile_kernel  # noqa: E402


def cuobjdump(cubin: bytes, flag: str) -> str:
    """cuobjdump's output for the cubin (-sass: the instructions; -res-usage: registers, stack, shared memory)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True, check=True).stdout


def instructions(cubin: bytes) -> list[str]:
    """The SASS instruction lines, predicates dropped ("@P0 BRA ..." -> "BRA ...")."""
    lines = []
    for line in cuobjdump(cubin, "-sass").splitlines():
        text = line.split("*/", 1)[1].split(";")[0].strip() if line.strip().startswith("/*") and "*/" in line else ""
        if text.startswith("@"):
            text = text.split(None, 1)[1] if " " in text else ""
        if text[:1].isalpha():
            lines.append(text)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("module")
    ap.add_argument("kernel")
    ap.add_argument("types", help="JSON: argument -> Triton type (*bf16, *i32, fp32 ...); the rest i32")
    ap.add_argument("constants", help="JSON: constexpr argument -> value")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    kernel = compile_kernel(a.module, a.kernel, json.loads(a.types), json.loads(a.constants),
                            {"num_warps": a.warps, "num_stages": a.stages})
    lines = instructions(kernel.asm["cubin"])
    ops = collections.Counter(line.split()[0].split(".")[0] for line in lines)
    usage = " ".join(part for part in cuobjdump(kernel.asm["cubin"], "-res-usage").split() if ":" in part[1:])
    print(f"{a.module}.{a.kernel}: {len(lines)} SASS instructions ({a.warps} warps, {a.stages} stages; {usage})")
    for op, n in ops.most_common(a.top):
        print(f"  {op:10s} {n:6d}")


if __name__ == "__main__":
    main()

"""The Triton W8A16 kernel (fp8_triton.py) against dequantize-then-matmul: decode, verify and graph-prefill
widths, edge blocks, K split into slices, and rows that do not depend on the batch (speculation's verify pass
must give each row what decoding it alone gives). CUDA, or the CPU through Triton's interpreter
(TRITON_INTERPRET=1 with Triton installed); else skipped."""

import pytest
import torch
import torch.nn.functional as F

from engine.fp8 import FP8Linear, dequantize, quantize

try:  # (CI's CPU-only torch has no Triton: the tests below skip there)
    import triton
    import triton.language as tl

    from engine.fp8_triton import _fp8_as_bf16

    @triton.jit
    def _convert_bytes(W, Y, ASM: tl.constexpr):
        i = tl.arange(0, 256)
        tl.store(Y + i, _fp8_as_bf16(tl.load(W + i), ASM))
except ImportError:
    _convert_bytes = None


def _fp8(n, k, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    w, s = quantize(torch.randn(n, k, generator=g) * 0.05)
    return w.to(device), s.to(device)


@pytest.mark.parametrize("n,k,rows,config", [
    (256, 384, 1, ("rows", (64, 8, 4, 4))),  # decode: whole blocks
    (200, 300, 5, ("rows", (32, 8, 4, 4))),  # verify rows over partial edge blocks in N and K
    (256, 1024, 3, ("rows", (64, 2, 4, 4))),  # K in four slices of two blocks: the partial sums add up
    (256, 384, 1, ("dot", (64, 8, 4, 3))),
    (200, 300, 5, ("dot", (64, 8, 4, 3))),
    (256, 1024, 3, ("dot", (32, 2, 4, 4))),
    (136, 256, 40, ("dot", (64, 8, 4, 3))),  # a graph prefill's bucket (BLOCK_M 64)
    (128, 128, 130, ("dot", (128, 4, 4, 3))),  # two row blocks of 128
    # the FP8 bytes made bf16 by bit moves (CUDA; the interpreter, whose bf16 dot is not exact, runs fp16 inputs,
    # which take the dot form: _fp8_as_bf16 has its own test below)
    (200, 300, 5, ("dotbits", (64, 8, 4, 3))),  # edge blocks, verify rows
    (256, 1024, 1, ("dotbits", (32, 2, 4, 4))),  # one row, K in slices
    (136, 256, 40, ("dotbits", (64, 8, 4, 3))),
    # one row, runs of BLOCK_K columns: whole tiles with K in two slices, and partial edge tiles in N and K
    (256, 1024, 1, ("stream", (16, 2, 4, 3, 256))),
    (200, 300, 1, ("stream", (8, 1 << 20, 4, 3, 512))),
    # the same, its FP8 bytes made float32 by bit moves
    (256, 1024, 1, ("streambits", (16, 2, 4, 3, 256))),
    (200, 300, 1, ("streambits", (8, 1 << 20, 4, 3, 512))),
    # the stream form's tiles for a few rows: partial edge tiles in N and K, K in slices
    (200, 300, 5, ("streamrows", (4, 1 << 20, 4, 2, 256))),
    (256, 1024, 3, ("streamrows", (8, 2, 4, 2, 128))),
])
def test_the_kernel_equals_the_dequantized_matmul(triton_device, n, k, rows, config):
    from engine import fp8_triton

    dtype = torch.bfloat16 if triton_device.type == "cuda" else torch.float16
    w, s = _fp8(n, k, triton_device, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(triton_device, dtype)
    got = fp8_triton._launch(x, w, s, config)
    ref = F.linear(x.float(), dequantize(w, s, torch.float32))
    assert got.dtype == dtype and got.shape == (rows, n)
    assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2


@pytest.mark.parametrize("rows,config", [(1, ("rows", (32, 1, 4, 3))), (5, ("rows", (64, 2, 4, 4))),
                                         (3, ("dot", (32, 2, 4, 4))), (1, ("stream", (8, 1, 4, 3, 128))),
                                         (8, ("streamrows", (2, 1 << 20, 4, 2, 512)))])
def test_the_kernels_stream_a_16_bit_weight_as_f_linear_computes(triton_device, rows, config):
    """No scale: the same kernels over a bf16 / fp16 weight (the 16-bit linears cuBLAS is slow at), K split in
    slices over a partial edge block."""
    from engine import fp8_triton

    dtype = torch.bfloat16 if triton_device.type == "cuda" else torch.float16
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(72, 300, generator=g) * 0.05).to(triton_device, dtype)
    x = torch.randn(rows, 300, generator=g).to(triton_device, dtype)
    got = fp8_triton._launch(x, w, None, config)
    ref = F.linear(x.float(), w.float())
    assert got.dtype == dtype and got.shape == (rows, 72)
    assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2


def test_every_fp8_byte_becomes_its_bf16_exactly(triton_device):
    """The bit moves of the dotbits form (the PTX on CUDA, its per-byte twin in the interpreter): all 256 bytes,
    subnormals and signed zeros included, equal torch's float8_e4m3fn values times 2^-120."""
    b = torch.arange(256, dtype=torch.uint8, device=triton_device)
    y = torch.empty(256, dtype=torch.bfloat16, device=triton_device)
    _convert_bytes[(1,)](b, y, triton_device.type == "cuda")
    want = b.view(torch.float8_e4m3fn).float()
    finite = ~want.isnan()  # (0x7F and 0xFF: e4m3fn's NaNs, never in a checkpoint's weights)
    got = y.float() * 2.0**120
    assert torch.equal(got[finite], want[finite]), [(i, got[i].item(), want[i].item()) for i in range(256)
                                                   if finite[i] and got[i] != want[i]][:8]
    assert torch.equal(y.view(torch.int16).bitwise_and(-32768)[finite], b.to(torch.int16).mul(256)
                       .bitwise_and(-32768)[finite].to(torch.int16))  # the sign bit, -0 included


def test_every_fp8_byte_streams_exactly_through_the_bit_moves(triton_device):
    """streambits: all 256 bytes (subnormals, signed zeros) as the weights of one row, each alone in its column
    with an input of 1 and a block scale of 1: every output is the byte's float8_e4m3fn value, exactly (the bit
    moves, the 2^64 / 2^56 scaling and no flush of float32 subnormals to zero)."""
    from engine import fp8_triton

    b = torch.arange(256, dtype=torch.uint8, device=triton_device)
    want = b.view(torch.float8_e4m3fn).float()
    finite = ~want.isnan()
    cols = 8  # each byte in a different word position j = column % 4 across the rows
    w = torch.zeros(256, cols, dtype=torch.uint8, device=triton_device)
    for j in range(cols):
        w[:, j] = b.roll(j)
    dtype = torch.bfloat16 if triton_device.type == "cuda" else torch.float16
    scale = torch.ones(2, 1, device=triton_device)
    for j in range(cols):
        x = torch.zeros(1, cols, dtype=dtype, device=triton_device)
        x[0, j] = 1
        got = fp8_triton._launch(x, w.view(torch.float8_e4m3fn), scale, ("streambits", (8, 1 << 20, 4, 3, 256)))
        expect = want.roll(j)
        ok = finite.roll(j)
        assert torch.equal(got[0].float()[ok], expect.to(dtype).float()[ok]), j


def test_the_row_kernel_gives_a_row_what_it_gives_it_alone(triton_device):
    """Its rows are independent: the same multiply-adds in the same order whatever the width."""
    from engine import fp8_triton

    dtype = torch.bfloat16 if triton_device.type == "cuda" else torch.float16
    w, s = _fp8(384, 512, triton_device)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1)).to(triton_device, dtype)
    for choice in (("rows", (64, 2, 4, 4)), ("dot", (32, 2, 4, 4)), ("dotbits", (32, 2, 4, 4))):
        verify = fp8_triton._launch(x, w, s, choice)
        for i in range(5):
            assert torch.equal(fp8_triton._launch(x[i : i + 1], w, s, choice), verify[i : i + 1]), choice


@pytest.mark.parametrize("n,k", [(256, 384), (200, 300)])  # whole blocks; partial edge blocks in N and K
def test_the_dequantizing_kernel_rounds_as_fp8_dequantize(triton_device, n, k):
    """Long prefills' weight: the same float32 products as fp8.dequantize, rounded once, bit for bit."""
    from engine import fp8_triton

    dtype = torch.bfloat16 if triton_device.type == "cuda" else torch.float16
    w, s = _fp8(n, k, triton_device, seed=n)
    assert torch.equal(fp8_triton.dequantized(w, s, dtype), dequantize(w, s, dtype))


def test_a_long_prefill_meets_the_weight_a_block_of_columns_at_a_time(triton_device, monkeypatch):
    """Wider than the kernels: the weight dequantized 128 rows (output columns) and their scale row at a time."""
    from engine import fp8_triton, splitk

    dtype = torch.bfloat16 if triton_device.type == "cuda" else torch.float16
    w, s = _fp8(328, 256, triton_device, seed=5)  # a partial last block of 72 rows
    x = torch.randn(fp8_triton.MAX_ROWS + 1, 256, generator=torch.Generator().manual_seed(5)).to(triton_device, dtype)
    whole = fp8_triton.matmul(x, w, s)
    monkeypatch.setattr(splitk, "DEQUANTIZED_BYTES", 1)
    blocks = fp8_triton.matmul(x, w, s)
    ref = F.linear(x.float(), dequantize(w, s, torch.float32))
    for got in (whole, blocks):
        assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2


def test_install_swaps_the_forward_after_its_self_check(triton_device):
    from engine import fp8_triton

    if triton_device.type != "cuda":
        # the interpreter's CPU tensors take the dequantizing forward, with the reason
        lin = FP8Linear(256, 128)
        assert fp8_triton.install([lin], "cpu", torch.bfloat16).startswith("weight-only")
        assert lin.fp8_kernel is None
        return
    lin = FP8Linear(256, 128, device="cuda")
    lin.weight.data, lin.weight_scale_inv.data = _fp8(128, 256, "cuda")
    why = fp8_triton.install([lin], "cuda", torch.bfloat16)
    assert why.startswith("Triton"), why
    assert lin.fp8_kernel is fp8_triton.matmul
    x = torch.randn(2, 3, 256, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.float(), dequantize(lin.weight, lin.weight_scale_inv, torch.float32))
    assert ((lin(x).float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    wide = torch.randn(fp8_triton.MAX_ROWS + 1, 256, device="cuda", dtype=torch.bfloat16)  # a long prefill
    assert torch.equal(lin(wide), F.linear(wide, dequantize(lin.weight, lin.weight_scale_inv, torch.bfloat16)))


def test_without_cuda_the_forward_stays_the_exact_reference():
    from engine import fp8_triton

    lin = FP8Linear(256, 128)
    assert fp8_triton.install([lin], "cpu", torch.float32).startswith("weight-only")
    assert fp8_triton.install([torch.nn.Linear(4, 4)], "cpu", torch.float32) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the FP8 x FP8 prefill path is CUDA's (and Triton 3.x's "
                    "interpreter rounds float32 to e4m3 wrongly: -125.3 to -64)")
def test_the_activation_quantizer_rounds_each_row_and_128_columns():
    """Long prefills' activations (FP8 x FP8): e4m3 with one scale per row and 128 columns, amax / 448, rounded
    as torch rounds; rows padded to a multiple of 4 come out zero."""
    from engine import fp8_triton

    dev = "cuda"
    x = (torch.randn(5, 256, generator=torch.Generator().manual_seed(3)) * 3).to(dev, torch.bfloat16)
    x[1, :128] = 0  # an all-zero group: its scale is tiny, its values 0
    q = torch.empty(8, 256, device=dev, dtype=torch.float8_e4m3fn)
    s = torch.empty(2, 8, device=dev, dtype=torch.float32)
    fp8_triton._fp8_quantize_groups[(1, 2)](x, q, s, 5, 8, 256, x.stride(0), BLOCK_M=32, BLOCK_K=128)
    g = x.float().view(5, 2, 128)
    ref_s = g.abs().amax(-1).clamp(min=1e-12) / 448.0
    ref_q = (g / ref_s[..., None]).to(torch.float8_e4m3fn).view(5, 256)
    assert torch.equal(s.t()[:5], ref_s)
    assert torch.equal(q[:5].float(), ref_q.float()) and not q[5:].float().any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt's block-scaled FP8 GEMM needs CUDA")
def test_long_prefills_run_fp8_x_fp8_near_the_dequantized_matmul(monkeypatch):
    from engine import fp8_triton

    lin = FP8Linear(512, 256, device="cuda")
    lin.weight.data, lin.weight_scale_inv.data = _fp8(256, 512, "cuda")
    why = fp8_triton.install([lin], "cuda", torch.bfloat16)
    if torch.cuda.get_device_capability() < (8, 9):
        assert lin.fp8_kernel is fp8_triton.matmul and "compute capability" in why
        return
    assert lin.fp8_kernel is fp8_triton.matmul_a8 and "FP8 x FP8" in why, why
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.float(), dequantize(lin.weight, lin.weight_scale_inv, torch.float32))
    assert ((lin(x).float() - ref).abs().max() / ref.abs().max()).item() < fp8_triton.A8_TOL
    one = x[:3]  # decode / verify widths stay W8A16
    assert torch.equal(lin(one), fp8_triton.matmul(one, lin.weight, lin.weight_scale_inv))
    monkeypatch.setenv("MTPCHAT_FP8_PREFILL", "w8a16")
    assert "MTPCHAT_FP8_PREFILL" in fp8_triton.install([lin], "cuda", torch.bfloat16)
    assert lin.fp8_kernel is fp8_triton.matmul


def test_split_k_leaves_its_tile_counters_at_zero_and_repeats_bit_for_bit(triton_device):
    """The last K slice of each tile sums the partials and resets the tile's counter (splitk.store_tile): a
    counter left behind would make the next launch (or graph replay) sum too early."""
    from engine import fp8_triton, splitk

    dtype = torch.bfloat16 if triton_device.type == "cuda" else torch.float16
    w, s = _fp8(200, 1024, triton_device, seed=3)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(2)).to(triton_device, dtype)
    first = fp8_triton._launch(x, w, s, ("rows", (32, 2, 4, 4)))  # 4 slices of 2 blocks, 7 column tiles
    assert not splitk._locks[x.device].any()
    for _ in range(3):
        assert torch.equal(fp8_triton._launch(x, w, s, ("rows", (32, 2, 4, 4))), first)
    assert not splitk._locks[x.device].any()
    with pytest.raises(ValueError, match="output tiles"):  # more tiles than counters: refused, not overrun
        splitk.output(1, 1, 2, splitk.TILES + 1, x)


_SPLIT = {"X": "*bf16", "S": "*fp32", "Y": "*bf16", "P": "*fp32", "LOCKS": "*i32"}  # (K split: float32 partials)


@pytest.mark.parametrize("kernel, types, constants, options", [
    ("_fp8_rows", {"W": "*fp8e4nv"}, {"KS": 8, "BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 128, "SCALED": True}, (4, 4)),
    ("_fp8_rows", {"W": "*bf16"}, {"KS": 8, "BLOCK_M": 4, "BLOCK_N": 64, "BLOCK_K": 128, "SCALED": False}, (8, 3)),
    ("_fp8_dot", {"W": "*fp8e4nv"},
     {"KS": 8, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SCALED": True, "BITS": False, "ASM": False}, (4, 3)),
    ("_fp8_dot", {"W": "*u8"},  # dotbits: the bytes made bf16 by inline PTX
     {"KS": 8, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SCALED": True, "BITS": True, "ASM": True}, (4, 3)),
    ("_fp8_stream", {"W": "*fp8e4nv"},
     {"KS": 5, "BLOCK_N": 4, "BLOCK_K": 1024, "SCALED": True, "EVEN": True, "BITS": False}, (4, 3)),
    ("_fp8_stream", {"W": "*i32"},  # streambits: the bytes read as words
     {"KS": 5, "BLOCK_N": 4, "BLOCK_K": 1024, "SCALED": True, "EVEN": True, "BITS": True}, (4, 3)),
    ("_fp8_stream", {"W": "*bf16"}, {"KS": 2, "BLOCK_N": 8, "BLOCK_K": 2048, "SCALED": False, "EVEN": False}, (4, 4)),
    ("_fp8_stream_rows", {"W": "*fp8e4nv"}, {"KS": 8, "BLOCK_M": 4, "BLOCK_N": 4, "BLOCK_K": 256, "SCALED": True},
     (4, 2)),
    ("_fp8_stream_rows", {"W": "*bf16"}, {"KS": 1 << 20, "BLOCK_M": 8, "BLOCK_N": 2, "BLOCK_K": 512,
                                          "SCALED": False}, (4, 2)),
    ("_fp8_dequantize", {"W": "*fp8e4nv"}, {"BLOCK_N": 64, "BLOCK_K": 128}, (4, 3)),  # (long prefills' weights)
    ("_fp8_quantize_groups", {"Q": "*fp8e4nv"}, {"BLOCK_M": 32, "BLOCK_K": 128}, (4, 3)),  # (FP8 x FP8 prefills)
])
def test_the_kernels_compile_for_a_gpu(kernel, types, constants, options):
    """Triton's interpreter never type-checks or lowers a kernel as the compiler does (tests/triton_front.py):
    each form and configuration kind the tuner times compiles for sm_90, PDL on, without a GPU."""
    pytest.importorskip("triton")
    from triton_front import compile_for_gpu

    pdl = {"PDL": True} if kernel.startswith(("_fp8_rows", "_fp8_dot", "_fp8_stream")) else {}
    compile_for_gpu("engine.fp8_triton", kernel, _SPLIT | types, constants | pdl, num_warps=options[0],
                    num_stages=options[1])

"""The Hopper emulated NVFP4 GEMM (fused Triton kernel; CUDA dequantize + cuBLAS + CUDA epilogue) vs the
per-block reference.

Operands are quantized by the reference quantizer (pure torch, run on the GPU for speed with
NVFP4_FORCE_REFERENCE=1 set only while quantizing), so these tests do not depend on the CUDA
quantization kernels. Tolerance: atol = rtol = 8e-3 on BF16 output (docs/numerics.md §11).
"""
import functools
import os

import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist import reference
from nvfp4_dist.gemm import hopper
from nvfp4_dist.gemm import gemm
from nvfp4_dist.reference.gemm import block_values

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs a Hopper (sm_90) or newer GPU")

TOLERANCE = dict(atol=8e-3, rtol=8e-3)
PLAIN = hopper.FusedConfig(use_ptx=False)
SMALL_TILES = hopper.FusedConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)
B_FIRST = hopper.FusedConfig(block_n=256, num_stages=3, dequantize_b_first=True)
RECIPE = nv.NVFP4Recipe()
ROW_SCALED = nv.NVFP4Recipe(row_scaled_activation=True, rht=False, stochastic_rounding=False)


def random_matrix(rows: int, cols: int, scale: float, seed: int) -> torch.Tensor:
    """Random BF16 data with block magnitudes spread over several octaves (never zeros)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator) * scale
    x *= torch.exp2(torch.randint(-4, 4, (rows, cols // 16, 1), generator=generator).float()).repeat_interleave(16, 1).reshape(rows, cols)
    return x.to(torch.bfloat16)


@functools.lru_cache(maxsize=8)
def layer_operands(m: int, n: int, k: int, seed: int = 0, recipe=RECIPE):
    """x [M, K] activation, W [N, K] weight, dy [M, N] gradient on the GPU, each with both copies
    (x only rowwise when row-scaled, and then no dy)."""
    row_scaled = recipe.row_scaled_activation
    previous = os.environ.get("NVFP4_FORCE_REFERENCE")
    os.environ["NVFP4_FORCE_REFERENCE"] = "1"
    try:
        quantize = lambda t, role, **kw: nv.quantize(t.to("cuda"), role, recipe=recipe, **kw)
        x = quantize(random_matrix(m, k, 1.0, seed), "activation", columnwise=not row_scaled)
        w = quantize(random_matrix(n, k, 0.1, seed + 1), "weight")
        dy = None if row_scaled else quantize(random_matrix(m, n, 1.0, seed + 2), "gradient")
    finally:
        if previous is None:
            del os.environ["NVFP4_FORCE_REFERENCE"]
        else:
            os.environ["NVFP4_FORCE_REFERENCE"] = previous
    return x, w, dy


def layout(name: str, x, w, dy):
    """(a, a_copy, b, b_copy) of fprop, dgrad or wgrad (docs/numerics.md §3)."""
    return {"fprop": (x, "rowwise", w, "rowwise"),
            "dgrad": (dy, "rowwise", w, "columnwise"),
            "wgrad": (dy, "columnwise", x, "columnwise")}[name]


def operands(a, a_copy, b, b_copy):
    pick = lambda q, copy: (getattr(q, f"{copy}_data"), getattr(q, f"{copy}_scale"), getattr(q, f"amax_{copy}"))
    return pick(a, a_copy) + pick(b, b_copy)


def check_bf16(out: torch.Tensor, ref: torch.Tensor):
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.to(torch.bfloat16).float(), **TOLERANCE)


SHAPES = [(128, 128, 128), (112, 128, 96), (256, 384, 512), (1024, 768, 2048)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("name", ["fprop", "dgrad", "wgrad"])
def test_fused_and_dequantize_paths_match_reference(m, n, k, name):
    args = operands(*layout(name, *layer_operands(m, n, k, seed=m + n + k)))
    ref = reference.gemm_reference(*args)
    check_bf16(hopper.gemm_fused(*args, out_dtype=torch.bfloat16), ref)
    check_bf16(hopper.gemm_fused(*args, out_dtype=torch.bfloat16, config=PLAIN), ref)
    check_bf16(hopper.gemm_fused(*args, out_dtype=torch.bfloat16, config=SMALL_TILES), ref)
    check_bf16(hopper.gemm_fused(*args, out_dtype=torch.bfloat16, config=B_FIRST), ref)
    check_bf16(hopper.gemm_dequantize_matmul(*args, out_dtype=torch.bfloat16), ref)
    check_bf16(hopper.gemm_dequantize_matmul(*args, out_dtype=torch.bfloat16, rows_per_chunk=96), ref)


@pytest.mark.parametrize("name", ["fprop", "wgrad"])
def test_largest_shape(name):
    m, n, k = 4096, 3072, 4096
    args = operands(*layout(name, *layer_operands(m, n, k, seed=7)))
    ref = reference.gemm_reference(*args)
    check_bf16(hopper.gemm_fused(*args, out_dtype=torch.bfloat16), ref)
    check_bf16(hopper.gemm_fused(*args, out_dtype=torch.bfloat16, config=B_FIRST), ref)
    check_bf16(hopper.gemm_dequantize_matmul(*args, out_dtype=torch.bfloat16), ref)
    check_bf16(hopper.gemm_dequantize_matmul(*args, out_dtype=torch.bfloat16, rows_per_chunk=1024), ref)


def test_dequantize_into_bf16_and_fp16_is_exact():
    """The dequantize path's CUDA kernel: BF16 fp4 * scale and FP16 fp4 * scale * 2^-6, bit for bit."""
    x, w, _ = layer_operands(96, 80, 272, seed=3)
    for data, scale in ((x.rowwise_data, x.rowwise_scale), (w.columnwise_data, w.columnwise_scale)):
        expected = block_values(data, scale).reshape(data.shape[0], -1)
        out = hopper.dequantize_to_bf16(data, scale)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out.float(), expected)
        half = torch.empty(expected.shape, dtype=torch.float16, device="cuda")
        assert torch.equal(hopper.dequantize_into(data, scale, half).float(), expected * 2.0 ** -6)
    rows = x.rowwise_data[32:64]  # a row slice, as the chunked GEMM passes it
    out = hopper.dequantize_to_bf16(rows, x.rowwise_scale[32:64])
    assert torch.equal(out.float(), block_values(x.rowwise_data, x.rowwise_scale).reshape(96, -1)[32:64])


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per_row", [False, True])
def test_epilogue_is_the_fp32_formula(out_dtype, bias_dtype, per_row):
    """out (+)= acc * (S_dec(a) * S_dec(b)) (+ bias), in FP32 in that order, one rounding: torch's FP32
    elementwise ops give the same bits. Rows of a larger output (strided), 2100 columns (two column blocks)."""
    from nvfp4_dist.reference.quantize import decode_scale
    rows, cols = 24, 2100
    generator = torch.Generator().manual_seed(29)
    acc = (torch.randn(rows, cols, generator=generator) * 1e4).cuda()
    a_amax = (torch.rand(rows if per_row else 1, generator=generator) * 50 + 0.5).cuda()
    b_amax = torch.tensor([3.75], device="cuda")
    bias = None if bias_dtype is None else torch.randn(cols, generator=generator).to(bias_dtype).cuda()
    alpha = decode_scale(a_amax) * decode_scale(b_amax)
    expected = acc * (alpha[:, None] if per_row else alpha)
    if bias is not None:
        expected = expected + bias.float()
    for accumulate in (False, True):
        for offset in (0, 3):  # 4-column vectors, and single columns (rows not aligned to 4 elements)
            whole = torch.randn(rows, cols + 8, generator=generator).to(out_dtype).cuda()
            out = whole[:, offset:offset + cols]
            before = out.float().clone()
            hopper.apply_epilogue(acc, a_amax, b_amax, bias, out, accumulate)
            want = (expected + before if accumulate else expected).to(out_dtype)
            assert torch.equal(out, want), (accumulate, offset, (out.float() - want.float()).abs().max().item())


PATHS = {"fused": hopper.gemm_fused,
         "fused_b_first": lambda *args, **kw: hopper.gemm_fused(*args, config=B_FIRST, **kw),
         "dequantize": hopper.gemm_dequantize_matmul,
         "dequantize_chunked": lambda *args, **kw: hopper.gemm_dequantize_matmul(*args, rows_per_chunk=160, **kw),
         "dequantize_fp32": lambda *args, **kw: hopper.gemm_dequantize_matmul(*args, via_fp32=True, **kw)}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("with_bias", [False, True])
def test_accumulate_into_fp32(path, with_bias):
    m, n, k = 640, 384, 320
    args = operands(*layout("wgrad", *layer_operands(m, n, k, seed=11)))
    rows, cols = args[0].shape[0], args[3].shape[0]
    main_grad = torch.randn(rows, cols, device="cuda")
    before = main_grad.clone()
    bias = torch.randn(cols, device="cuda", dtype=torch.bfloat16) if with_bias else None
    returned = PATHS[path](*args, bias=bias, accumulate_into=main_grad)
    assert returned is main_grad
    expected = before + reference.gemm_reference(*args) + (0 if bias is None else bias.float())
    torch.testing.assert_close(main_grad, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_output_dtypes_and_bias(path, out_dtype):
    x, w, _ = layer_operands(208, 144, 176, seed=5)
    args = operands(x, "rowwise", w, "rowwise")
    bias = torch.randn(144, device="cuda")
    out = PATHS[path](*args, out_dtype=out_dtype, bias=bias)
    assert out.dtype == out_dtype
    torch.testing.assert_close(out.float(), (reference.gemm_reference(*args) + bias).to(out_dtype).float(), **TOLERANCE)


@pytest.mark.parametrize("path", ["fused", "dequantize"])
def test_row_scaled_activation(path, monkeypatch):
    monkeypatch.setenv("NVFP4_HOPPER_GEMM", path)
    x, w, _ = layer_operands(272, 192, 256, seed=9, recipe=ROW_SCALED)
    assert x.amax_rowwise.numel() == 272
    args = operands(x, "rowwise", w, "rowwise")
    ref = reference.gemm_reference(*args)
    check_bf16(gemm(x, w, backend="emulated"), ref)
    for run in PATHS.values():
        check_bf16(run(*args, out_dtype=torch.bfloat16), ref)


@pytest.mark.parametrize("path", ["fused", "dequantize"])
def test_public_gemm_picks_emulated_on_hopper(path, monkeypatch):
    monkeypatch.setenv("NVFP4_HOPPER_GEMM", path)
    monkeypatch.delenv("NVFP4_GEMM_BACKEND", raising=False)
    monkeypatch.delenv("NVFP4_FORCE_REFERENCE", raising=False)
    x, w, dy = layer_operands(256, 512, 384, seed=13)
    for name in ("fprop", "dgrad", "wgrad"):
        a, a_copy, b, b_copy = layout(name, x, w, dy)
        out = gemm(a, b, a_copy=a_copy, b_copy=b_copy)
        check_bf16(out, reference.gemm_reference(*operands(a, a_copy, b, b_copy)))
        ref_backend = gemm(a, b, a_copy=a_copy, b_copy=b_copy, backend="reference")
        check_bf16(out, ref_backend.float())


def test_unknown_hopper_path_is_rejected(monkeypatch):
    monkeypatch.setenv("NVFP4_HOPPER_GEMM", "fastest")
    x, w, _ = layer_operands(128, 128, 128)
    with pytest.raises(ValueError, match="NVFP4_HOPPER_GEMM"):
        gemm(x, w, backend="emulated")


@pytest.mark.parametrize("path", sorted(PATHS))
def test_out_rows_of_a_larger_tensor(path):
    """out=: y lands in the given rows of a bigger output (the overlapped layers' per-chunk GEMMs), nothing else moves."""
    x, w, _ = layer_operands(192, 160, 224, seed=17)
    args = operands(x, "rowwise", w, "rowwise")
    whole = torch.full((3 * 192, 160), 7.0, device="cuda", dtype=torch.bfloat16)
    returned = PATHS[path](*args, out_dtype=torch.bfloat16, out=whole[192:384])
    assert returned.data_ptr() == whole[192:384].data_ptr()
    check_bf16(whole[192:384], reference.gemm_reference(*args))
    assert bool((whole[:192] == 7).all()) and bool((whole[384:] == 7).all())


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_cublaslt_scales_and_writes_the_output_itself(out_dtype, monkeypatch):
    """Per-tensor amaxes: cuBLASLt applies alpha and the bias and writes out (no FP32 product, no epilogue
    kernel), never reads the NaNs an output buffer may hold, and agrees with the FP32 path and the reference."""
    epilogues = []
    monkeypatch.setattr(hopper, "apply_epilogue", lambda *args: epilogues.append(args))
    x, w, _ = layer_operands(320, 272, 224, seed=31)
    args = operands(x, "rowwise", w, "rowwise")
    bias = torch.randn(272, device="cuda").to(out_dtype)
    out = torch.full((320, 272), float("nan"), device="cuda", dtype=out_dtype)
    hopper.gemm_dequantize_matmul(*args, out=out, bias=bias)
    assert not epilogues
    expected = reference.gemm_reference(*args) + bias.float()
    torch.testing.assert_close(out.float(), expected.to(out_dtype).float(), **TOLERANCE)
    monkeypatch.undo()
    via_fp32 = hopper.gemm_dequantize_matmul(*args, out_dtype=out_dtype, bias=bias, via_fp32=True)
    close = dict(atol=1e-2, rtol=1e-2) if out_dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.float(), via_fp32.float(), **close)  # only the summation order may differ


def test_dequantized_b_is_reused_then_dropped_with_its_operand():
    """The dequantize path keeps B's BF16 copy while B lives and is unchanged, and frees it with B."""
    x, w, _ = layer_operands(128, 256, 192, seed=19)
    b_data, b_scale = w.rowwise_data.clone(), w.rowwise_scale.clone()
    first = hopper._last_b.get(b_data, b_scale)
    assert hopper._last_b.get(b_data, b_scale) is first
    b_data.add_(0)  # a new version: dequantized again
    assert hopper._last_b.get(b_data, b_scale) is not first
    del first, b_data
    assert hopper._last_b.values is None and hopper._last_b.key is None


def test_dequantize_path_chunks_rows_to_its_byte_budget(monkeypatch):
    """With the default rows_per_chunk, a GEMM whose temporaries (BF16 A rows, plus FP32 product rows on the
    FP32 path) exceed CHUNK_BYTES runs in row chunks."""
    monkeypatch.setattr(hopper, "CHUNK_BYTES", 1 << 18)  # chunks of 256 rows for these shapes
    x, w, dy = layer_operands(1024, 384, 512, seed=23)
    calls = []
    original = hopper.dequantize_into
    monkeypatch.setattr(hopper, "dequantize_into", lambda data, *rest: calls.append(data.shape[0]) or original(data, *rest))
    for via_fp32 in (False, True):
        for name in ("fprop", "wgrad"):
            args = operands(*layout(name, x, w, dy))
            calls.clear()
            out = hopper.gemm_dequantize_matmul(*args, out_dtype=torch.bfloat16, via_fp32=via_fp32)
            check_bf16(out, reference.gemm_reference(*args))
            assert len([rows for rows in calls if rows <= 256]) >= 2, calls  # A in chunks of at most 256 rows


def quantized_with_reference(tensor: torch.Tensor, **kwargs):
    """The reference quantizer's NVFP4Tensor of tensor (on the GPU)."""
    return reference.quantize_tensor(tensor.to("cuda"), **kwargs)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_wgrad_with_row_scaled_columnwise_operand(path):
    """dW = dy^T . x with x's columnwise copy row-scaled (one amax per row of x^T, docs/numerics.md §6b): output
    column k carries S_dec(amax_col[k]), in every path (the per-column alpha of the epilogue and the fused kernel)."""
    m, n, k = 640, 384, 320
    x = random_matrix(m, k, 1.0, 31) * torch.logspace(-2, 2, k).to(torch.bfloat16)
    dy = quantized_with_reference(random_matrix(m, n, 1.0, 32), rowwise=False)
    xq = quantized_with_reference(x, rowwise=False, row_scaled=True)
    args = (dy.columnwise_data, dy.columnwise_scale, dy.amax_columnwise,
            xq.columnwise_data, xq.columnwise_scale, xq.amax_columnwise)
    assert xq.amax_columnwise.numel() == k
    expected = reference.gemm_reference(*args)
    check_bf16(PATHS[path](*args, out_dtype=torch.bfloat16), expected)
    main_grad = torch.randn(n, k, device="cuda")
    before = main_grad.clone()
    PATHS[path](*args, accumulate_into=main_grad)
    torch.testing.assert_close(main_grad, before + expected, **TOLERANCE)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("bounds", [(256, 448), (448, 256), (256, 256)], ids=str)
def test_4over6_bounds_in_every_path(path, bounds):
    """Operands quantized with 4over6 under the bound 256 carry S_dec = amax / 1536 (docs/numerics.md §12.7)."""
    from nvfp4_dist.reference.fourover6 import FourOverSix
    m, n, k = 256, 384, 512
    a = quantized_with_reference(random_matrix(m, k, 1.0, 41), columnwise=False,
                                 four_over_six=FourOverSix("MAE", bounds[0]))
    b = quantized_with_reference(random_matrix(n, k, 0.1, 42), columnwise=False, block_2d=True,
                                 four_over_six=FourOverSix("MSE", bounds[1]))
    args = (a.rowwise_data, a.rowwise_scale, a.amax_rowwise, b.rowwise_data, b.rowwise_scale, b.amax_rowwise)
    expected = reference.gemm_reference(*args, a_e4m3_bound=bounds[0], b_e4m3_bound=bounds[1])
    check_bf16(PATHS[path](*args, out_dtype=torch.bfloat16, a_e4m3_bound=bounds[0], b_e4m3_bound=bounds[1]),
               expected)
    check_bf16(gemm(a, b, backend="emulated"), expected)


@pytest.mark.parametrize("bounds", [(448, 448), (256, 448), (448, 256)], ids=str)
def test_epilogue_per_column_and_bounds_are_the_fp32_formula(bounds):
    """out = acc * (S_dec(a) * S_dec(b)[column]) bit for bit, S_dec with each operand's bound (2100 columns)."""
    from nvfp4_dist.reference.quantize import decode_scale
    rows, cols = 24, 2100
    generator = torch.Generator().manual_seed(30)
    acc = (torch.randn(rows, cols, generator=generator) * 1e4).cuda()
    a_amax = (torch.rand(rows, generator=generator) * 50 + 0.5).cuda()
    b_amax = (torch.rand(cols, generator=generator) * 50 + 0.5).cuda()
    expected = acc * (decode_scale(a_amax, bounds[0])[:, None] * decode_scale(b_amax, bounds[1])[None, :])
    for offset in (0, 3):
        out = torch.empty(rows, cols + 8, device="cuda")[:, offset:offset + cols]
        hopper.apply_epilogue(acc, a_amax, b_amax, None, out, False, *bounds)
        assert torch.equal(out, expected)

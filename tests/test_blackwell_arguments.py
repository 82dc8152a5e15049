"""The Blackwell GEMM's torch._scaled_mm arguments, checked on the CPU independently of the project's helpers.

The project builds the arguments (nvfp4_dist.gemm.blackwell); torch._scaled_mm is replaced by
`decoded_scaled_mm`, written here from torch's documented contract and nothing of the project:
  - the operand checks of torch's _scaled_mm for CUDA tensors (a row-major, b column-major, packed K a
    multiple of 16 bytes, N a multiple of 16, scales of round_up(rows, 128) * round_up(K/16, 4) values);
  - FP4 E2M1 packing as torch.float4_e2m1fn_x2 holds it: element 2j in the low nibble, 2j+1 in the high;
  - the scales' 128x4 block layout as torch's `to_blocked` (torch/testing/_internal/common_quantized.py)
    builds it: rows padded to 128 and columns to 4, the [128, 4] tiles in row-major tile order, each
    tile stored as [32, 4, 4] = (row % 32, row // 32, column);
and it multiplies in float64. The product times alpha must equal the reference GEMM (per-16-block FP32
partial sums, docs/numerics.md §8) to FP32 rounding, for unaligned M, N, K, a row-scaled A, and the
operand pairs of fprop, dgrad and wgrad as nvfp4_dist.Linear passes them.
"""
import ast
import pathlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import nvfp4_dist as nv
from nvfp4_dist import reference
from nvfp4_dist.gemm import blackwell, dispatch
from nvfp4_dist.tensor import NVFP4Tensor

RECIPE = nv.NVFP4Recipe(rht=False, stochastic_rounding=False)
ROW_SCALED = nv.NVFP4Recipe(row_scaled_activation=True, rht=False, stochastic_rounding=False)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; bit 3 is the sign

# (M, N, K): torch needs K % 32 == 0 and N % 16 == 0, M free; the others exercise the padding.
SHAPES = [(200, 48, 96), (128, 128, 128), (65, 112, 96), (1023, 48, 64), (31, 64, 1024), (1, 16, 32),
          (200, 40, 96), (48, 48, 80), (3, 24, 208), (130, 200, 272)]


def ceil_to(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def decode_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """float4_e2m1fn_x2 bytes [R, C] -> float64 [R, 2C]: low nibble first."""
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64, device=packed.device)[nibbles & 7]
    return torch.where(nibbles >= 8, -magnitudes, magnitudes)


def decode_blocked_scales(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """torch's to_blocked layout read back: flat E4M3 -> float64 [rows, cols] (the padding dropped)."""
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    values = flat.view(torch.float8_e4m3fn).to(torch.float64)
    tiles = values.reshape(row_tiles, col_tiles, 32, 4, 4)          # (tile row, tile col, r % 32, r // 32, c)
    full = tiles.permute(0, 3, 2, 1, 4).reshape(row_tiles * 128, col_tiles * 4)
    return full[:rows, :cols]


class DecodedScaledMM:
    """Stands in for torch._scaled_mm: checks torch's contract, records the call, multiplies in float64."""

    def __init__(self):
        self.calls = []

    def __call__(self, a, b, scale_a, scale_b, *, out_dtype):
        assert a.dtype == b.dtype == torch.float4_e2m1fn_x2
        assert scale_a.dtype == scale_b.dtype == torch.float8_e4m3fn and out_dtype == torch.float32
        assert a.stride(1) == 1 and a.stride(0) >= a.shape[1], f"a must be row-major, strides {a.stride()}"
        assert b.stride(0) == 1 and b.stride(1) >= b.shape[0], f"b must be column-major, strides {b.stride()}"
        rows, packed_k, cols = a.shape[0], a.shape[1], b.shape[1]
        assert b.shape[0] == packed_k and packed_k % 16 == 0 and cols % 16 == 0, (a.shape, b.shape)
        scale_cols = ceil_to(packed_k * 2 // 16, 4)
        assert scale_a.is_contiguous() and scale_a.numel() == ceil_to(rows, 128) * scale_cols
        assert scale_b.is_contiguous() and scale_b.numel() == ceil_to(cols, 128) * scale_cols
        self.calls.append(dict(a=a, b=b, scale_a=scale_a, scale_b=scale_b))
        k = packed_k * 2
        a_values = decode_e2m1(a.view(torch.uint8)) * decode_blocked_scales(
            scale_a, rows, k // 16).repeat_interleave(16, dim=1)
        b_codes = b.t().view(torch.uint8)  # [cols, packed_k], the memory b describes
        b_values = decode_e2m1(b_codes) * decode_blocked_scales(scale_b, cols, k // 16).repeat_interleave(16, dim=1)
        return (a_values @ b_values.t()).to(torch.float32)


@pytest.fixture
def scaled_mm(monkeypatch):
    fake = DecodedScaledMM()
    monkeypatch.setattr(torch, "_scaled_mm", fake)
    return fake


def random_matrix(rows, cols, scale, seed):
    """Random data with block magnitudes spread over several octaves (never zeros)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator) * scale
    octaves = torch.randint(-4, 4, (rows, cols // 16, 1), generator=generator).float()
    return (x * torch.exp2(octaves).repeat_interleave(16, 1).reshape(rows, cols)).to(torch.bfloat16)


def gemm_operands(q: NVFP4Tensor, copy: str):
    return getattr(q, f"{copy}_data"), getattr(q, f"{copy}_scale"), getattr(q, f"amax_{copy}")


def cublaslt_product(scaled_mm, a_operand, b_operand) -> torch.Tensor:
    """FP32 [M, N] as the cublaslt backend computes it, with the decoded stand-in for cuBLASLt."""
    args = blackwell.scaled_mm_arguments(*a_operand, *b_operand)
    return blackwell.finish_scaled_mm(blackwell.run_scaled_mm(args), args)


def assert_matches_reference(got: torch.Tensor, a_operand, b_operand) -> None:
    """got equals the reference GEMM up to FP32 accumulation order."""
    want = reference.gemm_reference(*a_operand, *b_operand)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6 * want.abs().max().item())


@pytest.mark.parametrize("m,n,k", SHAPES, ids=str)
@pytest.mark.parametrize("row_scaled", [False, True], ids=["per_tensor", "row_scaled"])
def test_decoded_arguments_equal_the_reference(m, n, k, row_scaled, scaled_mm):
    recipe = ROW_SCALED if row_scaled else RECIPE
    xq = nv.quantize(random_matrix(m, k, 1.0, m + k), "activation", recipe=recipe, columnwise=False)
    wq = nv.quantize(random_matrix(n, k, 0.1, n + k), "weight" if n % 16 == 0 else "activation",  # 2D blocks: N % 16
                     recipe=RECIPE, columnwise=False)
    assert xq.amax_rowwise.numel() == (m if row_scaled else 1)
    a_operand, b_operand = gemm_operands(xq, "rowwise"), gemm_operands(wq, "rowwise")
    assert_matches_reference(cublaslt_product(scaled_mm, a_operand, b_operand), a_operand, b_operand)
    call = scaled_mm.calls[-1]
    padded_k, padded_n = ceil_to(k, 32), ceil_to(n, 16)
    assert tuple(call["a"].shape) == (m, padded_k // 2) and tuple(call["b"].shape) == (padded_k // 2, padded_n)
    a_codes, b_codes = call["a"].view(torch.uint8), call["b"].t().view(torch.uint8)
    assert torch.equal(a_codes[:, :k // 2], xq.rowwise_data) and not a_codes[:, k // 2:].any()
    assert torch.equal(b_codes[:n, :k // 2], wq.rowwise_data) and not b_codes[n:].any() and not b_codes[:, k // 2:].any()
    # the scales of the padding are zero (so padded blocks add 0, never 0 * NaN)
    a_scales = decode_blocked_scales(call["scale_a"], ceil_to(m, 128), ceil_to(padded_k // 16, 4))
    b_scales = decode_blocked_scales(call["scale_b"], ceil_to(n, 128), ceil_to(padded_k // 16, 4))
    assert not a_scales[m:].any() and not a_scales[:, k // 16:].any()
    assert not b_scales[n:].any() and not b_scales[:, k // 16:].any()
    torch.testing.assert_close(a_scales[:m, :k // 16], xq.rowwise_scale.double(), rtol=0, atol=0)


def test_aligned_operands_are_used_in_place(scaled_mm):
    """M = 200 is not a multiple of 128: with K % 32 == 0 and N % 16 == 0 no operand is copied."""
    xq = nv.quantize(random_matrix(200, 96, 1.0, 1), "activation", recipe=RECIPE, columnwise=False)
    wq = nv.quantize(random_matrix(48, 96, 0.1, 2), "weight", recipe=RECIPE, columnwise=False)
    args = blackwell.scaled_mm_arguments(*gemm_operands(xq, "rowwise"), *gemm_operands(wq, "rowwise"))
    assert args.a.data_ptr() == xq.rowwise_data.data_ptr()
    assert args.b.data_ptr() == wq.rowwise_data.data_ptr()


def test_per_row_b_amax_scales_output_columns(scaled_mm):
    """A per-row amax on B (a row-scaled activation's columnwise copy as the wgrad B operand) scales
    output column n by S_dec(b_amax[n])."""
    xq = nv.quantize(random_matrix(64, 96, 1.0, 3), "activation", recipe=RECIPE, columnwise=False)
    wq = nv.quantize(random_matrix(40, 96, 0.1, 4), "activation", recipe=ROW_SCALED, columnwise=False)
    a_operand, b_operand = gemm_operands(xq, "rowwise"), gemm_operands(wq, "rowwise")
    assert b_operand[2].numel() == 40
    got = cublaslt_product(scaled_mm, a_operand, b_operand)
    unscaled = cublaslt_product(scaled_mm, a_operand, (*b_operand[:2], torch.tensor([2688.0])))
    s_dec = torch.div(b_operand[2], torch.tensor(2688.0))
    torch.testing.assert_close(got, unscaled * s_dec.reshape(1, -1), rtol=1e-6, atol=0)


LAYOUTS = {  # name: (a tensor, a copy, b tensor, b copy), as nvfp4_dist.linear runs them
    "fprop": ("x", "rowwise", "w", "rowwise"),
    "dgrad": ("dy", "rowwise", "w", "columnwise"),
    "wgrad": ("dy", "columnwise", "x", "columnwise"),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("m,n,k", [(208, 48, 96), (64, 48, 80), (48, 32, 64)], ids=str)
def test_gemm_operand_pairs_through_the_cublaslt_backend(name, m, n, k, scaled_mm, monkeypatch):
    """gemm(backend resolved to cublaslt) on each operand pair equals the reference GEMM of those copies."""
    recipe = nv.NVFP4Recipe()  # RHT on the gradient/activation columnwise copies, 2D weights, SR
    tensors = {"x": nv.quantize(random_matrix(m, k, 1.0, 5), "activation", recipe=recipe),
               "w": nv.quantize(random_matrix(n, k, 0.1, 6), "weight", recipe=recipe),
               "dy": nv.quantize(random_matrix(m, n, 1.0, 7), "gradient", recipe=recipe, sr_seed=11)}
    a_name, a_copy, b_name, b_copy = LAYOUTS[name]
    a, b = tensors[a_name], tensors[b_name]
    monkeypatch.setattr(dispatch, "resolve_backend", lambda backend, device: "cublaslt")
    got = nv.gemm(a, b, a_copy=a_copy, b_copy=b_copy, out_dtype=torch.float32)
    assert len(scaled_mm.calls) == 1
    assert_matches_reference(got, gemm_operands(a, a_copy), gemm_operands(b, b_copy))


@pytest.mark.parametrize("recipe", [nv.NVFP4Recipe(), ROW_SCALED], ids=["default", "row_scaled"])
def test_linear_forward_and_backward_through_the_cublaslt_backend(recipe, scaled_mm, monkeypatch):
    """nvfp4_dist.Linear with every NVFP4 GEMM on the cublaslt path equals the layer on the reference GEMM."""
    tokens, features_in, features_out = 48, 80, 48  # every GEMM's K (80, 48, 48) is 16 more than a multiple of 32

    def run():
        torch.manual_seed(0)
        layer = nv.Linear(features_in, features_out, bias=True, dtype=torch.float32, recipe=recipe)
        x = torch.randn(tokens, features_in, requires_grad=True)
        y = layer(x)
        y.backward(torch.randn_like(y))
        return y.detach(), x.grad, layer.weight.grad, layer.bias.grad

    monkeypatch.setattr(dispatch, "resolve_backend", lambda backend, device: "reference")
    want = run()
    monkeypatch.setattr(dispatch, "resolve_backend", lambda backend, device: "cublaslt")
    got = run()
    assert len(scaled_mm.calls) == 3
    for name, g, w in zip(("y", "dx", "dW", "db"), got, want):
        torch.testing.assert_close(g, w, rtol=2e-6, atol=2e-6 * w.abs().max().item(), msg=name)


def torch_to_blocked():
    """torch's own `to_blocked` (and its `ceil_div`), taken from the installed torch's source: importing
    torch.testing._internal.common_quantized would need torch's test-only dependencies."""
    path = pathlib.Path(torch.__file__).parent / "testing" / "_internal" / "common_quantized.py"
    tree = ast.parse(path.read_text())
    wanted = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in ("ceil_div", "to_blocked")]
    assert len(wanted) == 2, f"{path} no longer defines ceil_div and to_blocked"
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), namespace)
    return namespace["to_blocked"]


def test_swizzled_scales_equal_torchs_to_blocked():
    """The scale arguments are byte for byte what torch's own to_blocked makes of the unpadded scales."""
    to_blocked = torch_to_blocked()
    for m, n, k in [(200, 48, 96), (3, 24, 208), (130, 200, 272), (1023, 48, 64)]:
        xq = nv.quantize(random_matrix(m, k, 1.0, m), "activation", recipe=RECIPE, columnwise=False)
        wq = nv.quantize(random_matrix(n, k, 0.1, n), "activation", recipe=RECIPE, columnwise=False)
        args = blackwell.scaled_mm_arguments(*gemm_operands(xq, "rowwise"), *gemm_operands(wq, "rowwise"))
        for got, scale in ((args.scale_a, xq.rowwise_scale), (args.scale_b, wq.rowwise_scale)):
            assert torch.equal(got.view(torch.uint8), to_blocked(scale.view(torch.uint8)))


def test_hand_placed_scales_land_where_to_blocked_says():
    """Distinct scale bytes at known (row, column) positions, found at the offsets of the layout."""
    rows, scale_cols = 300, 6
    scale = torch.zeros(rows, scale_cols, dtype=torch.uint8)
    marks = {(0, 0): 0x38, (1, 0): 0x39, (32, 0): 0x3A, (0, 3): 0x3B, (0, 4): 0x3C, (127, 5): 0x3D,
             (128, 0): 0x3E, (299, 5): 0x3F}
    for (r, c), byte in marks.items():
        scale[r, c] = byte
    data = torch.zeros(rows, scale_cols * 8, dtype=torch.uint8)
    args = blackwell.scaled_mm_arguments(data, scale.view(torch.float8_e4m3fn), torch.ones(1),
                                         data[:16], scale[:16].view(torch.float8_e4m3fn), torch.ones(1))
    flat = args.scale_a.view(torch.uint8)
    # tile (r // 128, c // 4) of 2 column tiles, 512 bytes each; in a tile (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
    expected_offsets = {(0, 0): 0, (1, 0): 16, (32, 0): 4, (0, 3): 3, (0, 4): 512, (127, 5): 512 + 31 * 16 + 12 + 1,
                        (128, 0): 1024, (299, 5): 2 * 1024 + 512 + (299 % 32) * 16 + ((299 % 128) // 32) * 4 + 1}
    for position, offset in expected_offsets.items():
        assert flat[offset] == marks[position], position
    assert int(flat.ne(0).sum()) == len(marks) and flat.numel() == 384 * 8


@pytest.mark.parametrize("m,n,k", [(200, 48, 96), (3, 24, 208), (256, 128, 192)], ids=str)
def test_arguments_pass_torch_scaled_mm_checks(m, n, k):
    """torch's own shape/stride/dtype checks of _scaled_mm for CUDA tensors accept the arguments."""
    xq = nv.quantize(random_matrix(m, k, 1.0, 8), "activation", recipe=RECIPE, columnwise=False)
    wq = nv.quantize(random_matrix(n, k, 0.1, 9), "activation", recipe=RECIPE, columnwise=False)
    args = blackwell.scaled_mm_arguments(*gemm_operands(xq, "rowwise"), *gemm_operands(wq, "rowwise"))
    short_scale_a = args.scale_a[:-4]
    with FakeTensorMode():
        to_cuda = lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
        raw = torch._scaled_mm(to_cuda(args.a), to_cuda(args.b), to_cuda(args.scale_a), to_cuda(args.scale_b),
                               out_dtype=torch.float32)
        assert tuple(raw.shape) == (m, ceil_to(n, 16)) and raw.dtype == torch.float32
        with pytest.raises(RuntimeError):
            torch._scaled_mm(to_cuda(args.a), to_cuda(args.b), to_cuda(short_scale_a), to_cuda(args.scale_b),
                             out_dtype=torch.float32)


def test_argument_errors():
    xq = nv.quantize(random_matrix(32, 64, 1.0, 10), "activation", recipe=RECIPE, columnwise=False)
    wq = nv.quantize(random_matrix(48, 64, 0.1, 11), "weight", recipe=RECIPE, columnwise=False)
    data, scale, amax = gemm_operands(xq, "rowwise")
    w_args = gemm_operands(wq, "rowwise")
    with pytest.raises(ValueError, match="a_data"):
        blackwell.scaled_mm_arguments(data.to(torch.int16), scale, amax, *w_args)
    with pytest.raises(ValueError, match="a_scale.shape"):
        blackwell.scaled_mm_arguments(data, scale[:, :2], amax, *w_args)
    with pytest.raises(ValueError, match="b_scale"):
        blackwell.scaled_mm_arguments(data, scale, amax, w_args[0], w_args[1].float(), w_args[2])
    with pytest.raises(ValueError, match="K mismatch"):
        blackwell.scaled_mm_arguments(data[:, :16], scale[:, :2], amax, *w_args)
    with pytest.raises(ValueError, match="a_amax"):
        blackwell.scaled_mm_arguments(data, scale, torch.ones(5), *w_args)
    with pytest.raises(ValueError, match="b_amax has 3"):
        blackwell.scaled_mm_arguments(data, scale, amax, *w_args[:2], torch.ones(3))

"""NVFP4 GEMM on the CPU: the reference vs float64, gemm() options and validation, and the
Blackwell scaled_mm argument logic checked by emulating cuBLASLt's block-scaled math."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import nvfp4_dist as nv
from nvfp4_dist import reference
from nvfp4_dist.gemm import blackwell, gpu_backends
from nvfp4_dist.gemm import gemm, resolve_backend
from nvfp4_dist.reference.gemm import block_values
from nvfp4_dist.reference.quantize import decode_scale
from nvfp4_dist.reference.swizzle import swizzle_offset

RECIPE = nv.NVFP4Recipe(rht=False, stochastic_rounding=False)
ROW_SCALED = nv.NVFP4Recipe(row_scaled_activation=True, rht=False, stochastic_rounding=False)


def random_matrix(rows, cols, scale, seed):
    """Random BF16 data with block magnitudes spread over several octaves (never zeros)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator) * scale
    octaves = torch.randint(-4, 4, (rows, cols // 16, 1), generator=generator).float()
    return (x * torch.exp2(octaves).repeat_interleave(16, 1).reshape(rows, cols)).to(torch.bfloat16)


def layer(m, n, k, seed=0, recipe=RECIPE):
    row_scaled = recipe.row_scaled_activation
    x = nv.quantize(random_matrix(m, k, 1.0, seed), "activation", recipe=recipe, columnwise=not row_scaled)
    w = nv.quantize(random_matrix(n, k, 0.1, seed + 1), "weight", recipe=recipe)
    dy = None if row_scaled else nv.quantize(random_matrix(m, n, 1.0, seed + 2), "gradient", recipe=recipe)
    return x, w, dy


LAYOUTS = {"fprop": lambda x, w, dy: (x, "rowwise", w, "rowwise"),
           "dgrad": lambda x, w, dy: (dy, "rowwise", w, "columnwise"),
           "wgrad": lambda x, w, dy: (dy, "columnwise", x, "columnwise")}


def operands(a, a_copy, b, b_copy):
    pick = lambda q, copy: (getattr(q, f"{copy}_data"), getattr(q, f"{copy}_scale"), getattr(q, f"amax_{copy}"))
    return pick(a, a_copy) + pick(b, b_copy)


def float64_gemm(a_data, a_scale, a_amax, b_data, b_scale, b_amax):
    """A . B^T in float64 from the exact block values, times the FP32 alpha."""
    a = block_values(a_data, a_scale).reshape(a_data.shape[0], -1).double()
    b = block_values(b_data, b_scale).reshape(b_data.shape[0], -1).double()
    alpha = decode_scale(a_amax).reshape(-1, 1).double() * decode_scale(b_amax).reshape(1, -1).double()
    return (a @ b.t()) * alpha


@pytest.mark.parametrize("m,n,k", [(128, 128, 128), (112, 128, 96), (48, 80, 256)])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_reference_matches_float64(m, n, k, name):
    args = operands(*LAYOUTS[name](*layer(m, n, k, seed=m + k)))
    out = reference.gemm_reference(*args)
    expected = float64_gemm(*args)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_reference_row_scaled_matches_float64():
    x, w, _ = layer(64, 48, 160, seed=4, recipe=ROW_SCALED)
    assert x.amax_rowwise.shape == (64,)
    args = operands(x, "rowwise", w, "rowwise")
    expected = float64_gemm(*args)
    torch.testing.assert_close(reference.gemm_reference(*args).double(), expected, rtol=1e-5,
                               atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_public_gemm_on_cpu(name):
    a, a_copy, b, b_copy = LAYOUTS[name](*layer(96, 64, 80, seed=9))
    args = operands(a, a_copy, b, b_copy)
    expected = float64_gemm(*args)
    out = gemm(a, b, a_copy=a_copy, b_copy=b_copy)
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected.to(torch.bfloat16).double(), atol=8e-3, rtol=8e-3)
    bias = torch.randn(expected.shape[1])
    out32 = gemm(a, b, a_copy=a_copy, b_copy=b_copy, out_dtype=torch.float32, bias=bias)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), expected + bias.double(), rtol=1e-5, atol=1e-4)
    main_grad = torch.randn(*expected.shape)
    before = main_grad.clone()
    returned = gemm(a, b, a_copy=a_copy, b_copy=b_copy, accumulate_into=main_grad)
    assert returned is main_grad
    torch.testing.assert_close(main_grad.double(), before.double() + expected, rtol=1e-5, atol=1e-4)
    whole = torch.zeros(3 * expected.shape[0], expected.shape[1], dtype=torch.bfloat16)
    rows = slice(expected.shape[0], 2 * expected.shape[0])
    returned = gemm(a, b, a_copy=a_copy, b_copy=b_copy, out=whole[rows])
    assert returned.data_ptr() == whole[rows].data_ptr()
    assert torch.equal(whole[rows], out) and not whole[:expected.shape[0]].any() and not whole[rows.stop:].any()


def test_gemm_validation_errors():
    x, w, dy = layer(32, 48, 64)
    with pytest.raises(ValueError, match="K mismatch"):
        gemm(x, dy)
    with pytest.raises(ValueError, match="a_copy"):
        gemm(x, w, a_copy="diagonal")
    with pytest.raises(ValueError, match="holds no columnwise copy"):
        gemm(x.rowwise_only(), w, a_copy="columnwise", b_copy="columnwise")
    with pytest.raises(ValueError, match="must be an NVFP4Tensor"):
        gemm(torch.zeros(32, 64), w)
    with pytest.raises(ValueError, match="out_dtype"):
        gemm(x, w, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="bias"):
        gemm(x, w, bias=torch.ones(47))
    with pytest.raises(ValueError, match="accumulate_into"):
        gemm(x, w, accumulate_into=torch.zeros(32, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="accumulate_into"):
        gemm(x, w, accumulate_into=torch.zeros(48, 32).t())
    with pytest.raises(ValueError, match="out: expected"):
        gemm(x, w, out=torch.zeros(32, 48, dtype=torch.float32))
    with pytest.raises(ValueError, match="out: expected"):
        gemm(x, w, out=torch.zeros(48, 32, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="at most one"):
        gemm(x, w, out=torch.zeros(32, 48, dtype=torch.bfloat16), accumulate_into=torch.zeros(32, 48))
    with pytest.raises(ValueError, match="backend"):
        gemm(x, w, backend="fastest")
    with pytest.raises(ValueError, match="needs CUDA"):
        gemm(x, w, backend="cublaslt")
    with pytest.raises(ValueError, match="only the A operand may be row-scaled"):
        xr, _, _ = layer(32, 48, 64, recipe=ROW_SCALED)
        gemm(w, xr)


def test_backend_resolution(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("NVFP4_GEMM_BACKEND", raising=False)
    assert resolve_backend(None, cpu) == "reference"
    monkeypatch.setenv("NVFP4_GEMM_BACKEND", "emulated")
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_backend(None, cpu)
    monkeypatch.setenv("NVFP4_GEMM_BACKEND", "reference")
    assert resolve_backend(None, cpu) == "reference"
    monkeypatch.setenv("NVFP4_HOPPER_GEMM", "fastest")
    with pytest.raises(ValueError, match="NVFP4_HOPPER_GEMM"):
        gpu_backends.hopper_path()
    monkeypatch.setenv("NVFP4_HOPPER_GEMM", "fused")
    assert gpu_backends.hopper_path() == "fused"
    monkeypatch.delenv("NVFP4_HOPPER_GEMM")
    assert gpu_backends.hopper_path() == "dequantize"


# Blackwell: argument building, padding and the emulated cuBLASLt block-scaled math.

@pytest.mark.parametrize("m,n,k", [(128, 256, 128), (112, 128, 96), (200, 48, 272)])
@pytest.mark.parametrize("row_scaled", [False, True])
def test_blackwell_arguments_and_emulation_match_reference(m, n, k, row_scaled):
    generator = torch.Generator().manual_seed(m + n + k)
    x = random_matrix(m, k, 1.0, m)
    recipe = ROW_SCALED if row_scaled else RECIPE
    xq = nv.quantize(x, "activation", recipe=recipe, columnwise=False)
    wq = nv.quantize(torch.randn(n, k, generator=generator).to(torch.bfloat16) * 0.1, "weight", recipe=RECIPE,
                     columnwise=False)
    args = operands(xq, "rowwise", wq, "rowwise")
    call = blackwell.scaled_mm_arguments(*args)
    padded_m, padded_n, padded_k = (-(-m // 128) * 128, -(-n // 128) * 128, -(-k // 64) * 64)
    assert call.a.dtype == call.b.dtype == torch.float4_e2m1fn_x2
    assert tuple(call.a.shape) == (padded_m, padded_k // 2) and call.a.stride() == (padded_k // 2, 1)
    assert tuple(call.b.shape) == (padded_k // 2, padded_n) and call.b.stride() == (1, padded_k // 2)
    assert call.scale_a.dtype == call.scale_b.dtype == torch.float8_e4m3fn
    assert call.scale_a.shape == (padded_m * padded_k // 16,) and call.scale_b.shape == (padded_n * padded_k // 16,)
    assert (call.rows, call.cols) == (m, n)
    assert call.alpha.shape == ((m, 1) if row_scaled else (1, 1))
    # padding holds zero codes and zero scales; the data is unchanged
    codes = call.a.view(torch.uint8)
    assert torch.equal(codes[:m, :k // 2], xq.rowwise_data)
    assert not codes[m:].any() and not codes[:, k // 2:].any()
    # spot-check the swizzled positions with the SPEC formula
    raw = call.scale_b.view(torch.uint8)
    scale_b = wq.rowwise_scale.view(torch.uint8)
    for r, c in ((0, 0), (n - 1, k // 16 - 1), (min(33, n - 1), min(5, k // 16 - 1))):
        assert raw[swizzle_offset(r, c, padded_k // 16)] == scale_b[r, c]
    emulated = blackwell.finish_scaled_mm(blackwell.emulate_scaled_mm(call), call)
    expected = reference.gemm_reference(*args)
    torch.testing.assert_close(emulated, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


def test_blackwell_aligned_operands_are_not_copied():
    xq, wq, _ = layer(128, 128, 128)
    call = blackwell.scaled_mm_arguments(*operands(xq, "rowwise", wq, "rowwise"))
    assert call.a.data_ptr() == xq.rowwise_data.data_ptr()
    assert call.b.data_ptr() == wq.rowwise_data.data_ptr()


@pytest.mark.parametrize("m,n,k", [(256, 128, 192), (112, 128, 96)])
def test_blackwell_arguments_pass_torch_scaled_mm_checks(m, n, k):
    """torch's own shape/stride/dtype checks of _scaled_mm for CUDA tensors accept the arguments."""
    xq, wq, _ = layer(m, n, k)
    call = blackwell.scaled_mm_arguments(*operands(xq, "rowwise", wq, "rowwise"))
    short_scale_a = call.scale_a[:-4]
    with FakeTensorMode():
        to_cuda = lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
        raw = torch._scaled_mm(to_cuda(call.a), to_cuda(call.b), to_cuda(call.scale_a), to_cuda(call.scale_b),
                               out_dtype=torch.float32)
        assert tuple(raw.shape) == (-(-m // 128) * 128, -(-n // 128) * 128) and raw.dtype == torch.float32
        with pytest.raises(RuntimeError):
            torch._scaled_mm(to_cuda(call.a), to_cuda(call.b), to_cuda(short_scale_a), to_cuda(call.scale_b),
                             out_dtype=torch.float32)


def test_blackwell_argument_errors():
    xq, wq, _ = layer(32, 48, 64)
    data, scale, amax = xq.rowwise_data, xq.rowwise_scale, xq.amax_rowwise
    w_args = (wq.rowwise_data, wq.rowwise_scale, wq.amax_rowwise)
    with pytest.raises(ValueError, match="a_data"):
        blackwell.scaled_mm_arguments(data.to(torch.int16), scale, amax, *w_args)
    with pytest.raises(ValueError, match="a_scale.shape"):
        blackwell.scaled_mm_arguments(data, scale[:, :2], amax, *w_args)
    with pytest.raises(ValueError, match="b_scale"):
        blackwell.scaled_mm_arguments(data, scale, amax, wq.rowwise_data, wq.rowwise_scale.float(),
                                           wq.amax_rowwise)
    with pytest.raises(ValueError, match="K mismatch"):
        blackwell.scaled_mm_arguments(data[:, :16], scale[:, :2], amax, *w_args)
    with pytest.raises(ValueError, match="a_amax"):
        blackwell.scaled_mm_arguments(data, scale, torch.ones(5), *w_args)

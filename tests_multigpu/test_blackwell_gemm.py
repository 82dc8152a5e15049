"""The Blackwell NVFP4 GEMM (nvfp4_dist.gemm.blackwell) on a GPU.

Any CUDA GPU (Hopper included): the scale swizzle kernel (csrc/swizzle.cu) equals the reference swizzle
and torch's own `to_blocked` byte for byte; the torch._scaled_mm arguments built from CUDA operands (the
swizzle kernel, the K and N padding) equal those built from the same operands on the CPU; the automatic
backend choice on this GPU.

sm_100 / sm_103 / sm_120 only (skipped elsewhere, with the reason): gemm(backend="cublaslt"), the real
cuBLASLt block-scaled FP4 GEMM, on unaligned shapes:
  - probes after PyTorch's own NVFP4 numerics tests (identity, ones, a block of twos, a block whose code
    and scale are both modified), on A and on B, first and last rows and blocks: results are small
    integers, compared exactly with the float64 product of the probe's values and with the reference;
  - random codes (all 16) with random block scales 0.5, 1 or 2 and K <= 1024: every product is a multiple
    of 2^-4 and every partial sum below 2^18 in magnitude, so at most 22 significant bits: exact in FP32
    in any summation order, and compared bit for bit with the reference;
  - quantized random data for the fprop, dgrad and wgrad operand pairs (and a row-scaled A): within the
    bound of an FP32 accumulation in another order, K * 2^-23 * (|A| . |B|^T) * alpha.
Run: python -m pytest -q tests_multigpu/test_blackwell_gemm.py
"""
import ast
import pathlib

import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist import kernels, reference
from nvfp4_dist.gemm import blackwell, resolve_backend
from nvfp4_dist.reference.gemm import block_values
from nvfp4_dist.reference.quantize import decode_scale
from nvfp4_dist.tensor import NVFP4Tensor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

RECIPE = nv.NVFP4Recipe()
PLAIN = nv.NVFP4Recipe(rht=False, stochastic_rounding=False)
ROW_SCALED = nv.NVFP4Recipe(row_scaled_activation=True, rht=False, stochastic_rounding=False)
# (M, N, K) with M, N, K not multiples of 128 (and K % 32 == 16 or N % 16 != 0 for the padding path)
UNALIGNED = [(200, 48, 96), (65, 112, 96), (1023, 48, 64), (31, 64, 1024), (2, 1024, 128), (128, 128, 128),
             (200, 40, 96), (48, 48, 80), (3, 24, 208), (130, 200, 272)]
UNIT_AMAX = 2688.0  # S_dec = amax / 2688 = 1


def blackwell_missing() -> str | None:
    """None on a GPU with block-scaled FP4 tensor cores, else why the cuBLASLt tests cannot run."""
    major, minor = torch.cuda.get_device_capability()
    if major < 10:
        return (f"needs block-scaled FP4 tensor cores (sm_100 B200/GB200, sm_103 B300/GB300, sm_120 RTX PRO 6000 / "
                f"RTX 50); this GPU is sm_{major}{minor} ({torch.cuda.get_device_name()})")
    return None


needs_blackwell = pytest.mark.skipif(torch.cuda.is_available() and blackwell_missing() is not None,
                                     reason=blackwell_missing() if torch.cuda.is_available() else "")


def random_matrix(rows, cols, scale, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator) * scale
    octaves = torch.randint(-4, 4, (rows, cols // 16, 1), generator=generator).float()
    return (x * torch.exp2(octaves).repeat_interleave(16, 1).reshape(rows, cols)).to(torch.bfloat16)


def cpu_quantized(x, role, recipe, **options) -> NVFP4Tensor:
    """x quantized by the reference on the CPU (independent of the CUDA kernels), moved to the GPU."""
    return nv.quantize(x, role, recipe=recipe, **options).to("cuda")


def gemm_operands(q: NVFP4Tensor, copy: str):
    return getattr(q, f"{copy}_data"), getattr(q, f"{copy}_scale"), getattr(q, f"amax_{copy}")


# ------------------------------------------------------------------------------------------------------
# Any CUDA GPU: the swizzle kernel and the argument building.

def torch_to_blocked():
    """torch's own to_blocked, taken from the installed torch's source (its module needs test-only packages)."""
    path = pathlib.Path(torch.__file__).parent / "testing" / "_internal" / "common_quantized.py"
    tree = ast.parse(path.read_text())
    wanted = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in ("ceil_div", "to_blocked")]
    assert len(wanted) == 2, f"{path} no longer defines ceil_div and to_blocked"
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), namespace)
    return namespace["to_blocked"]


@pytest.mark.parametrize("shape", [(200, 6), (48, 6), (1023, 4), (3, 13), (130, 17), (1, 1), (128, 4),
                                   (8192, 256), (4096, 704), (16384, 5)], ids=str)
def test_swizzle_kernel_equals_reference_and_to_blocked(shape):
    scale = torch.randint(0, 127, shape, dtype=torch.uint8, device="cuda")  # 0x7F (NaN) left out
    got = kernels.swizzle_scales(scale.view(torch.float8_e4m3fn))
    assert got.dtype == torch.float8_e4m3fn and got.is_cuda
    want = reference.swizzle_scales(scale.cpu().view(torch.float8_e4m3fn))
    assert torch.equal(got.view(torch.uint8).cpu(), want.view(torch.uint8))
    assert torch.equal(got.view(torch.uint8), torch_to_blocked()(scale))


@pytest.mark.parametrize("m,n,k", UNALIGNED, ids=str)
@pytest.mark.parametrize("row_scaled", [False, True], ids=["per_tensor", "row_scaled"])
def test_arguments_from_cuda_operands_equal_the_cpu_ones(m, n, k, row_scaled, monkeypatch):
    """scaled_mm_arguments on CUDA operands (the swizzle kernel, padding on the GPU) gives the same bytes,
    shapes and strides as on the CPU (the reference swizzle); no Python swizzle runs for CUDA tensors."""
    x = nv.quantize(random_matrix(m, k, 1.0, m + k), "activation", recipe=ROW_SCALED if row_scaled else PLAIN,
                    columnwise=False)
    w = nv.quantize(random_matrix(n, k, 0.1, n), "activation", recipe=PLAIN, columnwise=False)
    cpu_operands = gemm_operands(x, "rowwise") + gemm_operands(w, "rowwise")
    want = blackwell.scaled_mm_arguments(*cpu_operands)
    cuda_operands = tuple(t.cuda() for t in cpu_operands)

    def python_swizzle(scale):
        raise AssertionError("the reference (Python) swizzle ran for CUDA scales")
    monkeypatch.setattr(reference, "swizzle_scales", python_swizzle)
    got = blackwell.scaled_mm_arguments(*cuda_operands)
    torch.cuda.synchronize()
    for field in ("a", "b", "scale_a", "scale_b"):
        on_gpu, on_cpu = getattr(got, field), getattr(want, field)
        assert on_gpu.is_cuda and on_gpu.dtype == on_cpu.dtype, field
        assert on_gpu.shape == on_cpu.shape and on_gpu.stride() == on_cpu.stride(), field
        assert torch.equal(on_gpu.view(torch.uint8).cpu(), on_cpu.view(torch.uint8)), field
    assert torch.equal(got.alpha.cpu(), want.alpha) and got.cols == want.cols == n
    if k % 32 == 0:  # no padding along K: A is used in place (M is never padded)
        assert got.a.data_ptr() == cuda_operands[0].data_ptr()
    if k % 32 == 0 and n % 16 == 0:
        assert got.b.data_ptr() == cuda_operands[3].data_ptr()


def test_automatic_backend_on_this_gpu(monkeypatch):
    """cuBLASLt on sm_100 and newer, the emulation on Hopper; an explicit cublaslt on Hopper is refused."""
    monkeypatch.delenv("NVFP4_FORCE_REFERENCE", raising=False)
    device = torch.device("cuda", torch.cuda.current_device())
    capability = torch.cuda.get_device_capability(device)
    expected = "cublaslt" if capability >= (10, 0) else "emulated" if capability >= (9, 0) else "reference"
    assert resolve_backend("auto", device) == expected
    if capability < (10, 0):
        with pytest.raises(ValueError, match=f"backend='cublaslt' needs sm_100 or newer; {device} is sm_"):
            resolve_backend("cublaslt", device)


# ------------------------------------------------------------------------------------------------------
# sm_100 / sm_103 / sm_120: the real cuBLASLt GEMM.

E2M1_CODES = {0.0: 0, 0.5: 1, 1.0: 2, 1.5: 3, 2.0: 4, 3.0: 5, 4.0: 6, 6.0: 7}


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """Exact E2M1 codes of values already on the grid (sign in bit 3)."""
    codes = torch.zeros(values.shape, dtype=torch.uint8)
    for value, code in E2M1_CODES.items():
        codes[values.abs() == value] = code
    magnitudes = torch.tensor(list(E2M1_CODES), dtype=torch.float64)[codes.long()]
    assert torch.equal(torch.where(values < 0, -magnitudes, magnitudes), values), "probe values must be E2M1"
    return codes | ((values < 0).to(torch.uint8) << 3)


def operand_from_values(values: torch.Tensor, scales: torch.Tensor, amax: float = UNIT_AMAX) -> NVFP4Tensor:
    """An NVFP4Tensor (rowwise copy) holding E2M1 `values` [R, K] with E4M3 block `scales` [R, K/16]."""
    codes = e2m1_codes(values)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # element 2j in the low nibble
    e4m3 = scales.to(torch.float8_e4m3fn)
    assert torch.equal(e4m3.double(), scales.double()), "probe scales must be exact in E4M3"
    return NVFP4Tensor(shape=torch.Size(values.shape), dtype=torch.bfloat16, rowwise_data=packed.cuda(),
                       rowwise_scale=e4m3.cuda(), amax_rowwise=torch.tensor([amax], device="cuda"))


def probe(name: str, m: int, n: int, k: int):
    """(A values, A scales, B values, B scales) of a probe, in float64, after PyTorch's NVFP4 numerics tests."""
    a, b = torch.ones(m, k, dtype=torch.float64), torch.ones(n, k, dtype=torch.float64)
    sa, sb = torch.ones(m, k // 16, dtype=torch.float64), torch.ones(n, k // 16, dtype=torch.float64)
    if name == "eye":
        a, b = torch.eye(m, k, dtype=torch.float64), torch.eye(n, k, dtype=torch.float64)
    elif name == "a_ones_modified":
        a[1 % m, :16] = 2
    elif name == "a_scale_modified":      # code 2.0 with block scale 2: value 4
        a[1 % m, :16], sa[1 % m, 0] = 2, 2
    elif name == "b_scale_modified":
        b[1 % n, :16], sb[1 % n, 0] = 2, 2
    elif name == "last_blocks_modified":  # the last row's last block, past the first 128-row and 4-column tiles
        a[m - 1, -16:], sa[m - 1, -1] = 6, 0.5
        b[n - 1, -16:], sb[n - 1, -1] = -3, 4
    return a, sa, b, sb


PROBES = ["eye", "ones", "a_ones_modified", "a_scale_modified", "b_scale_modified", "last_blocks_modified"]


@needs_blackwell
@pytest.mark.parametrize("m,n,k", UNALIGNED, ids=str)
@pytest.mark.parametrize("name", PROBES)
def test_probes_are_exact(name, m, n, k):
    a, sa, b, sb = probe(name, m, n, k)
    expected = (a * sa.repeat_interleave(16, 1)) @ (b * sb.repeat_interleave(16, 1)).t()
    aq, bq = operand_from_values(a, sa), operand_from_values(b, sb)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = nv.gemm(aq, bq, out_dtype=out_dtype, backend="cublaslt")
        assert got.shape == (m, n) and got.dtype == out_dtype
        assert torch.equal(got.cpu().double(), expected.to(out_dtype).double()), \
            f"{(got.cpu().double() != expected.to(out_dtype).double()).sum().item()} values differ"
    assert torch.equal(nv.gemm(aq, bq, out_dtype=torch.float32, backend="reference").cpu().double(), expected)


def exact_sum_operand(rows: int, k: int, seed: int, amax: torch.Tensor) -> NVFP4Tensor:
    """Random E2M1 codes (all 16) and random block scales 0.5, 1 or 2."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, k), generator=generator, dtype=torch.uint8)
    scales = torch.exp2(torch.randint(-1, 2, (rows, k // 16), generator=generator).float())
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return NVFP4Tensor(shape=torch.Size((rows, k)), dtype=torch.bfloat16, rowwise_data=packed.cuda(),
                       rowwise_scale=scales.to(torch.float8_e4m3fn).cuda(), amax_rowwise=amax.cuda(),
                       row_scaled=amax.numel() > 1)


@needs_blackwell
@pytest.mark.parametrize("m,n,k", UNALIGNED, ids=str)
@pytest.mark.parametrize("row_scaled", [False, True], ids=["per_tensor", "row_scaled"])
def test_exact_sums_equal_the_reference_bit_for_bit(m, n, k, row_scaled):
    generator = torch.Generator().manual_seed(m * n + k)
    a_amax = torch.rand(m if row_scaled else 1, generator=generator) * 100 + 0.1
    aq = exact_sum_operand(m, k, seed=m + k, amax=a_amax)
    bq = exact_sum_operand(n, k, seed=n + 2 * k, amax=torch.tensor([7.25]))
    got = nv.gemm(aq, bq, out_dtype=torch.float32, backend="cublaslt")
    want = nv.gemm(aq, bq, out_dtype=torch.float32, backend="reference")
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} values differ"


LAYOUTS = {"fprop": ("x", "rowwise", "w", "rowwise"), "dgrad": ("dy", "rowwise", "w", "columnwise"),
           "wgrad": ("dy", "columnwise", "x", "columnwise")}


@needs_blackwell
@pytest.mark.parametrize("m,n,k", [(208, 48, 96), (64, 48, 80), (48, 32, 64), (1024, 768, 2048)], ids=str)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_operand_pairs_within_fp32_accumulation_of_the_reference(name, m, n, k):
    tensors = {"x": cpu_quantized(random_matrix(m, k, 1.0, 5), "activation", RECIPE),
               "w": cpu_quantized(random_matrix(n, k, 0.1, 6), "weight", RECIPE),
               "dy": cpu_quantized(random_matrix(m, n, 1.0, 7), "gradient", RECIPE, sr_seed=11)}
    a_name, a_copy, b_name, b_copy = LAYOUTS[name]
    check_within_accumulation_bound(tensors[a_name], a_copy, tensors[b_name], b_copy)


@needs_blackwell
@pytest.mark.parametrize("m,n,k", [(200, 48, 96), (65, 112, 96), (3, 24, 208)], ids=str)
def test_row_scaled_fprop_within_fp32_accumulation_of_the_reference(m, n, k):
    xq = cpu_quantized(random_matrix(m, k, 1.0, 8), "activation", ROW_SCALED, columnwise=False)
    wq = cpu_quantized(random_matrix(n, k, 0.1, 9), "activation", PLAIN, columnwise=False)
    check_within_accumulation_bound(xq, "rowwise", wq, "rowwise")


def check_within_accumulation_bound(a: NVFP4Tensor, a_copy: str, b: NVFP4Tensor, b_copy: str) -> None:
    a_ops, b_ops = gemm_operands(a, a_copy), gemm_operands(b, b_copy)
    got = nv.gemm(a, b, a_copy=a_copy, b_copy=b_copy, out_dtype=torch.float32, backend="cublaslt")
    want = reference.gemm_reference(*a_ops, *b_ops)
    k = a_ops[0].shape[1] * 2
    a_abs = block_values(a_ops[0], a_ops[1]).reshape(a_ops[0].shape[0], -1).abs()
    b_abs = block_values(b_ops[0], b_ops[1]).reshape(b_ops[0].shape[0], -1).abs()
    alpha = decode_scale(a_ops[2]).reshape(-1, 1) * decode_scale(b_ops[2]).reshape(1, -1)
    allowed = k * 2.0 ** -23 * (a_abs @ b_abs.t()) * alpha + torch.finfo(torch.float32).tiny
    excess = ((got - want).abs() - allowed).max().item()
    assert excess <= 0, f"cublaslt differs from the reference by up to {excess:.3g} beyond the FP32 bound"


@needs_blackwell
def test_linear_on_the_hot_path_equals_the_general_path():
    """nv.Linear's three GEMMs through hot_path.gemm (scales swizzled in one call, the epilogue kernel) equal, bit for
    bit, the same layer with every GEMM through gemm() (tests_multigpu/test_hot_path_gpu.py checks the same with a
    stand-in for cuBLASLt on any GPU)."""
    from nvfp4_dist import hot_path

    def run():
        torch.manual_seed(0)
        layer = nv.Linear(512, 384, device="cuda", dtype=torch.bfloat16, recipe=RECIPE)
        x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = layer(x)
        y.backward(torch.randn_like(y))
        return y, x.grad, layer.weight.grad, layer.bias.grad

    fast = run()
    original = hot_path._scaled_mm_takes
    hot_path._scaled_mm_takes = lambda *args: False
    try:
        general = run()
    finally:
        hot_path._scaled_mm_takes = original
    for name, f, g in zip(("y", "dx", "dW", "db"), fast, general):
        assert torch.equal(f, g), name

"""The layers' hot path (nvfp4_dist/hot_path.py) against the general path it stands for, on one GPU: the same
codes, scales and amaxes as ops.quantize (each role, copies, given amaxes, SR with a device seed, FP16/FP32 input)
and the same output as nv.gemm (bias, FP32 accumulation, each output dtype), byte for byte, on the Hopper
emulation and on the cuBLASLt FP4 path (with torch._scaled_mm stood in where the GPU has no FP4 tensor cores).

    python -m pytest -q tests_multigpu/test_hot_path_gpu.py
"""
import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist import hot_path, ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FIELDS = ("rowwise_data", "rowwise_scale", "amax_rowwise", "columnwise_data", "columnwise_scale", "amax_columnwise")


def assert_same(fast, general):
    for name in FIELDS:
        a, b = getattr(fast, name), getattr(general, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    for flag in ("block_2d", "rht", "rht_random_sign", "row_scaled", "e4m3_bound"):
        assert getattr(fast, flag) == getattr(general, flag), flag


# (role, (rowwise, columnwise), dtype): an RHT columnwise copy (activations, gradients) takes BF16 input only, so
# layers cast other dtypes first (linear.quantize_operand) and those cases are not the hot path's.
CASES = [(role, copies, dtype) for role in ("activation", "weight", "gradient")
         for copies in ((True, True), (True, False), (False, True))
         for dtype in (torch.bfloat16, torch.float16, torch.float32)
         if not (copies[1] and role != "weight" and dtype != torch.bfloat16)]


@pytest.mark.parametrize("role, copies, dtype", CASES)
def test_quantize_equals_ops_quantize(role, copies, dtype):
    recipe = nv.NVFP4Recipe()
    rowwise, columnwise = copies
    torch.manual_seed(0)
    x = (torch.randn(96, 256, device="cuda") * 3).to(dtype)
    seed = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device="cuda")
    fast = hot_path.quantize(x, role, recipe, rowwise=rowwise, columnwise=columnwise, sr_seed=seed, sr_row_offset=32)
    general = ops.quantize(x, role, rowwise=rowwise, columnwise=columnwise, recipe=recipe, sr_seed=seed,
                           sr_row_offset=32, check_finite=False)
    assert_same(fast, general)


@pytest.mark.parametrize("recipe", [nv.NVFP4Recipe(row_scaled_activation=True), nv.NVFP4Recipe(rht=False),
                                    nv.NVFP4Recipe(weight_2d=False, stochastic_rounding=False)])
def test_quantize_equals_ops_quantize_for_other_recipes(recipe):
    torch.manual_seed(1)
    x = torch.randn(64, 128, device="cuda").to(torch.bfloat16)
    for role in ("activation", "weight", "gradient"):
        fast = hot_path.quantize(x, role, recipe, rowwise=True, columnwise=True, sr_seed=7)
        general = ops.quantize(x, role, recipe=recipe, sr_seed=7, check_finite=False)
        assert_same(fast, general)


def test_quantize_with_given_amaxes_and_unaligned_input():
    recipe = nv.NVFP4Recipe()
    base = torch.randn(64 * 128 + 8, device="cuda").to(torch.bfloat16)
    x = base[8:].view(64, 128)  # 16 bytes past the allocation: the kernels need a copy
    amax = torch.tensor([5.0], device="cuda")
    fast = hot_path.quantize(x, "activation", recipe, rowwise=True, columnwise=True, amax_rowwise=amax,
                             amax_columnwise=amax * 2)
    general = ops.quantize(x, "activation", recipe=recipe, amax_rowwise=amax, amax_columnwise=amax * 2,
                           check_finite=False)
    assert_same(fast, general)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_equals_nv_gemm(out_dtype, with_bias):
    recipe = nv.NVFP4Recipe()
    torch.manual_seed(2)
    a = nv.quantize(torch.randn(128, 256, device="cuda").to(torch.bfloat16), "activation", recipe=recipe)
    b = nv.quantize(torch.randn(96, 256, device="cuda").to(torch.bfloat16), "weight", recipe=recipe)
    bias = torch.randn(96, device="cuda").to(out_dtype) if with_bias else None
    fast = hot_path.gemm(a, b, a_copy="rowwise", b_copy="rowwise", out_dtype=out_dtype, bias=bias, recipe=recipe)
    general = nv.gemm(a, b, a_copy="rowwise", b_copy="rowwise", out_dtype=out_dtype, bias=bias, recipe=recipe)
    assert fast.dtype == general.dtype and torch.equal(fast, general)


def test_gemm_accumulates_like_nv_gemm():
    recipe = nv.NVFP4Recipe()
    torch.manual_seed(3)
    dy = nv.quantize(torch.randn(64, 96, device="cuda").to(torch.bfloat16), "gradient", recipe=recipe, sr_seed=3)
    x = nv.quantize(torch.randn(64, 128, device="cuda").to(torch.bfloat16), "activation", recipe=recipe)
    start = torch.randn(96, 128, device="cuda")
    fast, general = start.clone(), start.clone()
    hot_path.gemm(dy, x, a_copy="columnwise", b_copy="columnwise", out_dtype=torch.float32, accumulate_into=fast,
                  recipe=recipe)
    nv.gemm(dy, x, a_copy="columnwise", b_copy="columnwise", out_dtype=torch.float32, accumulate_into=general,
            recipe=recipe)
    assert torch.equal(fast, general)


# The cuBLASLt FP4 path (Blackwell), run here on any CUDA GPU: the backend resolved to "cublaslt" and torch._scaled_mm
# stood in by tests/test_blackwell_arguments.py's float64 decoder of its documented arguments. Both paths hand the
# stand-in their arguments, so equal outputs mean the same arguments and an epilogue kernel (alpha, bias,
# accumulation, output cast) bit-identical to the general path's torch ops. The real cuBLASLt GEMM is
# tests_multigpu/test_blackwell_gemm.py's, on Blackwell GPUs.

@pytest.fixture
def scaled_mm_backend(monkeypatch):
    """The stand-in for torch._scaled_mm (its .calls), and a counter of the general path's argument building."""
    from nvfp4_dist.gemm import blackwell, dispatch
    from tests.test_blackwell_arguments import DecodedScaledMM
    stand_in = DecodedScaledMM()
    stand_in.general_calls = 0
    build = blackwell.scaled_mm_arguments

    def counted_build(*args, **kwargs):
        stand_in.general_calls += 1
        return build(*args, **kwargs)
    monkeypatch.setattr(torch, "_scaled_mm", stand_in)
    monkeypatch.setattr(blackwell, "scaled_mm_arguments", counted_build)
    monkeypatch.setattr(dispatch, "resolve_backend", lambda backend, device: "cublaslt")
    hot_path._gpu_gemm_path.cache_clear()
    yield stand_in
    hot_path._gpu_gemm_path.cache_clear()


def operands(m, n, k, seed, *, a_recipe=None, b_role="weight", b_recipe=None):
    recipe = nv.NVFP4Recipe()
    torch.manual_seed(seed)
    x = nv.quantize(torch.randn(m, k, device="cuda").to(torch.bfloat16) * 3, "activation", recipe=a_recipe or recipe)
    w = nv.quantize(torch.randn(n, k, device="cuda").to(torch.bfloat16), b_role, recipe=b_recipe or recipe)
    dy = nv.quantize(torch.randn(m, n, device="cuda").to(torch.bfloat16), "gradient", recipe=recipe, sr_seed=5)
    return x, w, dy


LAYOUTS = {"fprop": ("x", "rowwise", "w", "rowwise"), "dgrad": ("dy", "rowwise", "w", "columnwise"),
           "wgrad": ("dy", "columnwise", "x", "columnwise")}


def both_paths(stand_in, a, a_copy, b, b_copy, **options):
    """(hot path result, general path result), each on a fresh copy of accumulate_into and a fresh out (options' out:
    a function that makes it); checks which path ran."""
    def fresh():
        return {name: value() if name == "out" else value.clone() if name == "accumulate_into" else value
                for name, value in options.items()}
    before = (len(stand_in.calls), stand_in.general_calls)
    fast = hot_path.gemm(a, b, a_copy=a_copy, b_copy=b_copy, **fresh())
    assert (len(stand_in.calls), stand_in.general_calls) == (before[0] + 1, before[1]), "the hot path did not run"
    general = nv.gemm(a, b, a_copy=a_copy, b_copy=b_copy, **fresh())
    assert stand_in.general_calls == before[1] + 1
    return fast, general


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32])
def test_scaled_mm_path_equals_the_general_cublaslt_path(layout, out_dtype, bias_dtype, scaled_mm_backend):
    tensors = dict(zip(("x", "w", "dy"), operands(128, 96, 256, 4)))
    a_name, a_copy, b_name, b_copy = LAYOUTS[layout]
    a, b = tensors[a_name], tensors[b_name]
    cols = getattr(b, f"{b_copy}_data").shape[0]
    bias = None if bias_dtype is None else torch.randn(cols, device="cuda").to(bias_dtype)
    fast, general = both_paths(scaled_mm_backend, a, a_copy, b, b_copy, out_dtype=out_dtype, bias=bias)
    assert fast.dtype == general.dtype == out_dtype and torch.equal(fast, general)


@pytest.mark.parametrize("with_bias", [False, True])
def test_scaled_mm_path_accumulates_and_writes_into_out_like_the_general_path(with_bias, scaled_mm_backend):
    x, _, dy = operands(64, 96, 128, 6)
    bias = torch.randn(128, device="cuda").to(torch.bfloat16) if with_bias else None
    start = torch.randn(96, 128, device="cuda")
    fast, general = both_paths(scaled_mm_backend, dy, "columnwise", x, "columnwise", out_dtype=torch.float32,
                               bias=bias, accumulate_into=start)
    assert torch.equal(fast, general) and not torch.equal(fast, start)
    def columns_of_a_wider_output():
        return torch.zeros(96, 3 * 128, device="cuda", dtype=torch.bfloat16)[:, 128:256]
    fast, general = both_paths(scaled_mm_backend, dy, "columnwise", x, "columnwise", out_dtype=torch.bfloat16,
                               bias=bias, out=columns_of_a_wider_output)
    assert fast.stride() == (3 * 128, 1) and torch.equal(fast, general) and fast.abs().sum() > 0


def test_scaled_mm_path_takes_per_row_amaxes(scaled_mm_backend):
    """A row-scaled A (one amax per row) and, in wgrad, the columnwise copy of a row-scaled activation as B (one amax
    per output column, docs/numerics.md §6b)."""
    row_scaled = nv.NVFP4Recipe(row_scaled_activation=True)
    x, w, dy = operands(96, 64, 128, 7, a_recipe=row_scaled)
    assert x.amax_rowwise.numel() == 96 and x.amax_columnwise.numel() == 128
    for a, a_copy, b, b_copy in ((x, "rowwise", w, "rowwise"), (dy, "columnwise", x, "columnwise")):
        fast, general = both_paths(scaled_mm_backend, a, a_copy, b, b_copy, out_dtype=torch.bfloat16)
        assert torch.equal(fast, general)


def test_operands_cublaslt_needs_padded_go_to_the_general_path(scaled_mm_backend):
    x, w, _ = operands(64, 48, 80, 8)  # K % 32 == 16: gemm() pads both operands by a block of zeros
    fast = hot_path.gemm(x, w, a_copy="rowwise", b_copy="rowwise", out_dtype=torch.bfloat16)
    assert scaled_mm_backend.general_calls == 1
    assert torch.equal(fast, nv.gemm(x, w, a_copy="rowwise", b_copy="rowwise", out_dtype=torch.bfloat16))


def test_linear_on_the_scaled_mm_path_equals_the_general_path(scaled_mm_backend, monkeypatch):
    """nv.Linear forward and backward (default recipe: RHT, SR, 2D weights; bias), its three GEMMs on the hot path,
    equal the layer with every GEMM through gemm()."""
    def run():
        torch.manual_seed(0)
        layer = nv.Linear(256, 192, device="cuda", dtype=torch.bfloat16, recipe=nv.NVFP4Recipe())
        x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = layer(x)
        y.backward(torch.randn_like(y))
        return y, x.grad, layer.weight.grad, layer.bias.grad

    fast = run()
    assert (len(scaled_mm_backend.calls), scaled_mm_backend.general_calls) == (3, 0)
    monkeypatch.setattr(hot_path, "_scaled_mm_takes", lambda *args: False)
    general = run()
    assert (len(scaled_mm_backend.calls), scaled_mm_backend.general_calls) == (6, 3)
    for name, f, g in zip(("y", "dx", "dW", "db"), fast, general):
        assert torch.equal(f, g), name


def test_grouped_linear_on_the_scaled_mm_path_equals_the_general_path(scaled_mm_backend, monkeypatch):
    """GroupedLinear's experts on the hot path (one GEMM per expert with tokens and stage; their wgrad operands are
    column slices of the grouped copies, copied as gemm() copies them) equal the layer with every GEMM through
    gemm()."""
    sizes = [64, 0, 32, 96]

    def run():
        torch.manual_seed(0)
        layer = nv.GroupedLinear(len(sizes), 256, 192, recipe=nv.NVFP4Recipe(), device="cuda")
        x = (torch.randn(sum(sizes), 256, device="cuda") * 2).to(torch.bfloat16).requires_grad_()
        y = layer(x, sizes)
        y.backward(torch.randn_like(y))
        return [y, x.grad, *[w.grad for w in layer.weights()], *[b.grad for b in layer.biases()]]

    fast = run()
    assert (len(scaled_mm_backend.calls), scaled_mm_backend.general_calls) == (9, 0)  # 3 experts x 3 GEMM stages
    monkeypatch.setattr(hot_path, "_scaled_mm_takes", lambda *args: False)
    general = run()
    assert scaled_mm_backend.general_calls == 9
    for index, (f, g) in enumerate(zip(fast, general)):
        assert torch.equal(f, g), index

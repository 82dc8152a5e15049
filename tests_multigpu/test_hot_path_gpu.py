"""The layers' hot path (nvfp4_dist/hot_path.py) against the general path it stands for, on one GPU: the same
codes, scales and amaxes as ops.quantize (each role, copies, given amaxes, SR with a device seed, FP16/FP32 input)
and the same output as nv.gemm (bias, FP32 accumulation, each output dtype), byte for byte.

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

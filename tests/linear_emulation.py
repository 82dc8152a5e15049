"""The NVFP4 linear math emulated with nvfp4_dist.reference functions only (the SPEC, not the layer code).

Used by the layer tests as the independent expectation: same recipe flags, same stochastic-rounding seed.
"""
import torch

from nvfp4_dist import reference as R
from nvfp4_dist.reference.fourover6 import FourOverSix


def draw_seed_like_backward() -> int:
    """The SR seed a layer's backward draws: one 62-bit integer from torch's default generator."""
    return int(torch.randint(0, 2 ** 62, (1,)).item())


def four_over_six(recipe, is_weight: bool):
    """The 4over6 settings of weights or activations (never gradients), as docs/numerics.md §12 assigns them."""
    kind = "weights" if is_weight else "activations"
    if recipe.nvfp4_4over6 not in ("all", kind):
        return None
    bound = 256 if recipe.nvfp4_4over6_e4m3_use_256 in ("all", kind) else 448
    return FourOverSix(recipe.nvfp4_4over6_err_mode, bound, recipe.nvfp4_4over6_err_use_fast_math)


def quantize_activation(x2d, recipe, *, rowwise=True, columnwise=True, amax_rowwise=None, amax_columnwise=None):
    """Rowwise copy from x; columnwise copy (RHT per recipe) from x, or from its BF16 cast when the RHT needs it.
    Row-scaled: one amax per row of x, and per column of x for the columnwise copy."""
    row = col = None
    if rowwise:
        row = R.quantize_tensor(x2d, rowwise=True, columnwise=False, row_scaled=recipe.row_scaled_activation,
                                amax_rowwise=amax_rowwise, four_over_six=four_over_six(recipe, False))
    if columnwise:
        source = x2d.to(torch.bfloat16) if recipe.rht else x2d
        col = R.quantize_tensor(source, rowwise=False, columnwise=True, rht=recipe.rht,
                                rht_random_sign=recipe.rht_random_sign, row_scaled=recipe.row_scaled_activation,
                                amax_columnwise=amax_columnwise, four_over_six=four_over_six(recipe, False))
    return row, col


def quantize_gradient(dy2d, recipe, sr_seed, *, sr_row_offset=0, amax_rowwise=None, amax_columnwise=None):
    seed = sr_seed if recipe.stochastic_rounding else None
    row = R.quantize_tensor(dy2d, rowwise=True, columnwise=False, sr_seed=seed, sr_row_offset=sr_row_offset,
                            amax_rowwise=amax_rowwise)
    source = dy2d.to(torch.bfloat16) if recipe.rht else dy2d
    col = R.quantize_tensor(source, rowwise=False, columnwise=True, rht=recipe.rht,
                            rht_random_sign=recipe.rht_random_sign, sr_seed=seed, sr_row_offset=sr_row_offset,
                            amax_columnwise=amax_columnwise)
    return row, col


def quantize_weight(weight, recipe):
    return R.quantize_tensor(weight.detach(), rowwise=True, columnwise=True, block_2d=recipe.weight_2d,
                             four_over_six=four_over_six(recipe, True))


def gemm_rows(a, b):
    """A . B^T in FP32 from rowwise copies."""
    return R.gemm_reference(a.rowwise_data, a.rowwise_scale, a.amax_rowwise, b.rowwise_data, b.rowwise_scale,
                            b.amax_rowwise, a_e4m3_bound=a.e4m3_bound, b_e4m3_bound=b.e4m3_bound)


def gemm_row_col(a, b):
    """A rowwise . (B's columnwise copy)^T: the dgrad GEMM."""
    return R.gemm_reference(a.rowwise_data, a.rowwise_scale, a.amax_rowwise, b.columnwise_data,
                            b.columnwise_scale, b.amax_columnwise, a_e4m3_bound=a.e4m3_bound,
                            b_e4m3_bound=b.e4m3_bound)


def gemm_cols(a, b):
    """A columnwise . (B columnwise)^T: the wgrad GEMM."""
    return R.gemm_reference(a.columnwise_data, a.columnwise_scale, a.amax_columnwise, b.columnwise_data,
                            b.columnwise_scale, b.amax_columnwise, a_e4m3_bound=a.e4m3_bound,
                            b_e4m3_bound=b.e4m3_bound)


def fprop(xq_row, wq, bias, out_dtype):
    y = gemm_rows(xq_row, wq)
    if bias is not None:
        y = y + bias.detach().to(torch.float32)
    return y.to(out_dtype)


def emulate_linear(x, weight, bias, dy, recipe, sr_seed):
    """(y, dx, dW, db) of the single-device NVFP4 linear layer."""
    x2d = x.detach().reshape(-1, x.shape[-1])
    dy2d = dy.reshape(-1, dy.shape[-1])
    wq = quantize_weight(weight, recipe)
    xq_row, xq_col = quantize_activation(x2d, recipe)
    y = fprop(xq_row, wq, bias, x.dtype)
    dyq_row, dyq_col = quantize_gradient(dy2d, recipe, sr_seed)
    dx = gemm_row_col(dyq_row, wq).to(x.dtype)
    dw = gemm_cols(dyq_col, xq_col).to(weight.dtype)
    db = None if bias is None else dy2d.sum(dim=0).to(bias.dtype)
    return y.reshape(*x.shape[:-1], -1), dx.reshape(x.shape), dw, db

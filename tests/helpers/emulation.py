"""The NVFP4 linear math emulated from the oracle's bytes (tests/helpers/oracle.py), not from the package's quantizer.

Every operand is quantized by the oracle (written from docs/numerics.md, sharing no code with nvfp4_dist) and
wrapped as an nvfp4_dist.NVFP4Tensor; the GEMMs are the package's reference GEMM, which tests/test_gemm.py holds
to the oracle's float64 product. A layer that equals this emulation exactly therefore quantized every operand to
the oracle's bytes. Same recipe flags and the same stochastic-rounding seed as the layer.
"""
import numpy as np
import torch

import nvfp4_dist as nv
from nvfp4_dist import reference as R
from tests.helpers import oracle as O


def draw_seed_like_backward(device="cpu") -> int:
    """The SR seed a layer's backward draws for gradients on `device` (nvfp4_dist.ops.draw_sr_seed): one 62-bit
    integer from that device's default generator (on CUDA, drawn on the GPU), as a Python int."""
    return int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=device).item())


def four_over_six(recipe, is_weight: bool) -> O.FourOverSix | None:
    """The 4over6 settings of weights or activations (never gradients), as docs/numerics.md §12 assigns them."""
    kind = "weights" if is_weight else "activations"
    if recipe.nvfp4_4over6 not in ("all", kind):
        return None
    bound = 256 if recipe.nvfp4_4over6_e4m3_use_256 in ("all", kind) else 448
    return O.FourOverSix(recipe.nvfp4_4over6_err_mode, bound, recipe.nvfp4_4over6_err_use_fast_math)


def _amax(amax):
    return None if amax is None else amax.detach().cpu().numpy().astype(np.float32)


def as_tensor(x: torch.Tensor, quantized: O.Quantized, **flags) -> nv.NVFP4Tensor:
    """The oracle's copies of x (2D view) as an NVFP4Tensor on x's device."""
    fields = {}
    for copy in ("rowwise", "columnwise"):
        bytes_ = getattr(quantized, copy)
        if bytes_ is not None:
            data, scale, amax = (t.to(x.device) for t in bytes_.torch())
            fields.update({f"{copy}_data": data, f"{copy}_scale": scale, f"amax_{copy}": amax,
                           "e4m3_bound": bytes_.bound})
    return nv.NVFP4Tensor(shape=x.shape, dtype=x.dtype, **fields, **flags)


def quantize_activation(x2d, recipe, *, rowwise=True, columnwise=True, amax_rowwise=None, amax_columnwise=None):
    """(rowwise copy from x, columnwise copy with the recipe's RHT from x, or from its BF16 cast when the RHT needs
    it), each an NVFP4Tensor or None. Row-scaled: one amax per row of x, and per column of x for the columnwise
    copy (docs/numerics.md §6b)."""
    row_scaled, options = recipe.row_scaled_activation, four_over_six(recipe, False)
    row = col = None
    if rowwise:
        q = O.quantize(x2d, columnwise=False, row_scaled=row_scaled, amax_rowwise=_amax(amax_rowwise),
                       four_over_six=options)
        row = as_tensor(x2d, q, row_scaled=row_scaled)
    if columnwise:
        source = x2d.to(torch.bfloat16) if recipe.rht else x2d
        q = O.quantize(source, rowwise=False, rht=recipe.rht, random_sign=recipe.rht_random_sign, row_scaled=row_scaled,
                       amax_columnwise=_amax(amax_columnwise), four_over_six=options)
        col = as_tensor(source, q, rht=recipe.rht, rht_random_sign=recipe.rht_random_sign, row_scaled=row_scaled)
    return row, col


def quantize_gradient(dy2d, recipe, sr_seed, *, sr_row_offset=0, amax_rowwise=None, amax_columnwise=None):
    """(rowwise, columnwise) copies of an output gradient: SR with sr_seed when the recipe says, the RHT on the
    columnwise copy; sr_row_offset is this shard's first row in the global gradient."""
    seed = sr_seed if recipe.stochastic_rounding else None
    row = O.quantize(dy2d, columnwise=False, sr_seed=seed, first_row=sr_row_offset, amax_rowwise=_amax(amax_rowwise))
    source = dy2d.to(torch.bfloat16) if recipe.rht else dy2d
    col = O.quantize(source, rowwise=False, rht=recipe.rht, random_sign=recipe.rht_random_sign, sr_seed=seed,
                     first_row=sr_row_offset, amax_columnwise=_amax(amax_columnwise))
    return (as_tensor(dy2d, row),
            as_tensor(source, col, rht=recipe.rht, rht_random_sign=recipe.rht_random_sign))


def quantize_weight(weight, recipe):
    """Both copies of a weight (16x16 blocks when recipe.weight_2d, 4over6 when the recipe says; no RHT)."""
    q = O.quantize(weight, block_2d=recipe.weight_2d, four_over_six=four_over_six(recipe, True))
    return as_tensor(weight.detach(), q, block_2d=recipe.weight_2d)


def _gemm(a, a_copy, b, b_copy):
    def pick(q, copy):
        return getattr(q, f"{copy}_data"), getattr(q, f"{copy}_scale"), getattr(q, f"amax_{copy}")
    return R.gemm_reference(*pick(a, a_copy), *pick(b, b_copy), a_e4m3_bound=a.e4m3_bound, b_e4m3_bound=b.e4m3_bound)


def gemm_rows(a, b):
    """A . B^T in FP32 from rowwise copies: the fprop GEMM."""
    return _gemm(a, "rowwise", b, "rowwise")


def gemm_row_col(a, b):
    """A rowwise . (B's columnwise copy)^T: the dgrad GEMM."""
    return _gemm(a, "rowwise", b, "columnwise")


def gemm_cols(a, b):
    """A columnwise . (B columnwise)^T: the wgrad GEMM."""
    return _gemm(a, "columnwise", b, "columnwise")


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


def linear_magnitudes(x, weight, dy, recipe, sr_seed) -> dict:
    """For y, dx and dW of emulate_linear: the elementwise sum of |terms| of the GEMM behind each, float64 from the
    oracle's bytes; it bounds what another backend's accumulation order may change
    (oracle.backend_difference_bound)."""
    x2d, dy2d = x.detach().reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    wq = quantize_weight(weight, recipe)
    xq_row, xq_col = quantize_activation(x2d, recipe)
    dyq_row, dyq_col = quantize_gradient(dy2d, recipe, sr_seed)
    return {"y": O.product(O.copy_of(xq_row, "rowwise"), O.copy_of(wq, "rowwise")).magnitude,
            "dx": O.product(O.copy_of(dyq_row, "rowwise"), O.copy_of(wq, "columnwise")).magnitude,
            "dW": O.product(O.copy_of(dyq_col, "columnwise"), O.copy_of(xq_col, "columnwise")).magnitude}

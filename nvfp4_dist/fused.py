"""Norms and activations as the NVFP4 layers' producers, alone or fused with the cast of their output.

norm() and activation() are the project's LayerNorm/RMSNorm and GELU/SwiGLU (autograd functions; the
forward defined in nvfp4_dist/reference/fused_producers.py, run by the CUDA kernels on CUDA tensors).
quantize_norm_output() and quantize_activation_output() give the NVFP4 copies of their BF16 output
without writing it: pass 1 (statistics and amaxes), the amaxes reduced by the caller's `reduce_amaxes`
(the tensor-parallel all-reduce under sequence parallelism, docs/numerics.md §9), pass 2 (the cast).
The copies equal, byte for byte, ops.quantize of norm()'s or activation()'s BF16 output.

Set NVFP4_FORCE_REFERENCE=1 to run the reference on every device.
"""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from nvfp4_dist import finite_check, ops
from nvfp4_dist.formats import BLOCK_SIZE
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.reference import fused_producers as reference
from nvfp4_dist.reference.fused_producers import ACTIVATIONS, NORMALIZATIONS
from nvfp4_dist.tensor import NVFP4Tensor

logger = logging.getLogger("nvfp4_dist")

FUSED_OUTPUT_DTYPE = torch.bfloat16  # the fused casts quantize a BF16 output (the RHT takes BF16, docs/numerics.md §5)


# ----------------------------------------------------------------------------------------------------------
# Checks and backend choice

def check_norm_arguments(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, normalization: str,
                         eps: float, *, quantized: bool = False) -> None:
    """ValueError naming the argument when the norm (quantized: and the cast of its output) cannot run as asked."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r}: allowed values are {NORMALIZATIONS}")
    if not isinstance(x, torch.Tensor) or x.dtype not in ops.INPUT_DTYPES:
        raise ValueError(f"x must be a torch.Tensor of {ops.INPUT_DTYPES}, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x.shape={tuple(x.shape)}: the last dim (normalized) must be positive")
    if quantized and x.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"x.shape={tuple(x.shape)}: the last dim must be a multiple of {BLOCK_SIZE} to quantize "
                         f"the norm's output (1x16 blocks)")
    hidden = x.shape[-1]
    for name, param in (("weight", weight), ("bias", bias)):
        if param is None:
            continue
        if not isinstance(param, torch.Tensor) or param.shape != (hidden,) or not param.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor of shape ({hidden},), got "
                             f"{getattr(param, 'shape', type(param).__name__)}")
        if param.device != x.device:
            raise ValueError(f"{name}.device={param.device} differs from x.device={x.device}")
    if normalization == "LayerNorm" and bias is None:
        raise ValueError("bias=None with normalization='LayerNorm': LayerNorm takes a bias")
    if normalization == "RMSNorm" and bias is not None:
        raise ValueError("bias given with normalization='RMSNorm': RMSNorm has no bias")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps={eps!r}: must be a finite number > 0")


def check_activation_arguments(h: torch.Tensor, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: allowed values are {ACTIVATIONS}")
    if not isinstance(h, torch.Tensor) or h.dtype not in ops.INPUT_DTYPES:
        raise ValueError(f"h must be a torch.Tensor of {ops.INPUT_DTYPES}, got {getattr(h, 'dtype', type(h).__name__)}")
    width = BLOCK_SIZE * (2 if activation == "swiglu" else 1)
    if h.dim() == 0 or h.shape[-1] == 0 or h.shape[-1] % width:
        raise ValueError(f"h.shape={tuple(h.shape)}: the last dim must be a positive multiple of {width} for "
                         f"activation={activation!r} (its output's last dim a multiple of {BLOCK_SIZE})")


def _norm_backend(x: torch.Tensor):
    """The CUDA kernels for CUDA tensors whose width they take, else the reference."""
    if ops.use_kernels(x):
        from nvfp4_dist import fused_kernels
        if fused_kernels.takes_norm_width(x.shape[-1], x.dtype):
            return fused_kernels
        logger.debug("norm of width %d (%s): no kernel, the reference runs on the GPU", x.shape[-1], x.dtype)
    return reference


def _activation_backend(h: torch.Tensor):
    if ops.use_kernels(h):
        from nvfp4_dist import fused_kernels
        return fused_kernels
    return reference


def _float_parameter(param: torch.Tensor | None) -> torch.Tensor | None:
    return None if param is None else param.detach().to(torch.float32).contiguous()


# ----------------------------------------------------------------------------------------------------------
# Norm and activation as autograd functions

def norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  mean: torch.Tensor | None, rstd: torch.Tensor, normalization: str, needs_input_grad) -> tuple:
    """(dx, dweight, dbias) from the forward's statistics: torch's own norm backward kernels on CUDA (those of
    F.layer_norm / F.rms_norm); on the CPU, whose kernels want the statistics in a 16-bit input's dtype,
    LayerNorm's in FP32 and RMSNorm's (no CPU kernel) by its formula in FP32."""
    compute = x.dtype if x.is_cuda else torch.float32
    lead = (*x.shape[:-1], 1)
    x_, dy_, w_ = x.to(compute), dy.to(compute), weight.to(compute)
    want = [bool(needs_input_grad[0]), bool(needs_input_grad[1])]
    db = None
    if normalization == "LayerNorm":
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            dy_, x_, [x.shape[-1]], mean.reshape(lead), rstd.reshape(lead), w_, bias.to(compute),
            want + [bool(needs_input_grad[2])])
    elif x.is_cuda:
        dx, dw = torch.ops.aten._fused_rms_norm_backward(dy_, x_, [x.shape[-1]], rstd.reshape(lead), w_, want)
    else:
        dx, dw = _rms_norm_backward_formula(dy_, x_, w_, rstd.reshape(lead), want)
    return (None if dx is None else dx.to(x.dtype), None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype))


def _rms_norm_backward_formula(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, want):
    """RMSNorm's (dx, dweight) in x's dtype: x_hat = x * rstd, g = dy * w,
    dx = rstd * (g - x_hat * mean(g * x_hat)), dweight = sum over rows of dy * x_hat."""
    x_hat = x * rstd
    dx = dw = None
    if want[0]:
        g = dy * weight
        dx = rstd * (g - x_hat * (g * x_hat).mean(dim=-1, keepdim=True))
    if want[1]:
        dw = (dy * x_hat).reshape(-1, x.shape[-1]).sum(dim=0)
    return dx, dw


class _NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, normalization, eps, out_dtype):
        y, mean, rstd = _norm_backend(x).norm_forward(x.contiguous(), _float_parameter(weight), _float_parameter(bias),
                                                      normalization=normalization, eps=eps, out_dtype=out_dtype)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.normalization = normalization
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        grads = norm_backward(dy, x, weight, bias, mean, rstd, ctx.normalization, ctx.needs_input_grad)
        return (*grads, None, None, None)


def norm_output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a norm hands to the layer after it: x's, or the autocast dtype under torch.autocast (where the
    matmuls that follow produce it)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, normalization: str = "LayerNorm",
         eps: float = 1e-5, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """LayerNorm (weight and bias) or RMSNorm (weight) over the last dim, in FP32 in the fixed order of
    reference/fused_producers.py, rounded once to out_dtype (default x.dtype). weight and bias are used as
    given (a module passes them in the dtype its norm computes with)."""
    check_norm_arguments(x, weight, bias, normalization, eps)
    out_dtype = out_dtype or x.dtype
    if out_dtype not in ops.INPUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype}: allowed are {ops.INPUT_DTYPES}")
    return _NormFunction.apply(x, weight, bias, normalization, float(eps), out_dtype)


def activation_backward(da: torch.Tensor, h: torch.Tensor, activation: str) -> torch.Tensor:
    """dL/dh from dL/da of a = activation(h), in FP32, returned in h's dtype."""
    h32, da32 = h.to(torch.float32), da.to(torch.float32)
    if activation == "gelu":
        cdf = 0.5 * torch.special.erfc(h32 * -math.sqrt(0.5))
        pdf = torch.exp(-0.5 * h32 * h32) * (1.0 / math.sqrt(2.0 * math.pi))
        return (da32 * (cdf + h32 * pdf)).to(h.dtype)
    gate, up = h32.chunk(2, dim=-1)
    sigmoid = torch.sigmoid(gate)
    silu = gate * sigmoid
    dsilu = sigmoid * (1.0 + gate * (1.0 - sigmoid))
    return torch.cat([da32 * up * dsilu, da32 * silu], dim=-1).to(h.dtype)


class _ActivationFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, activation):
        a = _activation_backend(h).activation_forward(h.contiguous(), activation=activation, out_dtype=h.dtype)
        ctx.save_for_backward(h)
        ctx.activation = activation
        return a

    @staticmethod
    def backward(ctx, da):
        (h,) = ctx.saved_tensors
        return activation_backward(da, h, ctx.activation), None


def activation(h: torch.Tensor, *, activation: str = "gelu") -> torch.Tensor:
    """GELU (erf) of h [..., N], or SwiGLU of h = [gate | up] [..., 2F] -> [..., F], in FP32 in the fixed order
    of reference/fused_producers.py, rounded once to h's dtype."""
    check_activation_arguments(h, activation)
    return _ActivationFunction.apply(h, activation)


# ----------------------------------------------------------------------------------------------------------
# Fused casts: pass 1, the caller's amax reduction, pass 2

def fusion_applies(recipe: NVFP4Recipe, output_dtype: torch.dtype) -> bool:
    """Whether a layer fuses its producer into the cast: the recipe allows it, its activation copies are ones the
    fused casts make (per-tensor scales, no 4over6: row-scaled and 4over6 activations take the unfused chain), its
    backward needs no more of the producer's output than those copies (the high_precision backward mode keeps the
    output itself, so it takes the unfused chain), and the producer's output, the tensor the unfused chain would
    quantize, is BF16."""
    return (recipe.fused_producers and not recipe.row_scaled_activation and recipe.backward_mode != "high_precision"
            and ops.four_over_six_options("activation", recipe) is None and output_dtype == FUSED_OUTPUT_DTYPE)


def _cast_options(recipe: NVFP4Recipe, rows: int, columnwise: bool) -> dict:
    options = ops.quantize_options("activation", recipe)
    if options["row_scaled"] and columnwise:
        raise ValueError("columnwise=True with row-scaled activations: the fused casts make a row-scaled rowwise "
                         "copy only; quantize the producer's output with nvfp4_dist.quantize for both copies")
    if columnwise and rows % BLOCK_SIZE:
        raise ValueError(f"{rows} rows: a columnwise copy needs the leading dims' product to be a multiple of "
                         f"{BLOCK_SIZE}")
    return dict(rht=options["rht"], rht_random_sign=options["rht_random_sign"], row_scaled=options["row_scaled"])


def _finish_amaxes(amax_rowwise, amax_columnwise, row_scaled: bool, recipe: NVFP4Recipe,
                   reduce_amaxes: Callable[[list], object] | None):
    if reduce_amaxes is not None and not row_scaled:  # per-row amaxes travel with their rows
        reduce_amaxes([amax_rowwise, amax_columnwise])
    if recipe.check_finite:
        finite_check.check_amaxes({"amax_rowwise": amax_rowwise, "amax_columnwise": amax_columnwise})


def quantize_norm_output(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, normalization: str,
                         eps: float, recipe: NVFP4Recipe, columnwise: bool,
                         reduce_amaxes: Callable[[list], object] | None = None):
    """(NVFP4 copies of norm(x)'s BF16 output, mean or None, rstd), the output never written.

    The rowwise copy always, the columnwise (wgrad) copy when asked, with the recipe's treatment of
    activations (RHT, row scaling). reduce_amaxes(list) all-reduces the amaxes between the passes.
    """
    check_norm_arguments(x, weight, bias, normalization, eps, quantized=True)
    rows = x.numel() // x.shape[-1]
    options = _cast_options(recipe, rows, columnwise)
    backend = _norm_backend(x)
    x, weight, bias = x.contiguous(), _float_parameter(weight), _float_parameter(bias)
    mean, rstd, amax_rowwise, amax_columnwise = backend.norm_amaxes(
        x, weight, bias, normalization=normalization, eps=float(eps), columnwise=columnwise, **options)
    _finish_amaxes(amax_rowwise, amax_columnwise, options["row_scaled"], recipe, reduce_amaxes)
    xq = backend.norm_quantize(x, weight, bias, mean, rstd, amax_rowwise=amax_rowwise,
                               amax_columnwise=amax_columnwise, rowwise=True, columnwise=columnwise, **options)
    return xq, mean, rstd


def quantize_activation_output(h: torch.Tensor, *, activation: str, recipe: NVFP4Recipe, columnwise: bool,
                               reduce_amaxes: Callable[[list], object] | None = None) -> NVFP4Tensor:
    """NVFP4 copies of activation(h)'s BF16 output (see quantize_norm_output), the output never written."""
    check_activation_arguments(h, activation)
    rows = h.numel() // h.shape[-1]
    options = _cast_options(recipe, rows, columnwise)
    backend = _activation_backend(h)
    h = h.contiguous()
    amax_rowwise, amax_columnwise = backend.activation_amaxes(h, activation=activation, columnwise=columnwise,
                                                              **options)
    _finish_amaxes(amax_rowwise, amax_columnwise, options["row_scaled"], recipe, reduce_amaxes)
    return backend.activation_quantize(h, activation=activation, amax_rowwise=amax_rowwise,
                                       amax_columnwise=amax_columnwise, rowwise=True, columnwise=columnwise, **options)

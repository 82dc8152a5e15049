"""Reference of the fused producers: a norm or an activation whose output goes straight into the NVFP4 cast.

The norm and the activation are defined here with every FP32 operation in a fixed order (elementwise
torch ops only: they round alike on every device), so that a kernel can reproduce them bit for bit:
- the row sum of a norm is a halving tree (pairs (i, i + n/2), then (i, i + n/4), ...) over each
  16-element block (the last one padded with zeros), then a halving tree over the blocks' sums, their
  count padded with zeros to a power of two (adding +0 changes no sum but the sign of a zero, so any power
  of two >= the count gives the same statistics);
- LayerNorm: mean = (sum(x) + 0) / K (the + 0 makes a zero sum +0, however much padding the tree had);
  var = sum((x - mean)^2) / K; rstd = 1 / sqrt(var + eps); y = ((x - mean) * rstd) * w + b.
  RMSNorm: rstd = 1 / sqrt(sum(x * x) / K + eps); y = (x * rstd) * w. sqrt is correctly rounded
  (correctly_rounded_sqrt: torch's own sqrt is not, on some CPUs);
- exp by Cody-Waite reduction and a degree-7 polynomial; SiLU(x) = x / (1 + exp(-x)); SwiGLU(g, u) =
  SiLU(g) * u; GELU(x) = (0.5 * x) * erfc(-x / sqrt(2)) with Numerical Recipes' erfc (fractional error
  below 1.2e-7).
Each value is formed in FP32 and rounded once to the output dtype. The fused op of a producer is, by
definition, that output quantized by reference.quantize_tensor (docs/numerics.md §2-6): the chain a kernel
that never writes the output must equal.

Pass 1 (`*_amaxes`) gives what the cast needs first (norm statistics, amaxes); pass 2 (`*_quantize`) the
copies. Between them, under sequence parallelism, the amaxes are all-reduced (docs/numerics.md §9).
"""
from __future__ import annotations

import torch

from nvfp4_dist.formats import BLOCK_SIZE
from nvfp4_dist.tensor import NVFP4Tensor
from nvfp4_dist.reference.copies import compute_amaxes, quantize_tensor

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = ("gelu", "swiglu")


def _f32(value: float, device) -> torch.Tensor:
    """A float32 constant, exactly `value` (given as a float32 number, e.g. float.fromhex)."""
    return torch.tensor(value, dtype=torch.float32, device=device)


# exp: n = rint(x * log2(e)); r = (x - n * LN2_HI) - n * LN2_LO; exp(x) = p(r) * 2^n. LN2_HI has 14
# significant bits, so n * LN2_HI is exact for |n| <= 2^10.
_LOG2E = float.fromhex("0x1.715476p+0")
_LN2_HI = float.fromhex("0x1.62e400p-1")
_LN2_LO = float.fromhex("0x1.7f7d1cp-20")
_EXP_POLY = (1.0, 1.0, 0.5, float.fromhex("0x1.555556p-3"), float.fromhex("0x1.555556p-5"),
             float.fromhex("0x1.111112p-7"), float.fromhex("0x1.6c16c2p-10"), float.fromhex("0x1.a01a02p-13"))
_EXP_MAX = float.fromhex("0x1.62e42ep+6")   # exp of anything above overflows: +inf
_EXP_MIN = float.fromhex("-0x1.9fe368p+6")  # exp of anything below is below half the smallest subnormal: 0
# erfc(z) = t * exp(-z^2 + c0 + t*(c1 + t*(c2 + ... + t*c9))), t = 1 / (1 + z/2), z >= 0 (Numerical Recipes'
# erfcc; its coefficients -1.26551223, 1.00002368, ..., 0.17087277 rounded to FP32).
_ERFC_POLY = tuple(float.fromhex(c) for c in (
    "-0x1.43f89cp+0", "0x1.00018ep+0", "0x1.7f11f6p-2", "0x1.8c6d92p-4", "-0x1.7d8498p-3", "0x1.1d8f98p-2",
    "-0x1.229cbap+0", "0x1.7d0f60p+0", "-0x1.a4f124p-1", "0x1.5df28ap-3"))
_FRAC_1_SQRT_2 = float.fromhex("0x1.6a09e6p-1")


def halving_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two long) by halving: t[:n/2] + t[n/2:], repeated."""
    n = t.shape[-1]
    if n & (n - 1):
        raise ValueError(f"halving_sum: the last dim ({n}) must be a power of two")
    while n > 1:
        n //= 2
        t = t[..., :n] + t[..., n:]
    return t[..., 0]


def fixed_order_row_sum(v2d: torch.Tensor) -> torch.Tensor:
    """Sum of each row of an FP32 [M, K]: halving trees over each 16-block (the last one padded with zeros),
    then over the blocks."""
    rows, cols = v2d.shape
    padded_cols = -(-cols // BLOCK_SIZE) * BLOCK_SIZE
    v2d = torch.nn.functional.pad(v2d, (0, padded_cols - cols))
    blocks = halving_sum(v2d.reshape(rows, padded_cols // BLOCK_SIZE, BLOCK_SIZE))
    count = blocks.shape[1]
    padded = 1 << max(count - 1, 0).bit_length()
    return halving_sum(torch.nn.functional.pad(blocks, (0, padded - count)))


def correctly_rounded_sqrt(t: torch.Tensor) -> torch.Tensor:
    """The IEEE (correctly rounded) square root of FP32 t, on any device.

    torch.sqrt is only faithful on some CPUs (its vectorized FP32 and FP64 paths can miss the nearest value by
    one ulp), while the kernels' sqrtf is correctly rounded. So torch's result is corrected:
    y is the nearest FP32 to sqrt(t) iff t lies between the squares of the midpoints to y's neighbours, and those
    midpoints (25 significant bits) and their squares (50) are exact in FP64. Two steps of one ulp each."""
    y = torch.sqrt(t)
    t64 = t.to(torch.float64)
    up_limit, down_limit = _f32(float("inf"), t.device), _f32(0.0, t.device)
    for _ in range(2):
        up, down = torch.nextafter(y, up_limit), torch.nextafter(y, down_limit)
        y64 = y.to(torch.float64)
        above = torch.div(y64 + up.to(torch.float64), 2.0)
        below = torch.div(y64 + down.to(torch.float64), 2.0)
        y = torch.where(t64 > above * above, up, torch.where(t64 < below * below, down, y))
    return y


def norm_row_sums(x: torch.Tensor, *, normalization: str):
    """(mean or None for RMSNorm, sum of squares), FP32 [M], of the rows of x [..., K]: the statistics before rstd,
    the sum of squares of x - mean (LayerNorm) or of x (RMSNorm)."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r}: allowed values are {NORMALIZATIONS}")
    v = x.reshape(-1, x.shape[-1]).to(torch.float32)
    if normalization == "LayerNorm":
        mean = torch.div(fixed_order_row_sum(v) + _f32(0.0, v.device), _f32(float(v.shape[1]), v.device))
        v = v - mean[:, None]
    else:
        mean = None
    return mean, fixed_order_row_sum(v * v)


def rstd_of(sum_of_squares: torch.Tensor, cols: int, eps: float) -> torch.Tensor:
    """rstd = 1 / sqrt(sum_of_squares / cols + eps), FP32."""
    device = sum_of_squares.device
    spread = torch.div(sum_of_squares, _f32(float(cols), device))
    return torch.div(_f32(1.0, device), correctly_rounded_sqrt(spread + _f32(eps, device)))


def norm_statistics(x2d: torch.Tensor, normalization: str, eps: float):
    """(mean or None for RMSNorm, rstd), FP32 [M], of the rows of x2d."""
    mean, sum_of_squares = norm_row_sums(x2d, normalization=normalization)
    return mean, rstd_of(sum_of_squares, x2d.shape[1], eps)


def normalized(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mean: torch.Tensor | None,
               rstd: torch.Tensor) -> torch.Tensor:
    """The norm's output in FP32 before its rounding: ((x - mean) * rstd) * w + b, or (x * rstd) * w."""
    x = x2d.to(torch.float32)
    w = weight.to(torch.float32)
    if mean is None:
        return (x * rstd[:, None]) * w
    return ((x - mean[:, None]) * rstd[:, None]) * w + bias.to(torch.float32)


def norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, normalization: str,
                 eps: float, out_dtype: torch.dtype):
    """(y in out_dtype with x's shape, mean or None, rstd) of LayerNorm/RMSNorm over the last dim."""
    x2d = x.reshape(-1, x.shape[-1])
    mean, rstd = norm_statistics(x2d, normalization, eps)
    return normalized(x2d, weight, bias, mean, rstd).to(out_dtype).reshape(x.shape), mean, rstd


def norm_amaxes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, normalization: str,
                eps: float, columnwise: bool = True, rht: bool = False, rht_random_sign: bool = True,
                row_scaled: bool = False):
    """Pass 1 of the fused norm + cast: (mean or None, rstd, amax_rowwise, amax_columnwise or None) of the
    norm's BF16 output, the amaxes as compute_amaxes gives them (per row when row_scaled; after the RHT)."""
    y, mean, rstd = norm_forward(x, weight, bias, normalization=normalization, eps=eps, out_dtype=torch.bfloat16)
    amax_rowwise, amax_columnwise = compute_amaxes(y.reshape(-1, y.shape[-1]), rowwise=True, columnwise=columnwise,
                                                   rht=rht, rht_random_sign=rht_random_sign, row_scaled=row_scaled)
    return mean, rstd, amax_rowwise, amax_columnwise


def norm_quantize(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mean: torch.Tensor | None,
                  rstd: torch.Tensor, *, amax_rowwise: torch.Tensor, amax_columnwise: torch.Tensor | None,
                  rowwise: bool = True, columnwise: bool = True, rht: bool = False, rht_random_sign: bool = True,
                  row_scaled: bool = False) -> NVFP4Tensor:
    """Pass 2: the norm's BF16 output (from pass 1's statistics) quantized with the given amaxes."""
    x2d = x.reshape(-1, x.shape[-1])
    y = normalized(x2d, weight, bias, mean, rstd).to(torch.bfloat16).reshape(x.shape)
    return quantize_tensor(y, rowwise=rowwise, columnwise=columnwise, rht=rht, rht_random_sign=rht_random_sign,
                           row_scaled=row_scaled, amax_rowwise=amax_rowwise if rowwise else None,
                           amax_columnwise=amax_columnwise if columnwise else None)


def _power_of_two(k: torch.Tensor) -> torch.Tensor:
    """2^k as FP32 for integer-valued FP32 k in [-126, 127], exactly (from the exponent bits)."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x of FP32 x in a fixed order of FP32 operations (within 2 ulp of the exact value)."""
    device = x.device
    xc = x.clamp(_EXP_MIN, _EXP_MAX)
    n = torch.round(xc * _f32(_LOG2E, device))
    r = (xc - n * _f32(_LN2_HI, device)) - n * _f32(_LN2_LO, device)
    p = _f32(_EXP_POLY[-1], device).expand_as(r)
    for c in reversed(_EXP_POLY[:-1]):
        p = _f32(c, device) + r * p
    half = torch.floor(n * _f32(0.5, device))
    y = (p * _power_of_two(half)) * _power_of_two(n - half)
    y = torch.where(x > _f32(_EXP_MAX, device), _f32(float("inf"), device), y)
    y = torch.where(x < _f32(_EXP_MIN, device), _f32(0.0, device), y)
    return torch.where(torch.isnan(x), x, y)


def erfc(z: torch.Tensor) -> torch.Tensor:
    """erfc of FP32 z in a fixed order of FP32 operations (fractional error below 1.2e-7 plus rounding)."""
    device = z.device
    a = z.abs()
    t = torch.div(_f32(1.0, device), _f32(1.0, device) + _f32(0.5, device) * a)
    q = _f32(_ERFC_POLY[-1], device).expand_as(t)
    for c in reversed(_ERFC_POLY[1:-1]):
        q = _f32(c, device) + t * q
    r = t * exp((_f32(_ERFC_POLY[0], device) - a * a) + t * q)
    return torch.where(z < 0, _f32(2.0, device) - r, r)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)) in FP32."""
    return torch.div(x, _f32(1.0, x.device) + exp(-x))


def gelu(x: torch.Tensor) -> torch.Tensor:
    """The exact (erf) GELU in FP32: (0.5 * x) * erfc(-x / sqrt(2))."""
    return (_f32(0.5, x.device) * x) * erfc(x * _f32(-_FRAC_1_SQRT_2, x.device))


def activated(h2d: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation of fc1's output h [M, N] in FP32: GELU [M, N], or SwiGLU [M, N/2] of h = [gate | up]."""
    h = h2d.to(torch.float32)
    if activation == "gelu":
        return gelu(h)
    gate, up = h.chunk(2, dim=-1)
    return silu(gate) * up


def activation_output_shape(shape: torch.Size, activation: str) -> torch.Size:
    return torch.Size((*shape[:-1], shape[-1] // 2 if activation == "swiglu" else shape[-1]))


def activation_forward(h: torch.Tensor, *, activation: str, out_dtype: torch.dtype) -> torch.Tensor:
    """The activation of h [..., N] in out_dtype ([..., N/2] for SwiGLU)."""
    a = activated(h.reshape(-1, h.shape[-1]), activation).to(out_dtype)
    return a.reshape(activation_output_shape(h.shape, activation))


def activation_amaxes(h: torch.Tensor, *, activation: str, columnwise: bool = True, rht: bool = False,
                      rht_random_sign: bool = True, row_scaled: bool = False):
    """Pass 1 of the fused activation + cast: (amax_rowwise, amax_columnwise or None) of its BF16 output."""
    a = activation_forward(h, activation=activation, out_dtype=torch.bfloat16)
    return compute_amaxes(a.reshape(-1, a.shape[-1]), rowwise=True, columnwise=columnwise, rht=rht,
                          rht_random_sign=rht_random_sign, row_scaled=row_scaled)


def activation_quantize(h: torch.Tensor, *, activation: str, amax_rowwise: torch.Tensor,
                        amax_columnwise: torch.Tensor | None, rowwise: bool = True, columnwise: bool = True,
                        rht: bool = False, rht_random_sign: bool = True, row_scaled: bool = False) -> NVFP4Tensor:
    """Pass 2: the activation's BF16 output quantized with the given amaxes."""
    a = activation_forward(h, activation=activation, out_dtype=torch.bfloat16)
    return quantize_tensor(a, rowwise=rowwise, columnwise=columnwise, rht=rht, rht_random_sign=rht_random_sign,
                           row_scaled=row_scaled, amax_rowwise=amax_rowwise if rowwise else None,
                           amax_columnwise=amax_columnwise if columnwise else None)

"""4over6 adaptive block scaling (docs/numerics.md §12), the reference way.

Each block is quantized twice: with its max mapped to 6 (the plain block scale) and mapped to 4 (the block
scale times 1.5). The candidate whose dequantized values lie closer to the input (MAE or MSE, summed in a
fixed order) is kept; ties keep map-to-6. The global scale uses the bound B = 256 or 448 in place of 448.

Transformer Engine's reference quantizer (transformer_engine/pytorch/custom_recipes/reference_nvfp4.py,
NVFP4QuantizerRef with nvfp4_use_4over6=True) defines the bytes; this module reproduces them.
"""
from __future__ import annotations

import dataclasses

import torch

from nvfp4_dist.formats import (BLOCK_SIZE, E4M3_MAX, FLT_MAX, FP4_MAX, SCALE_DTYPE, fp4_code_values,
                                fp4_round_to_nearest_even, pack_fp4)
from nvfp4_dist.reference.quantize import encode_scale

ERROR_MODES = ("MAE", "MSE")
E4M3_BOUNDS = (448, 256)
MAP_TO_4_FACTOR = 1.5  # block scale of the map-to-4 candidate: the map-to-6 one times 6 / 4


@dataclasses.dataclass(frozen=True)
class FourOverSix:
    """How one tensor is quantized with 4over6 (docs/numerics.md §12).

    err_mode: "MAE" (sum of |d|) or "MSE" (sum of d * d) over a block's 16 (or 256) elements.
    e4m3_bound: B in S_enc = 6 * B / A: 256 (the default, leaving the map-to-4 scales below 448) or 448.
    fast_math: measure the error in the scaled domain, d = fp4value * s - x * S_enc, instead of the input
      domain, d = (fp4value * s * A) / (6 * B) - x.
    """

    err_mode: str = "MAE"
    e4m3_bound: int = 256
    fast_math: bool = False

    def __post_init__(self):
        if self.err_mode not in ERROR_MODES:
            raise ValueError(f"err_mode={self.err_mode!r} is not one of {ERROR_MODES}")
        if self.e4m3_bound not in E4M3_BOUNDS or isinstance(self.e4m3_bound, bool):
            raise ValueError(f"e4m3_bound={self.e4m3_bound!r} is not one of {E4M3_BOUNDS}")
        if not isinstance(self.fast_math, bool):
            raise ValueError(f"fast_math={self.fast_math!r}: must be a bool")


def candidate_products(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp4value(code) * fp32(scale) in FP32, [..., 16] codes (uint8) and [...] E4M3 scales.

    The fast-math error of docs/numerics.md §12.4 forms this product with FP16 semantics (the exact product
    rounded to FP16, subnormals kept; a NaN scale gives NaN). Such a product has at most 6 significant bits
    (2 of E2M1, 4 of E4M3) and lies in [2^-10, 2688], so FP16 holds it exactly: the FP32 product is the same
    number, and a NaN scale propagates by itself.
    """
    values = fp4_code_values().to(codes.device)[codes.long()]
    return values * scale.to(torch.float32)[..., None]


def _accumulate(differences: torch.Tensor, err_mode: str) -> torch.Tensor:
    """Sum |d_i| (MAE) or d_i * d_i (MSE) over the last dim (16) in index order, each addition rounded in FP32."""
    total = torch.zeros(differences.shape[:-1], dtype=torch.float32, device=differences.device)
    for i in range(BLOCK_SIZE):
        d = differences[..., i]
        total = total + (d * d if err_mode == "MSE" else d.abs())
    return total


def sum_tile_rows(errors: torch.Tensor) -> torch.Tensor:
    """[M, K/16] per-row block errors -> [M/16, K/16] per 16x16 tile, summed as a tree:
    rows (r, r+8), then (r, r+4), (r, r+2), (r, r+1) (docs/numerics.md §12.5)."""
    rows = errors.reshape(errors.shape[0] // BLOCK_SIZE, BLOCK_SIZE, errors.shape[1])
    half = BLOCK_SIZE // 2
    while half >= 1:
        rows = rows[:, :half] + rows[:, half:2 * half]
        half //= 2
    return rows[:, 0]


def quantize_blocks_4over6(x2d: torch.Tensor, amax: torch.Tensor, options: FourOverSix, *, block_2d: bool = False):
    """Quantize a 2D tensor along its last dim with 4over6 (docs/numerics.md §12), 1x16 or 16x16 blocks.

    amax: (1,) per tensor or (M,) per row (row-scaled, docs/numerics.md §6).
    Returns (data uint8 [M, K/2], scale float8_e4m3fn [M, K/16]).
    """
    x = x2d.to(torch.float32)
    rows, cols = x.shape
    device = x.device
    amax = amax.to(torch.float32)
    s_enc = encode_scale(amax, options.e4m3_bound).reshape(-1, 1, 1)   # §12.1; (1,1,1) or (M,1,1)
    s_dec = torch.div(torch.ones_like(s_enc), s_enc)
    blocks = x.reshape(rows, cols // BLOCK_SIZE, BLOCK_SIZE)
    if block_2d:
        tiles = x.reshape(rows // BLOCK_SIZE, BLOCK_SIZE, cols // BLOCK_SIZE, BLOCK_SIZE)
        block_amax = tiles.abs().amax(dim=(1, 3)).repeat_interleave(BLOCK_SIZE, dim=0)
    else:
        block_amax = blocks.abs().amax(dim=2)
    # §12.2: base = div(a_b, 6) * S_enc, divide first; the map-to-4 scale is base * 1.5.
    base = torch.div(block_amax, torch.tensor(FP4_MAX, device=device)) * s_enc[:, :, 0]
    scale6 = base.clamp(-E4M3_MAX, E4M3_MAX).to(SCALE_DTYPE)
    scale4 = (base * MAP_TO_4_FACTOR).clamp(-E4M3_MAX, E4M3_MAX).to(SCALE_DTYPE)

    if options.fast_math:
        target = blocks * s_enc                                        # x * S_enc
    else:
        denominator = torch.tensor(FP4_MAX * options.e4m3_bound, dtype=torch.float32, device=device)
        error_amax = amax.reshape(-1, 1, 1)
    candidates = []
    for scale in (scale4, scale6):
        # §12.3: e_c = min(1 / (fp32(s_c) * S_dec), FLT_MAX); q_c = fp4(clamp(x * e_c, -6, 6))
        factor = scale.to(torch.float32) * s_dec[:, :, 0]
        encode = torch.div(torch.ones_like(factor), factor).clamp(max=FLT_MAX)
        codes = fp4_round_to_nearest_even((blocks * encode[:, :, None]).clamp(-FP4_MAX, FP4_MAX))
        products = candidate_products(codes, scale)
        if options.fast_math:
            differences = products - target
        else:
            differences = torch.div(products * error_amax, denominator) - blocks
        errors = _accumulate(differences, options.err_mode)
        candidates.append((codes, scale, errors))
    (codes4, scale4, err4), (codes6, scale6, err6) = candidates
    if block_2d:
        pick4 = (sum_tile_rows(err4) < sum_tile_rows(err6)).repeat_interleave(BLOCK_SIZE, dim=0)
    else:
        pick4 = err4 < err6                                               # ties keep map-to-6
    codes = torch.where(pick4[:, :, None], codes4, codes6).reshape(rows, cols)
    scale = torch.where(pick4, scale4.view(torch.uint8), scale6.view(torch.uint8)).view(SCALE_DTYPE)
    return pack_fp4(codes), scale

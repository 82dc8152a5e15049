"""Reference NVFP4 quantization in plain FP32 torch: docs/numerics.md sections 2, 4, 6 and 7.

Every CUDA quantization kernel has its twin here and must match it byte for byte.
"""
import torch

from nvfp4_dist.formats import (BLOCK_SIZE, E4M3_BOUND, E4M3_MAX, FLT_MAX, FP4_MAX, SCALE_DTYPE,
                                fp4_neighbours, fp4_round_to_nearest_even, pack_fp4)
from nvfp4_dist.reference.philox import stochastic_rounding_bits_grid

_ONE_SIXTH = torch.tensor(1.0 / 6.0, dtype=torch.float32)  # fp32(1/6), docs/numerics.md §2.3


def compute_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the tensor as FP32 of shape (1,) (docs/numerics.md §2.1)."""
    return x.detach().abs().amax().to(torch.float32).reshape(1)


def compute_row_amax(x2d: torch.Tensor) -> torch.Tensor:
    """max |x| of each row, FP32 of shape (M,) (docs/numerics.md §6)."""
    return x2d.detach().abs().amax(dim=1).to(torch.float32)


def encode_scale(amax: torch.Tensor, e4m3_bound: int = E4M3_BOUND) -> torch.Tensor:
    """S_enc = min(6 * B / A, FLT_MAX); 1.0 where that is 0 (A = inf) (docs/numerics.md §2.2).

    B is the E4M3 bound of the global scale: 448 (6 * B = 2688), or 256 for 4over6 tensors (docs/numerics.md §12.1).
    One correctly rounded FP32 division (torch.div of two tensors, not 2688.0 / t).
    """
    numerator = torch.full_like(amax, FP4_MAX * e4m3_bound, dtype=torch.float32)  # no host-to-device copy (GPU)
    s_enc = torch.div(numerator, amax.to(torch.float32)).clamp(max=FLT_MAX)
    return torch.where(s_enc == 0, torch.ones_like(s_enc), s_enc)


def decode_scale(amax: torch.Tensor, e4m3_bound: int = E4M3_BOUND) -> torch.Tensor:
    """S_dec = 1 / S_enc, one FP32 division."""
    s_enc = encode_scale(amax, e4m3_bound)
    return torch.div(torch.ones_like(s_enc), s_enc)


def block_scales(block_amax: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales s_b = e4m3(clamp(min(a_b * (S_enc * fp32(1/6)), FLT_MAX), +-448)) (docs/numerics.md §2.3)."""
    factor = s_enc * _ONE_SIXTH.to(s_enc.device)
    return (block_amax * factor).clamp(max=FLT_MAX).clamp(-E4M3_MAX, E4M3_MAX).to(SCALE_DTYPE)


def _stochastic_codes(v: torch.Tensor, sr_seed: int, sr_offset, sr_stream: int) -> torch.Tensor:
    """Codes of v (in [-6, 6]) rounded up in magnitude with probability (|v| - lo) / (hi - lo).

    Up iff bits < p * 65536 with bits from reference/philox.py (byte * 256). The kernels evaluate the
    same rule on the FP32 bits of RU(|v| * 2^-126) (csrc/nvfp4_numerics.cuh).
    """
    bits = stochastic_rounding_bits_grid(v.shape[0], v.shape[1], sr_offset[0], sr_offset[1], sr_stream, sr_seed,
                                         v.device).to(torch.float32)
    a = v.abs()
    lower, lower_value, upper_value = fp4_neighbours(a)
    gap = upper_value - lower_value
    probability_up = torch.where(gap > 0, torch.div(a - lower_value, torch.where(gap > 0, gap, 1.0)), 0.0)
    magnitude = torch.where(bits < probability_up * 65536.0, lower + 1, lower).clamp(max=7).to(torch.uint8)
    return magnitude | torch.where(v < 0, 8, 0).to(torch.uint8)


def quantize_blocks(x2d: torch.Tensor, amax: torch.Tensor, *, block_2d: bool = False,
                    sr_seed: int | None = None, sr_offset=(0, 0), sr_stream: int = 0):
    """Quantize a 2D tensor along its last dim with 1x16 (or 16x16) blocks (docs/numerics.md §2 and 4).

    amax: shape (1,) for a per-tensor scale or (M,) for one per row (docs/numerics.md §6).
    sr_seed: stochastic rounding with Philox bits at global positions
             (row + sr_offset[0], col + sr_offset[1]) of stream sr_stream (docs/numerics.md §7).
    Returns (data uint8 [M, K/2], scale float8_e4m3fn [M, K/16]).
    """
    x = x2d.to(torch.float32)
    rows, cols = x.shape
    s_enc = encode_scale(amax).reshape(-1, 1)                   # (1,1) or (M,1)
    s_dec = torch.div(torch.ones_like(s_enc), s_enc)
    blocks = x.reshape(rows, cols // BLOCK_SIZE, BLOCK_SIZE)
    if block_2d:
        tiles = x.reshape(rows // BLOCK_SIZE, BLOCK_SIZE, cols // BLOCK_SIZE, BLOCK_SIZE)
        tile_amax = tiles.abs().amax(dim=(1, 3))                  # [M/16, K/16]
        block_amax = tile_amax.repeat_interleave(BLOCK_SIZE, dim=0)
    else:
        block_amax = blocks.abs().amax(dim=2)                     # [M, K/16]
    scale = block_scales(block_amax, s_enc)
    # docs/numerics.md §2.4: e_b = min(1 / (fp32(s_b) * S_dec), FLT_MAX)
    denominator = scale.to(torch.float32) * s_dec
    encode = torch.div(torch.ones_like(denominator), denominator).clamp(max=FLT_MAX)
    scaled = (blocks * encode[:, :, None]).clamp(-FP4_MAX, FP4_MAX).reshape(rows, cols)
    if sr_seed is None:
        codes = fp4_round_to_nearest_even(scaled)
    else:
        codes = _stochastic_codes(scaled, sr_seed, sr_offset, sr_stream)
    return pack_fp4(codes), scale

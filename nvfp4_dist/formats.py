"""NVFP4 format constants and FP4 (E2M1) encoding/packing (docs/numerics.md section 1)."""
import torch

BLOCK_SIZE = 16                 # elements per block scale
FP4_MAX = 6.0                   # largest E2M1 magnitude
E4M3_MAX = 448.0                # largest E4M3 block scale
E4M3_BOUND = 448                # the bound B of the global scale S_enc = 6 * B / A (256 for 4over6, docs/numerics.md §12)
GLOBAL_SCALE_NUMERATOR = 2688.0  # E4M3_MAX * FP4_MAX
FLT_MAX = torch.finfo(torch.float32).max
SCALE_DTYPE = torch.float8_e4m3fn

# Magnitudes of codes 0..7; codes 8..15 are the same magnitudes negated.
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def fp4_code_values() -> torch.Tensor:
    """FP32 value of each of the 16 codes (code 8 is -0.0)."""
    mags = torch.tensor(FP4_MAGNITUDES, dtype=torch.float32)
    return torch.cat([mags, -mags])


def fp4_round_to_nearest_even(v: torch.Tensor) -> torch.Tensor:
    """Codes (uint8) of FP32 values already clamped to [-6, 6], ties to even (docs/numerics.md §2.5).

    Midpoints 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 round to the neighbour whose
    mantissa bit is 0: 0, 1, 1, 2, 2, 4, 4. A negative value that rounds to 0
    gives code 8 (-0); -0.0 itself gives code 0 (its sign test is false).
    """
    a = v.abs()
    # Thresholds: a value strictly above (or equal, for odd-code upper ties) moves up.
    mag = torch.zeros_like(a, dtype=torch.uint8)
    mag = torch.where(a > 0.25, 1, mag)   # 0.25 -> 0 (even)
    mag = torch.where(a >= 0.75, 2, mag)  # 0.75 -> 1.0 (code 2, even mantissa)
    mag = torch.where(a > 1.25, 3, mag)   # 1.25 -> 1.0
    mag = torch.where(a >= 1.75, 4, mag)  # 1.75 -> 2.0
    mag = torch.where(a > 2.5, 5, mag)    # 2.5 -> 2.0
    mag = torch.where(a >= 3.5, 6, mag)   # 3.5 -> 4.0
    mag = torch.where(a > 5.0, 7, mag)    # 5 -> 4.0
    return (mag | torch.where(v < 0, 8, 0).to(torch.uint8)).to(torch.uint8)


def fp4_neighbours(a: torch.Tensor):
    """For magnitudes a in [0, 6]: (lower grid index, lower value, upper value)."""
    mags = torch.tensor(FP4_MAGNITUDES, dtype=torch.float32, device=a.device)
    lower = (torch.bucketize(a.contiguous(), mags, right=True) - 1).clamp(0, 7)
    upper = (lower + 1).clamp(max=7)
    return lower, mags[lower], mags[upper]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes, element 2i in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def fp4_to_float(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes -> FP32 values, [..., K/2] -> [..., K]."""
    return fp4_code_values().to(packed.device)[unpack_fp4(packed).long()]

"""The 128x4 swizzled block-scale layout of Blackwell block-scaled GEMMs (docs/numerics.md §8)."""
import torch

from nvfp4_dist.formats import SCALE_DTYPE


def padded_scale_shape(rows: int, cols: int):
    """(rows rounded up to 128, scale columns rounded up to 4)."""
    return -(-rows // 128) * 128, -(-cols // 4) * 4


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """[R, C] scales -> flat [Rp * Cp] in swizzled order, zero padded.

    offset(r, c) = ((r // 128) * (Cp / 4) + c // 4) * 512
                   + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)
    """
    rows, cols = scale.shape
    padded_rows, padded_cols = padded_scale_shape(rows, cols)
    raw = torch.zeros(padded_rows, padded_cols, dtype=torch.uint8, device=scale.device)
    raw[:rows, :cols] = scale.view(torch.uint8)
    # r = rb*128 + r4*32 + r32, c = cb*4 + c4  ->  order (rb, cb, r32, r4, c4)
    tiles = raw.reshape(padded_rows // 128, 4, 32, padded_cols // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).view(SCALE_DTYPE)


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of swizzle_scales: flat swizzled scales -> [rows, cols]."""
    padded_rows, padded_cols = padded_scale_shape(rows, cols)
    tiles = swizzled.view(torch.uint8).reshape(padded_rows // 128, padded_cols // 4, 32, 4, 4)
    raw = tiles.permute(0, 3, 2, 1, 4).reshape(padded_rows, padded_cols)
    return raw[:rows, :cols].contiguous().view(SCALE_DTYPE)


def swizzle_offset(r: int, c: int, padded_cols: int) -> int:
    """The docs/numerics.md §8 formula for one scale's position, for spot checks."""
    return ((r // 128) * (padded_cols // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)

"""Reference dequantization (docs/numerics.md §2.6): x' = fp4value(q) * fp32(s_b) * S_dec."""
import torch

from nvfp4_dist.formats import BLOCK_SIZE, fp4_to_float
from nvfp4_dist.reference.quantize import decode_scale


def dequantize_blocks(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [M, K/2] codes, E4M3 [M, K/16] scales, amax (1,) or (M,) -> [M, K] in dtype."""
    values = fp4_to_float(data)
    rows, cols = values.shape
    s_dec = decode_scale(amax).reshape(-1, 1, 1)
    blocks = values.reshape(rows, cols // BLOCK_SIZE, BLOCK_SIZE) * scale.to(torch.float32)[:, :, None]
    return (blocks * s_dec).reshape(rows, cols).to(dtype)

"""Reference dequantization (docs/numerics.md §2.6): x' = fp4value(q) * fp32(s_b) * S_dec."""
import torch

from nvfp4_dist.formats import BLOCK_SIZE, E4M3_BOUND, fp4_to_float
from nvfp4_dist.reference.quantize import decode_scale


def dequantize_blocks(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                      dtype: torch.dtype = torch.float32, *, e4m3_bound: int = E4M3_BOUND) -> torch.Tensor:
    """uint8 [M, K/2] codes, E4M3 [M, K/16] scales, amax (1,) or (M,) -> [M, K] in dtype.

    e4m3_bound: the global-scale bound B the tensor was quantized with (S_dec = amax / (6 * B), docs/numerics.md §12.7).
    """
    values = fp4_to_float(data)
    rows, cols = values.shape
    s_dec = decode_scale(amax, e4m3_bound).reshape(-1, 1, 1)
    blocks = values.reshape(rows, cols // BLOCK_SIZE, BLOCK_SIZE) * scale.to(torch.float32)[:, :, None]
    return (blocks * s_dec).reshape(rows, cols).to(dtype)

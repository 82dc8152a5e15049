"""Reference block-scaled GEMM (docs/numerics.md §8): per-16-block FP32 partial sums."""
import torch

from nvfp4_dist.formats import BLOCK_SIZE, E4M3_BOUND, fp4_to_float
from nvfp4_dist.reference.quantize import decode_scale

_ROWS_PER_CHUNK = 256  # bounds the [rows, N, K/16] partial-sum buffer


def block_values(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp4(q) * fp32(s) per element, exact in FP32: [M, K/2], [M, K/16] -> [M, K/16, 16]."""
    values = fp4_to_float(data)
    rows, cols = values.shape
    return values.reshape(rows, cols // BLOCK_SIZE, BLOCK_SIZE) * scale.to(torch.float32)[:, :, None]


def gemm_reference(a_data, a_scale, a_amax, b_data, b_scale, b_amax, *, a_e4m3_bound: int = E4M3_BOUND,
                   b_e4m3_bound: int = E4M3_BOUND) -> torch.Tensor:
    """y = A . B^T in FP32 for A [M, K] and B [N, K], both quantized along K.

    y[m, n] = (sum over blocks of the FP32 block partial sums) * S_dec(A) * S_dec(B);
    a_amax may be per row (M,) for row-scaled activations (docs/numerics.md §6), b_amax per row (N,) for the
    columnwise copy of a row-scaled activation in wgrad (docs/numerics.md §6b: it scales output column n).
    *_e4m3_bound: each operand's global-scale bound (256 for some 4over6 tensors, docs/numerics.md §12.7).
    """
    a_blocks = block_values(a_data, a_scale)
    b_blocks = block_values(b_data, b_scale)
    alpha = (decode_scale(a_amax, a_e4m3_bound).reshape(-1, 1) * decode_scale(b_amax, b_e4m3_bound).reshape(1, -1))
    out = torch.empty(a_blocks.shape[0], b_blocks.shape[0], dtype=torch.float32, device=a_data.device)
    for start in range(0, a_blocks.shape[0], _ROWS_PER_CHUNK):
        chunk = a_blocks[start:start + _ROWS_PER_CHUNK]
        partial = torch.einsum("mbk,nbk->mnb", chunk, b_blocks)  # per-block FP32 sums
        out[start:start + _ROWS_PER_CHUNK] = partial.sum(dim=2)
    return out * alpha

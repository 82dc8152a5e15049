"""Reference rowwise/columnwise copies of a tensor (docs/numerics.md §3), with 2D, RHT, row scaling and SR."""
import torch

from nvfp4_dist.tensor import NVFP4Tensor
from nvfp4_dist.reference.dequantize import dequantize_blocks
from nvfp4_dist.reference.quantize import compute_amax, compute_row_amax, quantize_blocks
from nvfp4_dist.reference.rht import inverse_rht_transpose, rht_transpose

ROWWISE_STREAM, COLUMNWISE_STREAM = 0, 1  # Philox counter word 2 of each copy's SR bits


def columnwise_source(x2d: torch.Tensor, rht: bool, rht_random_sign: bool) -> torch.Tensor:
    """What the columnwise copy quantizes: x^T [K, M], after the RHT when it is on."""
    if rht:
        return rht_transpose(x2d, rht_random_sign)
    return x2d.t()


def compute_amaxes(x2d: torch.Tensor, *, rowwise: bool = True, columnwise: bool = True, rht: bool = False,
                   rht_random_sign: bool = True, row_scaled: bool = False):
    """(amax_rowwise, amax_columnwise) for the copies asked for (None for the others).

    Rowwise: per tensor (1,), or per row (M,) when row_scaled. Columnwise: after the RHT.
    """
    amax_rowwise = amax_columnwise = None
    if rowwise:
        amax_rowwise = compute_row_amax(x2d) if row_scaled else compute_amax(x2d)
    if columnwise:
        amax_columnwise = compute_amax(columnwise_source(x2d, rht, rht_random_sign)) if rht else compute_amax(x2d)
    return amax_rowwise, amax_columnwise


def quantize_tensor(x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = True,
                    block_2d: bool = False, rht: bool = False, rht_random_sign: bool = True,
                    row_scaled: bool = False, sr_seed: int | None = None, sr_row_offset: int = 0,
                    amax_rowwise: torch.Tensor | None = None,
                    amax_columnwise: torch.Tensor | None = None) -> NVFP4Tensor:
    """Quantize x (viewed as [M, K]) into an NVFP4Tensor, the reference way.

    amax_*: supplied from outside (reduced across ranks, docs/numerics.md §9) or computed here.
    sr_seed: stochastic rounding; sr_row_offset is this tensor's first row in the
    global tensor, so a shard draws the same bits as the full tensor would.
    """
    x2d = x.reshape(-1, x.shape[-1])
    local_row, local_col = compute_amaxes(x2d, rowwise=rowwise and amax_rowwise is None,
                                          columnwise=columnwise and amax_columnwise is None,
                                          rht=rht, rht_random_sign=rht_random_sign, row_scaled=row_scaled)
    amax_rowwise = amax_rowwise if amax_rowwise is not None else local_row
    amax_columnwise = amax_columnwise if amax_columnwise is not None else local_col
    q = NVFP4Tensor(shape=x.shape, dtype=x.dtype, block_2d=block_2d, rht=rht and columnwise,
                    rht_random_sign=rht_random_sign, row_scaled=row_scaled)
    if rowwise:
        q.rowwise_data, q.rowwise_scale = quantize_blocks(
            x2d, amax_rowwise, block_2d=block_2d, sr_seed=sr_seed,
            sr_offset=(sr_row_offset, 0), sr_stream=ROWWISE_STREAM)
        q.amax_rowwise = amax_rowwise
    if columnwise:
        q.columnwise_data, q.columnwise_scale = quantize_blocks(
            columnwise_source(x2d, rht, rht_random_sign), amax_columnwise, block_2d=block_2d,
            sr_seed=sr_seed, sr_offset=(0, sr_row_offset), sr_stream=COLUMNWISE_STREAM)
        q.amax_columnwise = amax_columnwise
    return q


def dequantize_tensor(q: NVFP4Tensor, dtype: torch.dtype, copy: str) -> torch.Tensor:
    """One copy of q back to `dtype` in the original shape ('rowwise' or 'columnwise')."""
    if copy == "rowwise":
        x2d = dequantize_blocks(q.rowwise_data, q.rowwise_scale, q.amax_rowwise)
    else:
        x_t = dequantize_blocks(q.columnwise_data, q.columnwise_scale, q.amax_columnwise)
        x2d = inverse_rht_transpose(x_t, q.rht_random_sign) if q.rht else x_t.t()
    return x2d.to(dtype).reshape(q.shape)

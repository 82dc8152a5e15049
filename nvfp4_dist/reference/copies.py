"""Reference rowwise/columnwise copies of a tensor (docs/numerics.md §3), with 2D, RHT, row scaling, SR and 4over6."""
import torch

from nvfp4_dist.formats import E4M3_BOUND
from nvfp4_dist.reference.dequantize import dequantize_blocks
from nvfp4_dist.reference.fourover6 import FourOverSix, quantize_blocks_4over6
from nvfp4_dist.reference.quantize import compute_amax, compute_row_amax, quantize_blocks
from nvfp4_dist.reference.rht import inverse_rht_transpose, rht_transpose
from nvfp4_dist.tensor import NVFP4Tensor

ROWWISE_STREAM, COLUMNWISE_STREAM = 0, 1  # Philox counter word 2 of each copy's SR bits


def check_copy_options(*, columnwise: bool, block_2d: bool, rht: bool, row_scaled: bool, stochastic: bool,
                       four_over_six: FourOverSix | None) -> None:
    """ValueError for combinations no copy supports (docs/numerics.md §6, 6b, 12); shared by the reference
    and the kernels."""
    if four_over_six is not None and not isinstance(four_over_six, FourOverSix):
        raise ValueError(f"four_over_six must be a FourOverSix or None, got {type(four_over_six).__name__}")
    if row_scaled and block_2d:
        raise ValueError("row_scaled=True with block_2d=True: row scaling takes 1x16 blocks only (docs/numerics.md §6)")
    if four_over_six is not None:
        if stochastic:
            raise ValueError("four_over_six with stochastic rounding: 4over6 keeps round-to-nearest "
                             "(docs/numerics.md §12); drop sr_seed or four_over_six")
        if rht and columnwise:
            raise ValueError("four_over_six with rht=True on the columnwise copy: 4over6 is not combined with "
                             "the RHT (docs/numerics.md §12); set rht=False")
        if row_scaled and columnwise:
            raise ValueError("four_over_six with row_scaled=True and columnwise=True: the columnwise copy of a "
                             "row-scaled tensor takes no 4over6 (docs/numerics.md §6); quantize it without 4over6")
    if row_scaled and stochastic and columnwise:
        raise ValueError("row_scaled=True with stochastic rounding on the columnwise copy: excluded by "
                         "docs/numerics.md §6; drop sr_seed")


def columnwise_source(x2d: torch.Tensor, rht: bool, rht_random_sign: bool) -> torch.Tensor:
    """What the columnwise copy quantizes: x^T [K, M], after the RHT when it is on."""
    if rht:
        return rht_transpose(x2d, rht_random_sign)
    return x2d.t()


def compute_amaxes(x2d: torch.Tensor, *, rowwise: bool = True, columnwise: bool = True, rht: bool = False,
                   rht_random_sign: bool = True, row_scaled: bool = False):
    """(amax_rowwise, amax_columnwise) for the copies asked for (None for the others).

    Rowwise: per tensor (1,), or per row (M,) when row_scaled. Columnwise: after the RHT; per tensor (1,), or
    per row of x^T (K,) when row_scaled (docs/numerics.md §6b).
    """
    amax_rowwise = amax_columnwise = None
    if rowwise:
        amax_rowwise = compute_row_amax(x2d) if row_scaled else compute_amax(x2d)
    if columnwise:
        source = columnwise_source(x2d, rht, rht_random_sign) if rht or row_scaled else x2d
        amax_columnwise = compute_row_amax(source) if row_scaled else compute_amax(source)
    return amax_rowwise, amax_columnwise


def _quantize_copy(x2d, amax, *, block_2d, four_over_six, sr_seed, sr_offset, sr_stream):
    if four_over_six is not None:
        return quantize_blocks_4over6(x2d, amax, four_over_six, block_2d=block_2d)
    return quantize_blocks(x2d, amax, block_2d=block_2d, sr_seed=sr_seed, sr_offset=sr_offset, sr_stream=sr_stream)


def quantize_tensor(x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = True,
                    block_2d: bool = False, rht: bool = False, rht_random_sign: bool = True,
                    row_scaled: bool = False, sr_seed: int | None = None, sr_row_offset: int = 0,
                    amax_rowwise: torch.Tensor | None = None, amax_columnwise: torch.Tensor | None = None,
                    four_over_six: FourOverSix | None = None) -> NVFP4Tensor:
    """Quantize x (viewed as [M, K]) into an NVFP4Tensor, the reference way.

    amax_*: supplied from outside (reduced across ranks, docs/numerics.md §9) or computed here.
    sr_seed: stochastic rounding; sr_row_offset is this tensor's first row in the
    global tensor, so a shard draws the same bits as the full tensor would.
    four_over_six: 4over6 block scaling of both copies (docs/numerics.md §12), with its global-scale bound.
    """
    check_copy_options(columnwise=columnwise, block_2d=block_2d, rht=rht, row_scaled=row_scaled,
                       stochastic=sr_seed is not None, four_over_six=four_over_six)
    x2d = x.reshape(-1, x.shape[-1])
    local_row, local_col = compute_amaxes(x2d, rowwise=rowwise and amax_rowwise is None,
                                          columnwise=columnwise and amax_columnwise is None,
                                          rht=rht, rht_random_sign=rht_random_sign, row_scaled=row_scaled)
    amax_rowwise = amax_rowwise if amax_rowwise is not None else local_row
    amax_columnwise = amax_columnwise if amax_columnwise is not None else local_col
    q = NVFP4Tensor(shape=x.shape, dtype=x.dtype, block_2d=block_2d, rht=rht and columnwise,
                    rht_random_sign=rht_random_sign, row_scaled=row_scaled,
                    e4m3_bound=E4M3_BOUND if four_over_six is None else four_over_six.e4m3_bound)
    common = dict(block_2d=block_2d, four_over_six=four_over_six, sr_seed=sr_seed)
    if rowwise:
        q.rowwise_data, q.rowwise_scale = _quantize_copy(x2d, amax_rowwise, sr_offset=(sr_row_offset, 0),
                                                         sr_stream=ROWWISE_STREAM, **common)
        q.amax_rowwise = amax_rowwise
    if columnwise:
        q.columnwise_data, q.columnwise_scale = _quantize_copy(
            columnwise_source(x2d, rht, rht_random_sign), amax_columnwise, sr_offset=(0, sr_row_offset),
            sr_stream=COLUMNWISE_STREAM, **common)
        q.amax_columnwise = amax_columnwise
    return q


def dequantize_tensor(q: NVFP4Tensor, dtype: torch.dtype, copy: str) -> torch.Tensor:
    """One copy of q back to `dtype` in the original shape ('rowwise' or 'columnwise')."""
    if copy == "rowwise":
        x2d = dequantize_blocks(q.rowwise_data, q.rowwise_scale, q.amax_rowwise, e4m3_bound=q.e4m3_bound)
    else:
        x_t = dequantize_blocks(q.columnwise_data, q.columnwise_scale, q.amax_columnwise, e4m3_bound=q.e4m3_bound)
        x2d = inverse_rht_transpose(x_t, q.rht_random_sign) if q.rht else x_t.t()
    return x2d.to(dtype).reshape(q.shape)

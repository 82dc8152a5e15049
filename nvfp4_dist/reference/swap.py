"""Reorders of packed copies: swap_first_dims (a gathered columnwise copy, docs/numerics.md §9) and transpose_codes
(a 16x16-blocked rowwise copy's codes into its columnwise copy's, §4)."""
import torch

from nvfp4_dist.formats import pack_fp4, unpack_fp4


def swap_first_dims(gathered: torch.Tensor, world_size: int) -> torch.Tensor:
    """[W*K, X] viewed as (W, K, X) -> (K, W, X), returned as [K, W*X].

    Turns the all-gather of per-rank columnwise copies [K, M_local/2] into the
    columnwise copy of the gathered tensor [K, W*M_local/2]; same for the scales.
    """
    rows, cols = gathered.shape
    return gathered.reshape(world_size, rows // world_size, cols).transpose(0, 1).reshape(rows // world_size, world_size * cols)


def transpose_codes(packed: torch.Tensor) -> torch.Tensor:
    """Packed FP4 codes [N, K/2] (element 2i of a row in the low nibble) -> the codes of the transpose, [K, N/2]."""
    return pack_fp4(unpack_fp4(packed).t().contiguous())

"""swap_first_dims: reorder a gathered columnwise copy (docs/numerics.md §9)."""
import torch


def swap_first_dims(gathered: torch.Tensor, world_size: int) -> torch.Tensor:
    """[W*K, X] viewed as (W, K, X) -> (K, W, X), returned as [K, W*X].

    Turns the all-gather of per-rank columnwise copies [K, M_local/2] into the
    columnwise copy of the gathered tensor [K, W*M_local/2]; same for the scales.
    """
    rows, cols = gathered.shape
    return gathered.reshape(world_size, rows // world_size, cols).transpose(0, 1).reshape(rows // world_size, world_size * cols)

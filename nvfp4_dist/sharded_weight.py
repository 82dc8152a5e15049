"""A weight sharded along dim 0 (data parallelism), quantized shard by shard with the whole weight's amax.

Every shard cuts on 16-row boundaries and is quantized with the amax of the whole weight, so the shards' NVFP4
bytes, put side by side, equal quantizing the whole weight (docs/numerics.md §4; docs/data_parallel.md). What a
shard sends over the wire is its rowwise codes and, with 16x16 blocks, one E4M3 scale per block (its rowwise
scale tensor repeats that scale on 16 rows); the columnwise copy of a 16x16-blocked weight is the transpose of
the rowwise one (docs/numerics.md §4), so it is derived after the gather instead of sent. With 1x16 weight
blocks or 4over6 weights both copies travel.

Group-free: the amax all-reduce and the all-gather are nvfp4_dist.parallel.param_gather's.
"""
from __future__ import annotations

import dataclasses

import torch

from nvfp4_dist import hot_path, ops
from nvfp4_dist.formats import BLOCK_SIZE, SCALE_DTYPE
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.tensor import NVFP4Tensor

ROWWISE_PIECES = ("rowwise_data", "block_scale", "rowwise_scale")  # rows of the weight along dim 0
COLUMNWISE_PIECES = ("columnwise_data", "columnwise_scale")        # [K, rows/2], [K, rows/16]: reordered after a gather


def check_weight_sharding(shape, world_size: int, *, name: str = "weight") -> None:
    """ValueError unless a weight of `shape` splits along dim 0 into world_size equal shards that cut on 16x16
    block boundaries (each shard a positive multiple of 16 rows; the last dim a multiple of 16)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be an integer >= 1")
    shape = tuple(shape)
    if len(shape) != 2:
        raise ValueError(f"{name}.shape={shape}: a sharded NVFP4 weight has 2 dims [out_features, in_features]")
    rows, cols = shape
    if cols == 0 or cols % BLOCK_SIZE:
        raise ValueError(f"{name}.shape={shape}: in_features ({cols}) must be a positive multiple of {BLOCK_SIZE}")
    if rows == 0 or rows % (BLOCK_SIZE * world_size):
        remedy = (f"pick a data-parallel size that divides its {rows // BLOCK_SIZE} row blocks, or pad the layer"
                  if rows and rows % BLOCK_SIZE == 0 else "pad the layer")
        raise ValueError(f"{name}.shape={shape}: {rows} rows do not split into {world_size} shards that cut on "
                         f"{BLOCK_SIZE}x{BLOCK_SIZE} block boundaries; out_features must be a multiple of "
                         f"{BLOCK_SIZE} * {world_size} = {BLOCK_SIZE * world_size} ({remedy})")


def shard_rows(weight: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """Rows [rank * n, (rank + 1) * n) of weight, n = rows / world_size (a view), after check_weight_sharding."""
    check_weight_sharding(weight.shape, world_size)
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r}: must be an integer in [0, {world_size})")
    rows = weight.shape[0] // world_size
    return weight[rank * rows:(rank + 1) * rows]


def local_weight_amax(shard: torch.Tensor) -> torch.Tensor:
    """max |shard| as float32 (1,): the shard's contribution to the weight's amax (no RHT on weights: both copies
    share it)."""
    return ops.compute_amaxes(shard.detach(), "weight", rowwise=True, columnwise=False)[0]


def derives_columnwise(recipe: NVFP4Recipe) -> bool:
    """Whether the weight's columnwise copy is the transpose of its rowwise one (16x16 blocks without 4over6,
    whose per-block error sums depend on the copy's element order, docs/numerics.md §12)."""
    return recipe.weight_2d and ops.four_over_six_options("weight", recipe) is None


def quantize_shard(shard: torch.Tensor, amax: torch.Tensor, recipe: NVFP4Recipe, *,
                   columnwise: bool = True, check_finite: bool | None = None) -> NVFP4Tensor:
    """The copies of a shard that travel, quantized with the whole weight's amax (float32 (1,)): the rowwise
    copy, and the columnwise copy when asked and not derivable after the gather (derives_columnwise).
    check_finite (default recipe.check_finite): a NaN/Inf amax raises NonFiniteAmaxError (the same on every rank:
    the amax is the group's); False where the caller has checked the amaxes itself (quantized then by the layers'
    hot path: one C++ call on CUDA, the same bytes)."""
    send_columnwise = columnwise and not derives_columnwise(recipe)
    given = dict(amax_rowwise=amax, amax_columnwise=amax if send_columnwise else None)
    if recipe.check_finite if check_finite is None else check_finite:
        return ops.quantize(shard.detach(), "weight", rowwise=True, columnwise=send_columnwise, recipe=recipe,
                            check_finite=True, **given)
    return hot_path.quantize(shard.detach(), "weight", recipe, rowwise=True, columnwise=send_columnwise, **given)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def wire_pieces(q: NVFP4Tensor) -> dict:
    """The uint8 tensors of a quantized shard that an all-gather moves, by name: rowwise codes, the scales
    (one row per 16x16 block with 16x16 blocks), and the columnwise copy when q holds one."""
    pieces = {"rowwise_data": q.rowwise_data.contiguous()}
    if q.block_2d:
        pieces["block_scale"] = _as_bytes(q.rowwise_scale[::BLOCK_SIZE])
    else:
        pieces["rowwise_scale"] = _as_bytes(q.rowwise_scale)
    if q.has_columnwise:
        pieces["columnwise_data"] = q.columnwise_data.contiguous()
        pieces["columnwise_scale"] = _as_bytes(q.columnwise_scale)
    return pieces


def wire_bytes(shape, recipe: NVFP4Recipe, *, columnwise: bool = True) -> int:
    """Bytes that a shard of `shape` [rows, cols] sends: its wire_pieces after quantize_shard with `recipe`."""
    rows, cols = shape
    total = rows * cols // 2
    total += (rows // BLOCK_SIZE if recipe.weight_2d else rows) * (cols // BLOCK_SIZE)
    if columnwise and not derives_columnwise(recipe):
        total += cols * rows // 2 + cols * rows // BLOCK_SIZE
    return total


def columnwise_from_rowwise(q: NVFP4Tensor) -> NVFP4Tensor:
    """q with its columnwise copy made from its 16x16-blocked rowwise copy: codes and per-block scales transposed
    (docs/numerics.md §4), the same bytes as quantizing the columnwise copy."""
    if not q.block_2d or not q.has_rowwise:
        raise ValueError(f"q={q!r}: the columnwise copy is the rowwise one transposed only for 16x16 blocks")
    block_scale = q.rowwise_scale.view(torch.uint8)[::BLOCK_SIZE]          # [N/16, K/16]
    columnwise_scale = block_scale.t().repeat_interleave(BLOCK_SIZE, dim=0)  # [K, N/16]
    return dataclasses.replace(q, columnwise_data=ops.transpose_codes(q.rowwise_data),
                               columnwise_scale=columnwise_scale.contiguous().view(SCALE_DTYPE),
                               amax_columnwise=q.amax_rowwise)


def assemble_gathered(shard_q: NVFP4Tensor, gathered: dict, world_size: int, *,
                      columnwise: bool = True) -> NVFP4Tensor:
    """The whole weight's NVFP4Tensor from the gathered wire pieces of its world_size shards (each [W * d0, ...]:
    rank r's rows at block r, as an all-gather along dim 0 gives them). shard_q: this rank's quantized shard
    (for the metadata and the amax, which every rank shares). columnwise: also give the columnwise copy."""
    rows, cols = shard_q.shape[0] * world_size, shard_q.shape[1]
    rowwise_data = gathered["rowwise_data"]
    if "block_scale" in gathered:
        scale = gathered["block_scale"].repeat_interleave(BLOCK_SIZE, dim=0)
    else:
        scale = gathered["rowwise_scale"]
    q = dataclasses.replace(shard_q, shape=torch.Size((rows, cols)), rowwise_data=rowwise_data,
                            rowwise_scale=scale.contiguous().view(SCALE_DTYPE), columnwise_data=None,
                            columnwise_scale=None, amax_columnwise=None)
    if not columnwise:
        return q
    if "columnwise_data" in gathered:
        return dataclasses.replace(
            q, columnwise_data=ops.swap_first_dims(gathered["columnwise_data"], world_size),
            columnwise_scale=ops.swap_first_dims(gathered["columnwise_scale"], world_size).view(SCALE_DTYPE),
            amax_columnwise=shard_q.amax_columnwise)
    return columnwise_from_rowwise(q)

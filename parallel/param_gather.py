"""The parameter all-gather of data parallelism in NVFP4 (docs/data_parallel.md).

Weights sharded along dim 0 over a data-parallel group are quantized shard by shard with the amax of the whole
weight (one all-reduce(MAX) of every weight's local amax together, per step), and their NVFP4 bytes are gathered
in one all-gather: 0.5 bytes per weight plus one E4M3 scale per 16x16 block, instead of 2 bytes in BF16. The
gathered copy equals, byte for byte, nvfp4_dist.quantize(whole weight, role="weight") (nvfp4_dist/sharded_weight.py).
Under tensor parallelism the data-parallel group shards each rank's tensor-parallel weight, whose amax stays
its own (docs/numerics.md §9): the result equals quantizing that rank's tensor-parallel shard.
Plain functions over a process group, no autograd (parallel/collectives.py's conventions); every rank passes
shards of the same shapes, in the same order.
"""
from __future__ import annotations

import torch

from nvfp4_dist import sharded_weight
from nvfp4_dist.recipe import NVFP4Recipe, check_recipe
from nvfp4_dist.tensor import NVFP4Tensor
from nvfp4_dist.parallel import collectives


def _check_shards(shards, group) -> int:
    """The group size, after checking that every shard is one of world_size aligned shards."""
    if not isinstance(shards, (list, tuple)) or not all(isinstance(s, torch.Tensor) for s in shards):
        raise ValueError(f"shards must be a list of torch.Tensor, got {type(shards).__name__}")
    world_size = collectives.group_size(group)
    for index, shard in enumerate(shards):
        if shard.dim() != 2:
            raise ValueError(f"shards[{index}].shape={tuple(shard.shape)}: a weight shard has 2 dims")
        sharded_weight.check_weight_sharding((shard.shape[0] * world_size, shard.shape[1]), world_size,
                                             name=f"shards[{index}] gathered over {world_size} ranks: weight")
    return world_size


def all_reduce_weight_amaxes(shards, group=None) -> list:
    """The amax of each whole weight from its shards: local amaxes, then one all-reduce(MAX) for all of them
    (a NaN anywhere gives +inf everywhere, collectives.all_reduce_amax)."""
    _check_shards(shards, group)
    amaxes = [sharded_weight.local_weight_amax(shard) for shard in shards]
    return collectives.all_reduce_amax(amaxes, group)


def quantize_weight_shards(shards, recipe: NVFP4Recipe | None = None, group=None, *,
                           columnwise: bool = True) -> list:
    """Each shard quantized with its whole weight's amax (all_reduce_weight_amaxes): the copies that travel."""
    check_recipe(recipe)
    recipe = recipe or NVFP4Recipe()
    amaxes = all_reduce_weight_amaxes(shards, group)
    return [sharded_weight.quantize_shard(shard, amax, recipe, columnwise=columnwise)
            for shard, amax in zip(shards, amaxes)]


def _gather_pieces(pieces_per_weight: list, group) -> list:
    """One all-gather of a byte buffer holding every weight's pieces; per weight, its pieces gathered along
    dim 0 ([W * d0, ...], rank r's at block r)."""
    world_size = collectives.group_size(group)
    flat = [piece.reshape(-1) for pieces in pieces_per_weight for piece in pieces.values()]
    if not flat:
        return []
    packed = torch.cat(flat)
    per_rank = collectives.all_gather_stacked(packed, group)  # [W, bytes]
    result, offset = [], 0
    for pieces in pieces_per_weight:
        gathered = {}
        for name, piece in pieces.items():
            chunk = per_rank[:, offset:offset + piece.numel()]
            gathered[name] = chunk.reshape(world_size * piece.shape[0], *piece.shape[1:])
            offset += piece.numel()
        result.append(gathered)
    return result


def all_gather_weights_nvfp4(shard_qs, group=None, *, columnwise: bool = True) -> list:
    """The whole weights' NVFP4Tensors from their quantized shards (quantize_weight_shards), in one all-gather;
    columnwise: also give each weight's columnwise copy (derived from the rowwise one for 16x16 blocks)."""
    if not isinstance(shard_qs, (list, tuple)) or not all(isinstance(q, NVFP4Tensor) for q in shard_qs):
        raise ValueError("shard_qs must be a list of NVFP4Tensor (quantize_weight_shards)")
    world_size = collectives.group_size(group)
    pieces = [sharded_weight.wire_pieces(q) for q in shard_qs]
    for q, weight_pieces in zip(shard_qs, pieces):
        if columnwise and not q.block_2d and "columnwise_data" not in weight_pieces:
            raise ValueError(f"columnwise=True: the shard {q!r} has no columnwise copy to gather and 1x16 blocks; "
                             f"quantize it with columnwise=True")
    gathered = _gather_pieces(pieces, group)
    return [sharded_weight.assemble_gathered(q, g, world_size, columnwise=columnwise)
            for q, g in zip(shard_qs, gathered)]


def gather_weights_nvfp4(shards, recipe: NVFP4Recipe | None = None, group=None, *, columnwise: bool = True) -> list:
    """The whole weights in NVFP4 from their shards: one amax all-reduce, the shard casts, one all-gather."""
    return all_gather_weights_nvfp4(quantize_weight_shards(shards, recipe, group, columnwise=columnwise), group,
                                    columnwise=columnwise)


def all_gather_weights(shards, group=None, dtype: torch.dtype | None = None) -> list:
    """The whole weights from their shards in `dtype` (default: each shard's), in one all-gather: the
    unquantized parameter gather (the baseline the NVFP4 gather replaces)."""
    world_size = _check_shards(shards, group)
    if not shards:
        return []
    dtype = dtype or shards[0].dtype
    pieces = [{"values": shard.detach().to(dtype).contiguous().view(torch.uint8)} for shard in shards]
    gathered = _gather_pieces(pieces, group)
    return [g["values"].view(dtype).reshape(shard.shape[0] * world_size, shard.shape[1])
            for g, shard in zip(gathered, shards)]

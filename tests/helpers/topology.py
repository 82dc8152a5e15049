"""Tensor-parallel groups that are not the world: 4 gloo ranks as TP=2 x DP=2 (or TP=2 x PP=2), in two layouts.

"consecutive": TP groups {0, 1} and {2, 3} (Megatron's and nvfp4-train's order); "strided": TP groups {0, 2} and
{1, 3}, so that a rank's index in its group differs from its global rank in both directions (point-to-point rings
must translate one into the other). The other dimension (data or pipeline parallel) pairs the ranks across groups.
Each TP group gets its own data, so a reduction over the world instead of the group changes the bytes.
"""
from __future__ import annotations

import dataclasses

import torch.distributed as dist

WORLD = 4
TP = 2
LAYOUTS = {"consecutive": ((0, 1), (2, 3)), "strided": ((0, 2), (1, 3))}


@dataclasses.dataclass(frozen=True)
class Placement:
    group: object          # this rank's tensor-parallel ProcessGroup
    ranks: tuple           # the global ranks of that group, in group order
    rank: int              # this rank's index in the group
    replica: int           # which TP group (data-parallel replica or pipeline stage) this rank is in


def tensor_parallel_groups(layout: str) -> Placement:
    """Create every TP group of `layout` (each rank creates all of them, in the same order) and return this rank's."""
    mine = None
    for replica, ranks in enumerate(LAYOUTS[layout]):
        group = dist.new_group(list(ranks))
        if dist.get_rank() in ranks:
            mine = Placement(group, ranks, ranks.index(dist.get_rank()), replica)
    return mine

"""Communication/GEMM overlap on a ring (SPEC 9, "Overlap").

Two schedules, each over the ranks of a tensor-parallel group, with NCCL (or gloo) point-to-point
transfers issued before the GEMM that does not depend on them, so the transfer of the next chunk runs
while the current chunk's GEMM does:

- ring_all_gather_consume: the all-gather feeding a GEMM. Every rank starts with its own chunk; at step i
  it consumes the chunk that came from rank (rank - i) mod W while passing it on to rank + 1.
- ring_reduce_scatter_produce: the reduce-scatter after a GEMM. At step i a rank computes the partial
  output of chunk (rank - i - 1) mod W, adds the running sum received from rank - 1 and passes it on;
  after W steps it holds the full sum of its own chunk.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist


def all_gather_order(rank: int, world_size: int) -> list[int]:
    """Source rank of the chunk consumed at each step of ring_all_gather_consume."""
    return [(rank - step) % world_size for step in range(world_size)]


def reduce_scatter_order(rank: int, world_size: int) -> list[int]:
    """Chunk whose partial output is produced at each step of ring_reduce_scatter_produce."""
    return [(rank - step - 1) % world_size for step in range(world_size)]


def _exchange(send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], group, world_size: int, rank: int):
    """Start sending `send` to the next rank and receiving `recv` from the previous one; returns the works."""
    next_rank = dist.get_global_rank(group, (rank + 1) % world_size) if group is not None else (rank + 1) % world_size
    prev_rank = dist.get_global_rank(group, (rank - 1) % world_size) if group is not None else (rank - 1) % world_size
    ops = [dist.P2POp(dist.isend, t, next_rank, group) for t in send]
    ops += [dist.P2POp(dist.irecv, t, prev_rank, group) for t in recv]
    return dist.batch_isend_irecv(ops)


def ring_all_gather_consume(local_chunk: Sequence[torch.Tensor], consume: Callable[[Sequence[torch.Tensor], int], None],
                            group=None) -> None:
    """Call consume(chunk_tensors, source_rank) for every rank's chunk, passing chunks round the ring.

    local_chunk: the tensors (for example packed data and scales) that make up this rank's chunk; every
    rank's chunk has the same shapes. The transfer of the next chunk is in flight during consume().
    """
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    current = [t.contiguous() for t in local_chunk]
    for step, source in enumerate(all_gather_order(rank, world_size)):
        works = []
        if step < world_size - 1:
            incoming = [torch.empty_like(t) for t in current]
            works = _exchange(current, incoming, group, world_size, rank)
        consume(current, source)
        for work in works:
            work.wait()
        if step < world_size - 1:
            current = incoming


def ring_reduce_scatter_produce(produce: Callable[[int], torch.Tensor], group=None) -> torch.Tensor:
    """Sum over ranks of produce(chunk) for this rank's chunk, with transfers overlapping produce().

    produce(c) returns this rank's partial output for chunk c (the rows destined for rank c); all
    chunks share a shape and dtype. The running sum travels in that dtype and is added in FP32.
    """
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    order = reduce_scatter_order(rank, world_size)
    running = produce(order[0]).contiguous()
    for chunk in order[1:]:
        incoming = torch.empty_like(running)
        works = _exchange([running], [incoming], group, world_size, rank)
        partial = produce(chunk)            # computed while the running sum travels
        for work in works:
            work.wait()
        running = (incoming.float() + partial.float()).to(partial.dtype)
    return running

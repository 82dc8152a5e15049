"""Gradient synchronisation of nvfp4-train: the data-parallel average (without --fsdp: FSDP2 reduce-scatters
the gradients itself) and the global-norm clip."""
from __future__ import annotations

import torch
import torch.distributed as dist

from nvfp4_dist.launch.sharding import local_tensor


def average_data_parallel_grads(model: torch.nn.Module, dp_group, dp_size: int) -> None:
    """Average every gradient across the data-parallel group (one flat all-reduce)."""
    if dp_size == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads]).div_(dp_size)
    dist.all_reduce(flat, group=dp_group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def clip_gradients(model: torch.nn.Module, max_norm: float, tp_group, shard_group=None) -> float:
    """Clip by the global norm (max_norm 0: measure only); returns the norm before clipping.

    TP-sharded parameters' squared norms are summed across the TP group; replicated ones count once.
    shard_group: the data-parallel group over which FSDP2 shards every gradient (--fsdp), whose ranks' squared
    norms of their shards are summed first; None when each rank holds whole gradients.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [local_tensor(p.grad) for p in params]
    sharded = [g.float().pow(2).sum() for p, g in zip(params, grads) if getattr(p, "tensor_model_parallel", False)]
    replicated = [g.float().pow(2).sum() for p, g in zip(params, grads)
                  if not getattr(p, "tensor_model_parallel", False)]
    zero = torch.zeros((), device=grads[0].device)
    sharded_sq = torch.stack(sharded).sum() if sharded else zero
    if shard_group is not None:
        replicated_sq = torch.stack(replicated).sum() if replicated else zero
        squares = torch.stack([sharded_sq, replicated_sq])
        dist.all_reduce(squares, group=shard_group)
        sharded_sq, replicated_sum = squares[0].clone(), squares[1]
    else:
        replicated_sum = torch.stack(replicated).sum() if replicated else 0.0
    dist.all_reduce(sharded_sq, group=tp_group)
    total = (sharded_sq + replicated_sum).sqrt()
    if max_norm > 0:
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
    return float(total)

"""Gradient synchronisation of nvfp4-train: the data-parallel average and the global-norm clip."""
from __future__ import annotations

import torch
import torch.distributed as dist


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


def clip_gradients(model: torch.nn.Module, max_norm: float, tp_group) -> float:
    """Clip by the global norm (max_norm 0: measure only); returns the norm before clipping.

    TP-sharded parameters' squared norms are summed across the TP group; replicated ones count once.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    sharded = [p.grad.float().pow(2).sum() for p in params if getattr(p, "tensor_model_parallel", False)]
    replicated = [p.grad.float().pow(2).sum() for p in params if not getattr(p, "tensor_model_parallel", False)]
    sharded_sq = torch.stack(sharded).sum() if sharded else torch.zeros((), device=params[0].grad.device)
    dist.all_reduce(sharded_sq, group=tp_group)
    total = (sharded_sq + (torch.stack(replicated).sum() if replicated else 0.0)).sqrt()
    if max_norm > 0:
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for p in params:
            p.grad.mul_(scale.to(p.grad.dtype))
    return float(total)

"""nvfp4-train's optimizer: AdamW (weight decay on matrices only) and its learning-rate schedule."""
from __future__ import annotations

import math

import torch


def make_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on the parameters of two or more dimensions, none on biases and norms."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def learning_rate(step: int, *, peak: float, minimum: float, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up to `peak` over warmup_steps, then cosine decay to `minimum` at total_steps."""
    if step <= warmup_steps:
        return peak * step / max(1, warmup_steps)
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return minimum + 0.5 * (peak - minimum) * (1 + math.cos(math.pi * min(1.0, progress)))

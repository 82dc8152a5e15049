"""CUDA graphs of models with NVFP4 layers (docs/cuda_graphs.md)."""
from __future__ import annotations

import torch

from nvfp4_dist import finite_check


def make_graphed_callables(callables, sample_args, **kwargs):
    """torch.cuda.make_graphed_callables for callables holding NVFP4 layers (same arguments and result).

    torch's warm-up runs backward on uninitialised output gradients (torch.empty_like), whose garbage the NaN/Inf
    check of the gradients' amaxes would report, later, as an error of the next step; here the warm-up's eager
    checks are skipped. The captured graphs check every replay (nvfp4_dist/finite_check.py).
    """
    with finite_check.suspended_outside_capture():
        return torch.cuda.make_graphed_callables(callables, sample_args, **kwargs)

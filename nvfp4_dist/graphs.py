"""CUDA graphs of models with NVFP4 layers (docs/cuda_graphs.md)."""
from __future__ import annotations

import contextlib

import torch

from nvfp4_dist import finite_check


@contextlib.contextmanager
def _thread_local_capture_mode():
    """torch.cuda.graph captures default to capture_error_mode="thread_local" inside the block.

    torch.cuda.make_graphed_callables captures in "global" mode, in which a potentially unsafe CUDA call made by any
    thread while the capture runs invalidates it. The captured backward runs on the autograd engine's device thread,
    which sets up its own per-thread state (library handles, workspaces) outside the captured stream on first use;
    "thread_local" leaves such calls of other threads alone and still refuses unsafe calls of the capturing one."""
    original = torch.cuda.graph.__init__

    def init(self, *args, **kwargs):
        kwargs.setdefault("capture_error_mode", "thread_local")
        original(self, *args, **kwargs)
    torch.cuda.graph.__init__ = init
    try:
        yield
    finally:
        torch.cuda.graph.__init__ = original


def make_graphed_callables(callables, sample_args, **kwargs):
    """torch.cuda.make_graphed_callables for callables holding NVFP4 layers (same arguments and result).

    torch's warm-up runs backward on uninitialised output gradients (torch.empty_like), whose garbage the NaN/Inf
    check of the gradients' amaxes would report, later, as an error of the next step; here the warm-up's eager
    checks are skipped. The captured graphs check every replay (nvfp4_dist/finite_check.py).
    Parameters without a .grad get a zero one: the graphed backward hands autograd its static gradient buffers,
    which a parameter with no .grad would take as its own, so the next replay would overwrite (and, with
    zero_grad(set_to_none=False), double) it. Keep them: zero_grad(set_to_none=False).
    The captures run in capture_error_mode "thread_local" (see _thread_local_capture_mode).
    """
    modules = callables if isinstance(callables, tuple) else (callables,)
    for module in modules:
        for parameter in (module.parameters() if isinstance(module, torch.nn.Module) else ()):
            if parameter.requires_grad and parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
    if torch.cuda.is_available():
        finite_check.reserve_records()  # the warm-up's suspended checks reserve none
    with finite_check.suspended_outside_capture(), _thread_local_capture_mode():
        return torch.cuda.make_graphed_callables(callables, sample_args, **kwargs)

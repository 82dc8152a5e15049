"""The NaN/Inf check of quantized amaxes (recipe.check_finite, docs/numerics.md §2), without a host sync per call on CUDA.

On the CPU an amax is checked at once. On CUDA, reading it would make the host wait for the GPU at every
quantize (the host could never run ahead of the kernels, and the overlapped layers' transfers could not be
queued early): instead each check copies the amaxes' maxima to pinned host memory behind an event, and
the error is raised by the first later check (or raise_pending_nonfinite()) that sees the copy landed.
At most MAX_PENDING checks wait; beyond that the oldest is waited for.
"""
from __future__ import annotations

import collections
import math

import torch

MAX_PENDING = 64


class NonFiniteAmaxError(ValueError):
    """A tensor's amax is NaN or Inf: its input holds NaN/Inf (recipe.check_finite)."""


def _error(name: str, value: float, deferred: bool) -> NonFiniteAmaxError:
    when = (" (checked asynchronously: an earlier quantize call on the GPU; "
            "nvfp4_dist.raise_pending_nonfinite() waits for the pending checks)") if deferred else ""
    return NonFiniteAmaxError(f"{name} is not finite ({value}): the input holds NaN or Inf{when}; pass a recipe with "
                              f"check_finite=False to quantize it anyway")


_pending: collections.deque = collections.deque()  # (event, pinned host maxima, names)


def _settle(wait: bool) -> None:
    """Look at the finished checks (all of them when wait) in order; raise for the first non-finite amax."""
    while _pending and (wait or len(_pending) > MAX_PENDING or _pending[0][0].query()):
        event, values, names = _pending.popleft()
        event.synchronize()
        for name, value in zip(names, values.tolist()):
            if not math.isfinite(value):
                _pending.clear()  # later checks belong to the step this error abandons
                raise _error(name, value, deferred=True)


def check_amaxes(amaxes: dict) -> None:
    """Raise NonFiniteAmaxError for a NaN/Inf among {name: amax tensor} (None entries skipped): at once for
    CPU tensors; for CUDA tensors at a later check, without waiting for the GPU now."""
    present = {name: amax for name, amax in amaxes.items() if amax is not None}
    if not present:
        return
    if not next(iter(present.values())).is_cuda:
        for name, amax in present.items():
            if not bool(torch.isfinite(amax).all()):
                raise _error(name, amax.flatten()[:4].tolist(), deferred=False)
        return
    maxima = torch.stack([amax.reshape(()) if amax.numel() == 1 else amax.max() for amax in present.values()])
    values = torch.empty(maxima.shape, dtype=maxima.dtype, pin_memory=True)
    values.copy_(maxima, non_blocking=True)  # torch.max propagates NaN
    event = torch.cuda.Event()
    event.record()
    _pending.append((event, values, list(present)))
    _settle(wait=False)


def raise_pending_nonfinite() -> None:
    """Wait for every pending CUDA check and raise NonFiniteAmaxError if one found a NaN/Inf amax."""
    _settle(wait=True)

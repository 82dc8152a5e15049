"""The NaN/Inf check of quantized amaxes (recipe.check_finite, docs/numerics.md §2), without a host sync per call on CUDA.

A check hands over a small float32 tensor of values (amax maxima) and an `explain` function that turns their
host copy into an error message, or None when they are fine. On the CPU the values are explained at once. On
CUDA, reading them would make the host wait for the GPU at every quantize (the host could never run ahead of
the kernels, and the overlapped layers' transfers could not be queued early): instead each check copies the
values to pinned host memory behind an event, and the error is raised by the first later check (or
raise_pending_nonfinite()) that sees the copy landed. At most MAX_PENDING checks wait; beyond that the
oldest is waited for.

operand_values / explain_operands describe the amaxes of quantized tensors: which tensor (x, the input, the
weight or the gradient of a layer), which copy, whether it holds NaN/Inf or is finite but overflows in the
random Hadamard transform (its rowwise amax finite, its RHT copy's not), and, across a tensor-parallel group,
whether this rank's shard or another rank's is at fault.
"""
from __future__ import annotations

import collections
import math
from typing import Callable

import torch

from nvfp4_dist.tensor import NVFP4Tensor

MAX_PENDING = 64


class NonFiniteAmaxError(ValueError):
    """A tensor's amax is NaN or Inf: it holds NaN/Inf, or overflows in the RHT (recipe.check_finite)."""


_DEFERRED = (" (checked asynchronously: an earlier quantize call on the GPU; nvfp4_dist.raise_pending_nonfinite() "
             "waits for the pending checks)")
_ADVICE = "; pass a recipe with check_finite=False to quantize it anyway"

_pending: collections.deque = collections.deque()  # (event, pinned host values, explain)


def _settle(wait: bool) -> None:
    """Explain the finished checks (all of them when wait) in order; raise for the first that finds a problem."""
    while _pending and (wait or len(_pending) > MAX_PENDING or _pending[0][0].query()):
        event, values, explain = _pending.popleft()
        event.synchronize()
        message = explain(values.tolist())
        if message is not None:
            _pending.clear()  # later checks belong to the step this error abandons
            raise NonFiniteAmaxError(message + _DEFERRED + _ADVICE)


def check(values: torch.Tensor, explain: Callable[[list], str | None]) -> None:
    """Raise NonFiniteAmaxError(explain(values as floats)) when explain returns a message: at once for CPU
    tensors; for CUDA tensors at a later check, without waiting for the GPU now."""
    values = values.detach().reshape(-1).to(torch.float32)
    if not values.is_cuda:
        message = explain(values.tolist())
        if message is not None:
            raise NonFiniteAmaxError(message + _ADVICE)
        return
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    _pending.append((event, host, explain))
    _settle(wait=False)


def raise_pending_nonfinite() -> None:
    """Wait for every pending CUDA check and raise NonFiniteAmaxError if one found a NaN/Inf amax."""
    _settle(wait=True)


def _maximum(amax: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """max of an amax tensor (NaN if any entry is NaN), 0 when absent or empty."""
    if amax is None or amax.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=device)
    return amax.detach().reshape(()) if amax.numel() == 1 else amax.detach().max()


def has_amax(q: NVFP4Tensor | None) -> bool:
    return q is not None and (q.amax_rowwise is not None or q.amax_columnwise is not None)


def operand_values(q: NVFP4Tensor) -> torch.Tensor:
    """(max rowwise amax, max columnwise amax) of q (which has at least one) as float32 [2]; an absent copy gives 0."""
    device = (q.amax_rowwise if q.amax_rowwise is not None else q.amax_columnwise).device
    return torch.stack([_maximum(q.amax_rowwise, device), _maximum(q.amax_columnwise, device)]).to(torch.float32)


def _cause(row: float, rht: bool, has_row: bool) -> str:
    """Why a tensor's amaxes are not finite: NaN/Inf in it, or an RHT overflow of a finite tensor."""
    if rht and has_row and math.isfinite(row):
        return ("the tensor is finite, but its random Hadamard transform (docs/numerics.md §5) overflows FP32 "
                "(values near the float maximum); scale it down or use a recipe with rht=False")
    if rht and not has_row:
        return "the tensor holds NaN or Inf, or its random Hadamard transform (docs/numerics.md §5) overflows FP32"
    return "the tensor holds NaN or Inf"


def explain_operands(specs: list, values: list, local: list | None = None, group: str = "") -> str | None:
    """The message for the first operand with a non-finite amax, or None.

    specs: (label, rht, has_rowwise, has_columnwise) per operand (see spec()), in the order of values: two per
    operand, its rowwise and columnwise amax maxima. local: this rank's own values where `values` were reduced
    (MAX) over a group, which `group` names in messages ("tensor-parallel rank"); None entries for operands
    whose own values are not known (amaxes reduced before quantizing).
    """
    for index, (label, rht, has_row, has_col) in enumerate(specs):
        row, col = values[2 * index], values[2 * index + 1]
        if all(math.isfinite(value) for value, present in ((row, has_row), (col, has_col)) if present):
            continue
        where = f" on some {group}" if local is not None else ""
        if local is not None and local[2 * index] is not None:
            own_row, own_col = local[2 * index], local[2 * index + 1]
            if math.isfinite(own_row) and math.isfinite(own_col):
                where = f" on another {group} (this rank's shard is finite)"
            else:
                row, col, where = own_row, own_col, f" on this {group}"
        present = [(name, value) for name, value, has in (("amax_rowwise", row, has_row),
                                                          ("amax_columnwise", col, has_col)) if has]
        first = next(name for name, value in present if not math.isfinite(value))
        amaxes = ", ".join(f"{name}={value}" for name, value in present)
        return f"{label}: {first} is not finite ({amaxes}){where}: {_cause(row, rht, has_row)}"
    return None


def spec(label: str, q: NVFP4Tensor) -> tuple:
    """explain_operands' description of the quantized tensor q, called `label` in messages."""
    return (label, q.rht and q.has_columnwise, q.amax_rowwise is not None, q.amax_columnwise is not None)


def check_operands(operands: dict) -> None:
    """Check the amaxes of {label: NVFP4Tensor or None} on this process alone (no group)."""
    present = {label: q for label, q in operands.items() if has_amax(q)}
    if not present:
        return
    specs = [spec(label, q) for label, q in present.items()]
    values = torch.cat([operand_values(q) for q in present.values()])
    check(values, lambda host: explain_operands(specs, host))


def check_amaxes(amaxes: dict, label: str = "the input") -> None:
    """Check {name: amax tensor or None} of one tensor, called `label` in messages (no group)."""
    present = {name: amax for name, amax in amaxes.items() if amax is not None and amax.numel()}
    if not present:
        return
    names = list(present)
    values = torch.stack([_maximum(amax, amax.device) for amax in present.values()]).to(torch.float32)

    def explain(host):
        bad = [f"{name}={value}" for name, value in zip(names, host) if not math.isfinite(value)]
        return f"{label}: {bad[0].split('=')[0]} is not finite ({', '.join(bad)}): the tensor holds NaN or Inf" if bad \
            else None
    check(values, explain)

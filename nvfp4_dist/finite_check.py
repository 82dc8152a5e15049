"""The NaN/Inf check of quantized amaxes (recipe.check_finite, docs/numerics.md §2), without a host sync per call on CUDA.

A check hands over a small float32 tensor of values (amax maxima) and an `explain` function that turns their
host copy into an error message, or None when they are fine. On the CPU the values are explained at once. On
CUDA, reading them would make the host wait for the GPU at every quantize (the host could never run ahead of
the kernels, and the overlapped layers' transfers could not be queued early): instead each check copies the
values to pinned host memory behind an event, and the error is raised by the first later check (or
raise_pending_nonfinite()) that sees the copy landed. At most MAX_PENDING checks wait; beyond that the
oldest is waited for (a bound on memory the host never reaches in practice: the GPU's launch queue stops it first).

Inside a CUDA graph capture a check launches a kernel that folds its values into a slice of pinned host memory
(replays run no Python, so nothing could explain them at once): the first NaN/Inf of any replay stays there. The
host reads those records without waiting for the GPU at every optimizer step (a pre-step hook, so the step that
would apply the bad gradients is refused when the GPU got there first) and at every eager check, and raises naming
the check as an eager call would; raise_pending_nonfinite() waits for the GPU, then reads both kinds.

operand_values / explain_operands describe the amaxes of quantized tensors: which tensor (x, the input, the
weight or the gradient of a layer), which copy, whether it holds NaN/Inf or is finite but overflows in the
random Hadamard transform (its rowwise amax finite, its RHT copy's not), and, across a tensor-parallel group,
whether this rank's shard or another rank's is at fault.
"""
from __future__ import annotations

import collections
import contextlib
import math
from typing import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from nvfp4_dist.tensor import NVFP4Tensor

MAX_PENDING = 4096


class NonFiniteAmaxError(ValueError):
    """A tensor's amax is NaN or Inf: it holds NaN/Inf, or overflows in the RHT (recipe.check_finite)."""


_DEFERRED = (" (checked asynchronously: an earlier quantize call on the GPU; nvfp4_dist.raise_pending_nonfinite() "
             "waits for the pending checks)")
_ADVICE = "; pass a recipe with check_finite=False to quantize it anyway"

_pending: collections.deque = collections.deque()  # (event, pinned host values, explain)


def _settle(wait: bool) -> None:
    """Explain the finished checks (all of them when wait) in order; raise for the first that finds a problem."""
    while _pending:
        event, values, explain = _pending[0]
        if wait or len(_pending) > MAX_PENDING:
            event.synchronize()
        elif not event.query():
            break
        _pending.popleft()
        message = explain(values.tolist())
        if message is not None:
            _pending.clear()  # later checks belong to the step this error abandons
            raise NonFiniteAmaxError(message + _DEFERRED + _ADVICE)


class _CapturedChecks:
    """The checks recorded inside CUDA graph captures: per check, a slice of a pinned host record that each replay
    folds its values into (csrc/nonfinite_record.cu keeps the first NaN/Inf of every entry) and `explain`. The
    host reads the record whenever it likes, without waiting for the GPU."""

    POOL_VALUES = 4096  # pinned floats allocated at a time (before capture: pinned allocation is not capturable)

    def __init__(self):
        self.pool, self.used = None, 0
        self.slots: list = []  # (record slice, explain)
        self.hook = None

    def reserve(self) -> None:
        """Allocate the pinned pool ahead of any capture (called by every eager CUDA check)."""
        if self.pool is None or self.used > self.POOL_VALUES // 2:
            self.pool, self.used = torch.zeros(self.POOL_VALUES, dtype=torch.float32, pin_memory=True), 0

    def record(self, values: torch.Tensor, explain: Callable[[list], str | None]) -> None:
        if self.pool is None or self.used + values.numel() > self.pool.numel():
            raise RuntimeError("a NaN/Inf check inside a CUDA graph capture found no free pinned record: run the "
                               "captured layers once eagerly before capturing them (warm-up), as "
                               "torch.cuda.make_graphed_callables does")
        record = self.pool[self.used:self.used + values.numel()]
        self.used += values.numel()
        from nvfp4_dist._extension import load_extension, stream_handle
        load_extension().record_nonfinite(values.contiguous(), record, stream_handle(values.device))
        self.slots.append((record, explain))
        if self.hook is None:
            self.hook = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: self.settle(wait=False))

    def settle(self, wait: bool) -> None:
        """Raise for the first captured check whose record holds a NaN/Inf (after the GPU's queued work when
        `wait`), and clear the records."""
        if not self.slots or torch.cuda.is_current_stream_capturing():
            return
        if wait:
            torch.cuda.synchronize()
        for record, explain in self.slots:
            values = record.tolist()
            if all(math.isfinite(value) for value in values):
                continue
            message = explain(values)
            for other, _ in self.slots:
                other.zero_()  # reported once; later replays record their own values
            if message is not None:
                raise NonFiniteAmaxError(message + _CAPTURED + _ADVICE)


_captured = _CapturedChecks()
_CAPTURED = (" (checked inside a CUDA graph replay, read at a later optimizer step, eager check or "
             "nvfp4_dist.raise_pending_nonfinite())")


_suspended = 0  # > 0: eager checks are skipped (suspended_outside_capture)


@contextlib.contextmanager
def suspended_outside_capture():
    """Skip the checks of eager calls (those inside a CUDA graph capture are still recorded): for warm-up steps
    that run backward on uninitialised output gradients (torch.cuda.make_graphed_callables)."""
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1


def check(values: torch.Tensor, explain: Callable[[list], str | None]) -> None:
    """Raise NonFiniteAmaxError(explain(values as floats)) when explain returns a message: at once for CPU
    tensors; for CUDA tensors at a later check, without waiting for the GPU now."""
    if _suspended and not (values.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    values = values.detach().reshape(-1).to(torch.float32)
    if not values.is_cuda:
        message = explain(values.tolist())
        if message is not None:
            raise NonFiniteAmaxError(message + _ADVICE)
        return
    if torch.cuda.is_current_stream_capturing():
        _captured.record(values, explain)
        return
    _captured.reserve()
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    _pending.append((event, host, explain))
    _settle(wait=False)
    _captured.settle(wait=False)


def raise_pending_nonfinite() -> None:
    """Wait for every pending CUDA check, and for the values of the checks captured in CUDA graphs as their last
    replays left them; raise NonFiniteAmaxError if one found a NaN/Inf amax."""
    _settle(wait=True)
    _captured.settle(wait=True)


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

"""The NaN/Inf check of quantized amaxes (recipe.check_finite, docs/numerics.md §2), without a host sync per call on CUDA.

On the CPU a check's values are explained at once. On CUDA, reading them would make the host wait for the GPU at
every quantize (the host could never run ahead of the kernels, and the overlapped layers' transfers could not be
queued early), so the error is raised later, by a check (or optimizer step) that finds it landed:
- A layer's operand check (check_operands) launches one kernel on the amax tensors that folds them into a record in
  pinned host memory (_Records; csrc/nonfinite_record.cu): the values of the first call that found a NaN/Inf, and a
  flag. The host reads the flags at every check and, through a pre-step hook, at every optimizer step (so that a
  step whose gradients the GPU already found non-finite is refused), without waiting for the GPU. Inside a CUDA
  graph capture every check records this way, into a record of its own that each replay folds into.
- Other checks (check(values, explain): given amaxes, tensor-parallel groups) copy their values to pinned host memory
  behind an event, explained once the copy landed. At most MAX_PENDING wait; beyond that the oldest is waited for
  (a bound the host never reaches in practice: the GPU's launch queue stops it first).
raise_pending_nonfinite() waits for the GPU, then reads both kinds.

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
MAX_RECORD_VALUES = 32  # the values one record kernel folds (csrc/nvfp4_kernels.h kMaxCheckedValues)


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


class _Records:
    """Pinned host records that a kernel (csrc/nonfinite_record.cu) folds a check's values into: per record, the
    values of the first call that found one not finite, and a flag; one more flag says any record holds one. The
    host reads the flags whenever it likes, without waiting for the GPU.

    A keyed check (an eager call of a layer's operand check: the same labels each call) reuses its record; a check
    inside a CUDA graph capture gets one of its own, which every replay folds into.
    """

    CHUNK = 16384  # pinned floats allocated at a time, before any capture (pinned allocation is not capturable)

    def __init__(self):
        self.pool = self.any = None
        self.used = 0
        self.keyed: dict = {}
        self.records: list = []  # [record tensor, its numpy view, explain]
        self.hook = None

    def reserve(self) -> None:
        """Allocate pinned memory ahead of any capture (every eager CUDA check calls this)."""
        if self.any is None:
            self.any = torch.zeros(1, dtype=torch.float32, pin_memory=True)
            self.any_view = self.any.numpy()
        if self.pool is None or self.used > self.CHUNK // 2:
            self.pool, self.used = torch.zeros(self.CHUNK, dtype=torch.float32, pin_memory=True), 0

    def _new_record(self, values: int, explain) -> list:
        if self.pool is None or self.used + values + 1 > self.CHUNK:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("a NaN/Inf check inside a CUDA graph capture found no free pinned record: run the "
                                   "captured layers once eagerly before capturing them (warm-up), as "
                                   "torch.cuda.make_graphed_callables does")
            self.pool, self.used = None, 0
            self.reserve()
        record = self.pool[self.used:self.used + values + 1]
        self.used += values + 1
        entry = [record, record.numpy(), explain]
        self.records.append(entry)
        if self.hook is None:
            self.hook = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: self.settle(wait=False))
        return entry

    def record(self, tensors: list, per_entry: bool, explain: Callable[[list], str | None], key=None) -> None:
        """Queue the kernel that folds the check's values into its record (see csrc/nonfinite_record.cu)."""
        from nvfp4_dist._extension import load_extension, stream_handle
        capturing = torch.cuda.is_current_stream_capturing()
        if not capturing:
            self.reserve()
        values = tensors[0].numel() if per_entry else len(tensors)
        if key is None or capturing:
            entry = self._new_record(values, explain)
        else:
            entry = self.keyed.get((key, values))
            if entry is None:
                entry = self.keyed[(key, values)] = self._new_record(values, explain)
            entry[2] = explain
        load_extension().record_check(tensors, per_entry, entry[0], self.any, stream_handle(tensors[0].device))

    def settle(self, wait: bool) -> None:
        """Raise for the first record holding a NaN/Inf (after the GPU's queued work when `wait`), clearing them all."""
        if self.any is None or torch.cuda.is_current_stream_capturing():
            return
        if wait:
            torch.cuda.synchronize()
        if self.any_view[0] == 0:
            return
        self.any_view[0] = 0
        found = [entry for entry in self.records if entry[1][-1] != 0]
        for entry in found:
            entry[1][-1] = 0  # reported once; later calls and replays record their own values
        for _, view, explain in found:
            message = explain(view[:-1].tolist())
            if message is not None:
                raise NonFiniteAmaxError(message + _RECORDED + _ADVICE)


_records = _Records()


def reserve_records() -> None:
    """Allocate the pinned records that checks inside a CUDA graph capture take (pinned allocation cannot be
    captured): call before capturing graphs whose warm-up ran with the eager checks suspended."""
    _records.reserve()


def _settle_all(wait: bool) -> None:
    """Both kinds of pending check: the event-backed copies (_settle), then the pinned records (_Records)."""
    _settle(wait)
    _records.settle(wait)


_RECORDED = (" (checked on the GPU without waiting for it, reported at a later check or optimizer step or by "
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


def check(values: torch.Tensor, explain: Callable[[list], str | None], key=None) -> None:
    """Raise NonFiniteAmaxError(explain(values as floats)) when explain returns a message: at once for CPU
    tensors; for CUDA tensors at a later check, without waiting for the GPU now.

    key: a hashable name of the check that is the same at every call of one call site with the same meaning of
    its values (a layer's operand check): its CUDA values then fold into a record of their own (_Records), which
    costs one kernel and no host copy; without a key they are copied to the host behind an event."""
    capturing = values.is_cuda and torch.cuda.is_current_stream_capturing()
    if _suspended and not capturing:
        return
    values = values.detach().reshape(-1).to(torch.float32)
    if not values.is_cuda:
        message = explain(values.tolist())
        if message is not None:
            raise NonFiniteAmaxError(message + _ADVICE)
        return
    if capturing or key is not None:
        count = values.numel()
        for start in range(0, count, MAX_RECORD_VALUES):  # one record per kernel's worth of values
            def explain_part(recorded, start=start):
                padded = [0.0] * count  # the other records' values read as finite here
                padded[start:start + len(recorded)] = recorded
                return explain(padded)
            _records.record([values[start:start + MAX_RECORD_VALUES].contiguous()], True, explain_part,
                            key=None if key is None else (key, start))
        if not capturing:
            _settle_all(wait=False)
        return
    _records.reserve()
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    _pending.append((event, host, explain))
    _settle_all(wait=False)


def raise_pending_nonfinite() -> None:
    """Wait for every pending CUDA check, and for the values of the checks captured in CUDA graphs as their last
    replays left them; raise NonFiniteAmaxError if one found a NaN/Inf amax."""
    _settle_all(wait=True)


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
    first = next(iter(present.values()))
    if (first.amax_rowwise if first.amax_rowwise is not None else first.amax_columnwise).is_cuda:
        if _suspended and not torch.cuda.is_current_stream_capturing():
            return
        # One kernel on the amax tensors themselves, into the record of these labels (see _Records).
        slots, tensors = [], []
        for index, q in enumerate(present.values()):
            for copy, amax in enumerate((q.amax_rowwise, q.amax_columnwise)):
                if amax is not None and amax.numel():
                    slots.append(2 * index + copy)
                    tensors.append(amax if amax.is_contiguous() else amax.reshape(-1).contiguous())

        for start in range(0, len(tensors), MAX_RECORD_VALUES):  # one record per kernel's worth of values
            part = slots[start:start + MAX_RECORD_VALUES]

            def explain(recorded, part=part):
                values = [0.0] * (2 * len(specs))  # the other records' operands read as finite here
                for slot, value in zip(part, recorded):
                    values[slot] = value
                return explain_operands(specs, values)
            _records.record(tensors[start:start + MAX_RECORD_VALUES], False, explain, key=(tuple(specs), start))
        if not torch.cuda.is_current_stream_capturing():  # no host reads inside a capture
            _settle_all(wait=False)
        return
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
    check(values, explain, key=("amaxes", label, tuple(names)))

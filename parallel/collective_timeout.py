"""A layer's collective that did not complete in its group's timeout, told as what it was and who was missing.

Gloo reports a timeout as "Timed out waiting 1800000ms for recv operation to complete", naming neither the layer,
the group nor the rank that never came. parallel/collectives.py runs each collective through guarded(); a timeout
then raises CollectiveTimeoutError naming:
- the layer: found on the Python stack when the failure happens (its forward, its autograd Function's forward or
  backward, or a check given its name), so that the normal path pays nothing for it;
- the operation, and the group's global ranks;
- the ranks that did not arrive, where the job's key-value store can tell: each rank that times out writes its
  arrival under a key of the group and of the collective's sequence number (collectives issued on the group by
  this module, the same count on every rank of a program that agrees), then waits up to ARRIVAL_GRACE_S for the
  others' keys. A rank still missing then did not reach that collective (or is too far behind to tell).
"""
from __future__ import annotations

import logging
import sys
import time

import torch.distributed as dist

from nvfp4_dist.linear import describe_layer

ARRIVAL_GRACE_S = 5.0
KEY_PREFIX = "nvfp4_dist/collective_timeout"
_TIMEOUT_WORDS = ("timed out", "timeout")

log = logging.getLogger("nvfp4_dist")
_issued: dict = {}  # group name -> collectives issued on it through guarded()


class CollectiveTimeoutError(RuntimeError):
    """A collective of a tensor-parallel layer did not complete within its process group's timeout."""


def guarded(operation: str, group, call):
    """call() (which issues one collective of `operation` on `group`), with a timeout raised as
    CollectiveTimeoutError. Returns (call's result, wait) where wait(work) waits for an asynchronous work of the
    same collective under the same guard."""
    sequence = _next_sequence(group)

    def run(step):
        try:
            return step()
        except RuntimeError as error:
            if not any(word in str(error).lower() for word in _TIMEOUT_WORDS):
                raise
            raise timeout_error(operation, group, sequence, error) from error
    return run(call), lambda work: run(work.wait)


def _group_name(group) -> str:
    group = group if group is not None else dist.group.WORLD
    return getattr(group, "group_name", None) or "-".join(map(str, dist.get_process_group_ranks(group)))


def _next_sequence(group) -> int:
    name = _group_name(group)
    _issued[name] = _issued.get(name, 0) + 1
    return _issued[name]


def layer_on_stack() -> str | None:
    """The layer whose code is running, innermost first: a `layer_name` argument (the checks, the backward
    helpers), a LinearOptions (`options`, or `ctx.options` in backward), or a layer's own method (`self`)."""
    frame = sys._getframe(1)
    while frame is not None:
        local = frame.f_locals
        name = local.get("layer_name")
        if isinstance(name, str) and name:
            return name
        for holder in (local.get("options"), getattr(local.get("ctx"), "options", None)):
            if isinstance(getattr(holder, "layer_name", None), str):
                return holder.layer_name
        owner = local.get("self")
        if hasattr(owner, "tp_group") and hasattr(owner, "weight"):
            return describe_layer(owner)
        frame = frame.f_back
    return None


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def missing_ranks(group, sequence: int) -> list | None:
    """The global ranks of `group` that did not report arriving at its collective number `sequence` within
    ARRIVAL_GRACE_S (this rank reports its own arrival first); None when the store cannot tell."""
    store = _store()
    if store is None:
        return None
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    prefix = f"{KEY_PREFIX}/{_group_name(group)}/{sequence}"
    try:
        store.set(f"{prefix}/{dist.get_rank()}", "arrived")
        deadline = time.monotonic() + ARRIVAL_GRACE_S
        missing = list(ranks)
        while missing:
            missing = [rank for rank in missing if not store.check([f"{prefix}/{rank}"])]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    except (RuntimeError, ValueError) as error:  # the store itself failed
        log.warning("collective timeout: the store could not tell which ranks arrived (%s)", error)
        return None
    return missing


def timeout_error(operation: str, group, sequence: int, cause: BaseException) -> CollectiveTimeoutError:
    """The CollectiveTimeoutError of this rank's collective number `sequence` on `group`."""
    layer = layer_on_stack()
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    missing = missing_ranks(group, sequence)
    if missing is None:
        arrival = "which ranks did not arrive is unknown (no store to ask)"
    elif missing:
        arrival = (f"rank(s) {missing} did not arrive at it (no report from them {ARRIVAL_GRACE_S:.0f} s after this "
                   f"rank's timeout: not at this layer, or stuck before it)")
    else:
        arrival = "every rank arrived at it (a transport failure, or a rank that stalled inside it)"
    where = f"layer {layer}" if layer else "a collective outside any layer"
    return CollectiveTimeoutError(f"{where}: the {operation} over the tensor-parallel group of global ranks {ranks} "
                                  f"timed out on rank {dist.get_rank()}; {arrival}. ({cause})")

"""Tensor-parallel communication primitives (docs/numerics.md §9): plain functions over a torch.distributed group.

NCCL on GPUs, gloo on CPUs; no autograd inside. `group=None` is the default (world) group.
A collective that does not complete within its group's timeout raises CollectiveTimeoutError naming the layer,
the group and the ranks that did not arrive (parallel/collective_timeout.py).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from nvfp4_dist import ops
from nvfp4_dist.tensor import NVFP4Tensor
from nvfp4_dist.parallel import symmetric
from nvfp4_dist.parallel.collective_timeout import CollectiveTimeoutError, guarded  # noqa: F401 (re-exported)

# torch >= 2.13 renamed the single-tensor collectives; older releases only have the *_tensor names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def all_reduce_amax(amaxes: list, group=None, *, peer_memory: bool | None = None) -> list:
    """MAX-reduce the given amaxes (None entries skipped) across the group in place, as one collective.

    Issued before quantizing a tensor that will be gathered, so that every shard shares one global scale.
    NaN is sent as +inf (a MAX that drops NaN, as gloo's and fmax-based ones do, would hide a NaN shard):
    a non-finite amax on any rank gives +inf on every rank, which recipe.check_finite then reports.
    By default through NVLink peer memory when parallel/symmetric.py is enabled for the group and the
    amaxes fit its one-shot kernel (peer_memory=False forces NCCL; gloo on CPU).
    """
    present = [amax for amax in amaxes if amax is not None]
    if not present or group_size(group) == 1:
        return amaxes
    for amax in present:
        amax.nan_to_num_(nan=math.inf, posinf=math.inf)
    if peer_memory is None:
        peer_memory = (all(a.is_cuda and a.is_contiguous() for a in present)
                       and sum(a.numel() for a in present) <= symmetric.MAX_AMAXES and symmetric.enabled(group))
    if peer_memory:
        symmetric.all_reduce_max(present, group)
        return amaxes
    flat = torch.cat([amax.reshape(-1) for amax in present])
    guarded("all-reduce of amaxes", group, lambda: dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group))
    offset = 0
    for amax in present:
        amax.copy_(flat[offset:offset + amax.numel()].view_as(amax))
        offset += amax.numel()
    return amaxes


def _gathered_pieces(q: NVFP4Tensor) -> dict:
    """The storage tensors of q that differ between ranks, by field name."""
    names = []
    if q.has_rowwise:
        names += ["rowwise_data", "rowwise_scale"] + (["amax_rowwise"] if q.row_scaled else [])
    if q.has_columnwise:
        names += ["columnwise_data", "columnwise_scale"]
    return {name: getattr(q, name).contiguous() for name in names}


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8).reshape(-1) if tensor.dim() else tensor.reshape(1).view(torch.uint8)


_COLUMNWISE = ("columnwise_data", "columnwise_scale")


def _assemble(q: NVFP4Tensor, gathered: dict, world_size: int, swapped: bool = False) -> NVFP4Tensor:
    """The gathered NVFP4Tensor from per-field gathers [W * d0, ...] (rows of rank r at block r).

    swapped: the columnwise fields already arrive in (K, W, X) order (the symmetric-memory gather).
    """
    fields = dict(gathered)
    for name in _COLUMNWISE:
        if name in fields and not swapped:
            fields[name] = ops.swap_first_dims(fields[name], world_size)
    shape = torch.Size((q.shape[0] * world_size, *q.shape[1:]))
    return dataclasses.replace(q, shape=shape, **fields)


def _gather_packed(pieces: dict, group, world_size: int, async_op: bool):
    """One all-gather of a byte buffer holding every piece; returns (work, wait, unpack)."""
    packed = torch.cat([_as_bytes(t) for t in pieces.values()])
    out = torch.empty(world_size * packed.numel(), dtype=torch.uint8, device=packed.device)
    work, wait = guarded("NVFP4 all-gather", group,
                         lambda: _all_gather_single(out, packed, group=group, async_op=async_op))

    def unpack() -> dict:
        per_rank = out.view(world_size, packed.numel())
        result, offset = {}, 0
        for name, t in pieces.items():
            size = t.numel() * t.element_size()
            chunk = per_rank[:, offset:offset + size].contiguous().view(t.dtype)
            result[name] = chunk.reshape(world_size * t.shape[0], *t.shape[1:])
            offset += size
        return result
    return work, wait, unpack


def _gather_coalesced(pieces: dict, group, world_size: int, async_op: bool):
    """One grouped launch of per-piece all-gathers straight into their final buffers (NCCL); (work, wait, unpack)."""
    outputs = {name: torch.empty((world_size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
               for name, t in pieces.items()}

    def launch():
        with dist._coalescing_manager(group=group, async_ops=async_op) as manager:
            for name, t in pieces.items():
                _all_gather_single(_as_bytes(outputs[name]), _as_bytes(t), group=group)
        return manager if async_op else None
    work, wait = guarded("NVFP4 all-gather", group, launch)
    return work, wait, (lambda: outputs)


def all_gather_nvfp4(q: NVFP4Tensor, group=None, async_op: bool = False, *, packed: bool | None = None,
                     peer_memory: bool | None = None):
    """Gather the NVFP4 shards of a tensor split along its first dim, as NVFP4 (0.5625 bytes per element).

    Rowwise data/scales (and per-row amaxes of row-scaled tensors) concatenate along dim 0; columnwise
    data/scales are gathered and reordered with swap_first_dims ((W, K, X) -> (K, W, X)). Per-tensor
    amaxes must already be shared (all_reduce_amax before quantizing): the result then equals, byte for
    byte, quantizing the gathered tensor.
    Data and scales travel in one collective: by default through NVLink peer memory when
    parallel/symmetric.py is enabled for the group (one kernel, columnwise copies reordered on the way;
    peer_memory=False forces NCCL), else one grouped NCCL launch straight into the final buffers, or
    (packed=True, the default off NCCL) one all-gather of a byte buffer holding them all.
    async_op=True returns (handle or None, finish) where finish() waits and returns the NVFP4Tensor.
    """
    if not isinstance(q, NVFP4Tensor):
        raise ValueError(f"q must be an NVFP4Tensor, got {type(q).__name__}")
    world_size = group_size(group)
    if world_size == 1:
        return (None, lambda: q) if async_op else q
    pieces = _gathered_pieces(q)
    if peer_memory is None:
        peer_memory = not packed and all(t.is_cuda for t in pieces.values()) and symmetric.enabled(group)
    if peer_memory:
        gathered = _assemble(q, symmetric.all_gather(pieces, set(_COLUMNWISE), group), world_size, swapped=True)
        return (None, lambda: gathered) if async_op else gathered
    if packed is None:
        packed = dist.get_backend(group) != "nccl"
    gather = _gather_packed if packed else _gather_coalesced
    work, wait, collect = gather(pieces, group, world_size, async_op)

    def finish() -> NVFP4Tensor:
        if work is not None:
            wait(work)
        return _assemble(q, collect(), world_size)
    return (work, finish) if async_op else finish()


def all_gather_bf16(x: torch.Tensor, group=None, async_op: bool = False):
    """Concatenate the ranks' x along dim 0 (any dtype). async_op=True returns (work, finish)."""
    world_size = group_size(group)
    if world_size == 1:
        return (None, lambda: x) if async_op else x
    x = x.contiguous()
    out = torch.empty((world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    work, wait = guarded("all-gather", group, lambda: _all_gather_single(out, x, group=group, async_op=async_op))
    if not async_op:
        return out

    def finish() -> torch.Tensor:
        wait(work)
        return out
    return work, finish


def all_gather_stacked(x: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's x (the same shape and dtype on every rank) stacked as [W, *x.shape]."""
    x = x.contiguous()
    out = torch.empty((group_size(group), *x.shape), dtype=x.dtype, device=x.device)
    if group_size(group) == 1:
        return out.copy_(x.unsqueeze(0))
    guarded("all-gather", group, lambda: _all_gather_single(out.view(-1), x.view(-1), group=group))
    return out


def reduce_scatter_bf16(x: torch.Tensor, group=None, async_op: bool = False, out: torch.Tensor | None = None):
    """Sum x over the ranks and keep this rank's 1/W slice of dim 0 (partial GEMM outputs, docs/numerics.md §9).

    out: a contiguous tensor of the slice's shape and x's dtype to write it into (default: a new one).
    async_op=True returns (work or None, finish) where finish() waits and returns the slice.
    """
    world_size = group_size(group)
    if x.shape[0] % world_size:
        raise ValueError(f"x.shape={tuple(x.shape)}: dim 0 must be divisible by the group size {world_size}")
    shape = (x.shape[0] // world_size, *x.shape[1:])
    if out is not None and (tuple(out.shape) != shape or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"out: {tuple(out.shape)} {out.dtype} (contiguous: {out.is_contiguous()}), expected a "
                         f"contiguous {shape} {x.dtype}")
    work = None
    if world_size == 1:
        out = x if out is None else out.copy_(x)
    else:
        x = x.contiguous()
        out = torch.empty(shape, dtype=x.dtype, device=x.device) if out is None else out
        work, wait = guarded("reduce-scatter", group,
                             lambda: _reduce_scatter_single(out, x, group=group, async_op=async_op))
    if not async_op:
        return out

    def finish() -> torch.Tensor:
        if work is not None:
            wait(work)
        return out
    return work, finish


def all_reduce_bf16(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum x over the ranks (a new tensor when x is not contiguous, else x in place)."""
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    guarded("all-reduce", group, lambda: dist.all_reduce(x, group=group))
    return x


def split_first_dim(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's 1/W slice of dim 0 (no communication)."""
    world_size = group_size(group)
    if x.shape[0] % world_size:
        raise ValueError(f"x.shape={tuple(x.shape)}: dim 0 must be divisible by the group size {world_size}")
    return x.chunk(world_size, dim=0)[group_rank(group)].contiguous()


def split_last_dim(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's 1/W slice of the last dim (no communication)."""
    world_size = group_size(group)
    if x.shape[-1] % world_size:
        raise ValueError(f"x.shape={tuple(x.shape)}: the last dim must be divisible by the group size {world_size}")
    return x.chunk(world_size, dim=-1)[group_rank(group)].contiguous()


def all_gather_last_dim(x: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate the ranks' x along the last dim."""
    world_size = group_size(group)
    if world_size == 1:
        return x
    gathered = all_gather_bf16(x.movedim(-1, 0), group)
    return gathered.movedim(0, -1).contiguous()

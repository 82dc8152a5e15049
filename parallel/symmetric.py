"""One-shot collectives through NVLink peer memory (torch symmetric memory): the NCCL path's faster twin on one host.

One kernel (csrc/peer_gather.cu) copies this rank's shard into its own symmetric buffer and ends with a
barrier over the ranks' signal pads; a second pulls every rank's shard straight into the final layout.
Columnwise copies land already reordered, so swap_first_dims costs nothing. The amax MAX all-reduce is one
single-block kernel (publish, barrier, reduce). No NCCL, two launches per gather and one per amax.
The results are byte-identical to the NCCL path of parallel/collectives.py (tests_multigpu/test_symmetric_gpu.py).

Each buffer has two halves that alternate from call to call: a rank can write its next shard while a peer
still reads the previous one, because the barrier of the call in between orders them. All calls of a
group must run on one CUDA stream per rank (the layers' current stream).
Used when NVFP4_SYMMETRIC_MEMORY is not 0 or off, the group is NCCL on CUDA with 2 to 8 ranks on one host, and
symmetric memory can be set up; every rank takes the same decision (otherwise NCCL, with a log line).
"""
from __future__ import annotations

import logging
import math
import socket
import warnings

import torch
import torch.distributed as dist

from nvfp4_dist import environment
from nvfp4_dist._extension import load_extension, stream_handle

log = logging.getLogger("nvfp4_dist")

MAX_RANKS, MAX_PIECES, MAX_AMAXES = 8, 8, 8  # csrc/nvfp4_kernels.h: kMaxPeers, kMaxPeerPieces, kMaxPeerAmaxes
_ALIGN = 256                                  # bytes between pieces (keeps 16-byte vector access)
_MIN_DATA_BYTES = 16 * 2 ** 20                # first data half; grows by doubling
_CHANNEL = 1  # signal-pad channel of our barriers (torch's own symmetric-memory ops use channel 0)

_workspaces: dict = {}
_enabled: dict = {}


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _resolved(group):
    """The group object (the current default group for None: a re-initialised world gets new workspaces)."""
    return dist.group.WORLD if group is None else group


def _rendezvous(symm, buffer: torch.Tensor, group_name: str):
    """symm.rendezvous; torch releases before 2.9 first need the group registered (enable_symm_mem_for_group)."""
    try:
        return symm.rendezvous(buffer, group_name)
    except RuntimeError:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm.enable_symm_mem_for_group(group_name)
        return symm.rendezvous(buffer, group_name)


class SymmetricWorkspace:
    """A group's symmetric buffer: [amax half 0 | amax half 1 | data half 0 | data half 1], and the peers' addresses."""

    _AMAX_HALF = _ALIGN

    def __init__(self, group, data_bytes: int):
        from torch.distributed import _symmetric_memory as symm
        self.data_half_bytes = _round_up(max(data_bytes, 1), _ALIGN)
        total = 2 * self._AMAX_HALF + 2 * self.data_half_bytes
        self.buffer = symm.empty(total, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
        self.handle = _rendezvous(symm, self.buffer, group.group_name)
        self.rank, self.world_size = self.handle.rank, self.handle.world_size
        self.bases = [self.handle.get_buffer(r, (total,), torch.uint8).data_ptr() for r in range(self.world_size)]
        self.signal_pads = [self.handle.get_signal_pad(r).data_ptr() for r in range(self.world_size)]
        self.blocks_done = torch.zeros(1, dtype=torch.int32, device=self.buffer.device)  # peer_publish's counter
        self._amax_half = self._data_half = 0
        self.retired: list = []  # grown-out workspaces of this group, kept alive (see _workspace)
        self.views: dict = {}    # (rank, byte offset, shape, dtype) -> tensor view of that rank's buffer

    def next_amax_offset(self) -> int:
        offset = self._amax_half * self._AMAX_HALF
        self._amax_half ^= 1
        return offset

    def next_data_offset(self) -> int:
        offset = 2 * self._AMAX_HALF + self._data_half * self.data_half_bytes
        self._data_half ^= 1
        return offset

    def barrier_args(self) -> tuple:
        """(signal pads, channel, rank): the barrier arguments of the peer kernels."""
        return self.signal_pads, _CHANNEL, self.rank


_HOST_NAME_BYTES = 256  # a fixed-size record per rank: host names are at most 255 bytes (POSIX HOST_NAME_MAX)


def _same_host(group) -> bool:
    """Whether every rank runs on this host: each rank's host name as a fixed-size byte record (no pickles)."""
    name = socket.gethostname().encode()[:_HOST_NAME_BYTES]
    record = torch.zeros(_HOST_NAME_BYTES, dtype=torch.uint8)
    record[:len(name)] = torch.frombuffer(bytearray(name), dtype=torch.uint8)
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    gathered = torch.empty((dist.get_world_size(group), _HOST_NAME_BYTES), dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(gathered.view(-1), record.to(device), group=group)
    return bool((gathered == gathered[0]).all())


def enabled(group=None) -> bool:
    """Whether this group's collectives take the symmetric-memory path (one decision per group, the same on all ranks).
    Not inside a CUDA graph capture: there the collectives take NCCL (the same bytes), which graphs can hold."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    group = _resolved(group)
    if group in _enabled:
        return _enabled[group]
    key = group.group_name
    allowed = environment.SYMMETRIC_MEMORY.read()
    world_size = dist.get_world_size(group)
    usable = (allowed and torch.cuda.is_available() and dist.get_backend(group) == "nccl"
              and 2 <= world_size <= MAX_RANKS and _same_host(group))
    if usable:
        try:
            _workspaces[group] = SymmetricWorkspace(group, _MIN_DATA_BYTES)
            ok = 1
        except Exception as error:  # no peer access, no symmetric memory in this torch build, ...
            log.warning("symmetric memory unavailable for group %s (%s); using NCCL", key, error)
            ok = 0
        agreed = torch.tensor([ok], device="cuda", dtype=torch.int32)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        usable = bool(agreed.item())
        if not usable:
            _workspaces.pop(group, None)
    _enabled[group] = usable
    log.info("group %s (%d ranks): %s collectives", key, world_size, "symmetric-memory" if usable else "NCCL")
    return usable


def _workspace(group, data_bytes: int) -> SymmetricWorkspace:
    """The group's workspace with at least data_bytes per data half (a collective the first time it must grow).

    A grown-out workspace is kept alive (peers may still read it on their streams); sizes double, so the
    retired ones add up to less than the live one.
    """
    group = _resolved(group)
    workspace = _workspaces[group]
    if workspace.data_half_bytes < data_bytes:
        grown = SymmetricWorkspace(group, max(data_bytes, 2 * workspace.data_half_bytes))
        grown.retired = [*workspace.retired, workspace]
        workspace.retired = []
        _workspaces[group] = workspace = grown
    return workspace


def all_reduce_max(amaxes: list, group=None) -> None:
    """MAX-reduce up to 8 FP32 values (contiguous CUDA tensors) across the group, in place; one kernel."""
    flat = [amax.view(-1) for amax in amaxes]
    count = sum(t.numel() for t in flat)
    if not 1 <= count <= MAX_AMAXES or any(t.dtype != torch.float32 or not t.is_cuda for t in flat):
        raise ValueError(f"all_reduce_max takes 1 to {MAX_AMAXES} float32 CUDA values, got {count}")
    workspace = _workspace(group, 0)
    slot = workspace.next_amax_offset()
    values = [t.data_ptr() + 4 * i for t in flat for i in range(t.numel())]
    load_extension().peer_amax_all_reduce(values, [base + slot for base in workspace.bases],
                                          *workspace.barrier_args(), stream_handle())


def _publish(pieces: dict, group) -> tuple:
    """This rank's pieces into its next data half, then the barrier; returns (workspace, half offset, layout)."""
    if not 1 <= len(pieces) <= MAX_PIECES:
        raise ValueError(f"pieces: 1 to {MAX_PIECES} tensors, got {len(pieces)}")
    layout, total = {}, 0
    for name, t in pieces.items():
        if not t.is_cuda or not t.is_contiguous() or t.dim() == 0:
            raise ValueError(f"piece {name!r} must be a contiguous CUDA tensor with at least 1 dim")
        layout[name] = total
        total += _round_up(t.numel() * t.element_size(), _ALIGN)
    workspace = _workspace(group, total)
    half = workspace.next_data_offset()
    names = [name for name, t in pieces.items() if t.numel()]
    if names:
        own = workspace.bases[workspace.rank] + half
        load_extension().peer_publish([pieces[n].data_ptr() for n in names], [own + layout[n] for n in names],
                                      [pieces[n].numel() * pieces[n].element_size() for n in names],
                                      *workspace.barrier_args(), workspace.blocks_done.data_ptr(), stream_handle())
    return workspace, half, layout


def all_gather(pieces: dict, interleaved: set, group=None) -> dict:
    """Gather each contiguous CUDA tensor of `pieces` ([rows, ...] on every rank) along dim 0.

    Names in `interleaved` come back reordered as swap_first_dims does ((W, rows, X) -> (rows, W, X), as
    [rows, W * X]); the others as [W * rows, ...].
    """
    workspace, half, layout = _publish(pieces, group)
    world_size = workspace.world_size
    outputs = {name: torch.empty((t.shape[0], world_size * math.prod(t.shape[1:])) if name in interleaved
                                 else (world_size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
               for name, t in pieces.items()}
    names = [name for name, t in pieces.items() if t.numel()]
    if names:
        row_bytes = [pieces[n].numel() * pieces[n].element_size() // pieces[n].shape[0] for n in names]
        load_extension().peer_gather([[base + half + layout[n] for base in workspace.bases] for n in names],
                                     [outputs[n].data_ptr() for n in names], [pieces[n].shape[0] for n in names],
                                     row_bytes, [n in interleaved for n in names], workspace.rank, stream_handle())
    return outputs


# ----------------------------------------------------------------------------------------------------------
# The comm/GEMM overlap's two schedules (parallel/overlap.py) on copy engines: transfers are cudaMemcpyAsync
# between this rank's memory and a peer's symmetric buffer on a side stream, so they take no SMs from the
# GEMMs they overlap (NCCL's point-to-point kernels wait for SMs that a full-GPU GEMM holds).

_side_streams: dict = {}


def _side_stream() -> torch.cuda.Stream:
    device = torch.cuda.current_device()
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device=device)
    return _side_streams[device]


def _peer_view(workspace: SymmetricWorkspace, rank: int, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A `shape` tensor of `dtype` at byte `offset` of rank `rank`'s symmetric buffer (cached: training repeats shapes)."""
    key = (rank, offset, tuple(shape), dtype)
    view = workspace.views.get(key)
    if view is None:
        element_size = torch.empty((), dtype=dtype).element_size()
        view = workspace.views[key] = workspace.handle.get_buffer(rank, key[2], dtype, offset // element_size)
    return view


def all_gather_consume(local_chunk, consume, order: list, group=None) -> None:
    """parallel/overlap.py's ring_all_gather_consume contract: consume(chunk_tensors, source) for each source in
    `order` (this rank first); copy engines pull every peer's chunk in that order while consume() runs."""
    pieces = {str(i): t.contiguous() for i, t in enumerate(local_chunk)}
    workspace, half, layout = _publish(pieces, group)
    current, side = torch.cuda.current_stream(), _side_stream()
    side.wait_stream(current)
    pulls = []
    for source in order[1:]:
        received = {name: torch.empty_like(t) for name, t in pieces.items()}  # allocated on the consuming stream
        with torch.cuda.stream(side):
            for name, t in received.items():
                if t.numel():
                    t.copy_(_peer_view(workspace, source, half + layout[name], t.shape, t.dtype))
            done = torch.cuda.Event()
            done.record(side)
        pulls.append((source, list(received.values()), done))
    consume(list(pieces.values()), order[0])
    for source, received, done in pulls:
        current.wait_event(done)
        consume(received, source)


def reduce_scatter_produce(produce, order: list, group=None, during_last_transfer=None) -> torch.Tensor:
    """parallel/overlap.py's ring_reduce_scatter_produce contract: the sum over ranks of produce(chunk) for this
    rank's chunk. produce(c) for each c in `order` runs on the current stream; copy engines push each partial
    into rank c's buffer (this rank's slot) while the next one is produced (and during_last_transfer() runs
    while the last one is pushed); after a barrier each rank adds its W slots in FP32, in rank order, rounded
    once to the partials' dtype (deterministic)."""
    workspace = _workspaces[_resolved(group)]
    rank, world_size = workspace.rank, workspace.world_size
    current, side = torch.cuda.current_stream(), _side_stream()
    first = produce(order[0]).contiguous()
    slot_bytes = _round_up(first.numel() * first.element_size(), _ALIGN)
    workspace = _workspace(group, world_size * slot_bytes)
    half = workspace.next_data_offset()
    for step, chunk in enumerate(order):
        partial = first if step == 0 else produce(chunk).contiguous()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            _peer_view(workspace, chunk, half + rank * slot_bytes, partial.shape, partial.dtype).copy_(partial)
        partial.record_stream(side)
    if during_last_transfer is not None:
        during_last_transfer()
    current.wait_stream(side)
    load_extension().peer_barrier(*workspace.barrier_args(), stream_handle())  # every rank's pushes have landed
    slot_elements = slot_bytes // first.element_size()
    region = _peer_view(workspace, rank, half, (world_size * slot_elements,), first.dtype)
    slots = region.as_strided((world_size, first.numel()), (slot_elements, 1))
    return slots.sum(dim=0, dtype=torch.float32).to(first.dtype).view(first.shape)

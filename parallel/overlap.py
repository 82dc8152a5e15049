"""Communication/GEMM overlap on a ring (docs/numerics.md §9, "Overlap").

Two schedules, each over the ranks of a tensor-parallel group, with transfers issued before the GEMM that
does not depend on them, so the transfer of the next chunk runs while the current chunk's GEMM does. Where
parallel/symmetric.py is enabled for the group (one host, NVLink peers) the transfers are copy-engine
copies through symmetric memory, which take no SMs from the GEMMs; elsewhere (several hosts, gloo, or
NVFP4_SYMMETRIC_MEMORY=0) they are NCCL (or gloo) point-to-point transfers round the ring:

- ring_all_gather_consume: the all-gather feeding a GEMM. Every rank starts with its own chunk; at step i
  it consumes the chunk that came from rank (rank - i) mod W while passing it on to rank + 1.
- ring_reduce_scatter_produce: the reduce-scatter after a GEMM. At step i a rank computes the partial
  output of chunk (rank - i - 1) mod W, adds the running sum received from rank - 1 and passes it on;
  after W steps it holds the full sum of its own chunk.

On them, the pipelined GEMMs of the sequence-parallel NVFP4 layers, selected by
overlapped_comm(plain_comm):
- column-parallel forward: the quantized input's rowwise chunks (data + scales, + per-row amaxes when
  row-scaled) go round the ring and each chunk's fprop GEMM writes its rows of the output;
- row-parallel forward: the fprop GEMM runs per destination rank, its BF16 partials reduce-scattered
  round the ring;
- row-parallel backward: the quantized output gradient goes round the ring into the dgrad GEMM, its
  columnwise copy riding along for the wgrad GEMM that follows;
- column-parallel backward: the dgrad GEMM runs per destination rank into the reduce-scatter ring and the
  wgrad GEMM during the ring's last transfer; the input's columnwise copy is re-gathered by an asynchronous
  all-gather that the following row-parallel layer starts right before its own wgrad GEMM (InputRegathers),
  so that GEMM too runs with a transfer in flight (without such a row layer: issued before the dgrad ring).
The same four GEMMs also pipeline on split collectives (split_gathered_gemm, split_gemm_reduce_scatter): the
plain path's all-gather or reduce-scatter cut into row pieces, each piece one collective over every rank, all
issued at once so that the communication stream stays busy while the GEMMs of the pieces already there run
(a reduce-scatter piece's rows of every destination in one GEMM).
Where NCCL moves bytes without peer-to-peer (PCIe-class links, across nodes) its point-to-point ring transfers run
slower than its collectives, and split collectives hide the communication the ring cannot.
Which path a layer takes (plain, ring or split collectives) is _RingChoice's decision: a GEMM-size floor and,
with measured link speeds, parallel/link_speed.py's model.
The all-gather side is bit-identical to the plain path when the GEMM's rows do not depend on how many rows
it is given (reference backend, the fused Hopper kernel). The reduce-scatter side sums in ring order (FP32
adds, rounded to the output dtype each hop) on NCCL, or in rank order in FP32 rounded once on copy engines, or
as the plain path's collective does on split collectives: each, like the plain reduce-scatter, is within W-1
roundings of the exact sum.
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time
import weakref
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from nvfp4_dist import ops
from nvfp4_dist.environment import OVERLAP_TRANSPORTS
from nvfp4_dist.gemm import gemm, operand
from nvfp4_dist.linear import LinearComm
from nvfp4_dist.tensor import NVFP4Tensor
from nvfp4_dist.parallel import collectives
from nvfp4_dist.parallel import symmetric
from nvfp4_dist.parallel.layer_comm import ColumnParallelComm, RowParallelComm
from nvfp4_dist.parallel.link_speed import (LinkSpeed, RingLoad, known_link_speed, nvfp4_bytes, piece_fractions,
                                            set_link_speed)

log = logging.getLogger("nvfp4_dist")


def all_gather_order(rank: int, world_size: int) -> list[int]:
    """Source rank of the chunk consumed at each step of ring_all_gather_consume."""
    return [(rank - step) % world_size for step in range(world_size)]


def reduce_scatter_order(rank: int, world_size: int) -> list[int]:
    """Chunk whose partial output is produced at each step of ring_reduce_scatter_produce."""
    return [(rank - step - 1) % world_size for step in range(world_size)]


def _exchange(send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], group, world_size: int, rank: int):
    """Start sending `send` to the next rank and receiving `recv` from the previous one; returns the works."""
    next_rank = dist.get_global_rank(group, (rank + 1) % world_size) if group is not None else (rank + 1) % world_size
    prev_rank = dist.get_global_rank(group, (rank - 1) % world_size) if group is not None else (rank - 1) % world_size
    ops = [dist.P2POp(dist.isend, t, next_rank, group) for t in send]
    ops += [dist.P2POp(dist.irecv, t, prev_rank, group) for t in recv]
    return dist.batch_isend_irecv(ops)


def _on_copy_engines(tensors: Sequence[torch.Tensor], group) -> bool:
    """Whether the schedules run on copy engines through symmetric memory (parallel/symmetric.py) for this group."""
    return torch.cuda.is_available() and all(t.is_cuda for t in tensors) and symmetric.enabled(group)


def ring_all_gather_consume(local_chunk: Sequence[torch.Tensor], consume: Callable[[Sequence[torch.Tensor], int], None],
                            group=None) -> None:
    """Call consume(chunk_tensors, source_rank) for every rank's chunk, passing chunks round the ring.

    local_chunk: the tensors (for example packed data and scales) that make up this rank's chunk; every
    rank's chunk has the same shapes. The transfer of the next chunk is in flight during consume().
    """
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if _on_copy_engines(local_chunk, group):
        return symmetric.all_gather_consume(local_chunk, consume, all_gather_order(rank, world_size), group)
    current = [t.contiguous() for t in local_chunk]
    for step, source in enumerate(all_gather_order(rank, world_size)):
        works = []
        if step < world_size - 1:
            incoming = [torch.empty_like(t) for t in current]
            works = _exchange(current, incoming, group, world_size, rank)
        consume(current, source)
        for work in works:
            work.wait()
        if step < world_size - 1:
            current = incoming


def ring_reduce_scatter_produce(produce: Callable[[int], torch.Tensor], group=None,
                                during_last_transfer: Callable[[], None] | None = None) -> torch.Tensor:
    """Sum over ranks of produce(chunk) for this rank's chunk, with transfers overlapping produce().

    produce(c) returns this rank's partial output for chunk c (the rows destined for rank c); all
    chunks share a shape and dtype. The running sum travels in that dtype and is added in FP32, rounded once
    per hop (torch's BF16/FP16 add computes in FP32: one kernel, no FP32 copies).
    during_last_transfer: called once, after the last produce() and before waiting for the last transfer
    (work that does not depend on the sum, such as a wgrad GEMM, hides that transfer).
    """
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    order = reduce_scatter_order(rank, world_size)
    if _on_copy_engines([], group):
        return symmetric.reduce_scatter_produce(produce, order, group, during_last_transfer=during_last_transfer)
    running = produce(order[0]).contiguous()
    for step, chunk in enumerate(order[1:], start=2):
        incoming = torch.empty_like(running)
        works = _exchange([running], [incoming], group, world_size, rank)
        partial = produce(chunk)            # computed while the running sum travels
        if step == world_size and during_last_transfer is not None:
            during_last_transfer()
        for work in works:
            work.wait()
        running = torch.add(incoming, partial)
    if world_size == 1 and during_last_transfer is not None:
        during_last_transfer()
    return running


# ----------------------------------------------------------------------------------------------------------
# Pipelined NVFP4 GEMMs on the ring.

def rowwise_pieces(q: NVFP4Tensor) -> list:
    """What travels of q's rowwise copy: packed data, scales as bytes, and the per-row amaxes when row-scaled."""
    pieces = [q.rowwise_data, q.rowwise_scale.view(torch.uint8)]
    return pieces + [q.amax_rowwise] if q.row_scaled else pieces


def rowwise_chunk(q: NVFP4Tensor, pieces: Sequence[torch.Tensor]) -> NVFP4Tensor:
    """One rank's chunk of q (rowwise copy only) from its received pieces; per-tensor amaxes are shared."""
    data, scale = pieces[0], pieces[1].view(torch.float8_e4m3fn)
    amax = pieces[2] if q.row_scaled else q.amax_rowwise
    return dataclasses.replace(q, shape=torch.Size((data.shape[0], q.cols)), rowwise_data=data, rowwise_scale=scale,
                               amax_rowwise=amax, columnwise_data=None, columnwise_scale=None, amax_columnwise=None)


class ColumnwiseCarry:
    """The all-gather of a columnwise copy (a wgrad operand) riding along a rowwise ring, else done on demand.

    Rank r's columnwise block [K, M/2] lands in columns [r*M/2, (r+1)*M/2) of the gathered [K, W*M/2]: the
    same bytes as all_gather_nvfp4 (docs/numerics.md §9), with no swap_first_dims.
    """

    def __init__(self, local: NVFP4Tensor, group):
        if not local.has_columnwise:
            raise ValueError("local: ColumnwiseCarry needs an NVFP4Tensor with a columnwise copy")
        self.local, self.group = local, group
        self.gathered: NVFP4Tensor | None = None
        self._pending: Callable[[], NVFP4Tensor] | None = None

    def pieces(self) -> list:
        return [self.local.columnwise_data, self.local.columnwise_scale.view(torch.uint8)]

    def start(self, world_size: int) -> Callable[[Sequence[torch.Tensor], int], None]:
        """Allocate the gathered copy; returns place(pieces, source_rank) that stores one rank's block."""
        data, scale = self.local.columnwise_data, self.local.columnwise_scale.view(torch.uint8)
        gathered_data = data.new_empty((data.shape[0], world_size * data.shape[1]))
        gathered_scale = scale.new_empty((scale.shape[0], world_size * scale.shape[1]))
        shape = torch.Size((self.local.shape[0] * world_size, *self.local.shape[1:]))
        self.gathered = dataclasses.replace(self.local, shape=shape, columnwise_data=gathered_data,
                                            columnwise_scale=gathered_scale.view(torch.float8_e4m3fn))

        def place(pieces: Sequence[torch.Tensor], source: int) -> None:
            data_cols, scale_cols = pieces[0].shape[1], pieces[1].shape[1]
            gathered_data[:, source * data_cols:(source + 1) * data_cols].copy_(pieces[0])
            gathered_scale[:, source * scale_cols:(source + 1) * scale_cols].copy_(pieces[1])
        return place

    def start_collective(self) -> None:
        """Start gathering the copy in one asynchronous NCCL (or gloo) all-gather (split collectives carry it so)."""
        self._pending = collectives.all_gather_nvfp4(self.local, self.group, async_op=True, peer_memory=False)[1]

    def finish(self) -> NVFP4Tensor:
        """The gathered copy (gathered now by all_gather_nvfp4 when no ring or collective carried it)."""
        if self.gathered is None:
            pending, self._pending = self._pending, None
            self.gathered = pending() if pending is not None else collectives.all_gather_nvfp4(self.local, self.group)
        return self.gathered


def ring_gathered_gemm(a: NVFP4Tensor, b: NVFP4Tensor, *, b_copy: str, out_dtype: torch.dtype,
                       bias: torch.Tensor | None = None, recipe=None, group=None,
                       carry: ColumnwiseCarry | None = None) -> torch.Tensor:
    """gemm(all-gather of a along its rows, b) [W*M, N], each chunk's GEMM overlapping the next chunk's transfer.

    a: this rank's M rows (rowwise copy; per-tensor amax already shared over the group, or row-scaled).
    Rank r's chunk gives rows [r*M, (r+1)*M) of the preallocated output. carry: a columnwise copy gathered
    in the same transfers (its consumer calls carry.finish()).
    """
    world_size = dist.get_world_size(group)
    n = operand(b, b_copy, "b")[0].shape[0]
    rows = a.rows
    out = torch.empty((world_size * rows, n), dtype=out_dtype, device=a.device)
    pieces = rowwise_pieces(a)
    rowwise_count = len(pieces)
    place_columnwise = None
    if carry is not None:
        place_columnwise = carry.start(world_size)
        pieces += carry.pieces()

    def consume(tensors: Sequence[torch.Tensor], source: int) -> None:
        chunk = rowwise_chunk(a, tensors[:rowwise_count])
        gemm(chunk, b, a_copy="rowwise", b_copy=b_copy, out_dtype=out_dtype, bias=bias, recipe=recipe,
             out=out[source * rows:(source + 1) * rows])
        if place_columnwise is not None:
            place_columnwise(tensors[rowwise_count:], source)

    ring_all_gather_consume(pieces, consume, group)
    return out


def ring_gemm_reduce_scatter(a: NVFP4Tensor, b: NVFP4Tensor, *, b_copy: str, out_dtype: torch.dtype,
                             bias: torch.Tensor | None = None, recipe=None, group=None,
                             during_last_transfer: Callable[[], None] | None = None) -> torch.Tensor:
    """Reduce-scatter over the group of gemm(a, b) [M, N] -> [M/W, N], one destination's rows at a time.

    The GEMM of rows [c*M/W, (c+1)*M/W) (destined for rank c) runs while the running sum of the previous
    destination travels; sums are FP32 adds rounded to out_dtype at each hop. during_last_transfer: see
    ring_reduce_scatter_produce.
    """
    world_size = dist.get_world_size(group)
    if a.rows % world_size:
        raise ValueError(f"a.shape={tuple(a.shape)}: its {a.rows} rows must be divisible by the group size "
                         f"{world_size}")
    rows = a.rows // world_size

    def produce(chunk: int) -> torch.Tensor:
        return gemm(a.rowwise_rows(chunk * rows, (chunk + 1) * rows), b, a_copy="rowwise", b_copy=b_copy,
                    out_dtype=out_dtype, bias=bias, recipe=recipe)

    return ring_reduce_scatter_produce(produce, group, during_last_transfer)


# ----------------------------------------------------------------------------------------------------------
# Pipelined NVFP4 GEMMs on split collectives.

COLLECTIVE_PIECES = 4  # row pieces per split collective: the last piece's GEMM (or first piece's transfer) shows


def collective_pieces(rows: int, most: int = COLLECTIVE_PIECES) -> int:
    """Pieces that split collectives cut `rows` rows into: the most, up to `most`, of a whole number of 16-row
    blocks each (so 2D block scales never straddle two pieces); 1 when `rows` is not a multiple of 32."""
    return next(pieces for pieces in range(most, 0, -1) if pieces == 1 or rows % (16 * pieces) == 0)


def split_pieces(rows: int, ratio: float = 1.0, most: int = COLLECTIVE_PIECES) -> list:
    """Row counts of the collective_pieces(rows, most) pieces of `rows` rows, in the proportions
    piece_fractions(pieces, ratio) (piece j+1 = ratio x piece j; 1: equal pieces), each a whole number (at least
    one) of 16-row blocks, the blocks that rounding leaves handed out by largest remainder."""
    pieces = collective_pieces(rows, most)
    if pieces == 1:
        return [rows]
    blocks = rows // 16
    shares = [fraction * blocks for fraction in piece_fractions(pieces, ratio)]
    counts = [max(1, int(share)) for share in shares]
    while sum(counts) < blocks:
        counts[max(range(pieces), key=lambda j: shares[j] - counts[j])] += 1
    while sum(counts) > blocks:
        counts[max((j for j in range(pieces) if counts[j] > 1), key=lambda j: counts[j] - shares[j])] -= 1
    return [16 * count for count in counts]


def piece_bounds(rows: int, pieces: int | Sequence[int] | None) -> list:
    """[start, stop) of each row piece: `pieces` equal pieces (an int, default collective_pieces(rows)) or pieces
    of the given row counts (a sequence adding up to `rows`)."""
    if pieces is None:
        pieces = collective_pieces(rows)
    if isinstance(pieces, int):
        if pieces < 1 or rows % pieces:
            raise ValueError(f"pieces={pieces}: {rows} rows must split into a whole number of rows per piece")
        pieces = [rows // pieces] * pieces
    counts = list(pieces)
    if not counts or any(not isinstance(c, int) or c < 1 for c in counts) or sum(counts) != rows:
        raise ValueError(f"pieces={counts}: row counts must be positive integers adding up to {rows}")
    starts = [sum(counts[:j]) for j in range(len(counts))]
    return [(start, start + count) for start, count in zip(starts, counts)]


def start_piece_gathers(a: NVFP4Tensor, pieces: int | Sequence[int] | None = None, group=None) -> list:
    """Start the asynchronous all-gathers (NCCL or gloo) of a's rowwise copy in row pieces (piece_bounds(a.rows,
    pieces)), in order; returns each piece's finish() (the gathered rows [start, stop) of every rank)."""
    return [collectives.all_gather_nvfp4(a.rowwise_rows(start, stop), group, async_op=True, peer_memory=False)[1]
            for start, stop in piece_bounds(a.rows, pieces)]


def split_gathered_gemm(a: NVFP4Tensor, b: NVFP4Tensor, *, b_copy: str, out_dtype: torch.dtype,
                        bias: torch.Tensor | None = None, recipe=None, group=None,
                        carry: ColumnwiseCarry | None = None,
                        pieces: int | Sequence[int] | None = None) -> torch.Tensor:
    """ring_gathered_gemm's result on split collectives: all-gathers of row pieces (rows [start, stop) of every
    rank), all issued before the first GEMM. This rank's own rows go through one GEMM while the first piece
    travels; then each piece's GEMMs (one per other source rank, into its rows of the output) run as soon as it
    has arrived, while later pieces travel.

    pieces: an int (equal pieces; default collective_pieces(M)) or the pieces' row counts (split_pieces).
    carry: a columnwise copy gathered in one more collective after them.
    """
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    n = operand(b, b_copy, "b")[0].shape[0]
    rows = a.rows
    bounds = piece_bounds(rows, pieces)
    out = torch.empty((world_size * rows, n), dtype=out_dtype, device=a.device)
    arriving = start_piece_gathers(a, pieces, group)
    if carry is not None:
        carry.start_collective()
    gemm(a, b, a_copy="rowwise", b_copy=b_copy, out_dtype=out_dtype, bias=bias, recipe=recipe,
         out=out[rank * rows:(rank + 1) * rows])
    for (start, stop), finish in zip(bounds, arriving):
        gathered, piece_rows = finish(), stop - start
        for source in (source for source in range(world_size) if source != rank):
            first = source * rows + start
            gemm(gathered.rowwise_rows(source * piece_rows, (source + 1) * piece_rows), b, a_copy="rowwise",
                 b_copy=b_copy, out_dtype=out_dtype, bias=bias, recipe=recipe, out=out[first:first + piece_rows])
    return out


def split_gemm_reduce_scatter(a: NVFP4Tensor, b: NVFP4Tensor, *, b_copy: str, out_dtype: torch.dtype,
                              bias: torch.Tensor | None = None, recipe=None, group=None,
                              during_last_transfer: Callable[[], None] | None = None,
                              pieces: int | Sequence[int] | None = None) -> torch.Tensor:
    """ring_gemm_reduce_scatter's result on split collectives: piece j of every destination's rows (rows
    [c*R + start, c*R + stop) for rank c, R = M/W) is computed in one GEMM, then reduce-scattered in one collective
    while the next piece's GEMM runs; it lands in rows [start, stop) of this rank's output.

    pieces: an int (equal pieces; default collective_pieces(R)) or the pieces' row counts (split_pieces).
    during_last_transfer: called once after the last piece's GEMMs, before waiting for the reduce-scatters.
    """
    world_size = dist.get_world_size(group)
    if a.rows % world_size:
        raise ValueError(f"a.shape={tuple(a.shape)}: its {a.rows} rows must be divisible by the group size "
                         f"{world_size}")
    rows = a.rows // world_size
    bounds = piece_bounds(rows, pieces)
    n = operand(b, b_copy, "b")[0].shape[0]
    out = torch.empty((rows, n), dtype=out_dtype, device=a.device)
    in_flight = []  # (collective's handle, its input): the input lives until the collective is done
    for start, stop in bounds:
        # every destination's rows of the piece in one GEMM: the weight is read once, not once per destination
        piece = a.rowwise_row_ranges([(c * rows + start, c * rows + stop) for c in range(world_size)])
        partial = gemm(piece, b, a_copy="rowwise", b_copy=b_copy, out_dtype=out_dtype, bias=bias, recipe=recipe)
        work, _ = collectives.reduce_scatter_bf16(partial, group, async_op=True, out=out[start:stop])
        in_flight.append((work, partial))
    if during_last_transfer is not None:
        during_last_transfer()
    for work, _ in in_flight:
        if work is not None:
            work.wait()
    return out


# ----------------------------------------------------------------------------------------------------------
# The group's link speed (parallel/link_speed.py), measured on the rings and collectives the layers run.

# Device type: (all-gather chunk per rank [rows, cols], reduce-scatter chunk per rank, GEMM size). On GPUs the
# chunks are as large as a big layer's ring step (18 MiB of NVFP4, 16 MiB of BF16), where per-transfer latency no
# longer skews the ring against the collective; the GEMM has 137 GFLOP.
PROBE_SHAPES = {"cuda": ((4096, 8192), (2048, 4096), 4096), "cpu": ((32, 256), (32, 128), 128)}


def _median_ms(step: Callable[[], object], device: torch.device, repeats: int, group=None) -> float:
    """Median ms of step() over `repeats` runs after one warm-up; with a group, its ranks start each run together."""
    step()
    times = []
    for _ in range(repeats):
        if group is not None:
            dist.all_reduce(torch.zeros(1, device=device), group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            step()
            times.append((time.perf_counter() - began) * 1e3)
    return max(statistics.median(times), 1e-6)


def measure_link_speed(group=None, device=None, repeats: int = 5) -> LinkSpeed:
    """Time the group's rings (ring_all_gather_consume, ring_reduce_scatter_produce) against the plain path's
    collectives (all_gather_nvfp4, reduce_scatter_bf16) on PROBE_SHAPES' chunks, and the NVFP4 GEMM on `device`
    (default: the current GPU on NCCL, else the CPU); agreed over the ranks (LinkSpeed.agreed). A collective:
    every rank of the group calls it."""
    world_size = dist.get_world_size(group)
    if world_size < 2:
        raise ValueError(f"group of {world_size} rank: link speeds need at least 2 ranks")
    if device is None:
        on_gpu = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    device = torch.device(device)
    if device.type not in PROBE_SHAPES:
        raise ValueError(f"device={device}: link speeds are measured on {tuple(PROBE_SHAPES)} devices")
    (gather_rows, gather_cols), (scatter_rows, scatter_cols), size = PROBE_SHAPES[device.type]
    generator = torch.Generator(device=device).manual_seed(0)  # leaves torch's generators (SR seeds, dropout) alone

    def random(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.bfloat16)
    gathered = ops.quantize(random(gather_rows, gather_cols), "activation", columnwise=False)
    pieces = rowwise_pieces(gathered)
    partial = random(world_size * scatter_rows, scatter_cols)
    chunks = partial.chunk(world_size)
    probes = {"all_gather": lambda: collectives.all_gather_nvfp4(gathered, group),
              "ring_all_gather": lambda: ring_all_gather_consume(pieces, lambda tensors, source: None, group),
              "reduce_scatter": lambda: collectives.reduce_scatter_bf16(partial, group),
              "ring_reduce_scatter": lambda: ring_reduce_scatter_produce(lambda chunk: chunks[chunk], group)}
    ms = {name: _median_ms(step, device, repeats, group) for name, step in probes.items()}
    a = ops.quantize(random(size, size), "activation", columnwise=False)
    b = ops.quantize(random(size, size), "weight", columnwise=False)
    gemm_ms = _median_ms(lambda: gemm(a, b, out_dtype=torch.bfloat16), device, repeats)
    gather_mb = (world_size - 1) * nvfp4_bytes(gather_rows, gather_cols) / 2 ** 20  # what one rank receives
    scatter_mb = (world_size - 1) * scatter_rows * scatter_cols * 2 / 2 ** 20
    return LinkSpeed(all_gather_ms_per_mb=ms["all_gather"] / gather_mb,
                     ring_all_gather_ms_per_mb=ms["ring_all_gather"] / gather_mb,
                     reduce_scatter_ms_per_mb=ms["reduce_scatter"] / scatter_mb,
                     ring_reduce_scatter_ms_per_mb=ms["ring_reduce_scatter"] / scatter_mb,
                     gemm_ms_per_gflop=gemm_ms / ring_step_gflops(size, size, size)).agreed(group)


def group_link_speed(group, device: torch.device) -> LinkSpeed | None:
    """The group's LinkSpeed: set_link_speed's, else measured at the first call (every rank of the group makes
    it at the same point: the first forward that weighs a ring) and kept. None while a CUDA graph is being
    captured before any measurement (nothing can be timed inside a capture)."""
    speed = known_link_speed(group)
    if speed is not None:
        return speed
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        log.warning("overlap: no link speed measured for the group before CUDA graph capture; the GEMM-size floor "
                    "alone decides (run one forward before capturing)")
        return None
    speed = measure_link_speed(group, device)
    set_link_speed(group, speed)
    log.info("overlap: link speed of the %d-rank group: %s", dist.get_world_size(group), speed.describe())
    return speed


# ----------------------------------------------------------------------------------------------------------
# The overlapped communication of the tensor-parallel layers (sequence parallelism; without it they are the
# plain comms: the all-reduce paths are not pipelined). A layer pipelines only where one ring step's GEMM has at
# least min_chunk_gflops (recipe.overlap_min_chunk_gflops): each step costs host time (launches, Python) that a
# small GEMM cannot hide. With measure_links (recipe.overlap_measure_links) it also needs its rings, forward and
# backward, to be expected to beat the plain path on the group's measured links (LinkSpeed.ring_saving_ms).
# Forward decides; the backward GEMMs of the same layer have the same size per ring step and follow the
# forward's choice. Every input of the choice is the same on all ranks, and so is the path.

def ring_step_gflops(rows_per_step: int, out_features: int, in_features: int) -> float:
    """GFLOP of one ring step's GEMM: [rows_per_step, in_features] x [in_features, out_features]."""
    return 2.0 * rows_per_step * out_features * in_features / 1e9


_CANDIDATES = {"auto": ("ring", "collectives"), "ring": ("ring",), "collectives": ("collectives",)}
# A pipelined path is taken only where it is expected to save this share of the plain path's time: the model
# leaves out what pipelining costs (the ring's or the pieces' extra launches and collective latencies, GEMMs cut
# into smaller ones, transfers slowed beside the GEMMs), which a smaller saving may not cover (docs/slow_links.md).
MIN_SAVING_SHARE = 0.15


class _RingChoice:
    """Which path an overlapped comm takes, decided in forward by choose() and followed by its backward: the plain
    path unless sequence parallel over more than one rank with pipelined steps of at least min_chunk_gflops; then,
    among the paths `transport` allows ("auto": the ring and split collectives, the latter not where the ring runs
    on copy engines; "ring"; "collectives"), with measure_links the one expected to save most on the group's
    links (only where it saves MIN_SAVING_SHARE of the plain path's time), or the plain path where none does;
    without, the first allowed."""

    min_chunk_gflops: float = 0
    measure_links: bool = False
    transport: str = "ring"
    path: str = "ring"  # "plain", "ring" or "collectives": the last forward's path
    piece_ratios: dict = {}  # split collectives: LinkSpeed.split_piece_ratio of each ring kind, none for equal pieces

    @property
    def pipelined(self) -> bool:
        """Whether the last forward went round the ring or on split collectives (its backward does too)."""
        return self.path != "plain"

    def overlaps(self) -> bool:
        return self.sequence_parallel and self.world_size > 1

    def choose(self, step_gflops: float, loads: Sequence[RingLoad], pieces: int, device: torch.device) -> str:
        """Decide this forward's path from one ring step's GEMM size, the rings (forward and backward) it runs and
        the row pieces its split collectives would have."""
        candidates = _CANDIDATES[self.transport]
        path = candidates[0] if self.overlaps() and step_gflops >= self.min_chunk_gflops else "plain"
        if path != "plain" and self.measure_links:
            speed = group_link_speed(self.group, device)
            if speed is not None:
                savings = {}
                if "ring" in candidates:
                    savings["ring"] = speed.ring_saving_ms(loads, self.world_size)
                if "collectives" in candidates and not (self.transport == "auto" and
                                                        _ring_on_copy_engines(self.group, device)):
                    savings["collectives"] = speed.split_saving_ms(loads, self.world_size, pieces)
                best = max(savings, key=savings.get)  # a tie keeps the ring
                enough = MIN_SAVING_SHARE * speed.plain_ms(loads, self.world_size)
                path = best if savings[best] > 0 and savings[best] >= enough else "plain"
                if path != getattr(self, "_logged_path", None):  # once per change, not at every step
                    self._logged_path = path
                    log.info("overlap: a %s of the %d-rank group takes the %s path (expected ms saved over the "
                             "plain path: %s)", type(self).__name__, self.world_size, path,
                             ", ".join(f"{name} {ms:.3g}" for name, ms in savings.items()))
        self.path = path
        self.piece_ratios = self._piece_ratios(loads) if path == "collectives" else {}
        return path

    def _piece_ratios(self, loads: Sequence[RingLoad]) -> dict:
        """How the split collectives of `loads` size their pieces where the group's link speed is known (measured
        for measure_links, or set_link_speed's); equal pieces where it is not."""
        speed = known_link_speed(self.group)
        return {} if speed is None else {load.kind: speed.split_piece_ratio(load, self.world_size) for load in loads}

    def split_pieces(self, kind: str, rows: int) -> list:
        """Row counts of the pieces that this layer's split collectives of `kind` cut `rows` rows into."""
        return split_pieces(rows, self.piece_ratios.get(kind, 1.0))

    def pipelines(self) -> bool:
        return self.overlaps() and self.pipelined

    def gathered_gemm(self, a: NVFP4Tensor, b: NVFP4Tensor, **kwargs) -> torch.Tensor:
        """gemm(all-gather of a, b) on this forward's pipelined path."""
        if self.path == "collectives":
            return split_gathered_gemm(a, b, group=self.group, pieces=self.split_pieces("all_gather", a.rows),
                                       **kwargs)
        return ring_gathered_gemm(a, b, group=self.group, **kwargs)

    def gemm_reduce_scatter(self, a: NVFP4Tensor, b: NVFP4Tensor, **kwargs) -> torch.Tensor:
        """Reduce-scatter of gemm(a, b) on this forward's pipelined path."""
        if self.path == "collectives":
            rows = a.rows // self.world_size  # not a whole number: split_gemm_reduce_scatter says so
            pieces = self.split_pieces("reduce_scatter", rows) if a.rows % self.world_size == 0 else None
            return split_gemm_reduce_scatter(a, b, group=self.group, pieces=pieces, **kwargs)
        return ring_gemm_reduce_scatter(a, b, group=self.group, **kwargs)


def _ring_on_copy_engines(group, device: torch.device) -> bool:
    """Whether the group's rings on `device` run on copy engines (parallel/symmetric.py), the NVLink path."""
    return device.type == "cuda" and symmetric.enabled(group)


# ----------------------------------------------------------------------------------------------------------
# Early re-gathers of column-parallel inputs.

def _tensor_key(saved: NVFP4Tensor) -> tuple:
    """What identifies a saved NVFP4Tensor from forward to backward: its first storage tensor's address."""
    tensor = saved.device_tensor()
    return tensor.device, tensor.data_ptr()


class _SavedInput:
    """A column-parallel layer's saved input (this rank's columnwise copy), held weakly, and its gather once started."""

    def __init__(self, saved: NVFP4Tensor):
        self.key = _tensor_key(saved)
        self.metadata = saved.metadata()
        self.refs = tuple(None if t is None else weakref.ref(t) for t in saved.tensors())
        self.finish: Callable[[], NVFP4Tensor] | None = None

    def tensor(self) -> NVFP4Tensor | None:
        """The saved input, or None once any of its storage was freed."""
        tensors = tuple(None if ref is None else ref() for ref in self.refs)
        if any(ref is not None and t is None for ref, t in zip(self.refs, tensors)):
            return None
        return self.metadata.with_tensors(tensors)


class InputRegathers:
    """The all-gathers of one group's column-parallel inputs that the following row-parallel layer starts early.

    A column-parallel layer (not keep_input_columnwise) gathers its input's columnwise copy again in backward for
    its wgrad GEMM. Its backward comes right after that of the row-parallel layer that followed it in forward,
    whose wgrad GEMM has no transfer to hide. So: in forward the column layer announces its saved input and the
    next row layer of the group claims the newest announcement; in backward that row layer starts the gather
    right before its wgrad GEMM and the column layer takes it (the same collective on the same bytes, issued
    earlier). Entries are keyed by the saved tensors and dropped when those are freed: nothing outlives the graph.
    """

    def __init__(self, group):
        self.group = group
        self.announced: dict = {}  # column layers' saved inputs not claimed yet, oldest first
        self.claimed: dict = {}    # a row layer's saved input -> the column layer's saved input it gathers
        self.started: dict = {}    # a column layer's saved input -> its gather in flight

    def announce(self, column_input: NVFP4Tensor) -> None:
        entry = _SavedInput(column_input)
        self.announced[entry.key] = entry
        weakref.finalize(column_input.device_tensor(), self._forget, entry.key)

    def claim(self, row_input: NVFP4Tensor) -> None:
        """Bind the newest announcement to this row layer's saved input; older ones cannot directly precede it."""
        try:
            _, newest = self.announced.popitem()  # the newest (dicts pop last in, first out)
        except KeyError:
            return
        self.announced.clear()
        key = _tensor_key(row_input)
        self.claimed[key] = newest
        weakref.finalize(row_input.device_tensor(), self.claimed.pop, key, None)

    def take_claim(self, row_input: NVFP4Tensor) -> _SavedInput | None:
        return self.claimed.pop(_tensor_key(row_input), None)

    def start(self, entry: _SavedInput) -> None:
        """Start the asynchronous all-gather of a claimed column input (a collective: every rank starts it)."""
        column_input = entry.tensor()
        if column_input is None:
            return
        entry.finish = collectives.all_gather_nvfp4(column_input, self.group, async_op=True)[1]
        self.started[entry.key] = entry

    def take_started(self, column_input: NVFP4Tensor) -> Callable[[], NVFP4Tensor] | None:
        """The finish() of this column input's gather when a row layer started it, else None."""
        key = _tensor_key(column_input)
        self.announced.pop(key, None)
        entry = self.started.pop(key, None)
        return None if entry is None else entry.finish

    def _forget(self, key) -> None:
        self.announced.pop(key, None)
        self.started.pop(key, None)


_input_regathers: dict = {}


def input_regathers(group) -> InputRegathers:
    """The group's InputRegathers (one per group object)."""
    if group not in _input_regathers:
        _input_regathers[group] = InputRegathers(group)
    return _input_regathers[group]


# ----------------------------------------------------------------------------------------------------------

class OverlappedColumnParallelComm(_RingChoice, ColumnParallelComm):
    """ColumnParallelComm with the input all-gather pipelined into fprop and dgrad into the reduce-scatter.

    keep_input_columnwise: the input's columnwise copy rides the fprop ring. Otherwise backward re-gathers
    it with an asynchronous all-gather, started by the following row-parallel layer's backward
    (InputRegathers), else before the dgrad GEMM (ColumnParallelComm.input_for_wgrad). The wgrad GEMM runs
    during the dgrad ring's last transfer.
    """

    def __init__(self, group, sequence_parallel: bool, keep_input_columnwise: bool, min_chunk_gflops: float = 0,
                 measure_links: bool = False, transport: str = "ring"):
        super().__init__(group, sequence_parallel, keep_input_columnwise)
        _configure(self, min_chunk_gflops, measure_links, transport)
        self.input_carry: ColumnwiseCarry | None = None

    def quantize_input(self, x2d, recipe, *, columnwise):
        return self.carry_input(super().quantize_input(x2d, recipe, columnwise=columnwise))

    def carry_input(self, xq):
        """Set up the ring carry of the quantized input's columnwise copy (keep_input_columnwise); returns xq."""
        kept = self.overlaps() and self.keep_input_columnwise and xq.has_columnwise
        self.input_carry = ColumnwiseCarry(xq.columnwise_only(), self.group) if kept else None
        return xq

    def fprop(self, xq, wq, *, bias, out_dtype, recipe):
        rows, out_features, in_features = xq.rows, wq.rows, xq.cols
        step_gflops = ring_step_gflops(rows, out_features, in_features)
        copies = 1 if self.input_carry is None else 2  # a kept columnwise copy rides the same ring
        loads = [RingLoad("all_gather", copies * nvfp4_bytes(rows, in_features), step_gflops),
                 # backward: the dgrad partials, reduce-scattered on the ring
                 RingLoad("reduce_scatter", rows * in_features * out_dtype.itemsize, step_gflops)]
        if self.choose(step_gflops, loads, collective_pieces(rows), xq.device) == "plain":
            return super().fprop(xq, wq, bias=bias, out_dtype=out_dtype, recipe=recipe)  # carry.finish() gathers
        return self.gathered_gemm(xq, wq, b_copy="rowwise", out_dtype=out_dtype, bias=bias, recipe=recipe,
                                  carry=self.input_carry)

    def _regathers_input(self) -> bool:
        return self.overlaps() and not self.keep_input_columnwise

    def input_to_save(self, xq):
        carry, self.input_carry = self.input_carry, None
        if carry is not None and carry.local.columnwise_data is xq.columnwise_data:
            return carry.finish()
        saved = super().input_to_save(xq)
        if self._regathers_input() and saved.has_columnwise:
            input_regathers(self.group).announce(saved)
        return saved

    def input_for_wgrad(self, saved_input):
        started = input_regathers(self.group).take_started(saved_input) if self._regathers_input() else None
        return started or super().input_for_wgrad(saved_input)

    def dgrad(self, dyq, wq, *, out_dtype, recipe):
        if not self.pipelines():
            return super().dgrad(dyq, wq, out_dtype=out_dtype, recipe=recipe)
        return self.gemm_reduce_scatter(dyq, wq, b_copy="columnwise", out_dtype=out_dtype, recipe=recipe)

    def dgrad_and_wgrad(self, dyq, wq, *, out_dtype, recipe, wgrad_step):
        if not self.pipelines():
            return super().dgrad_and_wgrad(dyq, wq, out_dtype=out_dtype, recipe=recipe, wgrad_step=wgrad_step)
        return self.gemm_reduce_scatter(dyq, wq, b_copy="columnwise", out_dtype=out_dtype, recipe=recipe,
                                        during_last_transfer=wgrad_step)


class OverlappedRowParallelComm(_RingChoice, RowParallelComm):
    """RowParallelComm with fprop pipelined into the reduce-scatter and the gradient all-gather into dgrad.

    The output gradient's columnwise copy (wgrad) rides the dgrad ring; without a dgrad it is gathered
    when the wgrad GEMM asks for it. Right before its wgrad GEMM, backward starts the re-gather of the
    column-parallel input that preceded this layer in forward (InputRegathers).
    """

    def __init__(self, group, sequence_parallel: bool, min_chunk_gflops: float = 0, measure_links: bool = False,
                 transport: str = "ring"):
        super().__init__(group, sequence_parallel)
        _configure(self, min_chunk_gflops, measure_links, transport)
        self.grad_output_carry: ColumnwiseCarry | None = None
        self.next_regather: _SavedInput | None = None

    def fprop(self, xq, wq, *, bias, out_dtype, recipe):
        rows, out_features, in_features = xq.rows // self.world_size, wq.rows, xq.cols
        step_gflops = ring_step_gflops(rows, out_features, in_features)
        loads = [RingLoad("reduce_scatter", rows * out_features * out_dtype.itemsize, step_gflops),
                 # backward: the output gradient's two copies, gathered on the ring
                 RingLoad("all_gather", 2 * nvfp4_bytes(rows, out_features), step_gflops)]
        if self.choose(step_gflops, loads, collective_pieces(rows), xq.device) == "plain":
            return super().fprop(xq, wq, bias=bias, out_dtype=out_dtype, recipe=recipe)
        return self.gemm_reduce_scatter(xq, wq, b_copy="rowwise", out_dtype=out_dtype, bias=bias, recipe=recipe)

    def input_to_save(self, xq):
        if self.overlaps() and xq.has_columnwise:
            input_regathers(self.group).claim(xq)
        return super().input_to_save(xq)

    def input_for_wgrad(self, saved_input):
        self.next_regather = input_regathers(self.group).take_claim(saved_input) if self.overlaps() else None
        return super().input_for_wgrad(saved_input)

    def quantize_grad_output(self, dy2d, recipe, *, sr_seed, rowwise, columnwise):
        self.grad_output_carry = None  # a new backward: nothing left to carry from an earlier one
        return super().quantize_grad_output(dy2d, recipe, sr_seed=sr_seed, rowwise=rowwise, columnwise=columnwise)

    def grad_output_for_wgrad(self, dyq):
        if not self.pipelines():
            return super().grad_output_for_wgrad(dyq)
        self.grad_output_carry = ColumnwiseCarry(dyq, self.group)
        return self.grad_output_carry.finish

    def dgrad(self, dyq, wq, *, out_dtype, recipe):
        if not self.pipelines():
            return super().dgrad(dyq, wq, out_dtype=out_dtype, recipe=recipe)
        carry, self.grad_output_carry = self.grad_output_carry, None
        return self.gathered_gemm(dyq, wq, b_copy="columnwise", out_dtype=out_dtype, recipe=recipe, carry=carry)

    def dgrad_and_wgrad(self, dyq, wq, *, out_dtype, recipe, wgrad_step):
        dx = self.dgrad(dyq, wq, out_dtype=out_dtype, recipe=recipe)
        regather, self.next_regather = self.next_regather, None
        if regather is not None:
            input_regathers(self.group).start(regather)  # in flight during the wgrad GEMM below
        wgrad_step()
        return dx


def _configure(comm, min_chunk_gflops: float, measure_links: bool, transport: str) -> None:
    if min_chunk_gflops < 0:
        raise ValueError(f"min_chunk_gflops={min_chunk_gflops}: must be >= 0")
    if not isinstance(measure_links, bool):
        raise ValueError(f"measure_links={measure_links!r}: must be True or False")
    if transport not in OVERLAP_TRANSPORTS:
        raise ValueError(f"transport={transport!r}: allowed are {OVERLAP_TRANSPORTS}")
    comm.min_chunk_gflops, comm.measure_links, comm.transport = min_chunk_gflops, measure_links, transport
    if comm.path not in ("plain", *_CANDIDATES[transport]):  # else the last forward's path stands for its backward
        comm.path = _CANDIDATES[transport][0]


def overlapped_comm(comm: LinearComm, min_chunk_gflops: float = 0, measure_links: bool = False,
                    transport: str = "ring") -> LinearComm:
    """The overlapped twin of a layer's ColumnParallelComm / RowParallelComm (same group and options), pipelining
    steps of at least min_chunk_gflops, on the paths `transport` allows ("auto", "ring", "collectives": see
    _RingChoice) and, with measure_links, only where one is expected to win on the group's measured links (an
    overlapped comm given here gets these settings)."""
    if isinstance(comm, (OverlappedColumnParallelComm, OverlappedRowParallelComm)):
        _configure(comm, min_chunk_gflops, measure_links, transport)
        return comm
    if isinstance(comm, ColumnParallelComm):
        return OverlappedColumnParallelComm(comm.group, comm.sequence_parallel, comm.keep_input_columnwise,
                                            min_chunk_gflops, measure_links, transport)
    if isinstance(comm, RowParallelComm):
        return OverlappedRowParallelComm(comm.group, comm.sequence_parallel, min_chunk_gflops, measure_links,
                                         transport)
    raise ValueError(f"comm={type(comm).__name__}: overlap applies to ColumnParallelComm and RowParallelComm")

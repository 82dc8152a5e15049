"""How fast a tensor-parallel group moves bytes and runs GEMMs, and which overlap path beats a layer's plain path.

The overlap (parallel/overlap.py) replaces a collective followed by a GEMM (or a GEMM followed by a
collective) with W ring steps, each moving one rank's chunk while one chunk's GEMM runs. Per step, with c the
collective's time for one chunk's bytes, r the ring's point-to-point time for the same bytes and g one chunk's
GEMM time:

    plain  (W-1) c + W g          ring  g + (W-1) max(r, g)          saving = (W-1) (c + g - max(r, g))

The ring wins wherever its transfers hide behind the GEMMs (r <= g: it saves the whole collective) and, where
they do not, only while g > (r - c): on links where point-to-point transfers run much slower than the
collective (NCCL's socket transport: r = 1.6 c) and the GEMMs are small against the transfers, the plain path
is faster than the ring.
Split collectives (the plain path's collective cut into k row pieces, parallel/overlap.py) move the same bytes
at the collective's speed, and each piece's GEMMs run while later pieces travel. With C = (W-1) c and G = W g,
one piece's transfer or GEMMs stay in the open:

    split  max(C, G) + min(C, G) / k                                  saving = (k-1)/k min(C, G)

with k equal pieces. Where a reduce-scatter's transfers outlast its GEMMs the layers grow its pieces geometrically
(LinkSpeed.split_piece_ratio), so that the piece left in the open is small; the choice of path counts equal pieces.

LinkSpeed holds c, r (per MB of a ring step, for all-gathers and reduce-scatters) and g (per GFLOP), measured
once per group (parallel/overlap.py: measure_link_speed) and agreed over the ranks, so that every rank takes
the same path.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import torch
import torch.distributed as dist

log = logging.getLogger("nvfp4_dist")

RING_KINDS = ("all_gather", "reduce_scatter")
NVFP4_BYTES_PER_ELEMENT = 9 / 16  # 4-bit code + one E4M3 scale per 16 elements


def nvfp4_bytes(rows: int, cols: int) -> int:
    """Bytes of one NVFP4 copy (packed codes and block scales) of a [rows, cols] tensor."""
    return rows * cols // 2 + rows * cols // 16


@dataclasses.dataclass(frozen=True)
class RingLoad:
    """One ring of a layer: its kind, the bytes each rank passes on per step, one step's GEMM GFLOP."""

    kind: str
    step_bytes: int
    step_gflops: float

    def __post_init__(self):
        if self.kind not in RING_KINDS:
            raise ValueError(f"kind={self.kind!r}: allowed are {RING_KINDS}")
        if self.step_bytes < 0 or self.step_gflops < 0:
            raise ValueError(f"step_bytes={self.step_bytes}, step_gflops={self.step_gflops}: must be >= 0")


@dataclasses.dataclass(frozen=True)
class LinkSpeed:
    """A group's measured speeds: ms per MB (2^20 bytes) of one ring step's transfer, through the plain path's
    collective and through the ring, for each ring kind; and ms per GFLOP of the NVFP4 GEMM."""

    all_gather_ms_per_mb: float
    ring_all_gather_ms_per_mb: float
    reduce_scatter_ms_per_mb: float
    ring_reduce_scatter_ms_per_mb: float
    gemm_ms_per_gflop: float

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{field.name}={value!r}: must be a positive finite number")

    def step_ms(self, load: RingLoad) -> tuple:
        """(collective, ring, GEMM) ms of one ring step of `load`."""
        mb = load.step_bytes / 2 ** 20
        collective = getattr(self, f"{load.kind}_ms_per_mb")
        ring = getattr(self, f"ring_{load.kind}_ms_per_mb")
        return collective * mb, ring * mb, self.gemm_ms_per_gflop * load.step_gflops

    def ring_saving_ms(self, loads: Sequence[RingLoad], world_size: int) -> float:
        """Expected ms the rings of `loads` save over the plain path on `world_size` ranks (negative: they lose)."""
        saving = 0.0
        for load in loads:
            collective, ring, gemm = self.step_ms(load)
            saving += (world_size - 1) * (collective + gemm - max(ring, gemm))
        return saving

    def plain_ms(self, loads: Sequence[RingLoad], world_size: int) -> float:
        """Expected ms of the plain path (whole collective, whole GEMM) for `loads` on `world_size` ranks."""
        return sum((world_size - 1) * collective + world_size * gemm
                   for collective, _, gemm in map(self.step_ms, loads))

    def split_piece_ratio(self, load: RingLoad, world_size: int) -> float:
        """How split collectives of `load` size their row pieces: piece j+1 = ratio x piece j (piece_fractions).

        A reduce-scatter whose transfers outlast its GEMMs leaves its first piece's GEMMs in the open: where they
        do by at least SIZED_PIECES_MIN_SHARE (C >= 2 G), its pieces grow SIZED_PIECES_RATIO times from piece to
        piece, so that each transfer still covers about the next piece's GEMMs. Everywhere else (all-gathers,
        whose last piece's GEMMs run beside the carried columnwise copy or a transfer of about their length, and
        reduce-scatters closer to their GEMMs) the pieces stay equal (1): sized pieces measured no faster there
        (docs/slow_links.md)."""
        if load.kind == "all_gather":
            return 1.0
        collective, _, gemm = self.step_ms(load)
        comm_bound = (world_size - 1) * collective >= SIZED_PIECES_MIN_SHARE * world_size * gemm
        return SIZED_PIECES_RATIO if comm_bound else 1.0

    def split_saving_ms(self, loads: Sequence[RingLoad], world_size: int, pieces: int) -> float:
        """Expected ms that split collectives of `pieces` row pieces save over the plain path for `loads`, counted
        with equal pieces: the layers size theirs by split_piece_ratio, which leaves a smaller end in the open."""
        saving = 0.0
        for load in loads:
            collective, _, gemm = self.step_ms(load)
            saving += (pieces - 1) / pieces * min((world_size - 1) * collective, world_size * gemm)
        return saving

    def agreed(self, group=None) -> LinkSpeed:
        """The group's common view: the slowest rank's ring transfers (MAX), the fastest rank's collectives and
        GEMMs (MIN), so the ring is chosen only where it wins on every rank. The same on all ranks."""
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return self
        names = [field.name for field in dataclasses.fields(self)]
        ring = [name.startswith("ring_") for name in names]
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        values = torch.tensor([getattr(self, n) if r else -getattr(self, n) for n, r in zip(names, ring)],
                              dtype=torch.float64, device=device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
        return LinkSpeed(**{n: (v if r else -v) for n, r, v in zip(names, ring, values.tolist())})

    def describe(self) -> str:
        return (f"all-gather {self.all_gather_ms_per_mb:.4f} ms/MB (ring {self.ring_all_gather_ms_per_mb:.4f}), "
                f"reduce-scatter {self.reduce_scatter_ms_per_mb:.4f} ms/MB (ring "
                f"{self.ring_reduce_scatter_ms_per_mb:.4f}), GEMM {self.gemm_ms_per_gflop:.4f} ms/GFLOP")


# A comm-bound reduce-scatter's pieces grow this many times from piece to piece (the MLP pair of
# benchmarks/overlap.py over slow links, C about 3.4 G: ratios 2, 2.5, 3 and 4 ran 0 %, 0 %, 3.4 % and 1.1 % faster
# than equal pieces, docs/slow_links.md), where its transfers take at least SIZED_PIECES_MIN_SHARE times its GEMMs.
SIZED_PIECES_RATIO = 3.0
SIZED_PIECES_MIN_SHARE = 2.0


def piece_fractions(pieces: int, ratio: float) -> list:
    """The shares of `pieces` consecutive pieces in geometric proportion: piece j+1 = ratio x piece j."""
    if pieces < 1 or not ratio > 0:
        raise ValueError(f"pieces={pieces}, ratio={ratio}: need pieces >= 1 and ratio > 0")
    weights = [ratio ** j for j in range(pieces)]
    return [weight / sum(weights) for weight in weights]


_speeds: dict = {}


def _key(group):
    """The group object (the current default group for None)."""
    return dist.group.WORLD if group is None else group


def known_link_speed(group=None) -> LinkSpeed | None:
    """The group's link speed, if measured (or set) already."""
    return _speeds.get(_key(group))


def set_link_speed(group, speed: LinkSpeed | None) -> None:
    """Use `speed` for the group from now on instead of measuring it (None: measure again at the next use).

    Every rank of the group must set the same value (the choice of path must agree across ranks)."""
    if speed is not None and not isinstance(speed, LinkSpeed):
        raise ValueError(f"speed must be a LinkSpeed or None, got {type(speed).__name__}")
    if speed is None:
        _speeds.pop(_key(group), None)
    else:
        _speeds[_key(group)] = speed
